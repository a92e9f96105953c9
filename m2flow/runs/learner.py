"""The learner loop every workload shares: a ``Trainer`` owns a model's optimiser and runs
epochs x minibatches x micro-batches with fp32 master parameters and autocast.

Precision. The parameters the optimiser updates are always fp32 ("masters"), and so is the
optimiser state: a model whose trainable parameters arrive in bf16/fp16 (a VLA or LM loaded
in its serving dtype) has them converted to fp32 in place when the Trainer is built (frozen
parameters keep their dtype: they get no update, and a 7B frozen backbone in fp32 would
double its memory). Forward and backward run under ``torch.autocast`` in the precision's
dtype (bf16 autocast also works on CPU). The rollout's copy of the model may stay bf16:
``load_state_dict`` casts the fp32 weights on sync.

Micro-batches. A minibatch too big for one forward/backward is cut into micro-batches; each
one's loss is weighted by its share of the minibatch and the gradients accumulate, so with
losses that are per-sample means the step equals the unsplit one (up to float rounding).

Data parallel. Given a :class:`~m2flow.pipelines.distributed.DataParallel` of N ranks, each
holding its part of the global batch (rank 0's rows first, then rank 1's, ...), the update is
the one-rank update of the global batch up to float rounding: every rank draws the same seeded
permutation of the *global* rows, so each minibatch is the one a single rank would take; each
rank computes its share of it (the rows it holds, possibly none), each micro-batch's loss
weighted by its share of the *global* minibatch; the gradients are summed over the ranks
(``DataParallel.sum_grads``: an all-reduce in flat buckets) before the clip and the step; the
minibatch terms are summed likewise, so ``stop_early`` and ``adapt_lr`` see the global values
on every rank (and every rank sets the same step size).
Statistics over a whole minibatch (advantage normalisation) are the ``minibatch`` callback's,
which must take them over the ranks too. The ranks start from rank 0's weights (broadcast when
the Trainer is built) and, taking identical steps, stay identical. An explicit all-reduce rather
than DDP's reducer: losses here run through a policy's ``evaluate_actions``, not ``forward``
(which DDP hooks), and a rank whose share of a minibatch is empty still has to take part.

Sharded (``shard="fsdp"``, :mod:`m2flow.pipelines.fsdp`). The same update, but each rank
holds 1/N of the parameters, gradients and optimiser state: FSDP2 shards the model's blocks
and root after rank 0's weights are broadcast, gathers a block's parameters around each of
its forwards and reduce-scatters (sums) its gradients in each backward, in place of
``sum_grads``. Since every forward is a collective, every rank runs as many micro-batches as
the rank with the most rows in the minibatch: a rank with fewer runs its last ones on a
filler row (one row of the batch) at weight 0, which adds exact zeros. The optimiser steps on
the shards; the clip's norm is the global one (the gradients are DTensors).
:meth:`Trainer.model_state_dict` and :meth:`Trainer.optimizer_state_dict` gather whole
tensors to rank 0 (collectives: every rank calls them).

Imports ``pipelines``-level things only (torch, tensordict, ``runs.seeding``,
``pipelines.distributed``): no workload.

>>> model = torch.nn.Linear(3, 1)
>>> trainer = Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), precision="fp32")
>>> batch = TensorDict({"x": torch.ones(4, 3), "y": torch.zeros(4)}, batch_size=[4])
>>> def loss_fn(mb):
...     return TensorDict({"loss_mse": ((model(mb["x"]).squeeze(-1) - mb["y"]) ** 2).mean()}, [])
>>> sorted(trainer.run_epochs(batch, loss_fn, epochs=1, num_minibatches=2, seed=0, iteration=0))
['early_stop', 'grad_norm', 'loss_mse']
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
from tensordict import TensorDict
from torch import nn

from m2flow.pipelines import fsdp
from m2flow.pipelines.distributed import SINGLE, DataParallel
from m2flow.runs import checkpoint, seeding

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
"""auto: the dtype the model's parameters arrive in (bf16/fp16 -> that autocast, else fp32)."""
AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
HALF_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}

LossFn = Callable[[TensorDict], TensorDict]
"""A minibatch (or micro-batch) -> a TensorDict (batch_size []) of ``loss_*`` terms (summed
to train; each a per-sample mean) and diagnostics (averaged into the metrics)."""
AdaptLr = Callable[[dict], Optional[float]]
"""A minibatch's terms -> the step size to take its step at (None: keep the current one)."""


