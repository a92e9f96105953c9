"""The run session: checkpoints tagged and pruned, one timing rule, the logger's output, and
its run control (the stop request, the phase, the launch, the ending)."""

import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest
import torch

from m2flow.pipelines import Worker
from m2flow.runs import checkpoint
from m2flow.runs.config import ClusterGroupConfig, RunnerBaseConfig
from m2flow.runs.logger import RunLogger, log_field
from m2flow.pipelines.futures import Stopped
from m2flow.runs.control import RunControl, launch
from m2flow.runs.session import RunSession


@dataclass
class Root:
    cluster: ClusterGroupConfig = field(default_factory=lambda: ClusterGroupConfig(backend="local"))
    runner: RunnerBaseConfig = field(default_factory=RunnerBaseConfig)
    run_name: str = "t"
    seed: int = 0


def session(tmp_path, keep=3, workload="embodied", control=None):
    cfg = Root(runner=RunnerBaseConfig(log_dir=str(tmp_path), keep_checkpoints=keep,
                                       progress_bar=False))
    s = RunSession(cfg, workload=workload, control=control)
    s.open_run(10, 0, []).close()
    return s


def test_keeps_the_newest_checkpoints_and_last_points_at_the_newest(tmp_path):
    s = session(tmp_path, keep=3)
    for it in range(1, 8):
        s.save(it, {"learner": {"w": torch.full((2,), float(it))}})
    folder = s.run_dir / "checkpoints"
    assert sorted(p.name for p in folder.glob("iter_*.pt")) == [
        "iter_00005.pt", "iter_00006.pt", "iter_00007.pt"]
    last = checkpoint.load(folder / "last.pt", workload="embodied")
    assert last["iteration"] == 7 and last["learner"]["w"].tolist() == [7.0, 7.0]
    assert s.last_checkpoint == folder / "iter_00007.pt"
    s.close()


def test_keep_zero_keeps_all(tmp_path):
    s = session(tmp_path, keep=0)
    for it in range(4):
        s.save(it, {"learner": {}})
    assert len(list((s.run_dir / "checkpoints").glob("iter_*.pt"))) == 4
    s.close()


def test_checkpoints_carry_their_workload_and_refuse_another(tmp_path):
    s = session(tmp_path, workload="reasoning")
    path = s.save(1, {"learner": {}}, prefix="step")
    assert torch.load(path, weights_only=False)["workload"] == "reasoning"
    with pytest.raises(checkpoint.CheckpointError, match="written by a reasoning run"):
        checkpoint.load(path, workload="embodied")
    s.close()


@pytest.mark.parametrize("content", [b"not a checkpoint\n", None])
def test_a_file_that_is_not_a_checkpoint_is_one_line(tmp_path, content):
    path = tmp_path / "x.pt"
    if content is None:
        torch.save({"weights": torch.zeros(2)}, path)  # a torch file, not m2flow's
    else:
        path.write_bytes(content)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(path, workload="embodied")
    assert "\n" not in str(e.value) and str(path) in str(e.value)


class Phases(Worker):
    def record(self, seconds: float) -> None:
        self.timer.add("sim", seconds * (self.rank + 1))
        if self.rank == 0:
            self.timer.add("send", seconds)


def test_timings_are_the_slowest_rank_per_phase(tmp_path):
    s = session(tmp_path)
    g = s.group("env", Phases)  # placement gives "env" one rank by default
    g2 = s.group("rollout", Phases)
    g.call(Phases.record, 0.5).wait()
    g2.call(Phases.record, 0.25).wait()
    assert s.timings() == {"time/env_sim": 0.5, "time/env_send": 0.5,
                           "time/rollout_sim": 0.25, "time/rollout_send": 0.25}
    assert s.timings() == {}  # popped
    s.close()


