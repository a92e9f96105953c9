"""Start-up checks of the checkpoints an embodied run reads (``resume``, ``init_from``,
``eval.checkpoint``): each is a checkpoint of this workload, written by a run of this config
(``resume``), of a policy whose tensors are the ones this config builds (checked on ``meta``,
without loading the weights). Every mistake is one line naming the field, before any worker
starts; ``m2flow.embodied.checks`` runs them after the config's own fields.
"""

from __future__ import annotations

from typing import Optional

from m2flow.embodied.config import TrainConfig
from m2flow.fields import field_error
from m2flow.runs.checks import check_file, check_resume


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

    from m2flow.runs import checkpoint

    state = state if state is not None else checkpoint.load(cfg.resume, mmap=True)
    written = OmegaConf.create(state["config"])
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
