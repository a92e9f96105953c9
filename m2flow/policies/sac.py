"""Soft actor-critic's policy for state observations (``policy.name=sac_mlp``): a
tanh-squashed Gaussian actor, twin Q critics with target copies, and the entropy temperature
(cleanRL's ``sac_continuous_action.py`` and ManiSkill's SAC baseline have this shape).

Reads ``("obs", "state")`` (B, D). Actor: MLP -> mean and log-std (squashed into
[LOG_STD_MIN, LOG_STD_MAX]); an action is ``tanh(u)`` scaled to the env's bounds, ``u`` the
Gaussian sample, so actions never leave the bounds, and its log-prob carries the tanh's
change of variables. Critics: two MLPs over (state, action), ``critic.0`` and ``critic.1``;
``critic_target`` is their trailing copy (no gradients; the algorithm updates it by Polyak
averaging). ``temperature.log_alpha`` is the log of the entropy weight alpha. What each part
trains is the algorithm's (``algorithm=sac``); the rollout only acts.

Settings (:class:`SACPolicyConfig`): ``policy.init_alpha`` (alpha's starting value) and
``policy.critic_layer_norm`` (a LayerNorm after each hidden layer of the critics, as
ManiSkill's baseline's ``--q_layer_norm``).

``policy.name=sac_cnn`` reads ``("obs", "rgb")`` (B, H, W, C) uint8 images (and the state
next to them, when the env has it): a NatureCNN encoder belongs to the critics
(``critic.encoder``; its trailing copy is ``critic_target.encoder``) and learns from their
loss alone; the actor reads its features detached (as ManiSkill's ``sac_rgbd.py`` and DrQ do:
the actor's loss would otherwise pull the encoder towards what flatters the critics).
``policy.feature_dim`` is the encoder's width.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from tensordict import TensorDict
from torch import nn
from torch.distributions import Normal

from m2flow import keys
from m2flow.policies.base import Policy, PolicyError
from m2flow.policies.config import MLPHeadsConfig
from m2flow.policies.cnn import NatureCNN
from m2flow.policies.layers import ACTIVATIONS, mlp, orthogonal_linear
from m2flow.policies.normalizer import RunningNorm, state_norm

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0  # cleanRL's range for the actor's log-std
TANH_EPS = 1e-6  # keeps log(1 - tanh(u)^2) finite at the bounds (cleanRL's)


@dataclass
class SACPolicyConfig(MLPHeadsConfig):
    """``policy.name=sac_mlp``: the MLP heads' settings and SAC's own."""

    init_alpha: float = 1.0
    """The entropy temperature alpha's starting value."""
    critic_layer_norm: bool = False
    """A LayerNorm after each hidden layer of the critics (ManiSkill's ``--q_layer_norm``)."""


@dataclass
class SACCNNPolicyConfig(SACPolicyConfig):
    """``policy.name=sac_cnn``: as sac_mlp, and the width of the critics' image encoder."""

    feature_dim: int = 256
    """Width of the image features (the NatureCNN encoder's final linear layer)."""


