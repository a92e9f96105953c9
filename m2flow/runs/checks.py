"""Start-up checks every workload's config shares: paths that must exist, the ``runner``
base group and ``seed``, the cluster and its placement on the machines it will have, and the
checkpoint to resume from. Each failure is one line naming the field, the value and the fix
(a ``m2flow.fields.FieldError``; the ranges of single fields are their settings classes'
``validate``); nothing here starts a worker, Ray or a simulator.

>>> check_file("data.train_path", "/no/such.jsonl", "give a local jsonl file")
Traceback (most recent call last):
...
m2flow.fields.FieldError: config error: data.train_path='/no/such.jsonl': does not exist; give a local jsonl file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional, Sequence

from m2flow.fields import FieldError, at_least, check_bound, field_error
from m2flow.pipelines import Placement, PlacementError
from m2flow.pipelines.cluster import check_cluster, expected_nodes
from m2flow.pipelines.placement import check_placement


def check_file(name: str, path: Optional[str], fix: str) -> None:
    """``path`` (field ``name``) is None or an existing file."""
    if path is not None and not Path(path).expanduser().is_file():
        is_dir = Path(path).expanduser().is_dir()
        what = "is a directory, not a file" if is_dir else "does not exist"
        raise field_error(name, path, f"{what}; {fix}.")


def check_runner_base(cfg: Any) -> None:
    """The fields of every workload's ``runner`` group (``RunnerBaseConfig.validate_base``),
    ``seed``, and that ``runner.log_dir`` is a folder if it exists."""
    cfg.runner.validate_base()
    check_bound(cfg, "seed", at_least(0), "use a non-negative seed")
    log_dir = Path(cfg.runner.log_dir).expanduser()
    if log_dir.exists() and not log_dir.is_dir():
        raise field_error("runner.log_dir", cfg.runner.log_dir,
                          "is a file; runs are written into a folder, point it at one.")


def check_cluster_config(cluster: Any, components: Sequence[str],
                         unused: Sequence[str] = ()) -> Optional[Placement]:
    """The ``cluster`` group against the machines it will have, before Ray starts: the
    backend, and the placement of ``components`` (the workload's; the config may list fewer)
    on this machine's cores and GPUs; ``unused``: names the config may list that this
    workload ignores (a cluster group shared with another workload places them). Returns the
    placement; None when joining a Ray cluster (its nodes are known once connected; the
    node-independent rules are checked)."""
    known = tuple(components) + tuple(unused)
    try:
        check_cluster(cluster)
        nodes = expected_nodes(cluster)
        if nodes is None:
            check_placement(cluster.placement, known)
            return None
        placement = Placement(cluster.placement, nodes, known)
        for name in components:  # the unlisted ones get defaults: those must fit too
            placement.ranks(name)
        return placement
    except PlacementError as e:  # its fields are the cluster group's
        text = re.sub(r"(?<![\w.])placement\.", "cluster.placement.", str(e))
        raise FieldError(f"config error: {text}") from None
    except ValueError as e:
        raise FieldError(f"config error: {e}") from None


def check_resume(path: Optional[str], workload: str, name: str = "resume") -> Optional[dict]:
    """``path`` is None or an m2flow checkpoint of ``workload`` (read mapped, not loaded);
    returns its state, mapped (None for no path), for further checks without a second read."""
    if path is None:
        return None
    from m2flow.runs import checkpoint

    try:
        return checkpoint.load(path, workload=workload, mmap=True)
    except ValueError as e:
        good = checkpoint.newest_good(path, workload)
        other = f" The newest good checkpoint beside it: {good}." if good else ""
        raise FieldError(
            f"config error: {name}={path}: {str(e).splitlines()[0]}{other}") from None
