"""The learner pieces every workload's update calls: a ``Trainer`` owns a model's optimiser
(fp32 master parameters, autocast) and gives an algorithm's own loop its steps: the
minibatches of an epoch (:meth:`Trainer.minibatches`), a minibatch's gradients micro-batch by
micro-batch, summed over data-parallel ranks (:meth:`Trainer.gradients`), and the optimiser
step (:meth:`Trainer.step`: unscale, clip, step). The loop itself (epochs, early stop, step
size) is the algorithm's, written top to bottom in its module: the Trainer calls nothing of
it but the loss function it is handed.

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
minibatch terms are summed likewise, so an algorithm's early stop and step-size rule see the
global values on every rank (and every rank sets the same step size). Statistics over a whole
minibatch (advantage normalisation) are the algorithm's, which must take them over the ranks
too. The ranks start from rank 0's weights (broadcast when the Trainer is built) and, taking
identical steps, stay identical. An explicit all-reduce rather than DDP's reducer: losses here
run through a policy's ``evaluate_actions``, not ``forward`` (which DDP hooks), and a rank
whose share of a minibatch is empty still has to take part.

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
>>> gen, means = minibatch_generator(seed=0, iteration=0), Means()
>>> for epoch in range(2):
...     for mb in trainer.minibatches(batch, 2, gen):  # (2,) each
...         terms = trainer.gradients(mb, loss_fn, micro_batch_size=1)
...         terms["grad_norm"] = trainer.step()
...         means.add(terms)
>>> sorted(means.means())
['grad_norm', 'loss_mse']
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

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


@dataclass
class Minibatch:
    """One minibatch of an epoch as this rank holds it (:meth:`Trainer.minibatches`)."""

    rows: TensorDict
    """This rank's rows of the minibatch (B_mb,): with one rank all of them; with several,
    possibly none. An algorithm may replace it with rows of its own making (normalised
    advantages) before :meth:`Trainer.gradients`."""
    total: int
    """Rows of the whole minibatch over every rank: each micro-batch's loss is weighted by its
    share of them."""
    filler: Optional[TensorDict] = None
    """Sharded: the row this rank runs at weight 0 while the busiest rank still has
    micro-batches (None: this rank's first)."""


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

    # -- an update's pieces: the minibatches of an epoch, a minibatch's gradients ----------
    def minibatches(self, batch: TensorDict, num_minibatches: int,
                    generator: torch.Generator) -> Iterator[Minibatch]:
        """One epoch over ``batch`` (B,): ``num_minibatches`` minibatches of one permutation
        drawn from ``generator`` (one ``randperm`` per call, when the first minibatch is
        taken). Data parallel: ``batch`` is this rank's part of the global batch; the
        permutation is of the global batch, and each minibatch is this rank's rows of the one
        a single rank would take (see the module docstring)."""
        sizes = self.dp.sizes(batch.shape[0])  # every rank's rows, in rank order
        size, first = sum(sizes), sum(sizes[: self.dp.rank])  # global rows; this rank's first
        mb_size = max(1, size // num_minibatches)
        filler = self._filler(batch, sizes) if self.sharded else None
        perm = torch.randperm(size, generator=generator)  # over the global batch
        for start in range(0, size, mb_size):
            idx = perm[start : start + mb_size]
            total = idx.numel()
            if self.dp.active:  # the rows of this minibatch that this rank holds
                idx = idx[(idx >= first) & (idx < first + batch.shape[0])] - first
            rows = batch[idx.to(batch.device) if batch.device is not None else idx]
            yield Minibatch(rows, total, filler)

    def gradients(self, mb: Minibatch | TensorDict, loss_fn: LossFn, *,
                  micro_batch_size: Optional[int] = None) -> dict[str, float]:
        """The gradients of ``loss_fn`` on ``mb``, for the :meth:`step` that follows: zeroes
        them, then runs forward and backward under :meth:`autocast` micro-batch by micro-batch
        (None: the whole minibatch at once), each loss weighted by its share of the minibatch
        (of ``mb.total`` rows: with several ranks, of the global minibatch), and sums the
        gradients over the ranks. Returns the minibatch's terms (micro-batches weighted
        alike; with several ranks summed over them, the same floats on every rank).

        ``mb``: a :class:`Minibatch` of :meth:`minibatches`, or a TensorDict that is the
        whole minibatch on this rank."""
        if isinstance(mb, TensorDict):
            mb = Minibatch(mb, mb.shape[0])
        rows, filler = mb.rows, mb.filler
        n_local, n = rows.shape[0], mb.total
        k = max(1, n_local if micro_batch_size is None else micro_batch_size)
        steps = -(-n_local // k)  # this rank's micro-batches
        if self.sharded:  # every forward is a collective: as many as the busiest rank's
            steps = int(self.dp.max(torch.tensor(steps)))
            if filler is None and n_local:
                filler = rows[:1]
        terms: dict[str, float] = {}
        self.zero_grad()
        for start in range(0, steps * k, k):
            real = start < n_local
            micro = (rows if k >= n_local else rows[start : start + k]) if real else filler
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
        return terms

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


def minibatch_generator(seed: int, iteration: int) -> torch.Generator:
    """The generator of the minibatch order of the update of ``iteration`` (and of SAC's
    replay samples): seeded by ``seeding.derive(seed, LEARN, iteration, 0)``, the same on
    every rank, so a resumed run draws what the uninterrupted one drew."""
    return torch.Generator().manual_seed(seeding.derive(seed, seeding.LEARN, iteration, 0)[0])


class Means:
    """The running means of an update's minibatch terms, key by key in the order first seen
    (a key some minibatches lack is still divided by every minibatch added).

    >>> means = Means()
    >>> means.add({"loss_pi": 1.0, "grad_norm": 2.0}); means.add({"loss_pi": 2.0})
    >>> means.means()
    {'loss_pi': 1.5, 'grad_norm': 1.0}
    """

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.count = 0

    def add(self, terms: dict[str, float]) -> None:
        for key, v in terms.items():
            self.sums[key] = self.sums.get(key, 0.0) + v
        self.count += 1

    def means(self) -> dict[str, float]:
        """Each key's sum over the minibatches added, divided by their count (``{}``: none)."""
        return {key: v / max(self.count, 1) for key, v in self.sums.items()}


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
