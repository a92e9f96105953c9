"""Errors the engine raises for people to read, and a worker's failure in one line."""

from __future__ import annotations

from typing import Optional

_RAISED_BY = "_m2flow_raised_by"  # the attribute that names the worker an exception came from
MAX_MESSAGE_CHARS = 400  # of an exception's message in a failure's line (the log has it all)


class PlacementError(ValueError):
    """A placement asks for resources the cluster does not have, or breaks its mode's rule."""


class WorkerError(RuntimeError):
    """A worker died, or a call on it failed; the message names the group, rank and method."""


class WorkerDied(WorkerError):
    """A worker's process died during a call (killed, crashed) or before it; the message names
    the group, rank, method and process. Its peers fail with it (a channel to it breaks, a wait
    on it times out): this is the failure to report."""


class WorkerStalled(WorkerError):
    """A worker made no progress for longer than its phase's limit without dying (stopped,
    deadlocked, stuck in native code; :mod:`m2flow.pipelines.watchdog`): the message names the
    worker itself (not one that waited on it), the seconds and the limit; ``worker`` is
    ``"group[rank r]"``."""

    def __init__(self, message: str, worker: str = ""):
        super().__init__(message)
        self.worker = worker


class OutOfMemory(WorkerDied):
    """A worker was killed because its machine ran out of memory (Ray's memory monitor); the
    message names the worker and, where Ray said, the node's memory used and its limit."""


def oom_summary(ray_message: str) -> str:
    """What Ray's out-of-memory text says, in one clause: the node's memory and who was killed.

    >>> oom_summary("1 worker(s) were killed due to the node running low on memory. Memory on "
    ...   "the node (IP: 10.0.0.2, ID: 71a) was 22.34GB used / 23.54GB limit (0.949)\\n"
    ...   "Selected to kill: (Actor(b08): job ID=01, task name=LearnerWorker.update, "
    ...   "pid=27872, actual memory used=1.65GB, worker ID=bed)")
    "killed by Ray's memory monitor with the node at 22.34GB used of 23.54GB (the killed process used 1.65GB)"
    """
    import re

    node = re.search(r"was ([\d.]+\s*[KMGT]?B) used / ([\d.]+\s*[KMGT]?B) limit", ray_message)
    killed = re.search(r"Selected to kill:.*?actual memory used=([\d.]+\s*[KMGT]?B)",
                       ray_message, re.S)
    text = "killed by Ray's memory monitor"
    if node:
        text += f" with the node at {node[1]} used of {node[2]}"
    if killed:
        text += f" (the killed process used {killed[1]})"
    return text


def mark_raised_by(exc: BaseException, where: str) -> None:
    """Records that ``exc`` was raised in a worker (``where``: ``worker env[rank 0] in
    collect()``); :func:`raised_by` reads it back."""
    try:
        setattr(exc, _RAISED_BY, where)
    except AttributeError:  # an exception type without attributes: only its note says so
        pass


def raised_by(exc: BaseException) -> Optional[str]:
    """The worker and method ``exc`` was raised in (None: raised here, by the driver)."""
    return getattr(exc, _RAISED_BY, None)


def failure_cause(exc: BaseException) -> str:
    """A failure in one clause: the worker, its method, and its exception's type and message;
    a worker's death or a wait that timed out as the driver saw it; or what the driver raised.

    >>> e = ValueError("the counter cannot take action 99")
    >>> mark_raised_by(e, "worker env[rank 0] in collect()")
    >>> failure_cause(e)
    'worker env[rank 0] in collect(): ValueError: the counter cannot take action 99'
    >>> failure_cause(WorkerDied("worker rollout[rank 0] in serve(): its process died."))
    'worker rollout[rank 0] in serve(): its process died.'
    >>> failure_cause(KeyError("obs"))
    "the driver raised KeyError: 'obs'"
    """
    where = raised_by(exc)
    text = one_line(str(exc))
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[:MAX_MESSAGE_CHARS].rstrip() + " ..."
    if where is None and isinstance(exc, WorkerError):  # the driver's words, naming the worker
        return text
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return f"{where}: {text}" if where else f"the driver raised {text}"


def one_line(text: str) -> str:
    """``text`` on one line: its lines joined; of a traceback within it, only its last line
    (the exception).

    >>> one_line("env process 1 raised during step:\\nTraceback (most recent call last):\\n"
    ...          '  File "x.py", line 3, in step\\nValueError: action 99')
    'env process 1 raised during step: ValueError: action 99'
    """
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    head = next((i for i, line in enumerate(lines) if line.startswith("Traceback (")), None)
    if head is None:
        return " ".join(lines)
    return " ".join(lines[:head] + lines[-1:])
