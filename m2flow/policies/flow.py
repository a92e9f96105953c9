"""Flow-matching actor-critic over state (``policy.name=flow_mlp``), fine-tuned by RL through
its denoising chain (πRL's Flow-Noise and Flow-SDE; arXiv 2510.25889, RLinf's ``openpi``
action model).

The actor is a velocity network v(s, x, t): an MLP over the normalised state s, a noisy
action chunk x (H actions of A dims, flattened) and a sinusoidal embedding of the time t
(openpi's, periods 4e-3 to 4). An action chunk is denoised in K Euler steps on the grid
t_k = 1 - k/K: the chain c_0 ~ N(0, I) at t = 1, c_{k+1} = c_k - v(s, c_k, t_k)/K, and
c_K (t = 0) is the action. Evaluation (``deterministic``) runs the ODE from a c_0 drawn from a
generator seeded by the observation itself: openpi and RLinf draw c_0 from a shared generator
at inference, which makes an episode's actions depend on its batch; c_0 = 0 would not either,
but it scores another policy than theirs (``flow_chain.FlowChain._start``). The chain lives in normalised action units: each bounded dim's
[low, high] is mapped to [-1, 1]; the env action is c_K mapped back and clipped to the
bounds, and the stored chain (what log-probs are of) is never clipped. The critic is an MLP
over the normalised state (or, with ``policy.critic=privileged``,
:class:`~m2flow.policies.critics.PrivilegedCritic`).

Behaviour cloning (:meth:`FlowMLPPolicy.bc_loss`) is flow matching as openpi trains π0:
x_t = t·ε + (1 - t)·a, target u = ε - a, t = 0.001 + 0.999·Beta(1.5, 1), loss the mean
squared error of v(s, x_t, t) against u.

RL turns the sampler into a chain of Gaussian transitions c_{k+1} ~ N(μ_k, σ_k²)
(``policy.noise_method``), with v_k = v(s, c_k, t_k) and Δ = 1/K:

- ``flow_noise``: μ_k = c_k - Δ·v_k (the Euler step) and σ_k from a learned noise head on the
  velocity network's last hidden features, squashed into ``noise_std_range`` (log σ² =
  tanh(·) mapped linearly onto [log σ_min², log σ_max²], as RLinf's ExploreNoiseNet). Every
  step is stochastic; the log-prob is the chain's joint log-density
  Σ_k Σ_{h,a} log N(c_{k+1}; μ_k, σ_k²); the entropy the transitions' Gaussian entropies
  summed alike (``algorithm.ent_coef`` trains the noise head with it).
- ``flow_sde``: the ODE made an SDE with the same marginals. With the estimates
  â = x - t·v (the action) and ε̂ = x + (1 - t)·v (the noise) at (x, t), the score of p_t is
  -ε̂ / t, and the Euler–Maruyama step of the reverse-time SDE
  dx = [v - (σ_t²/2)·∇log p_t] dt + σ_t dW̄ from t to t - Δ is μ = x - Δ·v -
  σ_t²·Δ/(2t)·ε̂, std σ_t·√Δ, with σ_t = noise_level·√(t / (1 - t)) (at t = 1 the
  denominator is 1 - t_1, as RLinf does). One step per sample, drawn uniformly from the
  K (or from ``sde_steps``: [K-1] puts the noise on the action, where PPO's step moves
  the ODE's action nearly as it moves the sampled one's mean), is stochastic
  (``flow_step``), the others are the ODE's; the log-prob is that one transition's,
  Σ_{h,a} log N(c_{j+1}; μ_j, σ_j²·Δ). Its σ is fixed, so its entropy is
  reported as 0 (no entropy term).

The chain's code (sampling, log-probs, flow matching) is :mod:`m2flow.policies.flow_chain`,
which ``policy=pi0`` shares; this module adds the MLP velocity network and the critic.

The rollout stores the chain (``flow_chain``, (K+1, H, A)) and, for Flow-SDE, the step
(``flow_step``); :meth:`evaluate_actions` recomputes those transitions' log-probs with
gradients. It also returns ``token_log_prob`` (H·A,): each action dim's log-prob, so that
``algorithm.logprob_level=action`` (a ratio per action of the chunk) or ``token`` (per dim,
as RLinf's ``logprob_type: token_level``) work; ``chunk`` (the default) takes their sum.

RLinf's defaults taken (``rlinf/models/embodiment/openpi/openpi_action_model.py``,
``examples/embodiment/config/model/pi0.yaml``, the πRL docs ``pi0.rst``): ``noise_method``
flow_sde, ``noise_level`` 0.5, ``noise_std_range`` [0.08, 0.16] (RLinf's
``noise_logvar_range``, which holds stds), the noise head's hidden sizes [128, 64] with tanh,
``denoise_steps`` K = 4 (``num_steps`` of model/pi0.yaml; OpenPi0Config's own default is 10).
RLinf normalises Flow-Noise's joint log-prob differently (``joint_logprob: true``): it adds
c_0's log N(0, I) term and averages over those K + 1 terms, per action dim;
``policy.logprob_reduce=mean`` does the same here, ``sum`` (the default) is the joint
density itself. RLinf's Flow-SDE draws one step for the whole batch, here each sample draws
its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from tensordict import TensorDict
from torch import nn

from m2flow import keys
from m2flow.policies import critics, flow_chain, hidden_state, task_embedding
from m2flow.policies.base import Policy, PolicyError
from m2flow.policies.config import MLPHeadsConfig
from m2flow.policies.flow_chain import (  # noqa: F401  (the maths, also importable from here)
    FlowChain, FlowChainSettings, sample_time, sde_sigma, sde_step, time_embedding, time_grid)
from m2flow.policies.layers import (
    ACTIVATIONS, ACTOR_OUT_GAIN, CRITIC_OUT_GAIN, mlp, orthogonal_linear)
from m2flow.policies.mlp import HIDE_FIELD, PRIVILEGED_CRITIC, check_critic
from m2flow.policies.normalizer import RunningNorm, state_norm


@dataclass
class FlowMLPConfig(MLPHeadsConfig, FlowChainSettings):
    """``policy.name=flow_mlp``: a flow-matching actor over state and an MLP critic."""

    activation: str = "gelu"
    """Hidden activation of the velocity network and the critic: tanh | relu | gelu | elu."""
    time_embed_dim: int = 32
    """Width of the sinusoidal time embedding (even)."""
    critic: str = "shared"
    """'shared': an MLP over the normalised state; 'privileged': an MLP over
    ``("obs", "privileged")`` (``env.privileged_state=true``)."""
    actor_hidden_state: Optional[List[List[int]]] = None
    """[start, end) ranges of the state's dims the velocity network reads as their running
    mean (0 after normalisation); the critic reads them all ([[9, 18]]: ManiSkill Panda's
    joint velocities). None: it reads the whole state."""
    task_embedding: int = task_embedding.WIDTH
    """Width of a learned embedding of ``("obs", "task")`` after the state, for the velocity
    network and the critic, when the env runs 2 or more tasks
    (``m2flow.policies.task_embedding``); 0: none. One-task envs get none."""


class FlowMLPPolicy(FlowChain, Policy):
    """``policy.name=flow_mlp``.

    >>> from m2flow.envs import EnvSpec
    >>> spec = EnvSpec({"state": (5,)}, 2, (-1.0, -1.0), (1.0, 1.0), 50)
    >>> pi = FlowMLPPolicy(FlowMLPConfig(name="flow_mlp", hidden_sizes=[8], chunk=3), spec)
    >>> obs = TensorDict({"state": torch.zeros(4, 5)}, batch_size=[4])
    >>> out = pi.act(TensorDict({"obs": obs}, batch_size=[4]))
    >>> out["action"].shape, out["flow_chain"].shape, out["flow_step"].shape
    (torch.Size([4, 3, 2]), torch.Size([4, 5, 3, 2]), torch.Size([4]))
    """

    config_class = FlowMLPConfig

    @staticmethod
    def check_config(cfg: FlowMLPConfig, env_cfg=None) -> None:
        """PolicyError naming the field for settings that cannot work; builds nothing."""
        if cfg.activation not in ACTIVATIONS:
            raise PolicyError(f"policy.activation={cfg.activation!r}: use one of "
                              f"{sorted(ACTIVATIONS)}.")
        if any(h < 1 for h in [*cfg.hidden_sizes, *cfg.noise_hidden_sizes]):
            raise PolicyError("policy.hidden_sizes and policy.noise_hidden_sizes: every width "
                              "must be >= 1.")
        flow_chain.check_settings(cfg)
        if cfg.time_embed_dim < 2 or cfg.time_embed_dim % 2:
            raise PolicyError(f"policy.time_embed_dim={cfg.time_embed_dim}: must be even and "
                              ">= 2 (sin and cos of each frequency).")
        check_critic(cfg.critic)
        task_embedding.check(cfg.task_embedding)
        if cfg.critic == PRIVILEGED_CRITIC and env_cfg is not None:
            critics.check_env(env_cfg, "policy.critic=privileged", "use policy.critic=shared")
        hidden_state.ranges(cfg.actor_hidden_state, None, HIDE_FIELD)
        if env_cfg is not None and env_cfg.obs_mode != "state":
            raise PolicyError(f"policy=flow_mlp reads only ('obs','state'); env.obs_mode="
                              f"{env_cfg.obs_mode} renders images it would ignore; use "
                              "env.obs_mode=state.")

    def __init__(self, cfg: FlowMLPConfig, env_spec):
        super().__init__()
        self.check_config(cfg)
        shapes = env_spec.obs_shapes
        if "state" not in shapes or len(shapes["state"]) != 1:
            raise PolicyError("policy.name='flow_mlp' reads a flat ('obs', 'state') vector; "
                              f"this env gives {shapes}. Use env.obs_mode=state.")
        obs_dim, act_dim = shapes["state"][0], env_spec.action_dim
        self.cfg = cfg
        self.task_emb = task_embedding.build(cfg.task_embedding, env_spec)
        n_state = obs_dim + task_embedding.width(self.task_emb)  # [state, E[task]]
        n_act = cfg.chunk * act_dim
        width = n_state + n_act + cfg.time_embed_dim
        layers = []
        for h in cfg.hidden_sizes:
            layers += [orthogonal_linear(width, h), ACTIVATIONS[cfg.activation]()]
            width = h
        self.trunk = nn.Sequential(*layers)  # (N, width): the features the heads read
        self.velocity_head = orthogonal_linear(width, n_act, ACTOR_OUT_GAIN)
        self._init_chain(cfg, env_spec, width)
        self.obs_norm = state_norm(obs_dim, cfg)
        self.privileged_critic = cfg.critic == PRIVILEGED_CRITIC
        if self.privileged_critic:
            self.critic = critics.privileged_critic(env_spec, cfg.hidden_sizes, cfg.activation)
        else:
            self.critic = mlp(n_state, list(cfg.hidden_sizes), 1, cfg.activation,
                              CRITIC_OUT_GAIN)
        hidden = hidden_state.ranges(cfg.actor_hidden_state, obs_dim, HIDE_FIELD)
        self.register_buffer("actor_sees", hidden_state.sees(hidden, n_state), persistent=False)

    # -- networks -------------------------------------------------------------------------

    def _state(self, obs: TensorDict) -> torch.Tensor:
        """The normalised state (B, D), with the task's embedding after it on a multi-task
        env (B, D + ``task_embedding``)."""
        state = self.obs_norm(obs[keys.leaf(keys.STATE)].float())
        return task_embedding.append(self.task_emb, state, obs)

    def _velocity(self, s: torch.Tensor, x: torch.Tensor,
                  t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(v (N, H, A), features (N, W)) at states s (N, D), chunks x (N, H, A), times (N,)."""
        if self.actor_sees is not None:
            s = s * self.actor_sees
        inp = torch.cat([s, x.flatten(1), time_embedding(t, self.cfg.time_embed_dim)], -1)
        features = self.trunk(inp)
        return self.velocity_head(features).view_as(x), features

    # -- acting and learning (the chain: :class:`~m2flow.policies.flow_chain.FlowChain`) ------

    def act(self, batch: TensorDict, deterministic: bool = False) -> TensorDict:
        """``action`` (B, H, A) in the env's units (B, A for H = 1), clipped to its bounds;
        ``flow_chain`` (B, K+1, H, A), ``flow_step`` (B,) for Flow-SDE; ``log_prob``,
        ``token_log_prob`` (B, H·A) and ``value``. ``deterministic``: the ODE's chain from a
        c_0 seeded by the observation (log-probs 0), a function of the observation alone."""
        obs = batch[keys.OBS]
        s = self._state(obs)
        out = self._act_outputs(s, s.shape[0], s.device, deterministic, obs)
        out[keys.VALUE] = self.value(obs)
        return TensorDict(out, batch_size=batch.batch_size)

    def evaluate_actions(self, batch: TensorDict) -> TensorDict:
        """Log-probs (with gradients) of the stored chain's transitions: every one for
        Flow-Noise, ``flow_step``'s for Flow-SDE; ``entropy``: Flow-Noise's transitions'
        (Flow-SDE: 0, its σ is fixed)."""
        obs = batch[keys.OBS]
        out = self._chain_log_probs(self._state(obs), batch)
        out[keys.VALUE] = self.value(obs)
        return TensorDict(out, batch_size=batch.batch_size)

    def bc_loss(self, batch: TensorDict, eps: Optional[torch.Tensor] = None,
                t: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Flow matching on expert chunks ``action`` (B, H, A) (or (B, A) for H = 1), env
        units: per sample, the mean over the chunk of (v(s, x_t, t) - (ε - a))², a in
        normalised action units. ``eps`` (B, H, A) and ``t`` (B,): drawn when None, ε ~ N(0, I)
        and t = 0.001 + 0.999·Beta(1.5, 1)."""
        s = self._state(batch[keys.OBS])
        return self._flow_matching_loss(s, batch[keys.ACTION], eps, t)

    def value(self, obs: TensorDict) -> torch.Tensor:
        if self.privileged_critic:
            return self.critic(obs)
        return self.critic(self._state(obs)).squeeze(-1)

    def observe(self, batch: TensorDict) -> None:
        if isinstance(self.obs_norm, RunningNorm):
            self.obs_norm.update(batch[keys.STATE])
        if self.privileged_critic:
            self.critic.observe(batch)
