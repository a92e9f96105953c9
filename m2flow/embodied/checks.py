"""Start-up checks of an embodied config: every mistake is one line naming the field, the
value and the fix, before any worker or simulator starts.

In order, cheapest first: each settings class checks the ranges of its own fields, in its
``validate()`` (``env``: the fields every env adapter shares, ``staging``, ``runner``,
``eval``, the ``runner`` fields every workload shares and ``seed``, then ``algorithm``); then
the cluster and its placement on this machine; the rules across groups, plain functions over
the typed settings and the run's counts (its ``Layout``: ``m2flow.embodied.layout``;
``check_config``); the checkpoints it reads (``resume``, ``init_from``, ``eval.checkpoint``:
``m2flow.embodied.checkpoint_checks``); and registry names with the env's and the policy's
own ``check_config`` hooks (which check the fields of their adapter's own settings).
"""

from __future__ import annotations

from typing import Optional

from m2flow.configs import ConfigError
from m2flow.embodied.checkpoint_checks import check_paths
from m2flow.embodied.config import TrainConfig
from m2flow.embodied.layout import Layout, check_layout
from m2flow.fields import field_error
from m2flow.runs.checks import check_cluster_config, check_runner_base

COMPONENTS = ("env", "rollout", "learner")  # the runner's (m2flow.embodied.runner.COMPONENTS)


def check_train_config(cfg: TrainConfig) -> None:
    """The fields of each settings group (its ``validate``), placement, cross-field rules,
    paths and registry names of ``cfg``; raises a one-line ValueError (``m2flow.cli.common``
    prints it as the config error)."""
    for group in (cfg.env, cfg.staging, cfg.runner, cfg.eval):
        group.validate()
    check_runner_base(cfg)
    cfg.algorithm.validate()
    placement = check_cluster_config(cfg.cluster, COMPONENTS)
    offloads = None
    if placement is not None:
        from m2flow.pipelines import offloads_for

        offloads = offloads_for(placement.shares_device, ["rollout", "learner"],
                                cfg.cluster.context_switch)
    check_config(cfg, offloads)
    check_paths(cfg)
    check_names(cfg)  # last: a simulator's registry can take seconds to import


def check_names(cfg: TrainConfig) -> None:
    """Registry lookups at startup, not 300 lines into a rollout: the names, whether their
    packages are installed (a missing simulator names the extra that installs it), whether the
    env's and the policy's settings are their classes' (a group file of another simulator,
    given another ``name``, is not), and their own ``check_config`` hooks (the policy's gets
    the env config too: the obs modes it can read)."""
    from m2flow.embodied.algorithms import ALGORITHMS, AlgorithmError
    from m2flow.envs import EnvError
    from m2flow.envs.registry import ENVS
    from m2flow.policies import PolicyError
    from m2flow.policies.registry import POLICIES

    try:
        ALGORITHMS.require(cfg.algorithm.name)
    except AlgorithmError as e:
        raise ConfigError(f"config error: algorithm.name: {e}") from None
    try:
        cls = ENVS.require(cfg.env.name)
        ENVS.check_settings(cfg.env, cls, "env")
        check = getattr(cls, "check_config", None)
        if check is not None:
            check(cfg.env)
    except EnvError as e:
        raise ConfigError(f"config error: {e}") from None
    if cfg.runner.stagger_episodes and not cls.episode_clocks:
        raise field_error("runner.stagger_episodes", True,
                          f"{cfg.env.name} cannot start its episodes part-way (mjlab/* envs "
                          "can); leave it false for this env.")
    try:
        cls = POLICIES.require(cfg.policy.name)
    except PolicyError as e:
        raise ConfigError(f"config error: policy.name: {e}") from None
    try:
        POLICIES.check_settings(cfg.policy, cls, "policy")
        check = getattr(cls, "check_config", None)
        if check is not None:
            check(cfg.policy, cfg.env)
    except PolicyError as e:
        raise ConfigError(f"config error: {e}") from None


def check_config(cfg: TrainConfig, offloads: Optional[dict[str, list[str]]] = None) -> Layout:
    """Config errors that only show in combination, before any worker starts; the run's
    layout they were checked on. ``offloads``: who offloads for whom in the run
    (``offloads_for``), when it has a learner."""
    layout = Layout.of(cfg)
    check_run(layout, cfg, offloads)
    return layout


def check_run(layout: Layout, cfg: TrainConfig,
              offloads: Optional[dict[str, list[str]]] = None) -> None:
    """The counts of ``layout`` (:func:`m2flow.embodied.layout.check_layout`), then the
    settings that must agree across env, policy, algorithm and runner."""
    check_layout(layout, cfg)
    pretrain = getattr(cfg.algorithm, "aux_pretrain_iterations", 0)
    if pretrain and not getattr(cfg.policy, "state_aux", 0) > 0:
        raise field_error(
            "algorithm.aux_pretrain_iterations", pretrain,
            f"trains the policy's auxiliary loss, which policy={cfg.policy.name} has off "
            "(policy.state_aux=0 or no such setting); set policy.state_aux > 0 (e.g. 1.0), "
            "or algorithm.aux_pretrain_iterations=0.")
    r = cfg.runner
    if r.stagger_episodes and r.reset_every_iteration:
        raise field_error("runner.stagger_episodes", True,
                          "needs runner.reset_every_iteration=false (a reset every iteration "
                          "would end every episode at the same step); set that too.")
    if r.overlap_learner and r.max_staleness < 1:
        raise ValueError(
            f"runner.overlap_learner=true needs runner.max_staleness >= 1 (got "
            f"{r.max_staleness}): overlapped collection uses weights one update old."
        )
    if r.overlap_learner and offloads and any(offloads.values()):
        raise ValueError(
            f"runner.overlap_learner=true trains while the rollout serves, but with "
            f"cluster.context_switch={cfg.cluster.context_switch!r} rollout and learner take "
            "turns on their device (placed on a common GPU, or 'always'). Set "
            "runner.overlap_learner=false, give them disjoint GPUs, or set "
            "cluster.context_switch=never if the device holds both."
        )


def memory_hint(layout: Layout, cfg: TrainConfig) -> str:
    """The fields that size an embodied run's memory, with their values: the fix an
    out-of-memory line gives (``m2flow.runs.session.RunOutOfMemory``).

    >>> from m2flow.cli.common import load_run_config
    >>> cfg = load_run_config("maniskill_pushcube_ppo_mlp", ["env.num_envs=8"])
    >>> memory_hint(Layout.of(cfg), cfg)
    "lower env.num_envs (now 8: a simulator process each) or set algorithm.micro_batch_size (now unset: each learner step takes its whole minibatch of 100 samples at once); m2flow-plan predicts a placement's memory"
    """
    n, workers = layout.num_envs, layout.env_workers
    sims = "" if cfg.env.sim_backend == "gpu" else ": a simulator process each"
    per = f" per env worker, {workers} workers" if workers > 1 else ""
    algo = cfg.algorithm
    mini = layout.update_samples // max(1, getattr(algo, "num_minibatches", 1))
    micro = getattr(algo, "micro_batch_size", None)
    now = (f"now {micro}" if micro else
           f"now unset: each learner step takes its whole minibatch of {mini} samples at once")
    return (f"lower env.num_envs (now {n}{per}{sims}) or set algorithm.micro_batch_size "
            f"({now}); m2flow-plan predicts a placement's memory")
