"""Workers and worker groups: N ranks of one worker class, as Ray actors or in this process.

A worker class subclasses :class:`Worker` and takes a :class:`WorkerInfo` first::

    class Echo(Worker):
        def __init__(self, info, prefix):
            super().__init__(info)
            self.prefix = prefix

        def hello(self, x):
            return f"{self.prefix}{self.rank}:{x}"

    group = WorkerGroup(cluster, "echo", Echo, placement.ranks("echo"), "r")
    group.call(Echo.hello, 1).wait()   # ['r0:1', 'r1:1']

Calls name the method itself, not a string, so a reader (and an IDE) can follow a parameter
from the caller into the worker; the group checks that the method belongs to its class.

A call returns :class:`~m2flow.pipelines.futures.Futures`; waiting on them (and stopping a
wait) is :mod:`m2flow.pipelines.futures`'.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from m2flow.pipelines import channel as _channel
from m2flow.pipelines.cluster import VISIBLE_DEVICES, Cluster, gpu_names, visible_gpus
from m2flow.pipelines import distributed
from m2flow.pipelines.context_switch import DeviceContext
from m2flow.pipelines.errors import PlacementError, WorkerError
from m2flow.pipelines.futures import Futures, Later, check_stop, gather
from m2flow.pipelines.launch import MAX_CONCURRENT_CALLS, construct_local, launch_ray_actor
from m2flow.pipelines.placement import RankResources
from m2flow.pipelines.timer import Timer
from m2flow.pipelines.watchdog import Watchdog

SHUTDOWN_WAIT_S = 5.0  # in-process calls of a worker with close() get this long to end
LEAVE_GROUP_WAIT_S = 2.0  # ranks of a process group get this long to leave it before they end


@dataclass(frozen=True)
class WorkerInfo:
    group: str
    rank: int
    world_size: int
    resources: RankResources
    backend: str
    """'ray' (own process) or 'local' (threads in the driver's process)."""
    process_group: Optional[distributed.ProcessGroupSpec] = None
    """The torch.distributed group that the ranks of a class with ``forms_process_group``
    join (None: no group, e.g. one rank)."""


class Worker:
    """Base class of every worker: knows its group, rank and resources; records timings.

    A class whose ranks train one model together sets ``forms_process_group = True``: with more
    than one rank they then form one torch.distributed process group before the subclass's
    constructor runs, and ``self.data_parallel`` is this rank's view of it
    (:class:`~m2flow.pipelines.distributed.DataParallel`; without a group, one that returns
    its inputs).
    """

    forms_process_group: bool = False
    """Whether the ranks of this class form a process group (see the class docstring)."""

    def __init__(self, info: WorkerInfo):
        self.info = info
        self.rank = info.rank
        self.world_size = info.world_size
        self.timer = Timer()
        # every GPU this rank was given, in placement order, as torch names it here; [] on CPU
        self.devices: list[str] = claim_gpus(info)
        if info.backend == "ray":  # this process is this rank's alone
            import torch

            self._unpinned = os.sched_getaffinity(0)
            if info.resources.cpu_ids:
                pin_process(info.resources.cpu_ids)
            torch.set_num_threads(info.resources.threads)
        self.data_parallel = distributed.SINGLE
        if info.process_group is not None:
            self.data_parallel = distributed.join(info.process_group, info.rank, self.device)
        self._links: dict[str, distributed.Link] = {}

    @property
    def device(self) -> str:
        """'cpu', or the first GPU this rank was given (``devices`` lists them all)."""
        return self.devices[0] if self.devices else "cpu"

    def float_threads(self) -> None:
        """Moves this process's own threads off its cores (onto the others it may use);
        processes it already started stay pinned. For a worker whose compute is in child
        processes (simulators): its bookkeeping then does not take time from its children (a
        pipe write from a child would otherwise wake it on the child's core)."""
        unpinned = getattr(self, "_unpinned", None)
        if unpinned is not None and self.info.resources.cpu_ids:
            pin_process((unpinned - set(self.info.resources.cpu_ids)) or unpinned)

    # Context switching: a worker registers its models and optimisers in ``self.context``; the
    # runner calls offload/onload when the placement has it share a device with another.
    @property
    def context(self) -> DeviceContext:
        """This worker's device-resident state (empty until the worker registers some)."""
        if getattr(self, "_context", None) is None:
            self._context = DeviceContext(self.device)
        return self._context

    def set_context_force(self, force: bool) -> None:
        """Copy on offload even when this worker computes on the CPU (context_switch=always)."""
        self.context.force = force

    def offload(self) -> dict[str, float]:
        """Moves this worker's registered state to host memory; bytes and seconds moved."""
        stats = self.context.offload()
        self.timer.add("offload", stats.seconds)
        return {"bytes": float(stats.bytes), "seconds": stats.seconds}

    def onload(self) -> dict[str, float]:
        """Moves this worker's registered state back onto its device."""
        stats = self.context.onload()
        self.timer.add("onload", stats.seconds)
        return {"bytes": float(stats.bytes), "seconds": stats.seconds}

    def pop_timings(self) -> dict[str, float]:
        """Seconds per phase since the last call (the runner gathers these every iteration)."""
        return self.timer.pop()

    def pid(self) -> int:
        return os.getpid()

    def _m2flow_alive(self) -> int:
        """The driver's watchdog asks this about every second (:mod:`~m2flow.pipelines.
        watchdog`); under Ray it runs in a concurrency group of its own, so a worker busy in
        a long call answers at once, and one that answers nothing is stopped or stuck."""
        return os.getpid()

    def link(self, name: str) -> distributed.Link:
        """This rank's view of link ``name`` (formed by :func:`~m2flow.pipelines.link.form_link`
        between this group and another)."""
        if name not in self._links:
            raise WorkerError(f"{self.info.group}[rank {self.rank}] is in no link named {name!r}; "
                              "form it first (pipelines.link.form_link).")
        return self._links[name]

    def _m2flow_join_link(self, name: str, spec: distributed.ProcessGroupSpec, *,
                          member: int) -> None:
        """Joins link ``name`` as ``member``; returns once every member has joined."""
        self._links[name] = distributed.join_link(spec, member, self.device, name)

    def _m2flow_leave_link(self, name: str) -> None:
        link = self._links.pop(name, None)
        if link is not None:
            link.close()

    def _m2flow_leave_process_group(self) -> None:
        """Destroys this rank's process group, if it has one (the group is shutting down)."""
        if self.info.process_group is not None:
            distributed.leave()

    def _m2flow_started(self) -> int:
        """Called once the worker is built. Moves every object alive now (the libraries,
        simulators and models it loaded) out of the garbage collector's view, so the
        collections that a hot loop's short-lived objects trigger do not rescan them: in a
        worker that has imported torch, Ray and a simulator a full collection takes
        milliseconds, and it lands in the middle of a step."""
        import gc

        gc.freeze()
        return os.getpid()

    # Channel plumbing: the receiving end of a channel lives in the worker that reads it.
    def _m2flow_open_channel(self, uid: str, capacity: int):
        if getattr(self, "_m2flow_channels", None) is None:
            self._m2flow_channels: set[str] = set()
        self._m2flow_channels.add(uid)
        return _channel.open_endpoint(uid, self.rank, capacity, listen=self.info.backend == "ray")

    def _m2flow_channel_put(self, uid: str, key, item, timeout: Optional[float]) -> None:
        endpoint = _channel.local_endpoint(uid, self.rank)
        if endpoint is None:
            raise RuntimeError(
                f"channel {uid.split('#')[0]!r} is closed on {self.info.group}[rank {self.rank}]."
            )
        endpoint.put(key, item, timeout)

    def _m2flow_close_channel(self, uid: str) -> None:
        _channel.close_endpoint(uid, self.rank)
        getattr(self, "_m2flow_channels", set()).discard(uid)

    def _m2flow_close_channels(self) -> None:
        """Closes every channel endpoint of this rank: a get or put waiting on one ends."""
        for uid in list(getattr(self, "_m2flow_channels", ())):
            self._m2flow_close_channel(uid)


def _method_name(worker_cls: type, method: Callable, group: str) -> str:
    """The name of ``method`` after checking that ``worker_cls`` has it (a typo or another
    class's method fails here, in the caller, instead of inside a Ray actor)."""
    if isinstance(method, str):
        raise TypeError(
            f"{group}.call({method!r}): pass the method itself "
            f"({worker_cls.__name__}.{method}), not its name."
        )
    name = getattr(method, "__name__", None)
    owner = getattr(method, "__qualname__", "").rpartition(".")[0]
    ours = getattr(worker_cls, name or "", None) is method or (
        hasattr(worker_cls, name or "") and any(c.__qualname__ == owner for c in worker_cls.__mro__))
    if not ours:
        raise TypeError(
            f"{group}.call({getattr(method, '__qualname__', method)!r}): not a method of "
            f"{worker_cls.__name__}, the class of worker group {group!r}."
        )
    return name


def claim_gpus(info: WorkerInfo) -> list[str]:
    """The torch devices of rank ``info``'s GPUs, the same physical GPUs under both backends.

    Placement GPU i is the i-th GPU its node shows (:func:`~m2flow.pipelines.cluster.gpu_names`
    reads this process's ``CUDA_VISIBLE_DEVICES``: the driver's, or for a Ray worker the one
    its node's Ray was started with). A rank in its own process (Ray) narrows
    ``CUDA_VISIBLE_DEVICES`` to its GPUs, so it and the processes it starts (simulators,
    renderers) see only them, as cuda:0, cuda:1, ...; a CPU rank sees none. A rank in the
    driver's process (local) names them in the driver's numbering, cuda:<placement id>.
    """
    ids = info.resources.gpu_ids
    names = gpu_names(ids, visible_gpus(os.environ.get(VISIBLE_DEVICES)))
    if info.backend != "ray":
        return [f"cuda:{i}" for i in ids]
    import torch

    if ids and torch.cuda.is_initialized():  # the variable is read once, when CUDA starts
        raise WorkerError(
            f"{info.group}[rank {info.rank}]: CUDA was started in this process before the "
            f"worker could narrow {VISIBLE_DEVICES} to its GPUs {names}; do not touch CUDA "
            "when the worker's module is imported (create tensors in the worker instead)."
        )
    os.environ[VISIBLE_DEVICES] = ",".join(names)
    return [f"cuda:{j}" for j in range(len(ids))]


def pin_process(cpu_ids) -> None:
    """Pins every thread of this process (and so every process it starts) to ``cpu_ids``."""
    cores = set(cpu_ids)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that just ended
            pass


class WorkerGroup:
    """Launches one worker per entry of ``ranks`` and calls methods on all or some of them.

    The constructor returns once every rank is built; :meth:`launch` returns at once, and
    :meth:`started` waits for the constructors (a group whose constructors wait for another
    group's result: ``Futures.later``)."""

    def __init__(
        self,
        cluster: Cluster,
        name: str,
        worker_cls: type,
        ranks: Sequence[RankResources],
        *args: Any,
        **kwargs: Any,
    ):
        self._launch(cluster, name, worker_cls, ranks, args, kwargs)
        self.started()

    @classmethod
    def launch(cls, cluster: Cluster, name: str, worker_cls: type,
               ranks: Sequence[RankResources], *args: Any, **kwargs: Any) -> "WorkerGroup":
        """The group with its ranks launched: under Ray their processes start and build
        meanwhile; call :meth:`started` before calling them. In process they are built now."""
        group = cls.__new__(cls)
        group._launch(cluster, name, worker_cls, ranks, args, kwargs)
        return group

    def _launch(self, cluster: Cluster, name: str, worker_cls: type,
                ranks: Sequence[RankResources], args, kwargs) -> None:
        self.name = name
        self.worker_cls = worker_cls
        self.backend = cluster.backend
        # the stop ends waits on these ranks and their start-up (Ctrl-C); the run's watchdog
        self.stop, self.watchdog = cluster.stop, cluster.watchdog  # watches them (its thread)
        self.world_size = len(ranks)
        self.resources = list(ranks)
        """Each rank's resources, as placed."""
        self.process_group: Optional[distributed.ProcessGroupSpec] = None
        self._executor: Optional[cf.ThreadPoolExecutor] = None
        self._running: set[cf.Future] = set()  # in-process calls not finished yet
        self.handles: list = []
        # the calls whose results the constructors wait for (started() waits on them first)
        self._inputs = [a.futures for a in (*args, *kwargs.values()) if isinstance(a, Later)]
        self._started = False
        try:
            self._start(cluster, ranks, args, kwargs)
        except BaseException:  # a failed or stopped start-up ends the ranks it started
            self.shutdown()
            raise

    def started(self) -> "WorkerGroup":
        """Waits until every rank is built and returns the group; a constructor's error is
        raised here, naming its rank, after the error of a call whose result it waited for.
        The ranks are watched from this wait on (``watchdog.NOT_STARTED``): a constructor
        that waits for another group's result has nothing to do before that is known."""
        if self._started or self.backend != "ray":
            return self
        try:
            if self._inputs:
                gather(*self._inputs)
            watched = self.watchdog is not None and self.watchdog.mine()
            if watched:  # watched while they start: a constructor that never returns is its
                self.watchdog.add(self)  # silence
            pids = self.call(Worker._m2flow_started).wait()  # constructor errors, with the rank
            if watched:  # each rank's first answer: built, its pid known (not left to
                self.watchdog.started(self, pids)  # whether a question came in meanwhile)
        except BaseException:  # a failed or stopped start-up ends the ranks it started
            self.shutdown()
            raise
        self._started = True
        return self

    def _start(self, cluster: Cluster, ranks: Sequence[RankResources], args, kwargs) -> None:
        self.process_group = self._process_group(cluster, ranks)
        if self.backend == "ray":
            for r, res in enumerate(ranks):
                check_stop(self.stop, [f"{self.name} start-up"])
                self.handles.append(
                    launch_ray_actor(cluster, self.worker_cls, self._info(r, res), args, kwargs))
        else:
            self._executor = cf.ThreadPoolExecutor(
                max_workers=MAX_CONCURRENT_CALLS * self.world_size,
                thread_name_prefix=f"m2flow-{self.name}",
            )
            for r, res in enumerate(ranks):  # in this thread: some simulators need it
                check_stop(self.stop, [f"{self.name} start-up"])
                self.handles.append(
                    construct_local(self.worker_cls, self._info(r, res), args, kwargs))

    def _info(self, rank: int, res: RankResources) -> WorkerInfo:
        return WorkerInfo(self.name, rank, self.world_size, res, self.backend,
                          self.process_group)

    def _process_group(self, cluster: Cluster, ranks: Sequence[RankResources]
                       ) -> Optional[distributed.ProcessGroupSpec]:
        """The process group of a ``forms_process_group`` class with more than one rank:
        world size from the placement, master at rank 0's node on a port free there, NCCL
        for ranks on GPUs of their own and gloo otherwise (``distributed.backend_for``)."""
        where = f"cluster.placement.components.{self.name}"
        forms = getattr(self.worker_cls, "forms_process_group", False)
        if not forms and any(r.shard != "none" for r in ranks):
            raise PlacementError(
                f"{where}.shard={ranks[0].shard}: only a component whose ranks train one model "
                "together (the learner) shards it; remove the key here.")
        if not (forms and len(ranks) > 1):
            return None
        if self.backend != "ray":
            raise PlacementError(
                f"{where}.workers={len(ranks)}: data-parallel ranks each need their own process "
                "(torch.distributed), but cluster.backend=local runs every worker in this one; "
                "use cluster.backend=ray or workers=1.")
        node = cluster.nodes[ranks[0].node]
        return distributed.ProcessGroupSpec(
            master_addr=node.address, master_port=distributed.free_port_on(node.node_id),
            world_size=len(ranks),
            backend=distributed.backend_for(ranks, where))

    def call(self, method: Callable, /, *args: Any, ranks: Optional[Sequence[int]] = None,
             **kwargs: Any) -> "Futures":
        """Calls ``method`` (a method of this group's worker class, e.g. ``EnvWorker.collect``)
        on the given ranks (default: all); returns :class:`Futures`."""
        return self.peers().call(method, *args, ranks=ranks, **kwargs)

    def peers(self) -> "Peers":
        """This group's ranks as a value to hand to another group's worker, which then calls
        them itself (see :class:`Peers`)."""
        return Peers(self.name, self.worker_cls, self.backend, list(self.handles),
                     self._executor, self._running, self.stop, self.watchdog)

    def kill(self, rank: int, timeout: float = 30.0) -> None:
        """Kills one rank's process (Ray only) and returns once it is gone: for fault tests."""
        import ray

        handle = self.handles[rank]
        ray.kill(handle, no_restart=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # ray.kill returns before the process is gone
            try:
                ray.get(handle.__ray_ready__.remote(), timeout=timeout)
            except ray.exceptions.RayActorError:
                return
        raise WorkerError(f"{self.name}[rank {rank}] was still alive {timeout:g} s after kill.")

    def shutdown(self) -> None:
        """Ends the ranks, abandoning calls still running (after a stop or a failure): Ray
        actors are killed; in-process ranks have their channels closed, so a call waiting on
        one ends, and a worker with a ``close()`` (an env worker) gets ``SHUTDOWN_WAIT_S`` to
        finish the step in hand first: a simulator is not closed under a thread stepping it."""
        if self.backend == "ray":
            import ray

            self._leave_process_group()
            for h in self.handles:
                try:
                    ray.kill(h, no_restart=True)
                except Exception:  # already dead: nothing left to stop
                    pass
        elif self._executor is not None:
            for h in self.handles:
                if isinstance(h, Worker):
                    h._m2flow_close_channels()
            if any(hasattr(h, "close") for h in self.handles):
                cf.wait(list(self._running), timeout=SHUTDOWN_WAIT_S)
            for h in self.handles:
                close = getattr(h, "close", None)
                if close is not None:
                    close()
            self._executor.shutdown(wait=False, cancel_futures=True)
        self.handles = []


    def _leave_process_group(self) -> None:
        """Has every rank destroy its process group before its process ends; a rank busy or
        stuck in a collective (a failed peer) is not waited for long: killing its process
        ends its membership too."""
        if self.process_group is None or not self.handles:
            return
        try:
            self.call(Worker._m2flow_leave_process_group).wait(
                timeout=LEAVE_GROUP_WAIT_S, stoppable=False)
        except Exception:  # a dead or stuck rank: its process is killed next
            pass


class Peers:
    """The ranks of one worker group, callable from wherever this value is: the driver
    (``WorkerGroup.call`` goes through it), or a worker of another group that was handed it
    (``WorkerGroup.peers()``), which then calls the ranks directly (Ray: actor to actor), with
    no driver round trip per call. Picklable under Ray (it carries the actor handles); an
    in-process group's value stays in this process (its calls run on the group's threads).
    ``stop``, ``watchdog``: the group's stop event and watchdog, which waits on these calls
    use; both stay in the driver's process (a worker's waits on its peers end on their own)."""

    def __init__(self, name: str, worker_cls: type, backend: str, handles: list,
                 executor: Optional[cf.ThreadPoolExecutor] = None,
                 running: Optional[set] = None, stop: Optional[threading.Event] = None,
                 watchdog: Optional[Watchdog] = None):
        self.name, self.worker_cls, self.backend = name, worker_cls, backend
        self.handles = handles
        self._executor, self._running = executor, running
        self.stop, self.watchdog = stop, watchdog

    def __getstate__(self) -> dict:
        if self.backend != "ray":
            raise TypeError(f"the ranks of in-process group {self.name!r} cannot leave this "
                            "process; hand them to a worker of the same cluster.backend.")
        return {**self.__dict__, "stop": None, "watchdog": None}

    @property
    def world_size(self) -> int:
        return len(self.handles)

    def call(self, method: Callable, /, *args: Any, ranks: Optional[Sequence[int]] = None,
             **kwargs: Any) -> Futures:
        """Calls ``method`` (a method of the group's worker class) on the given ranks
        (default: all); returns :class:`Futures`."""
        name = _method_name(self.worker_cls, method, self.name)
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        items = []
        for r in ranks:
            h = self.handles[r]
            if self.backend == "ray":
                items.append((r, getattr(h, name).remote(*args, **kwargs)))
            else:
                fut = self._executor.submit(getattr(h, name), *args, **kwargs)
                self._running.add(fut)
                fut.add_done_callback(self._running.discard)
                items.append((r, fut))
        return Futures(self.name, name, items, self.backend, self.stop, self.watchdog)

    def share(self, value: Any) -> Any:
        """``value`` as an argument of calls on these ranks: under Ray one object in this
        process's object store, which every rank called with it fetches from here (it lives
        while a reference to it does: the returned one, or a call's); in process the value
        itself."""
        if self.backend != "ray":
            return value
        import ray

        return ray.put(value)
