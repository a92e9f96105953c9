"""What the user sees: a progress bar, a one-line summary per iteration, TensorBoard scalars,
and at the end a plot and table of where each iteration's time went."""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from m2flow.runs.timeline import breakdown_table, plot_time_breakdown

log = logging.getLogger("m2flow")
TIME_PLOT = "time_breakdown.png"


@dataclass(frozen=True)
class LogField:
    """One value of the log line or the progress bar: the first of ``keys`` present, formatted
    with ``fmt`` (``"return {:.2f}"``). ``sticky``: the bar keeps showing the last value seen
    (an evaluation's result between evaluations)."""

    fmt: str
    keys: tuple[str, ...]
    sticky: bool = False

    def render(self, metrics: dict) -> str | None:
        for k in self.keys:
            if k in metrics:
                return self.fmt.format(metrics[k])
        return None


def log_field(fmt: str, *keys: str, sticky: bool = False) -> LogField:
    return LogField(fmt, keys, sticky)


class RunLogger:
    """Writes each iteration's metrics to the bar, the log file and TensorBoard.

    The workload says what its line and bar show (``fields``, ``bar_fields``); the logger
    knows no metric by name. It also keeps every iteration's metrics in ``history``;
    ``close()`` turns their ``time/`` keys into ``run_dir / "time_breakdown.png"`` and a table
    in the log. The bar is drawn only when both stdout and stderr are terminals, so a log
    redirected to a file holds the lines and no bar frames.
    """

    def __init__(self, run_dir: Path, total_iterations: int, start: int = 0, bar: bool = True,
                 fields: Sequence[LogField] = (), bar_fields: Sequence[LogField] = ()):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = run_dir
        self.writer = SummaryWriter(str(run_dir / "tb"))
        handler = logging.FileHandler(run_dir / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False  # the bar prints each line once; the file keeps them all
        self._handler = handler
        self.fields, self.bar_fields = list(fields), list(bar_fields)
        self._sticky: dict[int, str] = {}
        self.bar = tqdm(
            total=total_iterations, initial=start, desc="train", unit="it",
            disable=not (bar and _terminal()), dynamic_ncols=True,
        )
        self.history: list[dict] = []

    def log(self, iteration: int, step: int, metrics: dict[str, float]) -> None:
        self.history.append({**metrics, "iteration": iteration})
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()
        self.info(summary_line(iteration, step, metrics, self.fields))
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

    def close(self) -> None:
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


def summary_line(iteration: int, step: int, m: dict[str, float],
                 fields: Sequence[LogField] = ()) -> str:
    """``it N | steps S | <each field present> | <time/ keys>``."""
    parts = [f"it {iteration:4d}", f"steps {step:8d}"]
    parts += [text for f in fields if (text := f.render(m)) is not None]
    times = [f"{k[5:]} {v:.2f}s" for k, v in m.items() if k.startswith("time/")]
    return " | ".join(parts + ([" ".join(times)] if times else []))


def _terminal() -> bool:
    return sys.stdout.isatty() and sys.stderr.isatty()
