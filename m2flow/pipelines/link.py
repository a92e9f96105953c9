"""Links: a torch.distributed process group between one rank of a worker group and every
rank of another, for broadcasts from that one rank (weights from learner rank 0 to the
rollout ranks).

A link is formed from the placement as the data-parallel groups are
(:mod:`m2flow.pipelines.distributed`): its members are the source rank (member 0) and the
target ranks in rank order (members 1 to M); the master is the source's node, at a port free
there; the backend is NCCL when every member has GPUs of its own and gloo otherwise
(:func:`~m2flow.pipelines.distributed.link_backend`). Each member builds the group on a TCP
store of its own, so a learner rank that is also in a data-parallel group joins both.

Which way a weight sync travels is ``cluster.weight_sync`` (:func:`weight_sync_transport`):

- ``ray``: each bucket is a Ray object that every rollout rank fetches from the learner's
  object store (one object per bucket; works with every backend and placement);
- ``dist``: each bucket is one flat buffer broadcast over a link (gloo through host memory,
  NCCL from GPU to GPUs); needs ``cluster.backend=ray`` (a process per member);
- ``auto``: ``dist`` when the cluster backend is Ray and there is more than one rollout rank,
  or source and targets all have GPUs of their own (NCCL); ``ray`` otherwise.
"""

from __future__ import annotations

from typing import Sequence

from m2flow.pipelines import distributed
from m2flow.pipelines.cluster import WEIGHT_SYNC
from m2flow.pipelines.errors import PlacementError
from m2flow.pipelines.placement import RankResources
from m2flow.pipelines.futures import gather
from m2flow.pipelines.worker import Worker, WorkerGroup

LEAVE_WAIT_S = 2.0  # members get this long to leave a link before their processes end


def weight_sync_transport(setting: str, backend: str, source: RankResources,
                          targets: Sequence[RankResources]) -> str:
    """'ray' or 'dist': the transport ``cluster.weight_sync=setting`` means for a sync from
    ``source`` to ``targets`` under cluster backend ``backend`` (see the module docstring).

    >>> cpu, gpu = RankResources(0, 1.0, ()), lambda i: RankResources(0, 1.0, (i,))
    >>> [weight_sync_transport("auto", "ray", cpu, t) for t in ([cpu], [cpu, cpu])]
    ['ray', 'dist']
    >>> weight_sync_transport("auto", "ray", gpu(0), [gpu(1)]), weight_sync_transport(
    ...     "auto", "local", cpu, [cpu, cpu])
    ('dist', 'ray')
    """
    if setting not in WEIGHT_SYNC:
        raise ValueError(f"cluster.weight_sync={setting!r}: use one of {list(WEIGHT_SYNC)}.")
    if setting != "auto":
        return setting
    if backend != "ray":
        return "ray"
    nccl = distributed.link_backend([source, *targets]) == "nccl"
    return "dist" if len(targets) > 1 or nccl else "ray"


class LinkGroup:
    """The driver's handle on a formed link: its name, spec and members; ``close()`` has
    every member leave it."""

    def __init__(self, name: str, spec: distributed.ProcessGroupSpec, source: WorkerGroup,
                 source_rank: int, targets: WorkerGroup):
        self.name, self.spec = name, spec
        self._source, self._source_rank, self._targets = source, source_rank, targets

    @property
    def backend(self) -> str:
        return self.spec.backend

    def close(self) -> None:
        """Every member leaves the link; a dead or busy member is not waited for long (its
        process ends with its group)."""
        calls = []
        try:
            if self._source.handles:
                calls.append(self._source.call(Worker._m2flow_leave_link, self.name,
                                               ranks=[self._source_rank]))
            if self._targets.handles:
                calls.append(self._targets.call(Worker._m2flow_leave_link, self.name))
            gather(*calls, timeout=LEAVE_WAIT_S, stoppable=False)
        except Exception:  # a dead or stuck member: its process is killed with its group
            pass


def form_link(cluster, name: str, source: WorkerGroup, targets: WorkerGroup, *,
              source_rank: int = 0,
              timeout_s: float = distributed.DEFAULT_TIMEOUT_S) -> LinkGroup:
    """Forms link ``name`` between rank ``source_rank`` of ``source`` (member 0) and every
    rank of ``targets`` (members 1 to M, in rank order); returns once all have joined.

    Each member needs a process of its own (``cluster.backend=ray``). Afterwards a worker
    method reaches the link as ``self.link(name)``
    (:class:`~m2flow.pipelines.distributed.Link`).
    """
    if cluster.backend != "ray":
        raise PlacementError(
            f"link {name!r} between {source.name} and {targets.name}: its members each need "
            "their own process (torch.distributed), but cluster.backend=local runs every "
            "worker in this one; use cluster.backend=ray, or cluster.weight_sync=ray.")
    members = [source.resources[source_rank], *targets.resources]
    node = cluster.nodes[members[0].node]
    spec = distributed.ProcessGroupSpec(
        master_addr=node.address, master_port=distributed.free_port_on(node.node_id),
        world_size=len(members), backend=distributed.link_backend(members), timeout_s=timeout_s)
    joins = [source.call(Worker._m2flow_join_link, name, spec, member=0, ranks=[source_rank])]
    joins += [targets.call(Worker._m2flow_join_link, name, spec, member=1 + r, ranks=[r])
              for r in range(targets.world_size)]
    gather(*joins)
    return LinkGroup(name, spec, source, source_rank, targets)
