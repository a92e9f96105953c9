"""The run's shape, resolved once (``m2flow.embodied.layout``): its counts against the
config's numbers multiplied out by hand, the one check of them, and that no other embodied
module digs the counts out of the config."""

import ast
from pathlib import Path

import pytest

from m2flow.embodied.layout import Layout, check_layout

EMBODIED = Path(__file__).resolve().parents[2] / "m2flow" / "embodied"


def _cfg(name: str, overrides: list):
    from m2flow.cli.workloads import register_schemas
    from m2flow.configs import load_config, to_object

    register_schemas()
    return to_object(load_config(name, overrides))


def test_a_grpo_run_with_several_workers_has_the_counts_multiplied_out():
    cfg = _cfg("maniskill_pushcube_grpo_openvla_oft_tiny", [
        "env.num_envs=8", "algorithm.group_size=4", "staging.pipeline_stages=2",
        "staging.env_groups=4", "runner.rollout_steps=13", "cluster.backend=ray",
        "cluster.placement.components.env.workers=2",
        "cluster.placement.components.rollout.workers=4",
        "cluster.placement.components.learner.workers=2"])
    lay = Layout.of(cfg)
    assert (lay.env_workers, lay.num_envs, lay.total_envs) == (2, 8, 16)
    assert (lay.pipeline_stages, lay.env_groups, lay.served_stages) == (2, 4, 4)
    assert (lay.reset_group_size, lay.reset_groups) == (4, 4)
    assert (lay.rollout_workers, lay.learner_ranks) == (4, 2)
    assert lay.collected == lay.update_samples == 8 * 2 * 13
    check_layout(lay, cfg)  # whole groups, ranks dividing the workers: nothing to refuse


def test_unset_env_groups_are_the_stages_and_unplaced_components_one_worker():
    cfg = _cfg("maniskill_pushcube_ppo_mlp", ["env.num_envs=6", "staging.pipeline_stages=3"])
    cfg.cluster.placement.components = {}
    assert cfg.staging.env_groups is None
    lay = Layout.of(cfg)
    assert (lay.env_groups, lay.env_workers, lay.rollout_workers, lay.learner_ranks,
            lay.reset_group_size) == (3, 1, 1, 1, 1)


def test_bc_trains_on_its_dataset_batch_not_on_what_was_collected():
    cfg = _cfg("maniskill_pickcube_bc_mlp", ["env.num_envs=2", "algorithm.batch_size=96"])
    lay = Layout.of(cfg)
    assert lay.update_samples == 96 != lay.collected
    assert lay.update_source == "algorithm.batch_size, drawn from the dataset"


@pytest.mark.parametrize("overrides, line", [
    (["env.num_envs=6"], "env.num_envs=6: must be a multiple of 4"),
    (["cluster.placement.components.env.workers=3",
      "cluster.placement.components.learner.workers=2"],
     "cluster.placement.components.learner.workers=2: must divide "
     "cluster.placement.components.env.workers=3"),
    (["cluster.placement.components.rollout.workers=3"],
     "cluster.placement.components.rollout.workers=3: must divide the 1 stages"),
    (["algorithm.num_minibatches=300"],
     "algorithm.num_minibatches=300: must be <= the 104 samples an update trains on"),
])
def test_the_one_count_check_refuses_counts_that_do_not_fit(overrides, line):
    cfg = _cfg("maniskill_pushcube_grpo_openvla_oft_tiny", ["cluster.backend=ray", *overrides])
    with pytest.raises(ValueError) as e:
        check_layout(Layout.of(cfg), cfg)
    assert str(e.value).startswith(f"config error: {line}"), str(e.value)


def test_the_layout_is_frozen():
    lay = Layout(env_workers=1, num_envs=2, pipeline_stages=1, env_groups=1,
                 reset_group_size=1, rollout_workers=1, learner_ranks=1, rollout_steps=3,
                 update_samples=6, update_source="collected")
    with pytest.raises(AttributeError):
        lay.num_envs = 4


def _digs(tree: ast.AST) -> list[str]:
    """What digging the run's counts out of the config looks like in code: the placement's
    ``.components`` (env workers, rollout workers, learner ranks), the registry's
    ``reset_group_size(...)``, an algorithm's ``update_samples(...)`` (samples per update)
    and ``env_groups or ...`` (env groups defaulting to the stages)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "components":
            out.append(f"{node.lineno}: .components")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("reset_group_size", "update_samples")):
            out.append(f"{node.lineno}: {node.func.attr}(...)")
        elif (isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or)
              and isinstance(node.values[0], ast.Attribute)
              and node.values[0].attr == "env_groups"):
            out.append(f"{node.lineno}: env_groups or")
    return out


def test_no_other_embodied_module_reads_the_runs_shape_from_the_config():
    found = []
    for path in sorted(EMBODIED.rglob("*.py")):
        if path.name == "layout.py" or {"algorithms", "demos"} & set(path.parts):
            continue  # algorithms define reset_group_size; demos run no training layout
        found += [f"{path.relative_to(EMBODIED)}:{d}"
                  for d in _digs(ast.parse(path.read_text()))]
    assert not found, found


def test_the_shape_check_sees_what_it_looks_for():
    code = ("w = cfg.cluster.placement.components['env'].workers\n"
            "g = algorithm_class(n).reset_group_size(a)\n"
            "k = cfg.staging.env_groups or cfg.staging.pipeline_stages\n")
    assert sorted(_digs(ast.parse(code))) == [
        "1: .components", "2: reset_group_size(...)", "3: env_groups or"]
