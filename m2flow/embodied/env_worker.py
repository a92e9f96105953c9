"""The env worker: steps its envs with actions that arrive on a channel. Nothing else."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from tensordict import TensorDict

from m2flow.embodied import seeding
from m2flow.embodied.buffer import TrajectoryBuffer
from m2flow.envs import EnvConfig, make_env
from m2flow.envs.chunked import ChunkedEnv
from m2flow.pipelines import Channel, Worker


@dataclass
class EpisodeStats:
    """Episodes that ended during a call (per-env running sums live in the worker)."""

    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    successes: list[bool] = field(default_factory=list)
    discarded: int = 0
    """Episodes lost to a simulator process that died or hung (not in the lists above)."""

    def extend(self, other: "EpisodeStats") -> None:
        self.returns += other.returns
        self.lengths += other.lengths
        self.successes += other.successes
        self.discarded += other.discarded

    def summary(self) -> dict[str, float]:
        n = len(self.returns)
        lost = {"env/discarded_episodes": float(self.discarded)}
        if n == 0:
            return {"env/episodes": 0.0, **lost}
        return {
            **lost,
            "env/episodes": float(n),
            "env/return": sum(self.returns) / n,
            "env/episode_len": sum(self.lengths) / n,
            "env/success": sum(self.successes) / n,
        }


class EnvWorker(Worker):
    """Owns ``cfg.num_envs`` envs as ``groups`` env groups; runs them as S pipeline stages.

    Per step and stage it sends obs on ``obs_ch`` and reads actions from ``act_ch``; the lane
    key of stage k of this worker on both channels is ``(rank, k)``. A stage is a contiguous
    run of groups, so S can be anything from 1 to ``groups`` at every call without rebuilding
    a simulator (elastic pipelining): S=1 steps all groups at once. Groups get ``num_envs``
    split as evenly as possible. Env i of this rank draws the same reset seeds for any grouping
    and the trajectory lists envs in order, so its (N, T) layout does not depend on S.
    """

    def __init__(self, info, cfg: EnvConfig, seed: int, groups: int = 1,
                 channel_timeout: float = 600.0, reset_group_size: int = 1):
        super().__init__(info)
        self.cfg = cfg
        self.seed = seed
        self.timeout = channel_timeout
        if reset_group_size < 1 or cfg.num_envs % reset_group_size:
            raise ValueError(
                f"env.num_envs={cfg.num_envs} is not a multiple of algorithm.group_size="
                f"{reset_group_size}: each env worker holds whole groups of envs that reset to "
                "the same initial state."
            )
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

    def spec(self):
        return self.envs[0].spec

    def rollout(
        self, num_steps: int, obs_ch: Channel, act_ch: Channel, traj_ch: Channel, iteration: int,
        reset: bool = True, rebuild: bool = False, stages: int = 1,
    ) -> EpisodeStats:
        """Collects ``num_steps`` steps of every env and puts the (N, T) trajectory on traj_ch."""
        if reset or self._obs is None:
            self._obs = self._reset(seeding.TRAIN, iteration, rebuild)
        buffers = [TrajectoryBuffer(num_steps) for _ in self.sizes]
        runs = [_Episodes(n) for n in self.sizes]
        stats = EpisodeStats()

        def record(g: int, step: TensorDict) -> None:
            lost = step["next"].get("discarded", None)
            if lost is not None:  # a restarted simulator: its episode is not data
                step["valid"] = ~lost
            buffers[g].add(step)
            if lost is not None and lost.any():
                for i in lost.nonzero().flatten().tolist():
                    buffers[g].invalidate(i, steps_back=int(runs[g].len[i]))
            stats.extend(runs[g].update(step["next"]))

        self._obs = self._run(num_steps, self._obs, obs_ch, act_ch, record, stages)
        with self.timer("send"):
            traj = torch.cat([b.data() for b in buffers], dim=0)  # (N, T), envs in order
            traj_ch.put(traj, key=self.rank, timeout=self.timeout)
            traj_ch.flush()
        return stats

    def evaluate(self, rounds: int, obs_ch: Channel, act_ch: Channel, stages: int = 1,
                 chunk: int = 1) -> EpisodeStats:
        """``rounds`` x num_envs episodes from fixed seeds; counts each env's first episode."""
        stats = EpisodeStats()
        for r in range(rounds):
            seeds = seeding.derive(self.seed, seeding.EVAL, r, self.rank, self.num_envs)
            for ep in self.evaluate_round(obs_ch, act_ch, seeds, stages=stages, chunk=chunk):
                if ep.discarded:
                    stats.discarded += 1
                else:
                    stats.extend(EpisodeStats([ep.ret], [ep.length], [ep.success]))
        self._obs = None  # training resumes from a fresh reset
        return stats

    def evaluate_ranks(self, obs_ch: Channel, act_ch: Channel, per_rank: list[dict],
                       stages: int = 1) -> list["EvalEpisode"]:
        """``evaluate_round`` with this rank's entry of ``per_rank`` (one call for all ranks)."""
        return self.evaluate_round(obs_ch, act_ch, stages=stages, **per_rank[self.rank])

    def evaluate_round(
        self, obs_ch: Channel, act_ch: Channel, seeds: list[int], tasks: Optional[list] = None,
        max_steps: Optional[int] = None, video: Optional[list[bool]] = None, stages: int = 1,
        chunk: int = 1,
    ) -> list["EvalEpisode"]:
        """One episode per env: env i from ``seeds[i]`` (on task ``tasks[i]``), run for
        ``max_steps`` steps (default: the time limit); returns each env's first episode.

        ``chunk``: env steps per policy call (``max_steps / chunk`` calls, rounded up).
        ``video[i]``: keep env i's frames (its image observation) until that episode ends.
        An episode lost to a simulator restart comes back ``discarded``; the env's next
        episode is then not counted either.
        """
        max_steps = max_steps or self.spec().max_episode_steps
        if not max_steps:
            raise ValueError(f"env {self.cfg.name!r} has no time limit; set env.max_episode_steps.")
        n = self.num_envs
        episodes = [EvalEpisode(seed=seeds[i], task=None if tasks is None else int(tasks[i]))
                    for i in range(n)]
        image_key = _image_key(self.spec().obs_shapes) if video and any(video) else None
        keep = torch.tensor([bool(video and video[i] and image_key) for i in range(n)])
        runs = [_Episodes(m) for m in self.sizes]
        seen = torch.zeros(n, dtype=torch.bool)
        offsets = [sum(self.sizes[:g]) for g in range(len(self.sizes))]

        def frames(g: int, obs: TensorDict, live: torch.Tensor) -> None:
            for j in live.nonzero().flatten().tolist():
                episodes[offsets[g] + j].frames.append(obs[image_key][j].cpu().numpy())

        def record(g: int, step: TensorDict) -> None:
            sl = slice(offsets[g], offsets[g] + self.sizes[g])
            nxt = step["next"]
            lost = nxt.get("discarded", torch.zeros_like(nxt["done"])).cpu()
            done = nxt["done"].cpu()
            first = done & ~seen[sl]
            runs_g = runs[g]
            steps = nxt["num_steps"].cpu() if "num_steps" in nxt.keys() else 1
            ret, length, success = runs_g.ret + nxt["reward"].cpu(), runs_g.len + steps, \
                runs_g.success | nxt["success"].cpu()
            if image_key is not None and "frames" in nxt.keys():  # a chunk: every step's frame
                for j in (keep[sl] & ~seen[sl] & ~lost).nonzero().flatten().tolist():
                    for k in range(int(nxt["num_steps"][j])):
                        episodes[offsets[g] + j].frames.append(nxt["frames"][j, k].cpu().numpy())
            elif image_key is not None:
                frames(g, nxt["obs"], keep[sl] & ~seen[sl] & ~lost)
            for j in first.nonzero().flatten().tolist():
                ep = episodes[offsets[g] + j]
                ep.ret, ep.length, ep.success = float(ret[j]), int(length[j]), bool(success[j])
                ep.discarded = bool(lost[j])
            seen[sl] |= done
            runs_g.update(nxt)

        obs = self._reset(seeding.EVAL, 0, rebuild=True, seeds=seeds, tasks=tasks)
        if image_key is not None:
            for g, o in enumerate(obs):
                frames(g, o, keep[offsets[g] : offsets[g] + self.sizes[g]])
        for env in self.envs:
            env.frames_key = image_key
        try:
            self._run(math.ceil(max_steps / chunk), obs, obs_ch, act_ch, record, stages)
        finally:
            for env in self.envs:
                env.frames_key = None
        self._obs = None
        for g, runs_g in enumerate(runs):  # still running after max_steps: a failure so far
            for j in (~seen[offsets[g] : offsets[g] + self.sizes[g]]).nonzero().flatten().tolist():
                ep = episodes[offsets[g] + j]
                ep.ret, ep.length, ep.success = float(runs_g.ret[j]), int(runs_g.len[j]), False
        return episodes

    def _run(self, num_steps: int, obs: list, obs_ch: Channel, act_ch: Channel, record,
             stages: int) -> list:
        """The pipeline. Per step, stage by stage: wait for stage k's actions, wait for stage
        k-1's simulation to end, start stage k's, and only then record stage k-1's step and
        send its next obs. So one stage simulates at a time (a stage that shares the cores
        with another would finish later, and the rollout worker would wait for its obs), the
        rollout worker infers for the other stages meanwhile, and this worker's hand-offs
        (record, send: ~1 ms a step here) happen while a stage simulates instead of between
        simulations. S=1 has nothing to overlap with: finish, then wait for actions. Where the
        env steps in this thread (no background processes) each stage finishes in turn.
        Exactly ``num_steps`` obs go out per stage.
        """
        obs = list(obs)
        plan = self._stages(stages)
        background = all(self.envs[g].steps_in_background for groups in plan for g in groups)
        for k, groups in enumerate(plan):
            self._send(obs_ch, k, groups, obs)
        in_flight = None  # (stage, its actions, send its obs after?) started, not finished
        for t in range(num_steps):
            more = t + 1 < num_steps
            for k in range(len(plan)):
                if in_flight is not None and in_flight[0] == k:  # S=1
                    self._record(*in_flight, self._wait(in_flight[0], plan), plan, obs, obs_ch,
                                 record)
                    in_flight = None
                with self.timer("wait"):
                    act = act_ch.get(key=(self.rank, k), timeout=self.timeout)
                parts = act.split([self.sizes[g] for g in plan[k]]) if len(plan[k]) > 1 else [act]
                done = self._wait(in_flight[0], plan) if in_flight is not None else None
                with self.timer("sim"):
                    for g, a in zip(plan[k], parts):
                        self.envs[g].step_async(a["action"])
                if in_flight is not None:  # while stage k simulates
                    self._record(*in_flight, done, plan, obs, obs_ch, record)
                in_flight = (k, parts, more)
                if not background:
                    self._record(*in_flight, self._wait(k, plan), plan, obs, obs_ch, record)
                    in_flight = None
        if in_flight is not None:
            self._record(*in_flight, self._wait(in_flight[0], plan), plan, obs, obs_ch, record)
        with self.timer("send"):
            obs_ch.flush()
        return obs

    def _wait(self, k: int, plan: list) -> list:
        with self.timer("sim"):
            return [self.envs[g].step_wait() for g in plan[k]]

    def _record(self, k: int, parts: list, send: bool, outs: list, plan: list, obs: list,
                obs_ch: Channel, record) -> None:
        """Records stage k's step per group and sends its next obs if asked."""
        for g, a, out in zip(plan[k], parts, outs):
            step = out.empty()  # the step as the learner sees it (see m2flow.keys)
            step.update({"obs": obs[g], "next": out["next"]})
            step.update(a)
            record(g, step)
            obs[g] = out["obs"]
        if send:
            self._send(obs_ch, k, plan[k], obs)

    def _stages(self, stages: int) -> list[list[int]]:
        """Groups of each stage: contiguous runs, as even as possible."""
        if not 1 <= stages <= len(self.sizes):
            raise ValueError(
                f"{stages} pipeline stages asked of an env worker built with {len(self.sizes)} "
                f"env groups; set rollout.env_groups >= {stages} (it defaults to "
                "rollout.pipeline_stages)."
            )
        out, start = [], 0
        for n in stage_sizes(len(self.sizes), stages):
            out.append(list(range(start, start + n)))
            start += n
        return out

    def _send(self, obs_ch: Channel, k: int, groups: list[int], obs: list) -> None:
        with self.timer("send"):
            o = obs[groups[0]] if len(groups) == 1 else torch.cat([obs[g] for g in groups])
            obs_ch.put(TensorDict({"obs": o}, batch_size=o.batch_size), key=(self.rank, k),
                       timeout=self.timeout)

    def _reset(self, purpose: int, iteration: int, rebuild: bool = False,
               seeds: Optional[list] = None, tasks: Optional[list] = None) -> list:
        # env i of this rank at this iteration: a seed derived from all of them, for any S
        g = self.reset_group_size  # envs i // g share their initial state (GRPO groups)
        if seeds is None:
            seeds = seeding.derive(self.seed, purpose, iteration, self.rank, self.num_envs // g)
            seeds = [seeds[i // g] for i in range(self.num_envs)]
        num_tasks = len(self.spec().tasks)
        if num_tasks and tasks is None:
            # a multi-task env: group j trains on task (rank*N/g + j + iteration*N/g) mod tasks,
            # so every task gets envs over the iterations, and none switches when N*M covers all
            first = (self.rank + iteration) * (self.num_envs // g)
            tasks = [(first + i // g) % num_tasks for i in range(self.num_envs)]
        out, start = [], 0
        with self.timer("sim"):
            for env, n in zip(self.envs, self.sizes):
                kw = {} if tasks is None else {"task": tasks[start : start + n]}
                out.append(env.reset(seed=seeds[start : start + n], rebuild=rebuild, **kw)["obs"])
                start += n
        return out

    def close(self) -> None:
        for env in self.envs:
            env.close()


def stage_sizes(num_envs: int, stages: int) -> list[int]:
    """Envs per stage (or group): as even as possible, the first ones one more.

    >>> stage_sizes(7, 3)
    [3, 2, 2]
    """
    if not 1 <= stages <= num_envs:
        raise ValueError(
            f"rollout.pipeline_stages={stages} (or rollout.env_groups) with env.num_envs="
            f"{num_envs}: every stage needs at least one env; use 1 to {num_envs}."
        )
    base, extra = divmod(num_envs, stages)
    return [base + (k < extra) for k in range(stages)]


@dataclass
class EvalEpisode:
    """One evaluation episode: where it started and how it went."""

    seed: int
    task: Optional[int] = None
    ret: float = 0.0
    length: int = 0
    success: bool = False
    discarded: bool = False
    frames: list = field(default_factory=list)
    """(H, W, 3) uint8 images from the reset to the end of the episode, if asked for."""


def _image_key(obs_shapes: dict) -> Optional[str]:
    """The obs key videos are made of: 'rgb' if present, else the first (H, W, 3) key."""
    if "rgb" in obs_shapes:
        return "rgb"
    return next((k for k, s in obs_shapes.items() if len(s) == 3 and s[-1] == 3), None)


class _Episodes:
    """Running return/length/success of each env's current episode."""

    def __init__(self, n: int):
        self.ret = torch.zeros(n)
        self.len = torch.zeros(n, dtype=torch.long)
        self.success = torch.zeros(n, dtype=torch.bool)

    def update(self, nxt: TensorDict, only: torch.Tensor | None = None) -> EpisodeStats:
        self.ret += nxt["reward"].cpu()
        self.len += nxt["num_steps"].cpu() if "num_steps" in nxt.keys() else 1
        self.success |= nxt["success"].cpu()
        done = nxt["done"].cpu()
        lost = nxt.get("discarded", torch.zeros_like(done)).cpu()
        report = (done if only is None else only) & ~lost
        out = EpisodeStats(
            returns=self.ret[report].tolist(),
            lengths=self.len[report].tolist(),
            successes=self.success[report].tolist(),
            discarded=int(lost.sum()),
        )
        self.ret[done], self.len[done], self.success[done] = 0.0, 0, False
        return out
