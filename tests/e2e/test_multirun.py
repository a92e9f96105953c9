"""``m2flow-train -m``: Hydra's sweeper expands the overrides, its launcher runs one job after
the other, each in its own run directory; a summary table at the end; every job's config is
checked before the first one runs."""

import dataclasses

import pytest
import torch
import yaml

import m2flow.cli.sweep as sweep
from m2flow.cli.common import EXIT_CONFIG
from m2flow.cli.train import main as train
from m2flow.cli.workloads import workload
from m2flow.runs import checkpoint

TINY = ["env=gym_pendulum", "cluster=inprocess", "env.num_envs=2", "runner.rollout_steps=8",
        "runner.num_iterations=1", "runner.eval_episodes=2", "runner.progress_bar=false",
        "policy.hidden_sizes=[16]"]


def table_rows(out: str) -> list[list[str]]:
    """The summary table's rows (job, overrides, success, env steps, wall s, run dir, status)."""
    lines = out[out.index("| job | overrides |"):].splitlines()[2:]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")]


def test_a_seed_sweep_runs_each_job_in_its_own_run_dir_and_sums_up(tmp_path, capsys):
    assert train(["-m", *TINY, f"runner.log_dir={tmp_path}", "seed=3,4,5"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [(r[0], r[1], r[6]) for r in rows] == [("0", "seed=3", "ok"), ("1", "seed=4", "ok"),
                                                  ("2", "seed=5", "ok")]
    run_dirs = [tmp_path / r[5] if not r[5].startswith("/") else r[5] for r in rows]
    assert len(set(map(str, run_dirs))) == 3
    policies = []
    for (_, over, success, steps, *_), run_dir in zip(rows, run_dirs):
        saved = yaml.safe_load(open(f"{run_dir}/config.yaml"))
        assert f"seed={saved['seed']}" == over  # the job's own seed, in its own run dir
        state = checkpoint.load(f"{run_dir}/checkpoints/last.pt")
        assert int(steps) == state["global_step"] == 2 * 8
        assert float(success) == pytest.approx(state["metrics"]["eval/success_once"], abs=1e-3)
        policies.append(state["learner"]["policy"])
    first = next(iter(policies[0]))
    assert not torch.equal(policies[0][first], policies[1][first])  # seeds really differ
    summary = next(tmp_path.glob("multirun/*/summary.md")).read_text()
    assert summary.count("| ok |") == 3
    assert sorted(p.parent.name for p in tmp_path.glob("multirun/*/*/.hydra")) == ["0", "1", "2"]


def test_a_job_that_fails_is_a_row_and_the_sweep_goes_on(tmp_path, capsys, monkeypatch):
    real = workload

    def failing_on_seed_1(name):
        w = real(name)

        def train(cfg, control=None):
            if cfg.seed == 1:
                raise RuntimeError("simulator crashed")
            return w.train(cfg, control)
        return dataclasses.replace(w, train=train)

    monkeypatch.setattr(sweep, "workload", failing_on_seed_1)  # what a sweep job trains with
    assert train(["-m", *TINY, f"runner.log_dir={tmp_path}", "seed=0,1,2",
                      "runner.rollout_steps=4,8"]) == 1
    rows = table_rows(capsys.readouterr().out)
    assert len(rows) == 6
    for job, over, *_, status in rows:
        failed = "seed=1" in over.split()
        assert status == ("failed: RuntimeError: simulator crashed" if failed else "ok"), over
    # runner.rollout_steps comes first in the overrides (TINY), so it is the outer loop
    assert [r[1] for r in rows][:2] == ["runner.rollout_steps=4 seed=0",
                                        "runner.rollout_steps=4 seed=1"]
    assert [r[3] for r in rows] == ["8", "-", "8", "16", "-", "16"]  # env steps: 2 envs x steps


def test_a_bad_value_in_a_sweep_stops_it_before_any_job_runs(tmp_path, capsys):
    assert train(["-m", *TINY, f"runner.log_dir={tmp_path}", "seed=0,1",
                      "env.num_envs=2,0"]) == EXIT_CONFIG
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("m2flow-train: config error: env.num_envs=0")
    assert lines[0].endswith("(job 2 of the sweep: env.num_envs=0 seed=0)")  # the first bad one
    assert list(tmp_path.iterdir()) == []
