"""A worker that stops making progress without dying (SIGSTOP) ends the run: one line on
stderr naming the stopped worker itself (not a worker that waited on it), the phase, "no
progress for N s", the last checkpoint and the command that resumes from it; exit code 1,
and no process of the run left behind (the stopped worker is killed too).

Real runs of ``m2flow-train`` with Ray workers (``tests/e2e/test_run_failures.py``'s
``Run``), with a small ``runner.stall_timeout_s`` (or ``runner.channel_timeout_s``) so that
they end soon; the phase a worker is stopped in is found from the worker itself: it is
stopped while it computes (its process uses the CPU), in a run whose iterations spend nearly
all their time in that phase. The seconds to the line are not asserted (timings are not
tests' business)."""

import os
import re
import signal
import time

import psutil
import pytest

from m2flow.runs import checkpoint
from tests.e2e.test_run_failures import (TINY, Run, check_log, check_resume, wait_until_busy,
                                         with_fault_plugin)

STALL = ["runner.stall_timeout_s=10"]


def stop_when_busy(pid: int, timeout: float = 120.0) -> None:
    """SIGSTOPs ``pid`` once it used the CPU in two windows in a row (it is computing)."""
    wait_until_busy(pid, timeout)
    os.kill(pid, signal.SIGSTOP)


def stalled_line(run: Run, group: str, pid: int, phase: str,
                 limit: str = r" \(its limit 10 s: runner\.stall_timeout_s\)") -> str:
    """The run's end line, checked: it names ``group``'s rank 0 (``pid``), stalled in
    ``phase`` (``limit``: the line's words on the limit), and the last checkpoint with its
    resume command; no process left behind."""
    try:
        line = run.end_line()
    finally:
        if psutil.pid_exists(pid):  # (a failed check must not leave a stopped process)
            os.kill(pid, signal.SIGKILL)
    assert re.match(
        rf"m2flow-train: failed during {phase} after \d+ iterations: worker {group}\[rank 0\] "
        rf"\(pid {pid}\) stalled: no progress for \d+ s during {phase}{limit}; it answers "
        r"nothing \(stopped, e\.g\. by SIGSTOP, or stuck in native code holding its "
        r"interpreter\); it was ended \(traceback in \S+\); checkpoint \S+iter_\d+\.pt; "
        r"resume with: ", line), line
    check_resume(line, run)
    check_log(line, "WorkerStalled")
    assert run.processes_left() == []
    return line


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
    (``policy.name=mlp_marks_collection``, the fault plugin's MLP) marks that it sampled its
    80th action, in the middle of iteration 2's collection: stopped when merely busy, it
    could be stopped in a weight sync, whose automatic limit is minutes."""
    mark = tmp_path / "collecting"
    run = Run(tmp_path, TINY + ["runner.num_iterations=1000", "runner.rollout_steps=64",
                                "runner.channel_timeout_s=5", "algorithm.update_epochs=1",
                                "policy.name=mlp_marks_collection"],
              env={**with_fault_plugin(tmp_path), "M2FLOW_MARK_COLLECTION": str(mark)})
    deadline = time.monotonic() + 180.0
    while not mark.exists() or not mark.read_text():
        assert run.proc.poll() is None, f"the run ended early:\n{run.err.read_text()}"
        assert time.monotonic() < deadline, "the rollout never sampled its 80th action"
        time.sleep(0.01)
    pid = int(mark.read_text())
    os.kill(pid, signal.SIGSTOP)
    assert list(run.processes("ray::RolloutWorker")) == [pid]  # the rollout worker wrote it
    line = stalled_line(run, "rollout", pid, "collection", limit="")
    check_log(line, "(and with it: worker env[rank 0] in collect(): ChannelTimeout")


@pytest.mark.slow  # a third run of the kind the two above check, to keep CI's time down
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

