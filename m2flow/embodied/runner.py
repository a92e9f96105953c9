"""The embodied runner: wires env, rollout and learner workers through ``pipelines``.

One iteration reads top to bottom: collect -> update (advantages + PPO) -> sync weights ->
evaluate (sometimes) -> log -> checkpoint (sometimes). With ``runner.overlap_learner`` the
collection of iteration k+1 starts when the update of iteration k does, and the new weights
reach the rollout workers as soon as that update ends, while they serve.

When rollout and learner share a GPU (``cluster.context_switch``), they take turns on it: the
runner hands the device to the rollout before each collection and evaluation, and to the
learner before each update (``pipelines.ContextSwitcher``).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, replace
from typing import Optional, Sequence

from tensordict import TensorDict

from m2flow.embodied.checks import check_run, memory_hint
from m2flow.embodied.config import TrainConfig
from m2flow.embodied import eval_protocol
from m2flow.embodied.algorithms import ALGORITHMS
from m2flow.embodied.graph import monitor as plan_monitor
from m2flow.embodied.layout import Layout
from m2flow.embodied.no_signal import NoSignalWatch
from m2flow.embodied.stop_rules import SuccessStop, TrainingSuccess, confirms, gate_open
from m2flow.embodied.workers.env_eval import EvalRound
from m2flow.embodied.workers.env_worker import EnvWorker
from m2flow.embodied.workers.episodes import EpisodeStats
from m2flow.embodied.workers.learner_worker import LearnerWorker, learner_rank
from m2flow.embodied.workers.rollout_worker import RolloutWorker
from m2flow.embodied.workers.stages import rollout_rank
from m2flow.pipelines import Channel
from m2flow.pipelines.futures import Futures, gather
from m2flow.runs import checkpoint
from m2flow.runs.logger import announce, log_field, memory_in_use
from m2flow.runs.loop import RunLoop
from m2flow.runs.control import RunControl
from m2flow.runs.session import RunSession
from m2flow.runs.timeline import OVERLAP_KEY
from m2flow.runs.weights import send_state, sync_groups

WORKLOAD = "embodied"
COMPONENTS = ("env", "rollout", "learner")
LOG_FIELDS = [  # the per-iteration log line, after "it N | steps S"; detail: train.log's only
    log_field("sps {:.0f}", "perf/env_steps_per_s"),
    log_field("return {:.2f}", "env/return"),
    log_field("success {:.2f}/{:.2f}", "env/success_once", "env/success_at_end", together=True),
    log_field("eval {:.2f}/{:.2f}", "eval/success_once", "eval/success_at_end", together=True),
    log_field("eval_return {:.2f}", "eval/return", detail=True),
    log_field("kl {:.4f}", "loss/approx_kl"),  # PPO's, GRPO's
    log_field("vloss {:.4f}", "loss/loss_value"),  # PPO's
    log_field("bc_loss {:.3f}", "loss/loss_bc"),  # BC's (PPO's demo term)
    log_field("qloss {:.4f}", "loss/loss_q"),  # SAC's
    log_field("alpha {:.3f}", "loss/alpha"),  # SAC's
    log_field("learn_beside_collect {:.2f}s", OVERLAP_KEY, detail=True),
]
BAR_FIELDS = [
    log_field("sps={:.0f}", "perf/env_steps_per_s"),
    log_field("success={:.2f}/{:.2f}", "env/success_once", "env/success_at_end", together=True),
    log_field("eval={:.2f}/{:.2f}", "eval/success_once", "eval/success_at_end", together=True,
              sticky=True),
]


class EmbodiedRunner(RunLoop):
    """Builds the cluster, places the three components and runs PPO iterations in the run
    loop (:class:`m2flow.runs.loop.RunLoop`, ``train``).

    The run's shape is resolved once, into ``self.layout`` (:class:`m2flow.embodied.layout.
    Layout`): the counts below (env workers, envs, stages, reset groups) are read from it, and
    each worker is given its part of it.

    Args:
        cfg: the root config.
        train: False builds env and rollout workers only (evaluation).
        control: the command's run control (Ctrl-C, the phase; ``m2flow.runs.control``);
            None: the session's own.
    """

    log_fields, bar_fields = LOG_FIELDS, BAR_FIELDS

    def __init__(self, cfg: TrainConfig, *, train: bool = True,
                 control: Optional[RunControl] = None):
        self.cfg = cfg
        self.layout = Layout.of(cfg)  # checked with the placement in _start
        t0 = time.perf_counter()
        announce(_building(cfg, self.layout, train))
        self.session = RunSession(cfg, workload=WORKLOAD, control=control,
                                  best_metric=f"eval/{cfg.runner.success_metric}")
        try:
            self._start(cfg, train)
        except BaseException:  # a failed or stopped (Ctrl-C) start-up ends what it started
            self.session.close()
            raise
        learners = f", {self.learner.world_size} learner" if self.learner is not None else ""
        sync = "" if self.learner is None else (
            "; weights by Ray objects" if self.weight_link is None else
            f"; weights by {self.session.links[-1].backend} broadcast")
        announce(f"start-up: ready in {time.perf_counter() - t0:.1f} s: {self.env.world_size} "
                 f"env worker(s) x {self.layout.num_envs} envs, {self.rollout.world_size} rollout"
                 f"{learners}; placement {self.placement.mode}{sync}; {memory_in_use()}")
        if not train:
            self.session.phase = "evaluation"  # all that is left to do

    def _start(self, cfg: TrainConfig, train: bool) -> None:
        r, lay = cfg.runner, self.layout
        self.cluster, self.placement = self.session.cluster, self.session.placement
        # who steps aside for whom on a shared device (without a learner: only checks the mode)
        offloads = self.session.offloads_for(["rollout", "learner"] if train else [])
        check_run(lay, cfg, offloads)
        # an env worker's part of the layout: its envs (cfg.env.num_envs), groups, reset groups
        self.env = self.session.launch("env", EnvWorker, cfg.env, seed=cfg.seed,
                                       groups=lay.env_groups, channel_timeout=r.channel_timeout_s,
                                       reset_group_size=lay.reset_group_size)
        # rollout and learner processes start (and import) while the env workers build their
        # simulators; their constructors wait for the env's spec (Futures.later)
        spec = self.env.call(EnvWorker.spec, ranks=[0])
        self.rollout = self.session.launch("rollout", RolloutWorker, cfg.policy, spec.later(),
                                           seed=cfg.seed, channel_timeout=r.channel_timeout_s)
        self.learner = None
        if train:
            self.learner = self.session.launch(
                "learner", LearnerWorker, cfg.policy, cfg.algorithm, spec.later(), seed=cfg.seed,
                num_iterations=r.num_iterations, channel_timeout=r.channel_timeout_s,
            )
        self.env.started()
        self.spec = spec.wait()[0]
        self.rollout.started()
        self.chunk = self.rollout.call(RolloutWorker.chunk, ranks=[0]).wait()[0]  # env steps per call
        self.env_ranks = list(range(lay.env_workers))
        # stage (env rank e, stage k) goes to rollout rank (k * E + e) mod M: E env workers ->
        # M rollout workers, no relay (the start-up checks give each rank equally many)
        self.obs_ch = Channel(
            "obs", self.rollout, item_type=TensorDict,
            routes={(e, k): rollout_rank(e, k, lay.env_workers, lay.rollout_workers)
                    for e in self.env_ranks for k in range(lay.env_groups)},
        )
        self.set_stages(lay.pipeline_stages)
        self.act_ch = Channel("action", self.env, item_type=TensorDict)  # (e, k) -> env rank e
        self.iteration, self.global_step = 0, 0
        self.last_evaluation: Optional[eval_protocol.Evaluation] = None  # run_eval's last
        self._pending: Optional[_Collection] = None  # a collection started ahead (overlap)
        self._last_end: Optional[float] = None
        self._last_learn: Optional[float] = None  # the last update's seconds (overlap)
        self.weight_link: Optional[str] = None  # None: weights travel as Ray objects
        self.switcher = self.session.switcher  # evaluation only: nobody to take turns with
        if train:
            self.learner.started()
            self.switcher = self.session.take_turns(
                {"rollout": self.rollout, "learner": self.learner}, offloads)
            self.traj_ch = Channel("trajectory", self.learner, item_type=TensorDict, routes={
                e: learner_rank(e, lay.env_workers, lay.learner_ranks)
                for e in self.env_ranks})
            self.weight_link = self.session.weight_link(self.learner, self.rollout)
            if cfg.resume:
                self.load(cfg.resume)
            elif cfg.init_from:
                self.init_weights(cfg.init_from, skip=list(cfg.init_skip))
            self.sync_weights(self.iteration, full=True)

    def set_stages(self, stages: int) -> None:
        """Pipeline stages from the next collection on (1 to staging.env_groups)."""
        groups = self.layout.env_groups
        if not 1 <= stages <= groups:
            raise ValueError(f"pipeline stages={stages}: use 1 to staging.env_groups={groups}.")
        self.stages = stages
        # the stages' channel keys in the order env workers send them: stage by stage
        self.stage_keys = [(e, k) for k in range(stages) for e in self.env_ranks]

    # -- one iteration, step by step ---------------------------------------------------------
    def collect(self, iteration: int) -> EpisodeStats:
        """Runs ``rollout_steps`` steps of every env; trajectories go to the learner's channel."""
        return self.start_collect(iteration).result()

    def start_collect(self, iteration: int) -> "_Collection":
        r = self.cfg.runner
        return _Collection(
            iteration,
            self.env.call(EnvWorker.collect, self.obs_ch, self.act_ch, self.traj_ch,
                          num_steps=r.rollout_steps, iteration=iteration,
                          reset=r.reset_every_iteration, rebuild=r.exact_resets,
                          stages=self.stages, stagger=r.stagger_episodes),
            self._serve(r.rollout_steps, iteration, deterministic=False),
        )

    def update(self, iteration: int) -> dict:
        return self.start_update(iteration).wait()[0]

    def start_update(self, iteration: int) -> Futures:
        r = self.cfg.runner
        bound = r.max_staleness if r.overlap_learner else 0
        return self.learner.call(LearnerWorker.update, self.traj_ch, env_ranks=self.env_ranks,
                                 iteration=iteration, max_staleness=bound)

    def sync_weights(self, version: int, *, full: bool = False) -> None:
        """Sends the learner's weights (the version after ``version`` updates) to the rollout:
        what the update changed (trainable tensors, changed buffers), or everything when
        ``full`` (the learner's first sync and the one after a resume are full anyway), one
        bucket of at most ``runner.weight_sync_bucket_mb`` at a time, as a Ray object or
        broadcast over the weight link (``cluster.weight_sync``), from learner rank 0 to the
        rollout ranks directly: one call from here (:func:`m2flow.runs.weights.sync_groups`)."""
        sync_groups(self.learner, self.rollout, version=version, full=full,
                    bucket_mb=self.cfg.runner.weight_sync_bucket_mb, link=self.weight_link)

    def send_policy(self, state: dict, version: int = 0) -> None:
        """Sends a whole state dict held here (evaluation: a checkpoint's, or initial weights)
        to the rollout workers, bucket by bucket like ``sync_weights``."""
        send_state(self.rollout, state, version=version,
                   bucket_mb=self.cfg.runner.weight_sync_bucket_mb)

    def run_eval(self, episodes: Optional[int] = None, deterministic: bool = True,
                 reach: Optional[float] = None,
                 known: Optional[eval_protocol.Evaluation] = None) -> dict:
        """Episodes from fixed seeds (mean actions by default), through the loop ``m2flow-eval``
        runs (``eval_protocol.evaluate``): ``eval/success_once``, ``eval/success_at_end`` and
        friends (``Evaluation.metrics``).

        A one-task env runs exactly ``episodes`` (default ``runner.eval_episodes``), episode e
        from seed ``seeding.eval_seeds(seed, .)[e]`` whatever env it runs on; the envs of a
        last round with fewer episodes left run fillers, not counted. A multi-task env
        (``spec.tasks``: LIBERO, Meta-World MT10/MT50) runs ``episodes`` split evenly over
        its tasks, rounded down but at least one each (``eval_protocol.episodes_per_task``:
        64 over 10 tasks run 6 each), episode e of task j from seed e (LIBERO: init state e),
        as ``m2flow-eval`` does; its success rates are means over tasks, beside each task's
        (``eval/task<j>/success_once``). After each round the progress (episodes done,
        success so far) goes to the bar or the log (``RunSession.progress``). With ``reach``,
        the evaluation ends after the first round from which its success rate
        (``runner.success_metric``) can no longer reach ``reach`` even if every remaining
        episode succeeds: its numbers are those of the rounds run, plus ``eval/curtailed`` 1
        (the rounds run are the first rounds of the full evaluation). ``known``: an
        evaluation of these weights already run, whose episodes are not run again
        (``eval_protocol.evaluate``); the last one is ``self.last_evaluation``.
        """
        r = self.cfg.runner
        tasks = list(self.spec.tasks)
        names = tasks or [self.cfg.env.name]
        per_task = eval_protocol.episodes_per_task(episodes or r.eval_episodes, len(tasks))
        self.switcher.activate("rollout")  # its cost is part of time/eval
        result = eval_protocol.evaluate(
            self.eval_round, names, per_task, ranks=self.layout.env_workers,
            envs_per_rank=self.layout.num_envs, seed=self.cfg.seed, multi_task=bool(tasks),
            deterministic=deterministic, reach=reach, metric=r.success_metric, known=known,
            progress=self.session.progress(f"eval {self.cfg.env.name}", len(names) * per_task))
        self.last_evaluation = result
        return result.metrics(curtail=reach is not None)

    def eval_round(self, per_rank: list[EvalRound], deterministic: bool = True) -> list[list]:
        """One episode per env (``EnvWorker.eval_round``, one ``EvalRound`` per env worker);
        returns each rank's list of ``EvalEpisode``."""
        steps = per_rank[0].max_steps or self.spec.max_episode_steps
        steps = math.ceil(steps / self.chunk)
        per_rank = [replace(p, chunk=self.chunk) for p in per_rank]
        self.switcher.activate("rollout")
        env_out, _ = gather(
            self.env.call(EnvWorker.eval_round_ranks, self.obs_ch, self.act_ch,
                          per_rank=per_rank, stages=self.stages),
            self._serve(steps, 0, deterministic=deterministic),
        )
        return env_out

    def _serve(self, steps: int, iteration: int, deterministic: bool):
        return self.rollout.call(
            RolloutWorker.serve, self.obs_ch, self.act_ch, stage_keys=self.stage_keys,
            num_steps=steps, iteration=iteration, deterministic=deterministic,
            one_env_at_a_time=deterministic and self.cfg.runner.eval_batch_invariant,
        )

    def timings(self) -> dict[str, float]:
        """Per-component seconds since the last call (slowest rank of each component)."""
        return self.session.timings()

    # -- the loop ----------------------------------------------------------------------------
    def iterate(self, it: int) -> dict:
        """One iteration: collect -> update (advantages + PPO) -> sync weights; its metrics.

        With overlap, iteration it+1's collection is started here and finished by the next
        call (or by ``drain``).
        """
        r = self.cfg.runner
        steps = self.layout.collected * self.chunk  # env steps (a call runs a chunk)
        t0 = time.perf_counter()
        self.session.phase = "collection"
        switch = self.switcher.activate("rollout")  # (off with overlap: check_config)
        ahead = self._pending is not None  # started with the previous update (overlap)
        collection = self._pending if ahead else self.start_collect(it)
        self._pending = None
        episodes = collection.result()
        overlap = {}
        if ahead and self._last_learn is not None:
            # the collection (timed on the env workers) and the previous update (timed here)
            # were started together, so they ran side by side for the shorter of the two
            overlap = {OVERLAP_KEY: min(episodes.seconds, self._last_learn)}
        self.session.phase = "learning"
        switch = _sum(switch, self.switcher.activate("learner"))
        update = self.start_update(it)
        if r.overlap_learner and it + 1 < r.num_iterations:
            self._pending = self.start_collect(it + 1)  # with the weights at hand
        t1 = time.perf_counter()
        metrics = update.wait()[0]
        t_learn = time.perf_counter() - t1
        self._last_learn = t_learn
        self.global_step += steps
        self.iteration = it + 1  # what the learner holds now (a stop from here saves it)
        self.session.phase = "weight sync"
        self.sync_weights(it + 1)  # mid-collection when overlapping
        t_sync = time.perf_counter() - t1 - t_learn
        now = time.perf_counter()
        wall = now - (self._last_end if self._last_end is not None else t0)
        self._last_end = now
        return {
            **metrics,
            **episodes.summary(),
            **self.timings(),
            **(switch if self.switcher.enabled else {}),
            "perf/env_steps_per_s": steps / collection.seconds,
            "perf/steps_per_s_overall": steps / wall,
            "perf/iteration_s": wall,
            "time/driver_learn_wait": t_learn,
            "time/driver_weight_sync": t_sync,
            **overlap,
        }

    def drain(self) -> None:
        """Finishes a collection started ahead (overlap), so envs are idle (eval, save, close)."""
        if self._pending is not None:
            self._pending.result()

    # -- the run loop's hooks (m2flow.runs.loop) ---------------------------------------------
    def total(self) -> int:
        return self.cfg.runner.num_iterations

    def logged_step(self) -> int:
        return self.global_step

    def describe(self) -> str:
        cfg = self.cfg
        return (f"{self.layout.total_envs} envs of {cfg.env.name}, placement {self.placement.mode}, "
                f"backend {cfg.cluster.backend}")

    def before_loop(self, logger) -> dict:
        """The run's watches: no learning signal, the plan's prediction (``cluster.plan``),
        the success target (``runner.stop_at_success``)."""
        r = self.cfg.runner
        rewards = ALGORITHMS.require(self.cfg.algorithm.name).learns_from_rewards
        self._no_signal = NoSignalWatch(r.warn_no_signal_iterations if rewards else 0,
                                        self.cfg.algorithm.name)
        self._success_stop = SuccessStop(r.stop_at_success, r.stop_after_evals,
                                         metric=r.success_metric)
        self._plan_watch = plan_monitor(self.cfg, self.layout)  # predicted vs measured
        self.gated_evals = 0  # scheduled evaluations runner.eval_gate skipped
        self._training_success = TrainingSuccess(r.success_metric)  # the gate's window
        return {}

    def watch(self, metrics: dict, logger) -> None:
        self._training_success.observe(metrics)
        if self._plan_watch is not None:
            metrics.update(self._plan_watch.observe(metrics, self.set_stages, logger.info))
        warning = self._no_signal.update(metrics)
        if warning is not None:
            logger.info(warning)

    def evaluate(self) -> dict:
        """``run_eval`` once the collection started ahead (overlap) ends; with
        ``runner.eval_curtail``, cut short once ``runner.stop_at_success`` is out of reach."""
        r = self.cfg.runner
        self.drain()
        reach = r.stop_at_success if r.eval_curtail else None
        out = self.run_eval(reach=reach)
        if confirms(out, r):  # the stop rests on the larger evaluation, not a lucky small one
            # (the same weights: the episodes just run are its first, counted as they ended)
            out = {**self.run_eval(episodes=r.stop_confirm_episodes, reach=reach,
                                   known=self.last_evaluation), "eval/confirming": 1.0}
        self.timings()  # eval's worker timings are not part of the next iteration
        self._last_end = time.perf_counter()  # nor is its wall time
        return out

    def evaluation_wanted(self, metrics: dict) -> bool:
        """``runner.eval_gate``: the training success since the last scheduled evaluation
        (``TrainingSuccess``, fed by ``watch``) reached it; with no episode ended it waits."""
        wanted = gate_open(self._training_success.take(), self.cfg.runner)
        self.gated_evals += not wanted
        return wanted

    def stop_reason(self, metrics: dict) -> Optional[str]:
        success = metrics[f"eval/{self.cfg.runner.success_metric}"]
        return self._success_stop.describe(success) if self._success_stop.update(success) else None

    def memory_hint(self) -> str:
        return memory_hint(self.layout, self.cfg)

    def abandon(self) -> None:
        self._pending = None  # its workers are ended with the session

    def summary(self) -> dict:
        return {"env_steps": self.global_step, "gated_evaluations": self.gated_evals}

    # -- checkpoints -------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        # a save under way finishes even after Ctrl-C (RunControl); every rank takes part
        # (a sharded learner gathers the state to rank 0), rank 0 returns it
        learner = self.learner.call(LearnerWorker.state_dict).wait(stoppable=False)[0]
        # the env's spec: init_from's start-up check builds the new policy for it
        # (embodied.checkpoint_checks._check_policy_tensors)
        return {"global_step": self.global_step, "learner": learner,
                "env_spec": asdict(self.spec)}

    def load(self, path: str) -> None:
        state = self.session.load(path)
        self.learner.call(LearnerWorker.load_state_dict, state["learner"]).wait()
        self.iteration, self.global_step = state["iteration"], state["global_step"]
        note = self.learner.call(LearnerWorker.resume_note).wait()[0]
        if note:
            announce(f"resume: {note}")

    def init_weights(self, path: str, skip: Sequence[str] = ()) -> None:
        """Starts the learner from the policy weights of checkpoint ``path`` (``init_from``)
        but those named in ``skip`` (``init_skip``: they keep their initial values)."""
        state = checkpoint.load(path, workload=WORKLOAD)
        weights = {k: v for k, v in state["learner"]["policy"].items() if k not in skip}
        missing = self.learner.call(LearnerWorker.init_weights, weights,
                                    source=f"init_from={path}").wait()[0]
        kept = f"; initial values kept for {', '.join(missing)}" if missing else ""
        announce(f"start-up: policy weights from {path} (iteration {state['iteration']} of "
                 f"its run){kept}")

    def load_policy(self, state: dict) -> None:
        """Loads a checkpoint's policy weights into the rollout workers (evaluation)."""
        self.send_policy(state["learner"]["policy"])

    def close(self) -> None:
        self.session.close()


class _Collection:
    """One iteration's collection in flight: env rollouts and rollout serving together."""

    def __init__(self, iteration: int, env: Futures, serve: Futures):
        self.iteration, self._futures = iteration, (env, serve)
        self._t0, self.seconds = time.perf_counter(), 0.0
        self._result: Optional[EpisodeStats] = None

    def result(self) -> EpisodeStats:
        if self._result is None:
            env_out, _ = gather(*self._futures)
            self.seconds = time.perf_counter() - self._t0
            self._result = _merge(env_out)
        return self._result


def _sum(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in a.keys() | b.keys()}


def _building(cfg: TrainConfig, layout: Layout, train: bool) -> str:
    """The start-up line: what is about to be built."""
    who = "rollout and learner" if train else "rollout (evaluation)"
    resume = f"; resuming {cfg.resume}" if train and cfg.resume else ""
    return (f"start-up: building the {cfg.cluster.backend} cluster, env workers of "
            f"{layout.num_envs} {cfg.env.name} simulators each, policy {cfg.policy.name} for "
            f"{who}{resume}")


def _merge(parts: list[EpisodeStats]) -> EpisodeStats:
    total = EpisodeStats()
    for p in parts:
        total.extend(p)
    return total
