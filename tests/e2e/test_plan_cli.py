"""m2flow-plan end to end: from a saved profile (no measuring) to a plan file that
m2flow-train composes; refusals as one config-error line; one real profile of tiny envs."""

import json

import pytest
import yaml

from m2flow.cli.common import load_run_config
from m2flow.cli.train import main as train_cli
from m2flow.cli.plan import main as plan_cli
from tests.pipelines.test_planner import FACTS, profile
from m2flow.pipelines.planner.profiles import Node


@pytest.fixture
def saved_profile(tmp_path):
    p = profile(Node(cores=2, memory_mb=24_000), infer_per_item=0.010)
    p.facts = dict(FACTS)
    return p.save(tmp_path / "x.profile.json")


def test_plan_from_a_saved_profile_writes_a_file_that_training_composes(tmp_path, capsys,
                                                                        saved_profile):
    out = tmp_path / "plan.yaml"
    assert plan_cli(["--profile", str(saved_profile), "-o", str(out), "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "env steps/s" in text and "infeasible:" in text and "add up to 3 > 2 cores" in text
    body = yaml.safe_load(out.read_text())
    assert body["config_name"] == "maniskill_pushcube_ppo_mlp" and body["workload"] == "embodied"
    assert body["predicted"]["iteration_s"] > 0
    cfg = load_run_config("maniskill_pushcube_ppo_mlp", [f"cluster.plan={out}"])
    assert cfg.cluster.placement.mode == body["cluster"]["placement"]["mode"]
    assert f"env.num_envs={cfg.env.num_envs}" in body["overrides"]
    assert cfg.cluster.placement.components["env"].cpu_ids == (body["cluster"]["placement"]
                                                             ["components"]["env"]["cpu_ids"])
    assert train_cli([f"cluster.plan={out}", "--cfg"]) == 0


def test_plan_refusals_are_one_line(tmp_path, capsys, saved_profile):
    assert plan_cli(["--profile", str(tmp_path / "missing.json")]) == 2
    assert "--profile" in capsys.readouterr().err
    assert plan_cli(["--profile", str(saved_profile), "cluster.address=auto"]) == 2
    assert "plans the machine it runs on" in capsys.readouterr().err
    tiny = json.loads(saved_profile.read_text())
    tiny["node"]["memory_mb"] = 500
    small = tmp_path / "small.profile.json"
    small.write_text(json.dumps(tiny))
    assert plan_cli(["--profile", str(small), "-o", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("m2flow-plan: error: no plan of the embodied workload fits this node")
    assert "host memory" in err and len(err.strip().splitlines()) == 1
    assert train_cli(["cluster.plan=nope.yaml", "--cfg"]) == 2
    assert "cluster.plan=nope.yaml: no such file" in capsys.readouterr().err


def test_plan_profiles_real_envs_and_policy(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    rc = plan_cli(["-o", str(out), "--top", "2", "--no-calibrate", "env.num_envs=2", "runner.rollout_steps=4",
                   "policy.hidden_sizes=[16,16]", "algorithm.update_epochs=1"])
    assert rc == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "env.step (cpu)" in text and "learner.learn (cpu)" in text
    assert out.with_suffix(".profile.json").is_file()
    assert load_run_config("maniskill_pushcube_ppo_mlp", [f"cluster.plan={out}"]).env.num_envs


def test_a_run_with_an_auto_plan_logs_its_drift_and_re_plans_the_stages(tmp_path, ray_cluster,
                                                                       capsys):
    """A plan as cluster.plan=auto makes it (here from a profile that predicts a far slower
    machine: a 5 s update): the run logs the prediction, then re-plans once the drift shows."""
    from m2flow.pipelines.planner.calibration import models_for
    from m2flow.pipelines.planner.search import search
    from m2flow.pipelines.planner.planfile import write_plan_file
    from m2flow.embodied.graph import graph

    node = Node(cores=2, memory_mb=24_000)
    p = profile(node, infer_per_item=1e-6, sizes=(1, 2, 4), learn=5.0)
    p.facts = dict(FACTS, total_envs=4, rollout_steps=8)
    g = graph(p.facts)
    best = next(pr for pr in search(g, models_for(p, g), node)
                if pr.feasible and pr.plan.mode == "collocated" and pr.plan.workers == 1
                and pr.plan.stages == 1 and not pr.plan.overlap)
    path = write_plan_file(tmp_path / "auto.yaml", best,
                           config_name="maniskill_pushcube_ppo_mlp", workload="embodied",
                           node=node, knob_overrides=g.knob_overrides(best.plan, elastic=True),
                           label=best.plan.label(g), auto=True)
    p.save(tmp_path / "auto.profile.json")
    rc = train_cli([f"cluster.plan={path}", "runner.rollout_steps=8", "runner.num_iterations=4",
                    "runner.eval_interval=0", "runner.eval_episodes=4",
                    f"runner.log_dir={tmp_path}", "runner.progress_bar=false",
                    "policy.hidden_sizes=[16,16]", "algorithm.update_epochs=1"])
    assert rc == 0
    log = next(tmp_path.glob("*/*/train.log")).read_text()
    assert "s/iteration for this run's plan" in log and "re-plans the stages on a drift" in log
    assert "re-planned with the measured component times" in log


def test_cfg_prints_plan_auto_as_given_without_measuring(capsys, monkeypatch):
    """``m2flow-train --cfg cluster.plan=auto`` prints the config; making the plan would
    measure every component (minutes), which printing a config must not do."""
    import m2flow.cli.planning as planning

    def measuring(*args, **kwargs):
        raise AssertionError("--cfg made a plan")

    monkeypatch.setattr(planning, "make_plan", measuring)
    assert train_cli(["--cfg", "cluster.plan=auto", "env.num_envs=2"]) == 0
    out = capsys.readouterr().out
    assert "plan: auto" in out and "num_envs: 2" in out
