"""A sync's weights, cut into buckets and laid out in flat buffers (the data side of
:mod:`m2flow.runs.weights`, which holds the protocol between sender and receiver).

What to ship (:func:`trainable_keys`, :func:`changed_buffers`), how a manifest cuts it
(:func:`sync_manifest`, :func:`cut_buckets`: whole tensors up to a cap of bytes, larger ones
in row ranges), and a bucket as tensors (:func:`make_bucket`) or as one flat byte buffer that
both ends lay out alike from the manifest's dtypes and shapes (:func:`bucket_layout`,
:func:`pack_bucket`, :func:`unpack_bucket`), every piece at a multiple of ``ALIGN`` bytes so
that any dtype can view it.

>>> net = torch.nn.Linear(2, 2)
>>> manifest = sync_manifest(net, full=True, cap_bytes=16)  # weight 16 B, bias 8 B
>>> [[p.key for p in b] for b in manifest.buckets]
[['weight'], ['bias']]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch
from torch import nn

ALIGN = 16  # bytes: a piece of a flat bucket starts at a multiple, so any dtype can view it


@dataclass(frozen=True)
class Piece:
    """One tensor of a state dict, or rows ``[start, stop)`` of its first dimension."""

    key: str
    nbytes: int
    rows: Optional[tuple[int, int]] = None
    """None: the whole tensor."""


@dataclass
class SyncManifest:
    """What one sync ships: the names (``keys``) and the pieces of each bucket."""

    keys: list[str]
    buckets: list[list[Piece]]
    full: bool
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    """The sender's dtype and shape of each key (what a flat bucket's bytes mean)."""

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for b in self.buckets for p in b)


@dataclass
class WeightBucket:
    """The tensors of one bucket: ``whole`` by name, ``rows`` as (name, first row, rows). On
    the CPU as a Ray object; views of the flat buffer's device after a broadcast."""

    whole: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: list[tuple[str, int, torch.Tensor]] = field(default_factory=list)


# -- what to ship ----------------------------------------------------------------------------
def trainable_keys(module: nn.Module) -> list[str]:
    """State-dict names of the parameters that get gradients (tied ones under every name).

    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> m[0].requires_grad_(False)
    Linear(in_features=2, out_features=2, bias=True)
    >>> trainable_keys(m)
    ['1.weight', '1.bias']
    """
    return [k for k, v in module.state_dict(keep_vars=True).items()
            if isinstance(v, nn.Parameter) and v.requires_grad]


def buffer_snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the module's persistent buffers (the state-dict entries that are not
    parameters), to tell later which of them changed."""
    return {k: v.detach().to("cpu", copy=True)
            for k, v in module.state_dict(keep_vars=True).items()
            if not isinstance(v, nn.Parameter)}


def changed_buffers(module: nn.Module, snapshot: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the persistent buffers that differ from ``snapshot`` (or are not in it)."""
    now = buffer_snapshot(module)
    return [k for k, v in now.items()
            if k not in snapshot or v.shape != snapshot[k].shape or not torch.equal(v, snapshot[k])]


def cut_buckets(tensors: Mapping[str, torch.Tensor], keys: list[str],
                cap_bytes: int) -> list[list[Piece]]:
    """``keys`` of ``tensors`` in buckets of at most ``cap_bytes``, in order (greedy).

    A tensor larger than the cap is cut into row ranges of ``cap_bytes // row_bytes`` rows
    (at least one); sizes are read from shape and dtype, so ``meta`` tensors will do.

    >>> t = {"a": torch.empty(3, device="meta"), "b": torch.empty(10, 2, device="meta")}
    >>> [[(p.key, p.nbytes, p.rows) for p in b] for b in cut_buckets(t, ["a", "b"], 32)]
    [[('a', 12, None)], [('b', 32, (0, 4))], [('b', 32, (4, 8))], [('b', 16, (8, 10))]]
    """
    if cap_bytes < 1:
        raise ValueError(f"weight sync bucket of {cap_bytes} bytes: must be >= 1 byte.")
    buckets: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for piece in _pieces(tensors, keys, cap_bytes):
        if current and size + piece.nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(piece)
        size += piece.nbytes
    if current:
        buckets.append(current)
    return buckets


