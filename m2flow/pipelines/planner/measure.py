"""What every profiler needs: this node, a warm median timer, pinning, memory of processes.

>>> t = median_seconds(lambda: None, warm=1, min_calls=3, min_s=0.0)
>>> 0.0 <= t < 0.01
True
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

from m2flow.pipelines.planner.profiles import Node

RAY_DAEMONS_MB = 250.0
"""Ray's own processes on a node (GCS, raylet, ...), in MB: what bench/memory.py finds,
with a margin."""


def this_node(cluster_cfg=None) -> Node:
    """This machine as the planner's node: the cores this process may use (at most
    ``cluster.num_cpus``), the visible GPUs (at most ``cluster.num_gpus``), total memory."""
    import psutil

    cores = len(os.sched_getaffinity(0))
    gpus, gpu_mb = 0, float("inf")
    try:
        import torch

        gpus = torch.cuda.device_count()
        if gpus:
            gpu_mb = torch.cuda.get_device_properties(0).total_memory / 2**20
    except Exception:  # noqa: BLE001 - no usable CUDA is no GPU
        gpus = 0
    if cluster_cfg is not None:
        if getattr(cluster_cfg, "num_cpus", None):
            cores = min(cores, int(cluster_cfg.num_cpus))
        if getattr(cluster_cfg, "num_gpus", None) is not None:
            gpus = min(gpus, int(cluster_cfg.num_gpus))
    return Node(cores=cores, gpus=gpus, memory_mb=psutil.virtual_memory().total / 2**20,
                gpu_memory_mb=gpu_mb if gpus else float("inf"))


def median_seconds(fn: Callable[[], object], *, warm: int = 2, min_calls: int = 3,
                   min_s: float = 1.0, max_calls: int = 20,
                   sync: Optional[Callable[[], None]] = None) -> float:
    """Median wall seconds of ``fn()`` after ``warm`` untimed calls: at least ``min_calls``
    timed calls, more until ``min_s`` seconds were spent (at most ``max_calls``). ``sync``
    (``torch.cuda.synchronize``) is called around each timed call."""
    for _ in range(warm):
        fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < min_calls or (spent < min_s and len(times) < max_calls):
        if sync:
            sync()
        t = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t)
        spent += times[-1]
    return statistics.median(times)


def descendants(pid: Optional[int] = None) -> list[int]:
    """Every live process started by ``pid`` (default: this one), children's children too."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid or os.getpid()).children(recursive=True)]
    except psutil.Error:
        return []


def pin_pids(pids: Sequence[int], cores: Sequence[int]) -> None:
    """Pins every thread of each process in ``pids`` to ``cores``."""
    cores = set(cores)
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cores)
            except OSError:  # a thread that just ended
                pass


@contextmanager
def on_cores(cores: Sequence[int], threads: Optional[int] = None) -> Iterator[None]:
    """This process (every thread) on ``cores`` and torch on ``threads`` threads (default:
    one per core) for the block; then back to what it had."""
    import torch

    before, nthreads = os.sched_getaffinity(0), torch.get_num_threads()
    pin_pids([os.getpid()], cores)
    torch.set_num_threads(threads or len(cores))
    try:
        yield
    finally:
        pin_pids([os.getpid()], before)
        torch.set_num_threads(nthreads)


def pss_mb(pids: Sequence[int]) -> float:
    """Proportional set size of ``pids`` together (MB): shared pages counted once overall."""
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except psutil.Error:
            pass
    return total / 2**20


def rss_mb(pid: Optional[int] = None) -> float:
    import psutil

    return psutil.Process(pid or os.getpid()).memory_info().rss / 2**20
