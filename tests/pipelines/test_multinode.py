"""Several Ray nodes: components placed by a node's custom resource (``node_resource``), and a
real run on a local multi-node cluster (a head and two more raylets on this machine, each with
a resource of its own) where the ``cluster`` group (``cluster=ray_multinode``) puts env, rollout
and learner each on its node.

The cluster lives in a child process (this file run as a script) with a Ray temp folder of its
own, and its head listens on a port the system picks (``ray.cluster_utils`` starts the GCS on
port 0, never Ray's default 6379, which a user's Ray may hold): the runs join it by that
address and nothing else. A decoy head started after it is
the newest Ray on the machine, the one ``address=auto`` would pick; the runs must not land
there. Its nodes end with that process (Ray's reaper ends them if it is killed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from m2flow.pipelines import ComponentPlacement as C
from m2flow.pipelines import NodeInfo, Placement, PlacementConfig, PlacementError

HEAD, SIM, LEARN = "m2flow_rollout", "m2flow_env", "m2flow_learner"  # cluster/ray_multinode.yaml
ON = {"EnvWorker": SIM, "RolloutWorker": HEAD, "LearnerWorker": LEARN}
RUN_TIMEOUT_S = 170  # the issue: under 3 minutes
TINY = ["env.num_envs=2", "runner.rollout_steps=8", "runner.num_iterations=2",
        "runner.eval_interval=0", "runner.eval_episodes=2", "runner.progress_bar=false",
        "policy.hidden_sizes=[16]"]


def three_nodes():
    return [NodeInfo("head", "10.0.0.1", 4, 0, frozenset({HEAD})),
            NodeInfo("b", "10.0.0.2", 4, 0, frozenset({SIM})),
            NodeInfo("c", "10.0.0.3", 4, 1, frozenset({LEARN, "big_disk"}))]


def test_node_resource_picks_the_node_that_offers_it():
    p = Placement(PlacementConfig(mode="hybrid", components={
        "env": C(workers=2, node_resource=SIM), "learner": C(gpus=[0], node_resource=LEARN),
        "rollout": C()}), three_nodes())
    assert [r.node for r in p.ranks("env")] == [1, 1]
    assert [(r.node, r.gpu_ids) for r in p.ranks("learner")] == [(2, (0,))]
    assert p.ranks("rollout")[0].node == 0


@pytest.mark.parametrize("comp, fragment", [
    (C(node_resource="gpu_box"), "node_resource='gpu_box': no node of the cluster offers it "
     "(custom resources: big_disk, m2flow_env, m2flow_learner, m2flow_rollout); start that "
     "node with ray start --resources='{\"gpu_box\": 1}'"),
    (C(node_resource=SIM, gpus=[0]), "gpus asks for GPU 0, but node 1 has no GPUs"),
    (C(node=2, node_resource=SIM), "node=2 and node_resource='m2flow_env' both pick a node"),
    (C(node_resource=""), "node_resource is empty"),
])
def test_a_node_resource_that_does_not_fit_is_named(comp, fragment):
    with pytest.raises(PlacementError) as e:
        Placement(PlacementConfig(components={"env": comp}), three_nodes())
    assert str(e.value).startswith("placement.components.env") and fragment in str(e.value)


def test_a_resource_on_two_nodes_is_ambiguous():
    nodes = three_nodes() + [NodeInfo("d", "10.0.0.4", 4, 0, frozenset({SIM}))]
    with pytest.raises(PlacementError, match="2 nodes offer it; give each node a resource"):
        Placement(PlacementConfig(components={"env": C(node_resource=SIM)}), nodes)


def test_joining_when_no_cluster_runs_says_how_to_start_one(monkeypatch):
    import ray

    from m2flow.pipelines import Cluster, ClusterConfig

    def no_cluster(**kwargs):  # what ray.init(address="auto") raises when nothing runs
        raise ConnectionError("Could not find any running Ray instance. Please specify ...")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    with pytest.raises(ConnectionError) as e:
        Cluster(ClusterConfig(backend="ray", address="auto"))
    assert str(e.value).startswith("cluster.address='auto': no running Ray cluster to join "
                                   "(Could not find any running Ray instance.")
    assert "ray start --head" in str(e.value) and "cluster.address=null" in str(e.value)


def test_env_rollout_and_learner_run_on_their_own_nodes_of_a_ray_cluster(tmp_path):
    # a short folder: Ray's socket paths must stay under 107 characters
    with tempfile.TemporaryDirectory(prefix="m2n", dir="/tmp") as ray_tmp:
        # Ray's token authentication is off for this private cluster: nodes started by
        # ray.cluster_utils and a driver joining by address=auto did not agree on a token
        # (every actor was cancelled before it ran).
        env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_AUTH_MODE": "disabled"}
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["train_rc"] == 0 and seen["sac_rc"] == 0
    assert seen["decoy_actors"] == [], seen  # nothing joined the newest Ray
    assert sorted(seen["nodes"]) == sorted([HEAD, SIM, LEARN])
    assert len(set(seen["nodes"].values())) == 3  # three raylets
    for cls, resource in ON.items():  # Ray's own record of where each actor ran (two runs)
        assert seen["actors"][cls] == [seen["nodes"][resource]] * 2, (cls, seen)
    assert proc.stdout.count("done: 2 iterations, 32 env steps") == 2, proc.stdout[-3000:]


def actor_nodes(address: str) -> dict[str, list[str]]:
    """Ray's record of the cluster at ``address``: actor class -> the node ids it ran on."""
    import ray

    ray.init(address=address)
    try:
        actors: dict[str, list[str]] = {}
        for a in ray._private.state.actors().values():
            actors.setdefault(a["ActorClassName"], []).append(a["Address"]["NodeID"])
        nodes = {r: n["NodeID"] for n in ray.nodes() if n["Alive"] for r in n["Resources"]
                 if r in (HEAD, SIM, LEARN)}
        return {"actors": actors, "nodes": nodes}
    finally:
        ray.shutdown()


