"""Placement: every PlacementError names what is at fault; GPU splits and mode rules."""

import pytest

from m2flow.pipelines import (
    ComponentPlacement as C,
)
from m2flow.pipelines import (
    NodeInfo,
    Placement,
    PlacementConfig,
    PlacementError,
    RankResources,
)


def nodes(*specs):
    """One NodeInfo per (cpus, gpus) pair."""
    return [
        NodeInfo(f"n{i}", "127.0.0.1", num_cpus=c, num_gpus=g) for i, (c, g) in enumerate(specs)
    ]


def place(mode, node_specs=((8, 4),), **components):
    return Placement(PlacementConfig(mode=mode, components=components), nodes(*node_specs))


def error_of(mode, node_specs=((8, 4),), **components) -> str:
    with pytest.raises(PlacementError) as ei:
        place(mode, node_specs, **components)
    return str(ei.value)


@pytest.mark.parametrize("mode", ["collocated", "disaggregated", "hybrid"])
@pytest.mark.parametrize(
    "comp, fragments",
    [
        (C(gpus=[4]), ["placement.components.rollout.gpus", "GPU 4", "ids 0-3", "'rollout'"]),
        (C(gpus=[0, 1, 2, 3, 4, 5]), ["placement.components.rollout.gpus", "GPU 4", "ids 0-3"]),
        (C(gpus=[1, 1]), ["placement.components.rollout.gpus=[1, 1]", "twice"]),
        (C(workers=0), ["placement.components.rollout.workers=0", ">= 1 worker"]),
        (C(cpus=0), ["placement.components.rollout.cpus=0", "positive"]),
        (C(cpus=9), ["placement.components.rollout.cpus=9", "node 0 has 8 CPUs"]),
        (C(node=1), ["placement.components.rollout.node=1", "1 node(s)", "indices 0-0"]),
        (C(node=-1), ["placement.components.rollout.node=-1", "1 node(s)"]),
        (C(gpus=[0, 1, 2], workers=2), ["placement.components.rollout", "2 workers", "3 GPUs"]),
    ],
)
def test_component_errors_name_the_component(mode, comp, fragments):
    message = error_of(mode, env=C(cpus=1), rollout=comp)
    for fragment in fragments:
        assert fragment in message


def test_gpu_asked_on_a_node_without_gpus_says_so():
    message = error_of("hybrid", ((8, 0),), learner=C(gpus=[0]))
    assert "placement.components.learner.gpus asks for GPU 0" in message
    assert "node 0 has no GPUs" in message and "'learner' on CPU" in message


def test_gpu_id_is_checked_against_the_components_own_node():
    message = error_of("hybrid", ((8, 4), (8, 1)), learner=C(gpus=[1], node=1))
    assert "placement.components.learner.gpus asks for GPU 1, but node 1 has ids 0-0" in message
    assert place("hybrid", ((8, 4), (8, 1)), learner=C(gpus=[0], node=1)).ranks("learner") == [
        RankResources(node=1, cpus=1.0, gpu_ids=(0,))
    ]


def test_disaggregated_components_sharing_a_gpu_names_both():
    message = error_of("disaggregated", env=C(), rollout=C(gpus=[0, 1]), learner=C(gpus=[1, 2]))
    assert "'rollout' and 'learner' share a GPU" in message
    assert "'disaggregated'" in message


def test_disaggregated_cpu_shares_over_the_node_name_the_component():
    message = error_of(
        "disaggregated", ((4, 0),), env=C(workers=2, cpus=1.5), rollout=C(cpus=1.5)
    )
    assert "placement.components.rollout" in message
    assert "node 0 add up to 4.5 > 4 cores" in message


def test_disaggregated_cpu_budget_is_per_node():
    p = place("disaggregated", ((4, 0), (4, 0)), env=C(workers=4), rollout=C(workers=4, node=1))
    assert [r.node for r in p.ranks("rollout")] == [1] * 4
    assert "placement.components.rollout" in error_of(
        "disaggregated", ((4, 0), (4, 0)), env=C(workers=4), rollout=C(node=0)
    )


def test_collocated_components_on_different_gpus_name_both():
    message = error_of("collocated", env=C(), rollout=C(gpus=[0]), learner=C(gpus=[1]))
    assert "'rollout' uses [(0, 0)]" in message and "'learner' uses [(0, 1)]" in message


def test_collocated_error_names_the_component_that_differs():
    message = error_of("collocated", a=C(gpus=[0]), b=C(gpus=[0]), c=C(gpus=[0, 1], workers=2))
    assert "'a' uses" in message and "'c' uses" in message


def test_unknown_mode_is_named():
    message = error_of("pipelined", env=C())
    assert "placement.mode='pipelined' is not a mode" in message
    assert "disaggregated" in message


def test_four_gpus_split_over_two_workers():
    p = place("collocated", rollout=C(workers=2, cpus=2, gpus=[0, 1, 2, 3]))
    assert [r.gpu_ids for r in p.ranks("rollout")] == [(0, 1), (2, 3)]
    assert {(r.node, r.cpus) for r in p.ranks("rollout")} == {(0, 2.0)}


def test_two_workers_share_one_gpu():
    p = place("disaggregated", rollout=C(workers=2, gpus=[3]))
    assert [r.gpu_ids for r in p.ranks("rollout")] == [(3,), (3,)]
    p = place("hybrid", rollout=C(workers=4, gpus=[0, 1]))
    assert [r.gpu_ids for r in p.ranks("rollout")] == [(0,), (0,), (1,), (1,)]


