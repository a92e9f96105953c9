"""Appends a benchmark's rows to bench/results.csv (git-ignored) with the device and commit."""

from __future__ import annotations

import csv
import platform
import subprocess
from pathlib import Path

HEADER = ["bench", "case", "num_envs", "mode", "env_steps_per_s", "device", "commit"]


def append(bench: str, rows: list[tuple[str, int, str, float]]) -> None:
    """``rows``: (case, num_envs, mode, env steps per second)."""
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else platform.processor() or "cpu")
    path = Path(__file__).with_name("results.csv")
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(HEADER)
        for case, n, mode, rate in rows:
            w.writerow([bench, case, n, mode, f"{rate:.1f}", device, commit])
