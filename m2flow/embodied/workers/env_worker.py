"""The env worker: steps its envs with actions that arrive on a channel. Nothing else.

Its parts live next to it in :mod:`m2flow.embodied.workers`: the stage scheduler
(:mod:`~m2flow.embodied.workers.stages`), episode bookkeeping
(:mod:`~m2flow.embodied.workers.episodes`), reset seeds and tasks
(:mod:`~m2flow.embodied.workers.resets`), evaluation rounds
(:mod:`~m2flow.embodied.workers.env_eval`). This module keeps collection and the pipeline loop
(``EnvWorker._run``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.workers import resets
from m2flow.embodied.workers.buffer import TrajectoryBuffer
from m2flow.embodied.workers.env_eval import EvalRecorder, EvalRound
from m2flow.embodied.workers.episodes import EpisodeStats, EvalEpisode, RunningEpisodes
from m2flow.embodied.workers.stages import stage_groups, stage_sizes
from m2flow.envs import EnvConfig, make_env
from m2flow.envs.chunked import ChunkedEnv, step_wait_all
from m2flow.pipelines import Channel, Worker
from m2flow.runs import seeding

__all__ = ["EnvWorker", "EpisodeStats", "EvalEpisode", "EvalRound", "stage_sizes"]

Record = Callable[[int, TensorDict], None]  # (env group, its step) -> None


@dataclass
class StageStep:
    """A step of one stage that was started (``step_async``) and is not yet recorded."""

    stage: int
    actions: list[TensorDict]
    """The actions of each env group of the stage."""
    send_after: bool
    """Send the stage's next obs once the step is recorded (False on the last step)."""


@dataclass
class _Loop:
    """What every step of one ``EnvWorker._run`` shares."""

    stage_groups: list[list[int]]
    """Env groups of each stage."""
    obs: list[TensorDict]
    """Per env group: the obs to act on next."""
    obs_ch: Channel
    record: Record


