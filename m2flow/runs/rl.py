"""The RL maths of both workloads, as pure functions: advantages (PPO's GAE; group-relative
ones; normalised per minibatch), PPO's clipped surrogate at a log-prob level with its
diagnostics, and the critic's explained variance.

Embodied GRPO groups the episodes of envs reset to one initial state; reasoning GRPO groups the
completions of one prompt. Both score a sample against its group with the same rule
(:func:`group_advantages`), and both train with the same clipped policy objective
(:func:`clipped_terms`; embodied: a mean over samples, :func:`clipped_policy_terms`; reasoning:
a sum over completion tokens, divided by the step's token count later). Each workload keeps
what is its own: which samples form a group and which are filtered. The unit of the embodied
policy ratio is a log-prob level (:data:`LOGPROB_LEVELS`); reasoning's is each completion token.

With several data-parallel ranks, a statistic over a whole minibatch or batch (advantage
normalisation, explained variance) is taken over every rank's rows through the
:class:`~m2flow.pipelines.distributed.DataParallel` handed in (its ``sum``, a collective; with
one rank it returns its input).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.pipelines.distributed import DataParallel

__all__ = [
    "gae", "group_advantages", "normalize", "normalized_advantages", "normalize_shared",
    "clipped_terms", "clipped_surrogate", "ratio_stats", "LOGPROB_LEVELS", "level_log_probs",
    "per_ratio", "clipped_policy_terms", "explained_variance", "explained_variance_shared",
]


# -- advantages --------------------------------------------------------------------------------
def gae(
    reward: torch.Tensor,
    value: torch.Tensor,
    next_value: torch.Tensor,
    terminated: torch.Tensor,
    done: torch.Tensor,
    *,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation with auto-reset trajectories.

    Every argument is (N, T). ``next_value`` is the critic at the observation step t ended in
    (the final observation when the episode ended there), so a truncated step bootstraps from
    it while a terminated step does not; ``done`` cuts the recursion at episode ends.

    Returns ``(advantage, return)``, both (N, T), with ``return = advantage + value``.

    >>> z = torch.zeros(1, 2)
    >>> adv, ret = gae(torch.ones(1, 2), z, z, z.bool(), z.bool(), gamma=0.5, gae_lambda=1.0)
    >>> adv
    tensor([[1.5000, 1.0000]])
    """
    not_terminated = 1.0 - terminated.float()
    not_done = 1.0 - done.float()
    advantage = torch.zeros_like(reward)
    running = torch.zeros_like(reward[:, 0])
    for t in reversed(range(reward.shape[1])):
        delta = reward[:, t] + gamma * next_value[:, t] * not_terminated[:, t] - value[:, t]
        running = delta + gamma * gae_lambda * not_done[:, t] * running
        advantage[:, t] = running
    return advantage, advantage + value


