"""Learning curves of runs into one PNG (the command is ``m2flow-plot``, :mod:`m2flow.cli.plot`).

Reads each run's TensorBoard scalars (``<run>/tb``, written by :class:`RunLogger`) and draws,
for each metric, one panel against the logged step (env steps for embodied runs, samples for
reasoning) and one against wall time since the run's first scalar; runs are overlaid (the seeds
of a sweep, a before/after), labelled by their folder. A resumed run (its ``config.yaml``
names the checkpoint it resumed from) continues the wall-time axis of the run it resumed:
its clock starts where that run's was at the checkpoint's step, so a run stopped and resumed
plots as one curve in two colours.

A metric a run never logged is left out of that run's panels; a folder that is not a run (no
``tb/`` with scalars) is one clear error line.

A baseline is an ``m2flow-eval`` report (``results.json``): its success_once, success_at_end
and mean return are drawn as dashed levels in the panels of ``eval/success_once``,
``eval/success_at_end`` and ``eval/return`` (e.g. the BC checkpoint that RL started from).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

DEFAULT_METRICS = ("eval/success_once", "eval/success_at_end", "env/return")


@dataclass
class Curve:
    """One metric of one run: the logged steps, wall seconds since the run's first scalar,
    and values, in logging order."""

    steps: list[int]
    seconds: list[float]
    values: list[float]


def read_run(run_dir: Path) -> dict[str, Curve]:
    """Every scalar the run logged, by tag (an event file written by a resumed run's own
    directory is another run)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = Path(run_dir) / "tb"
    if not tb.is_dir():
        raise ValueError(f"{run_dir}: no tb/ folder; give a run directory written by "
                         "m2flow-train (runs/<config name>/<timestamp>).")
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    tags = acc.Tags().get("scalars", [])
    if not tags:
        raise ValueError(f"{run_dir}: its tb/ folder has no scalars yet.")
    events = {t: acc.Scalars(t) for t in tags}
    start = min(e.wall_time for ev in events.values() for e in ev)
    first_step = min(e.step for ev in events.values() for e in ev)
    start -= _resumed_offset(Path(run_dir), first_step)
    return {t: Curve([e.step for e in ev], [e.wall_time - start for e in ev],
                     [e.value for e in ev]) for t, ev in events.items()}


def _resumed_offset(run_dir: Path, first_step: int) -> float:
    """Wall seconds the run this one resumed from had run by ``first_step`` (0: not a resumed
    run, or its source run is gone): the latest scalar of the source at or before that step."""
    import yaml

    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        return 0.0
    resume = (yaml.safe_load(cfg_file.read_text()) or {}).get("resume")
    if not resume:
        return 0.0
    source = Path(resume).parent.parent  # <run>/checkpoints/iter_N.pt -> <run>
    if not Path(resume).is_absolute() and not source.is_dir():
        source = run_dir.parent.parent.parent / source  # a path relative to where it ran
    if source.resolve() == run_dir.resolve() or not (source / "tb").is_dir():
        return 0.0
    curves = read_run(source)
    before = [s for c in curves.values() for st, s in zip(c.steps, c.seconds) if st <= first_step]
    return max(before, default=0.0)


# the figures of an m2flow-eval report, by the training scalar they stand beside
REPORT_KEYS = {"eval/success_once": "mean_success_once",
               "eval/success_at_end": "mean_success_at_end"}


def read_baseline(report: Path) -> tuple[str, dict[str, float]]:
    """(label, {metric: level}) of an ``m2flow-eval`` ``results.json``; a file that is not
    one is a ValueError naming it."""
    import json

    try:
        data = json.loads(Path(report).read_text())
        levels = {m: float(data[k]) for m, k in REPORT_KEYS.items()}
        tasks = data["tasks"]
        levels["eval/return"] = sum(t["mean_return"] for t in tasks) / len(tasks)
        checkpoint, episodes = data["checkpoint"], int(data["episodes"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        raise ValueError(f"--baseline {report}: not an m2flow-eval results.json ({e!r}); give "
                         "the file m2flow-eval wrote (runs/<name>/<time>/eval/<time>/results.json)."
                         ) from e
    name = Path(checkpoint).parent.parent.parent.name  # runs/<name>/<time>/checkpoints/x.pt
    return f"{name}, m2flow-eval {episodes} episodes", levels


def plot(runs: list[Path], out: Path, metrics: tuple[str, ...] = DEFAULT_METRICS,
         baselines: tuple[Path, ...] = ()) -> Path:
    """Draws ``metrics`` of ``runs`` (rows) against steps and wall time (columns) into
    ``out`` (PNG), with each of ``baselines`` (m2flow-eval reports) as dashed levels;
    returns it."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    data = {Path(r): read_run(Path(r)) for r in runs}
    levels = [read_baseline(Path(b)) for b in baselines]
    if not any(m in curves for curves in data.values() for m in metrics):
        have = sorted({t for curves in data.values() for t in curves})
        raise ValueError(f"--metrics {list(metrics)}: none was logged by these runs; they have "
                         f"{have}.")
    fig, axes = plt.subplots(len(metrics), 2, figsize=(11, 3.2 * len(metrics)), squeeze=False)
    for row, metric in zip(axes, metrics):
        for run, curves in data.items():
            c = curves.get(metric)
            if c is None:
                continue
            label = _label(run)
            marker = "." if len(c.values) <= 200 else None  # dense series: a line is clearer
            row[0].plot(c.steps, c.values, marker=marker, label=label, linewidth=1)
            row[1].plot([s / 60 for s in c.seconds], c.values, marker=marker, label=label,
                        linewidth=1)
        for (label, level), style in zip(levels, ("--", ":", "-.") * len(levels)):
            if metric in level:
                for ax in row:
                    ax.axhline(level[metric], color="black", linestyle=style, linewidth=1,
                               label=label)
        row[0].set_xlabel("steps (env steps; reasoning: samples)")
        row[1].set_xlabel("wall time (min)")
        for ax in row:
            ax.set_ylabel(metric)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    from PIL import Image  # matplotlib's own dependency

    # a 64-colour palette: the same picture at about a third of the bytes (docs keep PNGs small)
    Image.open(buf).convert("RGB").quantize(colors=64).save(out, optimize=True)
    return out


def _label(run: Path) -> str:
    """``<config name>/<timestamp>`` of a run directory."""
    parts = run.resolve().parts
    return "/".join(parts[-2:])
