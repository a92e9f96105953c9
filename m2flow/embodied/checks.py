"""Start-up checks of an embodied config: every mistake is one line naming the field, the
value and the fix, before any worker or simulator starts.

In order, cheapest first: the ranges of every numeric field the env and policy settings
classes share (the table ``RULES``), the algorithm's own ``validate()``, the cluster and its
placement on this machine, the fields that must agree (``check_config``), the paths
(``resume``, ``eval.checkpoint``), and registry names with the env's and the policy's own
``check_config`` hooks (which check the fields of their own settings classes).
"""

from __future__ import annotations

from typing import Optional

from m2flow.configs import ConfigError
from m2flow.embodied.algorithms.base import AlgorithmConfig
from m2flow.embodied.config import TrainConfig
from m2flow.runs.checks import (
    Rule,
    above,
    at_least,
    check_cluster_config,
    check_fields,
    check_file,
    check_resume,
    check_runner_base,
    field_error,
    one_of,
    optional,
    within,
)

COMPONENTS = ("env", "rollout", "learner")  # the runner's (m2flow.embodied.runner.COMPONENTS)
SIM_BACKENDS = ("auto", "cpu", "gpu")
SUCCESS_METRICS = ("success_once", "success_at_end")  # EpisodeStats' two success figures

RULES: list[Rule] = [
    ("env.num_envs", at_least(1), "set the envs each env worker steps (e.g. 8)"),
    ("env.max_episode_steps", optional(at_least(1), "the simulator's limit"),
     "set the episode time limit in steps"),
    ("env.image_size", at_least(1), "set the camera width and height in pixels (e.g. 64)"),
    ("env.sim_backend", one_of(SIM_BACKENDS),
     "'auto' simulates on the env worker's GPU if it has one"),
    ("rollout.pipeline_stages", at_least(1),
     "use 1 (sequential) or S > 1 to overlap simulation and inference"),
    ("rollout.env_groups", optional(at_least(1), "rollout.pipeline_stages"),
     "give the env groups each env worker builds"),
    ("runner.num_iterations", at_least(1), "set it to the number of iterations to run"),
    ("runner.rollout_steps", at_least(1), "set the env steps per env per iteration (e.g. 50)"),
    ("runner.eval_interval", at_least(0),
     "evaluate every N iterations, or 0 for only after the last"),
    ("runner.eval_episodes", at_least(1), "set the episodes per evaluation (e.g. 16)"),
    ("runner.stop_at_success", optional(within(0, 1, open_low=True), "run all iterations"),
     "give the success rate to stop at, e.g. 0.9"),
    ("runner.success_metric", one_of(SUCCESS_METRICS),
     "'success_once' counts an episode that reached the goal at any step, 'success_at_end' "
     "one that holds it at its last step"),
    ("runner.stop_after_evals", at_least(1),
     "give the evaluations in a row that must reach runner.stop_at_success (e.g. 1 or 2)"),
    ("runner.max_staleness", at_least(0), "give the updates an action may lag behind (e.g. 1)"),
    ("runner.warn_no_signal_iterations", at_least(0),
     "give the iterations without learning signal before a warning (0: never)"),
    ("runner.weight_sync_bucket_mb", above(0),
     "give the most MB of one weight-sync bucket (default 256)"),
    ("eval.episodes", at_least(0), "give the episodes to run, or 0 for runner.eval_episodes"),
    ("eval.episodes_per_task", at_least(0), "give the episodes per task, or 0 for the default"),
    ("eval.max_steps", optional(at_least(1), "the env's limit"), "give the steps per episode"),
    ("eval.videos_per_task", at_least(0), "give the videos per task, or 0 for none"),
]


def check_train_config(cfg: TrainConfig) -> None:
    """Ranges, the algorithm's own checks, placement, cross-field rules, paths and registry
    names of ``cfg``; raises a one-line ValueError (``m2flow.cli.common`` prints it as the config
    error)."""
    check_fields(cfg, RULES)
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


def update_samples(algo, collected: int) -> tuple[int, str]:
    """``algo.update_samples(collected)``; a plugin's config that does not extend
    AlgorithmConfig trains on what was collected."""
    own = getattr(algo, "update_samples", None)
    return own(collected) if own else AlgorithmConfig.update_samples(algo, collected)


