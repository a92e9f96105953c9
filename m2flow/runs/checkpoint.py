"""Checkpoints written atomically: a temp file in the same directory, fsync, then rename.

What a worker returns for a checkpoint is moved to host memory first (``tree_to(state,
"cpu")``): a CUDA tensor sent through Ray would need a GPU in the driver to unpickle, and the
driver (which saves) may have none. Loading moves it back: ``Module.load_state_dict`` copies
into the parameters where they are, and ``Optimizer.load_state_dict`` casts each state tensor
to its parameter's device and dtype (torch/optim/optimizer.py,
``_process_value_according_to_param_policy``; Adam's ``step`` stays where it was saved).
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional, Sequence

import torch


def tree_to(obj: Any, device: str | torch.device) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples moved to ``device`` (a tensor
    already there is not copied); other leaves stay as they are.

    >>> out = tree_to({"state": {0: {"exp_avg": torch.ones(2), "step": 3}}, "ids": [0]}, "meta")
    >>> out["state"][0]["exp_avg"].device, out["state"][0]["step"], out["ids"]
    (device(type='meta'), 3, [0])
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device)
    if isinstance(obj, dict):
        moved = {k: tree_to(v, device) for k, v in obj.items()}
        return OrderedDict(moved) if isinstance(obj, OrderedDict) else moved
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):  # not a namedtuple
        return type(obj)(tree_to(v, device) for v in obj)
    return obj


def save(path: str | os.PathLike, state: dict) -> Path:
    """Writes ``state`` to ``path``; a crash mid-write leaves the old file (or none), never
    half. A write the system refuses (ENOSPC, EIO, ...) removes the temp file and raises a
    :class:`CheckpointWriteError` naming ``path`` and the reason."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise CheckpointWriteError(path, e) from e
        if isinstance(e, RuntimeError) and _os_cause(e) is not None:  # torch's zip writer
            raise CheckpointWriteError(path, _os_cause(e)) from e
        raise
    return path


def _version() -> str:
    from m2flow import __version__

    return __version__


def stamp() -> dict:
    """What every checkpoint records of the code that wrote it: ``format`` and
    ``m2flow_version``."""
    return {"format": FORMAT, "m2flow_version": _version()}


def _os_cause(e: BaseException) -> Optional[OSError]:
    """The OSError under ``e`` (its ``__cause__``/``__context__`` chain), if any."""
    while e is not None:
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


FORMAT = 1
"""The layout of the checkpoints this code writes (``state["format"]``, beside
``state["m2flow_version"]``), raised when a change leaves older code unable to read them.
``load`` refuses a newer format in one line; checkpoints from before the tag are format 1."""

LAST, BEST = "last.pt", "best.pt"  # hard links to the newest and the best checkpoint


def link_latest(path: Path, latest_name: str = LAST) -> Path:
    """Points ``<dir>/<latest_name>`` (``last.pt``, or ``best.pt``) at ``path`` atomically (a
    hard link renamed over the old one)."""
    latest = path.parent / latest_name
    tmp = path.parent / f".{latest_name}.tmp"
    if tmp.exists():
        tmp.unlink()
    os.link(path, tmp)
    os.replace(tmp, latest)
    return latest


