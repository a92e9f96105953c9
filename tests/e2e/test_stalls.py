"""A worker that stops making progress without dying (SIGSTOP) ends the run: one line on
stderr naming the stopped worker itself (not a worker that waited on it), the phase, "no
progress for N s", the last checkpoint and the command that resumes from it (in start-up:
that there is none, and the command that starts the run again); exit code 1, and no process
of the run left behind (the stopped worker is killed too).

Real runs of ``m2flow-train`` with Ray workers (``tests/e2e/test_run_failures.py``'s
``Run``), with a small ``runner.stall_timeout_s`` (or ``runner.channel_timeout_s``) so that
they end soon; the phase a worker is stopped in is found from the worker itself: it is
stopped while it computes (its process uses the CPU), in a run whose iterations spend nearly
all their time in that phase, or once it wrote that it is in the phase (the fault plugin's
``mlp_marks_phases`` policy and ``ppo_marks_save`` algorithm, ``tests/fault_plugin``). The
seconds to the line are not asserted (timings are not tests' business)."""

import os
import re
import shlex
import signal
import time

import psutil
import pytest

from m2flow.runs import checkpoint
from tests.e2e.test_run_failures import (TINY, Run, check_log, check_resume, wait_until_busy,
                                         with_fault_plugin)

# the limit holds in every phase, start-up's too: well above the slowest call of a start-up
# on a loaded 2-core machine (an env worker's constructor, which builds its simulators), so
# that only the stopped worker ends the run
STALL_S = 30
STALL = [f"runner.stall_timeout_s={STALL_S}"]
LIMIT = rf" \(its limit {STALL_S} s: runner\.stall_timeout_s\)"
SILENT = (r"it answers nothing \(stopped, e\.g\. by SIGSTOP, or stuck in native code holding "
          r"its interpreter\); it was ended")
NOT_STARTED = (r"it has answered nothing since it was launched: its constructor has not "
               r"returned \(stopped, e\.g\. by SIGSTOP, stuck, or slower than the limit\); "
               r"it was ended")


def stop_when_busy(pid: int, timeout: float = 120.0) -> None:
    """SIGSTOPs ``pid`` once it used the CPU in two windows in a row (it is computing)."""
    wait_until_busy(pid, timeout)
    os.kill(pid, signal.SIGSTOP)


def stop_when_marked(run: Run, mark, title: str, timeout: float = 180.0) -> int:
    """SIGSTOPs the process whose pid a worker wrote to ``mark`` (the first line) once it
    entered the phase (the fault plugin's marks); checks it is the run's ``title`` process
    (``ray::RolloutWorker``); returns its pid."""
    deadline = time.monotonic() + timeout
    while not mark.exists() or not mark.read_text().strip():
        assert run.proc.poll() is None, f"the run ended early:\n{run.err.read_text()}"
        assert time.monotonic() < deadline, f"no worker wrote {mark.name} in {timeout:g} s"
        time.sleep(0.01)
    pid = int(mark.read_text().split()[0])
    os.kill(pid, signal.SIGSTOP)
    assert pid in run.processes(title), (pid, run.processes())  # the worker it should be
    return pid


def stalled_line(run: Run, group: str, pid: int, phase: str, limit: str = LIMIT,
                 how: str = SILENT, started: bool = True) -> str:
    """The run's end line, checked: it names ``group``'s rank 0 (``pid``), stalled in
    ``phase`` (``limit``: the line's words on the limit; ``how``: on the worker), and the
    last checkpoint with its resume command, or (not ``started``: stalled before the run's
    loop, its pid not known yet) that no checkpoint was written and the command that starts
    the run again; no process left behind."""
    try:
        line = run.end_line()
    finally:
        if psutil.pid_exists(pid):  # (a failed check must not leave a stopped process)
            os.kill(pid, signal.SIGKILL)
    after, shown = (r" after \d+ iterations", rf" \(pid {pid}\)") if started else ("", "")
    assert re.match(
        rf"m2flow-train: failed during {phase}{after}: worker {group}\[rank 0\]{shown} "
        rf"stalled: no progress for \d+ s during {phase}{limit}; {how} \(traceback in \S+\); "
        + (r"checkpoint \S+iter_\d+\.pt; resume with: " if started else
           "no checkpoint was written; start again with: "), line), line
    if started:
        check_resume(line, run)
    else:
        command = shlex.split(line.split("; start again with: ")[1])
        assert command == ["m2flow-train", "--config-name", "maniskill_pushcube_ppo_mlp",
                           *run.overrides], command
    check_log(line, "WorkerStalled")
    assert run.processes_left() == []
    return line


def test_a_rollout_worker_stopped_while_it_starts_ends_the_run_naming_it(tmp_path):
    """Stopped in its constructor (its policy, ``mlp_marks_phases``, marks that it was built,
    and the constructor takes a few seconds more): Ray runs no call on a worker before its
    constructor returns, so it answers nothing from its launch on; the line names it, not the
    env worker started before it, which answers. No iteration ran: no checkpoint, and the
    line gives the command that starts the run again."""
    mark = tmp_path / "built"
    run = Run(tmp_path, TINY + STALL + ["policy.name=mlp_marks_phases"],
              env={**with_fault_plugin(tmp_path), "M2FLOW_MARK_START": str(mark)})
    pid = stop_when_marked(run, mark, "ray::RolloutWorker")
    stalled_line(run, "rollout", pid, "start-up", how=NOT_STARTED, started=False)


