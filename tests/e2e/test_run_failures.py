"""A run that fails ends with one line on stderr and exit code 1: the worker (group and rank),
its method, the cause, the phase and the iterations done, the last checkpoint and the command
that resumes from it. The traceback goes to the run's ``train.log``, never to the terminal.

Real runs of ``m2flow-train`` with Ray workers, and real failures: a rollout worker killed
with SIGKILL, a learner step that raises (an algorithm plugin, pip-installed as
``tests/fault_plugin``, so Ray's learner process finds it too), and a simulator process
stopped with SIGSTOP, so that a channel stops delivering."""

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from m2flow.runs import checkpoint
from tests.stderr import run_lines

TRAIN = [sys.executable, "-c", "import sys; from m2flow.cli.train import main as train; sys.exit(train())"]
TINY = ["env.num_envs=2", "runner.rollout_steps=8", "runner.eval_interval=0",
        "runner.checkpoint_interval=1", "runner.stop_at_success=null", "seed=0"]
PLUGIN = Path(__file__).parents[1] / "fault_plugin"
GONE_BOUND_S = 10.0  # Ray's daemons and the simulator processes end this soon after the driver
BUSY_CPU_S = 0.02  # CPU seconds per BUSY_WINDOW_S of a worker that computes
BUSY_WINDOW_S = 0.25


class Run:
    """``m2flow-train`` in its own session, its output in files, every process it starts
    marked by an environment variable (so the test finds the workers' processes)."""

    def __init__(self, tmp_path: Path, overrides: list[str], env: dict = None):
        self.tag = uuid.uuid4().hex
        self.runs = tmp_path / "runs"
        self.overrides = overrides + [f"runner.log_dir={self.runs}"]
        self.err = tmp_path / "err.txt"
        env = {**os.environ, **(env or {}), "M2FLOW_FAILURE_TEST": self.tag,
               "RAY_USAGE_STATS_ENABLED": "0"}
        with open(tmp_path / "out.txt", "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(TRAIN + self.overrides, stdout=out, stderr=err,
                                         env=env, start_new_session=True)

    def wait_for_checkpoint(self, name: str, timeout: float = 180.0,
                            poll_s: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while not list(self.runs.rglob(name)) and time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the run ended early:\n{self.err.read_text()}"
            time.sleep(poll_s)
        assert list(self.runs.rglob(name)), f"no {name} in {timeout:g} s"

    def processes(self, title: str = "") -> dict[int, tuple[int, str]]:
        """pid -> (parent pid, command line) of this run's processes whose command line
        contains ``title`` (Ray names an actor's process ``ray::<its class>``)."""
        found = {}
        for proc in Path("/proc").iterdir():
            try:
                if not proc.name.isdigit() or f"M2FLOW_FAILURE_TEST={self.tag}".encode() not in (
                        proc / "environ").read_bytes().split(b"\0"):
                    continue
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):  # ended meanwhile, or not ours to read
                continue
            if title in cmdline:
                found[int(proc.name)] = (ppid, cmdline)
        return found

    def end_line(self, timeout: float = 120.0) -> str:
        """The last stderr line, once the run ended with exit code 1 and no traceback."""
        self.proc.wait(timeout=timeout)
        err = self.err.read_text()
        assert self.proc.returncode == 1, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        return run_lines(err)[-1]

    def processes_left(self) -> list[str]:
        deadline = time.monotonic() + GONE_BOUND_S
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return [cmd[:200] for _, cmd in left.values()]


def wait_until_busy(pid: int, timeout: float = 120.0) -> None:
    """Returns once ``pid`` used the CPU in two windows in a row (it is computing)."""
    proc, in_a_row = psutil.Process(pid), 0
    deadline = time.monotonic() + timeout
    while in_a_row < 2:
        assert time.monotonic() < deadline, f"pid {pid} never got busy"
        t0 = sum(proc.cpu_times()[:2])
        time.sleep(BUSY_WINDOW_S)
        in_a_row = in_a_row + 1 if sum(proc.cpu_times()[:2]) - t0 > BUSY_CPU_S else 0


def check_resume(line: str, run: Run) -> Path:
    """The line's checkpoint (loadable) and its resume command (the run's own, resumed)."""
    saved = line.split("; checkpoint ")[1].split("; resume with: ")[0]
    command = shlex.split(line.split("; resume with: ")[1])
    assert command == ["m2flow-train", "--config-name", "maniskill_pushcube_ppo_mlp",
                       *run.overrides, f"resume={saved}"], command
    assert checkpoint.load(saved)["iteration"] >= 1
    return Path(saved)


