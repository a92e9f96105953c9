"""The env worker: steps its envs with actions that arrive on a channel. Nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """Owns ``cfg.num_envs`` envs; sends obs on ``obs_ch``, reads actions from ``act_ch``.

    Lane key of this worker on both channels: its rank.
    """

    def __init__(self, info, cfg: EnvConfig, seed: int, channel_timeout: float = 600.0):
        super().__init__(info)
        self.cfg = cfg
        self.seed = seed
        self.timeout = channel_timeout
        self.env = make_env(cfg, device=self.device)
        self.num_envs = self.env.num_envs
        self._obs = None

    def spec(self):
        return self.env.spec

    def rollout(
        self, num_steps: int, obs_ch: Channel, act_ch: Channel, traj_ch: Channel, iteration: int,
        reset: bool = True, rebuild: bool = False,
    ) -> EpisodeStats:
        """Collects ``num_steps`` steps of every env and puts the (N, T) trajectory on traj_ch."""
        if reset or self._obs is None:
            self._obs = self._reset(seeding.TRAIN, iteration, rebuild)
        buffer, stats = TrajectoryBuffer(num_steps), EpisodeStats()
        run = _Episodes(self.num_envs)
        for _ in range(num_steps):
            out, step = self._step(self._obs, obs_ch, act_ch)
            buffer.add(step)
            stats.extend(run.update(step["next"]))
            self._obs = out["obs"]
        traj = buffer.data()  # (N, T)
        with self.timer("send"):
            traj_ch.put(traj, key=self.rank, timeout=self.timeout)
            traj_ch.flush()
            obs_ch.flush()
        return stats

    def evaluate(self, rounds: int, obs_ch: Channel, act_ch: Channel) -> EpisodeStats:
        """``rounds`` x num_envs episodes from fixed seeds; counts each env's first episode."""
        max_steps = self.env.spec.max_episode_steps
        if not max_steps:
            raise ValueError(f"env {self.cfg.name!r} has no time limit; set env.max_episode_steps.")
        stats = EpisodeStats()
        for r in range(rounds):
            obs = self._reset(seeding.EVAL, r, rebuild=True)
            run, first = _Episodes(self.num_envs), EpisodeStats()
            seen = torch.zeros(self.num_envs, dtype=torch.bool)
            for _ in range(max_steps):
                out, step = self._step(obs, obs_ch, act_ch)
                done = step["next", "done"].cpu()
                first.extend(run.update(step["next"], only=done & ~seen))
                seen |= done
                obs = out["obs"]
            stats.extend(first)
        obs_ch.flush()
        self._obs = None  # training resumes from a fresh reset
        return stats

    def _reset(self, purpose: int, iteration: int, rebuild: bool = False):
        # env i of this rank at this iteration: a seed derived from all of them
        seeds = seeding.derive(self.seed, purpose, iteration, self.rank, self.num_envs)
        with self.timer("sim"):
            return self.env.reset(seed=seeds, rebuild=rebuild)["obs"]

    def _step(self, obs, obs_ch: Channel, act_ch: Channel):
        with self.timer("send"):
            obs_ch.put(TensorDict({"obs": obs}, batch_size=[self.num_envs]), key=self.rank,
                       timeout=self.timeout)
        with self.timer("wait"):
            act = act_ch.get(key=self.rank, timeout=self.timeout)
        with self.timer("sim"):
            out = self.env.step(act["action"])
        step = TensorDict(
            {"obs": obs, "action": act["action"], "log_prob": act["log_prob"],
             "value": act["value"], "next": out["next"]},
            batch_size=[self.num_envs],
        )
        return out, step

    def close(self) -> None:
        self.env.close()


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