def test_log_line_fields_come_from_the_workload_and_no_bar_frames_off_a_terminal(tmp_path, capsys):
    logger = RunLogger(tmp_path, 2, bar=True, fields=[log_field("ret {:.1f}", "a/ret")],
                       bar_fields=[log_field("acc={:.2f}", "e/acc", sticky=True)])
    logger.log(0, 10, {"a/ret": 1.25, "time/env_sim": 0.5})
    logger.log(1, 20, {"b/other": 3.0})
    logger.close()
    out = capsys.readouterr()
    assert "it    0 | steps       10 | ret 1.2 | slowest env_sim 0.50s" in out.out
    assert "it    1 | steps       20" in out.out and "ret" not in out.out.splitlines()[1]
    assert "\r" not in out.out + out.err  # pytest's capture is not a terminal: no bar frames


def test_the_watched_line_fits_160_columns_and_train_log_keeps_every_phase(tmp_path, capsys):
    """The embodied line at its widest (every field present, large values, every phase a
    ManiSkill run under Ray reports): within 160 columns on stdout; train.log's line has the
    detail fields and every phase's seconds."""
    from m2flow.embodied.runner import LOG_FIELDS
    from m2flow.runs.logger import MAX_LINE

    phases = ("env_sim", "env_wait", "env_send", "rollout_weight_sync", "rollout_infer",
              "rollout_wait", "rollout_send", "learner_learn", "learner_wait",
              "driver_learn_wait", "driver_weight_sync", "eval")
    m = {"perf/env_steps_per_s": 123456.0, "env/return": -12345.678, "env/success_once": 1.0,
         "env/success_at_end": 1.0, "eval/success_once": 1.0, "eval/success_at_end": 1.0,
         "eval/return": -12345.678, "loss/approx_kl": 12.3456, "loss/loss_value": 12345.6789,
         "perf/learn_overlapped_s": 12.5, "perf/iteration_s": 40.0,
         **{f"time/{p}": 10.0 + i for i, p in enumerate(phases)}}
    logger = RunLogger(tmp_path, 1, bar=False, fields=LOG_FIELDS)
    logger.log(12345, 123456789, m)
    logger.close()
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("it "))
    assert len(line) <= MAX_LINE, (len(line), line)
    # the slowest working phase (waits are idle time): the evaluation's 21 s of the
    # iteration's 40 s and its own
    assert line.endswith("| slowest eval 34%") and "kl 12.3456 | vloss 12345.6789" in line
    assert "eval_return" not in line and "env_wait" not in line
    logged = (tmp_path / "train.log").read_text()
    assert "eval_return -12345.68" in logged and "learn_beside_collect 12.50s" in logged
    assert all(f"{p} " in logged for p in phases)


def test_ctrl_c_first_asks_to_stop_then_interrupts_then_is_ignored_while_ending(tmp_path):
    control = RunControl()
    restore = control.handle_signals()
    try:
        signal.raise_signal(signal.SIGINT)  # the handler runs before this returns
        assert control.stop_requested and control.exit_code() == 130
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        restore()
        control = RunControl()  # a new command
        restore = control.handle_signals()
        assert not control.stop_requested
        signal.raise_signal(signal.SIGINT)
        s = session(tmp_path, control=control)
        s.close()  # ending the workers: a second Ctrl-C must not cut that short
        signal.raise_signal(signal.SIGINT)
    finally:
        restore()


def test_sigterm_stops_as_a_first_ctrl_c_and_its_exit_code_says_so():
    control = RunControl()
    restore = control.handle_signals()
    try:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # however often it comes
        assert control.stop_requested and control.exit_code() == 143
    finally:
        restore()


def test_two_sessions_in_one_process_do_not_see_each_others_stop(tmp_path):
    a, b = session(tmp_path / "a"), session(tmp_path / "b")
    try:
        ga, gb = a.group("env", Phases), b.group("env", Phases)
        a.control.request_stop()
        with pytest.raises(Stopped, match=r"env\.record\(\)"):
            ga.call(Phases.record, 0.1).wait()
        assert not b.control.stop_requested
        assert gb.call(Phases.record, 0.1).wait(timeout=10) == [None]
    finally:
        a.close()
        b.close()