def check_config(cfg: TrainConfig, offloads: Optional[dict[str, list[str]]] = None) -> None:
    """Config errors that only show in combination, before any worker starts. ``offloads``:
    who offloads for whom in the run (``offloads_for``), when it has a learner."""
    n = cfg.env.num_envs
    stages, groups = cfg.rollout.pipeline_stages, cfg.rollout.env_groups
    if stages > n:
        raise field_error("rollout.pipeline_stages", stages,
                          f"must be <= env.num_envs={n} (every stage needs an env); use 1 to {n}.")
    if groups is not None and not stages <= groups <= n:
        raise field_error(
            "rollout.env_groups", groups,
            f"must be in [rollout.pipeline_stages={stages}, env.num_envs={n}] (a stage is one "
            "or more env groups, a group one or more envs); change it or leave it unset.")
    _check_reset_groups(cfg)
    _check_learner_ranks(cfg)
    _check_rollout_ranks(cfg)
    env = cfg.cluster.placement.components.get("env")
    env_workers = 1 if env is None else env.workers
    samples, source = update_samples(cfg.algorithm, n * env_workers * cfg.runner.rollout_steps)
    minibatches = getattr(cfg.algorithm, "num_minibatches", 1)
    if minibatches > samples:
        raise field_error(
            "algorithm.num_minibatches", minibatches,
            f"must be <= the {samples} samples an update trains on ({source}); lower it or "
            "raise that.")
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


def check_paths(cfg: TrainConfig) -> None:
    """``eval.checkpoint`` and ``resume`` are checkpoints of this workload; ``eval.output_dir``
    is not a file. ``m2flow-eval checkpoint=...`` sets ``eval.checkpoint``: then ``resume``
    (kept in the checkpoint's config from its run, perhaps long pruned) is not read."""
    if cfg.eval.checkpoint is not None:
        check_file("eval.checkpoint", cfg.eval.checkpoint,
                   "give a .pt written by m2flow-train (runs/<name>/<time>/checkpoints/last.pt)")
        state = check_resume(cfg.eval.checkpoint, "embodied", name="eval.checkpoint")
        _check_policy_tensors(cfg, state, "eval.checkpoint", cfg.eval.checkpoint)
    else:
        check_resume_matches(cfg, check_resume(cfg.resume, "embodied"))
        check_init_from(cfg)
    out = cfg.eval.output_dir
    if out is not None:
        from pathlib import Path

        if Path(out).expanduser().is_file():
            raise field_error("eval.output_dir", out, "is a file; give a folder for the report.")


# what a run's checkpoint must share with the config that resumes it: the env and its
# observations and actions, the policy and its layers, the algorithm (its learner state)
RESUME_IDENTITY = ("env.name", "env.obs_mode", "env.control_mode", "env.image_size",
                   "policy.name", "policy.hidden_sizes", "algorithm.name")


def check_resume_matches(cfg: TrainConfig, state: Optional[dict] = None) -> None:
    """``resume`` was written by a run of this config: the fields of ``RESUME_IDENTITY`` agree
    (a checkpoint of another config would start every worker and then fail to load).
    ``state``: the checkpoint's, when the caller has read it already."""
    if cfg.resume is None:
        return
    from omegaconf import OmegaConf

    from m2flow.embodied.saved import upgrade
    from m2flow.runs import checkpoint

    state = state if state is not None else checkpoint.load(cfg.resume, mmap=True)
    saved = OmegaConf.create(state["config"])
    written = OmegaConf.create(upgrade(OmegaConf.to_container(saved)))  # an older layout too
    ours = OmegaConf.structured(cfg) if not OmegaConf.is_config(cfg) else cfg
    differ = [(key, OmegaConf.select(written, key), OmegaConf.select(ours, key))
              for key in RESUME_IDENTITY
              if OmegaConf.select(written, key) is not None  # a field it has (older: fewer)
              and _plain(OmegaConf.select(written, key)) != _plain(OmegaConf.select(ours, key))]
    if differ:
        what = "; ".join(f"{k}={theirs} there, {mine} here" for k, theirs, mine in differ)
        raise field_error("resume", cfg.resume, f"was written by another config ({what}); "
                          "resume it with the config it ran with (config.yaml in its run "
                          "directory), or start from its weights with init_from=.")
    # the same policy, and settings that build the same tensors: the learner loads them all
    _check_policy_tensors(cfg, state, "resume", cfg.resume)