class SACPolicy(Policy):
    """``policy.name=sac_mlp``.

    >>> from m2flow.envs import EnvSpec
    >>> spec = EnvSpec({"state": (5,)}, 2, (-1.0, -2.0), (1.0, 2.0), 50)
    >>> pi = SACPolicy(SACPolicyConfig(name="sac_mlp", hidden_sizes=[8], normalize_obs=False), spec)
    >>> obs = TensorDict({"state": torch.zeros(3, 5)}, batch_size=[3])
    >>> action, log_prob = pi.sample(obs)
    >>> action.shape, log_prob.shape, pi.q(obs, action).shape  # (B, A), (B,), twin (B, 2)
    (torch.Size([3, 2]), torch.Size([3]), torch.Size([3, 2]))
    >>> bool((action.abs() <= torch.tensor([1.0, 2.0])).all())
    True
    """

    soft_actor_critic = True
    """What ``algorithm=sac`` asks of a policy: ``sample``, ``q``, ``q_target``,
    ``log_alpha`` and the parameter names of each part."""
    config_class = SACPolicyConfig

    @staticmethod
    def check_config(policy_cfg: SACPolicyConfig, env_cfg) -> None:
        _check(policy_cfg)
        if env_cfg.obs_mode != "state":
            raise PolicyError(f"policy=sac_mlp reads only ('obs','state'); env.obs_mode="
                              f"{env_cfg.obs_mode}: use env.obs_mode=state.")

    def __init__(self, cfg: SACPolicyConfig, env_spec):
        super().__init__()
        _check(cfg)
        shapes = env_spec.obs_shapes
        if "state" not in shapes or len(shapes["state"]) != 1:
            raise PolicyError("policy.name='sac_mlp' reads a flat ('obs', 'state') vector; this "
                              f"env gives {shapes}. Use env.obs_mode=state.")
        obs_dim = shapes["state"][0]
        self.obs_norm = state_norm(obs_dim, cfg)
        self._build(cfg, env_spec, actor_in=obs_dim,
                    critic=lambda: _heads(obs_dim + env_spec.action_dim, cfg))

    def _build(self, cfg: SACPolicyConfig, env_spec, *, actor_in: int, critic) -> None:
        """The action bounds, the actor (``actor_in`` -> mean and log-std), the critics
        (``critic()`` makes them, after the actor) and their trailing copy, the temperature."""
        low = torch.tensor(env_spec.action_low, dtype=torch.float32)
        high = torch.tensor(env_spec.action_high, dtype=torch.float32)
        if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
            raise PolicyError(f"policy.name='{cfg.name}' squashes actions into the env's bounds, "
                              "and this env's action space is unbounded; use policy=mlp.")
        act_dim = env_spec.action_dim
        self.register_buffer("action_scale", (high - low) / 2)
        self.register_buffer("action_bias", (high + low) / 2)
        self.actor = mlp(actor_in, list(cfg.hidden_sizes), 2 * act_dim, cfg.activation, 1.0)
        self.critic = critic()
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.temperature = nn.Module()
        self.temperature.log_alpha = nn.Parameter(
            torch.tensor(math.log(float(cfg.init_alpha))))

    # -- what SAC trains ----------------------------------------------------------------------
    @property
    def log_alpha(self) -> nn.Parameter:
        return self.temperature.log_alpha

    def actor_parameter_names(self) -> list[str]:
        return [n for n, _ in self.named_parameters() if n.startswith("actor.")]

    def temperature_parameter_names(self) -> list[str]:
        return ["temperature.log_alpha"]

    def sample(self, obs: TensorDict, deterministic: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """An action for each row of ``obs`` (B, A), reparameterised (gradients flow through
        it), and its log-prob under the squashed Gaussian (B,); ``deterministic``: the
        squashed mean."""
        dist = self._dist(obs)
        mean = dist.mean
        u = mean if deterministic else dist.rsample()
        squashed = torch.tanh(u)
        log_prob = dist.log_prob(u) - torch.log(self.action_scale * (1 - squashed.pow(2))
                                                + TANH_EPS)
        return squashed * self.action_scale + self.action_bias, log_prob.sum(-1)

    def _dist(self, obs: TensorDict) -> Normal:
        """The Gaussian before the squash."""
        mean, log_std = self.actor(self._actor_input(obs)).chunk(2, dim=-1)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(log_std) + 1)
        return Normal(mean, log_std.exp())

    def _state(self, obs: TensorDict) -> torch.Tensor:
        return self.obs_norm(obs[keys.leaf(keys.STATE)])

    def _actor_input(self, obs: TensorDict) -> torch.Tensor:
        return self._state(obs)

    def _q(self, critic: nn.Module, obs: TensorDict, action: torch.Tensor) -> torch.Tensor:
        """``critic``'s (the critics' or their targets') twin Q(s, a) (B, 2)."""
        return _twin(critic, self._state(obs), action)

    def q(self, obs: TensorDict, action: torch.Tensor) -> torch.Tensor:
        """Both critics' Q(s, a) (B, 2)."""
        return self._q(self.critic, obs, action)

    def q_target(self, obs: TensorDict, action: torch.Tensor) -> torch.Tensor:
        """Both target critics' Q(s, a) (B, 2)."""
        return self._q(self.critic_target, obs, action)

    def observe(self, batch: TensorDict) -> None:
        """Running state statistics (``policy.normalize_obs``), from each update's new
        transitions; off by default (``sac_mlp.yaml``), as in SAC's references: moving
        statistics shift the inputs of every stored transition."""
        if isinstance(self.obs_norm, RunningNorm):
            self.obs_norm.update(batch[keys.STATE])

    # -- the Policy interface -----------------------------------------------------------------
    def act(self, batch: TensorDict, deterministic: bool = False) -> TensorDict:
        """Actions, their log-probs, and as ``value`` the smaller critic's Q of them. The
        log-prob is that of the action as it is stored, as ``evaluate_actions`` computes it:
        where tanh saturates, float32 keeps too little of the action to recover the sample
        exactly, and the two would disagree."""
        obs = batch[keys.OBS]
        dist = self._dist(obs)
        u = dist.mean if deterministic else dist.rsample()  # the draws sample() makes
        action = torch.tanh(u) * self.action_scale + self.action_bias
        return TensorDict({keys.ACTION: action, keys.LOG_PROB: self._log_prob_of(dist, action),
                           keys.VALUE: self.q(obs, action).min(-1).values},
                          batch_size=batch.batch_size)

    def evaluate_actions(self, batch: TensorDict) -> TensorDict:
        """The log-prob of the given (squashed) actions; ``entropy`` its one-sample estimate
        ``-log_prob``; ``value`` the smaller critic's Q(s, a)."""
        obs, action = batch[keys.OBS], batch[keys.ACTION]
        log_prob = self._log_prob_of(self._dist(obs), action)
        return TensorDict({keys.LOG_PROB: log_prob, keys.ENTROPY: -log_prob,
                           keys.VALUE: self.q(obs, action).min(-1).values},
                          batch_size=batch.batch_size)

    def _log_prob_of(self, dist: Normal, action: torch.Tensor) -> torch.Tensor:
        """The squashed Gaussian's log-prob (B,) of env-scaled actions (B, A)."""
        squashed = ((action - self.action_bias) / self.action_scale).clamp(-1 + TANH_EPS,
                                                                             1 - TANH_EPS)
        return (dist.log_prob(torch.atanh(squashed))
                - torch.log(self.action_scale * (1 - squashed.pow(2)) + TANH_EPS)).sum(-1)

    def value(self, obs: TensorDict) -> torch.Tensor:
        """The smaller critic's Q at the deterministic action."""
        action, _ = self.sample(obs, deterministic=True)
        return self.q(obs, action).min(-1).values


