"""Where an iteration's time goes: a per-component plot and a text table of ``time/`` metrics.

The runner reports ``time/<component>_<phase>`` seconds per iteration (``time/env_sim``,
``time/learner_weight_sync``) next to ``perf/iteration_s``. The component is the text before
the first underscore; a key without one (``time/eval``) is a component with the single phase
``total``. Both sets are open, so a new worker or phase shows up without code changes here.

With ``runner.overlap_learner`` the runner also reports ``perf/learn_overlapped_s``: the
seconds of the previous update during which this iteration's collection ran. The table's
last line sets their sum against the updates' (``time/driver_learn_wait``).
"""

from __future__ import annotations

import math
from pathlib import Path

TIME_PREFIX = "time/"
WALL_KEY = "perf/iteration_s"
OVERLAP_KEY = "perf/learn_overlapped_s"
LEARN_KEY = "time/driver_learn_wait"  # an update's seconds, as the driver waited for it
SPS_KEY = "perf/env_steps_per_s"
LONE_PHASE = "total"  # phase name for a key with no underscore, e.g. ``time/eval``
KNOWN_ORDER = ("env", "rollout", "learner", "driver")  # listed first; others follow as met
DPI = 100  # keeps a 400-iteration plot well under 200 KB
WIDTH_IN, HEIGHT_PER_COMPONENT_IN = 8.0, 2.2
AREA_FROM = 60  # from this many iterations on, bars are too thin to read: draw an area
BAR_WIDTH = 0.8  # of the spacing between iterations


def _number(v) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def _split(key: str) -> tuple[str, str]:
    """``"time/env_sim"`` -> ``("env", "sim")``; ``"time/eval"`` -> ``("eval", "total")``."""
    name = key[len(TIME_PREFIX):]
    component, _, phase = name.partition("_")
    return component, phase or LONE_PHASE


def _phases(history: list[dict]) -> dict[str, list[str]]:
    """Component -> its phase names, components in display order, phases sorted."""
    found: dict[str, set[str]] = {}
    for m in history:
        for k, v in m.items():
            if k.startswith(TIME_PREFIX) and _number(v) is not None:
                component, phase = _split(k)
                found.setdefault(component, set()).add(phase)
    order = [c for c in KNOWN_ORDER if c in found] + [c for c in found if c not in KNOWN_ORDER]
    return {c: sorted(found[c]) for c in order}


def _series(history: list[dict], key: str) -> list[float]:
    """One value per iteration; a missing or non-finite value counts as 0."""
    return [_number(m.get(key)) or 0.0 for m in history]


def _key(component: str, phase: str) -> str:
    return f"{TIME_PREFIX}{component}" + ("" if phase == LONE_PHASE else f"_{phase}")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def breakdown_table(history: list[dict]) -> str:
    """Mean seconds per iteration of every component and phase, with its share of the wall time.

    Args:
        history: per-iteration metric dicts as the runner logs them. A phase missing from an
            iteration counts as 0 s there, so an occasional phase (``time/eval``) shows its
            cost spread over all iterations.

    Returns:
        A small fixed-width table, one row per phase plus a total row per component with more
        than one phase; the share is of the mean ``perf/iteration_s`` ("-" without it).
        Components run concurrently, so shares across components can add up past 100%.
        An empty string when no ``time/`` key is present.

    >>> h = [{"time/env_sim": 0.6, "time/env_wait": 0.2, "time/learner_learn": 0.5,
    ...       "perf/iteration_s": 1.0}] * 2
    >>> print(breakdown_table(h))
    time per iteration, mean of 2 iterations; wall 1.000 s/it
    component  phase     s/it   share
    env        sim      0.600   60.0%
    env        wait     0.200   20.0%
    env        (all)    0.800   80.0%
    learner    learn    0.500   50.0%

    With overlap, a last line: of the updates' seconds, those that ran beside a collection.

    >>> h = [{"time/driver_learn_wait": 1.0, "perf/iteration_s": 1.1},
    ...      {"time/driver_learn_wait": 1.0, "perf/learn_overlapped_s": 0.25,
    ...       "perf/iteration_s": 1.1}]
    >>> print(breakdown_table(h).splitlines()[-1])
    learning beside collection: 0.125 of 1.000 s/it (12.5% of the learner's time)
    """
    phases = _phases(history)
    if not phases:
        return ""
    walls = [w for m in history if (w := _number(m.get(WALL_KEY))) is not None]
    wall = _mean(walls)  # nan without walls: every share then reads "-"

    cw = max(len("component"), *map(len, phases))
    pw = max(len("phase"), *(len(p) for names in phases.values() for p in names))

    def row(component: str, phase: str, seconds: float) -> str:
        share = f"{100 * seconds / wall:5.1f}%" if wall > 0 else "    -"
        return f"{component:<{cw}}  {phase:<{pw}}  {seconds:7.3f}  {share:>6}"

    wall_text = f"{wall:.3f} s/it" if walls else "unknown"
    lines = [
        f"time per iteration, mean of {len(history)} iterations; wall {wall_text}",
        f"{'component':<{cw}}  {'phase':<{pw}}  {'s/it':>7}  {'share':>6}",
    ]
    for component, names in phases.items():
        means = [_mean(_series(history, _key(component, p))) for p in names]
        lines += [row(component, p, s) for p, s in zip(names, means)]
        if len(names) > 1:
            lines.append(row(component, "(all)", sum(means)))
    if any(OVERLAP_KEY in m for m in history):
        beside, learn = _mean(_series(history, OVERLAP_KEY)), _mean(_series(history, LEARN_KEY))
        share = f"{100 * beside / learn:.1f}%" if learn > 0 else "-"
        lines.append(f"learning beside collection: {beside:.3f} of {learn:.3f} s/it "
                     f"({share} of the learner's time)")
    return "\n".join(lines)


