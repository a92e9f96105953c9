"""Stalled workers: a worker that stops making progress without dying (stopped by SIGSTOP,
deadlocked, stuck in native code holding its interpreter) ends the run instead of hanging it.

While the driver waits on workers (:func:`m2flow.pipelines.futures.gather`), the run's
:class:`Watchdog` (its cluster's: ``Cluster(watchdog=...)``) asks every worker of the run,
about every ``ASK_EVERY_S``, a question it answers on a thread of its own (``Worker._m2flow_alive``, in the Ray concurrency group
``WATCH_GROUP``): a worker busy in a long call answers at once; a stopped one answers nothing.
:class:`StallWatch` (timestamps in, a verdict out) judges by two rules:

- a worker that has not answered for longer than the phase's limit is stalled: the worker
  itself, not one that waits on it (that one answers);
- a wait of the driver in which no call has finished for longer than the limit, while every
  worker answers (a deadlock), is stalled on a call still pending.

A group's ranks are watched from the driver's wait on their constructors on
(``WorkerGroup.started``: right after their launch, or later for a group launched ahead of a
result its constructors wait for): Ray runs no call on a worker before its constructor
returns, so one whose constructor does not return (stopped, stuck, slow) answers nothing, and
is named as having answered nothing since it was launched (``NOT_STARTED``).

And when a call fails (a channel timed out waiting on a peer), a worker that does not answer
within ``FAILURE_GRACE_S`` is named as the failure instead (:meth:`Watchdog.behind`).

The limit (:func:`stall_limit`) comes from the phase's own measured durations, so that a long
step is never cut: ``STALL_FACTOR`` times the longest completed instance of the phase, at least
``STALL_FLOOR_S``; a phase not completed yet (start-up, a first learning step that compiles or
allocates for minutes) gets ``FIRST_ALLOWANCE_S``. ``runner.stall_timeout_s``, when set, is the
limit of every phase, start-up and phases not completed before included: the operator who sets
it knows the run's slowest step. Only the thread that made the
watchdog (the driver's) consults it: the waits of in-process workers' own threads are theirs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from m2flow.pipelines.errors import WorkerStalled

STALL_FACTOR = 10.0  # a phase may take this many times its longest completed instance
STALL_FLOOR_S = 300.0  # ... and never less than this: a loaded machine's spread
FIRST_ALLOWANCE_S = 1800.0  # a phase with no completed instance yet (start-up, a first step)
ASK_EVERY_S = 1.0  # a worker that answered is asked again this long after
FAILURE_GRACE_S = 2.0  # after a failure, a worker that answers nothing this long is behind it
WATCH_GROUP = "m2flow_watch"  # the Ray concurrency group the question is answered in
SILENT = ("it answers nothing (stopped, e.g. by SIGSTOP, or stuck in native code holding its "
          "interpreter); it was ended")
# a worker asked from its launch on answers nothing until its constructor returns (Ray runs
# no call before): stopped, stuck, or slow are alike from outside
NOT_STARTED = ("it has answered nothing since it was launched: its constructor has not "
               "returned (stopped, e.g. by SIGSTOP, stuck, or slower than the limit); it was "
               "ended")


def stall_limit(phase: str, longest: dict[str, float], override: Optional[float]) -> float:
    """Seconds without progress after which phase ``phase`` counts as stalled: ``override``
    (``runner.stall_timeout_s``) when set, in every phase; else ``STALL_FACTOR`` x the longest
    completed instance of the phase (``longest``), at least ``STALL_FLOOR_S``. A phase never
    completed (start-up, building every worker; a first learning step that compiles) has no
    duration to go by: without ``override`` it gets ``FIRST_ALLOWANCE_S``.

    >>> stall_limit("learning", {"learning": 42.0}, None)
    420.0
    >>> stall_limit("learning", {"learning": 2.0}, None), stall_limit("evaluation", {}, None)
    (300.0, 1800.0)
    >>> stall_limit("learning", {"learning": 42.0}, 30.0), stall_limit("start-up", {}, 30.0)
    (30.0, 30.0)
    """
    if override is not None:
        return float(override)
    if phase not in longest:
        return FIRST_ALLOWANCE_S
    return max(STALL_FLOOR_S, STALL_FACTOR * longest[phase])


def limit_origin(phase: str, longest: dict[str, float], override: Optional[float]) -> str:
    """Where :func:`stall_limit`'s value came from, for the failure's line.

    >>> limit_origin("start-up", {}, 30.0)
    'runner.stall_timeout_s'
    >>> print(limit_origin("start-up", {}, None))
    the allowance of a phase not completed before; runner.stall_timeout_s sets it
    """
    if override is not None:
        return "runner.stall_timeout_s"
    if phase not in longest:
        return "the allowance of a phase not completed before; runner.stall_timeout_s sets it"
    return (f"{STALL_FACTOR:g} x its longest so far, {longest[phase]:.1f} s, at least "
            f"{STALL_FLOOR_S:g} s; runner.stall_timeout_s sets it")


@dataclass(frozen=True)
class Stall:
    """A verdict: ``worker`` (``"learner[rank 0]"``, or ``"learner[rank 0] in update()"`` for a
    call that has not returned) made no progress for ``seconds`` during ``phase``, whose
    limit was ``limit`` (from ``origin``); ``how``: what was seen."""

    worker: str
    phase: str
    seconds: float
    limit: Optional[float]  # None: found behind a failure, not by the limit
    origin: str
    how: str

    def message(self, pid: Optional[int] = None) -> str:
        which = f" (pid {pid})" if pid is not None else ""
        limit = "" if self.limit is None else f" (its limit {self.limit:g} s: {self.origin})"
        return (f"worker {self.worker}{which} stalled: no progress for {self.seconds:.0f} s "
                f"during {self.phase}{limit}; {self.how}")


class StallWatch:
    """Decides from timestamps (seconds of one monotonic clock) whether the run is stalled,
    which worker, and in which phase; no Ray, no clock of its own.

    Args:
        override: ``runner.stall_timeout_s`` (None: limits from measured durations).
        now: the time the run started (its phase is ``"start-up"``).
    """

    def __init__(self, override: Optional[float], now: float):
        self.override = override
        self.longest: dict[str, float] = {}  # phase -> its longest completed instance, s
        self.phase, self.since = "start-up", now
        self.asked_at: dict[str, Optional[float]] = {}  # worker -> its unanswered question's
        self.answered_at: dict[str, float] = {}  # worker -> its last answer (or when added)
        self.heard: set[str] = set()  # the workers that answered once (their constructor ended)

    def enter(self, phase: str, now: float) -> None:
        """The run goes on to ``phase``; the one it leaves has its duration measured."""
        if phase == self.phase:
            return
        self.longest[self.phase] = max(self.longest.get(self.phase, 0.0), now - self.since)
        self.phase, self.since = phase, now

    def limit(self) -> float:
        return stall_limit(self.phase, self.longest, self.override)

    def added(self, worker: str, now: float) -> None:
        """``worker`` is watched from ``now`` (it counts as having answered then)."""
        self.answered_at[worker], self.asked_at[worker] = now, None

    def asked(self, worker: str, now: float) -> None:
        """``worker`` was asked at ``now`` (a question already unanswered keeps its time)."""
        if self.asked_at.get(worker) is None:
            self.asked_at[worker] = now

    def answered(self, worker: str, now: float) -> None:
        self.asked_at[worker], self.answered_at[worker] = None, now
        self.heard.add(worker)

    def how_silent(self, worker: str) -> str:
        """What a silent ``worker`` is, in words: one that never answered is still starting."""
        return SILENT if worker in self.heard else NOT_STARTED

    def forget(self, worker: str) -> None:
        self.asked_at.pop(worker, None)
        self.answered_at.pop(worker, None)

    def silent(self, now: float, grace: float) -> Optional[tuple[str, float]]:
        """The worker silent longest among those whose question has gone unanswered for
        ``grace`` seconds at least: (worker, seconds since its last answer). A question is
        asked only while the driver waits: one asked just now, after the driver did
        something else for a while, has had no time to be answered yet."""
        silent = [(now - self.answered_at[w], w) for w, t in self.asked_at.items()
                  if t is not None and now - t >= grace]
        if not silent:
            return None
        seconds, worker = max(silent)
        return worker, seconds

    def stalled(self, now: float, waiting: Sequence[str] = (),
                progress_at: Optional[float] = None,
                grace: float = 0.0) -> Optional[Stall]:
        """The stall at ``now``, or None. ``waiting``: the calls the driver waits on
        (``"env[rank 0] in collect()"``); ``progress_at``: when the wait started, or one of
        them last finished; ``grace``: how long a question may take to be answered. A worker
        that answers nothing comes first: it is the cause of a call waiting on it."""
        limit = self.limit()
        origin = limit_origin(self.phase, self.longest, self.override)
        silent = self.silent(now, grace)
        waited = now - progress_at if waiting and progress_at is not None else 0.0
        if silent is not None and max(silent[1], waited) > limit:
            return Stall(silent[0], self.phase, max(silent[1], waited), limit, origin,
                         self.how_silent(silent[0]))
        if waited > limit:
            return Stall(waiting[0], self.phase, waited, limit, origin,
                         "the call has not returned, though the worker answers (a deadlock, "
                         "or a wait that never ends); it was ended")
        return None


class Watchdog:
    """Asks the ranks of the Ray worker groups it watches (``add``) whether they are alive,
    while the driver waits (``tick``, from ``gather``), and raises
    :class:`~m2flow.pipelines.errors.WorkerStalled` for a stall (:class:`StallWatch`).
    In-process groups are not asked (a thread cannot be stopped alone); the waits on them
    still count.

    Args:
        override: ``runner.stall_timeout_s`` (None: limits from measured durations).
    """

    def __init__(self, override: Optional[float] = None):
        self.watch = StallWatch(override, time.monotonic())
        self.thread = threading.get_ident()
        self.handles: dict[str, object] = {}  # "group[rank r]" -> its actor
        self.pids: dict[str, int] = {}
        self.questions: dict[object, str] = {}  # unanswered ObjectRef -> worker

    def add(self, group) -> None:
        """Watches the ranks of ``group`` (a ``WorkerGroup``; Ray's only) from now on:
        ``WorkerGroup.started`` adds it before it waits on the constructors, so a constructor
        that does not return is the worker's silence (``NOT_STARTED``)."""
        if group.backend != "ray":
            return
        for rank, handle in enumerate(group.handles):
            self.handles[f"{group.name}[rank {rank}]"] = handle
            self.watch.added(f"{group.name}[rank {rank}]", time.monotonic())

    def started(self, group, pids: Sequence[int]) -> None:
        """The constructors of ``group``'s ranks returned (``Worker._m2flow_started``, which
        gives each rank's pid): each rank has answered, so a silence from now on is a stopped
        or stuck worker, named with its pid (``SILENT``), not one still starting."""
        if group.backend != "ray":
            return
        now = time.monotonic()
        for rank, pid in enumerate(pids):
            worker = f"{group.name}[rank {rank}]"
            if worker in self.handles:
                self.watch.answered(worker, now)
                self.pids[worker] = pid

    def enter(self, phase: str) -> None:
        self.watch.enter(phase, time.monotonic())

    def mine(self) -> bool:
        """Whether this thread is the one the watchdog watches from."""
        return threading.get_ident() == self.thread

    def tick(self, waiting: Sequence[str], progress_at: float) -> None:
        """Collects answers, asks again, and raises ``WorkerStalled`` on a stall."""
        self._ask()
        stall = self.watch.stalled(time.monotonic(), waiting, progress_at, FAILURE_GRACE_S)
        if stall is not None:
            raise self._error(stall)

    def behind(self) -> Optional[WorkerStalled]:
        """After a failure: a worker that answers nothing for ``FAILURE_GRACE_S`` (asked
        again now if it answered before), as the failure to report; None if all answer."""
        self._ask(every=0.0)
        deadline = time.monotonic() + FAILURE_GRACE_S
        while self.questions and (left := deadline - time.monotonic()) > 0:
            self._ask(wait=min(left, 0.2), every=None)
        silent = self.watch.silent(time.monotonic(), 0.0)  # unanswered for the grace at least
        if silent is None:
            return None
        return self._error(Stall(silent[0], self.watch.phase, silent[1], None, "",
                                 self.watch.how_silent(silent[0])))

    def _error(self, stall: Stall) -> WorkerStalled:
        worker = stall.worker.split(" in ")[0]
        return WorkerStalled(stall.message(self.pids.get(worker)), worker=worker)

    def _ask(self, wait: float = 0.0, every: Optional[float] = ASK_EVERY_S) -> None:
        """Collects the answers in (waiting up to ``wait`` s for one), then asks each worker
        with no question out whose last answer is ``every`` s old (None: asks none)."""
        if not self.handles and not self.questions:  # no Ray worker to ask
            return
        import ray

        if self.questions:
            refs = list(self.questions)
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait)
            if wait and not ready:
                return
            now = time.monotonic()
            for ref in ready:
                worker = self.questions.pop(ref)
                self.watch.answered(worker, now)
                try:
                    self.pids[worker] = ray.get(ref)
                except Exception:  # a dead worker: the call on it reports its death
                    self.handles.pop(worker, None)
                    self.watch.forget(worker)
        if every is None:
            return
        now = time.monotonic()
        out = set(self.questions.values())
        for worker, handle in self.handles.items():
            if worker not in out and now - self.watch.answered_at.get(worker, now) >= every:
                ref = handle._m2flow_alive.options(concurrency_group=WATCH_GROUP).remote()
                self.questions[ref] = worker
                self.watch.asked(worker, now)
