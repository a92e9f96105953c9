"""The search: every plan for a node, its predicted iteration time and memory, the best first.

The plans are :mod:`.space`'s (placements x workers x stages x overlap). Each placement is
checked by the engine's own :class:`~m2flow.pipelines.Placement`, so a plan the run would
refuse is refused here, with the same sentence.

**Time.** Each component rank's calls cost what the profile's fitted models say on the cores
that rank gets (``costmodel``). Work that runs at the same time is combined by
:func:`makespan`: the longest activity, but never less than the CPU work of any set of
activities divided by the cores they share (components sharing cores add their CPU-seconds:
on a node whose simulators already fill every core, overlapping inference or the learner
with them buys nothing). A phase holds the cores it runs on for its whole time (torch
threads spin at their barriers; simulators spread over k cores run as fast as the profile
measured them there): its work is cores x time, at least its time on one core. A cycle
(embodied) round costs the most of: one stage's trip round the loop (sim + infer +
hand-offs), each worker's busy time (S stages one after another), and the shared-core
bound. A chain (reasoning) costs the fill plus the bottleneck phase per
item. The update runs after the loop, or during it (learner overlap, streaming).

**Memory.** The sum of each rank's fitted memory at its size on the host, and per GPU
(rollout and learner taking turns on one GPU count the larger of the two there).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from m2flow.pipelines.cluster import NodeInfo
from m2flow.pipelines.errors import PlacementError
from m2flow.pipelines.placement import Placement, PlacementConfig
from m2flow.pipelines.planner.costmodel import CostModels, ModelError
from m2flow.pipelines.planner.graph import Graph, Phase
from m2flow.pipelines.planner.profiles import Node
from m2flow.pipelines.planner.space import Plan, plans

__all__ = ["Block", "Plan", "PlanError", "Prediction", "makespan", "plans", "predict",
           "search", "table"]

SIMPLER_WITHIN = 0.02
"""A simpler plan (fewer stages, workers) within this fraction of the fastest one is chosen
instead: predictions are not that exact, and simpler plans fail less. Among equally simple
ones the plan that pins more components to cores of their own comes first: the cost model
has no term for what pinning saves (no migrations, warm caches, no torch thread landing on
a simulator's core), so on a predicted tie it is the safer side."""
OVERLAP_GAIN = 0.10
"""Learner overlap trains on data one update stale, which costs iterations: the default
job needed 24 % more to reach 0.9 (bench/README.md, to_target.py). It is chosen only when it
predicts iterations at least this much faster than the best plan without it."""


class PlanError(ValueError):
    """No plan fits the node, or the node offers nothing to plan on; says why."""


@dataclass
class Prediction:
    plan: Plan
    iteration_s: float = math.inf
    throughput: float = 0.0
    """steps_per_iteration / iteration_s (env steps/s; completions/s)."""
    memory_mb: float = 0.0
    gpu_memory_mb: dict = field(default_factory=dict)
    breakdown: dict = field(default_factory=dict)
    """Seconds of each part: before, loop, train, sync, switch (or overlap)."""
    busy: dict = field(default_factory=dict)
    """Per component, the seconds its busiest rank computes in an iteration (alone-speed):
    what a run's ``time/<component>_<phase>`` measures."""
    infeasible: Optional[str] = None

    @property
    def feasible(self) -> bool:
        return self.infeasible is None


@dataclass(frozen=True)
class Block:
    """An activity in a period: its time alone, its CPU work on ``cpus``, GPU work on ``gpus``."""

    wall: float
    work: float = 0.0
    cpus: frozenset = frozenset()
    gpu_work: float = 0.0
    gpus: frozenset = frozenset()


def makespan(blocks: Sequence[Block]) -> float:
    """Time of activities that run at the same time: the longest one alone, or the CPU (GPU)
    work of any set of them over the cores (GPUs) they share, whichever is more.

    >>> a = Block(wall=1.0, work=2.0, cpus=frozenset({0, 1}))  # fills both cores for 1 s
    >>> b = Block(wall=0.5, work=0.5, cpus=frozenset({1}))
    >>> makespan([a, b]), makespan([Block(1.0, 1.0, frozenset({0})), b])
    (1.25, 1.0)
    """
    best = max((b.wall for b in blocks), default=0.0)
    for r in range(1, len(blocks) + 1):
        for sub in itertools.combinations(blocks, r):
            cpus = frozenset().union(*(b.cpus for b in sub))
            if cpus:
                best = max(best, sum(b.work for b in sub) / len(cpus))
            gpus = frozenset().union(*(b.gpus for b in sub))
            if gpus:
                best = max(best, sum(b.gpu_work for b in sub) / len(gpus))
    return best


# -- prediction ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Rank:
    cpus: frozenset
    cores: int
    """Cores a call of a processes-per-item phase may spread over (pinned cores or all)."""
    threads: int
    gpu: Optional[int]

    @property
    def device(self) -> str:
        return "cpu" if self.gpu is None else "cuda"


def placed_ranks(plan: Plan, graph: Graph, node: Node) -> dict[str, list[_Rank]]:
    """Each component's ranks as the engine's Placement resolves them; PlacementError if it
    refuses the plan."""
    placed = Placement(PlacementConfig(mode=plan.mode, components=dict(plan.components)),
                       [NodeInfo("planned", "", node.cores, node.gpus)], graph.names)
    every = frozenset(range(node.cores))
    out = {}
    for name in graph.names:
        out[name] = [_Rank(cpus=frozenset(r.cpu_ids) or every,
                           cores=len(r.cpu_ids) or node.cores,
                           threads=min(r.threads, node.cores),
                           gpu=r.gpu_ids[0] if r.gpu_ids else None)
                     for r in placed.ranks(name)]
    return out


class _Costs:
    """Calls of phases on ranks, as time alone and work."""

    def __init__(self, graph: Graph, models: CostModels):
        self.graph, self.models = graph, models

    def seconds(self, phase: Phase, size: float, rank: _Rank) -> float:
        spec = self.graph.component(phase.component)
        cores = rank.cores if spec.processes_per_item else rank.threads
        return self.models.seconds(phase.component, phase.phase, size, cores, rank.device)

    def block(self, phase: Phase, size: float, rank: _Rank, calls: float = 1.0) -> Block:
        """The calls as an activity. Its CPU work is what it holds: the cores it runs on x
        its time there, at least its time on one core (a torch op on k threads keeps k
        cores busy, spinning at its barriers; simulators on k cores run as fast as the
        profile measured them there, contention included)."""
        one = self.seconds(phase, size, rank)
        wall = calls * one
        work = calls * self.models.work(phase.component, phase.phase, size, rank.device)
        if rank.gpu is None:
            spread = (max(1.0, min(rank.cores, size))
                      if self.graph.component(phase.component).processes_per_item
                      else rank.threads)
            work = max(work, calls * spread * one)
        if rank.gpu is None:
            return Block(wall, work, rank.cpus)
        return Block(wall, 0.0, frozenset(), work, frozenset({rank.gpu}))


def predict(plan: Plan, graph: Graph, models: CostModels, node: Node) -> Prediction:
    """Iteration time, throughput and memory of ``plan`` (or why it cannot run)."""
    out = Prediction(plan)
    try:
        reason = _check(plan, graph)
        if reason:
            out.infeasible = reason
            return out
        ranks = placed_ranks(plan, graph, node)
        parts = _time(plan, graph, _Costs(graph, models), ranks, out.busy)
        _memory(out, plan, graph, models, ranks)
    except PlacementError as e:
        out.infeasible = str(e)
        return out
    except ModelError as e:
        out.infeasible = str(e)
        return out
    if models.overhead(plan.overlap) > 0:
        parts["overhead"] = models.overhead(plan.overlap)
    out.breakdown = parts
    out.iteration_s = sum(parts.values())
    out.throughput = graph.steps_per_iteration / out.iteration_s
    if out.memory_mb > node.memory_mb:
        out.infeasible = (f"needs {out.memory_mb / 1024:.1f} GB of host memory, the node has "
                          f"{node.memory_mb / 1024:.1f} GB")
    for gpu, mb in out.gpu_memory_mb.items():
        if mb > node.gpu_memory_mb:
            out.infeasible = (f"needs {mb / 1024:.1f} GB on GPU {gpu}, which has "
                              f"{node.gpu_memory_mb / 1024:.1f} GB")
    return out


def _check(plan: Plan, graph: Graph) -> Optional[str]:
    """The workload's own rules on workers and stages (sizes that do not split)."""
    first = graph.loop[0].component
    e, s = plan.workers, plan.stages
    if graph.items % e:
        return f"{graph.items} {graph.item_unit}s do not split over {e} {first} workers"
    per = graph.items // e
    if per % graph.group:
        return (f"{per} {graph.item_unit}s per {first} worker is not a multiple of "
                f"the group of {graph.group}")
    if s > per:
        return f"S={s} stages need at least {s} {graph.item_unit}s per {first} worker, not {per}"
    if not graph.cycle and per % s:
        return f"{per} {graph.item_unit}s do not split into {s} equal calls"
    comps = dict(plan.components)
    shared = _shared_gpu(comps, graph)
    if plan.overlap and shared:
        return ("learner overlap runs the learner during collection, but rollout and learner "
                "share a GPU (they take turns on it)")
    return None


def _shared_gpu(comps: dict, graph: Graph) -> bool:
    roll = graph.loop[-1].component if graph.cycle else graph.loop[0].component
    a, b = comps.get(roll), comps.get(graph.train.component)
    return bool(a and b and a.gpus and b.gpus and set(a.gpus) & set(b.gpus))


def _time(plan: Plan, graph: Graph, costs: _Costs, ranks: dict,
          busy: dict) -> dict[str, float]:
    first = graph.loop[0].component
    e, s = plan.workers, plan.stages
    stages = e * s
    size = graph.items / stages  # per stage (one call of each loop phase)
    env_ranks = ranks[first]
    # before the loop (resets), the workers at once; a worker starts every stage's at once
    # where each item has a process of its own (EnvWorker: reset_async, then reset_wait),
    # else its stages one after another
    before = [Block(0.0)]
    for r in env_ranks:
        for p in graph.before:
            together = graph.component(p.component).processes_per_item
            before.append(costs.block(p, size * s, r) if together
                          else costs.block(p, size, r, calls=s))
    t_before = makespan(before)
    learner = ranks[graph.train.component][0]
    train = costs.block(graph.train, graph.samples, learner)
    busy[first] = max(b.wall for b in before)
    busy[graph.train.component] = train.wall
    hop = 0.0
    if graph.hop is not None and costs.models.has(graph.hop.component, graph.hop.phase):
        hop = costs.models.seconds(graph.hop.component, graph.hop.phase, size)
    blocks, trip, item_times = [], 0.0, []
    for p in graph.loop:
        rs = ranks[p.component]
        calls = s if p.component == first else stages / len(rs)
        for r in rs:
            blocks.append(costs.block(p, size, r, calls=calls * (graph.rounds if graph.cycle else 1)))
        busy[p.component] = busy.get(p.component, 0.0) + blocks[-1].wall
        a = costs.seconds(p, size, rs[0])
        trip += a
        item_times.append(a * (1 if p.component == first else 1))
    comps = dict(plan.components)
    parts: dict[str, float] = {}
    if graph.cycle:
        chain = Block(graph.rounds * (trip + hop))
        if plan.overlap:
            parts["collect+train"] = makespan([Block(t_before + chain.wall), *before[1:],
                                               *blocks, train])
        else:
            parts["before"] = t_before
            parts["loop"] = makespan([chain, *blocks])
            parts["train"] = train.wall
    else:
        k = stages
        streamed = graph.stream_train and plan.mode != "collocated" and not _shared_gpu(comps, graph)
        if streamed:
            share = train.wall / k
            chain = Block(trip + hop + share + (k - 1) * max(*item_times, share))
            parts["before"] = t_before
            parts["loop+train"] = makespan([chain, *blocks, train])
        else:
            chain = Block(trip + hop + (k - 1) * max(item_times))
            parts["before"] = t_before
            parts["loop"] = makespan([chain, *blocks])
            parts["train"] = train.wall
    if graph.sync is not None:
        device = learner.device
        if not costs.models.has(graph.sync.component, graph.sync.phase, device):
            device = "cpu"  # measured on the CPU only: the copy is the same bytes
        if costs.models.has(graph.sync.component, graph.sync.phase, device):
            parts["sync"] = costs.models.seconds(graph.sync.component, graph.sync.phase,
                                                 graph.sync_size, device=device)
    if _shared_gpu(comps, graph):
        parts["switch"] = sum(costs.models.seconds(p.component, p.phase, 0, device="cuda")
                              for p in graph.switch
                              if costs.models.has(p.component, p.phase, "cuda"))
    return {k: v for k, v in parts.items() if v > 0 or k in ("loop", "train")}


def _memory(out: Prediction, plan: Plan, graph: Graph, models: CostModels, ranks: dict) -> None:
    first = graph.loop[0].component
    per_worker = graph.items / plan.workers
    per_stage = per_worker / plan.stages
    sizes = {first: per_worker, graph.train.component: graph.samples}
    host, gpu = 0.0, {}
    shared = _shared_gpu(dict(plan.components), graph)
    for name in graph.names:
        x = sizes.get(name, per_stage)
        for r in ranks[name]:
            host += models.mb(name, x, "cpu")
            if r.gpu is not None:
                gpu.setdefault(r.gpu, []).append(models.mb(name, x, "cuda"))
    out.memory_mb = host
    out.gpu_memory_mb = {g: (max(v) if shared else sum(v)) for g, v in gpu.items()}


# -- the search ----------------------------------------------------------------------------------
def search(graph: Graph, models: CostModels, node: Node) -> list[Prediction]:
    """Every plan's prediction: the feasible ones fastest first (the chosen one first, see
    ``SIMPLER_WITHIN``), then the infeasible ones with their reasons. Raises PlanError when
    none is feasible."""
    if node.cores < 1:
        raise PlanError(f"the node offers {node.cores} CPU cores; a plan needs at least one.")
    preds = [predict(p, graph, models, node) for p in plans(graph, node)]
    ok = sorted((p for p in preds if p.feasible), key=lambda p: p.iteration_s)
    bad = [p for p in preds if not p.feasible]
    if not ok:
        reasons = sorted({p.infeasible for p in bad})
        raise PlanError(f"no plan of the {graph.workload} workload fits this node ({node.cores} "
                        f"cores, {node.gpus} GPUs, {_gb(node.memory_mb)} GB): "
                        + "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else ""))
    return [*_chosen_first(ok), *bad]


def _chosen_first(ok: list[Prediction]) -> list[Prediction]:
    """``ok`` (fastest first) with the chosen plan moved to the front: without overlap
    unless it gains ``OVERLAP_GAIN``, then the simplest within ``SIMPLER_WITHIN`` (fewest
    stages, then workers, then floating components)."""
    plain = [p for p in ok if not p.plan.overlap]
    pool = ok
    if plain and ok[0].plan.overlap and \
            ok[0].iteration_s > plain[0].iteration_s * (1 - OVERLAP_GAIN):
        pool = plain
    best = pool[0]
    simple = min((p for p in pool if p.iteration_s <= best.iteration_s * (1 + SIMPLER_WITHIN)),
                 key=lambda p: (p.plan.stages, p.plan.workers, _floating(p.plan), p.iteration_s))
    rest = list(ok)
    rest.remove(simple)
    return [simple, *rest]


def _floating(plan: Plan) -> int:
    """How many of the plan's components run on any core (neither pinned cores nor a GPU)."""
    return sum(1 for _, c in plan.components if not c.cpu_ids and not c.gpus)


def _gb(mb: float) -> str:
    return "unlimited" if mb == math.inf else f"{mb / 1024:.1f}"


def table(preds: Sequence[Prediction], graph: Graph, top: int = 10,
          measured: Optional[dict] = None) -> str:
    """The best ``top`` feasible plans and every infeasible one with its reason; with
    ``measured`` ({label: seconds}), a measured column and the error."""
    unit = graph.throughput_unit
    head = f"{'#':>3}  {'iter s':>8}  {unit:>12}  {'mem GB':>7}  "
    if measured is not None:
        head += f"{'measured':>9}  {'error':>6}  "
    lines = [head + "plan"]
    ok = [p for p in preds if p.feasible]
    for i, p in enumerate(ok[:top]):
        row = (f"{i + 1:>3}  {p.iteration_s:>8.3f}  {p.throughput:>12.1f}  "
               f"{p.memory_mb / 1024:>7.1f}  ")
        if measured is not None:
            m = measured.get(p.plan.label(graph))
            row += (f"{m:>9.3f}  {100 * (p.iteration_s / m - 1):>+5.0f}%  " if m
                    else f"{'-':>9}  {'-':>6}  ")
        lines.append(row + p.plan.label(graph))
    if len(ok) > top:
        lines.append(f"     ... {len(ok) - top} more feasible plans")
    reasons: dict[str, list[Prediction]] = {}
    for p in preds:
        if not p.feasible:
            reasons.setdefault(p.infeasible, []).append(p)
    for reason, ps in reasons.items():
        more = f" (and {len(ps) - 1} more like it)" if len(ps) > 1 else ""
        lines.append(f"{'-':>3}  infeasible: {ps[0].plan.label(graph)}{more}: {reason}")
    return "\n".join(lines)
