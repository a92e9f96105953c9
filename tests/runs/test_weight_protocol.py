"""The weight-sync protocol between real Ray workers (``runs.weights``: ``SendsWeights``,
``ReceivesWeights``, ``sync_groups``): the driver makes one call per sync whatever the number
of buckets, the buckets reach every receiver from the sender (each receiver counts them), and
both transports leave every receiver bit-equal to the sender, a full sync then a delta one.

The receivers start from other weights (another seed, other buffers) and the sender's change
between the syncs moves a weight cut in row ranges, a bf16 parameter and a buffer, so a
bucket that did not arrive, or a piece loaded at the wrong rows, leaves a difference. The
driver's calls are counted where every call of the driver goes through (``Peers.call``), in
this process only: the sender's own calls to the receivers happen in its process.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from m2flow.pipelines import Placement, PlacementConfig, Worker, WorkerGroup
from m2flow.pipelines.link import form_link
from m2flow.pipelines.placement import ComponentPlacement
from m2flow.pipelines.worker import Peers
from m2flow.runs.weights import (ReceivesWeights, SendsWeights, WeightReceiver, WeightSender,
                                 WeightSyncError, sync_groups)

RECEIVERS = 2
SMALL_MB = 40 / 2**20  # 40-byte buckets: the 8x4 fp32 weight (128 B) goes 2 rows a bucket
LARGE_MB = 1.0  # the whole model in one bucket


class Mixed(nn.Module):
    def __init__(self, seed: int, extra: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc = nn.Linear(4, 8)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(8, 4, generator=g))
            self.fc.bias.copy_(torch.randn(8, generator=g))
        self.low = nn.Parameter(torch.randn(5, 3, generator=g).bfloat16())
        self.register_buffer("steps", torch.arange(3) + 100 * seed)
        self.register_buffer("count", torch.tensor(float(seed)))
        if extra:  # a tensor the sender does not have: a full sync must refuse this receiver
            self.register_buffer("other", torch.zeros(2))


class Sender(SendsWeights, Worker):
    def __init__(self, info):
        super().__init__(info)
        self.model = Mixed(seed=0)
        self.weights = WeightSender(self.model)

    def change(self) -> None:
        """What an update does: trainable weights and one buffer move."""
        with torch.no_grad():
            self.model.fc.weight.mul_(-2.0)
            self.model.low.add_(1.0)
            self.model.count.add_(7.0)

    def state(self) -> dict:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


class Receiver(ReceivesWeights, Worker):
    def __init__(self, info, extra: bool = False):
        super().__init__(info)
        self.model = Mixed(seed=1 + self.rank, extra=extra)
        self.receiver = WeightReceiver(self.model)
        self.buckets = 0

    def weight_receiver(self) -> WeightReceiver:
        return self.receiver

    def receive_weight_bucket(self, bucket) -> None:
        self.buckets += 1  # counted here, in the receiver: the calls the sender made
        super().receive_weight_bucket(bucket)

    def count(self) -> int:
        n, self.buckets = self.buckets, 0
        return n

    def state(self) -> tuple[int, dict]:
        return self.version, {k: v.clone() for k, v in self.model.state_dict().items()}


@pytest.fixture(scope="module")
def groups(ray_cluster):
    comps = {"learner": ComponentPlacement(), "rollout": ComponentPlacement(workers=RECEIVERS)}
    placement = Placement(PlacementConfig(mode="hybrid", components=comps), ray_cluster.nodes)
    sender = WorkerGroup(ray_cluster, "learner", Sender, placement.ranks("learner"))
    receivers = WorkerGroup(ray_cluster, "rollout", Receiver, placement.ranks("rollout"))
    link = form_link(ray_cluster, "weights", sender, receivers)
    yield sender, receivers, link.name, placement
    link.close()
    receivers.shutdown()
    sender.shutdown()


def counting_driver_calls(monkeypatch) -> list:
    """Patches ``Peers.call`` in this process (``WorkerGroup.call`` goes through it); the
    returned list gets (group, method) per call the driver makes."""
    calls, real = [], Peers.call

    def call(self, method, *args, **kwargs):
        calls.append((self.name, method.__name__))
        return real(self, method, *args, **kwargs)
    monkeypatch.setattr(Peers, "call", call)
    return calls


def bit_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("transport", ["ray", "dist"])
def test_one_driver_call_per_sync_and_every_receiver_bit_equal(groups, transport, monkeypatch):
    sender, receivers, link_name, _ = groups
    link = link_name if transport == "dist" else None
    # a mirror of the sender here, changed and prepared in step with it: what each sync ships
    mirror = Mixed(seed=0)
    mirror.load_state_dict(sender.call(Sender.state).wait()[0])
    plan = WeightSender(mirror)
    for bucket_mb in (SMALL_MB, LARGE_MB):
        for full in (True, False):
            if not full:
                sender.call(Sender.change).wait()
                Sender.change(SimpleNamespace(model=mirror))
            k = len(plan.prepare(full=full, cap_bytes=int(bucket_mb * 2**20)).buckets)
            assert k >= 5 if bucket_mb == SMALL_MB else k == 1
            receivers.call(Receiver.count).wait()  # (reset)
            calls = counting_driver_calls(monkeypatch)
            sync_groups(sender, receivers, version=7 + full, full=full, bucket_mb=bucket_mb,
                        link=link)
            monkeypatch.undo()
            assert calls == [("learner", "send_weights")], (bucket_mb, full)
            # by object, one call per bucket on each receiver (from the sender); by link none
            assert receivers.call(Receiver.count).wait() == [k if link is None else 0] * RECEIVERS
            want = mirror.state_dict()
            assert bit_equal(sender.call(Sender.state).wait()[0], want)
            for rank, (version, got) in enumerate(receivers.call(Receiver.state).wait()):
                assert version == 7 + full and bit_equal(got, want), (bucket_mb, full, rank)


def test_a_receivers_refusal_reaches_the_driver_through_the_sender(ray_cluster, groups):
    sender, _, _, placement = groups
    odd = WorkerGroup(ray_cluster, "rollout", Receiver, placement.ranks("rollout"), extra=True)
    try:
        with pytest.raises(WeightSyncError, match="a full sync without 1 of this model's"):
            sync_groups(sender, odd, version=1, full=True, bucket_mb=LARGE_MB)
    finally:
        odd.shutdown()


def test_in_process_ranks_refuse_to_leave_their_process():
    """An in-process group's ``Peers`` are its worker objects: handing them to a worker in
    another process would copy the workers, so pickling them is an error naming the group."""
    import pickle

    from m2flow.pipelines import Cluster, ClusterConfig, RankResources

    cluster = Cluster(ClusterConfig(backend="local", num_gpus=0))
    group = WorkerGroup(cluster, "rollout", Receiver, [RankResources(0, 1.0, ())])
    try:
        with pytest.raises(TypeError, match="in-process group 'rollout' cannot leave"):
            pickle.dumps(group.peers())
    finally:
        group.shutdown()
