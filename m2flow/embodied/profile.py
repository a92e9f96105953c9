"""Measures the embodied components alone, for the planner (``m2flow-plan``).

In this one process, one component at a time, each after warm-up calls:

- **env**: the config's envs as three env groups (``n/4``, ``n/4``, ``n/2`` envs; one
  simulator process each, as the env worker runs them), stepped with random actions (one
  policy call's worth: an action chunk) at ``n/4``, ``n/2`` and ``n`` envs, its processes
  pinned to one core and then spread over all; resets of those sizes as an env worker resets
  (every group's started before any is waited for, to the seeds and tasks of a next
  iteration: a multi-task env switching task rebuilds its scene); the PSS of its processes;
  and the hand-off cost per step (pickling obs and actions as the channels do, recording the
  step);
- **rollout**: the real ``RolloutWorker``'s policy answering batches of recorded observations
  of those sizes on 1 thread and on all cores (and on a GPU if the node has one);
- **learner**: the real ``LearnerWorker``'s update on a trajectory of the iteration's full
  size (recorded steps, tiled to ``runner.rollout_steps``), on all cores and on one; then a
  weight sync from it to the rollout worker (``runs.weights.sync_groups``, in this process).

``profile(cfg)`` returns the profile and its graph (:mod:`m2flow.embodied.graph`).
"""

from __future__ import annotations

import os
import pickle
import statistics
from dataclasses import replace
from datetime import datetime
from typing import Callable, Optional

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.config import TrainConfig
from m2flow.embodied import graph as embodied_graph
from m2flow.embodied.layout import Layout
from m2flow.embodied.workers import resets
from m2flow.embodied.workers.buffer import TrajectoryBuffer
from m2flow.embodied.workers.learner_worker import LearnerWorker
from m2flow.embodied.workers.rollout_worker import RolloutWorker
from m2flow.envs import make_env
from m2flow.envs.chunked import ChunkedEnv, step_wait_all
from m2flow.pipelines import Cluster, ClusterConfig, RankResources, WorkerGroup
from m2flow.pipelines.planner import measure
from m2flow.pipelines.planner.graph import Graph
from m2flow.pipelines.planner.profiles import Node, Profile
from m2flow.runs import seeding
from m2flow.runs.profile import (
    iteration_seconds, model_mb, profile_handover, profile_sync, shutdown)

RECORDED_STEPS = 4
"""Policy calls recorded for the learner's trajectory (tiled to rollout_steps): its cost
depends on the batch's shape, not on what is in it."""


class _OneItem:
    """A channel that always holds the same trajectory (the learner's ``get``)."""

    def __init__(self, item: TensorDict):
        self.item = item

    def get(self, key=0, timeout=None) -> TensorDict:
        return self.item.clone()


