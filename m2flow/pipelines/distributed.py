"""torch.distributed process groups for data-parallel ranks, formed from the placement.

A worker class whose ranks train one model together sets ``forms_process_group = True``; its
:class:`~m2flow.pipelines.worker.WorkerGroup` then forms one process group of its ranks before
they are built, from what the placement already says: the world size is the number of ranks,
the master is rank 0's node at a port free there (:func:`free_port`, asked on that node), the
backend is NCCL when each rank has GPUs of its own and gloo when they compute on CPUs (or share
a GPU, which NCCL refuses). The user writes
``cluster.placement.components.learner.workers=N`` and nothing else. Each rank joins in
:meth:`Worker.__init__ <m2flow.pipelines.worker.Worker>` (``info.process_group``), so the
worker's own constructor can already use the group, and leaves it when the group shuts down.

:class:`DataParallel` is a rank's view of its group: the few collectives a data-parallel
update needs (sums, maxima, rows gathered from every rank, gradients reduced). With one rank
(``SINGLE``) every one of them returns its input, so the same code runs with and without a
group.

>>> dp = SINGLE
>>> dp.sum(torch.tensor([1.0, 2.0])), dp.sizes(5), dp.gather_rows(torch.ones(2, 3)).shape
(tensor([1., 2.]), [5], torch.Size([2, 3]))
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from m2flow.pipelines.errors import PlacementError
from m2flow.pipelines.placement import RankResources

DEFAULT_TIMEOUT_S = 1800.0  # a collective waits this long for a late rank (torch's gloo default)
GRAD_BUCKET_ELEMENTS = 2**24  # gradients are reduced in flat buckets of at most this many values


@dataclass(frozen=True)
class ProcessGroupSpec:
    """Everything a rank needs to join its group (the driver fills it in from the placement)."""

    master_addr: str
    """The address of rank 0's node (torch's TCP store runs there)."""
    master_port: int
    """A port that was free on rank 0's node."""
    world_size: int
    """Ranks in the group."""
    backend: str
    """'nccl' (ranks on GPUs) or 'gloo' (ranks on CPUs)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds a rank waits for the others to join, and in each collective."""

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def backend_for(ranks: Sequence[RankResources], where: str = "the group") -> str:
    """'nccl' when every rank has GPUs of its own, 'gloo' when none has a GPU, or when ranks
    share one (NCCL runs one rank per GPU; gloo reduces their tensors through host memory). A
    mix of GPU and CPU ranks is an error.

    >>> cpu, gpu = RankResources(0, 1.0, ()), lambda i: RankResources(0, 1.0, (i,))
    >>> backend_for([cpu, cpu]), backend_for([gpu(0), gpu(1)]), backend_for([gpu(0), gpu(0)])
    ('gloo', 'nccl', 'gloo')
    """
    on_gpu = [bool(r.gpu_ids) for r in ranks]
    if not any(on_gpu):
        return "gloo"
    if not all(on_gpu):
        raise PlacementError(
            f"{where}: some ranks have GPUs and some do not, but data-parallel ranks train one "
            "model on one kind of device; give every rank a GPU (gpus: one or more per worker) "
            "or none.")
    used = [(r.node, g) for r in ranks for g in r.gpu_ids]
    return "nccl" if len(set(used)) == len(used) else "gloo"


def free_port() -> int:
    """A TCP port nobody listens on now on this machine (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def free_port_on(node_id: Optional[str]) -> int:
    """A free port on Ray node ``node_id`` (None: on this machine), found by a tiny task
    pinned there when it is another node."""
    if node_id is None:
        return free_port()
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if node_id == ray.get_runtime_context().get_node_id():
        return free_port()
    task = ray.remote(num_cpus=0)(free_port).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    return ray.get(task.remote())


def join(spec: ProcessGroupSpec, rank: int, device: str) -> "DataParallel":
    """Joins the default process group of this process as ``rank``; blocks until every rank
    of ``spec`` has joined (or ``spec.timeout_s`` passes). ``device`` is the rank's compute
    device ('cpu' or 'cuda:i': NCCL's collectives run on it)."""
    import torch.distributed as dist

    if spec.backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(
        spec.backend, init_method=spec.init_method, rank=rank, world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=spec.timeout_s),
    )
    return DataParallel(rank, spec.world_size, device if spec.backend == "nccl" else "cpu")


