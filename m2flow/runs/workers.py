"""The workers of a run: the cluster, the validated placement of its components, the worker
groups started on it (shut down in reverse order by ``close()``) and the links between them,
the context switcher for the components that share a device, the watchdog over them
(:mod:`m2flow.pipelines.watchdog`, limited by ``runner.stall_timeout_s``), and per-component
timings by one rule: ``time/<group>_<phase>``, the slowest rank's seconds.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

from m2flow.pipelines import Cluster, ContextSwitcher, Placement, WorkerGroup, offloads_for
from m2flow.pipelines import watchdog
from m2flow.pipelines.link import LinkGroup, form_link, weight_sync_transport


class RunWorkers:
    """Cluster, placement, worker groups, links, switcher and watchdog of one run.

    Args:
        cfg: the workload's root config; it has ``cluster`` and ``runner.stall_timeout_s``.
        stop: the run's stop event (``RunControl.stop``): once set, every wait on these
            workers raises ``Stopped`` (the cluster hands it to each group).
    """

    def __init__(self, cfg: Any, stop: threading.Event):
        self.cfg = cfg
        # a worker that stops making progress ends the run (pipelines.watchdog)
        self.watchdog = watchdog.Watchdog(cfg.runner.stall_timeout_s)
        self.cluster = Cluster(cfg.cluster, stop=stop, watchdog=self.watchdog)
        self.placement = Placement(cfg.cluster.placement, self.cluster.nodes)
        self.groups: list[WorkerGroup] = []
        self.links: list[LinkGroup] = []
        self.switcher = ContextSwitcher({}, {})  # nobody takes turns until take_turns()

    def group(self, name: str, cls: type, *args: Any, **kwargs: Any) -> WorkerGroup:
        """Starts the ranks of component ``name`` (as placed) as workers of class ``cls``."""
        return self.launch(name, cls, *args, **kwargs).started()

    def launch(self, name: str, cls: type, *args: Any, **kwargs: Any) -> WorkerGroup:
        """Launches the ranks of component ``name`` and returns before they are built (Ray;
        in process they are built now): call the group's ``started()`` before its methods.
        Groups launched one after another build at once, and an argument may be a result
        not known yet (``Futures.later()``). Ended by ``close()`` from their launch on."""
        # (its ranks are watched from started() on: WorkerGroup adds them to the watchdog)
        group = WorkerGroup.launch(self.cluster, name, cls, self.placement.ranks(name),
                                   *args, **kwargs)
        self.groups.append(group)
        return group

    def weight_link(self, learner: WorkerGroup, rollout: WorkerGroup) -> Optional[str]:
        """The link weights travel over from learner rank 0 to every rollout rank, formed
        now, when ``cluster.weight_sync`` says so (:mod:`m2flow.pipelines.link`); None: they
        travel as Ray objects. Pass it to ``runs.weights.sync_groups``."""
        transport = weight_sync_transport(self.cfg.cluster.weight_sync, self.cluster.backend,
                                          learner.resources[0], rollout.resources)
        if transport != "dist":
            return None
        self.links.append(form_link(self.cluster, "weights", learner, rollout))
        return self.links[-1].name

    def offloads_for(self, components: Sequence[str]) -> dict[str, list[str]]:
        """Who steps aside for whom among ``components`` on a shared device."""
        return offloads_for(self.placement.shares_device, list(components),
                            self.cfg.cluster.context_switch)

    def take_turns(self, groups: dict[str, WorkerGroup],
                   offloads: dict[str, list[str]]) -> ContextSwitcher:
        """The switcher that hands the shared device to one component at a time."""
        self.switcher = ContextSwitcher(groups, offloads,
                                        force=self.cfg.cluster.context_switch == "always")
        return self.switcher

    def timings(self) -> dict[str, float]:
        """Seconds per component and phase since the last call: the slowest rank's."""
        out: dict[str, float] = {}
        for g in self.groups:
            per_rank = g.call(g.worker_cls.pop_timings).wait()
            for phase in {p for t in per_rank for p in t}:
                out[f"time/{g.name}_{phase}"] = max(t.get(phase, 0.0) for t in per_rank)
        return out

    def close(self) -> None:
        """Ends the workers (calls still running are abandoned) and the cluster."""
        for link in self.links:
            link.close()
        self.links = []
        for g in reversed(self.groups):
            g.shutdown()
        self.groups = []
        self.cluster.shutdown()