def test_a_learner_stopped_while_it_learns_ends_the_run_naming_it(tmp_path):
    """Updates of many epochs: the learner computes for most of each iteration."""
    run = Run(tmp_path, TINY + STALL + ["runner.num_iterations=1000",
                                        "algorithm.update_epochs=300", "algorithm.target_kl=null"])
    run.wait_for_checkpoint("iter_00001.pt")
    (pid,) = run.processes("ray::LearnerWorker")
    stop_when_busy(pid)
    stalled_line(run, "learner", pid, "learning")


def test_a_rollout_worker_stopped_while_it_collects_ends_the_run_naming_it(tmp_path):
    """The env worker waiting on its actions fails first (its channel times out: the
    automatic limit is far longer); the line names the rollout worker, which answers
    nothing, not the env worker; the channel's failure is in the log. The rollout worker
    spends most of a collection waiting on the simulator, so it is stopped when its policy
    (``policy.name=mlp_marks_phases``, the fault plugin's MLP) marks that it sampled its
    80th action, in the middle of iteration 2's collection: stopped when merely busy, it
    could be stopped in a weight sync, whose automatic limit is minutes."""
    mark = tmp_path / "collecting"
    run = Run(tmp_path, TINY + ["runner.num_iterations=1000", "runner.rollout_steps=64",
                                "runner.channel_timeout_s=5", "algorithm.update_epochs=1",
                                "policy.name=mlp_marks_phases"],
              env={**with_fault_plugin(tmp_path), "M2FLOW_MARK_COLLECTION": str(mark)})
    pid = stop_when_marked(run, mark, "ray::RolloutWorker")
    line = stalled_line(run, "rollout", pid, "collection", limit="")
    check_log(line, "(and with it: worker env[rank 0] in collect(): ChannelTimeout")


@pytest.mark.slow  # a run of the kind the learning's test checks, to keep CI's time down
def test_an_env_worker_stopped_while_it_evaluates_ends_the_run_naming_it(tmp_path):
    """An evaluation after every iteration, of many more steps than the collection."""
    run = Run(tmp_path, TINY + STALL + ["runner.num_iterations=1000", "runner.eval_interval=1",
                                        "runner.eval_episodes=16", "algorithm.update_epochs=1"])
    run.wait_for_checkpoint("iter_00001.pt")
    (pid,) = run.processes("ray::EnvWorker")
    stop_when_busy(pid)
    line = stalled_line(run, "env", pid, "evaluation")
    # the evaluation comes before its iteration's checkpoint; the learner, alive and idle,
    # holds that iteration: the failure saved it, and the line names it
    done = int(re.search(r" after (\d+) iterations", line)[1])
    saved = check_resume(line, run)
    assert saved.name == f"iter_{done:05d}.pt", line
    assert checkpoint.load(saved)["iteration"] == done


@pytest.mark.slow  # a run of the kind the collection's test checks, to keep CI's time down
def test_a_rollout_worker_stopped_while_it_loads_weights_ends_the_run_naming_it(tmp_path):
    """Stopped as it loads the second iteration's weights (its policy, ``mlp_marks_phases``,
    marks its third load, after the first checkpoint): the learner, sending them, waits on
    it and answers; the line names the rollout worker. The learner's update was done: alive
    and idle but for the send, it holds iteration 2, which the failure saves."""
    mark = tmp_path / "loading"
    run = Run(tmp_path, TINY + STALL + ["runner.num_iterations=1000", "algorithm.update_epochs=1",
                                        "policy.name=mlp_marks_phases"],
              env={**with_fault_plugin(tmp_path), "M2FLOW_MARK_SYNC": str(mark)})
    pid = stop_when_marked(run, mark, "ray::RolloutWorker")
    line = stalled_line(run, "rollout", pid, "weight sync")
    assert " after 2 iterations: " in line, line
    saved = check_resume(line, run)
    assert saved.name == "iter_00002.pt", line
    assert checkpoint.load(saved)["iteration"] == 2


@pytest.mark.slow  # a run of the kind the learning's test checks, to keep CI's time down
def test_a_learner_stopped_while_it_saves_ends_the_run_naming_it(tmp_path):
    """Stopped as it hands over its state for the second iteration's checkpoint (its
    algorithm, ``ppo_marks_save``, marks it): the driver waits on it in checkpointing; the
    line names the learner and the first iteration's checkpoint, the last on disk (a
    stalled learner saves nothing more)."""
    mark = tmp_path / "saving"
    run = Run(tmp_path, TINY + STALL + ["runner.num_iterations=1000", "algorithm.update_epochs=1",
                                        "algorithm.name=ppo_marks_save"],
              env={**with_fault_plugin(tmp_path), "M2FLOW_MARK_SAVE": str(mark)})
    pid = stop_when_marked(run, mark, "ray::LearnerWorker")
    line = stalled_line(run, "learner", pid, "checkpointing")
    saved = check_resume(line, run)
    assert saved.name == "iter_00001.pt", line
    assert not list(saved.parent.glob("iter_00002*")), list(saved.parent.iterdir())