def _plain(value):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def check_init_from(cfg: TrainConfig) -> None:
    """``init_from`` is an embodied checkpoint of a run with this config's policy, whose
    tensors fit the policy this run builds (``_check_policy_tensors``). A policy that holds
    its state statistics (``policy.hold_obs_norm``) starts from a checkpoint that has them."""
    hold = bool(getattr(cfg.policy, "hold_obs_norm", False))
    if hold and cfg.init_from is None and cfg.resume is None:
        raise field_error("policy.hold_obs_norm", True,
                          "holds the state statistics of the checkpoint the run starts from, "
                          "and there is none: set init_from=<a BC run> or "
                          "policy.hold_obs_norm=false.")
    if cfg.init_from is None or cfg.resume is not None:
        return
    state = check_resume(cfg.init_from, "embodied", name="init_from")
    weights = state["learner"]["policy"]
    counts = [n for n in ("obs_norm.count", "state_norm.count")
              if n in weights and float(weights[n]) == 0.0]
    if hold and counts:
        raise field_error("policy.hold_obs_norm", True,
                          f"the checkpoint of init_from={cfg.init_from} has no state statistics "
                          f"({counts[0]} is 0: its run never updated them), so held they "
                          "normalise nothing; set policy.hold_obs_norm=false.")
    from omegaconf import OmegaConf

    written = OmegaConf.create(state["config"])
    theirs = OmegaConf.select(written, "policy.name")
    if theirs != cfg.policy.name:
        raise field_error("init_from", cfg.init_from,
                          f"holds a policy={theirs} but this run trains policy="
                          f"{cfg.policy.name}; start from a checkpoint of the same policy.")
    if cfg.init_skip:
        _check_skip(list(cfg.init_skip), list(state["learner"]["policy"]), cfg.init_from)
    _check_policy_tensors(cfg, state, "init_from", cfg.init_from)


def _check_policy_tensors(cfg: TrainConfig, state: dict, name: str, path: str) -> None:
    """The policy tensors of checkpoint ``path`` (field ``name``) fit the policy this run
    builds, names and shapes: for ``init_from`` as the learner loads them once every worker
    started (``LearnerWorker.init_weights``): those ``init_skip`` names aside, and a critic
    tensor the new policy has no place for dropped; the tensors the checkpoint lacks keep
    their initial values. For ``eval.checkpoint`` (``m2flow-eval``: the checkpoint's config
    with the command's overrides) the checkpoint must also hold every actor tensor, as the
    rollout workers load a whole policy: an override that adds a part (e.g.
    ``policy.noise_method=flow_noise`` on a BC checkpoint: a noise head) would otherwise fail
    in the weight sync once every worker started. For ``resume`` every tensor must fit and
    none be missing, as the learner loads a resumed run's policy strictly (e.g. a Flow-SDE
    run resumed with a config that says Flow-Noise: a noise head it never had). The first
    tensor that does not fit is the line, with the policy settings that differ.

    The policy is built on the meta device (no memory, no arithmetic) for the env spec the
    checkpoint's run saw (its ``env_spec``). For another env (a field of ``RESUME_IDENTITY``'s
    ``env.*`` differs) this run's spec is not known before its env worker starts: only the
    tensors whose shapes do not depend on the env are compared (those a second build, for a
    spec of other sizes, gives the same shape); the learner checks the others when it loads.
    Not checked here: a checkpoint without ``env_spec`` (written before it was saved), and a
    policy built on a device it is given (a VLA: its constructor loads pretrained files)."""
    spec = state.get("env_spec")
    if spec is None:
        return
    from omegaconf import OmegaConf

    from m2flow.envs.base import EnvSpec
    from m2flow.policies.base import critic_tensor
    from m2flow.runs.checkpoint import CheckpointError, missing_weights

    written = OmegaConf.create(state["config"])
    ours = OmegaConf.structured(cfg) if not OmegaConf.is_config(cfg) else cfg
    spec = EnvSpec(**spec)
    own = _meta_shapes(cfg, spec)
    if own is None:
        return
    same_env = all(_plain(OmegaConf.select(written, key)) == _plain(OmegaConf.select(ours, key))
                   for key in RESUME_IDENTITY if key.startswith("env."))
    if not same_env:  # only the shapes a spec of other sizes does not change
        other = _meta_shapes(cfg, _resized(spec))
        if other is None:
            return
        own = {k: v for k, v in own.items() if other.get(k) == v}
    skip = set(cfg.init_skip) if name == "init_from" else set()
    given = {k: v for k, v in state["learner"]["policy"].items()
             if k not in skip and (k in own or not critic_tensor(k) or name == "resume")}
    if not same_env:
        given = {k: v for k, v in given.items() if k in own or k not in other}
    theirs, mine = _plain(written.policy), _plain(ours.policy)
    differ = [f"policy.{k}={theirs[k]} there, {mine[k]} here" for k in theirs
              if k in mine and theirs[k] != mine[k]]
    because = f" (its run's {'; '.join(differ)})" if differ else ""  # what made them differ
    try:
        missing = missing_weights(own, given, name)
    except CheckpointError as e:  # "<name>: its tensor ...; start from ..."
        what = str(e)[len(name) + 2:]
        if name == "eval.checkpoint":
            what = what.replace("start from a checkpoint of the same policy",
                                "evaluate it with the policy", 1)
        if name == "resume":
            what = what.split("; start from")[0] + (
                "; resume it with the config it ran with (config.yaml in its run directory), "
                "or start from its weights with init_from=.")
        raise field_error(name, path, what.replace("; ", f"{because}; ", 1)) from None
    if name == "resume" and missing:  # the learner loads a resumed run's state strictly
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise field_error(name, path, f"lacks this policy's tensor(s) "
                          f"{', '.join(map(repr, missing[:3]))}{more}{because}; resume it "
                          "with the config it ran with (config.yaml in its run directory), "
                          "or start from its weights with init_from=.")
    missing = [k for k in missing if not critic_tensor(k)]  # evaluation calls no critic
    if name == "eval.checkpoint" and missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise field_error(name, path, f"lacks this policy's tensor(s) "
                          f"{', '.join(map(repr, missing[:3]))}{more}{because}; evaluate it "
                          "with the policy settings of the run that wrote it (drop the "
                          "policy overrides that add them).")