def drive(out: Path) -> None:
    """Starts the cluster, then a decoy head (the newest Ray here), trains
    with ``cluster=ray_multinode`` joining the cluster by its address, then reads from Ray's
    actor tables on which node each worker ran, and that none ran on the decoy."""
    from ray.cluster_utils import Cluster

    from m2flow.cli.train import main as train

    small = {"num_cpus": 1, "object_store_memory": 80 * 2**20, "include_dashboard": False}
    cluster = Cluster(initialize_head=True,
                      head_node_args={**small, "resources": {HEAD: 1}})
    decoy = None
    try:
        for resource in (SIM, LEARN):
            cluster.add_node(**small, resources={resource: 1})
        cluster.wait_for_nodes()
        decoy = Cluster(initialize_head=True, head_node_args=small)
        join = [f"cluster.address={cluster.address}"]
        rc = train(["cluster=ray_multinode", *join, *TINY, f"runner.log_dir={out}"])
        # off-policy on the same nodes: SAC's replay buffer on the learner's node, the
        # rollout acting with weights one update old while the learner updates
        sac_rc = train(["--config-name", "maniskill_pushcube_sac_mlp", "cluster=ray_multinode",
                        *join, *TINY, "algorithm.learning_starts=16", "algorithm.batch_size=8",
                        f"runner.log_dir={out / 'sac'}"])
        seen = actor_nodes(cluster.address)
        decoy_actors = sorted(actor_nodes(decoy.address)["actors"])
        (out / "seen.json").write_text(json.dumps({"train_rc": rc, "sac_rc": sac_rc, **seen,
                                                   "decoy_actors": decoy_actors}))
    finally:
        if decoy is not None:
            decoy.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    drive(Path(sys.argv[1]))