def test_a_stop_before_the_loop_names_the_phase_and_stands_for_the_next_run(tmp_path):
    """Ctrl-C while a run starts (before its loop): the start-up of its next group stops, and
    the line the command prints names the control's phase; a sweep's next job under the same
    control starts in start-up, still stopped."""
    control = RunControl()
    s = session(tmp_path, control=control)
    try:
        s.phase = "warm start"
        control.request_stop(signal.SIGINT)
        with pytest.raises(Stopped, match="env start-up"):
            s.group("env", Phases)
        assert control.phase == "warm start" and control.stop_signal == signal.SIGINT
    finally:
        s.close()
    assert control.ending  # past the stop decision: a second Ctrl-C is not an interrupt now
    s2 = session(tmp_path, control=control)
    try:
        assert s2.phase == "start-up" and not control.ending and control.stop_requested
        with pytest.raises(Stopped):
            s2.group("env", Phases)
    finally:
        s2.close()


def test_checkpoints_keep_the_launch_of_their_control_and_a_pickled_control_starts_afresh(
        tmp_path):
    control = RunControl(launch("gym_pendulum_ppo_mlp", ["seed=2"]))
    s = session(tmp_path, control=control)
    path = s.save(1, {"learner": {}})
    assert checkpoint.load(path)["launch"] == {"config_name": "gym_pendulum_ppo_mlp",
                                               "overrides": ["seed=2"]}
    s.close()
    bare = session(tmp_path / "bare")
    assert "launch" not in checkpoint.load(bare.save(1, {"learner": {}}))
    bare.close()
    control.request_stop(signal.SIGTERM)
    copy = pickle.loads(pickle.dumps(control))  # a sweep job sent to another process
    assert copy.launch == control.launch and not copy.stop_requested
    assert copy.phase == "start-up" and copy.stop_signal is None


def test_a_stop_saves_the_last_iteration_only_when_the_learner_is_idle(tmp_path):
    s = session(tmp_path)
    saved = []

    def stop(exc, iteration, start=0):
        return s.stopped(exc, iteration, start=start, save=lambda: saved.append(
            s.save(iteration, {"learner": {}})))

    assert stop(Stopped(["learner.update()", "env.collect()"]), 3).checkpoint is None
    assert stop(KeyboardInterrupt(), 3).checkpoint is None  # a second Ctrl-C: no save
    assert stop(Stopped(["env.collect()"]), 3, start=3).checkpoint is None  # nothing new
    line = stop(Stopped(["env.eval_episodes()", "rollout.serve()"]), 3).describe(
        lambda ckpt: f"m2flow-train resume={ckpt}")
    assert len(saved) == 1 and checkpoint.load(saved[0])["iteration"] == 3
    assert line == (f"interrupted during start-up after 3 iterations; checkpoint {saved[0]}; "
                    f"resume with: m2flow-train resume={saved[0]}")
    stop(Stopped(["env.collect()"]), 3)
    assert len(saved) == 1  # iteration 3 has its checkpoint already
    s.close()


def test_ctrl_c_ends_a_run_with_one_line_naming_the_last_checkpoint(tmp_path):
    """A real run of the CLI (in-process workers, a gymnasium env) interrupted by SIGINT."""
    cmd = [sys.executable, "-c", "import sys; from m2flow.cli.train import main as train; sys.exit(train())",
           "env=gym_pendulum", "cluster=inprocess", "env.num_envs=2", "runner.rollout_steps=8",
           "runner.num_iterations=100000", "runner.checkpoint_interval=1",
           "runner.eval_interval=0", f"runner.log_dir={tmp_path}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while (not list(tmp_path.rglob("iter_00002.pt")) and proc.poll() is None
           and time.monotonic() < deadline):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    lines = [l for l in err.splitlines() if l.strip()]
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert lines[-1].startswith("m2flow-train: interrupted during "), lines[-1]
    saved = lines[-1].split("; checkpoint ")[1].split(";")[0]
    assert saved.endswith(".pt") and checkpoint.load(saved)["iteration"] >= 2
    assert lines[-1].endswith(f" resume={saved}")