def _meta_shapes(cfg: TrainConfig, spec) -> Optional[dict]:
    """Tensor shapes by name of ``cfg.policy`` built for ``spec`` on the meta device; None
    when it cannot be built so (see ``_check_policy_tensors``)."""
    import torch

    from m2flow.policies.registry import POLICIES, make_policy, takes_device

    if takes_device(POLICIES.require(cfg.policy.name)):
        return None
    try:
        with torch.device("meta"):
            policy = make_policy(cfg.policy, spec, device="meta")
    except Exception:  # noqa: BLE001 - one that computes on its tensors: the learner checks
        return None
    return {k: v.shape for k, v in policy.state_dict().items()}


def _resized(spec):
    """``spec`` with every size one larger (an image's channels kept): what changes a shape
    that depends on the env."""
    from dataclasses import replace

    def grow(shape):
        return tuple(d + 1 for d in shape) if len(shape) < 3 else (
            tuple(d + 1 for d in shape[:-1]) + tuple(shape[-1:]))

    return replace(spec, obs_shapes={k: grow(v) for k, v in spec.obs_shapes.items()},
                   action_dim=spec.action_dim + 1, action_low=(*spec.action_low, -1.0),
                   action_high=(*spec.action_high, 1.0))


def _check_skip(skip: list[str], names: list[str], source: str) -> None:
    """Every name of ``init_skip`` is a tensor of the checkpoint's policy (``names``)."""
    import difflib

    for name in skip:
        if name not in names:
            near = difflib.get_close_matches(str(name), names, n=3)
            hint = f"did you mean {', '.join(near)}?" if near else \
                f"its tensors include {', '.join(names[:5])}."
            raise field_error("init_skip", list(skip), f"{name!r} is not a tensor of the policy "
                              f"in init_from={source}; {hint}")


def _check_reset_groups(cfg: TrainConfig) -> None:
    """``env.num_envs`` (per env worker) holds whole reset groups of the algorithm (GRPO's)."""
    from m2flow.embodied.algorithms import algorithm_class

    size = algorithm_class(cfg.algorithm.name).reset_group_size(cfg.algorithm)
    n = cfg.env.num_envs
    if size >= 1 and n % size:
        fit = max(size, round(n / size) * size)
        raise field_error(
            "env.num_envs", n,
            f"must be a multiple of {size}, the envs of one reset group of "
            f"algorithm={cfg.algorithm.name} (e.g. algorithm.group_size): each env worker holds "
            f"whole groups that reset to one initial state; use env.num_envs={fit}.")
    groups = cfg.rollout.env_groups
    if size > 1 and groups and groups > 1 and _gpu_batched(cfg):
        from m2flow.embodied.workers.stages import stage_sizes

        sizes = stage_sizes(n, groups)
        if any(s % size for s in sizes):
            raise field_error(
                "rollout.env_groups", groups,
                f"splits env.num_envs={n} into batches of {sizes}, but on ManiSkill's GPU "
                f"backend a reset group of {size} envs shares one initial state only within one "
                f"batch; choose rollout.env_groups so that every batch holds whole groups "
                f"(a divisor of {n // size}).")


