"""The embodied runner: wires env, rollout and learner workers through ``pipelines``.

One iteration reads top to bottom: collect -> update (advantages + PPO) -> sync weights ->
evaluate (sometimes) -> log -> checkpoint (sometimes).
"""

from __future__ import annotations

import math
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf
from tensordict import TensorDict

from m2flow.embodied import checkpoint
from m2flow.embodied.config import TrainConfig
from m2flow.embodied.env_worker import EnvWorker, EpisodeStats
from m2flow.embodied.learner_worker import LearnerWorker
from m2flow.embodied.logger import RunLogger, log
from m2flow.embodied.rollout_worker import RolloutWorker
from m2flow.pipelines import Channel, Cluster, Placement, WorkerGroup
from m2flow.pipelines.worker import gather

COMPONENTS = ("env", "rollout", "learner")


class EmbodiedRunner:
    """Builds the cluster, places the three components and runs PPO iterations.

    Args:
        cfg: the root config.
        train: False builds env and rollout workers only (evaluation).
    """

    def __init__(self, cfg: TrainConfig, *, train: bool = True):
        self.cfg = cfg
        r = cfg.runner
        self.cluster = Cluster(cfg.cluster)
        self.placement = Placement(cfg.cluster.placement, self.cluster.nodes)
        self.groups: list[WorkerGroup] = []
        self.env = self._group("env", EnvWorker, cfg.env, cfg.seed, r.channel_timeout_s)
        self.spec = self.env.call("spec", ranks=[0]).wait()[0]
        self.rollout = self._group(
            "rollout", RolloutWorker, cfg.policy, self.spec, cfg.seed, r.channel_timeout_s
        )
        self.env_ranks = list(range(self.env.world_size))
        self.obs_ch = Channel("obs", self.rollout, item_type=TensorDict,
                              routes={e: e % self.rollout.world_size for e in self.env_ranks})
        self.act_ch = Channel("action", self.env, item_type=TensorDict)
        self.num_envs = cfg.env.num_envs * self.env.world_size
        self.iteration, self.global_step = 0, 0
        self.learner = None
        if train:
            self.learner = self._group(
                "learner", LearnerWorker, cfg.policy, cfg.algorithm, self.spec, cfg.seed,
                r.num_iterations, r.channel_timeout_s,
            )
            self.traj_ch = Channel("trajectory", self.learner, item_type=TensorDict,
                                   routes={e: 0 for e in self.env_ranks})
            if cfg.resume:
                self.load(cfg.resume)
            self.sync_weights()

    def _group(self, name: str, cls: type, *args) -> WorkerGroup:
        group = WorkerGroup(self.cluster, name, cls, self.placement.ranks(name), *args)
        self.groups.append(group)
        return group

    # -- one iteration, step by step ---------------------------------------------------------
    def collect(self, iteration: int) -> EpisodeStats:
        """Runs ``rollout_steps`` steps of every env; trajectories go to the learner's channel."""
        r = self.cfg.runner
        env_out, _ = gather(
            self.env.call("rollout", r.rollout_steps, self.obs_ch, self.act_ch, self.traj_ch,
                          iteration, r.reset_every_iteration, r.exact_resets),
            self._serve(r.rollout_steps, iteration, deterministic=False),
        )
        return _merge(env_out)

    def update(self, iteration: int) -> dict:
        return self.learner.call("update", self.traj_ch, self.env_ranks, iteration).wait()[0]

    def sync_weights(self) -> None:
        weights = self.learner.call("get_weights", ranks=[0]).as_arg()
        self.rollout.call("set_weights", weights).wait()

    def evaluate(self, episodes: Optional[int] = None, deterministic: bool = True) -> dict:
        """Episodes from fixed seeds (mean actions by default): ``eval/success`` and friends."""
        episodes = episodes or self.cfg.runner.eval_episodes
        rounds = max(1, math.ceil(episodes / self.num_envs))
        steps = rounds * self.spec.max_episode_steps
        env_out, _ = gather(
            self.env.call("evaluate", rounds, self.obs_ch, self.act_ch),
            self._serve(steps, 0, deterministic=deterministic),
        )
        return {k.replace("env/", "eval/"): v for k, v in _merge(env_out).summary().items()}

    def _serve(self, steps: int, iteration: int, deterministic: bool):
        return self.rollout.call(
            "serve", steps, self.obs_ch, self.act_ch, self.env_ranks, iteration, deterministic
        )

    def timings(self) -> dict[str, float]:
        """Per-component seconds since the last call (slowest rank of each component)."""
        out: dict[str, float] = {}
        for g in self.groups:
            per_rank = g.call("pop_timings").wait()
            for p in {p for t in per_rank for p in t}:
                out[f"time/{g.name}_{p}"] = max(t.get(p, 0.0) for t in per_rank)
        return out

    # -- the loop ----------------------------------------------------------------------------
    def iterate(self, it: int) -> dict:
        """One iteration: collect -> update (advantages + PPO) -> sync weights; its metrics."""
        steps = self.cfg.runner.rollout_steps * self.num_envs
        t0 = time.perf_counter()
        episodes = self.collect(it)
        t_collect = time.perf_counter() - t0
        metrics = self.update(it)
        t1 = time.perf_counter()
        self.sync_weights()
        t_sync = time.perf_counter() - t1
        self.global_step += steps
        self.iteration = it + 1
        return {
            **metrics,
            **episodes.summary(),
            **self.timings(),
            "perf/env_steps_per_s": steps / t_collect,
            "perf/iteration_s": time.perf_counter() - t0,
            "time/driver_weight_sync": t_sync,
        }

    def train(self) -> dict:
        """Iterates until ``runner.num_iterations`` or ``runner.stop_at_success``; a summary."""
        cfg, r = self.cfg, self.cfg.runner
        self.run_dir = _run_dir(cfg)
        (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        logger = RunLogger(self.run_dir, r.num_iterations, self.iteration, bar=r.progress_bar)
        logger.info(f"run dir {self.run_dir}; {self.num_envs} envs of {cfg.env.name}, "
                    f"placement {self.placement.mode}, backend {cfg.cluster.backend}")
        start_wall, result = time.perf_counter(), {}
        try:
            for it in range(self.iteration, r.num_iterations):
                metrics = self.iterate(it)
                if self._due(r.eval_interval):
                    t0 = time.perf_counter()
                    metrics.update(self.evaluate())
                    metrics["time/eval"] = time.perf_counter() - t0
                    self.timings()  # eval's worker timings are not part of the next iteration
                    result = dict(metrics)
                stop = r.stop_at_success is not None and metrics.get("eval/success", -1.0) >= r.stop_at_success
                logger.log(it, self.global_step, metrics)
                if stop or self._due(r.checkpoint_interval):
                    self.save(metrics)
                if stop:
                    logger.info(f"eval success {metrics['eval/success']:.3f} >= "
                                f"runner.stop_at_success={r.stop_at_success}: stopping")
                    break
        finally:
            logger.close()
        return {
            **result,
            "iterations": self.iteration,
            "env_steps": self.global_step,
            "wall_s": time.perf_counter() - start_wall,
            "checkpoint": str(self.run_dir / "checkpoints" / "last.pt"),
        }

    def _due(self, interval: int) -> bool:
        """True after the last iteration, and every ``interval`` iterations (0: never else)."""
        last = self.iteration == self.cfg.runner.num_iterations
        return last or (interval > 0 and self.iteration % interval == 0)

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, metrics: Optional[dict] = None) -> Path:
        state = {
            "iteration": self.iteration,
            "global_step": self.global_step,
            "learner": self.learner.call("state_dict", ranks=[0]).wait()[0],
            "config": OmegaConf.to_yaml(OmegaConf.structured(self.cfg)),
            "metrics": dict(metrics or {}),
        }
        path = checkpoint.save(self.run_dir / "checkpoints" / f"iter_{self.iteration:05d}.pt", state)
        checkpoint.link_latest(path)
        return path

    def load(self, path: str) -> None:
        state = checkpoint.load(path)
        self.learner.call("load_state_dict", state["learner"]).wait()
        self.iteration, self.global_step = state["iteration"], state["global_step"]
        log.info(f"resumed from {path} at iteration {self.iteration}")

    def load_policy(self, state: dict) -> None:
        """Loads a checkpoint's policy weights into the rollout workers (evaluation)."""
        self.rollout.call("set_weights", state["learner"]["policy"]).wait()

    def close(self) -> None:
        for g in reversed(self.groups):
            g.shutdown()
        self.groups = []
        self.cluster.shutdown()


def _merge(parts: list[EpisodeStats]) -> EpisodeStats:
    total = EpisodeStats()
    for p in parts:
        total.extend(p)
    return total


def _run_dir(cfg: TrainConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    d = Path(cfg.runner.log_dir) / cfg.run_name / stamp
    d.mkdir(parents=True, exist_ok=True)
    return d
