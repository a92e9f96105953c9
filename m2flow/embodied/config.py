"""Configs the embodied runner owns (the root config composes them with the other layers')."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING

from m2flow.embodied.algorithms import AlgorithmConfig
from m2flow.envs import EnvConfig
from m2flow.fields import above, at_least, check_bound, one_of, optional, within
from m2flow.policies import PolicyConfig
from m2flow.runs.config import ClusterGroupConfig, RunnerBaseConfig

SUCCESS_METRICS = ("success_once", "success_at_end")  # EpisodeStats' two success figures


@dataclass
class StagingConfig:
    """How each env worker stages its envs: the pipeline stages it steps them as (one
    simulating while the rollout workers infer for another) and the env groups they are made
    of. (Inference itself, the rollout workers', is placed under ``cluster``.)"""

    pipeline_stages: int = 1
    """S: each env worker runs its envs as S pipeline stages. While the simulator steps stage
    k, the rollout worker infers actions for stage k+1 (1: plain sequential). Trajectories
    have the same layout for every S."""
    env_groups: Optional[int] = None
    """Env groups (batched envs) each env worker builds (None: pipeline_stages). A stage is a
    contiguous run of env groups, so the stage count can change at run time up to this
    without restarting a simulator."""

    def validate(self) -> None:
        """Raises FieldError naming the first field out of range."""
        check_bound(self, "staging.pipeline_stages", at_least(1),
                    "use 1 (sequential) or S > 1 to overlap simulation and inference")
        check_bound(self, "staging.env_groups", optional(at_least(1), "staging.pipeline_stages"),
                    "give the env groups each env worker builds")


@dataclass
class RunnerConfig(RunnerBaseConfig):
    """The training loop: how long, how often to evaluate, log and checkpoint."""

    num_iterations: int = 100
    """Iterations (collect -> advantages -> update -> sync) at most."""
    rollout_steps: int = 50
    """Policy calls per env per iteration (T); each call runs the policy's action chunk, so an
    iteration is T x chunk env steps per env."""
    reset_every_iteration: bool = True
    """Reset every env from a per-iteration seed at the start of each iteration; makes each
    iteration reproducible on its own (resume) and aligns episodes with iterations."""
    stagger_episodes: bool = False
    """After each training reset, start env i's episode a random number of steps into its
    time limit (uniform in [0, limit), drawn from the run's seed), so its first episode is
    cut short and from then on the envs' episodes end at different iterations: each batch
    mixes early and late phases of episodes instead of every env swinging up, say, in the
    same iterations (rsl-rl's ``init_at_random_ep_len``). Needs
    ``reset_every_iteration=false`` and an env that can set its episodes' step counts
    (mjlab)."""
    exact_resets: bool = False
    """Also rebuild the simulator at those resets (ManiSkill: the scene), so an iteration depends
    on its seed alone and a resumed run equals the uninterrupted one bit for bit; costs a scene
    rebuild per reset (docs/results.md#engine-and-tests). Evaluation always rebuilds."""
    eval_interval: int = 5
    """Evaluate every N iterations (and after the last); 0: only after the last."""
    eval_episodes: int = 16
    """Episodes per evaluation: episode e starts from the same initial state whatever
    ``env.num_envs`` and the env workers are (``seeding.eval_seeds``)."""
    stop_at_success: Optional[float] = None
    """Stop once an evaluation's success rate (``success_metric``) reaches this (None: run all
    iterations)."""
    success_metric: str = "success_once"
    """Which success rate stop_at_success, eval_curtail and ``best.pt`` use: 'success_once'
    (the goal held at some step of the episode) or 'success_at_end' (at its last step)."""
    stop_after_evals: int = 1
    """With stop_at_success: stop after this many evaluations in a row reach it (2: the
    success must hold at the next evaluation too)."""
    stop_confirm_episodes: int = 0
    """With stop_at_success: an evaluation that reaches it is run again over this many episodes
    (more than ``eval_episodes``; its own are the first of them: the same initial states, the
    same episodes) and it is this larger evaluation that the stop, ``best.pt``, the log and
    the ``done:`` line count, the figure ``m2flow-eval ... episodes=N`` gives the checkpoint:
    a lucky small evaluation does not end the run. 0, or no more than ``eval_episodes`` (an
    evaluation already that large): no confirmation."""
    eval_curtail: bool = True
    """With stop_at_success: end an evaluation after the round where it can no longer reach
    stop_at_success even if every remaining episode succeeds (the stop decision is the full
    evaluation's; ``eval/success_*`` are then those of the episodes run, ``eval/curtailed`` 1,
    and the checkpoint is never ``best.pt``). Saves most evaluation time before the policy
    gets close; False: every evaluation runs all ``eval_episodes``."""
    eval_gate: Optional[float] = None
    """A scheduled evaluation (every ``eval_interval``) runs only when the training success
    since the previous scheduled one (``env/<success_metric>`` of every episode that ended in
    those iterations, sampled actions; ``stop_rules.TrainingSuccess``) is at least this; the
    last iteration's always runs. The sampled success sits below the mean-action evaluation's,
    so a gate well under the target skips the evaluations of a policy that is far from it,
    at the risk of a later stop. None: every scheduled evaluation runs."""
    eval_batch_invariant: bool = True
    """Evaluation with mean actions (training-time and ``m2flow-eval``) runs the policy on one
    env's observation at a time, so an episode's actions never depend on which episodes share
    its batch: a float sum's order changes with the batch size (a BLAS kernel picks its
    blocking by shape), contact dynamics amplify the last-bit differences, and success would
    change with ``env.num_envs``. False: one call per batch, faster for a large policy on a
    GPU, at that cost."""
    overlap_learner: bool = False
    """Collect iteration k+1 (with the weights at hand) while the learner trains on iteration
    k; new weights reach the rollout workers mid-collection. PPO's ratio uses the stored
    behaviour log-probs, so mixed weights within a batch are fine."""
    max_staleness: int = 1
    """With overlap_learner: the most learner updates any action of a trajectory may lag
    behind the weights it is trained into (the learner refuses staler data)."""
    warn_no_signal_iterations: int = 5
    """Warn (log and stdout) after this many iterations in a row with nothing to learn from:
    every reward of the batch equal, or (GRPO) every group filtered; 0: never."""
    weight_sync_bucket_mb: float = 256.0
    """Weight sync from learner to rollout: the most MB of one bucket (one Ray object; a tensor
    larger than this travels in row ranges). Each iteration ships only what the update changed
    (trainable tensors, e.g. LoRA adapters and named heads, and changed buffers); the first sync
    after start or resume ships everything."""

    def validate(self) -> None:
        """Raises FieldError naming the first of its own fields out of range (those of
        RunnerBaseConfig: ``validate_base``)."""
        check_bound(self, "runner.num_iterations", at_least(1),
                    "set it to the number of iterations to run")
        check_bound(self, "runner.rollout_steps", at_least(1),
                    "set the env steps per env per iteration (e.g. 50)")
        check_bound(self, "runner.eval_interval", at_least(0),
                    "evaluate every N iterations, or 0 for only after the last")
        check_bound(self, "runner.eval_episodes", at_least(1),
                    "set the episodes per evaluation (e.g. 16)")
        check_bound(self, "runner.stop_at_success",
                    optional(within(0, 1, open_low=True), "run all iterations"),
                    "give the success rate to stop at, e.g. 0.9")
        check_bound(self, "runner.success_metric", one_of(SUCCESS_METRICS),
                    "'success_once' counts an episode that reached the goal at any step, "
                    "'success_at_end' one that holds it at its last step")
        check_bound(self, "runner.eval_gate",
                    optional(within(0, 1), "evaluate at every eval_interval"),
                    "give the training success a scheduled evaluation waits for, e.g. 0.7")
        check_bound(self, "runner.stop_after_evals", at_least(1),
                    "give the evaluations in a row that must reach runner.stop_at_success "
                    "(e.g. 1 or 2)")
        check_bound(self, "runner.stop_confirm_episodes", at_least(0),
                    "give the episodes of the evaluation that confirms a stop (e.g. 256), or 0 "
                    "for none")
        check_bound(self, "runner.max_staleness", at_least(0),
                    "give the updates an action may lag behind (e.g. 1)")
        check_bound(self, "runner.warn_no_signal_iterations", at_least(0),
                    "give the iterations without learning signal before a warning (0: never)")
        check_bound(self, "runner.weight_sync_bucket_mb", above(0),
                    "give the most MB of one weight-sync bucket (default 256)")


@dataclass
class EvalConfig:
    """``m2flow-eval``: which checkpoint, how many episodes, where the report goes."""

    checkpoint: Optional[str] = None
    """Path of a checkpoint written by m2flow-train (its config is used for env and policy);
    None: the policy config's initial weights (seeded by ``seed``)."""
    episodes: int = 0
    """One-task envs: episodes to run; 0: runner.eval_episodes."""
    episodes_per_task: int = 0
    """Episodes per task; 0: 50 for multi-task envs (LIBERO's protocol), else ``episodes``."""
    first_episode: int = 0
    """Episode e starts from the initial state of episode ``first_episode + e``: a multi-task
    env's seed ``first_episode + e`` (LIBERO: that init state of each task), a one-task env's
    ``seeding.eval_seeds(seed, .)[first_episode + e]``. 0 scores the states training's
    evaluation scores; e.g. 10 scores LIBERO's init states 10 on, which demos recorded from
    init states 0-9 never started from."""
    max_steps: Optional[int] = None
    """Steps per episode; None: the env's limit (LIBERO: the suite's published limit)."""
    videos_per_task: int = 2
    """MP4s of the first K episodes of each task (from the env's image observation)."""
    output_dir: Optional[str] = None
    """Report folder; None: <runner.log_dir>/eval/<run_name>/<timestamp>."""
    deterministic: bool = True
    """Act with the policy's mean (True) or sample like training does (False)."""

    def validate(self) -> None:
        """Raises FieldError naming the first field out of range."""
        check_bound(self, "eval.episodes", at_least(0),
                    "give the episodes to run, or 0 for runner.eval_episodes")
        check_bound(self, "eval.episodes_per_task", at_least(0),
                    "give the episodes per task, or 0 for the default")
        check_bound(self, "eval.first_episode", at_least(0),
                    "give the episode whose initial state the first one takes, or 0 for "
                    "training's")
        check_bound(self, "eval.max_steps", optional(at_least(1), "the env's limit"),
                    "give the steps per episode")
        check_bound(self, "eval.videos_per_task", at_least(0),
                    "give the videos per task, or 0 for none")


@dataclass
class TrainConfig:
    """The root config of an embodied run."""

    workload: str = "embodied"
    """Which workload runs this config (the table in m2flow.cli.workloads); set by the schema."""
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    staging: StagingConfig = field(default_factory=StagingConfig)
    algorithm: AlgorithmConfig = MISSING
    cluster: ClusterGroupConfig = field(default_factory=ClusterGroupConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 0
    """Seed of weights, env resets and sampling."""
    resume: Optional[str] = None
    """Checkpoint path to continue training from; ``latest``: the newest checkpoint of the
    runs named ``run_name`` under ``runner.log_dir``; ``auto``: that, or a fresh start if
    there is none."""
    init_from: Optional[str] = None
    """A checkpoint (or a run directory: its newest) whose policy weights this run starts from,
    at iteration 0 with a fresh optimiser: RL warm-started from an ``algorithm=bc`` run. Its
    policy must be this config's (same ``policy`` and sizes); tensors it lacks (a value head
    BC did not train) keep their initial values. Ignored with ``resume`` (that checkpoint
    holds the weights)."""
    init_skip: List[str] = field(default_factory=list)
    """Tensors of the ``init_from`` checkpoint's policy not loaded: they keep this config's
    initial values. ``[actor_log_std]`` with ``policy.init_log_std`` sets the exploration
    noise RL starts from, instead of the spread BC fitted to the demonstrations (wide enough
    to cover their variety, so sampled rollouts succeed far less often than the mean action).
    Without ``init_from`` nothing is loaded and this does nothing."""
    run_name: str = "run"
    """Name of the run directory's parent (entry configs set it to their own name)."""
