"""Gaussian MLP actor-critic for state observations (cleanRL / ManiSkill PPO baseline shape).

Reads ``("obs", "state")`` (B, D). Actor: MLP -> action mean; a learned state-independent
log-std. Critic: a separate MLP -> value, over the same state or, with
``policy.critic=privileged``, over ``("obs", "privileged")`` (an mjlab task's critic
group: its noise-free observations). ``policy.actor_hidden_state`` hides dims of the
state from the actor alone (the critic reads them all): each [start, end) range is fed to the
actor as its running mean (0 after normalisation); behaviour cloning needs it where the state
holds the robot's joint velocities (``m2flow.policies.hidden_state``). On a multi-task env
actor and critic also read a learned embedding of ``("obs", "task")``
(``policy.task_embedding``, :mod:`m2flow.policies.task_embedding`). Actions are raw
Gaussian samples; the env clips them to its bounds, and log-probs are of the unclipped sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch
from tensordict import TensorDict
from torch import nn
from torch.distributions import Normal

from m2flow import keys
from m2flow.policies import critics, hidden_state, task_embedding
from m2flow.policies.base import Policy, PolicyError
from m2flow.policies.config import MLPHeadsConfig
from m2flow.policies.layers import ACTIVATIONS, ACTOR_OUT_GAIN, CRITIC_OUT_GAIN, mlp
from m2flow.policies.normalizer import RunningNorm, state_norm

SHARED_CRITIC, PRIVILEGED_CRITIC = "shared", critics.PRIVILEGED
LOG_STD, SCALAR_STD = "log", "scalar"
HIDE_FIELD = "policy.actor_hidden_state"  # the setting of mlp and cnn
STATE_INPUT, PRIVILEGED_INPUT = keys.leaf(keys.STATE), keys.leaf(keys.PRIVILEGED)
MIN_STD = 1e-6  # rsl-rl's lower clamp of a scalar standard deviation


@dataclass
class GaussianConfig(MLPHeadsConfig):
    """The settings of the Gaussian actor-critics (mlp, cnn)."""

    init_log_std: float = -0.5
    """Initial log standard deviation of the Gaussian actions (state-independent)."""
    init_log_std_per_dim: Optional[List[float]] = None
    """One initial log standard deviation per action dimension, in place of
    ``init_log_std`` for all: RL from a cloned policy (``init_skip=[actor_log_std]``) whose
    dimensions tolerate different noise, e.g. LIBERO's OSC_POSE, where a rotation delta of
    0.5 rad per unit makes noise that position deltas (0.05 m per unit) tolerate fail every
    episode. None: ``init_log_std``."""
    critic: str = SHARED_CRITIC
    """'shared': the critic reads the actor's features; 'privileged': an asymmetric critic,
    an MLP of its own over the normalised ``("obs", "privileged")`` simulator state
    (``env.privileged_state=true``), while the actor still reads only its observations."""
    actor_hidden_state: Optional[List[List[int]]] = None
    """[start, end) ranges of ``("obs", "state")``'s dims the actor reads as their running
    mean (0 after normalisation); the critic reads them all. [[9, 18]] hides ManiSkill
    Panda's joint velocities, which a cloned policy would copy
    (``m2flow.policies.hidden_state``). None: the actor reads the whole state."""
    task_embedding: int = task_embedding.WIDTH
    """Width of a learned embedding of ``("obs", "task")`` after the actor's and critic's
    features when the env runs 2 or more tasks (``m2flow.policies.task_embedding``); 0: none
    (the policy cannot tell the tasks apart). One-task envs get none."""


@dataclass
class MLPPolicyConfig(GaussianConfig):
    """``policy.name=mlp``: the Gaussian actor-critic's settings and how its spread is kept."""

    std: str = LOG_STD
    """'log': learn the log of the actions' standard deviation (cleanRL's); 'scalar': the
    standard deviation itself, clamped at MIN_STD (rsl-rl's default ``std_type``)."""
    inputs: List[str] = field(default_factory=lambda: [STATE_INPUT])
    """The flat observations the MLP reads, concatenated in this order: ``state``, and
    ``privileged`` (``env.privileged_state=true``) for a control that sees the simulator's
    poses (a LIBERO or Meta-World suite's state baseline); ``actor_hidden_state`` indexes the
    concatenation."""


