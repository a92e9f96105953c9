"""Weight buckets as flat buffers broadcast over a gloo link (``cluster.weight_sync=dist``):
a full sync, then a delta sync, from member 0 to two receivers, in real processes.

The model mixes what a flat buffer must lay out right: fp32 and bf16 parameters, an int64,
a bool and a 0-dim buffer, and tensors cut into row ranges by a small bucket cap. The
receivers start from other weights (another seed, other buffer values), so a piece that does
not arrive, or lands at the wrong offset or dtype, leaves a difference. Member 0 is also
rank 0 of a data-parallel default group (as learner rank 0 is with several learners), which
the link must not disturb.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from torch import nn

from m2flow.pipelines import distributed
from m2flow.runs.weights import WeightReceiver, WeightSender

CAP = 40  # bytes per bucket: the 8x4 fp32 weight (128 B) travels in row ranges of 2 rows


class Mixed(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc = nn.Linear(4, 8)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(8, 4, generator=g))
            self.fc.bias.copy_(torch.randn(8, generator=g))
        self.low = nn.Parameter(torch.randn(5, 3, generator=g).bfloat16())
        self.register_buffer("steps", torch.arange(3) + 100 * seed)
        self.register_buffer("mask", torch.tensor([True, False, seed % 2 == 0]))
        self.register_buffer("count", torch.tensor(float(seed)))


def sender_side() -> tuple[Mixed, WeightSender]:
    model = Mixed(seed=0)
    return model, WeightSender(model)


def change(model: Mixed) -> None:
    """What an update does: trainable weights and one buffer move."""
    with torch.no_grad():
        model.fc.weight.mul_(-2.0)
        model.low.add_(1.0)
        model.count.add_(7.0)


def _member(proc: int, dp_spec, link_spec, out: str) -> None:
    torch.set_num_threads(1)
    dp = distributed.join(dp_spec, proc, "cpu") if proc < 2 else None  # learner ranks 0, 1
    try:
        if proc == 1:  # learner rank 1: in the data-parallel group, not in the link
            dp.sum(torch.ones(1))
            return
        link = distributed.join_link(link_spec, 0 if proc == 0 else proc - 1, "cpu", "weights")
        model, sender = sender_side()
        if proc == 0:
            sender.prepare(full=True, cap_bytes=CAP)
            sender.broadcast(link)
            change(model)
            assert float(dp.sum(torch.ones(1))) == 2.0  # the default group still works
            sender.prepare(full=False, cap_bytes=CAP)
            sender.broadcast(link)
            return
        own = Mixed(seed=proc)
        receiver, states = WeightReceiver(own), []
        for full in (True, False):
            if not full:
                change(model)
            manifest = sender.prepare(full=full, cap_bytes=CAP)  # from the sender's shapes
            receiver.begin(manifest.keys, full=full, stage=not full)
            receiver.receive_broadcast(link, manifest)
            receiver.finish()
            states.append({k: v.clone() for k, v in own.state_dict().items()})
        torch.save(states, f"{out}/member{proc}.pt")
        link.close()
    finally:
        if dp is not None:
            distributed.leave()


def test_full_then_delta_sync_over_a_gloo_link_is_bit_exact(tmp_path):
    port = distributed.free_port
    dp_spec = distributed.ProcessGroupSpec("127.0.0.1", port(), 2, "gloo", timeout_s=120)
    link_spec = distributed.ProcessGroupSpec("127.0.0.1", port(), 3, "gloo", timeout_s=120)
    mp.start_processes(_member, args=(dp_spec, link_spec, str(tmp_path)), nprocs=4,
                       start_method="spawn")
    model, sender = sender_side()
    first = sender.prepare(full=True, cap_bytes=CAP)
    assert any(p.rows is not None for b in first.buckets for p in b)  # row ranges exercised
    want = [{k: v.clone() for k, v in model.state_dict().items()}]
    change(model)
    delta = sender.prepare(full=False, cap_bytes=CAP)
    assert "count" in delta.keys and "steps" not in delta.keys  # unchanged buffers stay home
    want.append(model.state_dict())
    for proc in (2, 3):
        got = torch.load(tmp_path / f"member{proc}.pt")
        start = Mixed(seed=proc).state_dict()
        for i in range(2):
            for k, v in want[i].items():
                assert got[i][k].dtype == v.dtype and torch.equal(got[i][k], v), (proc, i, k)
            assert not all(torch.equal(start[k], v) for k, v in want[i].items())