def sizes_of(n: int) -> list[int]:
    """Env counts to measure at for ``n`` envs: n/4, n/2, n (distinct, at least 1).

    >>> sizes_of(16), sizes_of(4), sizes_of(2), sizes_of(1)
    ([4, 8, 16], [1, 2, 4], [1, 2], [1])
    """
    return sorted({max(1, n // 4), max(1, n // 2), n})


def profile(cfg: TrainConfig, *, say: Callable[[str], None] = print,
            node: Optional[Node] = None) -> tuple[Profile, Graph]:
    """Measures every component of ``cfg``'s run on this node; the profile and its graph."""
    node = node or measure.this_node(cfg.cluster)
    layout = Layout.of(cfg)
    n = layout.total_envs
    sizes = sizes_of(n)
    base_mb = measure.pss_mb([os.getpid()])  # a worker process with torch and m2flow
    prof = Profile("embodied", node, source={
        "env": cfg.env.name, "policy": cfg.policy.name, "algorithm": cfg.algorithm.name,
        "total_envs": n, "date": f"{datetime.now():%Y-%m-%d %H:%M}"})
    every = list(range(node.cores))
    counts = sorted({1, node.cores})
    say(f"profile: {n} envs of {cfg.env.name} as groups of {_groups(sizes)}, policy "
        f"{cfg.policy.name}, on {node.cores} cores and {node.gpus} GPUs")
    cluster = Cluster(ClusterConfig(backend="local", num_gpus=0))
    envs = _Envs(cfg, sizes, group=max(1, layout.reset_group_size))
    rollout = learner = None
    try:
        spec = envs.spec
        rollout = WorkerGroup(cluster, "rollout", RolloutWorker, [RankResources(0, 1.0, ())],
                              cfg.policy, spec, seed=cfg.seed)
        policy = rollout.handles[0].policy
        chunk = rollout.handles[0].chunk()
        say("profile: env steps and resets")
        for s in sizes:  # one core and all, side by side (the machine's speed drifts)
            for c in counts:
                with envs.on(s, every[:c], every):
                    prof.add_time("env", "step", size=s, cores=c,
                                  seconds=measure.median_seconds(lambda: envs.step(s, chunk)))
                    prof.add_time("env", "reset", size=s, cores=c,
                                  seconds=measure.median_seconds(lambda: envs.reset(s), warm=1,
                                                                 min_calls=1, min_s=0.0))
        sim_mb = measure.pss_mb(measure.descendants())
        for s in sizes:
            prof.add_memory("env", size=s, mb=base_mb + sim_mb * s / n)
        say("profile: policy inference")
        steps = envs.record(policy, RECORDED_STEPS)
        obs = steps[0][keys.OBS]
        for s in sizes:
            batch = TensorDict({keys.OBS: obs[:s]}, batch_size=[s])
            for c in counts:
                with measure.on_cores(every[:c]), torch.no_grad():
                    prof.add_time("rollout", "infer", size=s, cores=c,
                                  seconds=measure.median_seconds(lambda: policy.act(batch)))
        for s in sizes:
            prof.add_time("env", "hop", size=s, cores=1,
                          seconds=measure.median_seconds(lambda: _hand_off(steps[0][:s])))
        prof.add_memory("rollout", size=n, mb=base_mb + model_mb(policy))
        say("profile: learner update and weight sync")
        before = measure.rss_mb()
        learner = WorkerGroup(cluster, "learner", LearnerWorker,
                              [RankResources(0, float(node.cores), ())], cfg.policy,
                              cfg.algorithm, spec, seed=cfg.seed,
                              num_iterations=cfg.runner.num_iterations)
        traj = _signal(_tile(torch.stack(steps, dim=1), cfg.runner.rollout_steps))  # (N, T)
        _every_epoch(learner.handles[0].algorithm)
        update = learner.handles[0].update
        small = _OneItem(traj[:, : max(1, traj.shape[1] // 4)])
        full = _OneItem(traj)
        update(small, env_ranks=[0], iteration=0)  # warm: Adam's state, allocator
        for c in sorted(counts, reverse=True):
            with measure.on_cores(every[:c]):
                prof.add_time("learner", "learn", size=traj.numel(), cores=c,
                              seconds=measure.median_seconds(
                                  lambda: update(full, env_ranks=[0], iteration=0),
                                  warm=0, min_calls=1, min_s=1.0, max_calls=3))
        prof.add_memory("learner", size=traj.numel(),
                        mb=base_mb + max(0.0, measure.rss_mb() - before))
        param_mb = model_mb(policy)
        profile_sync(prof, learner, rollout, size_mb=param_mb,
                     bucket_mb=cfg.runner.weight_sync_bucket_mb, cores=1)
        prof.add_memory("runtime", size=0, mb=base_mb + measure.RAY_DAEMONS_MB)
        if node.gpus:
            say("profile: policy and learner on GPU 0")
            _on_gpu(prof, cfg, spec, sizes, steps, traj)
        prof.facts = embodied_graph.facts(layout, cfg, chunk, param_mb)
    finally:
        shutdown(learner, rollout)
        envs.close()
    return prof, embodied_graph.graph(prof.facts)


def _on_gpu(prof: Profile, cfg: TrainConfig, spec, sizes: list[int], steps: list,
            traj: TensorDict) -> None:
    """Inference, the update, the weight sync and the context switch (offload, onload) with
    rollout and learner on GPU 0, and their GPU memory."""
    cluster = Cluster(ClusterConfig(backend="local", num_gpus=1))
    gpu = [RankResources(0, 1.0, (0,))]
    sync = torch.cuda.synchronize
    rollout = learner = None
    try:
        torch.cuda.reset_peak_memory_stats()
        rollout = WorkerGroup(cluster, "rollout", RolloutWorker, gpu, cfg.policy, spec,
                              seed=cfg.seed)
        worker = rollout.handles[0]
        obs = steps[0][keys.OBS].to(worker.device)
        with torch.no_grad():
            for s in sizes:
                batch = TensorDict({keys.OBS: obs[:s]}, batch_size=[s])
                prof.add_time("rollout", "infer", size=s, cores=0, device="cuda",
                              seconds=measure.median_seconds(lambda: worker.policy.act(batch),
                                                             sync=sync))
        prof.add_memory("rollout", size=max(sizes), device="cuda",
                        mb=torch.cuda.max_memory_allocated() / 2**20)
        torch.cuda.reset_peak_memory_stats()
        learner = WorkerGroup(cluster, "learner", LearnerWorker, gpu, cfg.policy, cfg.algorithm,
                              spec, seed=cfg.seed, num_iterations=cfg.runner.num_iterations)
        _every_epoch(learner.handles[0].algorithm)
        update = learner.handles[0].update
        update(_OneItem(traj[:, : max(1, traj.shape[1] // 4)]), env_ranks=[0], iteration=0)
        prof.add_time("learner", "learn", size=traj.numel(), cores=0, device="cuda",
                      seconds=measure.median_seconds(
                          lambda: update(_OneItem(traj), env_ranks=[0], iteration=0), warm=0,
                          min_calls=1, min_s=0.0, sync=sync))
        prof.add_memory("learner", size=traj.numel(), device="cuda",
                        mb=torch.cuda.max_memory_allocated() / 2**20)
        profile_handover(prof, learner, rollout, size_mb=model_mb(worker.policy),
                         bucket_mb=cfg.runner.weight_sync_bucket_mb, sync=sync)
    finally:
        shutdown(learner, rollout)


def _groups(sizes: list[int]) -> list[int]:
    return [b - a for a, b in zip([0, *sizes[:-1]], sizes)]


class _Envs:
    """The envs as groups whose first k add up to each measured size."""

    def __init__(self, cfg: TrainConfig, sizes: list[int], group: int = 1):
        self.cfg, self.sizes, self.group = cfg, sizes, group
        self.iteration = 0
        self.groups: list[ChunkedEnv] = []
        self.pids: list[list[int]] = []  # each group's processes (simulators, servers)
        try:
            for k in _groups(sizes):
                before = set(measure.descendants())
                self.groups.append(ChunkedEnv(make_env(replace(cfg.env, num_envs=k))))
                self.pids.append(sorted(set(measure.descendants()) - before))
        except BaseException:
            self.close()
            raise
        self.spec = self.groups[0].spec
        self.reset()

    def _first(self, s: int) -> list[ChunkedEnv]:
        return self.groups[: self.sizes.index(s) + 1]

    def on(self, s: int, cores: list[int], every: list[int]):
        """The first groups adding up to ``s`` envs pinned to ``cores``, this process off them
        (as the env worker floats its own thread), for the block."""
        k = self.sizes.index(s) + 1
        pids = [p for group in self.pids[:k] for p in group]
        measure.pin_pids(pids + [q for p in pids for q in measure.descendants(p)], cores)
        own = [c for c in every if c not in cores] or every
        return measure.on_cores(own, threads=1)

    def step(self, s: int, chunk: int) -> list[TensorDict]:
        groups = self._first(s)
        for g in groups:
            g.step_async(self._random(g.num_envs, chunk))
        return step_wait_all(groups)  # as the env worker waits for a stage's groups

    def reset(self, s: Optional[int] = None) -> None:
        """Resets the first groups adding up to ``s`` envs (default: all) as an env worker
        of ``s`` envs resets at an iteration: every group's reset started before any is
        waited for, to the seeds and tasks the worker's next iteration gets (a multi-task
        env switching task rebuilds its scene, as it does in training)."""
        groups = self._first(s) if s is not None else self.groups
        n = sum(g.num_envs for g in groups)
        size = self.group if n % self.group == 0 else 1
        seeds = resets.env_seeds(self.cfg.seed, seeding.TRAIN, iteration=self.iteration,
                                 rank=0, num_envs=n, group_size=size)
        tasks = resets.train_tasks(len(self.spec.tasks), num_envs=n, rank=0,
                                   iteration=self.iteration, group_size=size)
        self.iteration += 1
        sizes = [g.num_envs for g in groups]
        for g, sd, t in zip(groups, resets.split(seeds, sizes), resets.split(tasks, sizes)):
            g.reset_async(seed=sd, **({} if t is None else {"task": t}))
        for g in groups:
            g.reset_wait()

    def _random(self, n: int, chunk: int) -> torch.Tensor:
        return random_actions(self.spec, n, chunk)

    def record(self, policy, calls: int) -> list[TensorDict]:
        """``calls`` steps of all envs with the policy's actions, each as the learner sees it
        (batch [n]); the env worker's ``_record`` in one place."""
        seed, obs = 0, []
        for g in self.groups:
            obs.append(g.reset(seed=list(range(seed, seed + g.num_envs)))[keys.OBS])
            seed += g.num_envs
        out = []
        for _ in range(calls):
            o = torch.cat(obs)
            with torch.no_grad():
                act = policy.act(TensorDict({keys.OBS: o}, batch_size=[o.shape[0]]))
            act[keys.POLICY_VERSION] = torch.zeros(act.batch_size, dtype=torch.long)
            start = 0
            for g in self.groups:
                g.step_async(act[keys.ACTION][start: start + g.num_envs])
                start += g.num_envs
            results = [g.step_wait() for g in self.groups]
            res = torch.cat(results)
            step = res.empty()
            step.update({keys.OBS: o, keys.NEXT: res[keys.NEXT]})
            step.update(act)
            out.append(step)
            obs = [r[keys.OBS] for r in results]
        return out

    def close(self) -> None:
        for g in self.groups:
            g.close()


def _hand_off(step: TensorDict) -> None:
    """What a stage's step costs besides simulating and inferring: obs out and actions back
    through a channel (pickled), and the step recorded into the trajectory."""
    obs = TensorDict({keys.OBS: step[keys.OBS]}, batch_size=step.batch_size)
    pickle.loads(pickle.dumps(obs, protocol=5))
    act = step.select(keys.ACTION, keys.LOG_PROB, strict=False)
    pickle.loads(pickle.dumps(act, protocol=5))
    TrajectoryBuffer(1).add(step)


def _tile(traj: TensorDict, steps: int) -> TensorDict:
    """A (N, k) trajectory repeated along time to (N, steps)."""
    reps = -(-steps // traj.shape[1])
    return torch.cat([traj] * reps, dim=1)[:, :steps]


def _signal(traj: TensorDict) -> TensorDict:
    """``traj`` as a batch every algorithm learns from in full: one episode per env ending
    at the last step, every other env succeeding (so no GRPO group is dropped, which would
    make the update look free)."""
    n, t = traj.shape
    done = torch.zeros(n, t, dtype=torch.bool)
    done[:, -1] = True
    won = done & (torch.arange(n) % 2 == 0)[:, None]
    for key in (keys.DONE, keys.TERMINATED, keys.SUCCESS, keys.TRUNCATED):
        if key in traj.keys(True):
            traj[key] = {keys.DONE: done, keys.TERMINATED: won, keys.SUCCESS: won,
                         keys.TRUNCATED: done & ~won}[key].clone()
    traj[keys.REWARD] = won.float()
    return traj


def _every_epoch(algorithm) -> None:
    """Times the whole update, every epoch and every parameter, as a run's update mostly is:
    the same batch again and again is soon stale to the moved policy, and PPO's target_kl
    would end the timed updates after their first epoch, far shorter than a run's; a critic
    warm-up would train the critic alone."""
    algorithm.stop_early = lambda terms: False
    algorithm.critic_only = lambda iteration: False


def graph_of(facts: dict) -> Graph:
    """The graph of a saved profile's facts (``m2flow-plan --profile FILE``)."""
    return embodied_graph.graph(facts)


def measure_iterations(cfg: TrainConfig, iterations: int, warm: int = 1) -> list[float]:
    """Seconds of each of ``iterations`` real training iterations (collect, update, sync; no
    evaluation) of ``cfg``, after ``warm`` untimed ones (``m2flow-plan --verify``)."""
    from m2flow.embodied.runner import EmbodiedRunner

    cfg.runner.progress_bar = False
    return iteration_seconds(EmbodiedRunner(cfg), iterations, warm, key="perf/iteration_s")


def calibrate(cfg: TrainConfig, iterations: int, warm: int = 1) -> list[tuple]:
    """Real iterations of ``cfg`` as it is, then (one runner) with learner overlap if it has
    none and may have it: ``(stages, overlap, mean seconds per iteration, the timed
    iterations' seconds, each component phase's mean seconds per iteration)`` of each."""
    from m2flow.embodied.runner import EmbodiedRunner

    cfg.runner.progress_bar = False
    runner = EmbodiedRunner(cfg)
    out, it = [], 0
    try:
        modes = [cfg.runner.overlap_learner]
        if not modes[0] and cfg.algorithm.name != "bc" and not runner.switcher.enabled:
            modes.append(True)  # on after off only: data collected ahead cannot be un-staled
        for overlap in modes:
            cfg.runner.overlap_learner = overlap
            times, phases = [], []
            for _ in range(warm + iterations):
                metrics = runner.iterate(it)
                times.append(metrics["perf/iteration_s"])
                phases.append({k.removeprefix("time/"): v for k, v in metrics.items()
                               if k.startswith("time/") and not k.startswith("time/driver")})
                it += 1
            # the mean, not the median: with overlap an iteration's boundary moves work to the
            # next, so single iterations swing widely and only the total is its rate
            timed = phases[warm:]
            out.append((runner.layout.pipeline_stages, overlap, statistics.fmean(times[warm:]),
                        times[warm:], {k: statistics.fmean(p.get(k, 0.0) for p in timed)
                                       for k in timed[0]}))
        runner.drain()
        return out
    finally:
        runner.close()


def random_actions(spec, n: int, chunk: int = 1) -> torch.Tensor:
    """Actions to profile a simulator with: uniform within the spec's bounds, standard normal
    on a dimension without bounds (an mjlab task's actions are unbounded).

    >>> from m2flow.envs import EnvSpec
    >>> a = random_actions(EnvSpec({}, 2, (-1.0, -float("inf")), (1.0, float("inf")), 10), 500)
    >>> bool(a.isfinite().all()), bool(a[:, 0].abs().max() <= 1), bool(a[:, 1].abs().max() > 1)
    (True, True, True)
    """
    low = torch.as_tensor(spec.action_low, dtype=torch.float32)
    high = torch.as_tensor(spec.action_high, dtype=torch.float32)
    shape = (n, chunk, low.numel()) if chunk > 1 else (n, low.numel())
    bounded = low.isfinite() & high.isfinite()
    if bounded.all():
        return low + (high - low) * torch.rand(shape)
    uniform = torch.where(bounded, low, 0) + torch.where(bounded, high - low, 0) * torch.rand(shape)
    return torch.where(bounded, uniform, torch.randn(shape))
