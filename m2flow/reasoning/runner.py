"""The reasoning runner: GRPO on prompts with reference answers, on the ``pipelines`` engine.

One step reads top to bottom: generate ``prompts_per_step`` groups of ``n`` completions ->
score them -> one GRPO update -> send the weights to the rollout worker. The placement picks
how the three workers share time:

- ``collocated``: rollout and learner take turns on one device. Generation streams each group
  to the reward worker (scoring overlaps generation), then the rollout worker steps aside
  (offload, when the placement has them share a GPU or ``cluster.context_switch=always``) and
  the learner trains on the whole step.
- ``disaggregated`` / ``hybrid``: all three run at once; each group streams rollout -> reward
  -> learner, which runs a micro-batch's forward and backward as soon as it is full.

Both orders compute the same update: the learner divides accumulated token sums by the step's
token count, so the micro-batch boundaries and arrival times do not enter the result.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf
from tensordict import TensorDict

from m2flow.embodied import checkpoint
from m2flow.embodied.logger import RunLogger
from m2flow.pipelines import (
    Channel,
    Cluster,
    ContextSwitcher,
    Placement,
    PlacementError,
    WorkerGroup,
    switch_plan,
)
from m2flow.pipelines.worker import gather
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.learner_worker import ReasoningLearner
from m2flow.reasoning.reward_worker import RewardWorker
from m2flow.reasoning.rollout_worker import ReasoningRollout

COMPONENTS = ("rollout", "reward", "learner")


class ReasoningRunner:
    def __init__(self, cfg: ReasoningConfig, *, train: bool = True):
        self.cfg = cfg
        self.cluster = Cluster(cfg.cluster)
        self.placement = Placement(cfg.cluster.placement, self.cluster.nodes)
        for name in COMPONENTS:
            if self.placement.component(name).workers != 1:
                raise PlacementError(
                    f"placement.components.{name}.workers="
                    f"{self.placement.component(name).workers}: the reasoning runner uses one "
                    "rank per component; set it to 1."
                )
        self.mode = "collocated" if self.placement.mode == "collocated" else "pipelined"
        plan = switch_plan(self.placement.shares_device, ["rollout", "learner"],
                           cfg.cluster.context_switch)
        if self.mode == "pipelined" and any(plan.values()):
            raise PlacementError(
                f"placement.mode={self.placement.mode} runs rollout and learner at the same time, "
                "but they share a GPU (or cluster.context_switch=always asks them to take "
                "turns); give them disjoint gpus or set placement.mode=collocated."
            )
        self.groups: list[WorkerGroup] = []
        self.rollout = self._group("rollout", ReasoningRollout, cfg)
        self.step = 0
        self.learner = None
        if train:
            self.reward = self._group("reward", RewardWorker, cfg)
            self.learner = self._group("learner", ReasoningLearner, cfg)
            p = cfg.algorithm.prompts_per_step
            self.gen_ch = Channel("generated", self.reward, capacity=p, item_type=TensorDict)
            self.scored_ch = Channel("scored", self.learner, capacity=p, item_type=TensorDict)
            self.switcher = ContextSwitcher({"rollout": self.rollout, "learner": self.learner},
                                            plan, force=cfg.cluster.context_switch == "always")
            if cfg.resume:
                self.load(cfg.resume)

    def _group(self, name: str, cls: type, *args) -> WorkerGroup:
        group = WorkerGroup(self.cluster, name, cls, self.placement.ranks(name), *args)
        self.groups.append(group)
        return group

    # -- phases ------------------------------------------------------------------------------
    def warm_start(self) -> dict:
        metrics = self.switcher.activate("learner")
        metrics.update(self.learner.call("warm_start", self.cfg.warm_start.steps).wait()[0])
        metrics.update(self.sync_weights(self.step))
        return metrics

    def sync_weights(self, version: int) -> dict:
        t0 = time.perf_counter()
        weights = self.learner.call("get_weights").as_arg()
        self.rollout.call("set_weights", weights, version).wait()
        return {"time/driver_weight_sync": time.perf_counter() - t0}

    def iterate(self, step: int) -> dict:
        """One GRPO step; its metrics."""
        p = self.cfg.algorithm.prompts_per_step
        t0 = time.perf_counter()
        metrics = self.switcher.activate("rollout")
        gen = self.rollout.call("generate_step", step, self.gen_ch)
        score = self.reward.call("score_step", self.gen_ch, self.scored_ch, p)
        if self.mode == "pipelined":
            gen_out, score_out, learn_out = gather(
                gen, score, self.learner.call("update", self.scored_ch, p, step))
        else:
            gen_out, score_out = gather(gen, score)
            t_gen = time.perf_counter() - t0
            for k, v in self.switcher.activate("learner").items():
                metrics[k] += v
            learn_out = self.learner.call("update", self.scored_ch, p, step).wait()
            metrics["time/driver_generate"] = t_gen
        metrics.update(self.sync_weights(step + 1))
        metrics.update(gen_out[0], **score_out[0], **learn_out[0], **self.timings())
        wall = time.perf_counter() - t0
        metrics["perf/gen_tokens_per_s"] = metrics["perf/gen_tokens"] / max(metrics["perf/gen_s"], 1e-9)
        metrics["perf/step_s"] = wall
        self.step = step + 1
        return metrics

    def evaluate(self, size: int = 0, samples: int = 0) -> dict:
        if self.learner is not None:
            self.switcher.activate("rollout")
        out = self.rollout.call("evaluate", size, samples).wait()[0]
        return out

    def timings(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for g in self.groups:
            for phase, s in g.call("pop_timings").wait()[0].items():
                if phase not in ("offload", "onload"):  # the switcher reports those
                    out[f"time/{g.name}_{phase}"] = s
        return out

    # -- the loop ----------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, r = self.cfg, self.cfg.runner
        self.run_dir = _run_dir(cfg)
        (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        logger = RunLogger(self.run_dir, r.num_steps, self.step, bar=r.progress_bar)
        logger.info(f"run dir {self.run_dir}; GRPO on "
                    f"{cfg.data.source}, mode {self.mode}, backend {cfg.cluster.backend}")
        start = time.perf_counter()
        result: dict = {}
        try:
            if self.step == 0:
                if cfg.warm_start.steps > 0:
                    ws = self.warm_start()
                    logger.info(f"warm start: {cfg.warm_start.steps} SFT steps, loss "
                                f"{ws['warm_start/loss_first']:.3f} -> {ws['warm_start/loss_last']:.3f}")
                ev = self.evaluate()
                result["eval/accuracy_start"] = ev["accuracy"]
                logger.info(f"held-out accuracy before GRPO: {ev['accuracy']:.3f} "
                            f"({ev['problems']} problems)")
                self.save({"eval/accuracy": ev["accuracy"]})
                self.timings()  # the warm start's and evaluation's time is not step 0's
            grpo_start = time.perf_counter()  # runner.max_minutes counts GRPO steps only
            for step in range(self.step, r.num_steps):
                metrics = self.iterate(step)
                over = (r.max_minutes is not None
                        and time.perf_counter() - grpo_start > 60 * r.max_minutes)
                last = self.step == r.num_steps or over
                if last or (r.eval_interval > 0 and self.step % r.eval_interval == 0):
                    t0 = time.perf_counter()
                    ev = self.evaluate()
                    metrics.update({"eval/accuracy": ev["accuracy"],
                                    "eval/response_len": ev["response_len"],
                                    "time/eval": time.perf_counter() - t0})
                    result.update(metrics)
                logger.log(step, self.step * cfg.algorithm.prompts_per_step * cfg.rollout.n,
                           metrics)
                if last or (r.checkpoint_interval > 0 and self.step % r.checkpoint_interval == 0):
                    self.save(metrics)
                if over:
                    logger.info(f"runner.max_minutes={r.max_minutes} reached: stopping")
                    break
        finally:
            logger.close()
        return {**result, "steps": self.step, "wall_s": time.perf_counter() - start,
                "grpo_s": time.perf_counter() - grpo_start,
                "checkpoint": str(self.run_dir / "checkpoints" / "last.pt")}

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, metrics: Optional[dict] = None) -> Path:
        state = {
            "workload": "reasoning",
            "iteration": self.step,
            "learner": self.learner.call("state_dict").wait()[0],
            "config": OmegaConf.to_yaml(OmegaConf.structured(self.cfg)),
            "metrics": {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float))},
        }
        path = checkpoint.save(self.run_dir / "checkpoints" / f"step_{self.step:05d}.pt", state)
        checkpoint.link_latest(path)
        return path

    def load(self, path: str) -> None:
        state = checkpoint.load(path)
        self.learner.call("load_state_dict", state["learner"]).wait()
        self.step = state["iteration"]
        self.sync_weights(self.step)

    def load_policy(self, state: dict) -> None:
        self.rollout.call("set_weights", state["learner"]["model"], state["iteration"]).wait()

    def close(self) -> None:
        for g in reversed(self.groups):
            g.shutdown()
        self.groups = []
        self.cluster.shutdown()


def _run_dir(cfg: ReasoningConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    d = Path(cfg.runner.log_dir) / cfg.run_name / stamp
    d.mkdir(parents=True, exist_ok=True)
    return d