def plot_time_breakdown(history: list[dict], path) -> Path | None:
    """Writes a PNG with one subplot per component, stacking its phases' seconds per iteration.

    Each subplot stacks the component's phases as bars per iteration, or as an area from
    ``AREA_FROM`` iterations on (a phase keeps its colour in every subplot), under a dashed
    line of ``perf/iteration_s``: the gap between the stack and the line is time that
    component spent idle or outside its timers. The title gives the run's mean env steps/s.
    It draws on matplotlib's Agg canvas and leaves pyplot's global backend alone, so it is
    safe in headless runs and in notebooks.

    Args:
        history: per-iteration metric dicts; x is each dict's ``"iteration"`` (its list index
            when absent). A phase missing from an iteration is drawn as 0 s.
        path: where the PNG goes; its parent folder must exist.

    Returns:
        The path written, or None (nothing written) when no ``time/`` key is present.

    >>> import tempfile
    >>> h = [{"iteration": i, "time/env_sim": 0.5, "time/learner_learn": 0.3,
    ...       "perf/iteration_s": 1.0, "perf/env_steps_per_s": 800.0} for i in range(3)]
    >>> with tempfile.TemporaryDirectory() as d:
    ...     out = plot_time_breakdown(h, Path(d) / "t.png")
    ...     print(out.name, out.read_bytes()[:4])
    t.png b'\\x89PNG'
    >>> plot_time_breakdown([{"perf/iteration_s": 1.0}], "unused.png") is None
    True
    """
    phases = _phases(history)
    if not phases:
        return None
    # Figure draws on an Agg canvas when saved, so pyplot's global backend stays untouched.
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    x = [m.get("iteration", i) for i, m in enumerate(history)]
    walls = _series(history, WALL_KEY) if any(WALL_KEY in m for m in history) else None
    colours = _colours(sorted({p for names in phases.values() for p in names}), colormaps)
    fig = Figure(figsize=(WIDTH_IN, HEIGHT_PER_COMPONENT_IN * len(phases)), dpi=DPI,
                 layout="constrained")
    axes = fig.subplots(len(phases), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (component, names) in zip(axes, phases.items()):
        stack = {p: _series(history, _key(component, p)) for p in names}
        _draw_stack(ax, x, stack, colours, walls)
        ax.set_ylabel(f"{component} [s]")
    axes[-1].set_xlabel("iteration")
    sps = [v for m in history if (v := _number(m.get(SPS_KEY))) is not None]
    fig.suptitle(f"time per iteration; mean {_mean(sps):,.0f} env steps/s" if sps
                 else "time per iteration")
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    return path


def _draw_stack(ax, x: list, stack: dict[str, list[float]], colours: dict, walls) -> None:
    """Stacked bars (an area once bars get too thin to see) with the wall time dashed on top."""
    legend = {}  # label -> artist, listed top of the plot first
    if len(x) < AREA_FROM:
        spacing = min((b - a for a, b in zip(sorted(x), sorted(x)[1:]) if b > a), default=1)
        half = BAR_WIDTH * spacing / 2
        bottom = [0.0] * len(x)
        for phase, seconds in stack.items():
            legend[phase] = ax.bar(x, seconds, width=2 * half, bottom=bottom,
                                   color=colours[phase])
            bottom = [b + s for b, s in zip(bottom, seconds)]
        if walls is not None:  # padded so the first and last bars are covered too
            (legend["iteration wall"],) = ax.plot(
                [x[0] - half, *x, x[-1] + half], [walls[0], *walls, walls[-1]], "k--",
                linewidth=1, drawstyle="steps-mid")
    else:
        # Steps a pixel or two wide gain nothing from antialiasing, which triples the PNG.
        areas = ax.stackplot(x, *stack.values(), step="mid", linewidth=0, antialiased=False,
                             colors=[colours[p] for p in stack])
        legend.update(zip(stack, areas))
        if walls is not None:
            (legend["iteration wall"],) = ax.plot(x, walls, "k--", linewidth=0.8,
                                                  drawstyle="steps-mid", antialiased=False)
    ax.set_ylim(bottom=0)
    labels = list(reversed(legend))  # the wall line, then the stack from its top down
    ax.legend([legend[k] for k in labels], labels, loc="upper left", bbox_to_anchor=(1.01, 1),
              fontsize="small", frameon=False)


def _colours(phases: list[str], colormaps) -> dict[str, tuple]:
    """One colour per phase name, the same in every subplot."""
    cmap = colormaps["tab10" if len(phases) <= 10 else "tab20"]
    return {p: cmap(i % cmap.N) for i, p in enumerate(phases)}