def check_log(line: str, *fragments: str) -> None:
    """The run's train.log, named in the line, holds the traceback and ``fragments``."""
    log = Path(re.search(r"\(traceback in (\S+train\.log)\)", line)[1]).read_text()
    assert "Traceback (most recent call last)" in log, log[-2000:]
    for fragment in fragments:
        assert fragment in log, (fragment, log[-2000:])


@pytest.mark.slow  # the next test's run, killed at a chosen moment, checks the same line: CI's time
def test_a_rollout_worker_killed_mid_run_ends_the_run_with_one_line(tmp_path):
    run = Run(tmp_path, TINY + ["runner.num_iterations=1000"])
    run.wait_for_checkpoint("iter_00001.pt")
    (pid,) = run.processes("ray::RolloutWorker")
    os.kill(pid, signal.SIGKILL)
    line = run.end_line()
    head = re.match(r"m2flow-train: failed during [a-z ]+ after (\d+) iterations: worker "
                    rf"rollout\[rank 0\] in \w+\(\): the worker's process died \(pid {pid}\): "
                    r"it was killed \(kill -9, the kernel's out-of-memory killer\) or crashed "
                    r"\(traceback in \S+\); checkpoint ", line)
    assert head, line
    saved = check_resume(line, run)
    assert 1 <= checkpoint.load(saved)["iteration"] <= int(head[1])
    check_log(line, "WorkerDied", f"pid: {pid}")
    assert run.processes_left() == []


def test_a_rollout_worker_killed_while_the_learner_learns_keeps_the_learners_iteration(tmp_path):
    """The rollout worker killed during iteration 2's update (of many epochs: the learner
    computes for most of each iteration), after iteration 1's checkpoint: the learner finishes
    the update unharmed and the weight sync that follows finds the rollout dead. The learner,
    alive and idle, holds iteration 2: the failure saves it, as a first Ctrl-C would, and the
    line names that checkpoint, not iteration 1's (which the run would otherwise resume from,
    losing an iteration)."""
    run = Run(tmp_path, TINY + ["runner.num_iterations=1000", "algorithm.update_epochs=300",
                                "algorithm.target_kl=null"])
    run.wait_for_checkpoint("iter_00001.pt")
    (learner,) = run.processes("ray::LearnerWorker")
    (pid,) = run.processes("ray::RolloutWorker")
    wait_until_busy(learner)  # iteration 2's update (iteration 1's ended with its checkpoint)
    assert not list(run.runs.rglob("iter_00002.pt"))
    os.kill(pid, signal.SIGKILL)
    line = run.end_line()
    assert re.match(r"m2flow-train: failed during weight sync after 2 iterations: worker "
                    rf"rollout\[rank 0\] in \w+\(\): the worker's process died \(pid {pid}\): "
                    r"it was killed \(kill -9, the kernel's out-of-memory killer\) or crashed "
                    r"\(traceback in \S+\); checkpoint ", line), line
    check_log(line, "WorkerDied", f"pid: {pid}")
    saved = check_resume(line, run)
    assert saved.name == "iter_00002.pt", line
    state, first = checkpoint.load(saved), checkpoint.load(saved.with_name("iter_00001.pt"))
    assert state["iteration"] == 2 and state["global_step"] == 2 * first["global_step"]
    changed = [k for k, v in state["learner"]["policy"].items()
               if not torch.equal(v, first["learner"]["policy"][k])]
    assert changed, "iteration 2's checkpoint holds iteration 1's weights"
    assert run.processes_left() == []


def with_fault_plugin(tmp_path: Path) -> dict:
    """The environment in which a run finds the algorithms of ``tests/fault_plugin``
    (pip-installed into ``tmp_path``)."""
    site, src = tmp_path / "site", tmp_path / "plugin"
    # a copy: the build's files stay out of the repository
    shutil.copytree(PLUGIN, src, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(src)],
                   check=True, capture_output=True, text=True)
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow  # a minute, most of it the bound waited out: CI's time is kept down
def test_a_failure_whose_save_hangs_gives_the_save_up(tmp_path):
    """As above, with a learner whose state, once iteration 2's update is done, never comes
    (``algorithm.name=ppo_save_hangs_at_2``): the failure's save is given up after its bound
    (``runs.loop.FAILURE_SAVE_MIN_S``), the line names iteration 1's checkpoint, the last on
    disk, and nothing is written later (no iteration 2, no temp file)."""
    run = Run(tmp_path, TINY + ["runner.num_iterations=1000", "algorithm.update_epochs=300",
                                "algorithm.target_kl=null", "algorithm.name=ppo_save_hangs_at_2"],
              env=with_fault_plugin(tmp_path))
    run.wait_for_checkpoint("iter_00001.pt")
    (learner,) = run.processes("ray::LearnerWorker")
    (pid,) = run.processes("ray::RolloutWorker")
    wait_until_busy(learner)
    os.kill(pid, signal.SIGKILL)
    line = run.end_line()
    assert line.startswith("m2flow-train: failed during weight sync after 2 iterations: worker "
                           "rollout[rank 0] in "), line
    saved = check_resume(line, run)
    assert saved.name == "iter_00001.pt", line
    assert run.processes_left() == []
    names = [p.name for p in saved.parent.iterdir()]
    assert "iter_00002.pt" not in names and not [n for n in names if "tmp" in n], names


