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

``policy.kwargs``: ``init_alpha`` (1.0: alpha's starting value).
"""

from __future__ import annotations

import copy
import math

import torch
from tensordict import TensorDict
from torch import nn
from torch.distributions import Normal

from m2flow import keys
from m2flow.policies.base import Policy, PolicyError
from m2flow.policies.config import PolicyConfig
from m2flow.policies.layers import ACTIVATIONS, mlp
from m2flow.policies.normalizer import RunningNorm

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0  # cleanRL's range for the actor's log-std
TANH_EPS = 1e-6  # keeps log(1 - tanh(u)^2) finite at the bounds (cleanRL's)
KWARGS = ("init_alpha",)


class SACPolicy(Policy):
    """``policy.name=sac_mlp``.

    >>> from m2flow.envs import EnvSpec
    >>> spec = EnvSpec({"state": (5,)}, 2, (-1.0, -2.0), (1.0, 2.0), 50)
    >>> pi = SACPolicy(PolicyConfig(name="sac_mlp", hidden_sizes=[8], normalize_obs=False), spec)
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

    @staticmethod
    def check_config(policy_cfg: PolicyConfig, env_cfg) -> None:
        _check(policy_cfg)
        if env_cfg.obs_mode != "state":
            raise PolicyError(f"policy=sac_mlp reads only ('obs','state'); env.obs_mode="
                              f"{env_cfg.obs_mode}: use env.obs_mode=state.")

    def __init__(self, cfg: PolicyConfig, env_spec):
        super().__init__()
        _check(cfg)
        if "state" not in env_spec.obs_shapes or len(env_spec.obs_shapes["state"]) != 1:
            raise PolicyError("policy.name='sac_mlp' reads a flat ('obs', 'state') vector; this "
                              f"env gives {env_spec.obs_shapes}. Use env.obs_mode=state.")
        low = torch.tensor(env_spec.action_low, dtype=torch.float32)
        high = torch.tensor(env_spec.action_high, dtype=torch.float32)
        if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
            raise PolicyError("policy.name='sac_mlp' squashes actions into the env's bounds, and "
                              "this env's action space is unbounded; use policy=mlp.")
        obs_dim, act_dim, hidden = env_spec.obs_shapes["state"][0], env_spec.action_dim, \
            list(cfg.hidden_sizes)
        self.obs_norm = RunningNorm(obs_dim) if cfg.normalize_obs else nn.Identity()
        self.register_buffer("action_scale", (high - low) / 2)
        self.register_buffer("action_bias", (high + low) / 2)
        self.actor = mlp(obs_dim, hidden, 2 * act_dim, cfg.activation, 1.0)  # mean, log-std
        self.critic = nn.ModuleList(
            [mlp(obs_dim + act_dim, hidden, 1, cfg.activation, 1.0) for _ in range(2)])
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.temperature = nn.Module()
        self.temperature.log_alpha = nn.Parameter(
            torch.tensor(math.log(float(cfg.kwargs.get("init_alpha", 1.0)))))

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
        mean, log_std = self.actor(self._state(obs)).chunk(2, dim=-1)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(log_std) + 1)
        return Normal(mean, log_std.exp())

    def _state(self, obs: TensorDict) -> torch.Tensor:
        return self.obs_norm(obs[keys.leaf(keys.STATE)])

    def q(self, obs: TensorDict, action: torch.Tensor) -> torch.Tensor:
        """Both critics' Q(s, a) (B, 2)."""
        return _twin(self.critic, self._state(obs), action)

    def q_target(self, obs: TensorDict, action: torch.Tensor) -> torch.Tensor:
        """Both target critics' Q(s, a) (B, 2)."""
        return _twin(self.critic_target, self._state(obs), action)

    def observe(self, batch: TensorDict) -> None:
        """Running state statistics (``policy.normalize_obs``), from each update's new
        transitions; off by default (``sac_mlp.yaml``), as in SAC's references: moving
        statistics shift the inputs of every stored transition."""
        if isinstance(self.obs_norm, RunningNorm):
            self.obs_norm.update(batch[keys.STATE])

    # -- the Policy interface -----------------------------------------------------------------
    def act(self, batch: TensorDict, deterministic: bool = False) -> TensorDict:
        """Actions, their log-probs, and as ``value`` the smaller critic's Q of them."""
        obs = batch[keys.OBS]
        action, log_prob = self.sample(obs, deterministic)
        return TensorDict({keys.ACTION: action, keys.LOG_PROB: log_prob,
                           keys.VALUE: self.q(obs, action).min(-1).values},
                          batch_size=batch.batch_size)

    def evaluate_actions(self, batch: TensorDict) -> TensorDict:
        """The log-prob of the given (squashed) actions; ``entropy`` its one-sample estimate
        ``-log_prob``; ``value`` the smaller critic's Q(s, a)."""
        obs, action = batch[keys.OBS], batch[keys.ACTION]
        squashed = ((action - self.action_bias) / self.action_scale).clamp(-1 + TANH_EPS,
                                                                             1 - TANH_EPS)
        u = torch.atanh(squashed)
        log_prob = (self._dist(obs).log_prob(u)
                    - torch.log(self.action_scale * (1 - squashed.pow(2)) + TANH_EPS)).sum(-1)
        return TensorDict({keys.LOG_PROB: log_prob, keys.ENTROPY: -log_prob,
                           keys.VALUE: self.q(obs, action).min(-1).values},
                          batch_size=batch.batch_size)

    def value(self, obs: TensorDict) -> torch.Tensor:
        """The smaller critic's Q at the deterministic action."""
        action, _ = self.sample(obs, deterministic=True)
        return self.q(obs, action).min(-1).values


def _twin(critics: nn.ModuleList, state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    x = torch.cat([state, action], dim=-1)  # (B, D + A)
    return torch.cat([c(x) for c in critics], dim=-1)  # (B, 2)


def _check(cfg: PolicyConfig) -> None:
    """PolicyError for a config ``sac_mlp`` cannot build."""
    if cfg.activation not in ACTIVATIONS:
        raise PolicyError(f"policy.activation={cfg.activation!r}: use one of "
                          f"{sorted(ACTIVATIONS)}.")
    unknown = sorted(set(cfg.kwargs) - set(KWARGS))
    if unknown:
        raise PolicyError(f"policy.kwargs.{unknown[0]} is not an option of policy.name=sac_mlp; "
                          f"it takes {', '.join(KWARGS)}.")
    if float(cfg.kwargs.get("init_alpha", 1.0)) <= 0:
        raise PolicyError(f"policy.kwargs.init_alpha={cfg.kwargs['init_alpha']}: must be > 0.")