class EnvWorker(Worker):
    """Owns ``cfg.num_envs`` envs as ``groups`` env groups; runs them as S pipeline stages.

    Per step and stage it sends obs on ``obs_ch`` and reads actions from ``act_ch``; the
    key of stage k of this worker on both channels is ``(rank, k)``. A stage is a contiguous
    run of groups, so S can be anything from 1 to ``groups`` at every call without rebuilding
    a simulator (elastic pipelining): S=1 steps all groups at once. Groups get ``num_envs``
    split as evenly as possible. Env i of this rank draws the same reset seeds for any grouping
    and the trajectory lists envs in order, so its (N, T) layout does not depend on S.
    """

    def __init__(self, info, cfg: EnvConfig, *, seed: int, groups: int = 1,
                 channel_timeout: float = 600.0, reset_group_size: int = 1):
        super().__init__(info)
        self.cfg = cfg
        self.seed = seed
        self.timeout = channel_timeout
        # its part of the run's layout, checked at start-up (embodied.layout.check_layout):
        # reset_group_size divides cfg.num_envs, groups is within 1..cfg.num_envs
        self.reset_group_size = reset_group_size
        self.sizes = stage_sizes(cfg.num_envs, groups)
        # ChunkedEnv: a policy may return action chunks (K env steps per call)
        self.envs = [ChunkedEnv(make_env(replace(cfg, num_envs=n), device=self.device))
                     for n in self.sizes]
        if self.envs[0].device.type == "cpu":
            # the simulator processes keep this worker's cores; its own thread (sending actions,
            # receiving results, recording) floats, so it does not take time from them
            self.float_threads()
        self.num_envs = cfg.num_envs
        self._obs: Optional[list] = None  # per group: the obs to act on next
        self._runs: list[RunningEpisodes] = []  # per group: the episodes under way

    def spec(self):
        return self.envs[0].spec

    def collect(
        self, obs_ch: Channel, act_ch: Channel, traj_ch: Channel, *, num_steps: int,
        iteration: int, reset: bool = True, rebuild: bool = False, stages: int = 1,
        stagger: bool = False,
    ) -> EpisodeStats:
        """Collects ``num_steps`` steps of every env and puts the (N, T) trajectory on traj_ch;
        the stats' ``seconds`` is this call's wall time. ``stagger``: after a reset, start
        the envs' episodes at random steps (``runner.stagger_episodes``)."""
        t0 = time.perf_counter()
        if reset or self._obs is None:
            self._obs = self._reset(seeding.TRAIN, iteration, rebuild)
            if stagger:
                self._stagger(iteration)
            # an episode's return, length and success run on across calls until the envs reset
            # (runner.reset_every_iteration=false: episodes longer than an iteration)
            self._runs = [RunningEpisodes(n) for n in self.sizes]
        buffers = [TrajectoryBuffer(num_steps) for _ in self.sizes]
        runs = self._runs
        stats = EpisodeStats()

        def record(g: int, step: TensorDict) -> None:
            lost = step.get(keys.DISCARDED, None)
            if lost is not None:  # a restarted simulator: its episode is not data
                step[keys.VALID] = ~lost
            buffers[g].add(step)
            if lost is not None and lost.any():
                for i in lost.nonzero().flatten().tolist():
                    buffers[g].invalidate(i, steps_back=int(runs[g].len[i]))
            stats.extend(runs[g].update(step))

        self._obs = self._run(num_steps, self._obs, obs_ch, act_ch, record, stages)
        with self.timer("send"):
            traj = torch.cat([b.data() for b in buffers], dim=0)  # (N, T), envs in order
            traj_ch.put(traj, key=self.rank, timeout=self.timeout)
            traj_ch.flush()
        stats.seconds = time.perf_counter() - t0
        return stats

    def eval_round_ranks(self, obs_ch: Channel, act_ch: Channel, *, per_rank: list[EvalRound],
                         stages: int = 1) -> list[EvalEpisode]:
        """``eval_round`` with this rank's entry of ``per_rank`` (one call for all ranks)."""
        r = per_rank[self.rank]
        return self.eval_round(obs_ch, act_ch, seeds=r.seeds, tasks=r.tasks,
                               max_steps=r.max_steps, video=r.video, stages=stages,
                               chunk=r.chunk)

    def eval_round(
        self, obs_ch: Channel, act_ch: Channel, *, seeds: list[int], tasks: Optional[list] = None,
        max_steps: Optional[int] = None, video: Optional[list[bool]] = None, stages: int = 1,
        chunk: int = 1,
    ) -> list[EvalEpisode]:
        """One episode per env: env i from ``seeds[i]`` (on task ``tasks[i]``), run for
        ``max_steps`` steps (default: the time limit); returns each env's first episode.

        ``chunk``: env steps per policy call (``max_steps / chunk`` calls, rounded up).
        ``video[i]``: keep env i's frames (its image observation) until that episode ends.
        An episode lost to a simulator restart comes back ``discarded`` (see ``EvalRecorder``).
        """
        max_steps = max_steps or self.spec().max_episode_steps
        if not max_steps:
            raise ValueError(f"env {self.cfg.name!r} has no time limit; set env.max_episode_steps.")
        rec = EvalRecorder(self.sizes, self.spec().obs_shapes, seeds=seeds, tasks=tasks,
                           video=video)
        obs = self._reset(seeding.EVAL, 0, rebuild=True, seeds=seeds, tasks=tasks)
        rec.start(obs)
        for env in self.envs:
            env.frames_key = rec.image_key
        try:
            self._run(math.ceil(max_steps / chunk), obs, obs_ch, act_ch, rec.record, stages)
        finally:
            for env in self.envs:
                env.frames_key = None
        self._obs = None
        return rec.finish()

    def _run(self, num_steps: int, obs: list, obs_ch: Channel, act_ch: Channel, record: Record,
             stages: int) -> list:
        """The pipeline. Per step, stage by stage: wait for stage k's actions, wait for stage
        k-1's simulation to end, start stage k's, and only then record stage k-1's step and
        send its next obs. So one stage simulates at a time (a stage that shares the cores
        with another would finish later, and the rollout worker would wait for its obs), the
        rollout worker infers for the other stages meanwhile, and this worker's hand-offs
        (record, send) happen while a stage simulates instead of between simulations. S=1 has
        nothing to overlap with: finish, then wait for actions. Where the env steps in this
        thread (no background processes) each stage finishes in turn.
        Exactly ``num_steps`` obs go out per stage.
        """
        loop = _Loop(stage_groups(len(self.sizes), stages), list(obs), obs_ch, record)
        by_stage = loop.stage_groups
        background = all(self.envs[g].steps_in_background for groups in by_stage for g in groups)
        for k, groups in enumerate(by_stage):
            self._send(obs_ch, k, groups, loop.obs)
        in_flight: Optional[StageStep] = None  # started, not finished
        for t in range(num_steps):
            more = t + 1 < num_steps
            for k in range(len(by_stage)):
                if in_flight is not None and in_flight.stage == k:  # S=1
                    self._record(loop, in_flight, self._wait(loop, in_flight.stage))
                    in_flight = None
                with self.timer("wait"):
                    act = act_ch.get(key=(self.rank, k), timeout=self.timeout)
                parts = (act.split([self.sizes[g] for g in by_stage[k]]) if len(by_stage[k]) > 1
                         else [act])
                done = self._wait(loop, in_flight.stage) if in_flight is not None else None
                with self.timer("sim"):
                    for g, a in zip(by_stage[k], parts):
                        self.envs[g].step_async(a[keys.ACTION])
                if in_flight is not None:  # while stage k simulates
                    self._record(loop, in_flight, done)
                in_flight = StageStep(k, parts, more)
                if not background:
                    self._record(loop, in_flight, self._wait(loop, k))
                    in_flight = None
        if in_flight is not None:
            self._record(loop, in_flight, self._wait(loop, in_flight.stage))
        with self.timer("send"):
            obs_ch.flush()
        return loop.obs

    def _wait(self, loop: _Loop, k: int) -> list:
        with self.timer("sim"):
            return step_wait_all([self.envs[g] for g in loop.stage_groups[k]])

    def _record(self, loop: _Loop, started: StageStep, outs: list) -> None:
        """Records the stage's step per group and sends its next obs if asked."""
        groups = loop.stage_groups[started.stage]
        for g, a, out in zip(groups, started.actions, outs):
            step = out.empty()  # the step as the learner sees it (see m2flow.keys)
            step.update({keys.OBS: loop.obs[g], keys.NEXT: out[keys.NEXT]})
            step.update(a)
            loop.record(g, step)
            loop.obs[g] = out[keys.OBS]
        if started.send_after:
            self._send(loop.obs_ch, started.stage, groups, loop.obs)

    def _send(self, obs_ch: Channel, k: int, groups: list[int], obs: list) -> None:
        with self.timer("send"):
            o = obs[groups[0]] if len(groups) == 1 else torch.cat([obs[g] for g in groups])
            obs_ch.put(TensorDict({keys.OBS: o}, batch_size=o.batch_size), key=(self.rank, k),
                       timeout=self.timeout)

    def _stagger(self, iteration: int) -> None:
        """Env i's episode starts ``steps[i]`` steps in, uniform in [0, time limit), drawn
        from (seed, iteration, rank) so a resumed run staggers alike."""
        limit = self.spec().max_episode_steps
        gen = torch.Generator().manual_seed(
            seeding.derive(self.seed, seeding.STAGGER, iteration, self.rank)[0])
        steps = torch.randint(0, limit, (self.num_envs,), generator=gen)
        for env, part in zip(self.envs, torch.split(steps, self.sizes)):
            env.start_episodes_at(part)

    def _reset(self, purpose: int, iteration: int, rebuild: bool = False,
               seeds: Optional[list] = None, tasks: Optional[list] = None) -> list:
        """Resets every env (see :mod:`~m2flow.embodied.workers.resets`); per group: its first
        obs."""
        g = self.reset_group_size  # envs i // g share their initial state (GRPO groups)
        if seeds is None:
            seeds = resets.env_seeds(self.seed, purpose, iteration=iteration, rank=self.rank,
                                     num_envs=self.num_envs, group_size=g)
        if tasks is None:
            tasks = resets.train_tasks(len(self.spec().tasks), num_envs=self.num_envs,
                                       rank=self.rank, iteration=iteration, group_size=g)
        with self.timer("sim"):  # every group's resets at once, then their first obs
            for env, s, t in zip(self.envs, resets.split(seeds, self.sizes),
                                 resets.split(tasks, self.sizes)):
                kw = {} if t is None else {"task": t}
                env.reset_async(seed=s, rebuild=rebuild, **kw)
            return [env.reset_wait()[keys.OBS] for env in self.envs]

    def close(self) -> None:
        for env in self.envs:
            env.close()