def _check_learner_ranks(cfg: TrainConfig) -> None:
    """Several learner ranks (data parallel) each train on the trajectories of whole env
    workers, an equal number each (so a GRPO group, which lives in one env worker, is never
    split), and each needs its own process."""
    comps = cfg.cluster.placement.components
    learners = comps["learner"].workers if "learner" in comps else 1
    if learners <= 1:
        return
    field = "cluster.placement.components.learner.workers"
    env_workers = comps["env"].workers if "env" in comps else 1
    if env_workers % learners:
        fit = max(d for d in range(1, env_workers + 1) if env_workers % d == 0 and d <= learners)
        raise field_error(
            field, learners,
            f"must divide cluster.placement.components.env.workers={env_workers}: each learner "
            "rank trains on the trajectories of whole env workers, equally many each; use "
            f"{field}={fit} or cluster.placement.components.env.workers="
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


def _check_rollout_ranks(cfg: TrainConfig) -> None:
    """M rollout workers serve the E x S stages (env worker, stage) of E env workers, equally
    many each (``stages.rollout_rank``: round-robin), so M must divide E x S: none idle, none
    the bottleneck."""
    comps = cfg.cluster.placement.components
    m = comps["rollout"].workers if "rollout" in comps else 1
    e = comps["env"].workers if "env" in comps else 1
    stages = e * cfg.rollout.pipeline_stages
    if stages % m == 0:
        return
    field = "cluster.placement.components.rollout.workers"
    fits = [n for n in range(1, stages + 1) if stages % n == 0]
    raise field_error(
        field, m,
        f"must divide the {stages} stages (cluster.placement.components.env.workers={e} x "
        f"rollout.pipeline_stages={cfg.rollout.pipeline_stages}) it serves, equally many per "
        f"rollout worker; use {field} in {fits}, or more env workers or stages.")


def _gpu_batched(cfg: TrainConfig) -> bool:
    """ManiSkill on its GPU backend (asked for, or ``auto`` with the env placed on a GPU)."""
    if not cfg.env.name.startswith("ManiSkill/"):
        return False
    env = cfg.cluster.placement.components.get("env")
    on_gpu = env is not None and bool(env.gpus)
    return cfg.env.sim_backend == "gpu" or (cfg.env.sim_backend == "auto" and on_gpu)


def memory_hint(cfg: TrainConfig) -> str:
    """The fields that size an embodied run's memory, with their values: the fix an
    out-of-memory line gives (``m2flow.runs.session.RunOutOfMemory``).

    >>> from m2flow.cli.common import load_run_config
    >>> memory_hint(load_run_config("maniskill_pushcube_ppo_mlp", ["env.num_envs=8"]))
    "lower env.num_envs (now 8: a simulator process each) or set algorithm.micro_batch_size (now unset: each learner step takes its whole minibatch of 100 samples at once); m2flow-plan predicts a placement's memory"
    """
    env = cfg.cluster.placement.components.get("env")
    workers = 1 if env is None else env.workers
    n = cfg.env.num_envs
    sims = "" if cfg.env.sim_backend == "gpu" else ": a simulator process each"
    per = f" per env worker, {workers} workers" if workers > 1 else ""
    algo = cfg.algorithm
    samples, _ = update_samples(algo, n * workers * cfg.runner.rollout_steps)
    mini = samples // max(1, getattr(algo, "num_minibatches", 1))
    micro = getattr(algo, "micro_batch_size", None)
    now = (f"now {micro}" if micro else
           f"now unset: each learner step takes its whole minibatch of {mini} samples at once")
    return (f"lower env.num_envs (now {n}{per}{sims}) or set algorithm.micro_batch_size "
            f"({now}); m2flow-plan predicts a placement's memory")