def group_advantages(values: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Each sample's advantage against its group, ``(v - mean) / (std + eps)`` with the
    population std (GRPO's paper); ``values`` lists groups of ``group_size`` one after another.

    A group whose values are all equal has no signal and gets exactly 0, for any ``eps``: not
    ``0/0 = nan`` with ``eps=0``, nor the rounding residue of a mean that float32 cannot hold
    (three rewards of 0.1) divided by ``eps``, which would push every sample of the group the
    same way by a made-up amount.

    >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.1, 0.1]), group_size=2)
    tensor([ 1.0000, -1.0000, -1.0000,  1.0000,  0.0000,  0.0000])
    """
    if group_size < 1 or values.numel() % group_size:
        raise ValueError(f"{values.numel()} samples do not split into groups of {group_size}.")
    v = values.float().reshape(-1, group_size)  # (groups, n)
    mean = v.mean(dim=1, keepdim=True)
    std = v.std(dim=1, unbiased=False, keepdim=True)
    constant = (v == v[:, :1]).all(dim=1, keepdim=True)
    adv = torch.where(constant, torch.zeros_like(v), (v - mean) / (std + eps))
    return adv.reshape(-1)


def normalize(adv: torch.Tensor) -> torch.Tensor:
    """Zero mean, unit (sample) std.

    >>> normalize(torch.tensor([1.0, 3.0]))
    tensor([-0.7071,  0.7071])
    """
    return (adv - adv.mean()) / (adv.std() + 1e-8)


def normalized_advantages(mb: TensorDict, dp: DataParallel) -> TensorDict:
    """``mb`` with its advantages normalised over the whole minibatch (with several ranks of
    ``dp``, over every rank's share of it: a collective), as a shallow copy; a minibatch of
    one row on one rank is returned as it is.

    >>> normalized_advantages(TensorDict({"advantage": torch.tensor([1.0, 3.0])}, [2]),
    ...                       DataParallel())["advantage"]
    tensor([-0.7071,  0.7071])
    """
    if dp.active:
        adv = normalize_shared(mb[keys.ADVANTAGE], dp)
    elif mb.shape[0] > 1:
        adv = normalize(mb[keys.ADVANTAGE])
    else:
        return mb
    mb = mb.clone(recurse=False)
    mb[keys.ADVANTAGE] = adv
    return mb


def normalize_shared(adv: torch.Tensor, dp: DataParallel) -> torch.Tensor:
    """:func:`normalize` over the concatenation of every rank's ``adv`` (this rank's rows of
    it returned): the global mean first, then the sum of squared deviations from it, as
    ``Tensor.std`` takes them; unchanged when the ranks hold fewer than 2 values in all."""
    stats = dp.sum(torch.stack([adv.new_tensor(float(adv.numel())), adv.sum()]))
    n = float(stats[0])
    if n <= 1:
        return adv
    mean = stats[1] / n
    var = dp.sum(((adv - mean) ** 2).sum()) / (n - 1)
    return (adv - mean) / (var.sqrt() + 1e-8)


# -- the clipped surrogate ---------------------------------------------------------------------
def clipped_terms(ratio: torch.Tensor, adv: torch.Tensor, clip_coef: float) -> torch.Tensor:
    """PPO's clipped policy objective per ratio, as a loss: ``max(-A r, -A clip(r, 1-c, 1+c))``
    (``adv`` broadcast against ``ratio``)."""
    return torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip_coef, 1 + clip_coef))


def clipped_surrogate(log_ratio: torch.Tensor, adv: torch.Tensor, clip_coef: float) -> torch.Tensor:
    """The mean of :func:`clipped_terms` over every ratio.

    >>> lr = torch.log(torch.tensor([1.5, 0.5]))  # ratios 1.5 (A=+1) and 0.5 (A=-1)
    >>> clipped_surrogate(lr, torch.tensor([1.0, -1.0]), 0.2)  # (-1.2 + 0.8) / 2
    tensor(-0.2000)
    """
    return clipped_terms(log_ratio.exp(), adv, clip_coef).mean()


@torch.no_grad()
def ratio_stats(log_ratio: torch.Tensor, clip_coef: float) -> dict:
    """``approx_kl`` (the k3 estimator of KL(old || new)) and ``clip_fraction``, means."""
    ratio = log_ratio.exp()
    return {"approx_kl": ((ratio - 1) - log_ratio).mean(),
            "clip_fraction": ((ratio - 1.0).abs() > clip_coef).float().mean()}


LOGPROB_LEVELS = ("token", "action", "chunk")
"""The unit of the policy ratio: 'token' (each action token), 'action' (the tokens of one
action summed) or 'chunk' (everything one policy call decided, summed)."""


def level_log_probs(out: TensorDict, mb: TensorDict, level: str,
                    action_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(new, old) log-probs at ``level``: (B,) for 'chunk', (B, Q) per token or (B, Q / A)
    per action from the policy's ``token_log_prob`` (``out``: ``evaluate_actions`` of
    ``mb``; ``mb``: what the rollout recorded). A chunk of 8 actions of 7 tokens is one
    ratio of 56 tokens' log-probs summed: one update moves it far more than any one token's.

    >>> old = TensorDict({keys.LOG_PROB: torch.tensor([-3.0]),
    ...                   keys.TOKEN_LOG_PROB: torch.tensor([[-1.0, -0.5, -1.0, -0.5]])}, [1])
    >>> new = TensorDict({keys.LOG_PROB: torch.tensor([-2.0]),
    ...                   keys.TOKEN_LOG_PROB: torch.tensor([[-0.5, -0.5, -0.5, -0.5]])}, [1])
    >>> [n - o for n, o in (level_log_probs(new, old, lv, 2) for lv in LOGPROB_LEVELS)]
    [tensor([[0.5000, 0.0000, 0.5000, 0.0000]]), tensor([[0.5000, 0.5000]]), tensor([1.])]
    """
    if level == "chunk":
        return out[keys.LOG_PROB], mb[keys.LOG_PROB]
    if keys.TOKEN_LOG_PROB not in mb.keys():
        raise ValueError(
            f"algorithm.logprob_level={level!r} needs per-token log-probs, which this "
            "policy does not produce; use 'chunk' (or a VLA policy)."
        )
    new, old = out[keys.TOKEN_LOG_PROB], mb[keys.TOKEN_LOG_PROB]  # (B, Q)
    if level == "action":
        new = new.reshape(new.shape[0], -1, action_dim).sum(-1)  # (B, Q / A)
        old = old.reshape(old.shape[0], -1, action_dim).sum(-1)
    return new, old


