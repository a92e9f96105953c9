"""The cluster: a local Ray by default, an existing Ray cluster with ``address``, or no Ray.

>>> cluster = Cluster(ClusterConfig(backend="local"))
>>> cluster.nodes[0].num_cpus > 0
True
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from m2flow.pipelines.errors import PlacementError

if TYPE_CHECKING:
    from m2flow.pipelines.watchdog import Watchdog

BACKENDS = ("ray", "local")
WEIGHT_SYNC = ("auto", "ray", "dist")  # how weights travel to the rollout (pipelines.link)
MIN_OBJECT_STORE_MB = 75  # Ray refuses a smaller object store
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
_UUID_PREFIXES = ("GPU-", "MIG-")  # a whole GPU's UUID, or one MIG instance's


@dataclass
class ClusterConfig:
    """How to reach the machines. Placement of components lives in ``PlacementConfig``."""

    backend: str = "ray"
    """'ray': components are Ray actors; 'local': components live in this process (threads)."""
    address: Optional[str] = None
    """None starts a local Ray; 'auto' or 'host:port' joins an existing Ray cluster."""
    num_cpus: Optional[int] = None
    """CPUs a local Ray may use (None: all of this machine's)."""
    num_gpus: Optional[int] = None
    """GPUs this machine offers (local backend, or a local Ray): at most the ones visible to
    this process (``CUDA_VISIBLE_DEVICES``). None: all visible ones."""
    object_store_memory_mb: int = 512
    """Size of a local Ray's object store; bounded so Ray does not take a third of RAM."""
    context_switch: str = "auto"
    """auto: components placed on a common GPU take turns on it (offload/onload of weights,
    gradients, optimiser state); always: switch even on CPU (copies; for tests and dry runs);
    never: keep everything resident (the device must hold it all)."""
    weight_sync: str = "auto"
    """How weights travel from learner rank 0 to the rollout ranks, bucket by bucket. ray: each
    bucket a Ray object the rollout ranks fetch; dist: each bucket one flat buffer broadcast
    over a torch.distributed group of learner rank 0 and the rollout ranks (gloo, or NCCL when
    all of them have GPUs of their own; needs backend=ray); auto: dist with backend=ray and
    more than one rollout worker (or NCCL), else ray. See m2flow.pipelines.link."""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str
    num_cpus: int
    num_gpus: int
    resources: frozenset = frozenset()
    """The node's custom Ray resources (``ray start --resources``), by name."""


class Cluster:
    """Starts or joins the machines the components will be placed on.

    ``stop``: the event that, once set, ends every stoppable wait on this cluster's workers
    (``pipelines.futures``) and the start-up of its worker groups: a run's ``RunControl.stop``,
    set by Ctrl-C. None: an event of the cluster's own, which nothing else sets.
    ``watchdog``: the run's :class:`~m2flow.pipelines.watchdog.Watchdog`, which the driver's
    waits on this cluster's workers consult (its thread's only); None: none watches them."""

    def __init__(self, cfg: ClusterConfig, stop: Optional[threading.Event] = None,
                 watchdog: Optional[Watchdog] = None):
        check_cluster(cfg)
        self.cfg = cfg
        self.stop = threading.Event() if stop is None else stop
        self.watchdog = watchdog
        self.backend = cfg.backend
        self._connected = False
        if cfg.backend == "ray":
            self.nodes = self._start_ray(cfg)
        else:
            self.nodes = [_this_machine(cfg)]

    def _start_ray(self, cfg: ClusterConfig) -> list[NodeInfo]:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        # Ray starts its workers at nice 15, so a simulator or policy worker loses its core to
        # any ordinary process (Ray's own daemons, a driver loop). A local Ray started by
        # m2flow runs them at normal priority.
        os.environ.setdefault("RAY_worker_niceness", "0")
        # the worker lines Ray forwards to the driver carry colour codes; a log file gets them
        # as escape sequences (Ray reads this variable as it prints each line)
        if not sys.stdout.isatty():
            os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        import ray

        if not ray.is_initialized():
            with _keep_sigterm_handler():
                self._init_ray(cfg)
            self._connected = True
        return _ray_nodes()

    @staticmethod
    def _init_ray(cfg: ClusterConfig) -> None:
        import ray

        if cfg.address is None:
            ray.init(
                num_cpus=cfg.num_cpus,
                # counted as placement counts them, so Ray's node and ours agree
                num_gpus=_this_machine(cfg).num_gpus,
                object_store_memory=cfg.object_store_memory_mb * 2**20,
                include_dashboard=False,
                configure_logging=False,
                # Ray starts a default worker per CPU for tasks when the driver connects; every
                # m2flow worker is an actor with environment variables of its own, which runs
                # in a process started for it, so those would only take CPU from the start-up
                _system_config={"prestart_worker_first_driver": False},
            )
            return
        try:
            ray.init(address=cfg.address, configure_logging=False)
        except ConnectionError as e:
            raise ConnectionError(
                f"cluster.address={cfg.address!r}: no running Ray cluster to join "
                f"({str(e).splitlines()[0]}); start one first (ray start --head on the "
                "head node, ray start --address=HEAD:6379 on the others), or set "
                "cluster.address=null for a Ray on this machine only.") from None

    @property
    def num_gpus(self) -> int:
        return sum(n.num_gpus for n in self.nodes)

    def shutdown(self) -> None:
        if self._connected:
            import ray

            ray.shutdown()
            self._connected = False

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


@contextlib.contextmanager
def _keep_sigterm_handler():
    """Puts back this process's SIGTERM handler after Ray connects: Ray's core worker installs
    its own (a stack dump, then an abort), which would turn a stop the program handles (see
    ``runs.control.RunControl.handle_signals``), or the quiet end of an unhandled SIGTERM,
    into a crash."""
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def check_cluster(cfg: ClusterConfig) -> None:
    """Raises ValueError (one line naming the field and the fix) for a config no cluster can
    start with; starts nothing."""
    if cfg.backend not in BACKENDS:
        raise ValueError(
            f"cluster.backend={cfg.backend!r} is not a backend; use one of {list(BACKENDS)}."
        )
    if cfg.backend == "local" and cfg.address is not None:
        raise ValueError(
            f"cluster.address={cfg.address!r} is set but cluster.backend='local' runs "
            "everything in this process; set cluster.backend=ray to join a Ray cluster, or "
            "cluster.address=null."
        )
    if cfg.weight_sync not in WEIGHT_SYNC:
        raise ValueError(
            f"cluster.weight_sync={cfg.weight_sync!r}: use one of {list(WEIGHT_SYNC)} (auto: "
            "a torch.distributed broadcast with several rollout workers, else Ray objects).")
    if cfg.weight_sync == "dist" and cfg.backend != "ray":
        raise ValueError(
            f"cluster.weight_sync=dist broadcasts over torch.distributed, which needs each worker "
            f"in its own process, but cluster.backend={cfg.backend!r} runs every worker in this "
            "one; use cluster.backend=ray, or cluster.weight_sync=ray (or auto).")
    if cfg.num_cpus is not None and cfg.num_cpus < 1:
        raise ValueError(f"cluster.num_cpus={cfg.num_cpus}: must be >= 1, or null for all of "
                         "this machine's.")
    if cfg.num_gpus is not None and cfg.num_gpus < 0:
        raise ValueError(f"cluster.num_gpus={cfg.num_gpus}: must be >= 0, or null for all "
                         "visible ones.")
    if cfg.object_store_memory_mb < MIN_OBJECT_STORE_MB:
        raise ValueError(
            f"cluster.object_store_memory_mb={cfg.object_store_memory_mb}: Ray needs at least "
            f"{MIN_OBJECT_STORE_MB}; raise it (default 512)."
        )


def expected_nodes(cfg: ClusterConfig) -> Optional[list[NodeInfo]]:
    """The nodes a cluster built from ``cfg`` will have, known before it starts: this machine
    (counted as the cluster counts it) for ``backend=local`` or a local Ray (``address``
    None); None when joining a Ray cluster, whose nodes are only known once connected."""
    check_cluster(cfg)
    if cfg.backend == "ray":
        ray = sys.modules.get("ray")  # not imported: not started here
        if ray is not None and ray.is_initialized():
            return _ray_nodes()  # the Ray this process is connected to: a Cluster reuses it
        if cfg.address is not None:
            return None
    return [_this_machine(cfg)]


def _ray_nodes() -> list[NodeInfo]:
    """The alive nodes of the connected Ray, the head node first."""
    import ray

    alive = [n for n in ray.nodes() if n["Alive"]]
    alive.sort(key=lambda n: (not n["Resources"].get("node:__internal_head__"), n["NodeID"]))
    return [
        NodeInfo(
            node_id=n["NodeID"],
            address=n["NodeManagerAddress"],
            num_cpus=int(n["Resources"].get("CPU", 0)),
            num_gpus=int(n["Resources"].get("GPU", 0)),
            resources=frozenset(r for r in n["Resources"] if _is_custom(r)),
        )
        for n in alive
    ]


def _is_custom(resource: str) -> bool:
    """A resource a user gave the node, not one Ray gives every node."""
    return (resource not in ("CPU", "GPU", "memory", "object_store_memory")
            and not resource.startswith(("node:", "accelerator_type:")))


def _this_machine(cfg: ClusterConfig) -> NodeInfo:
    cpus = cfg.num_cpus or len(os.sched_getaffinity(0))
    gpus = cfg.num_gpus
    if gpus != 0:  # 0 asks for none: nothing to count
        visible = visible_gpu_count()
        if gpus is not None and gpus > visible:
            value = os.environ.get(VISIBLE_DEVICES)
            shown = "" if value is None else f" ({VISIBLE_DEVICES}={value!r})"
            raise ValueError(
                f"cluster.num_gpus={gpus}, but this machine shows {visible} GPU(s){shown}; set "
                f"at most {visible}, or null for all visible ones."
            )
        gpus = visible if gpus is None else gpus
    return NodeInfo(node_id="local", address="127.0.0.1", num_cpus=cpus, num_gpus=gpus)


def visible_gpu_count() -> int:
    """GPUs this process may use: those its ``CUDA_VISIBLE_DEVICES`` shows that exist (torch
    counts them; the list bounds the count, so a variable set after CUDA started in this
    process, which torch's count no longer follows, still binds the workers it starts)."""
    visible = visible_gpus(os.environ.get(VISIBLE_DEVICES))
    if visible == []:
        return 0
    import torch

    count = torch.cuda.device_count()
    return count if visible is None else min(count, len(visible))


def visible_gpus(value: Optional[str]) -> Optional[list[str]]:
    """The GPUs a ``CUDA_VISIBLE_DEVICES`` value shows, in order, read as CUDA reads it;
    None when the variable is unset (every GPU of the machine).

    Entries are ordinals ("4"), or UUIDs of GPUs ("GPU-8f3a...") or of MIG instances
    ("MIG-..."), as the first entry's kind says. The list ends before the first entry CUDA
    cannot read (a non-number among ordinals, another kind among UUIDs); an ordinal keeps its
    leading digits ("1gpu" is 1); an entry given twice hides every GPU; "" shows none.

    >>> visible_gpus("4,5"), visible_gpus(""), visible_gpus("3,x,5"), visible_gpus(None)
    (['4', '5'], [], ['3'], None)
    """
    if value is None:
        return None
    for prefix in _UUID_PREFIXES:
        if value.startswith(prefix):
            names = list(itertools.takewhile(lambda e: e.startswith(prefix), value.split(",")))
            return names if len(set(names)) == len(names) else []
    readable = itertools.takewhile(lambda o: o is not None, map(_ordinal, value.split(",")))
    ordinals = [str(o) for o in readable]
    return ordinals if len(set(ordinals)) == len(ordinals) else []


def _ordinal(entry: str) -> Optional[int]:
    """The device ordinal an entry starts with (as C's strtoul reads it); None if none, or
    if it is negative (CUDA stops reading the list there)."""
    m = re.match(r"[+-]?\d+", entry.strip())
    return int(m.group()) if m and int(m.group()) >= 0 else None


def gpu_names(gpu_ids: Sequence[int], visible: Optional[list[str]]) -> list[str]:
    """What ``CUDA_VISIBLE_DEVICES`` calls placement GPUs ``gpu_ids`` on a node whose GPUs
    are ``visible`` (:func:`visible_gpus`): placement GPU i is the i-th GPU the node shows, so
    under ``CUDA_VISIBLE_DEVICES=4,5`` (a SLURM job, a shared machine) GPU 0 is the one CUDA
    calls 4. Raises ``PlacementError`` for an id past the visible ones.

    >>> gpu_names([1], ["4", "5"]), gpu_names([0, 1], ["4", "5"]), gpu_names([1], None)
    (['5'], ['4', '5'], ['1'])
    """
    if visible is None:
        return [str(i) for i in gpu_ids]
    missing = [i for i in gpu_ids if not 0 <= i < len(visible)]
    if missing:
        have = f"ids 0-{len(visible) - 1}" if visible else "no GPU ids"
        raise PlacementError(
            f"placement GPU {missing[0]} is not visible on its node: {VISIBLE_DEVICES} there "
            f"shows {len(visible)} GPU(s) {visible}, placement GPU i being the i-th of them; "
            f"use {have} in the component's gpus, or widen {VISIBLE_DEVICES}."
        )
    return [visible[i] for i in gpu_ids]
