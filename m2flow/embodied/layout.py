"""The run's shape, resolved once: how many env workers, envs, stages, reset groups, rollout
workers and learner ranks an embodied run has, and how many samples an update trains on.

:class:`Layout` is built from a composed config (``Layout.of``) and its counts checked in one
place (:func:`check_layout`), at start-up before any worker starts. Everything after that
reads the layout, not the config: the runner (which hands each worker its part: an env worker
gets its envs per worker, env groups and reset group size), the planner's graph
(:mod:`m2flow.embodied.graph`), the profiler, evaluation and the memory hint.

Why here, in ``embodied/`` beside ``config``: the shape is made of embodied notions (env
groups, an algorithm's reset groups, what an update trains on, which only the algorithm
registry of ``embodied.algorithms`` knows), so no lower layer (``runs``, ``pipelines``) may
build it; and every reader is in ``embodied/`` (runner, graph, profile, eval_protocol,
checks). Workers, which import only ``embodied.algorithms`` (tests/runs/test_import_rules.py),
receive their part as plain numbers.

One name, one meaning: ``num_envs`` is always per env worker (as ``env.num_envs``),
``total_envs`` the envs of all env workers together.
"""

from __future__ import annotations

from dataclasses import dataclass

from m2flow.embodied.algorithms import AlgorithmConfig, algorithm_class
from m2flow.embodied.config import TrainConfig
from m2flow.fields import field_error

ENV_WORKERS = "cluster.placement.components.env.workers"
ROLLOUT_WORKERS = "cluster.placement.components.rollout.workers"
LEARNER_WORKERS = "cluster.placement.components.learner.workers"


@dataclass(frozen=True)
class Layout:
    """The counts of one embodied run (see the module's docstring for who reads them).

    >>> lay = Layout(env_workers=2, num_envs=8, pipeline_stages=2, env_groups=4,
    ...              reset_group_size=4, rollout_workers=1, learner_ranks=2, rollout_steps=50,
    ...              update_samples=800,
    ...              update_source="env.num_envs x env workers x runner.rollout_steps")
    >>> lay.total_envs, lay.collected, lay.served_stages, lay.reset_groups
    (16, 800, 4, 4)
    """

    env_workers: int
    """Env worker processes (``cluster.placement.components.env.workers``; 1 if unplaced)."""
    num_envs: int
    """Envs each env worker steps (``env.num_envs``)."""
    pipeline_stages: int
    """Stages each env worker runs its envs as, at the start (``staging.pipeline_stages``; a
    plan's monitor may change the runner's count within ``env_groups``)."""
    env_groups: int
    """Env groups (batched envs) each env worker builds (``staging.env_groups``, or the
    stages when unset): the most stages the run can switch to without a rebuild."""
    reset_group_size: int
    """Envs of one reset group, which reset to one initial state (the algorithm's: GRPO's
    ``group_size``; 1 for the others)."""
    rollout_workers: int
    """Rollout (inference) workers (``cluster.placement.components.rollout.workers``)."""
    learner_ranks: int
    """Data-parallel learner ranks (``cluster.placement.components.learner.workers``)."""
    rollout_steps: int
    """Policy calls per env per iteration (``runner.rollout_steps``)."""
    update_samples: int
    """Samples one update trains on (the algorithm's ``update_samples``: by default all
    collected, BC's its dataset batch)."""
    update_source: str
    """Where ``update_samples`` comes from, for a config error's line."""

    @property
    def total_envs(self) -> int:
        """Envs of all env workers together."""
        return self.env_workers * self.num_envs

    @property
    def collected(self) -> int:
        """Policy calls (samples) one iteration collects, over all envs."""
        return self.total_envs * self.rollout_steps

    @property
    def served_stages(self) -> int:
        """The (env worker, stage) pairs the rollout workers serve at the start."""
        return self.env_workers * self.pipeline_stages

    @property
    def reset_groups(self) -> int:
        """Reset groups over all env workers."""
        return self.total_envs // self.reset_group_size

    @classmethod
    def of(cls, cfg: TrainConfig) -> "Layout":
        """The layout of ``cfg`` (ranges already checked: its settings classes' ``validate``,
        :func:`m2flow.embodied.checks.check_train_config`); the counts are checked by
        :func:`check_layout`."""
        comps = cfg.cluster.placement.components

        def workers(name: str) -> int:
            return comps[name].workers if name in comps else 1

        env_workers, n = workers("env"), cfg.env.num_envs
        algo = cfg.algorithm
        collected = n * env_workers * cfg.runner.rollout_steps
        # a plugin's config that does not extend AlgorithmConfig trains on what was collected
        own = getattr(algo, "update_samples", None)
        samples, source = (own(collected) if own else
                           AlgorithmConfig.update_samples(algo, collected))
        return cls(
            env_workers=env_workers, num_envs=n,
            pipeline_stages=cfg.staging.pipeline_stages,
            env_groups=cfg.staging.env_groups or cfg.staging.pipeline_stages,
            reset_group_size=algorithm_class(algo.name).reset_group_size(algo),
            rollout_workers=workers("rollout"), learner_ranks=workers("learner"),
            rollout_steps=cfg.runner.rollout_steps,
            update_samples=samples, update_source=source,
        )