def leave() -> None:
    """Destroys this process's default process group (nothing if it has none)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class DataParallel:
    """One rank's view of its data-parallel group: the collectives of a data-parallel update.

    Every method is a collective when ``world_size > 1``: all ranks call it, in the same
    order. With one rank each returns its input (no torch.distributed involved).

    Args:
        rank: this rank (0 to world_size - 1).
        world_size: ranks in the group.
        device: where the collectives' tensors live ('cpu' for gloo, the rank's GPU for NCCL).
    """

    def __init__(self, rank: int = 0, world_size: int = 1, device: str = "cpu"):
        self.rank, self.world_size, self.device = rank, world_size, device

    @property
    def active(self) -> bool:
        """Whether there is anyone to talk to (more than one rank)."""
        return self.world_size > 1

    def _reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        if not self.active:
            return t
        import torch.distributed as dist

        out = t.detach().to(self.device, copy=True)
        dist.all_reduce(out, op=getattr(dist.ReduceOp, op))
        return out.to(t.device)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``t`` over the ranks (a new tensor, on ``t``'s device)."""
        return self._reduce(t, "SUM")

    def max(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``t`` over the ranks."""
        return self._reduce(t, "MAX")

    def sizes(self, n: int) -> list[int]:
        """Every rank's ``n``, in rank order (e.g. the rows of each rank's batch)."""
        if not self.active:
            return [n]
        import torch.distributed as dist

        mine = torch.tensor([n], dtype=torch.long, device=self.device)
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine)
        return [int(t) for t in out]

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (rows may differ in number, the rest of the shape may not),
        concatenated in rank order along dim 0, on ``t``'s device."""
        if not self.active:
            return t
        import torch.distributed as dist

        sizes = self.sizes(t.shape[0])
        padded = torch.zeros((max(sizes), *t.shape[1:]), dtype=t.dtype, device=self.device)
        padded[: t.shape[0]] = t.to(self.device)
        out = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(out, padded)
        return torch.cat([o[:n] for o, n in zip(out, sizes)]).to(t.device)

    def gather_objects(self, obj: Any) -> list:
        """Every rank's picklable ``obj``, in rank order."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replaces every gradient of ``params`` by its sum over the ranks, in flat buckets.

        A parameter whose gradient is None on every rank keeps None (an optimiser skips it,
        which a zero gradient would not: Adam would still move it by its momentum); one that
        has a gradient on some rank only (another rank's minibatch share was empty) gets
        zeros where it had none, then the sum.
        """
        if not self.active:
            return
        import torch.distributed as dist

        params = [p for p in params if p.requires_grad]
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        has = self.max(has).bool().tolist()
        grads = []
        for p, h in zip(params, has):
            if h:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        for bucket in _buckets(grads):
            flat = torch.cat([g.reshape(-1) for g in bucket]).to(self.device)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            start = 0
            for g in bucket:
                g.copy_(flat[start : start + g.numel()].view_as(g))
                start += g.numel()

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Copies rank 0's parameters and buffers into every rank's ``module`` (DDP does this
        when it wraps a model: the ranks start from one set of weights)."""
        if not self.active:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                buf = t.detach().to(self.device, copy=True)
                dist.broadcast(buf, src=0)
                t.copy_(buf)


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``grads`` cut into runs of one dtype and device of at most ``GRAD_BUCKET_ELEMENTS``."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        last = out[-1][-1] if out else None
        if (last is None or last.dtype != g.dtype or last.device != g.device
                or size + g.numel() > GRAD_BUCKET_ELEMENTS):
            out.append([])
            size = 0
        out[-1].append(g)
        size += g.numel()
    return out


SINGLE = DataParallel()
"""The view of a rank that has no group: every collective returns its input."""


# -- links: a process group between one rank of a group and every rank of another ------------
def link_backend(members: Sequence[RankResources]) -> str:
    """The backend of a link between ``members`` (e.g. a learner rank and the rollout ranks):
    'nccl' when every member has GPUs and none of them is another member's (NCCL runs one
    rank per GPU), else 'gloo', which moves the bytes through host memory (so a GPU and a
    CPU member may share a link, unlike data-parallel ranks).

    >>> cpu, gpu = RankResources(0, 1.0, ()), lambda i: RankResources(0, 1.0, (i,))
    >>> link_backend([gpu(0), gpu(1)]), link_backend([gpu(0), cpu]), link_backend([gpu(0), gpu(0)])
    ('nccl', 'gloo', 'gloo')
    """
    if not all(r.gpu_ids for r in members):
        return "gloo"
    used = [(r.node, g) for r in members for g in r.gpu_ids]
    return "nccl" if len(set(used)) == len(used) else "gloo"


class Link:
    """One member's view of a link: a process group of its own (not the process's default
    group, which a data-parallel rank already uses), made for broadcasts from member 0.

    Args:
        group: the torch process group (gloo or NCCL) of the link's members.
        member: this member (0 is the source, e.g. learner rank 0).
        world_size: members of the link.
        device: where the broadcast buffers live: 'cpu' for gloo, this member's GPU for NCCL.
        keep: objects the group needs alive (its TCP store).
    """

    def __init__(self, group, member: int, world_size: int, device: str, keep: tuple = ()):
        self._group, self._keep = group, keep
        self.member, self.world_size, self.device = member, world_size, device

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Member ``src``'s ``t`` into every member's ``t`` (same size and dtype everywhere, on
        ``device``); returns ``t`` once it holds the bytes (a collective: every member calls
        it, in the same order)."""
        self._group.broadcast(t, src).wait()
        if t.is_cuda:  # NCCL's wait orders the current stream only: the host may read next
            torch.cuda.current_stream(t.device).synchronize()
        return t

    def close(self) -> None:
        """Ends the link's group (its members call this as the link closes)."""
        group, self._group, self._keep = self._group, None, ()
        shutdown = getattr(group, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:  # a peer already gone: nothing left to shut down
                pass


def join_link(spec: ProcessGroupSpec, member: int, device: str, name: str) -> Link:
    """Joins link ``name`` as ``member`` (0: the source, whose node runs the TCP store) and
    blocks until every member of ``spec`` has joined. The group is built directly on a TCP
    store, not with ``init_process_group``, so a process may be in a link and in a
    data-parallel default group at once."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, member == 0,
                          timeout=timeout)
    prefixed = dist.PrefixStore(f"m2flow-link-{name}", store)
    if spec.backend == "nccl":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, member, spec.world_size, options)
    else:
        group = dist.ProcessGroupGloo(prefixed, member, spec.world_size, timeout)
        device = "cpu"
    return Link(group, member, spec.world_size, device, keep=(store, prefixed))