def test_an_exception_in_a_learner_step_ends_the_run_with_one_line(tmp_path):
    run = Run(tmp_path, TINY + ["runner.num_iterations=3", "algorithm.name=ppo_fails_at_2"],
              env=with_fault_plugin(tmp_path))
    line = run.end_line(timeout=300)
    assert line.startswith(
        "m2flow-train: failed during learning after 1 iterations: worker learner[rank 0] in "
        "update(): LossDiverged: loss is nan in the learner step of iteration 1 (traceback in "
        f"{run.runs}/maniskill_pushcube_ppo_mlp/"), line
    assert check_resume(line, run).name == "iter_00001.pt"
    check_log(line, "in loss\n", "m2flow_fault_plugin.LossDiverged: loss is nan")
    assert run.processes_left() == []


def test_a_channel_that_stops_delivering_ends_the_run_with_one_line(tmp_path):
    """A simulator process stopped with SIGSTOP as a collection starts: its env worker waits on
    it (for up to env.step_timeout_s), so the rollout worker gets no observation within the
    channel's timeout. (Stopped at a collection's last step instead, nobody would wait on a
    channel; the collection of 64 steps that follows a checkpoint is far from its end.)"""
    run = Run(tmp_path, TINY + ["runner.num_iterations=1000", "runner.rollout_steps=64",
                                "runner.channel_timeout_s=5"])
    run.wait_for_checkpoint("iter_00001.pt")
    forked = run.processes("forkserver")  # the fork server and the simulators it forked
    simulator = min(pid for pid, (ppid, _) in forked.items() if ppid in forked)
    run.wait_for_checkpoint("iter_00002.pt", poll_s=0.01)  # the next collection starts now
    os.kill(simulator, signal.SIGSTOP)
    try:
        line = run.end_line()
    finally:
        with contextlib.suppress(ProcessLookupError):  # Ray kills a killed worker's children
            os.kill(simulator, signal.SIGKILL)
    assert re.match(r"m2flow-train: failed during collection after 2 iterations: worker "
                    r"rollout\[rank 0\] in serve\(\): ChannelTimeout: channel 'obs' key "
                    r"\(0, 0\) got nothing for 5 s: its producer is slow, stuck or dead "
                    r"\(traceback in \S+\); checkpoint \S+iter_00002.pt; ", line), line
    check_resume(line, run)
    check_log(line, "ChannelTimeout")
    assert run.processes_left() == []


def test_a_simulator_that_dies_on_every_step_ends_the_run_after_max_restarts(tmp_path):
    """Every simulator process of the run is killed (SIGKILL) as soon as it exists, from the
    second checkpoint on: each is replaced, the replacements die too, and after
    ``env.max_restarts`` restarts in a row the run ends in one line naming the env and the
    simulator's last error, instead of restarting forever."""
    run = Run(tmp_path, TINY + ["runner.num_iterations=1000", "env.max_restarts=2"])
    run.wait_for_checkpoint("iter_00001.pt")
    killed = set()
    while run.proc.poll() is None:
        forked = run.processes("forkserver")  # the fork server and the simulators it forked
        for pid in [pid for pid, (ppid, _) in forked.items() if ppid in forked]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.05)
    line = run.end_line()
    assert re.match(
        r"m2flow-train: failed during [a-z ]+ after \d+ iterations: worker env\[rank 0\] in "
        r"\w+\(\): SimulatorError: ManiSkill/PushCube-v1, env \d: its simulator process was "
        r"lost again after 2 restarts in a row with no episode finished "
        r"\(env.max_restarts=2\); not restarted any more\. Last error: env process \d "
        r"\(pid (\d+)\) died \(killed by SIGKILL\) during [a-z]+ \(traceback in \S+\); "
        r"checkpoint \S+; resume with: ", line), line
    assert int(re.search(r"\(pid (\d+)\) died", line)[1]) in killed
    check_resume(line, run)
    assert run.processes_left() == []
