"""Large observation arrays from a simulator process to its parent through shared memory.

A simulator process answers each step with a pickled message on a pipe. For an image (49 KiB
at 128 px; LIBERO sends two, and a step whose episode ended carries two observations) that is
a copy into the pickle, a pipe transfer in 64 KiB pieces, and another copy out of it in the
parent. With an :class:`ObsBlock`, the process writes those arrays into a shared-memory block
its parent created for it and sends the rest of the message with :data:`IN_BLOCK` in their
place; the parent copies them out before it sends its next command (the only time the process
writes the block). Small arrays (state vectors) stay in the message, where they cost less.

The parent owns the block: it creates it, keeps it across restarts of the process (the
replacement attaches to it by name) and unlinks it on close. A process only attaches.
"""

from __future__ import annotations

import copy
import os
import secrets
import sys
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, Optional

import gymnasium as gym
import numpy as np

MODES = ("auto", "on", "off")
MIN_BYTES = 16 * 1024  # 'auto': arrays at least this large go through the block
ALIGN = 64  # each array starts on a cache line
# a step's result holds two observations: the one to act on, and the one the step ended in
# (a different one only where the episode ended and the env was reset)
OBS, FINAL_OBS = 0, 1
REGIONS = 2


class _InBlock:
    """Stands in a message for an array that is in the block (pickled by name: one object)."""

    def __reduce__(self):
        return "IN_BLOCK"

    def __repr__(self):
        return "IN_BLOCK"


IN_BLOCK = _InBlock()


@dataclass(frozen=True)
class Field:
    """One observation array in the block: ``key`` in a dict observation (None: the whole
    observation is this array), at ``offset`` bytes into its region."""

    key: Optional[str]
    offset: int
    shape: tuple
    dtype: str


def layout(space: gym.Space, mode: str) -> tuple[tuple[Field, ...], int]:
    """The arrays of an observation from ``space`` that go through a block in ``mode``, and
    the bytes they take (one region); ``((), 0)`` where none does.

    'auto': fixed-shape Box arrays of at least :data:`MIN_BYTES`; 'on': every one; 'off': none.
    Only a Box space or the Box entries of a flat Dict space qualify.

    >>> space = gym.spaces.Dict({"state": gym.spaces.Box(-1, 1, (25,)),
    ...                          "rgb": gym.spaces.Box(0, 255, (128, 128, 3), np.uint8)})
    >>> layout(space, "auto")
    ((Field(key='rgb', offset=0, shape=(128, 128, 3), dtype='|u1'),), 49152)
    """
    if mode not in MODES:
        raise ValueError(f"shared_memory={mode!r}: use one of {list(MODES)}.")
    if isinstance(space, gym.spaces.Dict):
        entries = list(space.spaces.items())
    else:
        entries = [(None, space)]
    min_bytes = {"auto": MIN_BYTES, "on": 0, "off": None}[mode]
    fields, offset = [], 0
    for key, sub in entries:
        if min_bytes is None or not isinstance(sub, gym.spaces.Box):
            continue
        dtype = np.dtype(sub.dtype)
        nbytes = int(np.prod(sub.shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0 or nbytes < min_bytes:
            continue
        fields.append(Field(key, offset, tuple(sub.shape), dtype.str))
        offset += -(-nbytes // ALIGN) * ALIGN
    return tuple(fields), offset


class ObsBlock:
    """One simulator process's block: :data:`REGIONS` regions of ``region_bytes`` each, laid
    out as ``fields`` say. Made by :meth:`create` (the parent) or :meth:`attach` (the process).

    >>> space = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
    >>> parent = ObsBlock.create(*layout(space, "on"), tag="doc")
    >>> child = ObsBlock.attach(parent.name, parent.fields, parent.region_bytes)
    >>> sent = child.put(np.full((64, 64, 3), 7, np.uint8), OBS)
    >>> sent, parent.take(sent, OBS)[0, 0]
    (IN_BLOCK, array([7, 7, 7], dtype=uint8))
    >>> child.close(); parent.close(unlink=True)
    """

    def __init__(self, shm: shared_memory.SharedMemory, fields: tuple, region_bytes: int):
        self.shm, self.fields, self.region_bytes = shm, tuple(fields), region_bytes
        self._views = [
            {f.key: np.ndarray(f.shape, np.dtype(f.dtype), buffer=shm.buf,
                               offset=r * region_bytes + f.offset) for f in self.fields}
            for r in range(REGIONS)
        ]

    @property
    def name(self) -> str:
        return self.shm.name

    @classmethod
    def create(cls, fields: tuple, region_bytes: int, *, tag: str) -> "ObsBlock":
        """A new block, named ``m2flow-<pid>-<tag>-<random>`` (the parent's: it unlinks it)."""
        name = f"m2flow-{os.getpid()}-{tag}-{secrets.token_hex(4)}"
        shm = shared_memory.SharedMemory(name, create=True, size=REGIONS * region_bytes)
        return cls(shm, fields, region_bytes)

    @classmethod
    def attach(cls, name: str, fields: tuple, region_bytes: int) -> "ObsBlock":
        """The parent's block ``name``, in a simulator process."""
        if sys.version_info >= (3, 13):  # only the parent, who unlinks it, tracks it
            shm = shared_memory.SharedMemory(name, track=False)
        else:
            # registers the name with the resource tracker again; a process forked from the
            # fork server shares its parent's tracker, which keeps a set of names, so the
            # parent's unlink (and unregister) still leaves nothing to clean up or warn about
            shm = shared_memory.SharedMemory(name)
        return cls(shm, fields, region_bytes)

    def put(self, obs: Any, region: int) -> Any:
        """Writes ``obs``'s block arrays into ``region``; returns ``obs`` with :data:`IN_BLOCK`
        in their place (a copy: ``obs`` is left as it was). An array whose shape or dtype is
        not the space's stays in the message."""
        views = self._views[region]
        if not isinstance(obs, dict):
            return IN_BLOCK if self._write(views.get(None), obs) else obs
        out = copy.copy(obs)
        for key, view in views.items():
            if self._write(view, obs.get(key)):
                out[key] = IN_BLOCK
        return out

    def take(self, obs: Any, region: int) -> Any:
        """``obs`` as :meth:`put` was given it: :data:`IN_BLOCK` replaced by copies of the
        region's arrays (the block is overwritten by the next step). Fills a dict in place."""
        views = self._views[region]
        if obs is IN_BLOCK:
            return views[None].copy()
        if isinstance(obs, dict):
            for key, view in views.items():
                if obs.get(key) is IN_BLOCK:
                    obs[key] = view.copy()
        return obs

    def close(self, unlink: bool = False) -> None:
        """Unmaps the block (and removes its name if ``unlink``); safe to call twice."""
        if self._views is None:
            return
        self._views = None  # they export the mapping's buffer: close() refuses while they live
        self.shm.close()
        if unlink:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass

    def __del__(self):  # unmapped before SharedMemory's own __del__, which the views would fail
        self.close()

    @staticmethod
    def _write(view: Optional[np.ndarray], arr) -> bool:
        if view is None or not isinstance(arr, np.ndarray):
            return False
        if arr.shape != view.shape or arr.dtype != view.dtype:
            return False
        np.copyto(view, arr)
        return True
