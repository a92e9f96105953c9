"""How fast is one full weight sync from learner rank 0 to M rollout ranks, by each transport?

For a model of ``--mb`` MB of fp32 weights (tensors of ``TENSOR_MB`` each), one sender and
``--rollout-workers`` receivers (Ray actors, as the runner places learner and rollout), it
times one full sync, bucket by bucket (``--bucket-mb``, the runner's default 256), over

- ``ray``: ``cluster.weight_sync=ray``, each bucket a Ray object every receiver fetches;
- ``dist``: ``cluster.weight_sync=dist``, each bucket one flat buffer broadcast over the link
  (gloo, or NCCL with ``--device cuda`` and a GPU per rank);

against two ceilings of the same bytes, in the same run:

- ``copy``: one tensor copy in this process (``dst.copy_(src)``, on the device);
- ``flat``: one broadcast of a single flat buffer of all the bytes over the same link,
  preallocated on every member (no packing, no buckets, no loading).

Each is the median of ``--repeats`` after a warm-up sync. GB/s is the model's bytes over the
seconds of one sync (every receiver gets all of them: the bytes moved are M times that).
Both sync paths run the code the runner runs (``runs.weights``: one driver call to the sender,
which sends the manifest and buckets to the receivers itself; their name checks and loads;
``pipelines.link``); the receivers check the sum of their weights against
the sender's after each timed path.

    python bench/weight_sync.py [--mb 100 1000] [--rollout-workers 2] [--bucket-mb 256]
                                [--repeats 3] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from m2flow.pipelines import Cluster, ClusterConfig, Placement, PlacementConfig, Worker
from m2flow.pipelines.link import form_link
from m2flow.pipelines.placement import ComponentPlacement
from m2flow.pipelines.futures import gather
from m2flow.pipelines.worker import WorkerGroup
from m2flow.runs.weights import (ReceivesWeights, SendsWeights, WeightReceiver, WeightSender,
                                 sync_groups)

TENSOR_MB = 64  # the model's tensors (a large model's layers are tens to hundreds of MB)
ROW = 1024  # fp32 values per row: a tensor larger than a bucket is cut in rows


class Blob(torch.nn.Module):
    """``mb`` MB of fp32 parameters in tensors of at most ``TENSOR_MB``, seeded."""

    def __init__(self, mb: float, device: str, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        rows_left, i = int(mb * 2**20) // (4 * ROW), 0
        while rows_left > 0:
            rows = min(rows_left, TENSOR_MB * 2**20 // (4 * ROW))
            self.register_parameter(f"w{i}", torch.nn.Parameter(
                torch.rand(rows, ROW, generator=g).to(device)))
            rows_left, i = rows_left - rows, i + 1


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Sender(SendsWeights, Worker):
    def __init__(self, info, mb: float):
        super().__init__(info)
        self.model = Blob(mb, self.device, seed=0)
        self.weights, self.flat = WeightSender(self.model), None

    def flat_broadcast(self, *, link: str, nbytes: int) -> None:
        self.flat = flat_buffer(self.flat, nbytes, self.link(link).device)
        self.link(link).broadcast(self.flat, src=0)

    def checksum(self) -> float:
        return float(sum(p.detach().double().sum() for p in self.model.parameters()))


class Receiver(ReceivesWeights, Worker):
    stage_delta_syncs = True  # as the runner's rollout (the syncs timed here are full ones)

    def __init__(self, info, mb: float):
        super().__init__(info)
        self.model = Blob(mb, self.device, seed=1 + self.rank)  # other weights until synced
        self.receiver, self.flat = WeightReceiver(self.model), None

    def weight_receiver(self) -> WeightReceiver:
        return self.receiver

    def finish_weight_sync(self) -> None:
        super().finish_weight_sync()
        sync(self.device)  # the timing covers the loads queued on a GPU

    def flat_broadcast(self, *, link: str, nbytes: int) -> None:
        self.flat = flat_buffer(self.flat, nbytes, self.link(link).device)
        self.link(link).broadcast(self.flat, src=0)

    def checksum(self) -> float:
        return float(sum(p.detach().double().sum() for p in self.model.parameters()))


def flat_buffer(buf, nbytes: int, device: str) -> torch.Tensor:
    """A buffer of ``nbytes`` on ``device``, kept between calls (touched once, so its pages
    exist before the timed broadcasts)."""
    if buf is None or buf.numel() != nbytes:
        buf = torch.ones(nbytes, dtype=torch.uint8, device=device)
    return buf


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plain_copy_seconds(nbytes: int, device: str, repeats: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)
        sync(device)
    seconds = median_seconds(copy, repeats)
    del src, dst
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, nargs="+", default=[100.0, 1000.0],
                   help="model sizes in MB of fp32 weights")
    p.add_argument("--rollout-workers", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=256.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: sender on GPU 0, receiver r on GPU 1 + r (NCCL) or all on "
                        "GPU 0 when there are fewer GPUs (gloo through host memory)")
    args = p.parse_args()
    m = args.rollout_workers
    store_mb = int(max(512, 3 * args.bucket_mb))
    cluster = Cluster(ClusterConfig(backend="ray", object_store_memory_mb=store_mb))
    gpus = cluster.num_gpus
    if args.device == "cuda":
        own = gpus >= m + 1
        comps = {"learner": ComponentPlacement(gpus=[0]),
                 "rollout": ComponentPlacement(workers=m, gpus=list(range(1, m + 1)) if own
                                               else [0])}
    else:
        comps = {"learner": ComponentPlacement(), "rollout": ComponentPlacement(workers=m)}
    placement = Placement(PlacementConfig(mode="hybrid", components=comps), cluster.nodes)
    print(f"{m} receivers; bucket {args.bucket_mb:g} MB; device {args.device}; "
          f"{cluster.nodes[0].num_cpus} CPUs, {gpus} GPUs; median of {args.repeats}")
    print(f"{'MB':>7} {'path':<6} {'link':<5} {'s/sync':>8} {'GB/s':>7} {'of copy':>8} "
          f"{'of flat':>8}")
    for mb in args.mb:
        sender = WorkerGroup(cluster, "learner", Sender, placement.ranks("learner"), mb)
        receivers = WorkerGroup(cluster, "rollout", Receiver, placement.ranks("rollout"), mb)
        link = form_link(cluster, "weights", sender, receivers)
        nbytes = int(mb * 2**20) // (4 * ROW) * 4 * ROW
        want = sender.call(Sender.checksum).wait()[0]

        def full_sync(name):
            sync_groups(sender, receivers, version=0, full=True, bucket_mb=args.bucket_mb,
                        link=name)

        def flat():
            gather(sender.call(Sender.flat_broadcast, link="weights", nbytes=nbytes),
                   receivers.call(Receiver.flat_broadcast, link="weights", nbytes=nbytes))
        copy_s = plain_copy_seconds(nbytes, "cuda" if args.device == "cuda" else "cpu",
                                    args.repeats)
        flat_s = median_seconds(flat, args.repeats)
        rows = [("copy", "-", copy_s), ("flat", link.backend, flat_s)]
        for path, name in (("ray", None), ("dist", "weights")):
            seconds = median_seconds(lambda: full_sync(name), args.repeats)
            got = receivers.call(Receiver.checksum).wait()
            assert all(abs(g - want) <= 1e-9 * abs(want) for g in got), (path, got, want)
            rows.append((path, "-" if name is None else link.backend, seconds))
        for path, backend, seconds in rows:
            rate = nbytes / 1e9 / seconds
            print(f"{nbytes / 2**20:>7.0f} {path:<6} {backend:<5} {seconds:>8.3f} {rate:>7.2f} "
                  f"{copy_s / seconds:>8.2f} {flat_s / seconds:>8.2f}")
        link.close()
        receivers.shutdown()
        sender.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
