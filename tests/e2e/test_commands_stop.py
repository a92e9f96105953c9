"""``m2flow-demos``, ``m2flow-plan`` and ``m2flow-eval`` stop on Ctrl-C and on SIGTERM as
``m2flow-train`` does (tests/runs/test_ctrl_c.py): one line on stderr saying where, no
traceback, exit code 130 or 143, no process left behind. The demos kept before the stop are
written, and load; so are the evaluated episodes, and those of an evaluation whose env worker
died. Real ManiSkill, real Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from m2flow.runs import seeding
from tests.runs.test_ctrl_c import _tagged
from tests.stderr import run_lines


def _start(tmp_path: Path, module: str, args: list[str]):
    tag = f"M2FLOW_STOP_TEST={tmp_path.name}"
    key, value = tag.split("=")
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    code = f"import sys; from m2flow.cli.{module} import main; sys.exit(main())"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=o, stderr=e,
                                cwd=tmp_path, start_new_session=True,
                                env={**os.environ, key: value, "RAY_USAGE_STATS_ENABLED": "0"})
    return proc, out, err, tag


def _wait_for(proc, path: Path, text: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, f"ended early:\n{path.read_text()[-2000:]}"
    assert text in path.read_text(), f"{text!r} not reached in {timeout:g} s"


def _stopped(proc, err: Path, tag: str, sig: int) -> str:
    if sig == signal.SIGINT:
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
    else:
        os.kill(proc.pid, sig)  # kill PID: the command alone
    proc.wait(timeout=120)  # the seconds: docs/results.md's failure table, not asserted
    text = err.read_text()
    assert "Traceback" not in text, text
    lines = run_lines(text)
    assert proc.returncode == 128 + sig, (proc.returncode, lines)
    deadline = time.monotonic() + 10
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], left
    return lines[-1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["sigterm", "ctrl_c"])
def test_demos_stop_in_one_line_and_keep_what_they_recorded(tmp_path, sig):
    proc, out, err, tag = _start(tmp_path, "demos", [
        "env=maniskill_pickcube", "env.obs_mode=state", "demos.episodes=50",
        "demos.output=demos/part"])
    _wait_for(proc, out, "(2/50 kept")
    line = _stopped(proc, err, tag, sig)
    assert line.startswith("m2flow-demos: interrupted after "), line
    kept = int(line.split(" kept;")[0].split(", ")[-1].split(" of ")[0])
    assert kept >= 2 and line.endswith(f"of 50 kept; wrote demos/part.h5 with them."), line
    with h5py.File(tmp_path / "demos" / "part.h5") as f:
        assert len([k for k in f if k.startswith("traj_")]) == kept


def test_plan_stops_in_one_line_while_it_measures(tmp_path, sig=signal.SIGTERM):
    proc, out, err, tag = _start(tmp_path, "plan", [
        "--config-name", "maniskill_pushcube_ppo_mlp", "env.num_envs=2"])
    _wait_for(proc, out, "profile: env steps and resets", timeout=240)
    line = _stopped(proc, err, tag, sig)
    assert line == "m2flow-plan: interrupted; no plan written.", line
    assert not (tmp_path / "plans").exists() or not list((tmp_path / "plans").iterdir())


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["sigterm", "ctrl_c"])
def test_eval_stops_in_one_line_and_writes_the_episodes_it_counted(tmp_path, sig):
    """2000 episodes of the MLP's initial weights, 2 at a time; stopped after the first rounds,
    the report holds exactly the episodes the line counts: episodes 0..n-1, each from its own
    seed (the seeds a full evaluation gives them), marked as a partial report."""
    proc, out, err, tag = _start(tmp_path, "eval", [
        "env=maniskill_pushcube", "policy=mlp", "episodes=2000", "env.num_envs=2",
        "runner.progress_bar=false", "runner.progress_interval_s=0"])
    _wait_for(proc, out, "eval ManiSkill/PushCube-v1: 4/2000 ep")
    line = _stopped(proc, err, tag, sig)
    head, _, kept = line.partition(" of 2000 episodes; partial report in ")
    assert head.startswith("m2flow-eval: interrupted during evaluation after ") and kept, line
    done = int(head.rsplit(" ", 1)[1])
    assert done >= 4 and kept.endswith("."), line
    report = json.loads((tmp_path / kept[:-1] / "results.json").read_text())
    assert report["interrupted"] and report["episodes_asked"] == 2000
    assert report["episodes"] == done
    episodes = report["per_episode"]
    assert [e["episode"] for e in episodes] == list(range(len(episodes)))
    assert len([e for e in episodes if not e["discarded"]]) == done
    assert [e["seed"] for e in episodes] == seeding.eval_seeds(0, len(episodes))
    assert "**Interrupted**" in (tmp_path / kept[:-1] / "results.md").read_text()


def test_eval_whose_env_worker_dies_writes_the_episodes_it_counted(tmp_path):
    """The env worker killed (SIGKILL, as the kernel's out-of-memory killer does) after the
    first rounds: one line naming the death and the partial report, exit code 1, and the
    report holds exactly the episodes the line counts, marked as failed."""
    proc, out, err, tag = _start(tmp_path, "eval", [
        "env=maniskill_pushcube", "policy=mlp", "episodes=2000", "env.num_envs=2",
        "runner.progress_bar=false", "runner.progress_interval_s=0"])
    _wait_for(proc, out, "eval ManiSkill/PushCube-v1: 4/2000 ep")
    workers = [c for c in _tagged_pids(tag) if "ray::EnvWorker" in c[1]]
    assert len(workers) == 1, workers
    os.kill(workers[0][0], signal.SIGKILL)
    proc.wait(timeout=120)
    text = err.read_text()
    assert "Traceback" not in text, text
    line = run_lines(text)[-1]
    assert proc.returncode == 1, line
    head, _, kept = line.partition(" of 2000 episodes kept: partial report in ")
    assert head.startswith("m2flow-eval: failed during evaluation: worker env[rank 0]"), line
    assert "its process died" in head or "process died" in head, line
    done = int(head.rsplit("; ", 1)[1])
    assert kept.endswith("."), line  # nothing to resume: no checkpoint clause
    report_dir = kept[:-1]
    report = json.loads((tmp_path / report_dir / "results.json").read_text())
    assert report["failed"] and not report["interrupted"], report["failed"]
    assert report["episodes"] == done >= 4 and report["episodes_asked"] == 2000
    episodes = report["per_episode"]
    assert [e["episode"] for e in episodes] == list(range(len(episodes)))
    assert "**Failed** after" in (tmp_path / report_dir / "results.md").read_text()
    deadline = time.monotonic() + 10
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], left


def _tagged_pids(tag: str) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose environment holds ``tag``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and tag.encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append((int(proc.name),
                              (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except OSError:  # ended meanwhile, or not ours to read
            pass
    return found
