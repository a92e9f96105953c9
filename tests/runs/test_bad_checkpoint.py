"""A checkpoint that cannot be resumed is refused at start-up in one line (exit 2), before
any worker runs: one of another config, names what differs; a truncated one, names the newest
good checkpoint beside it. Made by a real (tiny, in-process) run."""

from __future__ import annotations

import os
import shutil
import time

import pytest

import m2flow

from m2flow.cli.train import main as train
from tests.failure_notes import note

COMMON = ["env=gym_pendulum", "cluster=inprocess", "env.num_envs=2", "runner.rollout_steps=8",
          "runner.eval_interval=0", "runner.eval_episodes=2", "runner.progress_bar=false"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    logs = tmp_path_factory.mktemp("runs")
    assert train([*COMMON, "runner.num_iterations=2", "runner.checkpoint_interval=1",
                  f"runner.log_dir={logs}"]) == 0
    return next(logs.glob("*/*/checkpoints"))


def _refused(capsys, args, logs) -> str:
    before = set(logs.rglob("*"))
    start = time.time()  # for the failure table (bench/failure_timings.py); not asserted
    code = train([*COMMON, "runner.num_iterations=3", f"runner.log_dir={logs}", *args])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    note("line", line=err[-1] if err else "", code=code, start=start)
    assert code == 2, err
    assert len(err) == 1, err
    assert set(logs.rglob("*")) == before  # no run directory written: nothing started
    return err[0]


def test_a_checkpoint_of_another_config_names_what_differs(run_dir, tmp_path, capsys):
    line = _refused(capsys, [f"resume={run_dir / 'last.pt'}", "policy.hidden_sizes=[32]"],
                    tmp_path)
    assert "resume=" in line and "another config" in line
    assert "policy.hidden_sizes=[256, 256, 256] there, [32] here" in line
    line = _refused(capsys, [f"resume={run_dir / 'last.pt'}", "algorithm=sac", "policy=sac_mlp"],
                    tmp_path)
    assert "algorithm.name=ppo there, sac here" in line and "policy.name=mlp there, sac_mlp here" in line


def test_a_truncated_checkpoint_names_the_newest_good_one(run_dir, tmp_path, capsys):
    folder = tmp_path / "checkpoints"
    shutil.copytree(run_dir, folder)
    last = folder / "iter_00002.pt"
    os.truncate(last, last.stat().st_size // 2)
    line = _refused(capsys, [f"resume={last}"], tmp_path / "logs")
    assert f"resume={last}" in line and "not a checkpoint m2flow can read" in line
    assert line.endswith(f"The newest good checkpoint beside it: {folder / 'iter_00001.pt'}.")


def test_a_checkpoint_of_a_newer_format_names_the_version_that_wrote_it(run_dir, tmp_path,
                                                                         capsys):
    import torch

    from m2flow.runs import checkpoint

    state = torch.load(run_dir / "last.pt", weights_only=False)
    assert (state["format"], state["m2flow_version"]) == (checkpoint.FORMAT, m2flow.__version__)
    state.update(format=checkpoint.FORMAT + 1, m2flow_version="9.9.0")
    newer = tmp_path / "newer" / "iter_00002.pt"
    checkpoint.save(newer, state)
    line = _refused(capsys, [f"resume={newer}"], tmp_path / "logs")
    assert (f"was written by m2flow 9.9.0 in checkpoint format {checkpoint.FORMAT + 1}; this "
            f"m2flow ({m2flow.__version__}) reads formats up to {checkpoint.FORMAT}") in line