class SACCNNPolicy(SACPolicy):
    """``policy.name=sac_cnn`` (see the module docstring).

    >>> from m2flow.envs import EnvSpec
    >>> spec = EnvSpec({"rgb": (36, 36, 3), "state": (5,)}, 2, (-1.0, -1.0), (1.0, 1.0), 50)
    >>> cfg = SACCNNPolicyConfig(name="sac_cnn", hidden_sizes=[8], feature_dim=16)
    >>> pi = SACCNNPolicy(cfg, spec)
    >>> obs = TensorDict({"rgb": torch.zeros(3, 36, 36, 3, dtype=torch.uint8),
    ...                   "state": torch.zeros(3, 5)}, batch_size=[3])
    >>> action, log_prob = pi.sample(obs)
    >>> action.shape, log_prob.shape, pi.q(obs, action).shape
    (torch.Size([3, 2]), torch.Size([3]), torch.Size([3, 2]))
    >>> "critic.encoder.fc.0.weight" in pi.critic_parameter_names()
    True
    """

    config_class = SACCNNPolicyConfig

    @staticmethod
    def check_config(policy_cfg: SACCNNPolicyConfig, env_cfg) -> None:
        _check(policy_cfg)
        if env_cfg.obs_mode == "state":
            raise PolicyError("policy=sac_cnn reads ('obs','rgb') images, but env.obs_mode=state "
                              "renders none; use env.obs_mode=rgb or policy=sac_mlp.")

    def __init__(self, cfg: SACCNNPolicyConfig, env_spec):
        nn.Module.__init__(self)
        _check(cfg)
        shapes = env_spec.obs_shapes
        if "rgb" not in shapes or len(shapes["rgb"]) != 3:
            raise PolicyError("policy.name='sac_cnn' needs ('obs', 'rgb') images (H, W, C); this "
                              f"env gives {shapes}. Set env.obs_mode=rgb.")
        self.has_state = "state" in shapes and len(shapes["state"]) == 1
        state_dim = shapes["state"][0] if self.has_state else 0
        self.obs_norm = state_norm(state_dim, cfg, self.has_state)
        width = cfg.feature_dim
        if width < 1:
            raise PolicyError(f"policy.feature_dim={width}: must be >= 1.")
        n_in = width + state_dim
        self._build(cfg, env_spec, actor_in=n_in, critic=lambda: nn.ModuleDict({
            "encoder": NatureCNN(tuple(shapes["rgb"]), width),
            "heads": _heads(n_in + env_spec.action_dim, cfg)}))

    def _features(self, encoder: nn.Module, obs: TensorDict) -> torch.Tensor:
        x = encoder(obs[keys.leaf(keys.RGB)])  # (B, feature_dim)
        return torch.cat([x, self._state(obs)], dim=-1) if self.has_state else x

    def _actor_input(self, obs: TensorDict) -> torch.Tensor:
        with torch.no_grad():  # the critics' encoder, not trained by the actor
            return self._features(self.critic.encoder, obs)

    def _q(self, critic: nn.Module, obs: TensorDict, action: torch.Tensor) -> torch.Tensor:
        return _twin(critic.heads, self._features(critic.encoder, obs), action)

    def observe(self, batch: TensorDict) -> None:
        if isinstance(self.obs_norm, RunningNorm):
            self.obs_norm.update(batch[keys.STATE])


