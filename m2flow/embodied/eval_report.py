"""``m2flow-eval``'s report of an evaluation (``eval_protocol.run_protocol``'s dict): into
the output folder ``results.json`` (per task and mean, and ``per_episode``), ``results.md``
(the same as a Markdown table, saying where its episodes started) and
``videos/task<j>_<task>_ep<e>_<success|failure>.mp4`` for the episodes whose frames were kept
(named by success_once); each file written whole or not at all."""

from __future__ import annotations

import json
import re
from pathlib import Path

VIDEO_FPS = 20  # LIBERO and ManiSkill control at 20 Hz


def write_report(report: dict, out_dir: Path) -> dict[str, Path]:
    """Writes results.json, results.md and the videos; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    videos = report.pop("_videos", [])
    report.pop("_failure", None)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    _atomic_write(paths["json"], json.dumps(report, indent=2) + "\n")
    _atomic_write(paths["markdown"], markdown(report))
    if videos:
        vdir = out_dir / "videos"
        vdir.mkdir(exist_ok=True)
        for slot, ep in videos:
            outcome = "success" if ep.success_once else "failure"
            name = f"task{slot.task:02d}_{_slug(report['tasks'][slot.task]['name'])}_ep{slot.episode:02d}_{outcome}.mp4"
            write_video(vdir / name, ep.frames)
        paths["videos"] = vdir
    return paths


def _from_episode(first: int) -> str:
    """``' from episode 10's initial state'`` for ``eval.first_episode`` 10; '' for 0."""
    return f" from episode {first}'s initial state" if first else ""


def markdown(report: dict) -> str:
    lines = [
        f"# Evaluation: {report['env']} with policy {report['policy']}",
        "",
        f"checkpoint: {report['checkpoint'] or 'none (initial weights)'}; "
        f"{report['episodes_per_task']} episodes per task"
        f"{_from_episode(report.get('first_episode', 0))}, at most {report['max_steps']} steps; "
        f"{'mean' if report['deterministic'] else 'sampled'} actions; "
        f"{report['discarded']} episodes discarded (simulator restarts)",
        "",
        *([f"**Interrupted** (Ctrl-C or SIGTERM) after {report['episodes']} of "
           f"{report['episodes_asked']} episodes: a partial report.", ""]
          if report.get("interrupted") else []),
        *([f"**Failed** after {report['episodes']} of {report['episodes_asked']} episodes "
           f"({report['failed']}): a partial report.", ""] if report.get("failed") else []),
        "| task | instruction | success_once | success_at_end | episodes | mean length |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for t in report["tasks"]:
        lines.append(f"| {t['task']} | {t['name']} | {t['success_once']:.3f} "
                     f"| {t['success_at_end']:.3f} | {t['episodes']} | {t['mean_length']:.1f} |")
    lines.append(f"| | **mean over tasks** | **{report['mean_success_once']:.3f}** | "
                 f"**{report['mean_success_at_end']:.3f}** | {report['episodes']} | |")
    if report.get("groups"):  # e.g. Meta-World's difficulty levels, as RLinf's MT50 table
        lines += ["", "| group | tasks | success_once | success_at_end | episodes |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {g['group']} | {g['tasks']} | {g['success_once']:.3f} | "
                  f"{g['success_at_end']:.3f} | {g['episodes']} |" for g in report["groups"]]
    return "\n".join(lines) + "\n"


def write_video(path: Path, frames: list) -> None:
    import imageio.v2 as imageio

    tmp = path.with_suffix(".tmp.mp4")
    # macro_block_size=1: keep odd sizes as they are (no rescale)
    imageio.mimwrite(tmp, frames, fps=VIDEO_FPS, codec="libx264", macro_block_size=1,
                     quality=8)
    tmp.replace(path)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _slug(text: str, limit: int = 60) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:limit]