class GaussianActorCritic(Policy):
    """A Gaussian actor and a critic, both MLPs over ``_features(obs)``: subclasses say how
    observations become features (an MLP policy: the normalised state; a CNN: image features
    and state); acting, scoring and the value are the same for all of them."""

    @staticmethod
    def check_config(policy_cfg: GaussianConfig, env_cfg) -> None:
        """Raises PolicyError for heads that cannot be built (``env_cfg``: the env's config,
        for the subclasses' obs-mode rules); builds nothing."""
        if policy_cfg.activation not in ACTIVATIONS:
            raise PolicyError(
                f"policy.activation={policy_cfg.activation!r}: use one of {sorted(ACTIVATIONS)}."
            )
        if any(h < 1 for h in policy_cfg.hidden_sizes):
            raise PolicyError(
                f"policy.hidden_sizes={list(policy_cfg.hidden_sizes)}: every width must be >= 1 "
                "(an empty list: linear heads)."
            )
        if not np.isfinite(policy_cfg.init_log_std):
            raise PolicyError(f"policy.init_log_std={policy_cfg.init_log_std}: must be finite "
                              "(e.g. -0.5).")
        per_dim = policy_cfg.init_log_std_per_dim
        if per_dim is not None and (not per_dim or not np.all(np.isfinite(list(per_dim)))):
            raise PolicyError(f"policy.init_log_std_per_dim={list(per_dim)}: give one finite "
                              "value per action dimension, or null for policy.init_log_std.")
        check_critic(policy_cfg.critic)
        task_embedding.check(policy_cfg.task_embedding)
        if policy_cfg.critic == PRIVILEGED_CRITIC:
            critics.check_env(env_cfg, "policy.critic=privileged", "use policy.critic=shared")
        hidden_state.ranges(policy_cfg.actor_hidden_state, None, HIDE_FIELD)

    def _build_heads(self, n_features: int, act_dim: int, cfg: GaussianConfig,
                     std: str = LOG_STD) -> None:
        """Actor mean, the actions' spread and the critic. ``std``: 'log' learns the log of
        the standard deviation (cleanRL's); 'scalar' the standard deviation itself, clamped
        at MIN_STD (rsl-rl's default ``std_type``: Adam moves it by about the step size in
        absolute terms, so it can shrink much faster than a log-std)."""
        if cfg.activation not in ACTIVATIONS:
            raise PolicyError(
                f"policy.activation={cfg.activation!r}: use one of {sorted(ACTIVATIONS)}."
            )
        hidden = list(cfg.hidden_sizes)
        self.actor_mean = mlp(n_features, hidden, act_dim, cfg.activation, ACTOR_OUT_GAIN)
        log_std = initial_log_std(cfg, act_dim)
        if std == SCALAR_STD:  # exp in float64, then float32: as the single value always was
            self.actor_std = nn.Parameter(torch.tensor([float(np.exp(v)) for v in log_std]))
        else:
            self.actor_log_std = nn.Parameter(torch.tensor(log_std))
        self.critic = mlp(n_features, hidden, 1, cfg.activation, CRITIC_OUT_GAIN)

    def _features(self, obs: TensorDict) -> torch.Tensor:
        raise NotImplementedError

    def _hide_from_actor(self, hidden: list[tuple[int, int]], offset: int,
                         n_features: int) -> None:
        """Registers ``actor_sees`` (``hidden_state.sees``; None: the actor reads every
        feature). A constant, not a weight: the same for every checkpoint of the config, so
        it is not saved."""
        self.register_buffer("actor_sees", hidden_state.sees(hidden, n_features, offset),
                             persistent=False)

    def _dist(self, features: torch.Tensor) -> Normal:
        if getattr(self, "actor_sees", None) is not None:
            features = features * self.actor_sees
        mean = self.actor_mean(features)
        if hasattr(self, "actor_std"):
            return Normal(mean, self.actor_std.clamp(min=MIN_STD).expand_as(mean))
        return Normal(mean, self.actor_log_std.expand_as(mean).exp())

    def _value(self, obs: TensorDict, features: torch.Tensor) -> torch.Tensor:
        """The critic's value; subclasses with a critic of its own inputs override it."""
        return self.critic(features).squeeze(-1)

    def value(self, obs: TensorDict) -> torch.Tensor:
        return self._value(obs, self._features(obs))

    def act(self, batch: TensorDict, deterministic: bool = False) -> TensorDict:
        features = self._features(batch[keys.OBS])
        dist = self._dist(features)
        action = dist.mean if deterministic else dist.sample()
        return TensorDict(
            {
                keys.ACTION: action,
                keys.LOG_PROB: dist.log_prob(action).sum(-1),
                keys.VALUE: self._value(batch[keys.OBS], features),
            },
            batch_size=batch.batch_size,
        )

    def evaluate_actions(self, batch: TensorDict) -> TensorDict:
        features = self._features(batch[keys.OBS])
        dist = self._dist(features)
        out = TensorDict(
            {
                keys.LOG_PROB: dist.log_prob(batch[keys.ACTION]).sum(-1),
                keys.ENTROPY: dist.entropy().sum(-1),
                keys.VALUE: self._value(batch[keys.OBS], features),
            },
            batch_size=batch.batch_size,
        )
        aux = self._aux_loss(batch[keys.OBS], features)
        if aux is not None:
            out[keys.AUX_LOSS] = aux
        return out

    def _aux_loss(self, obs: TensorDict, features: torch.Tensor):
        """A per-sample auxiliary loss on the features (None: none); the RL losses add it."""
        return None