def _heads(n_in: int, cfg: SACPolicyConfig) -> nn.ModuleList:
    """The twin critics over (features, action): MLPs, with a LayerNorm after each hidden layer
    under ``policy.critic_layer_norm``."""
    hidden = list(cfg.hidden_sizes)
    if not cfg.critic_layer_norm:
        return nn.ModuleList([mlp(n_in, hidden, 1, cfg.activation, 1.0) for _ in range(2)])

    def normed() -> nn.Sequential:
        layers, width = [], n_in
        for h in hidden:
            layers += [orthogonal_linear(width, h), nn.LayerNorm(h), ACTIVATIONS[cfg.activation]()]
            width = h
        return nn.Sequential(*layers, orthogonal_linear(width, 1, 1.0))

    return nn.ModuleList([normed() for _ in range(2)])


def _twin(critics: nn.ModuleList, features: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    x = torch.cat([features, action], dim=-1)  # (B, D + A)
    return torch.cat([c(x) for c in critics], dim=-1)  # (B, 2)


def _check(cfg: SACPolicyConfig) -> None:
    """PolicyError for a config this policy cannot build."""
    if cfg.activation not in ACTIVATIONS:
        raise PolicyError(f"policy.activation={cfg.activation!r}: use one of "
                          f"{sorted(ACTIVATIONS)}.")
    if any(h < 1 for h in cfg.hidden_sizes):
        raise PolicyError(f"policy.hidden_sizes={list(cfg.hidden_sizes)}: every width must be "
                          ">= 1 (an empty list: linear heads).")
    if cfg.init_alpha <= 0:
        raise PolicyError(f"policy.init_alpha={cfg.init_alpha}: must be > 0.")
