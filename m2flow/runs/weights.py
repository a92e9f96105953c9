"""Shipping a model's weights from the worker that trains it to the workers that run it, at
any size: only what changed, in buckets of bounded bytes, each checked and loaded on arrival.

What changes between two syncs is what the learner writes: its trainable parameters (under
LoRA only the adapters) and the buffers its update changes (observation-normaliser
statistics). Frozen weights never change, so a delta sync leaves them out: at 7B with LoRA
rank 32 that is ~80 MB instead of ~15 GB. A full sync (every tensor of the state dict) is the
first one and the one after a resume: an inference copy need not have built its frozen weights
the same way (a tiny model's random init is not seeded like the learner's; a checkpoint may be
loaded in another dtype), and checking that it did would cost a pass over every frozen weight
anyway, so the first sync simply ships them, once, streamed in buckets.

A bucket holds whole tensors up to ``cap`` bytes; a tensor larger than the cap is cut along
its first dimension into row ranges of at most ``cap`` bytes (a single row larger than the cap
goes alone), so no bucket exceeds the cap except such a row. A bucket travels one of two ways
(``cluster.weight_sync``, :mod:`m2flow.pipelines.link`):

- as one object (one Ray object between processes; :func:`sync_groups` without a link), so
  the object store holds about one bucket at a time;
- as one flat byte buffer broadcast from learner rank 0 over a link, a torch.distributed
  group of it and the rollout ranks (:func:`sync_groups` with a link): the manifest says each
  piece's dtype and shape (``SyncManifest.specs``), so both ends lay the bucket out alike
  (:func:`bucket_layout`), every piece at a multiple of ``ALIGN`` bytes, and the receiver
  reads its pieces as views of the buffer (:func:`unpack_bucket`) that go through the same
  ``WeightReceiver.receive`` as an object does (:meth:`WeightSender.broadcast`,
  :meth:`WeightReceiver.receive_broadcast`).

The receiving side checks names exactly (``load_state_dict(strict=False)`` alone would ignore a
misspelt name and leave a missing one as it was): every name must be one of its own, and by the
end of a sync every announced name must have arrived whole.

The buckets themselves (what to ship, how it is cut, the flat layout) are
:mod:`m2flow.runs.buckets`. One sync is one protocol between two worker classes, which gain it by a mixin each (no
method of theirs passes it through): :class:`SendsWeights` (a learner: prepares the sync and
sends it) and :class:`ReceivesWeights` (a rollout: begins, loads the buckets, finishes). The
driver asks learner rank 0 once (:func:`sync_groups`); it calls the receivers itself
(:func:`push_sync`, given them as :class:`~m2flow.pipelines.Peers`), so the buckets go from
learner to rollout with no driver round trip per bucket.

Imports torch only (the receivers are any value with ``call`` and ``share``, as ``Peers``
has): both workloads use it.

>>> sender = torch.nn.Linear(2, 2)
>>> receiver = torch.nn.Linear(2, 2)
>>> manifest = sync_manifest(sender, full=True, cap_bytes=16)  # weight 16 B, bias 8 B
>>> [[p.key for p in b] for b in manifest.buckets]
[['weight'], ['bias']]
>>> sink = WeightReceiver(receiver)
>>> sink.begin(manifest.keys, full=True)
>>> for b in manifest.buckets:
...     sink.receive(make_bucket(sender.state_dict(), b))
>>> sink.finish()
>>> torch.equal(receiver.weight, sender.weight)
True
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Mapping, Optional, Protocol

import torch
from torch import nn

from m2flow.runs.buckets import (SyncManifest, WeightBucket, bucket_layout, buffer_snapshot,
                                 cut_buckets, make_bucket, pack_bucket, sync_manifest,
                                 tensor_specs, unpack_bucket)

class WeightSyncError(RuntimeError):
    """A sync whose names do not match the receiving model's (a misspelt, unknown or missing
    tensor name): the two sides built different models."""


class Broadcaster(Protocol):
    """What the flat path needs of a link (:class:`m2flow.pipelines.distributed.Link`)."""

    device: str

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor: ...


class Scratch:
    """One reusable flat buffer: a fresh buffer's pages are faulted in as it is first written
    (about as long as the copy itself), so a buffer used for every bucket of every sync
    saves that. Kept between syncs in host memory only (at most one bucket's bytes); a GPU
    buffer is dropped at the end of each sync (``release``)."""

    def __init__(self):
        self._buf: Optional[torch.Tensor] = None

    def get(self, size: int, device: str) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.numel() < size or str(buf.device) != str(torch.device(device)):
            buf = self._buf = torch.empty(size, dtype=torch.uint8, device=device)
        return buf[:size]

    def release(self) -> None:
        """Drops a GPU buffer (host ones stay for the next sync)."""
        if self._buf is not None and self._buf.device.type != "cpu":
            self._buf = None


class WeightSender:
    """The sending side, kept by the worker that trains ``module``: prepares syncs and hands out
    their buckets; remembers the buffers as last shipped, so a delta sync finds the changed
    ones.

    The first sync it prepares is a full one whatever is asked (nothing was shipped before), and
    so is the first after ``reset()`` (call it when the weights were replaced, e.g. loaded).
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self._snapshot: Optional[dict[str, torch.Tensor]] = None
        self._manifest: Optional[SyncManifest] = None
        self._scratch = Scratch()  # the flat buffer each bucket is packed into

    def reset(self) -> None:
        """Forgets what was shipped: the next sync is a full one."""
        self._snapshot, self._manifest = None, None

    def prepare(self, *, full: bool, cap_bytes: int) -> SyncManifest:
        """Prepares the next sync (full: every tensor) in buckets of at most ``cap_bytes`` (see
        :func:`cut_buckets`); its buckets come from ``bucket(i)``."""
        self._manifest = sync_manifest(self.module, full=full or self._snapshot is None,
                                       cap_bytes=cap_bytes, snapshot=self._snapshot)
        self._snapshot = buffer_snapshot(self.module)
        return self._manifest

    def bucket(self, index: int) -> WeightBucket:
        if self._manifest is None or not 0 <= index < len(self._manifest.buckets):
            raise IndexError(f"weight sync bucket {index}: prepare a sync first, then ask for "
                             "buckets 0 to len(manifest.buckets) - 1.")
        return make_bucket(self.module.state_dict(), self._manifest.buckets[index])

    def broadcast(self, link: Broadcaster) -> int:
        """Broadcasts every bucket of the prepared sync over ``link`` (as member 0), each
        packed into one flat buffer (:func:`pack_bucket`); the receivers call
        :meth:`WeightReceiver.receive_broadcast`. Returns the bytes sent."""
        if self._manifest is None:
            raise RuntimeError("weight sync broadcast: prepare a sync first.")
        state, sent = self.module.state_dict(), 0
        for pieces in self._manifest.buckets:
            size = bucket_layout(pieces, self._manifest.specs)[1]
            flat = pack_bucket(state, pieces, self._manifest.specs,
                               out=self._scratch.get(size, link.device))
            link.broadcast(flat, src=0)
            sent += size
        self._scratch.release()
        return sent


# -- the receiving side ------------------------------------------------------------------------
class WeightReceiver:
    """Loads buckets into ``module``, checking names exactly.

    ``begin(keys, full=..., stage=...)`` announces a sync; ``receive(bucket)`` loads a bucket
    as it arrives (``stage=False``) or holds it in host memory (``stage=True``); ``finish()``
    loads what was held and raises :class:`WeightSyncError` unless every announced name arrived
    whole. Staging makes a sync atomic for inferences running meanwhile (they see the old
    weights until ``finish``), at the cost of host memory for the sync's bytes.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self._expected: dict[str, int] = {}  # name -> rows still to come (1 for 0-dim)
        self._held: list[WeightBucket] = []
        self._stage = False
        self._scratch = Scratch()  # the flat buffer buckets arrive in, when not staging

    def begin(self, keys: list[str], *, full: bool, stage: bool = False) -> None:
        own = self.module.state_dict()
        unknown = [k for k in keys if k not in own]
        if unknown:
            raise WeightSyncError(
                f"weight sync: {len(unknown)} tensor name(s) this model does not have, e.g. "
                f"{unknown[0]!r}; sender and receiver must build the same policy config.")
        missing = [k for k in own if k not in set(keys)] if full else []
        if missing:
            raise WeightSyncError(
                f"weight sync: a full sync without {len(missing)} of this model's tensors, e.g. "
                f"{missing[0]!r}; sender and receiver must build the same policy config.")
        self._expected = {k: _rows(own[k]) for k in keys}
        self._held, self._stage = [], stage

    def receive(self, bucket: WeightBucket) -> None:
        for k in list(bucket.whole) + [k for k, _, _ in bucket.rows]:
            if k not in self._expected:
                raise WeightSyncError(f"weight sync: tensor {k!r} was not announced by begin().")
        for k in bucket.whole:
            self._expected[k] = 0
        for k, _, t in bucket.rows:
            self._expected[k] -= t.shape[0]
        if self._stage:
            self._held.append(bucket)
        else:
            self._load(bucket)

    def receive_broadcast(self, link: Broadcaster, manifest: SyncManifest,
                          lock: Optional[AbstractContextManager] = None) -> None:
        """Receives every bucket of ``manifest`` over ``link`` (broadcast by member 0,
        :meth:`WeightSender.broadcast`) and passes each to :meth:`receive`, holding ``lock``
        (if any) only while it does. A staged bucket arrives in a buffer of its own (it is
        held until ``finish``); otherwise every bucket arrives in one reused buffer."""
        for pieces in manifest.buckets:
            size = bucket_layout(pieces, manifest.specs)[1]
            flat = (torch.empty(size, dtype=torch.uint8, device=link.device) if self._stage
                    else self._scratch.get(size, link.device))
            bucket = unpack_bucket(link.broadcast(flat, src=0), pieces, manifest.specs)
            with lock or nullcontext():
                self.receive(bucket)
        self._scratch.release()

    def finish(self) -> None:
        for bucket in self._held:
            self._load(bucket)
        self._held = []
        short = [k for k, left in self._expected.items() if left != 0]
        if short:
            raise WeightSyncError(
                f"weight sync: {len(short)} announced tensor(s) did not arrive whole, e.g. "
                f"{short[0]!r}; every bucket of the manifest must be received before finish().")

    @torch.no_grad()
    def _load(self, bucket: WeightBucket) -> None:
        if bucket.whole:
            result = self.module.load_state_dict(bucket.whole, strict=False)
            if result.unexpected_keys:  # begin() checked the names; a module that renames
                raise WeightSyncError(f"weight sync: {result.unexpected_keys[0]!r} was not "
                                      "loaded by this model.")
        if bucket.rows:
            own = self.module.state_dict()  # tensors sharing the parameters' storage
            for k, start, t in bucket.rows:
                own[k][start:start + t.shape[0]].copy_(t)


def _rows(t: torch.Tensor) -> int:
    """Rows a tensor arrives in: its first dimension (whole tensors count as all of it)."""
    return t.shape[0] if t.dim() > 0 else 1


# -- the protocol: a sender, its receivers, one driver call per sync --------------------------
class SendsWeights:
    """What a worker class that trains a model gains to send its weights (a mixin of a
    :class:`~m2flow.pipelines.Worker`): it sets ``self.weights`` to a :class:`WeightSender` of
    the model. The driver asks its rank 0 once per sync (:func:`sync_groups`), and it sends
    the sync to the receivers itself (:func:`push_sync`): no bucket passes through the driver,
    and the driver's calls do not grow with the number of buckets."""

    weights: WeightSender

    def prepare_weight_sync(self, *, full: bool = False, bucket_mb: float) -> SyncManifest:
        """Plans a sync to the inference copies: everything (``full``; the first sync and the
        one after a load are full whatever is asked) or what an update changes (the trainable
        parameters and the buffers changed since the last sync), in buckets of at most
        ``bucket_mb`` MB; the buckets come from ``weight_bucket``."""
        return self.weights.prepare(full=full, cap_bytes=max(1, int(bucket_mb * 2**20)))

    def weight_bucket(self, *, index: int) -> WeightBucket:
        """CPU copies of bucket ``index`` of the prepared sync."""
        return self.weights.bucket(index)

    def send_weights(self, receivers, *, version: int, full: bool, bucket_mb: float,
                     link: Optional[str] = None) -> None:
        """Prepares a sync (``prepare_weight_sync``) and sends it to every rank of
        ``receivers`` (:class:`~m2flow.pipelines.Peers` of a group of :class:`ReceivesWeights`
        workers), which then hold weights ``version``: each bucket as one object, or, with
        ``link`` (a link between this rank and the receivers), broadcast over it."""
        manifest = self.prepare_weight_sync(full=full, bucket_mb=bucket_mb)
        broadcast = (None if link is None else
                     (link, lambda: self.weights.broadcast(self.link(link))))
        push_sync(receivers, manifest, self.weights.bucket, version=version, broadcast=broadcast)


class ReceivesWeights:
    """What a worker class that holds an inference copy gains to receive weights (a mixin of a
    :class:`~m2flow.pipelines.Worker`): it defines ``weight_receiver()`` (what loads buckets
    into its copy: a :class:`WeightReceiver`, or an engine's own), and may set ``weight_lock``
    and ``stage_delta_syncs``. Each call is timed as ``weight_sync``; after ``finish_weight_sync``
    ``self.version`` is the version ``begin_weight_sync`` announced."""

    stage_delta_syncs: bool = False
    """True: a delta sync is held in host memory and loaded at once by ``finish_weight_sync``,
    so an inference running meanwhile (learner overlap) sees one set of weights; a full sync
    (at start, after a resume: nothing is being served) still loads each bucket as it arrives,
    so host memory holds one bucket. False: every bucket loads as it arrives (nothing infers
    while weights arrive)."""
    weight_lock: Optional[AbstractContextManager] = None
    """Held while a bucket loads (and at ``finish_weight_sync``): the lock inference holds."""
    version: int = 0
    _next_version: int = 0

    def weight_receiver(self) -> WeightReceiver:
        """What loads the buckets into this worker's inference copy."""
        raise NotImplementedError(f"{type(self).__name__} receives weights: define "
                                  "weight_receiver() (runs.weights.ReceivesWeights).")

    def _weight_lock(self) -> AbstractContextManager:
        return nullcontext() if self.weight_lock is None else self.weight_lock

    def begin_weight_sync(self, manifest: SyncManifest, *, version: int) -> None:
        """Announces a sync of ``manifest.keys`` (an unknown name, or a full sync missing one
        of this copy's, is a :class:`WeightSyncError` here)."""
        with self.timer("weight_sync"):
            self.weight_receiver().begin(manifest.keys, full=manifest.full,
                                         stage=self.stage_delta_syncs and not manifest.full)
            self._next_version = version

    def receive_weight_bucket(self, bucket: WeightBucket) -> None:
        """Loads (or stages) one bucket into the copy's own tensors: into host memory while it
        is offloaded (the next onload carries them to the device)."""
        with self.timer("weight_sync"), self._weight_lock():
            self.weight_receiver().receive(bucket)

    def receive_weight_broadcast(self, manifest: SyncManifest, *, link: str) -> None:
        """Receives every bucket of ``manifest`` over link ``link`` (broadcast by the sender,
        :meth:`WeightSender.broadcast`) and loads (or stages) each as ``receive_weight_bucket``
        does; inference goes on while a bucket is in flight."""
        with self.timer("weight_sync"):
            self.weight_receiver().receive_broadcast(self.link(link), manifest,
                                                     lock=self.weight_lock)

    def finish_weight_sync(self) -> None:
        """Loads the staged buckets; the copy is now the announced version. Raises
        :class:`WeightSyncError` if an announced tensor did not arrive whole."""
        with self.timer("weight_sync"), self._weight_lock():
            self.weight_receiver().finish()
            self.version = self._next_version


def push_sync(receivers, manifest: SyncManifest, bucket: Callable[[int], WeightBucket], *,
              version: int, broadcast: Optional[tuple[str, Callable[[], object]]] = None
              ) -> None:
    """Sends the sync ``manifest`` to every rank of ``receivers`` (:class:`~m2flow.pipelines.Peers`
    of :class:`ReceivesWeights` workers), from wherever this runs: a learner rank
    (``SendsWeights.send_weights``) or the driver (:func:`send_state`). The receivers are
    called directly: ``begin_weight_sync``; then each bucket (``bucket(i)``) as one object
    that every receiver fetches from this process, the next made once the receivers have
    loaded the last (the object store holds one bucket at a time); or, with ``broadcast``
    (a link's name and the call that broadcasts the buckets over it as member 0),
    ``receive_weight_broadcast`` on every receiver while this process broadcasts;
    ``finish_weight_sync``. A receiver's failure or death is raised here; waits have no
    time limit, as a driver's wait on the receivers has none (a broadcast has the link's)."""
    receivers.call(ReceivesWeights.begin_weight_sync, manifest, version=version).wait()
    if broadcast is not None:
        link, send = broadcast
        arriving = receivers.call(ReceivesWeights.receive_weight_broadcast, manifest, link=link)
        send()
        arriving.wait()
    else:
        for i in range(len(manifest.buckets)):
            receivers.call(ReceivesWeights.receive_weight_bucket,
                           receivers.share(bucket(i))).wait()
    receivers.call(ReceivesWeights.finish_weight_sync).wait()


# -- the driver's side: one call per sync ------------------------------------------------------
def sync_groups(learner, rollout, *, version: int, full: bool, bucket_mb: float,
                link: Optional[str] = None) -> None:
    """One sync from rank 0 of ``learner`` (a group of :class:`SendsWeights` workers) to every
    rank of ``rollout`` (:class:`ReceivesWeights` workers): one call, on learner rank 0
    (``send_weights``), whatever the number of buckets; the buckets go from it to the rollout
    ranks directly (:func:`push_sync`), each as one Ray object, or with ``link`` (the name of a
    link formed between learner rank 0 and the rollout ranks,
    :func:`m2flow.pipelines.link.form_link`) broadcast over it."""
    learner.call(SendsWeights.send_weights, rollout.peers(), version=version, full=full,
                 bucket_mb=bucket_mb, link=link, ranks=[0]).wait()


def send_state(rollout, state: Mapping[str, torch.Tensor], *, version: int,
               bucket_mb: float) -> None:
    """A whole state dict held by the driver (a checkpoint's weights, for evaluation) to every
    rank of ``rollout`` (:class:`ReceivesWeights` workers), in buckets as a learner sends them
    (:func:`push_sync`, from the driver)."""
    cap = max(1, int(bucket_mb * 2**20))
    manifest = SyncManifest(list(state), cut_buckets(state, list(state), cap), full=True,
                            specs=tensor_specs(state, list(state)))
    push_sync(rollout.peers(), manifest, lambda i: make_bucket(state, manifest.buckets[i]),
              version=version)