class GaussianMLPPolicy(GaussianActorCritic):
    """``policy.name=mlp``.

    >>> from m2flow.envs import EnvSpec
    >>> spec = EnvSpec({"state": (5,)}, 2, (-1.0, -1.0), (1.0, 1.0), 50)
    >>> pi = GaussianMLPPolicy(MLPPolicyConfig(name="mlp", hidden_sizes=[8]), spec)
    >>> obs = TensorDict({"state": torch.zeros(3, 5)}, batch_size=[3])
    >>> out = pi.act(TensorDict({"obs": obs}, batch_size=[3]))
    >>> out["action"].shape, out["log_prob"].shape, out["value"].shape
    (torch.Size([3, 2]), torch.Size([3]), torch.Size([3]))
    """

    config_class = MLPPolicyConfig

    @staticmethod
    def check_config(policy_cfg: MLPPolicyConfig, env_cfg) -> None:
        GaussianActorCritic.check_config(policy_cfg, env_cfg)
        _check_std(policy_cfg.std)
        _check_inputs(policy_cfg.inputs)
        if PRIVILEGED_INPUT in policy_cfg.inputs:
            critics.check_env(env_cfg, "policy.inputs=[..., privileged]",
                              "read policy.inputs=[state]")
        if env_cfg.obs_mode != "state":
            raise PolicyError(
                f"policy=mlp reads only ('obs','state'); env.obs_mode={env_cfg.obs_mode} renders "
                "images it would ignore; use env.obs_mode=state or policy=cnn."
            )

    def __init__(self, cfg: MLPPolicyConfig, env_spec):
        super().__init__()
        self.inputs = _check_inputs(cfg.inputs)
        for name in self.inputs:
            if name not in env_spec.obs_shapes or len(env_spec.obs_shapes[name]) != 1:
                raise PolicyError(
                    f"policy.name='mlp' reads a flat ('obs', {name!r}) vector; this env gives "
                    f"{env_spec.obs_shapes}. Use env.obs_mode=state (and "
                    "env.privileged_state=true for 'privileged'), or an image policy."
                )
        obs_dim = sum(env_spec.obs_shapes[name][0] for name in self.inputs)
        self.task_emb = task_embedding.build(cfg.task_embedding, env_spec)
        n_features = obs_dim + task_embedding.width(self.task_emb)  # [state, E[task]]
        self._build_heads(n_features, env_spec.action_dim, cfg, _check_std(cfg.std))
        self.obs_norm = state_norm(obs_dim, cfg)
        self.privileged_critic = check_critic(cfg.critic) == PRIVILEGED_CRITIC
        hidden = hidden_state.ranges(cfg.actor_hidden_state, obs_dim, HIDE_FIELD)
        self._hide_from_actor(hidden, 0, n_features)
        if self.privileged_critic:  # replaces the critic over the state
            self.critic = critics.privileged_critic(env_spec, cfg.hidden_sizes, cfg.activation)

    def _state(self, obs: TensorDict) -> torch.Tensor:
        """The inputs, concatenated (B, D): ``state`` alone unless ``policy.inputs`` says."""
        if self.inputs == [STATE_INPUT]:
            return obs[STATE_INPUT]
        return torch.cat([obs[name].float() for name in self.inputs], dim=-1)

    def _features(self, obs: TensorDict) -> torch.Tensor:
        state = self.obs_norm(self._state(obs))
        return task_embedding.append(self.task_emb, state, obs)  # (B, D [+ task_embedding])

    def _value(self, obs: TensorDict, features: torch.Tensor) -> torch.Tensor:
        if not self.privileged_critic:
            return super()._value(obs, features)
        return self.critic(obs)

    def observe(self, batch: TensorDict) -> None:
        if isinstance(self.obs_norm, RunningNorm):
            self.obs_norm.update(self._state(batch[keys.OBS]))
        if self.privileged_critic:
            self.critic.observe(batch)