def _pieces(tensors: Mapping[str, torch.Tensor], keys: list[str], cap_bytes: int):
    for k in keys:
        t = tensors[k]
        nbytes = t.numel() * t.element_size()
        if nbytes <= cap_bytes or t.dim() == 0 or t.shape[0] <= 1:
            yield Piece(k, nbytes)
            continue
        row_bytes = nbytes // t.shape[0]
        step = max(1, cap_bytes // max(row_bytes, 1))
        for start in range(0, t.shape[0], step):
            stop = min(start + step, t.shape[0])
            yield Piece(k, (stop - start) * row_bytes, (start, stop))


def sync_manifest(module: nn.Module, *, full: bool, cap_bytes: int,
                  snapshot: Optional[Mapping[str, torch.Tensor]] = None) -> SyncManifest:
    """The sync of ``module``: every state-dict tensor (``full``), or its trainable parameters
    plus the buffers that differ from ``snapshot`` (None: every buffer)."""
    state = module.state_dict()
    if full:
        keys = list(state)
    else:
        changed = set(changed_buffers(module, snapshot) if snapshot is not None
                      else buffer_snapshot(module))
        trainable = set(trainable_keys(module))
        keys = [k for k in state if k in trainable or k in changed]  # state-dict order
    return SyncManifest(keys, cut_buckets(state, keys, cap_bytes), full, tensor_specs(state, keys))


def tensor_specs(tensors: Mapping[str, torch.Tensor],
                 keys: list[str]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Dtype and shape of each of ``keys``, for :attr:`SyncManifest.specs`."""
    return {k: (tensors[k].dtype, tuple(tensors[k].shape)) for k in keys}


def make_bucket(tensors: Mapping[str, torch.Tensor], pieces: list[Piece]) -> WeightBucket:
    """CPU copies of ``pieces`` of ``tensors`` (a state dict), ready to send."""
    bucket = WeightBucket()
    for p in pieces:
        t = tensors[p.key].detach()
        if p.rows is None:
            bucket.whole[p.key] = t.to("cpu", copy=True)
        else:
            bucket.rows.append((p.key, p.rows[0], t[p.rows[0]:p.rows[1]].to("cpu", copy=True)))
    return bucket


# -- a bucket as one flat buffer (the torch.distributed path) ---------------------------------
@dataclass(frozen=True)
class Slot:
    """Where a piece lies in a flat bucket, and what its bytes are."""

    piece: Piece
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def bucket_layout(pieces: list[Piece], specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
                  ) -> tuple[list[Slot], int]:
    """The slots of ``pieces`` in one flat buffer, in order, each at a multiple of ``ALIGN``
    bytes; and the buffer's bytes. Both ends compute it from the manifest alone.

    >>> specs = {"w": (torch.float32, (3, 2)), "b": (torch.float64, (3,))}
    >>> slots, size = bucket_layout([Piece("w", 16, (1, 3)), Piece("b", 24)], specs)
    >>> [(s.piece.key, s.offset, s.shape) for s in slots], size
    ([('w', 0, (2, 2)), ('b', 16, (3,))], 40)
    """
    slots, offset = [], 0
    for p in pieces:
        dtype, shape = specs[p.key]
        if p.rows is not None:
            shape = (p.rows[1] - p.rows[0], *shape[1:])
        slots.append(Slot(p, offset, dtype, tuple(shape)))
        offset += -(-p.nbytes // ALIGN) * ALIGN
    end = slots[-1].offset + slots[-1].piece.nbytes if slots else 0
    return slots, end


def pack_bucket(tensors: Mapping[str, torch.Tensor], pieces: list[Piece],
                specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                device: str = "cpu", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``pieces`` of ``tensors`` (a state dict) copied into one flat uint8 buffer on
    ``device`` (into ``out`` when given: a uint8 buffer of the layout's bytes), laid out by
    :func:`bucket_layout`."""
    slots, size = bucket_layout(pieces, specs)
    flat = torch.empty(size, dtype=torch.uint8, device=device) if out is None else out
    for s in slots:
        t = tensors[s.piece.key].detach()
        if s.piece.rows is not None:
            t = t[s.piece.rows[0]:s.piece.rows[1]]
        flat[s.offset:s.offset + s.piece.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    return flat


def unpack_bucket(flat: torch.Tensor, pieces: list[Piece],
                  specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> WeightBucket:
    """The bucket a flat buffer holds, its tensors views of ``flat`` (no copy: keep ``flat``
    unchanged until they are loaded).

    >>> state = {"w": torch.arange(6.0).view(3, 2), "b": torch.tensor([1, 2, 3])}
    >>> pieces = [Piece("w", 16, (1, 3)), Piece("b", 24)]
    >>> specs = tensor_specs(state, ["w", "b"])
    >>> bucket = unpack_bucket(pack_bucket(state, pieces, specs), pieces, specs)
    >>> bucket.rows[0][:2], bucket.rows[0][2].tolist(), bucket.whole["b"].tolist()
    (('w', 1), [[2.0, 3.0], [4.0, 5.0]], [1, 2, 3])
    """
    bucket = WeightBucket()
    slots, _ = bucket_layout(pieces, specs)
    for s in slots:
        t = flat[s.offset:s.offset + s.piece.nbytes].view(s.dtype).view(s.shape)
        if s.piece.rows is None:
            bucket.whole[s.piece.key] = t
        else:
            bucket.rows.append((s.piece.key, s.piece.rows[0], t))
    return bucket