def load(path: str | os.PathLike, workload: Optional[str] = None, mmap: bool = False) -> dict:
    """The state saved at ``path``. ``workload``: the workload that must have written it
    (checkpoints from before the tag are embodied ones). Every problem is one ``CheckpointError``
    line naming the path and the fix. ``mmap``: map the tensors instead of reading them (cheap
    checks of a large file)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not exist; pass a .pt file written by "
            "m2flow-train (runs/<name>/<time>/checkpoints/last.pt), its run directory "
            "(runs/<name>/<time>) or its run name's folder (runs/<name>: the newest run)."
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint m2flow can read ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); pass a .pt file written by m2flow-train."
        ) from None
    if not isinstance(state, dict) or "config" not in state or "learner" not in state:
        raise CheckpointError(
            f"{str(path)!r} is a torch file but not an m2flow checkpoint (no config and learner "
            "state); pass a .pt file written by m2flow-train."
        )
    fmt = state.get("format", 1)
    if not isinstance(fmt, int) or fmt > FORMAT:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was written by m2flow "
            f"{state.get('m2flow_version', '(unknown version)')} in checkpoint format {fmt}; "
            f"this m2flow ({_version()}) reads formats up to {FORMAT}: use that m2flow "
            "version or a newer one."
        )
    found = state.get("workload", "embodied")
    if workload is not None and found != workload:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was written by a {found} run, not a {workload} one; "
            f"resume it with its own config (m2flow-eval checkpoint=... picks it up itself)."
        )
    return state


def newest_good(path: str | os.PathLike, workload: Optional[str] = None) -> Optional[Path]:
    """The newest other checkpoint beside ``path`` (``iter_*.pt`` of its folder, newest
    first) that ``load`` reads, mapped; None if there is none. What a refused checkpoint's
    line offers instead of it."""
    path = Path(path)
    try:
        bad = path.stat()
    except OSError:
        bad = None
    for cand in sorted(path.parent.glob("iter_*.pt"), reverse=True):
        st = cand.stat()
        if bad is not None and (st.st_ino, st.st_dev) == (bad.st_ino, bad.st_dev):
            continue  # the refused file itself, or a hard link to it (last.pt)
        try:
            load(cand, workload=workload, mmap=True)
        except CheckpointError:
            continue
        return cand
    return None


def prune(folder: Path, keep: int, pattern: str = "iter_*.pt",
          protect: Sequence[str] = (BEST,)) -> list[Path]:
    """Deletes all but the newest ``keep`` files matching ``pattern`` (0: keep all), except a
    file that a link named in ``protect`` (``best.pt``) points at. ``last.pt`` is a hard link,
    so the newest file stays readable under both names. Returns the deleted."""
    if keep <= 0:
        return []
    files = sorted(folder.glob(pattern))  # zero-padded iteration numbers sort in order
    links = [folder / name for name in protect if (folder / name).is_file()]
    gone = [f for f in files[:-keep] if not any(os.path.samefile(f, link) for link in links)]
    for f in gone:
        f.unlink(missing_ok=True)
    return gone


def find_latest(log_dir: str | os.PathLike, run_name: str) -> Optional[Path]:
    """The newest checkpoint of the runs called ``run_name``: of the ``last.pt`` files under
    ``<log_dir>/<run_name>/<time>/checkpoints/``, the one written last, as the ``iter_*.pt``
    (or ``step_*.pt``) file it points at; None if there is none."""
    runs = Path(log_dir).expanduser() / run_name
    found = [p for p in runs.glob(f"*/checkpoints/{LAST}") if p.is_file()]
    if not found:
        return None
    newest = max(found, key=lambda p: (p.stat().st_mtime_ns, p.parent.parent.name))
    named = [f for f in sorted(newest.parent.glob("*_*.pt")) if os.path.samefile(f, newest)]
    return named[-1] if named else newest


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint file ``path`` names: a file is itself; a run directory
    (``runs/<name>/<time>``) is its newest checkpoint (what its ``last.pt`` points at); a
    folder of runs (``runs/<name>``) is the newest checkpoint of its runs. Anything else is a
    :class:`CheckpointError` saying what was looked for."""
    p = Path(path).expanduser()
    if p.is_file() or not p.is_dir():
        return p  # a missing path: load() says so
    if (p / "checkpoints").is_dir():
        last = p / "checkpoints" / LAST
        if not last.is_file():
            raise CheckpointError(f"{p} is a run directory without a checkpoint yet "
                                  f"(no {last}).")
        named = [f for f in sorted(last.parent.glob("*_*.pt")) if os.path.samefile(f, last)]
        return named[-1] if named else last
    found = find_latest(p.parent, p.name)
    if found is None:
        raise CheckpointError(f"{p} is a folder with no run checkpoint in it (looked for "
                              f"{p}/*/checkpoints/{LAST}); give a .pt file or a run directory.")
    return found


def missing_weights(own: dict[str, torch.Size], given: dict[str, torch.Tensor],
                    source: str) -> list[str]:
    """The names of ``own`` (a model's tensor shapes by name) that ``given`` (a checkpoint's
    weights) lacks: they keep their initial values when ``given`` is loaded. A tensor of
    ``given`` the model has no place for, or of another shape, is a :class:`CheckpointError`
    naming it and ``source``: the checkpoint was written for another policy.

    >>> missing_weights({"a": torch.Size([2]), "v": torch.Size([1])}, {"a": torch.ones(2)}, "x")
    ['v']
    >>> missing_weights({"a": torch.Size([2])}, {"a": torch.ones(3)}, "init_from=x.pt")
    Traceback (most recent call last):
    ...
    m2flow.runs.checkpoint.CheckpointError: init_from=x.pt: its tensor 'a' has shape (3,) where this policy's has (2,); start from a checkpoint of the same policy (policy= and its settings as the run that wrote it).
    """
    fix = "start from a checkpoint of the same policy (policy= and its settings as the run " \
          "that wrote it)."
    extra = sorted(set(given) - set(own))
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise CheckpointError(f"{source}: this policy has no tensor named "
                              f"{', '.join(map(repr, extra[:3]))}{more}; {fix}")
    for name, tensor in given.items():
        if tuple(tensor.shape) != tuple(own[name]):
            raise CheckpointError(
                f"{source}: its tensor {name!r} has shape {tuple(tensor.shape)} where this "
                f"policy's has {tuple(own[name])}; {fix}")
    return sorted(set(own) - set(given))


class CheckpointError(ValueError):
    """A path that is not a readable checkpoint of the expected workload."""


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (a full disk, an I/O error): the file it was
    to be and the system's reason. Nothing was overwritten: ``save`` writes a temp file and
    renames it, so the checkpoint before it (and ``last.pt``) still loads."""

    def __init__(self, path: Path, cause: OSError):
        reason = os.strerror(cause.errno) if cause.errno else str(cause)
        code = errno.errorcode.get(cause.errno, "") if cause.errno else ""
        super().__init__(cause.errno, f"could not write {path} ({code + ': ' if code else ''}"
                                      f"{reason}); nothing was overwritten")
        self.path = path

    def __str__(self) -> str:
        return self.strerror


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