def initial_log_std(cfg: GaussianConfig, act_dim: int) -> list[float]:
    """The actions' initial log-std, one per dimension: ``init_log_std_per_dim``, else
    ``init_log_std`` in every dimension.

    >>> cfg = GaussianConfig(name="mlp", init_log_std_per_dim=[-3.0, -7.0])
    >>> initial_log_std(cfg, 2), initial_log_std(GaussianConfig(name="mlp"), 2)
    ([-3.0, -7.0], [-0.5, -0.5])
    >>> initial_log_std(cfg, 7)
    Traceback (most recent call last):
    ...
    m2flow.policies.base.PolicyError: policy.init_log_std_per_dim has 2 values, but the env's actions have 7 dimensions: give one per dimension.
    """
    per_dim = cfg.init_log_std_per_dim
    if per_dim is None:
        return [float(cfg.init_log_std)] * act_dim
    if len(per_dim) != act_dim:
        raise PolicyError(f"policy.init_log_std_per_dim has {len(per_dim)} values, but the "
                          f"env's actions have {act_dim} dimensions: give one per dimension.")
    return [float(v) for v in per_dim]


def _check_inputs(inputs) -> list:
    """``policy.inputs`` as a list, or a PolicyError naming the allowed keys."""
    inputs = list(inputs)
    allowed = (STATE_INPUT, PRIVILEGED_INPUT)
    if not inputs or len(set(inputs)) != len(inputs) or not set(inputs) <= set(allowed):
        raise PolicyError(f"policy.inputs={inputs}: distinct keys among {list(allowed)}, "
                          "e.g. [state] or [state, privileged].")
    return inputs


def check_critic(critic: str) -> str:
    """``critic`` (``policy.critic`` of mlp and cnn), or a PolicyError naming the two."""
    if critic not in (SHARED_CRITIC, PRIVILEGED_CRITIC):
        raise PolicyError(f"policy.critic={critic!r}: use {SHARED_CRITIC!r} (the actor's "
                          f"features) or {PRIVILEGED_CRITIC!r} (('obs','privileged'), "
                          "env.privileged_state=true).")
    return critic


def _check_std(std: str) -> str:
    if std not in (LOG_STD, SCALAR_STD):
        raise PolicyError(f"policy.std={std!r}: use {LOG_STD!r} (a learned log-std) or "
                          f"{SCALAR_STD!r} (the std itself, as rsl-rl).")
    return std