def resolve_precision(precision: str, model: nn.Module) -> str:
    """``precision`` with ``auto`` resolved from the model's parameters: ``bf16``/``fp16`` when
    any floating parameter is in that dtype (a model built in its serving dtype), else ``fp32``.

    >>> resolve_precision("auto", torch.nn.Linear(2, 2).to(torch.bfloat16))
    'bf16'
    >>> resolve_precision("auto", torch.nn.Linear(2, 2))
    'fp32'
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {list(PRECISIONS)}.")
    if precision != "auto":
        return precision
    for p in model.parameters():
        if p.dtype in HALF_DTYPES:
            return HALF_DTYPES[p.dtype]
    return "fp32"


def to_fp32_masters(model: nn.Module) -> int:
    """Converts the model's trainable half-precision parameters to fp32 in place (the
    Parameter objects stay the same); returns how many were converted."""
    n = 0
    for p in model.parameters():
        if p.requires_grad and p.dtype in HALF_DTYPES:
            p.data = p.data.float()
            n += 1
    return n


def total_loss(terms: TensorDict) -> torch.Tensor:
    """Sum of every ``loss_*`` term."""
    return sum(v for k, v in terms.items() if k.startswith("loss_"))


class Trainer:
    """A model, its optimiser, and the update step (fp32 masters, autocast, accumulation).

    Args:
        model: the module to train; its trainable half-precision parameters become fp32.
        make_optimizer: builds the optimiser from the parameters, e.g.
            ``lambda params: torch.optim.Adam(params, lr=3e-4)`` (it is given every parameter
            of the model, frozen ones too: they never get a gradient, so it skips them).
        precision: ``auto`` (default) | ``fp32`` | ``bf16`` | ``fp16``: the autocast dtype of
            forward and backward; ``auto`` resolves from the model's parameter dtype before
            they are converted. ``fp16`` adds a gradient scaler.
        max_grad_norm: clip the global gradient norm to this before each step (None: no clip).
        data_parallel: the ranks training this model together (default: this one alone); see
            the module docstring. The model's weights become rank 0's.
        shard: ``none`` (default: every rank holds the whole model) | ``fsdp`` (FSDP2 shards
            it over the ranks of ``data_parallel``; with one rank there is nothing to shard).
        forward_methods: the model's methods that run it besides ``forward`` (a policy's
            ``evaluate_actions``), which the sharded root gathers its parameters around.
    """

    def __init__(
        self, model: nn.Module, make_optimizer: Callable[[list], torch.optim.Optimizer], *,
        precision: str = "auto", max_grad_norm: Optional[float] = None,
        data_parallel: DataParallel = SINGLE, shard: str = "none",
        forward_methods: Sequence[str] = (),
    ):
        if shard not in fsdp.SHARD_MODES:
            raise ValueError(f"shard={shard!r}: use one of {list(fsdp.SHARD_MODES)}.")
        self.model = model
        self.precision = resolve_precision(precision, model)
        to_fp32_masters(model)
        self.max_grad_norm = max_grad_norm
        self.dtype = AUTOCAST_DTYPES[self.precision]
        self.scaler = None
        device_type = next((p.device.type for p in model.parameters()), "cpu")
        if self.precision == "fp16":  # fp16's small range: scale the loss, unscale the grads
            self.scaler = torch.amp.GradScaler(device_type)
        self.dp = data_parallel
        self.sharded = shard == "fsdp" and self.dp.active
        if self.dp.active:
            if self.scaler is not None:  # each rank's scaler would skip steps on its own
                raise ValueError("precision fp16 (a gradient scaler) with several data-parallel "
                                 "ranks is not supported; use bf16 or fp32.")
            self.dp.broadcast_module(model)  # (before sharding: FSDP broadcasts nothing)
        if self.sharded:
            if device_type != torch.device(self.dp.device).type:
                raise ValueError(
                    f"shard=fsdp: the model is on {device_type} but the group's collectives run "
                    f"on {self.dp.device} (ranks sharing a GPU use gloo); give each rank a GPU of "
                    "its own, or use shard=none.")
            fsdp.shard(model, device_type=device_type, world_size=self.dp.world_size,
                       forward_methods=forward_methods,
                       param_dtype=torch.bfloat16 if self.precision == "bf16" else None)
        self.params = list(model.parameters())  # (the shards, when sharded)
        self.optimizer = make_optimizer(self.params)
        self.lr: Optional[float] = None
        """The step size ``set_lr`` last set (None: none yet; the optimiser's own)."""

    # -- the lower-level API: accumulate, then step ---------------------------------------
    def _device_type(self) -> str:
        return self.params[0].device.type if self.params else "cpu"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context forward and backward run in (a no-op for fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type(), dtype=self.dtype)

    def set_lr(self, lr: float) -> None:
        """Sets every parameter group's step size to ``lr`` times its ``lr_scale`` (1 when
        the group has none: a critic with a step size of its own keeps its ratio)."""
        self.lr = lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, weight: float = 1.0) -> None:
        """Adds ``weight * d loss`` to the gradients (a micro-batch's share of its minibatch)."""
        if weight != 1.0:  # (0: a sharded rank's filler, whose gradients are exact zeros)
            loss = loss * weight
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def step(self, *, grad_divisor: float = 1.0) -> float:
        """Divides the accumulated gradients by ``grad_divisor`` (e.g. the step's token count
        when the losses were sums), clips, steps the optimiser and zeroes the gradients.
        Returns the gradient norm before clipping (0.0 without clipping)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if grad_divisor != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(grad_divisor)
        grad_norm = 0.0
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
            # sharded: a DTensor; its full value is the norm over every rank's shards
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.zero_grad()
        return grad_norm

    # -- the loop ------------------------------------------------------------------------
    def train_minibatch(self, mb: TensorDict, loss_fn: LossFn, *,
                        micro_batch_size: Optional[int] = None,
                        total: Optional[int] = None,
                        filler: Optional[TensorDict] = None,
                        adapt_lr: Optional[AdaptLr] = None) -> dict[str, float]:
        """One optimiser step on ``mb``: forward/backward micro-batch by micro-batch (None:
        the whole minibatch at once), each weighted by its share; then clip and step.
        Returns the minibatch's terms (micro-batches weighted alike) and ``grad_norm``.

        ``adapt_lr``: called with the minibatch's terms right before the step; a float it
        returns is ``set_lr`` for this step and the ones after (rsl-rl's adaptive schedule).

        ``total``: the rows of the global minibatch when ``mb`` is this rank's share of it
        (data parallel; default ``mb``'s own rows): shares are of ``total``, and gradients and
        terms are summed over the ranks before the step. ``filler``: sharded, the row a
        rank whose share is empty runs at weight 0 (default: ``mb``'s first row)."""
        n_local = mb.shape[0]
        n = n_local if total is None else total
        k = max(1, n_local if micro_batch_size is None else micro_batch_size)
        steps = -(-n_local // k)  # this rank's micro-batches
        if self.sharded:  # every forward is a collective: as many as the busiest rank's
            steps = int(self.dp.max(torch.tensor(steps)))
            if filler is None and n_local:
                filler = mb[:1]
        terms: dict[str, float] = {}
        self.zero_grad()
        for start in range(0, steps * k, k):
            real = start < n_local
            micro = (mb if k >= n_local else mb[start : start + k]) if real else filler
            weight = (1.0 if micro.shape[0] == n else micro.shape[0] / n) if real else 0.0
            with self.autocast():
                out = loss_fn(micro)
                loss = total_loss(out)
            self.backward(loss, weight)
            if real:
                for key, v in out.items():
                    terms[key] = terms.get(key, 0.0) + weight * float(v.detach())
        if self.dp.active:
            terms = sum_terms(self.dp.gather_objects(terms))
            if not self.sharded:  # (sharded: FSDP summed them in backward)
                self.dp.sum_grads(self.params)
        if adapt_lr is not None:
            lr = adapt_lr(terms)
            if lr is not None:
                self.set_lr(lr)
        terms["grad_norm"] = self.step()
        return terms

    def run_epochs(
        self, batch: TensorDict, loss_fn: LossFn, *, epochs: int, num_minibatches: int,
        seed: int, iteration: int, micro_batch_size: Optional[int] = None,
        minibatch: Optional[Callable[[TensorDict], TensorDict]] = None,
        stop_early: Optional[Callable[[dict], bool]] = None,
        adapt_lr: Optional[AdaptLr] = None,
    ) -> dict[str, float]:
        """``epochs`` passes over ``batch`` (B,) in ``num_minibatches`` minibatches of a
        seeded permutation (seed ``seeding.derive(seed, LEARN, iteration, 0)``), one
        optimiser step each. Data parallel: ``batch`` is this rank's part of the global batch,
        and the permutation and minibatches are the global batch's (see the module docstring).

        Args:
            minibatch: applied to each whole minibatch before it is cut into micro-batches
                (e.g. advantage normalisation).
            stop_early: called with the last minibatch's terms after each epoch; True ends
                the loop.
            adapt_lr: called with each minibatch's terms before its step; a float it returns
                becomes the step size (:meth:`train_minibatch`).

        Returns the terms averaged over the minibatches run, plus ``early_stop`` (0/1).
        """
        gen = torch.Generator().manual_seed(seeding.derive(seed, seeding.LEARN, iteration, 0)[0])
        sizes = self.dp.sizes(batch.shape[0])  # every rank's rows, in rank order
        size, first = sum(sizes), sum(sizes[: self.dp.rank])  # global rows; this rank's first
        mb_size = max(1, size // num_minibatches)
        filler = self._filler(batch, sizes) if self.sharded else None
        sums: dict[str, float] = {}
        count, stopped = 0, False
        for _ in range(epochs):
            perm = torch.randperm(size, generator=gen)  # over the global batch
            for start in range(0, size, mb_size):
                idx = perm[start : start + mb_size]
                total = idx.numel()
                if self.dp.active:  # the rows of this minibatch that this rank holds
                    idx = idx[(idx >= first) & (idx < first + batch.shape[0])] - first
                mb = batch[idx.to(batch.device) if batch.device is not None else idx]
                if minibatch is not None:
                    mb = minibatch(mb)
                terms = self.train_minibatch(mb, loss_fn, micro_batch_size=micro_batch_size,
                                             total=total, filler=filler, adapt_lr=adapt_lr)
                for key, v in terms.items():
                    sums[key] = sums.get(key, 0.0) + v
                count += 1
            if stop_early is not None and stop_early(terms):
                stopped = True
                break
        out = {key: v / max(count, 1) for key, v in sums.items()}
        out["early_stop"] = float(stopped)
        return out

    def _filler(self, batch: TensorDict, sizes: list[int]) -> TensorDict:
        """One row of the global batch for this rank's zero-weight forwards: its own first,
        or, when it holds no rows, the first row of the first rank that does."""
        if min(sizes) > 0:
            return batch[:1]
        offers = self.dp.gather_objects(batch[:1].cpu() if batch.shape[0] else None)
        row = next(o for o in offers if o is not None)
        return row.to(batch.device) if batch.device is not None else row

    # -- whole state, for weight sync and checkpoints --------------------------------------
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copies of the model's whole state dict. Sharded: a collective; rank 0 gets the
        whole tensors, the other ranks ``{}``."""
        if self.sharded:
            return fsdp.gather_state_dict(self.model)
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def load_model_state_dict(self, state: dict[str, torch.Tensor], *,
                              strict: bool = True) -> None:
        """Loads a whole state dict (sharded: every rank gets the same one, and keeps its
        shard; a collective). ``strict=False``: tensors ``state`` lacks keep their values."""
        if self.sharded:
            fsdp.load_state_dict(self.model, state, strict=strict)
        else:
            self.model.load_state_dict(state, strict=strict)

    def optimizer_state_dict(self) -> dict:
        """The optimiser's state in host memory, laid out as an unsharded
        ``Optimizer.state_dict()`` either way (a sharded one gathered: a collective; rank 0
        gets it, the other ranks ``{}``)."""
        if self.sharded:
            return fsdp.gather_optimizer_state(self.model, self.optimizer)
        return checkpoint.tree_to(self.optimizer.state_dict(), "cpu")

    def load_optimizer_state_dict(self, state: dict) -> None:
        if self.sharded:
            fsdp.load_optimizer_state(self.model, self.optimizer, state)
        else:
            self.optimizer.load_state_dict(state)



def sum_terms(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Each rank's minibatch terms (already weighted by its share) summed, in rank order (so
    every rank gets the same floats); a rank with no rows in the minibatch has none.

    >>> sum_terms([{"loss_pi": 0.25, "kl": 0.5}, {}, {"loss_pi": 0.5, "kl": 0.25}])
    {'loss_pi': 0.75, 'kl': 0.75}
    """
    out: dict[str, float] = {}
    for terms in per_rank:
        for key, v in terms.items():
            out[key] = out.get(key, 0.0) + v
    return out


@contextlib.contextmanager
def frozen_but(model: torch.nn.Module, names: Optional[list[str]]):
    """Within the block, only the parameters ``names`` of ``model`` require gradients (None:
    nothing changes); each parameter's own ``requires_grad`` is put back after it.

    >>> m = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
    >>> with frozen_but(m, ["1.bias"]):
    ...     [n for n, p in m.named_parameters() if p.requires_grad]
    ['1.bias']
    >>> all(p.requires_grad for p in m.parameters())
    True
    """
    if names is None:
        yield
        return
    keep = set(names)
    saved = {n: p.requires_grad for n, p in model.named_parameters()}
    try:
        for n, p in model.named_parameters():
            p.requires_grad_(saved[n] and n in keep)
        yield
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(saved[n])
