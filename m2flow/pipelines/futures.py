"""Waiting on workers: the futures of a group's call, ``gather``, and stopping a wait.

The driver waits on workers in slices of ``WAIT_SLICE_S``, so it stays responsive: a worker's
failure is raised as soon as it happens, and once the calls' stop event is set (their cluster's
``stop``: the run's ``RunControl``, set by Ctrl-C) every wait raises :class:`Stopped` within a
slice instead of running to the end of the phase. The event travels with the calls (each
:class:`Futures` holds its group's), so two runs in one process never stop each other.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import threading
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

from m2flow.pipelines.errors import (
    OutOfMemory,
    WorkerDied,
    WorkerError,
    failure_cause,
    mark_raised_by,
    oom_summary,
    raised_by,
)

if TYPE_CHECKING:
    from m2flow.pipelines.watchdog import Watchdog

WAIT_SLICE_S = 0.2  # the driver looks for a stop request at least this often while it waits
# a worker that dies makes its peers fail within moments (a channel to it breaks): after a
# failure, the calls still pending get this long to show a death, the failure to report
DEATH_GRACE_S = 1.0


class Stopped(Exception):
    """The run was asked to stop (its stop event set, e.g. by Ctrl-C) while the driver waited on
    workers; the calls it was waiting on (``waiting_on``: ``["env.collect()", ...]``) are
    abandoned: they end when their group shuts down."""

    def __init__(self, waiting_on: Sequence[str]):
        super().__init__(f"stop requested while waiting on {', '.join(waiting_on) or 'nothing'}")
        self.waiting_on = list(waiting_on)


class Futures:
    """Results of one call on several ranks. ``wait()`` fails fast on the first error.

    ``stop``: the event that ends a stoppable wait on them (their group's cluster's); None: a
    wait on them ends on its own only (a worker calling its peers in its own process).
    ``watchdog``: the run's (their cluster's), which a wait on them from its thread consults
    (:mod:`m2flow.pipelines.watchdog`); None: none."""

    def __init__(self, group: str, method: str, items: list, backend: str,
                 stop: Optional[threading.Event] = None, watchdog: Optional[Watchdog] = None):
        self.group, self.method, self.items, self.backend = group, method, items, backend
        self.stop = stop
        self.watchdog = watchdog

    def wait(self, timeout: Optional[float] = None, *, stoppable: bool = True) -> list:
        """Per-rank results (see :func:`gather`)."""
        return gather(self, timeout=timeout, stoppable=stoppable)[0]

    def later(self) -> Any:
        """The first rank's result as a constructor argument of workers launched before it is
        known (``WorkerGroup.launch``): under Ray a :class:`Later`, which the constructor turns
        into the result with :func:`resolve`; in process the result itself, waited on now (an
        in-process worker is built in the caller's thread, when it is launched)."""
        if self.backend != "ray":
            return self.wait()[0]
        return Later(self)


class Later:
    """One rank's result of a call, handed to workers of another group before it is known.

    Ray starts an actor's process only once the object refs among its constructor's
    arguments are ready, but a ref nested in a value is not waited for: a ``Later`` carries
    the call's ref that way, so the process starts (and imports what it needs) at once, and
    its constructor waits for the value in :func:`resolve`. The group it is handed to waits
    on the call before it waits on its own constructors (``WorkerGroup.started``), so a
    failed call is reported as the call's own failure, naming its worker."""

    def __init__(self, futures: Futures):
        self.futures: Optional[Futures] = futures  # the driver's; not pickled
        self.ref = futures.items[0][1]

    def __getstate__(self) -> dict:
        return {"futures": None, "ref": self.ref}


def resolve(value: Any) -> Any:
    """``value`` itself, or for a :class:`Later` the call's result, waited for here (in a
    worker's constructor). A call that failed does not raise here: this worker waits to be
    ended, and the driver, which waits on the call before it waits on this constructor,
    reports the failure and ends it; an error raised here would add Ray's account of this
    constructor's failure to the run's output, after the run's own line."""
    if not isinstance(value, Later):
        return value
    import ray

    try:
        return ray.get(value.ref)
    except Exception:  # the driver reports the call's failure and ends this worker
        threading.Event().wait()


def gather(*futures: Futures, timeout: Optional[float] = None,
           stoppable: bool = True) -> list[list]:
    """Waits for several calls at once, raising the first failure as soon as it happens; a
    failure that a peer's death caused (a channel to it broke) gives way to that death if it
    shows within ``DEATH_GRACE_S`` (Ray), and one that a stalled peer caused (a channel
    timed out waiting on it) to that stall. While it waits, the calls' watchdog
    (:mod:`m2flow.pipelines.watchdog`) raises ``WorkerStalled`` for a worker that makes no
    progress.

    Waiting on env and rollout together matters: if the env worker dies, the rollout worker
    would otherwise block on its channel and the run would hang instead of failing.

    Args:
        timeout: seconds before a ``WorkerError`` naming a call still pending (None: no limit).
        stoppable: raise :class:`Stopped` within ``WAIT_SLICE_S`` once the stop event of
            any of ``futures`` is set; False for a wait that must end on its own (saving a
            checkpoint).
    """
    results = [[None] * len(f.items) for f in futures]
    pending = {}
    for i, f in enumerate(futures):
        for j, (rank, fut) in enumerate(f.items):
            pending[fut] = (i, j, rank, f)
    deadline = None if timeout is None else time.monotonic() + timeout
    backends = {f.backend for f in futures}
    if len(backends) > 1:
        raise ValueError("gather() takes calls of one backend at a time.")
    backend = backends.pop() if backends else "local"
    watch = next((f.watchdog for f in futures
                  if f.watchdog is not None and f.watchdog.mine()), None)
    stops = list({id(f.stop): f.stop for f in futures if f.stop is not None}.values())
    progress_at = time.monotonic()  # the wait's start, or its last call that finished
    while pending:
        if stoppable and any(s.is_set() for s in stops):
            raise Stopped(list(dict.fromkeys(f"{f.group}.{f.method}()"
                                             for _, _, _, f in pending.values())))
        left = WAIT_SLICE_S if deadline is None else max(0.0, min(WAIT_SLICE_S,
                                                                  deadline - time.monotonic()))
        done = _wait_any(list(pending), left, backend)
        if done:
            progress_at = time.monotonic()
        elif watch is not None:  # a stalled worker ends the wait (pipelines.watchdog)
            watch.tick([f"{f.group}[rank {rank}] in {f.method}()"
                        for _, _, rank, f in pending.values()], progress_at)
        if not done and deadline is not None and time.monotonic() >= deadline:
            _, _, rank, f = next(iter(pending.values()))
            raise WorkerError(
                f"{f.group}[rank {rank}].{f.method}() did not finish within {timeout:g} s."
            )
        for fut in done:
            i, j, rank, f = pending.pop(fut)
            try:
                results[i][j] = _result(fut, f, rank)
            except Exception as e:
                cause = None
                if not isinstance(e, WorkerDied):  # a peer that died or stopped caused it?
                    cause = _death_among(pending, backend) or (watch and watch.behind())
                if cause is None:
                    raise
                _note(cause, f"(and with it: {failure_cause(e)})")
                raise cause from None
    return results


def _death_among(pending: dict, backend: str) -> Optional[WorkerDied]:
    """The death of a worker among the ``pending`` calls, if one shows within
    ``DEATH_GRACE_S``: the cause of a failure of its peers. Ray only (a thread does not die)."""
    if backend != "ray":
        return None
    deadline = time.monotonic() + DEATH_GRACE_S
    while pending and (left := deadline - time.monotonic()) > 0:
        for fut in _wait_any(list(pending), left, backend):
            _, _, rank, f = pending.pop(fut)
            try:
                _result(fut, f, rank)
            except WorkerDied as e:
                return e
            except Exception:  # another consequence
                pass
    return None


def check_stop(stop: Optional[threading.Event], waiting_on: list[str]) -> None:
    """Raises :class:`Stopped` (naming ``waiting_on``) once ``stop`` is set (Ctrl-C).

    >>> stop = threading.Event()
    >>> check_stop(stop, ["env start-up"]); stop.set()
    >>> check_stop(stop, ["env start-up"])
    Traceback (most recent call last):
    ...
    m2flow.pipelines.futures.Stopped: stop requested while waiting on env start-up
    """
    if stop is not None and stop.is_set():
        raise Stopped(waiting_on)


def _wait_any(futs: list, timeout: float, backend: str) -> list:
    """The calls of ``futs`` that finished (or failed) within ``timeout`` seconds; returns as
    soon as one does. Ray's wait does not return to Python until then, so a signal handler
    runs only between calls: keep ``timeout`` short."""
    if backend == "ray":
        import ray

        ready, _ = ray.wait(futs, num_returns=1, timeout=timeout)
        return ready
    done, _ = cf.wait(futs, timeout=timeout, return_when=cf.FIRST_COMPLETED)
    return list(done)


def _result(fut, f: Futures, rank: int):
    """The call's result; a failure raised as the worker's own exception (its type kept, the
    worker named in a note and by ``errors.raised_by``), or a worker's death as
    :class:`WorkerDied` (:class:`OutOfMemory` when Ray's memory monitor killed it)."""
    where = f"worker {f.group}[rank {rank}] in {f.method}()"
    if f.backend != "ray":
        exc = fut.exception()
        if exc is not None:
            _note(exc, f"(raised by {where})")
            mark_raised_by(exc, where)
            raise exc
        return fut.result()
    import ray

    try:
        return ray.get(fut)
    except ray.exceptions.OutOfMemoryError as e:  # the call's worker, killed for memory
        raise OutOfMemory(f"{where}: {oom_summary(str(e))}.") from None
    except ray.exceptions.RayActorError as e:
        if "low on memory" in str(e):  # a call on a worker the monitor had killed
            raise OutOfMemory(f"{where}: {oom_summary(str(e))}.") from None
        raise _died(e, f, rank, where) from None
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(e.cause, BaseException) else None
        if cause is None:
            raise WorkerError(f"{where}: {e}") from None
        if isinstance(cause, WorkerDied) and raised_by(cause) is None:
            # the worker called a peer itself (weight sync's buckets) and saw it die: the
            # death is the failure, named as such, not the call that waited on it
            _note(cause, f"(seen by {where}, which was calling it)")
            raise cause from None
        _note(cause, f"(raised by {where}; there:)\n{_remote_traceback(e)}")
        mark_raised_by(cause, where)
        raise cause from None


def _died(e: Exception, f: Futures, rank: int, where: str) -> WorkerDied:
    """A call on a dead actor as one sentence (Ray's own text in a note): the constructor's
    exception where that is what ended it, else the process that died."""
    text = _remote_traceback(e)
    if getattr(e, "actor_init_failed", False):
        last = [line for line in text.splitlines() if line.strip()][-1:] or [type(e).__name__]
        died = WorkerDied(f"worker {f.group}[rank {rank}] in __init__(): {last[0].strip()}")
    else:
        pid = re.search(r"\bpid: (\d+)", text)
        which = f" (pid {pid[1]})" if pid else ""
        died = WorkerDied(f"{where}: the worker's process died{which}: it was killed (kill -9, "
                          "the kernel's out-of-memory killer) or crashed")
    _note(died, f"(Ray:)\n{text}")
    return died


def _remote_traceback(e: Exception) -> str:
    try:
        return str(e)  # Ray's text: the worker-side traceback
    except Exception:  # a dual-class RayTaskError can fail to render; the cause still stands
        return ""


def _note(exc: BaseException, note: str) -> None:
    if note not in getattr(exc, "__notes__", []):
        exc.add_note(note)
