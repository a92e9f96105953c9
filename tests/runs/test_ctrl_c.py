"""Ctrl-C on real runs of ``m2flow-train``: the run stops within seconds in any phase (not at
the end of the phase), keeps or writes a loadable checkpoint, ends every process it started
and says in one line where it stopped and how to resume."""

import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from m2flow.cli.common import load_run_config
from m2flow.runs import checkpoint
from tests.stderr import run_lines

TRAIN = [sys.executable, "-c", "import sys; from m2flow.cli.train import main as train; sys.exit(train())"]
PUSHCUBE = ["env.num_envs=2", "runner.num_iterations=1000", "runner.stop_at_success=null"]
STOP_BOUND_S = 15.0  # the phases interrupted below last over 60 s
GONE_BOUND_S = 10.0  # Ray's daemons and the simulator processes end this soon after the driver


class Run:
    """``m2flow-train`` in its own session (a terminal's Ctrl-C reaches its process group), its
    output in files, every process it starts marked by an environment variable."""

    def __init__(self, tmp_path: Path, overrides: list[str]):
        self.tag = f"M2FLOW_CTRL_C_TEST={uuid.uuid4().hex}"
        self.overrides = overrides + [f"runner.log_dir={tmp_path / 'runs'}"]
        self.out, self.err = tmp_path / "out.txt", tmp_path / "err.txt"
        key, value = self.tag.split("=")
        env = {**os.environ, key: value, "RAY_USAGE_STATS_ENABLED": "0"}
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(TRAIN + self.overrides, stdout=out, stderr=err, env=env,
                                         start_new_session=True)
        self.runs = tmp_path / "runs"

    def wait_for(self, found, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not found() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.proc.poll() is None, f"the run ended early:\n{self.err.read_text()}"
        assert found(), f"not reached in {timeout:g} s:\n{self.out.read_text()}"

    def ctrl_c(self, times: int = 1) -> float:
        """Seconds from the first SIGINT to the exit."""
        t0 = time.monotonic()
        for _ in range(times):
            os.killpg(self.proc.pid, signal.SIGINT)
            time.sleep(0.05)
        self.proc.wait(timeout=120)
        return time.monotonic() - t0

    def processes_left(self) -> list[str]:
        """Command lines of the processes this run started that are still alive."""
        deadline = time.monotonic() + GONE_BOUND_S
        while (left := _tagged(self.tag)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def err_lines(self) -> list[str]:
        """The non-empty lines of the run's stderr, less the host's disk warnings."""
        return run_lines(self.err.read_text())

    def stop_line(self) -> str:
        err = self.err.read_text()
        assert "Traceback" not in err, err
        return self.err_lines()[-1]


def _tagged(tag: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and tag.encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:  # ended meanwhile, or not ours to read
            pass
    return found


@pytest.mark.slow  # the SIGTERM test below is this run, stopped the same way: CI's time
def test_ctrl_c_during_a_long_evaluation_saves_the_iteration_and_stops_in_seconds(tmp_path):
    """Ray workers; the evaluation after iteration 2 would take minutes (4000 episodes)."""
    run = Run(tmp_path, PUSHCUBE + [
        "runner.rollout_steps=4", "runner.checkpoint_interval=1", "runner.eval_interval=2",
        "runner.eval_episodes=4000"])
    run.wait_for(lambda: list(run.runs.rglob("iter_00001.pt")))
    time.sleep(2.0)  # iteration 2 (4 steps, one small update) ends well within this
    seconds = run.ctrl_c()
    line = run.stop_line()
    assert run.proc.returncode == 130, line
    assert seconds < STOP_BOUND_S, f"{seconds:.1f} s: {line}"
    assert line.startswith("m2flow-train: interrupted during evaluation after 2 iterations; "
                           "checkpoint "), line
    saved = line.split("checkpoint ")[1].split(";")[0]
    assert Path(saved).name == "iter_00002.pt" and checkpoint.load(saved)["iteration"] == 2
    command = shlex.split(line.split("resume with: ")[1])
    assert command == ["m2flow-train", "--config-name", "maniskill_pushcube_ppo_mlp",
                       *run.overrides, f"resume={saved}"]
    lines = run.err_lines()
    assert not [l for l in lines if l.startswith("(") or "Error" in l], lines
    assert run.processes_left() == []
    # the command is accepted as it stands (the resume checkpoint is checked at start-up)
    assert load_run_config(command[2], command[3:]).resume == saved


def test_ctrl_c_twice_during_collection_in_process_stops_in_seconds(tmp_path):
    """In-process workers (threads) with one simulator process per env; a collection of
    100000 steps would take many minutes. Nothing completed yet: nothing to save."""
    run = Run(tmp_path, PUSHCUBE + ["cluster=inprocess", "runner.rollout_steps=100000",
                                    "runner.eval_interval=0"])
    run.wait_for(lambda: "run dir " in run.out.read_text())
    time.sleep(2.0)  # into the collection
    seconds = run.ctrl_c(times=2)
    line = run.stop_line()
    assert run.proc.returncode == 130, line
    assert seconds < STOP_BOUND_S, f"{seconds:.1f} s: {line}"
    assert line.startswith("m2flow-train: interrupted during collection after 0 iterations; "
                           "no checkpoint was written; start again with: m2flow-train "), line
    assert not list(run.runs.rglob("*.pt"))
    assert run.processes_left() == []


def test_sigterm_during_an_evaluation_stops_as_a_first_ctrl_c_with_exit_code_143(tmp_path):
    """SIGTERM to the driver alone (``kill PID``, a scheduler's stop): the stop of a first
    Ctrl-C, exit code 143 (128 + SIGTERM); the simulators ended with the run print nothing."""
    run = Run(tmp_path, PUSHCUBE + [
        "runner.rollout_steps=4", "runner.checkpoint_interval=1", "runner.eval_interval=2",
        "runner.eval_episodes=4000", "runner.progress_bar=false", "runner.progress_interval_s=0"])
    run.wait_for(lambda: "eval ManiSkill/PushCube-v1: 2/4000 ep" in run.out.read_text())
    t0 = time.monotonic()
    os.kill(run.proc.pid, signal.SIGTERM)
    run.proc.wait(timeout=120)
    seconds = time.monotonic() - t0
    line = run.stop_line()
    assert run.proc.returncode == 128 + signal.SIGTERM, line
    assert seconds < STOP_BOUND_S, f"{seconds:.1f} s: {line}"
    assert line.startswith("m2flow-train: interrupted during evaluation after 2 iterations; "
                           "checkpoint "), line
    saved = line.split("checkpoint ")[1].split(";")[0]
    assert Path(saved).name == "iter_00002.pt" and checkpoint.load(saved)["iteration"] == 2
    lines = run.err_lines()
    assert lines[-2:] == ["SIGTERM: stopping, as after a first Ctrl-C.", line]
    # nothing a worker or a simulator printed (Ray forwards those as "(EnvWorker pid=...) ...")
    assert not [l for l in lines if l.startswith("(") or "Error" in l], lines
    assert run.processes_left() == []
