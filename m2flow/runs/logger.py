"""What the user sees: a progress bar, a one-line summary per iteration, the progress of long
phases (``Progress``: an evaluation's episodes), TensorBoard scalars, and at the end a plot
and table of where each iteration's time went.

Bars are drawn only on a terminal (stdout and stderr both): a log file gets lines, never a
bar's carriage-return frames."""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from tqdm import tqdm

from m2flow.runs.timeline import breakdown_table, plot_time_breakdown

log = logging.getLogger("m2flow")
TIME_PLOT = "time_breakdown.png"
LOG_FILE = "train.log"  # the run directory's log: every line, and a failure's traceback


@dataclass(frozen=True)
class LogField:
    """One value of the log line or the progress bar: the first of ``keys`` present, formatted
    with ``fmt`` (``"return {:.2f}"``); with ``together``, all of ``keys`` in one ``fmt``, shown
    only when all are present. ``sticky``: the bar keeps showing the last value seen (an
    evaluation's result between evaluations). ``detail``: in ``train.log``'s line only, not in
    the one a person watches.

    >>> both = log_field("success {:.2f}/{:.2f}", "a/once", "a/end", together=True)
    >>> both.render({"a/once": 0.9, "a/end": 0.47}), both.render({"a/once": 0.9})
    ('success 0.90/0.47', None)
    """

    fmt: str
    keys: tuple[str, ...]
    sticky: bool = False
    together: bool = False
    detail: bool = False

    def render(self, metrics: dict) -> str | None:
        if self.together:
            if all(k in metrics for k in self.keys):
                return self.fmt.format(*(metrics[k] for k in self.keys))
            return None
        for k in self.keys:
            if k in metrics:
                return self.fmt.format(metrics[k])
        return None


def log_field(fmt: str, *keys: str, sticky: bool = False, together: bool = False,
              detail: bool = False) -> LogField:
    return LogField(fmt, keys, sticky, together, detail)


class RunLogger:
    """Writes each iteration's metrics to the bar, the log file and TensorBoard.

    The workload says what its line and bar show (``fields``, ``bar_fields``); the logger
    knows no metric by name. It also keeps every iteration's metrics in ``history``;
    ``close()`` turns their ``time/`` keys into ``run_dir / "time_breakdown.png"`` and a table
    in the log. The bar is drawn only when both stdout and stderr are terminals, so a log
    redirected to a file holds the lines and no bar frames. ``progress()`` follows a long
    phase within an iteration; its lines come every ``progress_every_s`` seconds.
    """

    def __init__(self, run_dir: Path, total_iterations: int, start: int = 0, bar: bool = True,
                 fields: Sequence[LogField] = (), bar_fields: Sequence[LogField] = (),
                 progress_every_s: float = 15.0):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = run_dir
        self.writer = SummaryWriter(str(run_dir / "tb"))
        handler = logging.FileHandler(run_dir / LOG_FILE)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False  # the bar prints each line once; the file keeps them all
        self._handler = handler
        self.fields, self.bar_fields = list(fields), list(bar_fields)
        self._sticky: dict[int, str] = {}
        self.bar = tqdm(
            total=total_iterations, initial=start, desc="train", unit="it",
            disable=not (bar and terminal()), dynamic_ncols=True,
        )
        self.history: list[dict] = []
        self.progress_every_s = progress_every_s
        self.closed = False

    def progress(self, desc: str, total: int, unit: str = "ep") -> "Progress":
        """A long phase's progress: on a terminal a second bar under the run's, with its lines
        in ``train.log`` only; elsewhere its lines on stdout and in ``train.log``."""
        shown = not self.bar.disable
        return Progress(desc, total, unit=unit, bar=shown, write=log.info if shown else self.info,
                        every_s=self.progress_every_s)

    def log(self, iteration: int, step: int, metrics: dict[str, float]) -> None:
        self.history.append({**metrics, "iteration": iteration})
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()
        log.info(summary_line(iteration, step, metrics, self.fields, full=True))
        self.bar.write(summary_line(iteration, step, metrics, self.fields))
        sys.stdout.flush()
        shown = []
        for i, f in enumerate(self.bar_fields):
            text = f.render(metrics)
            if text is not None and f.sticky:
                self._sticky[i] = text
            text = self._sticky.get(i) if text is None and f.sticky else text
            if text is not None:
                shown.append(text)
        self.bar.set_postfix_str(" ".join(shown))
        self.bar.update(1)

    def info(self, line: str) -> None:
        log.info(line)
        self.bar.write(line)
        sys.stdout.flush()  # a log file shows the line now, not when a buffer fills

    def close(self) -> None:
        self.closed = True
        try:
            self.write_time_breakdown()
        finally:
            self.bar.close()
            self.writer.close()
            log.removeHandler(self._handler)
            self._handler.close()

    def write_time_breakdown(self) -> None:
        """Logs the time table and plots it; a failure is one warning line, never a lost run."""
        try:
            table = breakdown_table(self.history)
            if table:
                self.info(table)
            plot_time_breakdown(self.history, self.run_dir / TIME_PLOT)
        except Exception as e:  # noqa: BLE001 - a missing plot must not fail a finished run
            line = f"warning: time breakdown not written ({TIME_PLOT}): {type(e).__name__}: {e}"
            log.warning(line)
            self.bar.write(line)


