"""OpenVLA checkpoints in the published Hugging Face layout, from a local directory.

A directory like ``openvla/openvla-7b`` holds ``config.json`` (``timm_model_ids``,
``image_sizes``, ``use_fused_vision_backbone``, ``text_config`` for the Llama, ``norm_stats``),
safetensors shards (``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``, or
one ``model.safetensors``) with the published parameter names, the tokenizer files and
``dataset_statistics.json``. It is read here without ``trust_remote_code`` and without network:
the names map onto :class:`~m2flow.policies.vla.prismatic.Prismatic`:

    vision_backbone.featurizer.*        -> backbones.0.*
    vision_backbone.fused_featurizer.*  -> backbones.1.*
    projector.*                         -> projector.*
    language_model.*                    -> llm.*

``save`` writes the same layout (used by tests, which build a tiny checkpoint and check that
the loaded model's logits equal the original's).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from m2flow.policies.base import PolicyError
from m2flow.policies.vla.prismatic import Prismatic

RENAMES = (  # published prefix -> ours
    ("vision_backbone.featurizer.", "backbones.0."),
    ("vision_backbone.fused_featurizer.", "backbones.1."),
    ("projector.", "projector."),
    ("language_model.", "llm."),
)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _published(name: str) -> str:
    for theirs, ours in RENAMES:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    raise KeyError(name)


def _ours(name: str) -> Optional[str]:
    for theirs, ours in RENAMES:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return None


def save(vlm: Prismatic, path: str, vision: list[str], tokenizer=None,
         norm_stats: Optional[dict] = None, shards: int = 2) -> None:
    """Writes ``vlm`` in OpenVLA's layout (config.json, safetensors shards + index, tokenizer,
    dataset_statistics.json)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {_published(k): v.detach().contiguous() for k, v in vlm.state_dict().items()}
    names = sorted(state)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in part}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(v.numel() * v.element_size() for v in state.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                         "weight_map": weight_map}, indent=2))
    fused = len(vision) > 1
    config = {
        "model_type": "openvla",
        "architectures": ["OpenVLAForActionPrediction"],
        "use_fused_vision_backbone": fused,
        "arch_specifier": "no-align+fused-gelu-mlp" if fused else "no-align+gelu-mlp",
        "image_resize_strategy": "resize-naive",
        "timm_model_ids": [v.removeprefix("timm/") for v in vision],
        "timm_override_act_layers": [None] * len(vision),
        "image_sizes": [vlm.image_size] * len(vision),
        "text_config": vlm.llm.config.to_dict(),
        "n_action_bins": 256,
        "norm_stats": norm_stats or {},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    (out / "dataset_statistics.json").write_text(json.dumps(norm_stats or {}, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))


def load(path: str, dtype: torch.dtype = torch.float32) -> tuple[Prismatic, dict]:
    """(the model with the checkpoint's weights, its config dict) from a local directory."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    root = Path(path)
    if not (root / "config.json").is_file():
        raise PolicyError(
            f"policy.kwargs.checkpoint={path!r}: no config.json there; give a local directory "
            "in OpenVLA's Hugging Face layout (config.json, *.safetensors, tokenizer files)."
        )
    config = json.loads((root / "config.json").read_text())
    missing = [k for k in ("timm_model_ids", "image_sizes", "text_config") if k not in config]
    if missing:
        raise PolicyError(f"policy.kwargs.checkpoint={path!r}: config.json lacks {missing}; "
                          "is this an OpenVLA checkpoint?")
    if len(set(config["image_sizes"])) != 1:
        raise PolicyError(f"{path}: backbones with different image sizes {config['image_sizes']} "
                          "are not supported.")
    text = dict(config["text_config"])
    text.pop("model_type", None)
    llm_cfg = LlamaConfig(**{**text, "attn_implementation": "sdpa"})
    llm = LlamaForCausalLM(llm_cfg)
    vlm = Prismatic([f"timm/{m}" for m in config["timm_model_ids"]], config["image_sizes"][0], llm)
    if (root / INDEX).is_file():
        files = sorted(set(json.loads((root / INDEX).read_text())["weight_map"].values()))
    elif (root / SINGLE).is_file():
        files = [SINGLE]
    else:
        raise PolicyError(f"policy.kwargs.checkpoint={path!r}: no {INDEX} or {SINGLE}.")
    state = {}
    for f in files:
        for name, tensor in load_file(str(root / f)).items():
            ours = _ours(name)
            if ours is not None:
                state[ours] = tensor
    result = vlm.load_state_dict(state, strict=False)
    # tied or absent buffers aside, every parameter must come from the checkpoint
    missing = [k for k in result.missing_keys if not k.startswith(("mean", "std"))]
    if missing or result.unexpected_keys:
        raise PolicyError(
            f"policy.kwargs.checkpoint={path!r}: parameters do not match the published layout "
            f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
            f"{result.unexpected_keys[:5]})."
        )
    return vlm.to(dtype), config


def load_tokenizer(path: str):
    """The checkpoint's own tokenizer (``tokenizer.json``, or Llama's ``tokenizer.model``)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model")):
        raise PolicyError(f"policy.kwargs.checkpoint={path!r}: no tokenizer.json or "
                          "tokenizer.model in that directory.")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