def test_cpu_only_component_gets_no_gpu_ids():
    assert place("collocated", env=C(workers=3)).ranks("env") == [RankResources(0, 1.0, ())] * 3


def test_shares_device_collocated_vs_disaggregated():
    colloc = place("collocated", env=C(), rollout=C(gpus=[0, 1]), learner=C(gpus=[0, 1]))
    assert colloc.shares_device("rollout", "learner")
    assert not colloc.shares_device("env", "rollout")
    disagg = place("disaggregated", rollout=C(gpus=[0, 1]), learner=C(gpus=[2, 3]))
    assert not disagg.shares_device("rollout", "learner")


def test_hybrid_allows_gpu_and_cpu_sharing():
    p = place(
        "hybrid", ((2, 2),), env=C(cpus=2), rollout=C(gpus=[0, 1]), learner=C(cpus=2, gpus=[1])
    )
    assert p.shares_device("rollout", "learner")
    assert p.ranks("learner") == [RankResources(0, 2.0, (1,))]


def test_unlisted_component_gets_the_default_placement():
    p = place("collocated", env=C(workers=2))
    assert p.ranks("logger") == [RankResources(0, 1.0, ())]


def test_components_may_be_plain_mappings():
    p = place("hybrid", rollout={"workers": 2, "gpus": [0, 1], "cpus": 0.5})
    assert p.ranks("rollout") == [RankResources(0, 0.5, (0,)), RankResources(0, 0.5, (1,))]


def test_disaggregated_pins_each_component_to_its_own_cores():
    p = place("disaggregated", ((4, 0),), env=C(cpus=2), rollout=C(workers=2, cpus=1))
    assert [r.cpu_ids for r in p.ranks("env")] == [(0, 1)]
    assert [r.cpu_ids for r in p.ranks("rollout")] == [(2,), (3,)]
    assert p.ranks("rollout")[0].threads == 1 and p.ranks("env")[0].threads == 2


def test_explicit_cpu_ids_split_over_ranks_and_set_the_share():
    p = place("hybrid", ((4, 0),), env=C(workers=2, cpu_ids=[0, 1, 2, 3]), learner=C(cpus=4))
    assert [(r.cpu_ids, r.cpus) for r in p.ranks("env")] == [((0, 1), 2.0), ((2, 3), 2.0)]
    assert p.ranks("learner")[0].cpu_ids == ()  # not pinned: shares the node


@pytest.mark.parametrize("ids, fragment", [
    ([0, 9], "cpu_ids=[0, 9]: cores must be distinct ids 0-3"),
    ([1, 1], "cpu_ids=[1, 1]: cores must be distinct"),
    ([0, 1, 2], "has 3 cores for 2 workers"),
])
def test_bad_cpu_ids_name_the_field(ids, fragment):
    msg = error_of("hybrid", ((4, 0),), env=C(workers=2, cpu_ids=ids))
    assert "placement.components.env.cpu_ids" in msg and fragment in msg


def test_disaggregated_components_pinned_to_the_same_core_name_both():
    msg = error_of("disaggregated", ((4, 0),), env=C(cpu_ids=[0]), rollout=C(cpu_ids=[0]))
    assert "'env' and 'rollout'" in msg and "cores [0]" in msg


def test_a_ray_worker_is_pinned_to_its_cores(ray_cluster):
    from m2flow.pipelines import Worker, WorkerGroup

    class Probe(Worker):
        def cores(self):
            import os

            import torch

            return sorted(os.sched_getaffinity(0)), torch.get_num_threads()

    group = WorkerGroup(ray_cluster, "probe", Probe, [RankResources(0, 1.0, (), (0,))])
    try:
        assert group.call(Probe.cores).wait() == [([0], 1)]
    finally:
        group.shutdown()


@pytest.mark.parametrize("name, components", [
    ("gpu_collocated", ["env", "rollout", "learner"]),
    ("gpu_inprocess", ["env", "rollout", "learner"]),
    ("reasoning_collocated_gpu", ["rollout", "learner"]),
])
def test_the_one_gpu_cluster_configs_put_rollout_and_learner_on_gpu_0_taking_turns(name, components):
    """The configs for one machine with one GPU (scripts/gpu_check.sh's H100: 16 cores), read
    from their files: every GPU component on GPU 0, and rollout and learner take turns there
    (the env, whose simulators hold no weights, never switches)."""
    from pathlib import Path

    from omegaconf import OmegaConf

    import m2flow
    from m2flow.pipelines import offloads_for

    path = Path(m2flow.__file__).parent / "configs" / "cluster" / f"{name}.yaml"
    placement = OmegaConf.to_container(OmegaConf.load(path).placement)
    p = Placement(PlacementConfig(**placement), nodes((16, 1)))
    for c in components:
        assert [r.gpu_ids for r in p.ranks(c)] == [(0,)], c
    offloads = offloads_for(p.shares_device, ["rollout", "learner"])
    assert offloads == {"rollout": ["learner"], "learner": ["rollout"]}
    with pytest.raises(PlacementError, match="GPU 0"):  # and a machine without one says so
        Placement(PlacementConfig(**placement), nodes((16, 0)))
