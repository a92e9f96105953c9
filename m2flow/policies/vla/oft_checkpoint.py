"""Which OpenVLA-OFT checkpoint layouts load, and the files an OFT checkpoint adds.

Loads: OFT checkpoints that decode **discrete action tokens through the LM head** in one
parallel pass: SimpleVLA-RL's LIBERO SFT/RL releases and RLinf's (``implement_version:
rlinf``). They are OpenVLA's Hugging Face layout (``config.json``, safetensors, tokenizer,
``dataset_statistics.json``; read by :mod:`m2flow.policies.vla.checkpoint`), optionally with
``proprio_projector--<step>_checkpoint.pt`` (openvla-oft's ``ProprioProjector``: ``fc1``,
GELU, ``fc2``; keys possibly prefixed ``module.`` by DDP).

Refused at start-up, with one line naming the file found: openvla-oft's continuous heads
(``action_head--*.pt``: the L1-regression MLP or the diffusion head, with
``noisy_action_projector--*.pt``) and FiLM checkpoints (``vision_backbone--*.pt``, or
``use_film: true`` in ``config.json``). Their action distribution is not a categorical over
bins, so the token log-probs RL needs do not exist for them.

Norm statistics are :func:`m2flow.policies.vla.checkpoint.norm_stats` (``dataset_statistics.json``
entries replace ``config.json``'s of the same dataset, as SimpleVLA-RL and RLinf load them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from m2flow.policies.base import PolicyError
from m2flow.policies.vla import checkpoint as vla_checkpoint

PROPRIO = "proprio_projector"
REFUSED = {  # file prefix -> what it is
    "action_head": "a continuous action head (L1 regression or diffusion)",
    "noisy_action_projector": "a diffusion action head's noisy-action projector",
    "vision_backbone": "a FiLM vision backbone",
}
LOADS = ("OFT checkpoints that decode discrete action tokens through the LM head "
         "(SimpleVLA-RL's and RLinf's releases: OpenVLA's Hugging Face layout, optionally with "
         "proprio_projector--*_checkpoint.pt)")


def _component_files(root: Path, prefix: str) -> list[Path]:
    """openvla-oft's ``find_checkpoint_file``: files named ``<prefix>--*`` with 'checkpoint'."""
    return sorted(p for p in root.glob(f"{prefix}--*") if "checkpoint" in p.name)


def check_layout(path: str) -> Optional[Path]:
    """Raises PolicyError for an OFT layout that does not load (see module doc); returns the
    proprio projector file, or None when there is none. Reads file names and config.json only."""
    root = Path(path).expanduser()
    for prefix, what in REFUSED.items():
        found = _component_files(root, prefix)
        if found:
            raise PolicyError(
                f"policy.checkpoint={path!r} has {found[0].name}: {what}, which "
                f"m2flow does not load; it loads {LOADS}."
            )
    config = json.loads((root / "config.json").read_text())
    if config.get("use_film"):
        raise PolicyError(f"policy.checkpoint={path!r}: config.json has use_film: true "
                          f"(FiLM), which m2flow does not load; it loads {LOADS}.")
    proprio = _component_files(root, PROPRIO)
    if len(proprio) > 1:
        raise PolicyError(
            f"policy.checkpoint={path!r} has {len(proprio)} proprio projectors "
            f"({', '.join(p.name for p in proprio)}); keep the one the policy was trained with."
        )
    return proprio[0] if proprio else None


def load_proprio(file: Path) -> dict[str, torch.Tensor]:
    """The projector's state dict without DDP's ``module.`` prefix (openvla-oft's
    ``load_component_state_dict``)."""
    state = torch.load(file, map_location="cpu", weights_only=True)
    return {k.removeprefix("module."): v for k, v in state.items()}


def proprio_bounds(stats: dict, key: str, path: str) -> dict:
    """``stats[key]["proprio"]`` (q01, q99, mask): how the state was normalised in training."""
    entry = stats.get(key, {}).get("proprio")
    if entry is None or "q01" not in entry or "q99" not in entry:
        raise PolicyError(
            f"policy.checkpoint={path!r}: the statistics of unnorm_key={key!r} have no "
            "proprio q01/q99, which its proprio projector needs; set policy.use_proprio=false "
            "or use the checkpoint's own dataset_statistics.json."
        )
    return entry


def check_options(o) -> Optional[Path]:
    """Start-up checks of ``policy.checkpoint`` against the other settings ``o``
    (``OFTPolicyConfig``; file names and config.json only): its proprio projector file or None."""
    ckpt = o.checkpoint
    if not (Path(ckpt).expanduser() / "config.json").is_file():
        raise PolicyError(
            f"policy.checkpoint={ckpt!r}: no config.json there; give a local "
            "directory in OpenVLA's Hugging Face layout, or null for the tiny model."
        )
    proprio = check_layout(ckpt)
    if o.use_proprio and proprio is None:
        raise PolicyError(
            f"policy.use_proprio=true, but {ckpt!r} has no proprio_projector--*.pt; "
            "set policy.use_proprio=false (or null: follow the checkpoint)."
        )
    if o.unnorm_key is not None:
        vla_checkpoint.check_unnorm_key(ckpt, o.unnorm_key)
    elif proprio is not None and o.use_proprio is not False:
        raise PolicyError(
            f"policy.unnorm_key is needed: {ckpt!r} has a proprio projector, and the state "
            "is normalised with a dataset's statistics; set unnorm_key (e.g. "
            "libero_spatial_no_noops) or use_proprio: false."
        )
    return proprio
