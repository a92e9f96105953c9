"""Demonstrations for behaviour cloning and RLPD (the command is ``m2flow-demos``,
:mod:`m2flow.cli.demos`), one recorder module per env family: :mod:`.maniskill` records
ManiSkill's motion-planning solutions through m2flow's own env (with the motion planner of
:mod:`.screw_planner`), :mod:`.libero` a scripted LIBERO expert (:mod:`.libero_expert`),
:mod:`.metaworld` Meta-World's own experts. All write the same HDF5 layout (:mod:`.dataset`).

A recorder module offers the same few names, which the command calls in this order:

- ``DEFAULT_CONFIG``: its entry config in ``m2flow/configs/demos/`` (each family has its own,
  since its env settings and demos options differ);
- ``load_demos_config(config_name, overrides)``: the checked config (a ConfigError of one line);
- ``output_stem(cfg)``: where the dataset goes (``X`` for ``X.h5`` and ``X.json``);
- ``generate(cfg, log)``: ``(demos, tally, spec)``; a Ctrl-C ends it early with the demos kept
  so far and ``tally.interrupted`` (``tally.tried`` and ``tally.kept`` count episodes);
- ``save(stem, demos, env_cfg, spec, tally)``: writes the dataset (with the tally), returns
  ``(h5 path, json path)``;
- ``closing_line(cfg, tally, demos, h5_path)``: the command's last line,
  ``wanted(cfg)``: the episodes asked for, and ``succeeded(cfg, tally)``: whether it exits 0.
"""

from __future__ import annotations

import importlib
from types import ModuleType

RECORDERS = {
    "ManiSkill": "m2flow.embodied.demos.maniskill",
    "LIBERO": "m2flow.embodied.demos.libero",
    "MetaWorld": "m2flow.embodied.demos.metaworld",
}
"""Env family (the part of ``env.name`` before ``/``) -> its recorder module, imported when
picked (each imports its simulator)."""
DEFAULT_FAMILY = "ManiSkill"
"""The family of ``m2flow-demos`` without ``env=`` (its ``configs/demos/default.yaml``)."""


def recorder(family: str) -> ModuleType:
    """The recorder module of ``family``; KeyError naming the known ones."""
    if family not in RECORDERS:
        raise KeyError(f"m2flow-demos has no recorder for {family!r} envs; it records "
                       f"{', '.join(RECORDERS)} (m2flow.embodied.demos.RECORDERS).")
    return importlib.import_module(RECORDERS[family])
