"""Weight shipping (m2flow.runs.weights, m2flow.runs.buckets): what a sync selects, how it cuts buckets, and that a
receiving copy ends up equal to the sender, against hand-worked sizes and peft's own naming."""

import pytest
import torch
from torch import nn

from m2flow.runs.buckets import Piece, cut_buckets, make_bucket, sync_manifest
from m2flow.runs.weights import WeightReceiver, WeightSender, WeightSyncError


class Net(nn.Module):
    """Two linear layers and a running statistic (a buffer the trainer changes)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self.register_buffer("stat", torch.zeros(6))
        self.register_buffer("fixed", torch.arange(4.0))  # never changes


def lora_net(seed: int) -> nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    net = Net(seed)
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["body.0", "body.2"]), net)
    for name, p in net.named_parameters():
        p.requires_grad = "lora_" in name
    return net


def sync(sender: WeightSender, receiver: nn.Module, *, full: bool, cap: int):
    manifest = sender.prepare(full=full, cap_bytes=cap)
    sink = WeightReceiver(receiver)
    sink.begin(manifest.keys, full=manifest.full)
    for i in range(len(manifest.buckets)):
        sink.receive(sender.bucket(i))
    sink.finish()
    return manifest


def test_a_delta_sync_ships_the_lora_adapters_and_the_changed_buffer_only():
    net = lora_net(0)
    sender = WeightSender(net)
    first = sender.prepare(full=False, cap_bytes=1 << 20)
    assert first.full and first.keys == list(net.state_dict())  # nothing was shipped before
    with torch.no_grad():
        net.stat += 1.0
    manifest = sender.prepare(full=False, cap_bytes=1 << 20)
    # peft names its adapters lora_A / lora_B; the frozen base weights and the unchanged
    # buffer stay home
    expected = {k for k in net.state_dict() if ".lora_" in k} | {"stat"}
    assert len(expected) == 5 and set(manifest.keys) == expected and not manifest.full
    assert set(sender.prepare(full=False, cap_bytes=1 << 20).keys) == expected - {"stat"}


def test_buckets_on_a_hand_worked_example():
    m = lambda *shape, dtype=torch.float32: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    t = {"a": m(10), "b": m(5), "c": m(20), "d": m(30, 4, dtype=torch.bfloat16), "e": m(()),
         "f": m(2, 50)}
    got = cut_buckets(t, list(t), cap_bytes=100)
    # a 40 B + b 20 B; c 80 B; d is 240 B in rows of 8 B: 12 rows (96 B) a piece; e 4 B joins
    # d's last piece (48 B); f's rows are 200 B each, over the cap: one row a bucket
    assert got == [
        [Piece("a", 40), Piece("b", 20)],
        [Piece("c", 80)],
        [Piece("d", 96, (0, 12))],
        [Piece("d", 96, (12, 24))],
        [Piece("d", 48, (24, 30)), Piece("e", 4)],
        [Piece("f", 200, (0, 1))],
        [Piece("f", 200, (1, 2))],
    ]
    for bucket in got:
        assert sum(p.nbytes for p in bucket) <= 100 or len(bucket) == 1


def test_a_copy_equals_the_sender_after_full_and_delta_syncs_in_small_buckets():
    src, dst = lora_net(0), lora_net(1)
    sender = WeightSender(src)
    manifest = sync(sender, dst, full=True, cap=64)  # the 8x6 weight (192 B) goes in row ranges
    assert any(p.rows is not None for b in manifest.buckets for p in b)
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    with torch.no_grad():  # a training step and a statistics update
        for p in src.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
        src.stat.add_(2.0)
    sync(sender, dst, full=False, cap=64)
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k


def test_a_staged_sync_changes_nothing_until_finish():
    src, dst = Net(0), Net(1)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    manifest = sync_manifest(src, full=True, cap_bytes=64)
    sink = WeightReceiver(dst)
    sink.begin(manifest.keys, full=True, stage=True)
    for pieces in manifest.buckets:
        sink.receive(make_bucket(src.state_dict(), pieces))
    assert all(torch.equal(dst.state_dict()[k], v) for k, v in before.items())
    sink.finish()
    assert torch.equal(dst.body[0].weight, src.body[0].weight)


def test_names_are_checked_exactly():
    dst = Net(1)
    sink = WeightReceiver(dst)
    with pytest.raises(WeightSyncError, match="'body.0.wieght'"):
        sink.begin(["body.0.wieght"], full=False)
    with pytest.raises(WeightSyncError, match="full sync without 1 of this model's tensors"):
        sink.begin([k for k in dst.state_dict() if k != "fixed"], full=True)
    manifest = sync_manifest(Net(0), full=True, cap_bytes=64)
    sink.begin(manifest.keys, full=True)
    sink.receive(make_bucket(Net(0).state_dict(), manifest.buckets[0]))
    with pytest.raises(WeightSyncError, match="did not arrive whole"):
        sink.finish()
