"""What both workloads' profilers (``m2flow-plan``) measure alike: the learner's weight sync
to the rollout, on a GPU each component's offload and onload (context switch), a model's
size and the seconds of real iterations (``m2flow-plan --verify``); and the end of their
worker groups."""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from m2flow.pipelines import WorkerGroup
from m2flow.pipelines.planner import measure
from m2flow.pipelines.planner.profiles import Profile
from m2flow.runs.weights import sync_groups


def profile_sync(prof: Profile, learner: WorkerGroup, rollout: WorkerGroup, *, size_mb: float,
                 bucket_mb: float, cores: int, device: str = "cpu",
                 sync: Optional[Callable[[], None]] = None) -> None:
    """Adds ``learner.sync`` to ``prof`` (``size_mb``: the model's weights): the median of
    partial syncs after one full one, untimed (a run's first sync ships everything, later
    ones what an update changed). ``sync``: the device's synchronize (a GPU), so a timing
    covers the work it started."""
    sync_groups(learner, rollout, version=1, full=True, bucket_mb=bucket_mb)
    prof.add_time("learner", "sync", size=size_mb, cores=cores, device=device,
                  seconds=measure.median_seconds(lambda: sync_groups(
                      learner, rollout, version=1, full=False, bucket_mb=bucket_mb),
                      warm=1, sync=sync))


def profile_switch(prof: Profile, groups: dict[str, WorkerGroup], *,
                   sync: Callable[[], None]) -> None:
    """Adds ``offload`` and ``onload`` on the GPU of each group's rank 0 to ``prof`` (its
    registered state, moved for real: ``force`` off, the device is a GPU)."""
    for name, group in groups.items():
        w = group.handles[0]
        w.set_context_force(False)
        off = measure.median_seconds(w.offload, warm=0, min_calls=1, min_s=0.0, sync=sync)
        on = measure.median_seconds(w.onload, warm=0, min_calls=1, min_s=0.0, sync=sync)
        prof.add_time(name, "offload", size=0, cores=0, device="cuda", seconds=off)
        prof.add_time(name, "onload", size=0, cores=0, device="cuda", seconds=on)


def profile_handover(prof: Profile, learner: WorkerGroup, rollout: WorkerGroup, *,
                     size_mb: float, bucket_mb: float, sync: Callable[[], None]) -> None:
    """Adds, with ``learner`` and ``rollout`` on one GPU, the weight sync from the one to the
    other (:func:`profile_sync`) and each one's offload and onload (:func:`profile_switch`)
    to ``prof``."""
    profile_sync(prof, learner, rollout, size_mb=size_mb, bucket_mb=bucket_mb, cores=0,
                 device="cuda", sync=sync)
    profile_switch(prof, {"rollout": rollout, "learner": learner}, sync=sync)


def shutdown(*groups: Optional[WorkerGroup]) -> None:
    """Shuts down each of ``groups`` that was built (None: not yet), in order."""
    for group in groups:
        if group is not None:
            group.shutdown()


def model_mb(module: nn.Module) -> float:
    """The MiB of ``module``'s state dict (parameters and buffers) as it is stored.

    >>> model_mb(nn.Linear(256, 1024))  # (256 * 1024 + 1024) fp32 values
    1.00390625
    """
    return sum(t.numel() * t.element_size() for t in module.state_dict().values()) / 2**20


def iteration_seconds(runner, iterations: int, warm: int, *, key: str) -> list[float]:
    """``metrics[key]`` of each of ``iterations`` calls of ``runner.iterate`` (a
    :class:`~m2flow.runs.loop.RunLoop`) after ``warm`` untimed ones; then the work started
    ahead finishes (``drain``), and the runner closes, also on an error.

    >>> class Clock:  # iteration ``it`` takes it + 0.5 s
    ...     def iterate(self, it): return {"perf/iteration_s": it + 0.5}
    ...     def drain(self): print("drained")
    ...     def close(self): print("closed")
    >>> iteration_seconds(Clock(), 2, 1, key="perf/iteration_s")
    drained
    closed
    [1.5, 2.5]
    """
    try:
        out = []
        for it in range(warm + iterations):
            metrics = runner.iterate(it)
            if it >= warm:
                out.append(metrics[key])
        runner.drain()
        return out
    finally:
        runner.close()
