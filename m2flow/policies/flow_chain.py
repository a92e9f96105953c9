"""The denoising chain every flow-matching policy shares (``flow_mlp``, ``pi0``): openpi's flow
matching for behaviour cloning, the Euler sampler, and the chain made stochastic for RL
(πRL's Flow-Noise and Flow-SDE, arXiv 2510.25889) with the log-probs of its transitions.

A policy provides the velocity v(ctx, x, t) (:meth:`FlowChain._velocity`) of a noisy chunk x
(N, H, A) at times t (N,) given a per-sample context ``ctx`` (the normalised state of an MLP,
a VLA's cached prefix); :class:`FlowChain` does the rest:

- the chain: K Euler steps on the grid t_k = 1 - k/K, c_0 ~ N(0, I) at t = 1,
  c_{k+1} = c_k - v(ctx, c_k, t_k)/K; c_K (t = 0) is the action, in normalised units (each
  bounded dim's [low, high] -> [-1, 1]), mapped back and clipped for the env;
- ``deterministic`` (evaluation): the ODE's chain from a c_0 ~ N(0, I) drawn from a generator
  seeded by the row's own observation (:func:`observation_seeds`), so that an episode's actions
  do not depend on its batch or on the global generator, yet c_0 is a draw of the noise the
  policy was trained from (:meth:`FlowChain._start` says why not c_0 = 0); sampled chains
  (training) draw c_0 and the stochastic steps from torch's global generator, which the run
  seeds;
- ``flow_noise``: every step c_{k+1} ~ N(c_k - v_k/K, σ_k²), σ_k from a learned noise head on
  the velocity's features (:class:`NoiseHead`), the log-prob the chain's joint density;
- ``flow_sde``: one step per sample (``flow_step``) is the Euler–Maruyama step of the
  reverse-time SDE with the flow's marginals (:func:`sde_step`), the others the ODE's; the
  log-prob that transition's;
- the learner's log-probs of a stored chain (``flow_chain``) with gradients, and the flow
  matching loss x_t = t·ε + (1 - t)·a, target u = ε - a, t = 0.001 + 0.999·Beta(1.5, 1).

The maths is documented in :mod:`m2flow.policies.flow` (the first policy to use it).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from torch import nn

from m2flow import keys
from m2flow.policies.base import PolicyError
from m2flow.policies.layers import ACTOR_OUT_GAIN, mlp

FLOW_NOISE, FLOW_SDE = "flow_noise", "flow_sde"
NOISE_METHODS = (FLOW_SDE, FLOW_NOISE)
LOGPROB_REDUCES = ("sum", "mean")
TIME_PERIODS = (4e-3, 4.0)  # openpi's sinusoidal time embedding: shortest, longest period
TIME_ALPHA = 1.5  # openpi's flow-matching times: Beta(1.5, 1), biased to the noise end
TIME_MIN = 0.001  # ... squeezed into [0.001, 1] (t = TIME_MIN + (1 - TIME_MIN) * beta)
NOISE_ACTIVATION = "tanh"  # RLinf's ExploreNoiseNet
LOG_2PI = math.log(2 * math.pi)
# not part of the noise's seed: what an actor never reads (the simulator's state), and the task
# index, so that a policy that ignores the task (policy.task_embedding=0) acts alike on each
UNSEEDED = (keys.PRIVILEGED, keys.TASK)


@dataclass
class FlowChainSettings:
    """The chain's settings, shared by the flow-matching policies' configs."""

    chunk: int = 4
    """H: actions per policy call (env steps of one chunk)."""
    denoise_steps: int = 4
    """K: Euler steps from t=1 to t=0 (RLinf's ``num_steps`` for π0)."""
    noise_method: str = FLOW_SDE
    """flow_sde | flow_noise: how the chain becomes stochastic for RL (RLinf's default:
    flow_sde)."""
    noise_level: float = 0.5
    """flow_sde: a in σ_t = a·√(t/(1-t)) (RLinf's default 0.5)."""
    sde_steps: Optional[List[int]] = None
    """flow_sde: the denoising steps (0 = from t=1, ..., K-1 = the one that lands on the
    action) the stochastic one is drawn from, uniformly; None: all K (RLinf's default;
    its ``ignore_last`` is [0, ..., K-2]). Noise put in early is mostly undone by the ODE
    steps after it; [K-1] puts it on the action itself, as a Gaussian policy's."""
    noise_std_range: List[float] = field(default_factory=lambda: [0.08, 0.16])
    """flow_noise: [min, max] of the learned noise std (RLinf's noise_logvar_range)."""
    noise_hidden_sizes: List[int] = field(default_factory=lambda: [128, 64])
    """flow_noise: hidden widths of the noise head (RLinf's ExploreNoiseNet)."""
    logprob_reduce: str = "sum"
    """flow_noise: 'sum', the chain's joint log-density; 'mean', RLinf's joint_logprob: c_0's
    N(0, I) term and the K transitions' averaged (per action dim). flow_sde: 'sum'."""


def check_settings(cfg: FlowChainSettings) -> None:
    """PolicyError naming the field for chain settings that cannot work."""
    if any(h < 1 for h in cfg.noise_hidden_sizes):
        raise PolicyError("policy.noise_hidden_sizes: every width must be >= 1.")
    for name in ("chunk", "denoise_steps"):
        if getattr(cfg, name) < 1:
            raise PolicyError(f"policy.{name}={getattr(cfg, name)}: must be >= 1.")
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
    if cfg.sde_steps is not None:
        steps = list(cfg.sde_steps)
        if not steps or len(set(steps)) != len(steps) or not all(
                0 <= k < cfg.denoise_steps for k in steps):
            raise PolicyError(f"policy.sde_steps={steps}: distinct steps in [0, "
                              f"{cfg.denoise_steps - 1}] (policy.denoise_steps="
                              f"{cfg.denoise_steps}), or null for all of them.")
    if cfg.logprob_reduce == "mean" and cfg.noise_method == FLOW_SDE:
        raise PolicyError("policy.logprob_reduce='mean' averages Flow-Noise's chain; "
                          "flow_sde scores one transition: use 'sum'.")


def observation_seeds(obs) -> list[int]:
    """One 63-bit seed per row of ``obs`` (a TensorDict (B,)): a hash of the bytes of the row's
    observations, key by key in sorted order (those in ``UNSEEDED`` left out). The same
    observation gives the same seed whatever batch it is in; different observations give
    unrelated seeds.

    >>> import torch
    >>> from tensordict import TensorDict
    >>> obs = TensorDict({"state": torch.tensor([[0.0, 1.0], [2.0, 3.0]])}, batch_size=[2])
    >>> a, b = observation_seeds(obs)
    >>> observation_seeds(obs[1:]) == [b], a != b
    (True, True)
    """
    b = obs.batch_size[0]
    digests = [hashlib.blake2b(digest_size=8) for _ in range(b)]
    names = sorted((k for k in obs.keys(True, True)
                    if (keys.OBS, *((k,) if isinstance(k, str) else k)) not in UNSEEDED),
                   key=str)
    for name in names:
        rows = obs[name].detach().cpu().contiguous().numpy()  # (B, ...)
        for i in range(b):
            digests[i].update(rows[i].tobytes())
    return [int.from_bytes(d.digest(), "little") & (2 ** 63 - 1) for d in digests]


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


# -- the chain, for any velocity --------------------------------------------------------------


class FlowChain:
    """Mixin of a flow-matching policy (an ``nn.Module``): sampling, scoring and cloning
    through the denoising chain. The policy sets ``cfg`` (a :class:`FlowChainSettings`),
    calls :meth:`_init_chain` and defines :meth:`_velocity` (and :meth:`_repeat` when its
    context is not one tensor, or ``score_steps_apart``)."""

    score_steps_apart = False
    """Flow-Noise's learner scores the K transitions one step at a time (True) or as one
    batch (see :meth:`_noise_transitions`)."""

    def _init_chain(self, cfg: FlowChainSettings, env_spec, n_features: int) -> None:
        """The chain's constants and, for Flow-Noise, the noise head on ``n_features``."""
        self.chunk, self.steps, self.action_dim = cfg.chunk, cfg.denoise_steps, env_spec.action_dim
        self.method = cfg.noise_method
        if self.method == FLOW_NOISE:
            self.noise_head = NoiseHead(n_features, cfg.noise_hidden_sizes,
                                        cfg.chunk * self.action_dim, list(cfg.noise_std_range))
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

    def _velocity(self, ctx: Any, x: torch.Tensor,
                  t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(v (N, H, A), features (N, W) for the noise head) at contexts ``ctx`` (N samples),
        chunks x (N, H, A), times t (N,)."""
        raise NotImplementedError

    def _repeat(self, ctx: Any, n: int) -> Any:
        """``ctx`` with each sample repeated n times in a row (a tensor's repeat_interleave)."""
        return ctx.repeat_interleave(n, 0)

    def _transition(self, ctx, x: torch.Tensor, k: torch.Tensor,
                    method: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of chain[k+1] given chain[k] = x (N, H, A) at grid steps k (N,):
        Flow-Noise's or Flow-SDE's Gaussian."""
        t = self.times[k]
        v, features = self._velocity(ctx, x, t)
        if method == FLOW_SDE:
            return self._sde(x, v, t)
        return x - v / self.steps, self.noise_head(features).view_as(x)

    def _sde(self, x: torch.Tensor, v: torch.Tensor,
             t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tt = t[:, None, None]
        sigma = sde_sigma(tt, self.cfg.noise_level, 1.0 - 1.0 / self.steps)
        return sde_step(x, v, tt, 1.0 / self.steps, sigma)

    def _chain(self, ctx, b: int, device, deterministic: bool, seeds=None):
        """Samples a chain (B, K+1, H, A) for the B samples of ``ctx``; returns it, the
        elementwise log-probs of its scored transitions (B, n, H, A) (None if
        ``deterministic``: the ODE's chain) and Flow-SDE's stochastic step (B,) (else None).
        ``seeds``: the deterministic chain's c_0 seed per row (:meth:`_start`)."""
        k_steps = self.steps
        x = self._start(b, device, deterministic, seeds)
        chain, log_probs = [x], []
        sde = self.method == FLOW_SDE and not deterministic
        step = self._draw_sde_steps(b, device) if sde else None
        for k in range(k_steps):
            ks = torch.full((b,), k, device=device, dtype=torch.long)
            if self.method == FLOW_NOISE and not deterministic:  # every step stochastic
                mean, std = self._transition(ctx, x, ks, FLOW_NOISE)
                x = mean + std * torch.randn_like(mean)
                log_probs.append(gaussian_log_prob(x, mean, std))
            else:
                v, _ = self._velocity(ctx, x, self.times[ks])
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

    def _start(self, b: int, device, deterministic: bool, seeds=None) -> torch.Tensor:
        """c_0 (B, H, A), a draw of N(0, I): from torch's global generator for sampled chains;
        for the deterministic chain, row i's from a generator seeded by ``seeds[i]`` (the
        policy's :func:`observation_seeds`), so that its action is a function of the
        observation alone. openpi and RLinf draw c_0 from a shared generator at inference,
        which makes an episode's actions depend on how many others share its batch and on
        what drew before, and evaluation's promise (episode e acts the same whatever the env
        count) cannot allow that. c_0 = 0, the noise's mean, would keep the promise too, but
        it evaluates another policy than the one openpi and RLinf score (the ODE's image of
        one atypical point instead of a draw of the noise the flow carries to actions);
        the seeded draw keeps their distribution over episodes. ``seeds`` None with
        ``deterministic``: c_0 = 0."""
        shape = (b, self.chunk, self.action_dim)
        if not deterministic:
            return torch.randn(shape, device=device)
        if seeds is None:
            return torch.zeros(shape, device=device)
        rows = [torch.randn(shape[1:], generator=torch.Generator().manual_seed(s))
                for s in seeds]
        return torch.stack(rows).to(device)

    def _draw_sde_steps(self, b: int, device) -> torch.Tensor:
        """Flow-SDE's stochastic step (B,) per sample, uniform over ``sde_steps`` (all K when
        None)."""
        allowed = self.cfg.sde_steps
        if allowed is None:
            return torch.randint(self.steps, (b,), device=device)
        allowed = torch.tensor(list(allowed), dtype=torch.long, device=device)
        return allowed[torch.randint(len(allowed), (b,), device=device)]

    def _act_outputs(self, ctx, b: int, device, deterministic: bool, obs=None) -> dict:
        """``act``'s chain keys: ``action`` (env units), ``log_prob``, ``token_log_prob``,
        ``flow_chain`` and, for Flow-SDE, ``flow_step``. ``obs``: the rows' observations,
        which seed the deterministic chain's c_0."""
        seeds = observation_seeds(obs) if deterministic and obs is not None else None
        chain, log_probs, step = self._chain(ctx, b, device, deterministic, seeds)
        if log_probs is None:
            per_dim = torch.zeros(b, self.chunk, self.action_dim, device=device)
        else:
            per_dim = self._reduce(log_probs, chain[:, 0], first_is="log_prob")
        out = {
            keys.ACTION: self._env_action(chain[:, -1]),
            keys.LOG_PROB: per_dim.sum((1, 2)),
            keys.TOKEN_LOG_PROB: per_dim.flatten(1),
            keys.FLOW_CHAIN: chain,
        }
        if self.method == FLOW_SDE:
            out[keys.FLOW_STEP] = step if step is not None else torch.zeros(
                b, dtype=torch.long, device=device)
        return out

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

    def _noise_transitions(self, ctx, chain: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flow-Noise's (mean, std) (B, K, H, A) of every transition of chains (B, K+1, H, A):
        all K steps as one batch of B·K (``ctx`` repeated by :meth:`_repeat`), or, with
        ``score_steps_apart``, step by step in the rollout's own batch shapes (a model whose
        kernels round differently at another batch size still gives the rollout's numbers)."""
        b, k_steps, dev = chain.shape[0], self.steps, chain.device
        shape = (b, k_steps, self.chunk, self.action_dim)
        if self.score_steps_apart:
            steps = [self._transition(ctx, chain[:, k], torch.full((b,), k, device=dev),
                                      FLOW_NOISE) for k in range(k_steps)]
            return torch.stack([m for m, _ in steps], 1), torch.stack([s for _, s in steps], 1)
        x = chain[:, :-1].reshape(b * k_steps, self.chunk, self.action_dim)  # (B*K, H, A)
        ks = torch.arange(k_steps, device=dev).repeat(b)
        mean, std = self._transition(self._repeat(ctx, k_steps), x, ks, FLOW_NOISE)
        return mean.view(shape), std.view(shape)

    def _chain_log_probs(self, ctx, batch) -> dict:
        """``evaluate_actions``' chain keys, with gradients: ``log_prob``, ``token_log_prob``
        of the stored chain's transitions (every one for Flow-Noise, ``flow_step``'s for
        Flow-SDE) and ``entropy`` (Flow-Noise's transitions'; Flow-SDE: 0, its σ is fixed)."""
        chain = batch[keys.FLOW_CHAIN]  # (B, K+1, H, A)
        b, dev = chain.shape[0], chain.device
        if self.method == FLOW_NOISE:
            mean, std = self._noise_transitions(ctx, chain)  # (B, K, H, A) each
            lp = gaussian_log_prob(chain[:, 1:], mean, std)
            per_dim = self._reduce(lp, chain[:, 0], "log_prob")
            entropy = self._reduce(gaussian_entropy(std), chain[:, 0], "entropy")
            entropy = entropy.sum((1, 2))
        else:
            k = batch[keys.FLOW_STEP].long()
            rows = torch.arange(b, device=dev)
            mean, std = self._transition(ctx, chain[rows, k], k, FLOW_SDE)
            per_dim = gaussian_log_prob(chain[rows, k + 1], mean, std)
            entropy = torch.zeros(b, device=dev)
        return {keys.LOG_PROB: per_dim.sum((1, 2)), keys.TOKEN_LOG_PROB: per_dim.flatten(1),
                keys.ENTROPY: entropy}

    def _flow_matching_loss(self, ctx, action: torch.Tensor, eps: Optional[torch.Tensor],
                            t: Optional[torch.Tensor]) -> torch.Tensor:
        """Per sample, the mean over the chunk of (v(ctx, x_t, t) - (ε - a))², for expert
        chunks ``action`` in env units (reshaped to (B, H, A)), a in normalised units; ``eps``
        and ``t`` drawn when None (ε ~ N(0, I), t = 0.001 + 0.999·Beta(1.5, 1))."""
        a = action.reshape(action.shape[0], self.chunk, self.action_dim)
        a = (a - self.action_center) / self.action_half
        eps = torch.randn_like(a) if eps is None else eps
        t = sample_time(a.shape[0], device=a.device) if t is None else t
        x_t, target = flow_matching_pair(a, eps, t)
        v, _ = self._velocity(ctx, x_t, t)
        return ((v - target) ** 2).mean((1, 2))
