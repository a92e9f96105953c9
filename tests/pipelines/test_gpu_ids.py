"""GPU ids under an existing CUDA_VISIBLE_DEVICES (issue 13): placement GPU i is the i-th
visible GPU, for both backends; the local node counts visible GPUs only.

No GPU needed: the variable is set per test, and torch's device count is stood in for where a
machine with GPUs is meant.
"""

import os

import pytest
import torch

from m2flow.pipelines import PlacementError, RankResources, Worker, WorkerGroup, WorkerInfo
from m2flow.pipelines import cluster as cluster_mod
from m2flow.pipelines import worker as worker_mod
from m2flow.pipelines.cluster import ClusterConfig, gpu_names, expected_nodes, visible_gpus

VAR = "CUDA_VISIBLE_DEVICES"


@pytest.fixture(autouse=True)
def keep_the_variable():
    """A rank built in this process sets the variable itself (as in its own process): put
    back the value from before the test (set up before, so torn down after, monkeypatch)."""
    value = os.environ.get(VAR)
    yield
    if value is None:
        os.environ.pop(VAR, None)
    else:
        os.environ[VAR] = value


# --- reading the variable -----------------------------------------------------------------


@pytest.mark.parametrize("value", [
    "4,5", "", "0", "3,x,5", "1gpu2,2ampere", " 2, 3", "1,1", "2,-1,3", "+3,4", "NoDevFiles",
    "GPU-aa,GPU-bb", "GPU-aa,3,GPU-bb", "GPU-aa,GPU-aa", "MIG-x,MIG-y", "MIG-x,GPU-y",
])
def test_visible_gpus_reads_the_variable_as_torch_does(monkeypatch, value):
    assert torch.version.hip is None  # torch's parser reads HIP variables on ROCm builds
    monkeypatch.setenv(VAR, value)
    expected = [str(d) for d in torch.cuda._parse_visible_devices()]  # upstream's reading
    assert visible_gpus(value) == expected


@pytest.mark.parametrize("value, expected", [
    (None, None),  # unset: every GPU of the machine
    ("", []),
    ("4,5", ["4", "5"]),
    ("4,x,5", ["4"]),  # CUDA stops at the first entry it cannot read
    ("GPU-8f3a,MIG-1c2d", ["GPU-8f3a"]),
    ("1,0,1", []),  # a repeated entry: no GPU at all
])
def test_visible_gpus_hand_worked(value, expected):
    assert visible_gpus(value) == expected


# --- placement ids -> this rank's GPUs, both backends ---------------------------------------


def start(monkeypatch, backend, gpu_ids):
    """A rank built as its backend builds it, in this process; returns (its devices, the
    CUDA_VISIBLE_DEVICES it leaves for itself and its children)."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # keep the test's threads
    info = WorkerInfo("learner", 0, 1, RankResources(0, 1.0, tuple(gpu_ids)), backend)
    w = Worker(info)
    return w.devices, os.environ.get(VAR)


def physical(devices, visible):
    """The GPU each torch device names, in the machine's own names, given ``visible``."""
    return [visible[int(d.split(":")[1])] for d in devices]


@pytest.mark.parametrize("value, gpu_ids, names", [
    ("4,5", (1,), ["5"]),
    ("4,5", (0, 1), ["4", "5"]),
    ("GPU-a,GPU-b,GPU-c", (2, 0), ["GPU-c", "GPU-a"]),
    (None, (1,), ["1"]),
])
def test_both_backends_give_a_rank_the_ith_visible_gpus(monkeypatch, value, gpu_ids, names):
    if value is None:
        monkeypatch.delenv(VAR, raising=False)
        seen = [str(i) for i in range(8)]
    else:
        monkeypatch.setenv(VAR, value)
        seen = value.split(",")
    devices, env = start(monkeypatch, "local", gpu_ids)  # the driver's process: its numbering
    assert env == value and physical(devices, seen) == names
    devices, env = start(monkeypatch, "ray", gpu_ids)  # its own process: narrowed to its GPUs
    assert env == ",".join(names) and devices == [f"cuda:{j}" for j in range(len(names))]
    assert physical(devices, env.split(",")) == names


def test_a_cpu_rank_in_its_own_process_sees_no_gpu(monkeypatch):
    monkeypatch.setenv(VAR, "4,5")
    assert start(monkeypatch, "ray", ()) == ([], "")
    assert Worker(WorkerInfo("env", 0, 1, RankResources(0, 1.0, ()), "local")).device == "cpu"


def test_each_backend_maps_ids_through_gpu_names(monkeypatch):
    calls = []

    def recording(ids, visible):
        calls.append((tuple(ids), visible))
        return gpu_names(ids, visible)

    monkeypatch.setattr(worker_mod, "gpu_names", recording)
    monkeypatch.setenv(VAR, "4,5")
    for backend in ("local", "ray"):
        start(monkeypatch, backend, (1,))
        monkeypatch.setenv(VAR, "4,5")
    assert calls == [((1,), ["4", "5"])] * 2


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_gpu_id_past_the_visible_ones_names_the_variable(monkeypatch, backend):
    monkeypatch.setenv(VAR, "4")
    with pytest.raises(PlacementError, match=r"placement GPU 1 .*CUDA_VISIBLE_DEVICES.*ids 0-0"):
        start(monkeypatch, backend, (0, 1))


class Probe(Worker):
    def gpus(self):
        return self.devices, os.environ.get(VAR)


def test_a_ray_rank_narrows_its_own_variable(ray_cluster):
    visible = visible_gpus(os.environ.get(VAR))  # the cluster started with this environment
    ids = (1,) if visible is None or len(visible) >= 2 else ()
    group = WorkerGroup(ray_cluster, "probe", Probe, [RankResources(0, 1.0, ids)])
    try:
        (got,) = group.call(Probe.gpus).wait(timeout=60)
    finally:
        group.shutdown()
    assert got == ([f"cuda:{j}" for j in range(len(ids))], ",".join(gpu_names(ids, visible)))


# --- the local node's count -----------------------------------------------------------------


@pytest.fixture
def eight_gpus(monkeypatch):
    """A machine with 8 GPUs whose CUDA started before the variable was set: torch's count
    (cached at start) no longer follows it, the processes it starts do."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)


@pytest.mark.parametrize("value, count", [("4,5", 2), ("", 0), ("4,x,5", 1), (None, 8)])
def test_the_local_node_counts_only_visible_gpus(monkeypatch, eight_gpus, value, count):
    if value is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, value)
    assert expected_nodes(ClusterConfig(backend="local"))[0].num_gpus == count


def test_num_gpus_above_the_visible_ones_is_refused(monkeypatch, eight_gpus):
    monkeypatch.setenv(VAR, "4,5")
    fragment = r"cluster.num_gpus=4, .*CUDA_VISIBLE_DEVICES='4,5'.*at most 2"
    with pytest.raises(ValueError, match=fragment):
        expected_nodes(ClusterConfig(backend="local", num_gpus=4))
    assert expected_nodes(ClusterConfig(backend="local", num_gpus=2))[0].num_gpus == 2


def test_a_local_ray_is_given_the_count_placement_uses(monkeypatch, eight_gpus):
    import ray

    seen = {}
    monkeypatch.setenv(VAR, "4,x,5")  # Ray alone would count 3 entries; CUDA shows 1 GPU
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setattr(cluster_mod, "_ray_nodes", lambda: [])
    cluster_mod.Cluster(ClusterConfig(backend="ray"))
    assert seen["num_gpus"] == 1
