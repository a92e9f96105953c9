"""How device data crosses processes (issue 13): copied to the CPU at the sender, leaf by leaf.

No test here needs a GPU but the last: ``meta`` tensors stand for CUDA ones. They refuse
``.numpy()`` and a copy to the CPU like a CUDA tensor in a process without the GPU would, so
the one step that needs a device, the device-to-host copy, is stood in for by a function that
records what it was given and hands back known CPU values.
"""

import pytest
import torch
from tensordict import TensorDict

from m2flow.pipelines import Channel, Cluster, ClusterConfig, RankResources, Worker, WorkerGroup
from m2flow.pipelines import transport
from m2flow.pipelines.channel import close_endpoint


def on_host(t: torch.Tensor) -> torch.Tensor:
    """The CPU values the stand-in copy gives a non-CPU tensor: 0, 1, 2, ... in its shape."""
    return torch.arange(t.numel()).reshape(t.shape).to(t.dtype)


@pytest.fixture
def copies(monkeypatch):
    """Stands in for the device-to-host copy; records every tensor it was asked to copy. Also
    makes ``.numpy()`` on a non-CPU tensor fail loudly, wherever it is called."""
    seen = []

    def host_copies(tensors):
        seen.extend(tensors)
        assert all(t.device.type != "cpu" for t in tensors), "copied a CPU tensor"
        return [on_host(t) for t in tensors]

    numpy = torch.Tensor.numpy

    def checked_numpy(self, *a, **kw):
        assert self.device.type == "cpu", f".numpy() on a {self.device} tensor"
        return numpy(self, *a, **kw)

    monkeypatch.setattr(transport, "_host_copies", host_copies, raising=False)
    monkeypatch.setattr(torch.Tensor, "numpy", checked_numpy)
    return seen


def mixed(device):
    """An env step as a GPU env worker makes it: device leaves, one CPU leaf (the worker's
    own bookkeeping), nested keys; ``device`` is the TensorDict's (None: not uniform)."""
    td = TensorDict({"obs": {"state": torch.empty(2, 3, device="meta")},
                     "next": {"done": torch.empty(2, dtype=torch.bool, device="meta")}},
                    batch_size=[2], device=device)
    if device is None:
        td["reward"] = torch.tensor([0.5, -1.0])
    return td


@pytest.mark.parametrize("device", [None, "meta"], ids=["device=None", "device=meta"])
def test_device_leaves_cross_a_socket_as_cpu_tensors_copied_at_the_sender(copies, device):
    td = mixed(device)
    key, timeout, got = transport.decode(transport.encode((0, 1), td, 2.0))
    assert (key, timeout, got.batch_size) == ((0, 1), 2.0, torch.Size([2]))
    assert sorted(t.shape for t in copies) == [(2,), (2, 3)]  # each device leaf once
    for k, v in td.items(include_nested=True, leaves_only=True):
        assert got[k].device.type == "cpu", k
        expected = v if v.device.type == "cpu" else on_host(v)
        assert got[k].dtype == v.dtype and torch.equal(got[k], expected), k


def test_cpu_items_are_not_copied(copies):
    td = TensorDict({"obs": {"state": torch.rand(2, 3)}}, batch_size=[2])
    assert transport.to_host(td) is td
    got = transport.decode(transport.encode(0, td))[2]
    assert torch.equal(got["obs", "state"], td["obs", "state"]) and not copies


def test_tensors_in_plain_containers_go_to_the_host_too(copies):
    item = {"ids": [torch.empty(3, device="meta"), 7], "mask": torch.ones(2)}
    got = transport.decode(transport.encode(0, item))[2]
    assert torch.equal(got["ids"][0], torch.arange(3.0)) and got["ids"][1] == 7
    assert torch.equal(got["mask"], torch.ones(2))


@pytest.fixture
def sink():
    group = WorkerGroup(Cluster(ClusterConfig(backend="local", num_gpus=0)), "sink", Worker,
                        [RankResources(0, 1.0, ())])
    yield group
    group.shutdown()


class RemoteRank:
    """Stands in for a Ray actor handle on another machine: keeps what a put sends it."""

    def __init__(self):
        self.sent = []
        self._m2flow_channel_put = self

    def remote(self, uid, key, item, timeout):
        self.sent.append(item)
        return None


def test_a_put_to_another_machine_sends_cpu_tensors(copies, sink):
    ch = Channel("trajectory", sink, item_type=TensorDict)
    close_endpoint(ch.uid, 0)  # the rank lives elsewhere: no local queue, no socket
    ch._handles, ch._addresses = [RemoteRank()], [("another-machine", None)]
    ch.put(mixed(None), key=0)
    (sent,) = ch._handles[0].sent
    assert all(v.device.type == "cpu" for v in sent.values(include_nested=True, leaves_only=True))
    assert torch.equal(sent["obs", "state"], torch.arange(6.0).view(2, 3)) and len(copies) == 2


def test_a_put_in_the_same_process_hands_the_item_over_as_it_is(copies, sink):
    ch = Channel("obs", sink, item_type=TensorDict)
    td = mixed("meta")
    ch.put(td, key=0)
    assert ch.get(key=0) is td and not copies


# --- GPU: a real CUDA TensorDict through a real channel between two Ray workers ------------


class CudaProducer(Worker):
    def send(self, ch):
        dev = self.device
        td = TensorDict({"obs": {"state": torch.arange(6.0, device=dev).view(2, 3)},
                         "done": torch.tensor([True, False], device=dev)}, batch_size=[2])
        td["reward"] = torch.tensor([0.5, -1.0])  # a CPU leaf: device=None
        ch.put(td, key=0, timeout=60)
        ch.flush()
        return dev, torch.cuda.is_available()


class HostConsumer(Worker):
    def take(self, ch):
        td = ch.get(key=0, timeout=60)
        return torch.cuda.is_available(), {
            "/".join(k) if isinstance(k, tuple) else k: (v.device.type, v.tolist())
            for k, v in td.items(include_nested=True, leaves_only=True)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_tensordict_crosses_to_a_ray_worker_without_a_gpu(ray_cluster):
    producer = WorkerGroup(ray_cluster, "gpu-producer", CudaProducer, [RankResources(0, 1.0, (0,))])
    consumer = WorkerGroup(ray_cluster, "cpu-consumer", HostConsumer, [RankResources(0, 1.0, ())])
    try:
        ch = Channel("trajectory", consumer, item_type=TensorDict)
        (device, producer_sees_gpu), = producer.call(CudaProducer.send, ch).wait(timeout=120)
        (consumer_sees_gpu, got), = consumer.call(HostConsumer.take, ch).wait(timeout=120)
    finally:
        producer.shutdown()
        consumer.shutdown()
    assert device == "cuda:0" and producer_sees_gpu and not consumer_sees_gpu
    assert got == {"obs/state": ("cpu", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]),
                   "done": ("cpu", [True, False]), "reward": ("cpu", [0.5, -1.0])}