def per_ratio(adv: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    """A per-sample advantage (B,) spread over each sample's ratios (B, ...)."""
    return adv.reshape(-1, *([1] * (log_ratio.ndim - 1))).expand_as(log_ratio)


def clipped_policy_terms(policy, mb: TensorDict, *, clip_coef: float, ent_coef: float,
                         level: str = "chunk", action_dim: int = 1,
                         value_term: Optional[Callable[[TensorDict], torch.Tensor]] = None
                         ) -> TensorDict:
    """The clipped policy loss of minibatch ``mb`` (obs, the actions, the behaviour log-probs
    and a per-sample ``advantage``), the ratio at log-prob ``level`` and each sample's
    advantage on every ratio of it: a TensorDict of ``loss_policy``, ``value_term``'s
    ``loss_value`` when given (called with the policy's ``evaluate_actions`` output: a
    critic's weighted loss), ``loss_entropy`` and ``loss_aux`` when the policy returns one
    (the runner sums the ``loss_*`` terms in this order), and diagnostics ``approx_kl``,
    ``clip_fraction``, ``entropy``; each a mean over samples (and their ratios).

    >>> class Fixed:  # log-prob -1 where the rollout logged -1.5 (ratio e^0.5), entropy 1
    ...     def evaluate_actions(self, mb):
    ...         return TensorDict({keys.LOG_PROB: torch.full((2,), -1.0),
    ...                            keys.ENTROPY: torch.ones(2)}, [2])
    >>> mb = TensorDict({keys.LOG_PROB: torch.full((2,), -1.5),
    ...                  keys.ADVANTAGE: torch.tensor([1.0, -1.0])}, [2])
    >>> t = clipped_policy_terms(Fixed(), mb, clip_coef=0.2, ent_coef=0.1)
    >>> [k for k in t.keys() if k.startswith("loss_")], round(float(t["loss_policy"]), 4)
    (['loss_policy', 'loss_entropy'], 0.2244)
    """
    out = policy.evaluate_actions(mb)
    new, old = level_log_probs(out, mb, level, action_dim)
    log_ratio = new - old
    pg_loss = clipped_surrogate(log_ratio, per_ratio(mb[keys.ADVANTAGE], log_ratio), clip_coef)
    value = {} if value_term is None else {"loss_value": value_term(out)}
    entropy = out[keys.ENTROPY].mean()
    terms = TensorDict(
        {
            "loss_policy": pg_loss,
            **value,
            "loss_entropy": -ent_coef * entropy,
            **ratio_stats(log_ratio, clip_coef),
            "entropy": entropy.detach(),
        },
        batch_size=[],
    )
    if keys.AUX_LOSS in out.keys():  # the policy's own (e.g. policy.state_aux)
        terms["loss_aux"] = out[keys.AUX_LOSS].mean()
    return terms


# -- the critic's fit --------------------------------------------------------------------------
def explained_variance(pred: torch.Tensor, target: torch.Tensor) -> float:
    """1 - Var(target - pred) / Var(target) (nan when the target is constant)."""
    var = target.var()
    return float("nan") if var == 0 else float(1 - (target - pred).var() / var)


def explained_variance_shared(pred: torch.Tensor, target: torch.Tensor,
                              dp: DataParallel) -> float:
    """:func:`explained_variance` over every rank's rows, from summed moments."""
    pred, target = pred.double(), target.double()
    err = target - pred
    m = dp.sum(torch.stack([target.new_tensor(float(target.numel())), target.sum(),
                            (target ** 2).sum(), err.sum(), (err ** 2).sum()]))
    n = float(m[0])
    if n < 2:
        return float("nan")
    var_t = float(m[2] - m[1] ** 2 / n) / (n - 1)
    var_e = float(m[4] - m[3] ** 2 / n) / (n - 1)
    return float("nan") if var_t == 0 else 1 - var_e / var_t
