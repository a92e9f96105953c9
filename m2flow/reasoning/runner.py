"""The reasoning runner: GRPO on prompts with reference answers, on the ``pipelines`` engine.

One step reads top to bottom: generate ``prompts_per_step`` groups of ``n`` completions ->
score them -> one GRPO update -> send the weights to the rollout worker (bucket by bucket, at
most ``runner.weight_sync_bucket_mb`` each). The placement picks how the three workers share
time:

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
from typing import Optional

from tensordict import TensorDict

from m2flow.pipelines import Channel, PlacementError
from m2flow.pipelines.futures import gather
from m2flow.reasoning.checks import memory_hint
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.learner_worker import ReasoningLearner
from m2flow.reasoning.reward_worker import RewardWorker
from m2flow.reasoning.rollout_worker import ReasoningRollout
from m2flow.runs.logger import log_field
from m2flow.runs.loop import RunLoop
from m2flow.runs.control import RunControl
from m2flow.runs.session import RunSession
from m2flow.runs.weights import send_state, sync_groups

WORKLOAD = "reasoning"
COMPONENTS = ("rollout", "reward", "learner")
LOG_FIELDS = [  # the per-step log line, after "it N | steps S" (S: completions so far)
    log_field("reward {:.3f}", "train/reward"),
    log_field("len {:.1f}", "train/response_len"),
    log_field("eval_acc {:.3f}", "eval/accuracy"),
    log_field("gen_tok/s {:.0f}", "perf/gen_tokens_per_s"),
]
BAR_FIELDS = [
    log_field("reward={:.3f}", "train/reward"),
    log_field("eval_acc={:.3f}", "eval/accuracy", sticky=True),
]


class RewardSignalWatch:
    """Counts GRPO steps in a row whose every group got one reward for all its completions
    (advantages all 0: nothing to learn) and returns a warning line every ``steps`` of them.

    >>> watch = RewardSignalWatch(steps=2, reward="exact")
    >>> [watch.update({"train/groups_constant": 4.0, "train/reward": 0.0}, num_groups=4)
    ...  is not None for _ in range(4)]
    [False, True, False, True]
    >>> watch.update({"train/groups_constant": 3.0, "train/reward": 0.2}, num_groups=4)
    >>> watch.streak
    0
    """

    def __init__(self, steps: int, reward: str):
        self.iterations, self.reward, self.streak = steps, reward, 0

    def update(self, metrics: dict, *, num_groups: int) -> Optional[str]:
        if metrics["train/groups_constant"] < num_groups:
            self.streak = 0
            return None
        self.streak += 1
        if self.iterations <= 0 or self.streak % self.iterations:
            return None
        return (
            f"WARNING: no reward signal for {self.streak} GRPO steps in a row: every group's "
            f"completions got the same reward (mean {metrics['train/reward']:.3f}), so every "
            "advantage is 0, algorithm.filter_groups drops every group and the model does not "
            "learn. Likely causes: the reward function fails and scores everything alike "
            f"(algorithm.reward={self.reward}: check that it gives a known-correct completion "
            "1.0 on the worker), answers the model never gets right (too hard, "
            "rollout.max_new_tokens too short to finish, data.template not asking for the form "
            "the reward reads) or always gets right (too easy). "
            "runner.warn_constant_reward_steps=0 silences this."
        )


def merge_accuracy(parts: list[dict]) -> dict:
    """One evaluation's result from its slices' (``ReasoningRollout.eval_accuracy``).

    >>> merge_accuracy([{"accuracy": 1.0, "response_len": 4.0, "problems": 2, "samples": [1]},
    ...                 {"accuracy": 0.0, "response_len": 1.0, "problems": 1, "samples": []}])
    {'accuracy': 0.6666666666666666, 'response_len': 3.0, 'problems': 3, 'samples': [1]}
    """
    n = sum(p["problems"] for p in parts)
    return {"accuracy": sum(p["accuracy"] * p["problems"] for p in parts) / max(1, n),
            "response_len": sum(p["response_len"] * p["problems"] for p in parts) / max(1, n),
            "problems": n, "samples": [s for p in parts for s in p["samples"]]}


class ReasoningRunner(RunLoop):
    """Builds the cluster, places rollout, reward and learner, and runs GRPO steps in the run
    loop (:class:`m2flow.runs.loop.RunLoop`, ``train``); an iteration is one GRPO step."""

    unit, checkpoint_prefix = "steps", "step"
    log_fields, bar_fields = LOG_FIELDS, BAR_FIELDS

    def __init__(self, cfg: ReasoningConfig, *, train: bool = True,
                 control: Optional[RunControl] = None):
        self.cfg = cfg
        self.session = RunSession(cfg, workload=WORKLOAD, best_metric="eval/accuracy",
                                  control=control)
        try:
            self._start(cfg, train)
        except BaseException:  # a failed or stopped (Ctrl-C) start-up ends what it started
            self.session.close()
            raise
        if not train:
            self.session.phase = "evaluation"  # all that is left to do

    def _start(self, cfg: ReasoningConfig, train: bool) -> None:
        self.placement = self.session.placement
        for name in COMPONENTS:
            if self.placement.component(name).workers != 1:
                raise PlacementError(
                    f"placement.components.{name}.workers="
                    f"{self.placement.component(name).workers}: the reasoning runner uses one "
                    "rank per component; set it to 1."
                )
        self.mode = "collocated" if self.placement.mode == "collocated" else "pipelined"
        offloads = self.session.offloads_for(["rollout", "learner"])
        if self.mode == "pipelined" and any(offloads.values()):
            raise PlacementError(
                f"placement.mode={self.placement.mode} runs rollout and learner at the same time, "
                "but they share a GPU (or cluster.context_switch=always asks them to take "
                "turns); give them disjoint gpus or set placement.mode=collocated."
            )
        self.rollout = self.session.group("rollout", ReasoningRollout, cfg)
        self.iteration = 0
        self.learner = None
        if train:
            self.reward = self.session.group("reward", RewardWorker, cfg)
            self.learner = self.session.group("learner", ReasoningLearner, cfg)
            p = cfg.algorithm.prompts_per_step
            self.gen_ch = Channel("generated", self.reward, capacity=p, item_type=TensorDict)
            self.scored_ch = Channel("scored", self.learner, capacity=p, item_type=TensorDict)
            self.switcher = self.session.take_turns(
                {"rollout": self.rollout, "learner": self.learner}, offloads)
            if cfg.resume:
                self.load(cfg.resume)

    # -- phases ------------------------------------------------------------------------------
    def warm_start(self) -> dict:
        metrics = self.switcher.activate("learner")
        metrics.update(self.learner.call(ReasoningLearner.warm_start,
                                         steps=self.cfg.warm_start.steps).wait()[0])
        metrics.update(self.sync_weights(self.iteration))
        return metrics

    def sync_weights(self, version: int, *, full: bool = False) -> dict:
        """Sends the learner's weights (the version after ``version`` GRPO steps) to the
        rollout's engine: what an update changed (the trainable parameters), or everything
        when ``full`` (the learner's first sync and the one after a resume are full anyway),
        one bucket of at most ``runner.weight_sync_bucket_mb`` at a time, from the learner to
        the rollout directly: the object store holds one bucket, not the model, and the driver
        makes one call (see :func:`m2flow.runs.weights.sync_groups`)."""
        t0 = time.perf_counter()
        sync_groups(self.learner, self.rollout, version=version, full=full,
                    bucket_mb=self.cfg.runner.weight_sync_bucket_mb)
        return {"time/driver_weight_sync": time.perf_counter() - t0}

    def send_policy(self, state: dict, version: int = 0) -> None:
        """Sends a whole state dict held here (evaluation: a checkpoint's weights) to the
        rollout's engine, bucket by bucket like ``sync_weights``."""
        send_state(self.rollout, state, version=version,
                   bucket_mb=self.cfg.runner.weight_sync_bucket_mb)

    def iterate(self, it: int) -> dict:
        """One GRPO step; its metrics."""
        p = self.cfg.algorithm.prompts_per_step
        t0 = time.perf_counter()
        self.session.phase = "generation"
        metrics = self.switcher.activate("rollout")
        gen = self.rollout.call(ReasoningRollout.generate_step, self.gen_ch, iteration=it)
        score = self.reward.call(RewardWorker.score_step, self.gen_ch, self.scored_ch,
                                 num_groups=p)
        if self.mode == "pipelined":
            self.session.phase = "generation and learning"
            gen_out, score_out, learn_out = gather(
                gen, score, self._update(it))
        else:
            gen_out, score_out = gather(gen, score)
            t_gen = time.perf_counter() - t0
            self.session.phase = "learning"
            for k, v in self.switcher.activate("learner").items():
                metrics[k] += v
            learn_out = self._update(it).wait()
            metrics["time/driver_generate"] = t_gen
        self.iteration = it + 1  # what the learner holds now (a stop from here saves it)
        self.session.phase = "weight sync"
        metrics.update(self.sync_weights(it + 1))
        metrics.update(gen_out[0], **score_out[0], **learn_out[0], **self.timings())
        wall = time.perf_counter() - t0
        metrics["perf/gen_tokens_per_s"] = metrics["perf/gen_tokens"] / max(metrics["perf/gen_s"], 1e-9)
        metrics["perf/step_s"] = wall
        return metrics

    def _update(self, it: int):
        return self.learner.call(ReasoningLearner.update, self.scored_ch,
                                 num_groups=self.cfg.algorithm.prompts_per_step, iteration=it)

    def eval_accuracy(self, size: int = 0, samples: int = 0) -> dict:
        """Greedy held-out accuracy (``ReasoningRollout.eval_accuracy``), in slices of
        ``rollout.eval_batch_size`` problems, the progress (problems done, accuracy so far)
        shown between them; the same numbers as one call (greedy, batch by batch)."""
        if self.learner is not None:
            self.switcher.activate("rollout")
        total = self.rollout.call(ReasoningRollout.num_eval_problems, size=size).wait()[0]
        step = self.cfg.rollout.eval_batch_size
        parts = []
        progress = self.session.progress(f"eval {self.cfg.data.source}", total, unit="problems")
        try:
            for start in range(0, total, step):
                left = max(0, samples - sum(len(p["samples"]) for p in parts))
                part = self.rollout.call(ReasoningRollout.eval_accuracy, size=size,
                                         samples=left, start=start, stop=start + step).wait()[0]
                parts.append(part)
                done = sum(p["problems"] for p in parts)
                right = sum(p["accuracy"] * p["problems"] for p in parts)
                progress.update(part["problems"], f"accuracy {right / max(1, done):.3f}")
        finally:
            progress.close()
        return merge_accuracy(parts)

    def timings(self) -> dict[str, float]:
        return self.session.timings()

    # -- the run loop's hooks (m2flow.runs.loop) ---------------------------------------------
    def total(self) -> int:
        return self.cfg.runner.num_steps

    def logged_step(self) -> int:
        """Completions so far."""
        return self.iteration * self.cfg.algorithm.prompts_per_step * self.cfg.rollout.n

    def describe(self) -> str:
        return (f"GRPO on {self.cfg.data.source}, mode {self.mode}, "
                f"backend {self.cfg.cluster.backend}")

    def before_loop(self, logger) -> dict:
        """A fresh run: the warm start (``warm_start.steps`` SFT steps), then the held-out
        accuracy before GRPO, saved as step 0."""
        cfg = self.cfg
        self._reward_watch = RewardSignalWatch(cfg.runner.warn_constant_reward_steps,
                                               cfg.algorithm.reward)
        if self.iteration > 0:
            return {}
        if cfg.warm_start.steps > 0:
            self.session.phase = "warm start"
            ws = self.warm_start()
            logger.info(f"warm start: {cfg.warm_start.steps} SFT steps, loss "
                        f"{ws['warm_start/loss_first']:.3f} -> {ws['warm_start/loss_last']:.3f}")
        self.session.phase = "evaluation"
        ev = self.eval_accuracy()
        logger.info(f"held-out accuracy before GRPO: {ev['accuracy']:.3f} "
                    f"({ev['problems']} problems)")
        self.save({"eval/accuracy": ev["accuracy"]})
        self.timings()  # the warm start's and evaluation's time is not step 0's
        return {"eval/accuracy_start": ev["accuracy"]}

    def watch(self, metrics: dict, logger) -> None:
        warning = self._reward_watch.update(metrics,
                                            num_groups=self.cfg.algorithm.prompts_per_step)
        if warning is not None:
            logger.info(warning)

    def evaluate(self) -> dict:
        ev = self.eval_accuracy()
        return {"eval/accuracy": ev["accuracy"], "eval/response_len": ev["response_len"]}

    def memory_hint(self) -> str:
        return memory_hint(self.cfg)

    # -- checkpoints -------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        # a save under way finishes even after Ctrl-C (RunControl.handle_signals)
        return {"learner": self.learner.call(ReasoningLearner.state_dict).wait(stoppable=False)[0]}

    def load(self, path: str) -> None:
        state = self.session.load(path)
        self.learner.call(ReasoningLearner.load_state_dict, state["learner"]).wait()
        self.iteration = state["iteration"]
        self.sync_weights(self.iteration, full=True)  # full anyway: the learner was loaded

    def load_policy(self, state: dict) -> None:
        """Loads a checkpoint's weights into the rollout's engine (evaluation)."""
        self.send_policy(state["learner"]["model"], version=state["iteration"])

    def close(self) -> None:
        self.session.close()
