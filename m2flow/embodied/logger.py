"""What the user sees: a progress bar, a one-line summary per iteration, TensorBoard scalars,
and at the end a plot and table of where each iteration's time went."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from tqdm import tqdm

from m2flow.embodied.timeline import breakdown_table, plot_time_breakdown

log = logging.getLogger("m2flow")
TIME_PLOT = "time_breakdown.png"


class RunLogger:
    """Writes each iteration's metrics to the bar, the log file and TensorBoard.

    It also keeps every iteration's metrics in ``history``; ``close()`` turns their ``time/``
    keys into ``run_dir / "time_breakdown.png"`` and a table in the log.
    """

    def __init__(self, run_dir: Path, total_iterations: int, start: int = 0, bar: bool = True):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = run_dir
        self.writer = SummaryWriter(str(run_dir / "tb"))
        handler = logging.FileHandler(run_dir / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False  # the bar prints each line once; the file keeps them all
        self._handler = handler
        self.bar = tqdm(
            total=total_iterations, initial=start, desc="train", unit="it", disable=not bar,
            dynamic_ncols=True,
        )
        self.history: list[dict] = []

    def log(self, iteration: int, step: int, metrics: dict[str, float]) -> None:
        self.history.append({**metrics, "iteration": iteration})
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()
        self.info(summary_line(iteration, step, metrics))
        if "train/reward" in metrics:  # reasoning
            self._last_acc = metrics.get("eval/accuracy", getattr(self, "_last_acc", float("nan")))
            self.bar.set_postfix_str(f"reward={metrics['train/reward']:.3f} "
                                     f"eval_acc={self._last_acc:.3f}")
        else:
            self.bar.set_postfix_str(
                f"sps={metrics.get('perf/env_steps_per_s', 0):.0f} "
                f"success={metrics.get('eval/success', metrics.get('env/success', float('nan'))):.2f}"
            )
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


def summary_line(iteration: int, step: int, m: dict[str, float]) -> str:
    parts = [f"it {iteration:4d}", f"steps {step:8d}"]
    for key, fmt in [
        ("perf/env_steps_per_s", "sps {:.0f}"),
        ("env/return", "return {:.2f}"),
        ("env/success", "success {:.2f}"),
        ("eval/success", "eval_success {:.2f}"),
        ("loss/approx_kl", "kl {:.4f}"),
        ("loss/loss_value", "vloss {:.4f}"),
        ("train/reward", "reward {:.3f}"),
        ("train/response_len", "len {:.1f}"),
        ("eval/accuracy", "eval_acc {:.3f}"),
        ("perf/gen_tokens_per_s", "gen_tok/s {:.0f}"),
    ]:
        if key in m:
            parts.append(fmt.format(m[key]))
    times = [f"{k[5:]} {v:.2f}s" for k, v in m.items() if k.startswith("time/")]
    return " | ".join(parts + ([" ".join(times)] if times else []))
