"""What every recorder writes the same way: an episode in memory, a per-task tally, and the
HDF5 file of trajectories (ManiSkill's RecordEpisode layout: ``traj_<i>/obs/<key>``,
``actions``, ``rewards``, ``terminated``, ``truncated``, ``success``; images gzip-compressed).

Each recorder adds its own episode fields (the seed, the task, the planner's steps) and its own
JSON metadata; the BC dataset (:mod:`m2flow.embodied.datasets`) reads any of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

_IMAGE_COMPRESSION = dict(compression="gzip", compression_opts=5)


@dataclass
class Episode:
    """One kept episode as recorded in memory (what the dataset holds for it)."""

    obs: dict  # key -> (T+1, ...) numpy
    actions: np.ndarray  # (T, A) float32
    rewards: np.ndarray  # (T,) float32
    success: np.ndarray  # (T,) bool
    terminated: np.ndarray  # (T,) bool
    truncated: np.ndarray  # (T,) bool


@dataclass
class TaskTally:
    """What happened to the episodes tried, in all and per task index."""

    tried: int = 0
    kept: int = 0
    per_task: dict = field(default_factory=dict)
    """task index -> [tried, kept]."""
    seconds: float = 0.0
    interrupted: bool = False
    """Ctrl-C (or SIGTERM, as the command maps it) ended the run: the demos are those kept."""

    def count(self, task: int, kept: bool) -> None:
        """One episode of ``task`` tried, and kept or not."""
        row = self.per_task.setdefault(task, [0, 0])
        row[0] += 1
        self.tried += 1
        if kept:
            row[1] += 1
            self.kept += 1


def dataset_paths(stem: Path) -> tuple[Path, Path]:
    """``stem``.h5 and ``stem``.json, with their folder made."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    return stem.with_name(stem.name + ".h5"), stem.with_name(stem.name + ".json")


def write_trajectories(h5_path: Path, demos: Sequence[Episode],
                       describe: Callable[[int, Episode], dict]) -> list[dict]:
    """Writes ``demos`` as ``traj_0`` ... to ``h5_path``; returns ``describe(i, demo)`` of each,
    the JSON's ``episodes`` list."""
    import h5py

    episodes = []
    with h5py.File(h5_path, "w") as f:
        for i, demo in enumerate(demos):
            g = f.create_group(f"traj_{i}", track_order=True)
            obs = g.create_group("obs", track_order=True)
            for key, value in demo.obs.items():
                image = value.dtype == np.uint8 and value.ndim == 4
                obs.create_dataset(key, data=value, **(_IMAGE_COMPRESSION if image else {}))
            g.create_dataset("actions", data=demo.actions, dtype=np.float32)
            executed = getattr(demo, "executed", None)  # what ran, where noise perturbed it
            if executed is not None:
                g.create_dataset("executed_actions", data=executed, dtype=np.float32)
            g.create_dataset("rewards", data=demo.rewards, dtype=np.float32)
            for name in ("terminated", "truncated", "success"):
                g.create_dataset(name, data=getattr(demo, name), dtype=bool)
            episodes.append(describe(i, demo))
    return episodes


# -- the command's checks and paths ----------------------------------------------------------


def output_stem(output: str, env_cfg, prefix: str = "") -> Path:
    """OUTPUT without its .h5: ``output`` (``demos.output``) where given, else
    ``demos/<prefix><the env name's part after '/'>_<obs mode><image size unless state>``.

    >>> from types import SimpleNamespace as NS
    >>> output_stem("", NS(name="ManiSkill/PushCube-v1", obs_mode="rgb", image_size=64))
    PosixPath('demos/PushCube-v1_rgb64')
    >>> output_stem("out/mine.h5", None)
    PosixPath('out/mine')
    """
    if output:
        p = Path(output).expanduser()
        return p.with_suffix("") if p.suffix in (".h5", ".json") else p
    name = env_cfg.name.split("/", 1)[1]
    size = env_cfg.image_size if env_cfg.obs_mode != "state" else ""
    return Path("demos") / f"{prefix}{name}_{env_cfg.obs_mode}{size}"


def check_env_and_output(env_cfg, stem: Path, overwrite: bool) -> None:
    """The env's own checks (its settings class and ``check_config``) and the output's: a
    ConfigError of one line for a bad env setting, or for a dataset at ``stem`` that
    ``overwrite`` does not allow replacing."""
    from m2flow.configs import ConfigError
    from m2flow.envs import EnvError
    from m2flow.envs.registry import ENVS

    try:
        cls = ENVS.require(env_cfg.name)  # its simulator installed
        ENVS.check_settings(env_cfg, cls, "env")
        cls.check_config(env_cfg)
    except EnvError as e:
        raise ConfigError(f"config error: {str(e).splitlines()[0]}") from None
    existing = [p for p in (stem.with_name(stem.name + ".h5"), stem.with_name(stem.name + ".json"))
                if p.exists()]
    if existing and not overwrite:
        raise ConfigError(f"config error: demos.output: {existing[0]} exists; pick another "
                          "demos.output or set demos.overwrite=true.")
