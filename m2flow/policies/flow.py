"""Flow-matching actor-critic over state (``policy.name=flow_mlp``), fine-tuned by RL through
its denoising chain (πRL's Flow-Noise and Flow-SDE; arXiv 2510.25889, RLinf's ``openpi``
action model).

The actor is a velocity network v(s, x, t): an MLP over the normalised state s, a noisy
action chunk x (H actions of A dims, flattened) and a sinusoidal embedding of the time t
(openpi's, periods 4e-3 to 4). An action chunk is denoised in K Euler steps on the grid
t_k = 1 - k/K: the chain c_0 ~ N(0, I) at t = 1, c_{k+1} = c_k - v(s, c_k, t_k)/K, and
c_K (t = 0) is the action. The chain lives in normalised action units: each bounded dim's
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
  K, is stochastic (``flow_step``), the others are the ODE's; the log-prob is that one
  transition's, Σ_{h,a} log N(c_{j+1}; μ_j, σ_j²·Δ). Its σ is fixed, so its entropy is
  reported as 0 (no entropy term).

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

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from tensordict import TensorDict
from torch import nn

from m2flow import keys
from m2flow.policies import critics, hidden_state
from m2flow.policies.base import Policy, PolicyError
from m2flow.policies.config import MLPHeadsConfig
from m2flow.policies.layers import (
    ACTIVATIONS, ACTOR_OUT_GAIN, CRITIC_OUT_GAIN, mlp, orthogonal_linear)
from m2flow.policies.mlp import HIDE_FIELD, PRIVILEGED_CRITIC, check_critic
from m2flow.policies.normalizer import RunningNorm

FLOW_NOISE, FLOW_SDE = "flow_noise", "flow_sde"
NOISE_METHODS = (FLOW_SDE, FLOW_NOISE)
LOGPROB_REDUCES = ("sum", "mean")
TIME_PERIODS = (4e-3, 4.0)  # openpi's sinusoidal time embedding: shortest, longest period
TIME_ALPHA = 1.5  # openpi's flow-matching times: Beta(1.5, 1), biased to the noise end
TIME_MIN = 0.001  # ... squeezed into [0.001, 1] (t = TIME_MIN + (1 - TIME_MIN) * beta)
NOISE_ACTIVATION = "tanh"  # RLinf's ExploreNoiseNet
LOG_2PI = math.log(2 * math.pi)


@dataclass
class FlowMLPConfig(MLPHeadsConfig):
    """``policy.name=flow_mlp``: a flow-matching actor over state and an MLP critic."""

    activation: str = "gelu"
    """Hidden activation of the velocity network and the critic: tanh | relu | gelu | elu."""
    chunk: int = 4
    """H: actions per policy call (env steps of one chunk)."""
    denoise_steps: int = 4
    """K: Euler steps from t=1 to t=0 (RLinf's ``num_steps`` for π0)."""
    time_embed_dim: int = 32
    """Width of the sinusoidal time embedding (even)."""
    noise_method: str = FLOW_SDE
    """flow_sde | flow_noise: how the chain becomes stochastic for RL (RLinf's default:
    flow_sde)."""
    noise_level: float = 0.5
    """flow_sde: a in σ_t = a·√(t/(1-t)) (RLinf's default 0.5)."""
    noise_std_range: List[float] = field(default_factory=lambda: [0.08, 0.16])
    """flow_noise: [min, max] of the learned noise std (RLinf's noise_logvar_range)."""
    noise_hidden_sizes: List[int] = field(default_factory=lambda: [128, 64])
    """flow_noise: hidden widths of the noise head (RLinf's ExploreNoiseNet)."""
    logprob_reduce: str = "sum"
    """flow_noise: 'sum', the chain's joint log-density; 'mean', RLinf's joint_logprob: c_0's
    N(0, I) term and the K transitions' averaged (per action dim). flow_sde: 'sum'."""
    critic: str = "shared"
    """'shared': an MLP over the normalised state; 'privileged': an MLP over
    ``("obs", "privileged")`` (``env.privileged_state=true``)."""
    actor_hidden_state: Optional[List[List[int]]] = None
    """[start, end) ranges of the state's dims the velocity network reads as their running
    mean (0 after normalisation); the critic reads them all ([[9, 18]]: ManiSkill Panda's
    joint velocities). None: it reads the whole state."""


# -- the maths, as pure functions (tests/policies/test_flow.py checks them by hand) ----------


def time_grid(k: int, device=None) -> torch.Tensor:
    """The K + 1 times of the Euler chain, from 1 (noise) to 0 (action).

    >>> time_grid(4).tolist()
    [1.0, 0.75, 0.5, 0.25, 0.0]
    """
    return torch.linspace(1.0, 0.0, k + 1, device=device)


def time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features (N, dim) of times t (N,): sin and cos of 2π·t/period for dim/2
    periods spaced geometrically over TIME_PERIODS (openpi's embedding of the flow time)."""
    lo, hi = TIME_PERIODS
    frac = torch.linspace(0.0, 1.0, dim // 2, device=t.device, dtype=torch.float64)
    freq = (2 * math.pi / (lo * (hi / lo) ** frac)).to(t.dtype)
    angle = t[:, None] * freq[None]  # (N, dim/2)
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


def sample_time(n: int, generator: Optional[torch.Generator] = None,
                device=None) -> torch.Tensor:
    """n flow-matching times TIME_MIN + (1 - TIME_MIN)·Beta(TIME_ALPHA, 1) (openpi's), drawn
    as U^(1/α) (the law of Beta(α, 1)) so that a generator seeds them."""
    beta = torch.rand(n, generator=generator).pow(1.0 / TIME_ALPHA).to(device)
    return TIME_MIN + (1.0 - TIME_MIN) * beta


def flow_matching_pair(action: torch.Tensor, eps: torch.Tensor,
                       t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, u): the noisy chunk t·ε + (1 - t)·a and the velocity target ε - a, for chunks
    (N, H, A) and times (N,)."""
    tt = t[:, None, None]
    return tt * eps + (1.0 - tt) * action, eps - action


def sde_sigma(t: torch.Tensor, noise_level: float, t_next_to_one: float) -> torch.Tensor:
    """σ_t = noise_level·√(t / (1 - t)), with 1 - ``t_next_to_one`` (the grid's second time)
    as the denominator at t = 1, where the formula is infinite (RLinf's rule).

    >>> sde_sigma(time_grid(4)[:-1], 0.5, 0.75).tolist()  # doctest: +ELLIPSIS
    [1.0, 0.866..., 0.5, 0.288...]
    """
    denom = 1.0 - torch.where(t >= 1.0, torch.full_like(t, t_next_to_one), t)
    return noise_level * torch.sqrt(t / denom)


def sde_step(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, dt: float,
             sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the Euler–Maruyama step from t to t - dt of the reverse SDE whose
    marginals are the flow's: mean = x - dt·v - σ²·dt/(2t)·(x + (1-t)·v), std = σ·√dt.
    ``t`` and ``sigma`` broadcast against x (N, H, A)."""
    noise_hat = x + (1.0 - t) * v  # E[ε | x_t]: the score is -noise_hat / t
    mean = x - dt * v - sigma ** 2 * dt / (2.0 * t) * noise_hat
    return mean, sigma * math.sqrt(dt) * torch.ones_like(mean)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Elementwise log N(x; mean, std²)."""
    return -0.5 * ((x - mean) / std) ** 2 - std.log() - 0.5 * LOG_2PI


def gaussian_entropy(std: torch.Tensor) -> torch.Tensor:
    """Elementwise entropy of N(·, std²): ½·log(2πe·std²)."""
    return 0.5 * (LOG_2PI + 1.0) + std.log()


# -- the policy ---------------------------------------------------------------------------


class NoiseHead(nn.Module):
    """Flow-Noise's learned std: an MLP of the velocity network's features whose output,
    squashed by tanh, is the log-variance's position in [log σ_min², log σ_max²]."""

    def __init__(self, n_in: int, hidden: list[int], n_out: int, std_range: list[float]):
        super().__init__()
        self.net = mlp(n_in, list(hidden), n_out, NOISE_ACTIVATION, ACTOR_OUT_GAIN)
        lo, hi = (2.0 * math.log(s) for s in std_range)
        self.log_var_range = (lo, hi)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        lo, hi = self.log_var_range
        log_var = lo + (hi - lo) * (torch.tanh(self.net(features)) + 1.0) / 2.0
        return torch.exp(0.5 * log_var)


class FlowMLPPolicy(Policy):
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
        for name in ("chunk", "denoise_steps"):
            if getattr(cfg, name) < 1:
                raise PolicyError(f"policy.{name}={getattr(cfg, name)}: must be >= 1.")
        if cfg.time_embed_dim < 2 or cfg.time_embed_dim % 2:
            raise PolicyError(f"policy.time_embed_dim={cfg.time_embed_dim}: must be even and "
                              ">= 2 (sin and cos of each frequency).")
        if cfg.noise_method not in NOISE_METHODS:
            raise PolicyError(f"policy.noise_method={cfg.noise_method!r}: use one of "
                              f"{', '.join(NOISE_METHODS)}.")
        if not cfg.noise_level > 0:
            raise PolicyError(f"policy.noise_level={cfg.noise_level}: must be > 0 (RLinf: 0.5).")
        lo_hi = list(cfg.noise_std_range)
        if len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1]:
            raise PolicyError(f"policy.noise_std_range={lo_hi}: [min, max] with "
                              "0 < min <= max (RLinf: [0.08, 0.16]).")
        if cfg.logprob_reduce not in LOGPROB_REDUCES:
            raise PolicyError(f"policy.logprob_reduce={cfg.logprob_reduce!r}: use one of "
                              f"{', '.join(LOGPROB_REDUCES)}.")
        if cfg.logprob_reduce == "mean" and cfg.noise_method == FLOW_SDE:
            raise PolicyError("policy.logprob_reduce='mean' averages Flow-Noise's chain; "
                              "flow_sde scores one transition: use 'sum'.")
        check_critic(cfg.critic)
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
        self.chunk, self.steps, self.action_dim = cfg.chunk, cfg.denoise_steps, act_dim
        self.method = cfg.noise_method
        n_act = cfg.chunk * act_dim
        width = obs_dim + n_act + cfg.time_embed_dim
        layers = []
        for h in cfg.hidden_sizes:
            layers += [orthogonal_linear(width, h), ACTIVATIONS[cfg.activation]()]
            width = h
        self.trunk = nn.Sequential(*layers)  # (N, width): the features the heads read
        self.velocity_head = orthogonal_linear(width, n_act, ACTOR_OUT_GAIN)
        if self.method == FLOW_NOISE:
            self.noise_head = NoiseHead(width, cfg.noise_hidden_sizes, n_act,
                                        list(cfg.noise_std_range))
        self.obs_norm = RunningNorm(obs_dim) if cfg.normalize_obs else nn.Identity()
        self.privileged_critic = cfg.critic == PRIVILEGED_CRITIC
        if self.privileged_critic:
            n_priv = critics.privileged_dim(shapes, "policy.critic=privileged")
            self.critic = critics.PrivilegedCritic(n_priv, cfg.hidden_sizes, cfg.activation)
        else:
            self.critic = mlp(obs_dim, list(cfg.hidden_sizes), 1, cfg.activation,
                              CRITIC_OUT_GAIN)
        hidden = hidden_state.ranges(cfg.actor_hidden_state, obs_dim, HIDE_FIELD)
        self.register_buffer("actor_sees", hidden_state.sees(hidden, obs_dim), persistent=False)
        self._register_action_scale(env_spec)
        self.register_buffer("times", time_grid(self.steps), persistent=False)

    def _register_action_scale(self, env_spec) -> None:
        """Constants (not weights): the chain's unit per dim, [low, high] -> [-1, 1] where
        both bounds are finite (else the env's own unit)."""
        low = torch.tensor(env_spec.action_low, dtype=torch.float32)
        high = torch.tensor(env_spec.action_high, dtype=torch.float32)
        bounded = torch.isfinite(low) & torch.isfinite(high) & (high > low)
        center = torch.where(bounded, (low + high) / 2, torch.zeros_like(low))
        half = torch.where(bounded, (high - low) / 2, torch.ones_like(low))
        for name, value in (("action_low", low), ("action_high", high),
                            ("action_center", center), ("action_half", half)):
            self.register_buffer(name, value, persistent=False)

    # -- networks -------------------------------------------------------------------------

    def _state(self, obs: TensorDict) -> torch.Tensor:
        """The normalised state (B, D)."""
        return self.obs_norm(obs[keys.leaf(keys.STATE)].float())

    def _velocity(self, s: torch.Tensor, x: torch.Tensor,
                  t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(v (N, H, A), features (N, W)) at states s (N, D), chunks x (N, H, A), times (N,)."""
        if self.actor_sees is not None:
            s = s * self.actor_sees
        inp = torch.cat([s, x.flatten(1), time_embedding(t, self.cfg.time_embed_dim)], -1)
        features = self.trunk(inp)
        return self.velocity_head(features).view_as(x), features

    def _transition(self, s: torch.Tensor, x: torch.Tensor, k: torch.Tensor,
                    method: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of chain[k+1] given chain[k] = x (N, H, A) at grid steps k (N,):
        Flow-Noise's or Flow-SDE's Gaussian."""
        t = self.times[k]
        v, features = self._velocity(s, x, t)
        if method == FLOW_SDE:
            return self._sde(x, v, t)
        return x - v / self.steps, self.noise_head(features).view_as(x)

    def _sde(self, x: torch.Tensor, v: torch.Tensor,
             t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tt = t[:, None, None]
        sigma = sde_sigma(tt, self.cfg.noise_level, 1.0 - 1.0 / self.steps)
        return sde_step(x, v, tt, 1.0 / self.steps, sigma)

    # -- acting -----------------------------------------------------------------------------

    def _chain(self, s: torch.Tensor, deterministic: bool):
        """Samples a chain (B, K+1, H, A) for states s (B, D); returns it, the elementwise
        log-probs of its scored transitions (B, n, H, A) (None if ``deterministic``: the
        ODE's chain) and Flow-SDE's stochastic step (B,) (else None)."""
        b, k_steps = s.shape[0], self.steps
        x = torch.randn(b, self.chunk, self.action_dim, device=s.device)
        chain, log_probs = [x], []
        sde = self.method == FLOW_SDE and not deterministic
        step = torch.randint(k_steps, (b,), device=s.device) if sde else None
        for k in range(k_steps):
            ks = torch.full((b,), k, device=s.device, dtype=torch.long)
            if self.method == FLOW_NOISE and not deterministic:  # every step stochastic
                mean, std = self._transition(s, x, ks, FLOW_NOISE)
                x = mean + std * torch.randn_like(mean)
                log_probs.append(gaussian_log_prob(x, mean, std))
            else:
                v, _ = self._velocity(s, x, self.times[ks])
                ode = x - v / k_steps  # the Euler step
                x = ode
                if sde:  # one stochastic step per sample, the ODE's elsewhere
                    mean, std = self._sde(chain[-1], v, self.times[ks])
                    here = (step == k)[:, None, None]
                    x = torch.where(here, mean + std * torch.randn_like(mean), ode)
                    log_probs.append(torch.where(here, gaussian_log_prob(x, mean, std), 0.0))
            chain.append(x)
        if sde:  # the one stochastic step's terms (the others' are 0)
            log_probs = [torch.stack(log_probs, 1).sum(1)]
        return torch.stack(chain, 1), (torch.stack(log_probs, 1) if log_probs else None), step

    def act(self, batch: TensorDict, deterministic: bool = False) -> TensorDict:
        """``action`` (B, H, A) in the env's units (B, A for H = 1), clipped to its bounds;
        ``flow_chain`` (B, K+1, H, A), ``flow_step`` (B,) for Flow-SDE; ``log_prob``,
        ``token_log_prob`` (B, H·A) and ``value``. ``deterministic``: the ODE's chain
        (no noise; log-probs 0)."""
        obs = batch[keys.OBS]
        s = self._state(obs)
        chain, log_probs, step = self._chain(s, deterministic)
        b = s.shape[0]
        if log_probs is None:
            per_dim = torch.zeros(b, self.chunk, self.action_dim, device=s.device)
        else:
            per_dim = self._reduce(log_probs, chain[:, 0], first_is="log_prob")
        out = {
            keys.ACTION: self._env_action(chain[:, -1]),
            keys.LOG_PROB: per_dim.sum((1, 2)),
            keys.TOKEN_LOG_PROB: per_dim.flatten(1),
            keys.VALUE: self.value(obs),
            keys.FLOW_CHAIN: chain,
        }
        if self.method == FLOW_SDE:
            out[keys.FLOW_STEP] = step if step is not None else torch.zeros(
                b, dtype=torch.long, device=s.device)
        return TensorDict(out, batch_size=batch.batch_size)

    def _env_action(self, x: torch.Tensor) -> torch.Tensor:
        """The chain's last sample (B, H, A) in env units, clipped to the bounds."""
        a = x * self.action_half + self.action_center
        a = torch.maximum(torch.minimum(a, self.action_high), self.action_low)
        return a[:, 0] if self.chunk == 1 else a

    def _reduce(self, per_step: torch.Tensor, x0: torch.Tensor, first_is: str) -> torch.Tensor:
        """(B, n, H, A) per-transition terms -> (B, H, A): summed over the transitions, or
        (``logprob_reduce=mean``) averaged with c_0's N(0, I) term (``first_is``: 'log_prob'
        or 'entropy' of it), as RLinf's joint_logprob."""
        if self.cfg.logprob_reduce == "sum":
            return per_step.sum(1)
        one = torch.ones_like(x0)
        first = (gaussian_log_prob(x0, torch.zeros_like(x0), one) if first_is == "log_prob"
                 else gaussian_entropy(one))
        return (first + per_step.sum(1)) / (per_step.shape[1] + 1)

    # -- learning ---------------------------------------------------------------------------

    def evaluate_actions(self, batch: TensorDict) -> TensorDict:
        """Log-probs (with gradients) of the stored chain's transitions: every one for
        Flow-Noise, ``flow_step``'s for Flow-SDE; ``entropy``: Flow-Noise's transitions'
        (Flow-SDE: 0, its σ is fixed)."""
        obs = batch[keys.OBS]
        s = self._state(obs)
        chain = batch[keys.FLOW_CHAIN]  # (B, K+1, H, A)
        b, k_steps = chain.shape[0], self.steps
        if self.method == FLOW_NOISE:
            x = chain[:, :-1].reshape(b * k_steps, self.chunk, self.action_dim)  # (B*K, H, A)
            ks = torch.arange(k_steps, device=s.device).repeat(b)
            mean, std = self._transition(s.repeat_interleave(k_steps, 0), x, ks, FLOW_NOISE)
            shape = (b, k_steps, self.chunk, self.action_dim)
            lp = gaussian_log_prob(chain[:, 1:], mean.view(shape), std.view(shape))
            per_dim = self._reduce(lp, chain[:, 0], "log_prob")
            entropy = self._reduce(gaussian_entropy(std.view(shape)), chain[:, 0], "entropy")
            entropy = entropy.sum((1, 2))
        else:
            k = batch[keys.FLOW_STEP].long()
            rows = torch.arange(b, device=s.device)
            mean, std = self._transition(s, chain[rows, k], k, FLOW_SDE)
            per_dim = gaussian_log_prob(chain[rows, k + 1], mean, std)
            entropy = torch.zeros(b, device=s.device)
        return TensorDict({
            keys.LOG_PROB: per_dim.sum((1, 2)),
            keys.TOKEN_LOG_PROB: per_dim.flatten(1),
            keys.ENTROPY: entropy,
            keys.VALUE: self.value(obs),
        }, batch_size=batch.batch_size)

    def bc_loss(self, batch: TensorDict, eps: Optional[torch.Tensor] = None,
                t: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Flow matching on expert chunks ``action`` (B, H, A) (or (B, A) for H = 1), env
        units: per sample, the mean over the chunk of (v(s, x_t, t) - (ε - a))², a in
        normalised action units. ``eps`` (B, H, A) and ``t`` (B,): drawn when None, ε ~ N(0, I)
        and t = 0.001 + 0.999·Beta(1.5, 1)."""
        s = self._state(batch[keys.OBS])
        a = batch[keys.ACTION].reshape(s.shape[0], self.chunk, self.action_dim)
        a = (a - self.action_center) / self.action_half
        eps = torch.randn_like(a) if eps is None else eps
        t = sample_time(a.shape[0], device=a.device) if t is None else t
        x_t, target = flow_matching_pair(a, eps, t)
        v, _ = self._velocity(s, x_t, t)
        return ((v - target) ** 2).mean((1, 2))

    def value(self, obs: TensorDict) -> torch.Tensor:
        if self.privileged_critic:
            return self.critic(obs)
        return self.critic(self._state(obs)).squeeze(-1)

    def observe(self, batch: TensorDict) -> None:
        if isinstance(self.obs_norm, RunningNorm):
            self.obs_norm.update(batch[keys.STATE])
        if self.privileged_critic:
            self.critic.observe(batch)
