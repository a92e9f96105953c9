"""The env worker: steps its envs with actions that arrive on a channel. Nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from tensordict import TensorDict

from m2flow.embodied import seeding
from m2flow.embodied.buffer import TrajectoryBuffer
from m2flow.envs import EnvConfig, make_env
from m2flow.pipelines import Channel, Worker


@dataclass
class EpisodeStats:
    """Episodes that ended during a call (per-env running sums live in the worker)."""

    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    successes: list[bool] = field(default_factory=list)

    def extend(self, other: "EpisodeStats") -> None:
        self.returns += other.returns
        self.lengths += other.lengths
        self.successes += other.successes

    def summary(self) -> dict[str, float]:
        n = len(self.returns)
        if n == 0:
            return {"env/episodes": 0.0}
        return {
            "env/episodes": float(n),
            "env/return": sum(self.returns) / n,
            "env/episode_len": sum(self.lengths) / n,
            "env/success": sum(self.successes) / n,
        }


class EnvWorker(Worker):
    """Owns ``cfg.num_envs`` envs as ``stages`` groups (pipeline stages); per step and stage it
    sends obs on ``obs_ch`` and reads actions from ``act_ch``.

    Lane key of stage k of this worker on both channels: ``(rank, k)``. Stages get
    ``num_envs`` split as evenly as possible (the first ones one env more). Env i of this rank
    draws the same reset seeds for any number of stages, and the trajectory concatenates the
    stages in env order, so its (N, T) layout does not depend on S.
    """

    def __init__(self, info, cfg: EnvConfig, seed: int, stages: int = 1,
                 channel_timeout: float = 600.0):
        super().__init__(info)
        self.cfg = cfg
        self.seed = seed
        self.timeout = channel_timeout
        self.sizes = stage_sizes(cfg.num_envs, stages)
        self.envs = [make_env(replace(cfg, num_envs=n), device=self.device) for n in self.sizes]
        self.num_envs = cfg.num_envs
        self._obs: Optional[list] = None  # per stage: the obs to act on next

    def spec(self):
        return self.envs[0].spec

    def rollout(
        self, num_steps: int, obs_ch: Channel, act_ch: Channel, traj_ch: Channel, iteration: int,
        reset: bool = True, rebuild: bool = False,
    ) -> EpisodeStats:
        """Collects ``num_steps`` steps of every env and puts the (N, T) trajectory on traj_ch."""
        if reset or self._obs is None:
            self._obs = self._reset(seeding.TRAIN, iteration, rebuild)
        buffers = [TrajectoryBuffer(num_steps) for _ in self.sizes]
        runs = [_Episodes(n) for n in self.sizes]
        stats = EpisodeStats()

        def record(k: int, step: TensorDict) -> None:
            buffers[k].add(step)
            stats.extend(runs[k].update(step["next"]))

        self._obs = self._run(num_steps, self._obs, obs_ch, act_ch, record)
        with self.timer("send"):
            traj = torch.cat([b.data() for b in buffers], dim=0)  # (N, T), envs in order
            traj_ch.put(traj, key=self.rank, timeout=self.timeout)
            traj_ch.flush()
        return stats

    def evaluate(self, rounds: int, obs_ch: Channel, act_ch: Channel) -> EpisodeStats:
        """``rounds`` x num_envs episodes from fixed seeds; counts each env's first episode."""
        max_steps = self.spec().max_episode_steps
        if not max_steps:
            raise ValueError(f"env {self.cfg.name!r} has no time limit; set env.max_episode_steps.")
        stats = EpisodeStats()
        for r in range(rounds):
            runs = [_Episodes(n) for n in self.sizes]
            seen = [torch.zeros(n, dtype=torch.bool) for n in self.sizes]

            def record(k: int, step: TensorDict) -> None:
                done = step["next", "done"].cpu()
                stats.extend(runs[k].update(step["next"], only=done & ~seen[k]))
                seen[k] |= done

            obs = self._reset(seeding.EVAL, r, rebuild=True)
            self._run(max_steps, obs, obs_ch, act_ch, record)
        self._obs = None  # training resumes from a fresh reset
        return stats

    def _run(self, num_steps: int, obs: list, obs_ch: Channel, act_ch: Channel, record) -> list:
        """The pipeline: per step, each stage in turn waits for its actions and simulates.

        Stage k's next obs is sent as soon as it simulated, so the rollout worker infers for
        it while the later stages simulate. Exactly ``num_steps`` obs go out per stage.
        """
        obs = list(obs)
        for k in range(len(self.sizes)):
            self._send(obs_ch, k, obs[k])
        for t in range(num_steps):
            for k, env in enumerate(self.envs):
                with self.timer("wait"):
                    act = act_ch.get(key=(self.rank, k), timeout=self.timeout)
                with self.timer("sim"):
                    out = env.step(act["action"])
                step = out.empty()  # the step as the learner sees it (see m2flow.keys)
                step.update({"obs": obs[k], "next": out["next"]})
                step.update(act)
                record(k, step)
                obs[k] = out["obs"]
                if t + 1 < num_steps:
                    self._send(obs_ch, k, obs[k])
        with self.timer("send"):
            obs_ch.flush()
        return obs

    def _send(self, obs_ch: Channel, k: int, obs: TensorDict) -> None:
        with self.timer("send"):
            obs_ch.put(TensorDict({"obs": obs}, batch_size=[self.sizes[k]]), key=(self.rank, k),
                       timeout=self.timeout)

    def _reset(self, purpose: int, iteration: int, rebuild: bool = False) -> list:
        # env i of this rank at this iteration: a seed derived from all of them, for any S
        seeds = seeding.derive(self.seed, purpose, iteration, self.rank, self.num_envs)
        out, start = [], 0
        with self.timer("sim"):
            for env, n in zip(self.envs, self.sizes):
                out.append(env.reset(seed=seeds[start : start + n], rebuild=rebuild)["obs"])
                start += n
        return out

    def close(self) -> None:
        for env in self.envs:
            env.close()


def stage_sizes(num_envs: int, stages: int) -> list[int]:
    """Envs per stage: as even as possible, the first stages one more.

    >>> stage_sizes(7, 3)
    [3, 2, 2]
    """
    if not 1 <= stages <= num_envs:
        raise ValueError(
            f"rollout.pipeline_stages={stages} with env.num_envs={num_envs}: every stage needs "
            f"at least one env; use 1 to {num_envs} stages."
        )
    base, extra = divmod(num_envs, stages)
    return [base + (k < extra) for k in range(stages)]


class _Episodes:
    """Running return/length/success of each env's current episode."""

    def __init__(self, n: int):
        self.ret = torch.zeros(n)
        self.len = torch.zeros(n, dtype=torch.long)
        self.success = torch.zeros(n, dtype=torch.bool)

    def update(self, nxt: TensorDict, only: torch.Tensor | None = None) -> EpisodeStats:
        self.ret += nxt["reward"].cpu()
        self.len += 1
        self.success |= nxt["success"].cpu()
        done = nxt["done"].cpu()
        report = done if only is None else only
        out = EpisodeStats(
            returns=self.ret[report].tolist(),
            lengths=self.len[report].tolist(),
            successes=self.success[report].tolist(),
        )
        self.ret[done], self.len[done], self.success[done] = 0.0, 0, False
        return out