class Progress:
    """How far one long phase (an evaluation) has got: ``done`` of ``total`` and a status
    (``success 0.40``). With ``bar``, a tqdm bar (under the run's bar; gone when the phase
    ends). ``write`` (None: nowhere) gets a line at most every ``every_s`` seconds (0: at every
    update) and, once it got one, a last line when the phase is complete: a log file gets
    lines, never bar frames.

    >>> lines, clock = [], iter([0.0, 4.0, 20.0, 21.0]).__next__  # seconds since the start
    >>> p = Progress("eval PushCube", 6, write=lines.append, every_s=15.0, clock=clock)
    >>> for status in ("success 0.50", "success 0.25", "success 0.33"):
    ...     p.update(2, status)
    >>> p.close()
    >>> lines
    ['eval PushCube: 4/6 ep | success 0.25 | 20 s, about 10 s left', 'eval PushCube: 6/6 ep | success 0.33 | 21 s']
    """

    def __init__(self, desc: str, total: int, *, unit: str = "ep", bar: bool = False,
                 write: Optional[Callable[[str], None]] = None, every_s: float = 15.0,
                 clock: Callable[[], float] = time.monotonic):
        self.desc, self.total, self.unit = desc, total, unit
        self.write, self.every_s, self.clock = write, every_s, clock
        self.done, self.status, self.lines = 0, "", 0
        self.t0 = self._last = clock()
        self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False,
                        dynamic_ncols=True) if bar else None

    def update(self, n: int, status: str = "") -> None:
        """``n`` more done; ``status``: what the bar and the next line show after the count."""
        self.done, self.status = self.done + n, status
        if self.bar is not None:
            self.bar.set_postfix_str(status, refresh=False)
            self.bar.update(n)
        if self.write is None:
            return
        now = self.clock()
        complete = self.done >= self.total
        if now - self._last >= self.every_s or (complete and self.lines):
            self.write(self.line(now))
            self.lines += 1
            self._last = now

    def line(self, now: float) -> str:
        parts = [f"{self.desc}: {self.done}/{self.total} {self.unit}"]
        if self.status:
            parts.append(self.status)
        took = now - self.t0
        left = ""
        if 0 < self.done < self.total:
            left = f", about {took / self.done * (self.total - self.done):.0f} s left"
        return " | ".join(parts + [f"{took:.0f} s{left}"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def announce(line: str) -> None:
    """A line for the person watching (start-up: what is being built) on stdout, flushed,
    and in the run's log once it is open."""
    log.info(line)
    tqdm.write(line)
    sys.stdout.flush()


WALL_KEYS = ("perf/iteration_s", "perf/step_s")  # an iteration's (a reasoning step's) wall time
MAX_LINE = 160  # columns of the line a person watches
EVAL_KEY = "time/eval"  # an evaluation's seconds: the run loop's, outside perf/iteration_s


def summary_line(iteration: int, step: int, m: dict[str, float],
                 fields: Sequence[LogField] = (), full: bool = False) -> str:
    """``it N | steps S | <each field present> | slowest <phase> <its share>``: the line a
    person watches, within 160 columns (``MAX_LINE``). With ``full`` (``train.log``'s line):
    the ``detail`` fields too, and every ``time/`` key's seconds in place of the slowest.

    >>> m = {"a/ret": 1.25, "b/x": 2.0, "time/env_sim": 0.6, "time/env_wait": 0.3,
    ...      "time/learner_learn": 0.2, "perf/iteration_s": 0.8}
    >>> fields = [log_field("ret {:.1f}", "a/ret"), log_field("x {:.0f}", "b/x", detail=True)]
    >>> summary_line(3, 30, m, fields)
    'it    3 | steps       30 | ret 1.2 | slowest env_sim 75%'
    >>> summary_line(3, 30, m, fields, full=True)
    'it    3 | steps       30 | ret 1.2 | x 2 | env_sim 0.60s env_wait 0.30s learner_learn 0.20s'
    """
    parts = [f"it {iteration:4d}", f"steps {step:8d}"]
    parts += [text for f in fields if (full or not f.detail) and (text := f.render(m)) is not None]
    if full:
        times = [f"{k[5:]} {v:.2f}s" for k, v in m.items() if k.startswith("time/")]
        return " | ".join(parts + ([" ".join(times)] if times else []))
    slowest = slowest_phase(m)
    return " | ".join(parts + ([slowest] if slowest else []))


def slowest_phase(m: dict[str, float]) -> str | None:
    """The component phase that took longest this iteration, and its share of the iteration's
    wall time (its seconds without one); an evaluation (``time/eval``, outside the iteration's
    ``perf/iteration_s``) adds its seconds to that wall. Waits (``*_wait``, the driver's) are
    idle time, not work, and are left out.

    >>> slowest_phase({"time/env_sim": 0.5, "time/rollout_wait": 0.9, "perf/iteration_s": 1.0})
    'slowest env_sim 50%'
    >>> slowest_phase({"time/env_sim": 0.5, "time/eval": 3.0, "perf/iteration_s": 1.0})
    'slowest eval 75%'
    >>> slowest_phase({"time/learner_learn": 0.25}), slowest_phase({})
    ('slowest learner_learn 0.25s', None)
    """
    work = {k[5:]: v for k, v in m.items() if k.startswith("time/") and not k.endswith("_wait")
            and not k.startswith("time/driver_") and isinstance(v, (int, float))}
    if not work:
        return None
    name = max(work, key=work.get)
    wall = next((m[k] for k in WALL_KEYS if isinstance(m.get(k), (int, float))), None)
    if wall is not None and isinstance(m.get(EVAL_KEY), (int, float)):
        wall += m[EVAL_KEY]
    if wall and wall > 0:
        return f"slowest {name} {100 * work[name] / wall:.0f}%"
    return f"slowest {name} {work[name]:.2f}s"


def terminal() -> bool:
    """True when stdout and stderr are both terminals (a bar may be drawn)."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def memory_in_use() -> str:
    """This machine's memory in use, for a person to see how close a run is to its limit
    (``memory 18.2 of 23.5 GB in use``): total minus what the kernel reports available."""
    import psutil

    vm = psutil.virtual_memory()
    return f"memory {(vm.total - vm.available) / 2**30:.1f} of {vm.total / 2**30:.1f} GB in use"