def test_a_failure_is_one_line_and_its_traceback_goes_to_the_runs_log(tmp_path):
    from m2flow.pipelines.errors import mark_raised_by

    s = session(tmp_path)
    ckpt = s.save(2, {"learner": {}})
    s.phase = "learning"
    try:
        raise ZeroDivisionError("division by zero in the loss")
    except ZeroDivisionError as e:
        mark_raised_by(e, "worker learner[rank 0] in update()")
        failed = s.failed(e, 3)
    log = s.run_dir / "train.log"
    assert failed.describe(lambda c: f"m2flow-train resume={c}") == (
        "failed during learning after 3 iterations: worker learner[rank 0] in update(): "
        f"ZeroDivisionError: division by zero in the loss (traceback in {log}); checkpoint "
        f"{ckpt}; resume with: m2flow-train resume={ckpt}")
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "in test_a_failure_is_one" in text
    assert isinstance(failed, RuntimeError)  # not an interruption: a sweep goes on
    s.close()


def test_a_failure_before_the_run_opened_gets_a_run_dir_for_its_traceback(tmp_path):
    from m2flow.runs.failure import run_failed

    cfg = Root(runner=RunnerBaseConfig(log_dir=str(tmp_path), progress_bar=False))
    failed = run_failed(KeyError("obs"), cfg, phase="start-up")
    assert failed.describe() == (f"failed during start-up: the driver raised KeyError: 'obs' "
                                 f"(traceback in {failed.log}); no checkpoint was written.")
    assert failed.log.parent.parent == tmp_path / "t"  # <log_dir>/<run_name>/<time>/
    assert (failed.log.parent / "config.yaml").exists()
    assert "KeyError: 'obs'" in failed.log.read_text()


def test_an_evaluation_that_failed_says_what_it_kept_and_nothing_about_resuming(tmp_path):
    """``EvalFailed``: its error's own line (a death, or a kill for memory with the hint), then
    the episodes kept and where, or that none was counted; an evaluation has no checkpoint to
    resume from, so the line has no checkpoint clause. Its traceback is the error's."""
    from pathlib import Path

    from m2flow.pipelines.errors import OutOfMemory, WorkerDied
    from m2flow.runs.failure import EvalFailed, RunOutOfMemory, run_failed

    cfg = Root(runner=RunnerBaseConfig(log_dir=str(tmp_path), progress_bar=False))
    died = WorkerDied("worker env[rank 0] in eval_round_ranks(): its process died.")
    failed = run_failed(EvalFailed(died, 72, 200, Path("eval/x")), cfg, phase="evaluation")
    assert failed.describe() == (
        "failed during evaluation: worker env[rank 0] in eval_round_ranks(): its process died "
        f"(traceback in {failed.log}); 72 of 200 episodes kept: partial report in eval/x.")
    assert "WorkerDied" in failed.log.read_text() and "EvalFailed" not in failed.log.read_text()
    oom = OutOfMemory("worker env[rank 0] in eval_round_ranks(): killed by Ray's memory monitor")
    failed = run_failed(EvalFailed(oom, 0, 200, None), cfg, phase="evaluation",
                        hint="lower env.num_envs (now 4)")
    assert isinstance(failed, RunOutOfMemory)
    assert failed.describe() == (
        "out of memory during evaluation: worker env[rank 0] in eval_round_ranks(): killed by "
        "Ray's memory monitor; lower env.num_envs (now 4); no episode of 200 was counted.")
