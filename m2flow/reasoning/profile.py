"""Measures the reasoning components alone, for the planner (``m2flow-plan``).

In this one process, one at a time, each after a warm-up call, on one core and on all:

- **rollout**: the real ``ReasoningRollout``'s engine generating ``n`` completions for a
  quarter, half and all of a step's prompts in one call;
- **reward**: the real ``RewardWorker`` scoring those completions (decode + check);
- **learner**: the real ``ReasoningLearner``'s GRPO update on a whole step of those groups
  (rewards set to alternate within each group: the update's cost depends on the batch's
  shape, and a constant group would be skipped), then a weight sync to the rollout.

``profile(cfg)`` returns the profile and its graph (:mod:`m2flow.reasoning.graph`).
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Callable, Optional

import torch

from m2flow import keys
from m2flow.pipelines import Cluster, ClusterConfig, RankResources, WorkerGroup
from m2flow.pipelines.planner import measure
from m2flow.pipelines.planner.graph import Graph
from m2flow.pipelines.planner.profiles import Node, Profile
from m2flow.reasoning import graph as reasoning_graph
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.learner_worker import ReasoningLearner
from m2flow.reasoning.reward_worker import RewardWorker
from m2flow.reasoning.rollout_worker import ReasoningRollout, decode
from m2flow.runs.profile import (
    iteration_seconds, model_mb, profile_handover, profile_sync, shutdown)


class _Groups:
    """A channel that hands out the same scored groups, in order, again and again."""

    def __init__(self, groups):
        self.groups, self.i = groups, 0

    def get(self, key=0, timeout=None):
        g = self.groups[self.i % len(self.groups)].clone()
        self.i += 1
        return g


def profile(cfg: ReasoningConfig, *, say: Callable[[str], None] = print,
            node: Optional[Node] = None) -> tuple[Profile, Graph]:
    """Measures rollout, reward and learner of ``cfg`` on this node; profile and graph."""
    node = node or measure.this_node(cfg.cluster)
    p, n = cfg.algorithm.prompts_per_step, cfg.rollout.n
    calls = sorted({max(1, p // 4), max(1, p // 2), p})
    base_mb = measure.pss_mb([os.getpid()])
    prof = Profile("reasoning", node, source={
        "data": cfg.data.source, "model": cfg.model.path or "tiny",
        "date": f"{datetime.now():%Y-%m-%d %H:%M}"})
    every, counts = list(range(node.cores)), sorted({1, node.cores})
    say(f"profile: GRPO, {p} prompts x {n} completions per step, on {node.cores} cores and "
        f"{node.gpus} GPUs")
    cluster = Cluster(ClusterConfig(backend="local", num_gpus=0))
    one = [RankResources(0, 1.0, ())]
    rollout = reward = learner = None
    try:
        rollout = WorkerGroup(cluster, "rollout", ReasoningRollout, one, cfg)
        worker = rollout.handles[0]
        problems = [worker.train[i] for i in worker.problems_of_step(0)]
        prompts = [q.prompt(cfg.data.template) for q in problems]
        say("profile: generation")
        for c in counts:
            with measure.on_cores(every[:c]):
                for k in calls:
                    prof.add_time("rollout", "generate", size=k * n, cores=c,
                                  seconds=measure.median_seconds(
                                      lambda: worker.engine.generate(prompts[:k], n, seed=0),
                                      warm=1, min_calls=2, min_s=0.5))
        out = worker.engine.generate(prompts, n, seed=0)
        prof.add_memory("rollout", size=p * n, mb=base_mb + model_mb(worker.model))
        say("profile: rewards")
        reward = WorkerGroup(cluster, "reward", RewardWorker, one, cfg)
        scorer = reward.handles[0]
        scored = []
        for g, q in enumerate(problems):
            group = out[g * n:(g + 1) * n].clone()
            group[keys.PROBLEM] = torch.full((n,), 0, dtype=torch.long)
            group[keys.POLICY_VERSION] = torch.zeros(n, dtype=torch.long)
            group[keys.COMPLETION_REWARD] = (torch.arange(n) % 2).float()  # never constant
            scored.append(group)
        answers = [q.answer for q in problems]

        def score(k: int) -> None:
            for g in range(k):
                for text in decode(scorer.tokenizer, scored[g]):
                    scorer.score(text, answers[g])

        for c in counts:
            with measure.on_cores(every[:c], threads=1):
                for k in calls:
                    prof.add_time("reward", "score", size=k * n, cores=c,
                                  seconds=measure.median_seconds(lambda: score(k), warm=1))
        prof.add_memory("reward", size=p * n, mb=base_mb)
        say("profile: learner update and weight sync")
        before = measure.rss_mb()
        learner = WorkerGroup(cluster, "learner", ReasoningLearner,
                              [RankResources(0, float(node.cores), ())], cfg)
        update = learner.handles[0].update
        update(_Groups(scored), num_groups=max(1, p // 4), iteration=0)  # warm: AdamW state
        for c in sorted(counts, reverse=True):
            with measure.on_cores(every[:c]):
                prof.add_time("learner", "learn", size=p * n, cores=c,
                              seconds=measure.median_seconds(
                                  lambda: update(_Groups(scored), num_groups=p, iteration=0),
                                  warm=0, min_calls=1, min_s=1.0, max_calls=3))
        prof.add_memory("learner", size=p * n, mb=base_mb + max(0.0, measure.rss_mb() - before))
        param_mb = model_mb(worker.model)
        profile_sync(prof, learner, rollout, size_mb=param_mb,
                     bucket_mb=cfg.runner.weight_sync_bucket_mb, cores=1)
        prof.add_memory("runtime", size=0, mb=base_mb + measure.RAY_DAEMONS_MB)
        if node.gpus:
            say("profile: generation and learner on GPU 0")
            _on_gpu(prof, cfg, prompts, calls, scored)
        prof.facts = reasoning_graph.facts(cfg, param_mb)
    finally:
        shutdown(learner, reward, rollout)
    return prof, reasoning_graph.graph(prof.facts)


def _on_gpu(prof: Profile, cfg: ReasoningConfig, prompts: list, calls: list[int],
            scored: list) -> None:
    """Generation, the GRPO update, the weight sync and the context switch with rollout and
    learner on GPU 0, and their GPU memory."""
    cluster = Cluster(ClusterConfig(backend="local", num_gpus=1))
    gpu = [RankResources(0, 1.0, (0,))]
    sync, n, p = torch.cuda.synchronize, cfg.rollout.n, cfg.algorithm.prompts_per_step
    rollout = learner = None
    try:
        torch.cuda.reset_peak_memory_stats()
        rollout = WorkerGroup(cluster, "rollout", ReasoningRollout, gpu, cfg)
        engine = rollout.handles[0].engine
        for k in calls:
            prof.add_time("rollout", "generate", size=k * n, cores=0, device="cuda",
                          seconds=measure.median_seconds(
                              lambda: engine.generate(prompts[:k], n, seed=0), warm=1,
                              min_calls=2, min_s=0.5, sync=sync))
        prof.add_memory("rollout", size=p * n, device="cuda",
                        mb=torch.cuda.max_memory_allocated() / 2**20)
        torch.cuda.reset_peak_memory_stats()
        learner = WorkerGroup(cluster, "learner", ReasoningLearner, gpu, cfg)
        update = learner.handles[0].update
        update(_Groups(scored), num_groups=max(1, p // 4), iteration=0)
        prof.add_time("learner", "learn", size=p * n, cores=0, device="cuda",
                      seconds=measure.median_seconds(
                          lambda: update(_Groups(scored), num_groups=p, iteration=0), warm=0,
                          min_calls=1, min_s=0.0, sync=sync))
        prof.add_memory("learner", size=p * n, device="cuda",
                        mb=torch.cuda.max_memory_allocated() / 2**20)
        profile_handover(prof, learner, rollout, size_mb=model_mb(rollout.handles[0].model),
                         bucket_mb=cfg.runner.weight_sync_bucket_mb, sync=sync)
    finally:
        shutdown(learner, rollout)


def graph_of(facts: dict) -> Graph:
    """The graph of a saved profile's facts (``m2flow-plan --profile FILE``)."""
    return reasoning_graph.graph(facts)


def measure_iterations(cfg: ReasoningConfig, iterations: int, warm: int = 1) -> list[float]:
    """Seconds of each of ``iterations`` real GRPO steps of ``cfg`` (no warm start, no
    evaluation), after ``warm`` untimed ones (``m2flow-plan --verify``)."""
    from m2flow.reasoning.runner import ReasoningRunner

    cfg.runner.progress_bar = False
    return iteration_seconds(ReasoningRunner(cfg), iterations, warm, key="perf/step_s")


def calibrate(cfg: ReasoningConfig, iterations: int, warm: int = 1) -> list[tuple]:
    """Real GRPO steps of ``cfg`` as it is: ``[(generate calls, False, mean seconds, the
    timed steps' seconds)]``."""
    import statistics

    calls = max(1, cfg.algorithm.prompts_per_step // cfg.rollout.prompts_per_call)
    times = measure_iterations(cfg, iterations, warm)
    return [(calls, False, statistics.fmean(times), times)]