def check_layout(lay: Layout, cfg: TrainConfig) -> None:
    """The one check of a run's counts, cheapest first; the first that fails raises its
    one-line error naming the field and the fix. ``cfg`` gives the names and the settings a
    count is held against (the backend, the algorithm, the env's simulator)."""
    n, stages = lay.num_envs, lay.pipeline_stages
    if stages > n:
        raise field_error("staging.pipeline_stages", stages,
                          f"must be <= env.num_envs={n} (every stage needs an env); use 1 to {n}.")
    env_groups = cfg.staging.env_groups  # as given: None leaves it to the stages
    if env_groups is not None and not stages <= env_groups <= n:
        raise field_error(
            "staging.env_groups", env_groups,
            f"must be in [staging.pipeline_stages={stages}, env.num_envs={n}] (a stage is one "
            "or more env groups, a group one or more envs); change it or leave it unset.")
    _check_reset_groups(lay, cfg)
    _check_learner_ranks(lay, cfg)
    _check_rollout_ranks(lay)
    minibatches = getattr(cfg.algorithm, "num_minibatches", 1)
    if minibatches > lay.update_samples:
        raise field_error(
            "algorithm.num_minibatches", minibatches,
            f"must be <= the {lay.update_samples} samples an update trains on "
            f"({lay.update_source}); lower it or raise that.")


def _check_reset_groups(lay: Layout, cfg: TrainConfig) -> None:
    """``env.num_envs`` (per env worker) holds whole reset groups of the algorithm (GRPO's)."""
    size, n = lay.reset_group_size, lay.num_envs
    if size >= 1 and n % size:
        fit = max(size, round(n / size) * size)
        raise field_error(
            "env.num_envs", n,
            f"must be a multiple of {size}, the envs of one reset group of "
            f"algorithm={cfg.algorithm.name} (e.g. algorithm.group_size): each env worker holds "
            f"whole groups that reset to one initial state; use env.num_envs={fit}.")
    env_groups = cfg.staging.env_groups  # batches of envs, not reset groups
    if size > 1 and env_groups and env_groups > 1 and _gpu_batched(cfg):
        from m2flow.embodied.workers.stages import stage_sizes

        sizes = stage_sizes(n, env_groups)
        if any(s % size for s in sizes):
            raise field_error(
                "staging.env_groups", env_groups,
                f"splits env.num_envs={n} into batches of {sizes}, but on ManiSkill's GPU "
                f"backend a reset group of {size} envs shares one initial state only within one "
                f"batch; choose staging.env_groups so that every batch holds whole reset groups "
                f"(a divisor of {n // size}).")


def _check_learner_ranks(lay: Layout, cfg: TrainConfig) -> None:
    """Several learner ranks (data parallel) each train on the trajectories of whole env
    workers, an equal number each (so a GRPO group, which lives in one env worker, is never
    split), and each needs its own process."""
    learners, env_workers = lay.learner_ranks, lay.env_workers
    if learners <= 1:
        return
    field = LEARNER_WORKERS
    if env_workers % learners:
        fit = max(d for d in range(1, env_workers + 1) if env_workers % d == 0 and d <= learners)
        raise field_error(
            field, learners,
            f"must divide {ENV_WORKERS}={env_workers}: each learner "
            "rank trains on the trajectories of whole env workers, equally many each; use "
            f"{field}={fit} or {ENV_WORKERS}="
            f"{env_workers + learners - env_workers % learners}.")
    if cfg.cluster.backend != "ray":
        raise field_error(
            field, learners,
            f"data-parallel learner ranks each need their own process (torch.distributed), but "
            f"cluster.backend={cfg.cluster.backend} runs every worker in this one; use "
            f"cluster.backend=ray or {field}=1.")
    if cfg.algorithm.name == "bc":
        raise field_error(
            field, learners,
            "algorithm=bc draws its dataset sample itself, the same on every learner rank, so "
            f"several ranks would train on copies of it; use {field}=1 for behaviour cloning.")
    if getattr(cfg.algorithm, "precision", None) == "fp16":
        raise field_error(
            "algorithm.precision", "fp16",
            f"adds a gradient scaler, and with {field}={learners} each rank's scaler would skip "
            f"steps on its own; use algorithm.precision=bf16 or fp32, or {field}=1.")


def _check_rollout_ranks(lay: Layout) -> None:
    """M rollout workers serve the E x S stages (env worker, stage) of E env workers, equally
    many each (``stages.rollout_rank``: round-robin), so M must divide E x S: none idle, none
    the bottleneck."""
    m, stages = lay.rollout_workers, lay.served_stages
    if stages % m == 0:
        return
    fits = [k for k in range(1, stages + 1) if stages % k == 0]
    raise field_error(
        ROLLOUT_WORKERS, m,
        f"must divide the {stages} stages ({ENV_WORKERS}={lay.env_workers} x "
        f"staging.pipeline_stages={lay.pipeline_stages}) it serves, equally many per "
        f"rollout worker; use {ROLLOUT_WORKERS} in {fits}, or more env workers or stages.")


def _gpu_batched(cfg: TrainConfig) -> bool:
    """ManiSkill on its GPU backend (asked for, or ``auto`` with the env placed on a GPU)."""
    if not cfg.env.name.startswith("ManiSkill/"):
        return False
    env = cfg.cluster.placement.components.get("env")
    on_gpu = env is not None and bool(env.gpus)
    return cfg.env.sim_backend == "gpu" or (cfg.env.sim_backend == "auto" and on_gpu)
