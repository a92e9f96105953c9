"""Checkpoints written atomically: a temp file in the same directory, fsync, then rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch


def save(path: str | os.PathLike, state: dict) -> Path:
    """Writes ``state`` to ``path``; a crash mid-write leaves the old file (or none), never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def link_latest(path: Path, latest_name: str = "last.pt") -> Path:
    """Points ``<dir>/last.pt`` at ``path`` atomically (a hard link renamed over the old one)."""
    latest = path.parent / latest_name
    tmp = path.parent / f".{latest_name}.tmp"
    if tmp.exists():
        tmp.unlink()
    os.link(path, tmp)
    os.replace(tmp, latest)
    return latest


def load(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} does not exist; pass the path of a .pt file written by "
            "m2flow-train (runs/<name>/<time>/checkpoints/last.pt)."
        )
    return torch.load(path, map_location="cpu", weights_only=False)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
