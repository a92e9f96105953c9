"""OpenVLA checkpoints in the published Hugging Face layout, from a local directory.

A directory like ``openvla/openvla-7b`` holds ``config.json`` (OpenVLA's ``OpenVLAConfig``:
``timm_model_ids``, ``timm_override_act_layers``, ``image_sizes``, ``use_fused_vision_backbone``,
``arch_specifier``, ``text_config`` for the Llama, ``n_action_bins``, ``norm_stats``), safetensors
shards (``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``, or one
``model.safetensors``) with the published parameter names, the tokenizer files and
``dataset_statistics.json``. It is read here without ``trust_remote_code`` and without network:
the names map onto :class:`~m2flow.policies.vla.prismatic.Prismatic`:

    vision_backbone.featurizer.*        -> backbones.0.*
    vision_backbone.fused_featurizer.*  -> backbones.1.*
    projector.*                         -> projector.*
    language_model.*                    -> llm.*

and, inside the backbones, OpenVLA's ``*.scale_factor`` is timm's LayerScale ``*.gamma`` (its HF
export renames it because transformers rewrites parameter names containing ``gamma``).

The published ``text_config`` holds only what differs from ``LlamaConfig``'s defaults (for
openvla-7b: the padded ``vocab_size`` 32064 and ``pad_token_id``), so the defaults build
Llama-2-7B. The backbones are built from ``timm_model_ids`` as published; a shrunk checkpoint
(tests) adds the m2flow-only field ``m2flow_timm_kwargs`` (one dict of ``timm.create_model``
sizes per backbone), which published configs simply lack.

``load`` builds the module tree on the ``meta`` device and assigns each shard's tensors, read
straight onto the target device and cast to the target dtype: peak host memory is about one
tensor of a shard, never the model in fp32. ``save`` writes the same layout (m2flow's own
writer, for tests and small models).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from m2flow.policies.action_tokenizer import N_BINS
from m2flow.policies.base import PolicyError
from m2flow.policies.vla.prismatic import Prismatic

RENAMES = (  # published prefix -> ours
    ("vision_backbone.featurizer.", "backbones.0."),
    ("vision_backbone.fused_featurizer.", "backbones.1."),
    ("projector.", "projector."),
    ("language_model.", "llm."),
)
LAYER_SCALE = (".scale_factor", ".gamma")  # published LayerScale name -> timm's
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
STATISTICS = "dataset_statistics.json"
TIMM_KWARGS = "m2flow_timm_kwargs"
PROJECTORS = {"gelu-mlp": False, "fused-gelu-mlp": True}  # arch_specifier -> fused


def _published(name: str) -> str:
    """Our parameter name -> the published one.

    >>> _published("backbones.0.blocks.3.ls1.gamma")
    'vision_backbone.featurizer.blocks.3.ls1.scale_factor'
    """
    for theirs, ours in RENAMES:
        if name.startswith(ours):
            rest = name[len(ours):]
            if ours.startswith("backbones.") and rest.endswith(LAYER_SCALE[1]):
                rest = rest[: -len(LAYER_SCALE[1])] + LAYER_SCALE[0]
            return theirs + rest
    raise KeyError(name)


def _ours(name: str) -> Optional[str]:
    """A published parameter name -> ours (None: not part of the model).

    >>> _ours("vision_backbone.fused_featurizer.attn_pool.latent")
    'backbones.1.attn_pool.latent'
    >>> _ours("vision_backbone.featurizer.blocks.0.ls2.scale_factor")
    'backbones.0.blocks.0.ls2.gamma'
    """
    for theirs, ours in RENAMES:
        if name.startswith(theirs):
            rest = name[len(theirs):]
            if ours.startswith("backbones.") and rest.endswith(LAYER_SCALE[0]):
                rest = rest[: -len(LAYER_SCALE[0])] + LAYER_SCALE[1]
            return ours + rest
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
    kwargs = [dict(k) for k in vlm.vision_kwargs]
    acts = [k.pop("act_layer", None) for k in kwargs]
    text = vlm.llm.config.to_dict()
    config = {
        "model_type": "openvla",
        "architectures": ["OpenVLAForActionPrediction"],
        "use_fused_vision_backbone": fused,
        "arch_specifier": "no-align+fused-gelu-mlp" if fused else "no-align+gelu-mlp",
        "image_resize_strategy": "resize-naive",
        "timm_model_ids": [v.removeprefix("timm/") for v in vision],
        "timm_override_act_layers": acts,
        "image_sizes": [vlm.image_size] * len(vision),
        "text_config": text,
        "pad_token_id": text.get("pad_token_id"),
        "n_action_bins": N_BINS,
        "norm_stats": norm_stats or {},
    }
    if any(kwargs):
        config[TIMM_KWARGS] = kwargs
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    (out / STATISTICS).write_text(json.dumps(norm_stats or {}, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PolicyError(f"policy.checkpoint={str(path.parent)!r}: cannot read {what} "
                          f"{path.name} ({e}).") from None


def _raw_config(path: str) -> dict:
    root = Path(path).expanduser()
    if not (root / "config.json").is_file():
        raise PolicyError(
            f"policy.checkpoint={path!r}: no config.json there; give a local directory "
            "in OpenVLA's Hugging Face layout (config.json, *.safetensors, tokenizer files)."
        )
    return _read_json(root / "config.json", "its config")


def norm_stats(path: str) -> dict:
    """The checkpoint's per-dataset statistics: ``config.json``'s ``norm_stats`` and
    ``dataset_statistics.json`` together (the published openvla-7b has both, with the same
    Open-X keys). ``dataset_statistics.json`` wins where they differ, as in openvla's and
    openvla-oft's evaluation (``get_vla`` replaces ``vla.norm_stats`` by the file) and in
    SimpleVLA-RL's and RLinf's loaders. Reads no weights."""
    stats = dict(_raw_config(path).get("norm_stats") or {})
    file = Path(path).expanduser() / STATISTICS
    if file.is_file():
        stats.update(_read_json(file, "its statistics"))
    return stats


def check_unnorm_key(path: str, key: Optional[str]) -> None:
    """Raises PolicyError unless ``key`` names a dataset with action statistics (``q01``,
    ``q99``) in the checkpoint at ``path``; None (no un-normalisation asked) passes. Reads
    config.json and dataset_statistics.json only, so it runs at start-up.

    The base openvla-7b knows only its Open-X training sets (``bridge_orig``,
    ``fractal20220817_data``, ...); a LIBERO key needs a LIBERO fine-tune.
    """
    if key is None:
        return
    stats = norm_stats(path)
    if key not in stats:
        raise PolicyError(f"policy.unnorm_key={key!r} is not in the checkpoint's "
                          f"statistics at {path}; it has {sorted(stats)}.")
    action = stats[key].get("action") if isinstance(stats[key], dict) else None
    if not isinstance(action, dict) or not {"q01", "q99"} <= set(action):
        raise PolicyError(f"policy.unnorm_key={key!r}: the checkpoint's statistics at "
                          f"{path} have no action q01/q99 for it; pick another key of "
                          f"{sorted(stats)}.")


def read_config(path: str) -> dict:
    """``config.json`` checked against OpenVLA's ``configuration_prismatic.py``, with
    ``norm_stats`` completed from ``dataset_statistics.json``; one PolicyError per problem."""
    config = _raw_config(path)
    where = f"policy.checkpoint={path!r}: config.json"
    missing = [k for k in ("timm_model_ids", "image_sizes", "text_config") if k not in config]
    if missing:
        raise PolicyError(f"{where} lacks {missing}; is this an OpenVLA checkpoint?")
    ids = list(config["timm_model_ids"])
    fused = config.get("use_fused_vision_backbone")
    fused = len(ids) > 1 if fused is None else bool(fused)
    n = 2 if fused else 1
    acts = list(config.get("timm_override_act_layers") or [None] * n)
    kwargs = list(config.get(TIMM_KWARGS) or [{}] * n)
    for field, value in (("timm_model_ids", ids), ("image_sizes", config["image_sizes"]),
                         ("timm_override_act_layers", acts), (TIMM_KWARGS, kwargs)):
        if len(value) < n:
            raise PolicyError(f"{where} has {field}={value}, but use_fused_vision_backbone="
                              f"{fused} needs {n} entries.")
    if not all(isinstance(k, dict) for k in kwargs):
        raise PolicyError(f"{where} has {TIMM_KWARGS}={kwargs}; give one dict of "
                          "timm.create_model arguments per backbone (or leave it out).")
    if len(set(config["image_sizes"][:n])) != 1:
        raise PolicyError(f"{where}: backbones with different image sizes "
                          f"{config['image_sizes']} are not supported.")
    arch = config.get("arch_specifier")
    if arch is not None and PROJECTORS.get(arch.removeprefix("no-align+")) is not fused:
        raise PolicyError(f"{where} has arch_specifier={arch!r} with use_fused_vision_backbone="
                          f"{fused}; OpenVLA's projector is 'no-align+gelu-mlp' for one backbone "
                          "and 'no-align+fused-gelu-mlp' for two.")
    bins = config.get("n_action_bins", N_BINS)
    if bins != N_BINS:
        raise PolicyError(f"{where} has n_action_bins={bins}; the OpenVLA policies decode "
                          f"{N_BINS} bins.")
    kind = config["text_config"].get("model_type", "llama")
    if kind != "llama":
        raise PolicyError(f"{where} has text_config.model_type={kind!r}; only Llama language "
                          "models are supported.")
    config["norm_stats"] = norm_stats(path)
    config["use_fused_vision_backbone"] = fused
    config["timm_model_ids"], config["timm_override_act_layers"] = ids[:n], acts[:n]
    config[TIMM_KWARGS] = [dict(k) for k in kwargs[:n]]
    return config


def build(config: dict) -> Prismatic:
    """The module tree a (checked) config describes, on the ``meta`` device: shapes and
    names, no memory. ``load`` fills it; tests compare it with the published index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    text = {k: v for k, v in config["text_config"].items()
            if k not in ("model_type", "torch_dtype", "dtype")}
    vision_kwargs = [{**k, "act_layer": a} for k, a in
                     zip(config[TIMM_KWARGS], config["timm_override_act_layers"])]
    with torch.device("meta"):
        llm = LlamaForCausalLM(LlamaConfig(**{**text, "attn_implementation": "sdpa"}))
        return Prismatic([f"timm/{m}" for m in config["timm_model_ids"]],
                         config["image_sizes"][0], llm, vision_kwargs=vision_kwargs)


def expected_weights(vlm: Prismatic) -> dict[str, tuple[int, ...]]:
    """Published name -> shape of every tensor a checkpoint must hold for ``vlm`` (a tied LM
    head, if any, is left out: checkpoints do not store it)."""
    tied = vlm.llm.config.tie_word_embeddings
    return {_published(k): tuple(v.shape) for k, v in vlm.state_dict().items()
            if not (tied and k == "llm.lm_head.weight")}


def _shard_files(root: Path, path: str) -> list[str]:
    if (root / INDEX).is_file():
        return sorted(set(_read_json(root / INDEX, "its index")["weight_map"].values()))
    if (root / SINGLE).is_file():
        return [SINGLE]
    raise PolicyError(f"policy.checkpoint={path!r}: no {INDEX} or {SINGLE}.")


def _check_headers(root: Path, path: str, files: list[str], expected: dict) -> None:
    """Names and shapes of every shard (headers only, no data) against ``expected``."""
    from safetensors import safe_open

    found, unexpected = {}, []
    for f in files:
        with safe_open(str(root / f), framework="pt") as fh:
            for name in fh.keys():
                if _ours(name) is None:
                    continue  # not part of the VLA (e.g. an OFT head stored beside it)
                if name not in expected:
                    unexpected.append(name)
                found[name] = tuple(fh.get_slice(name).get_shape())
    missing = sorted(set(expected) - set(found))
    if missing or unexpected:
        raise PolicyError(
            f"policy.checkpoint={path!r}: parameters do not match the published layout "
            f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
            f"{unexpected[:5]}); config.json does not describe these weights."
        )
    wrong = [f"{k} {found[k]} (config.json gives {expected[k]})" for k in expected
             if found[k] != expected[k]]
    if wrong:
        raise PolicyError(f"policy.checkpoint={path!r}: tensor shapes differ from what "
                          f"config.json describes: {wrong[:3]}; config.json does not describe "
                          "these weights.")


def load(path: str, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu") -> tuple[Prismatic, dict]:
    """(the model with the checkpoint's weights, its checked config dict) from a local
    directory, every floating tensor in ``dtype`` on ``device``.

    The module tree is built on ``meta``; each shard's tensors are read by safetensors onto
    ``device``, cast, and assigned (``load_state_dict(assign=True)``), one shard at a time;
    the non-persistent buffers (pixel statistics, rotary frequencies) are then computed on
    ``device``. For openvla-7b in bfloat16 that is 15 GB on the device and no 30 GB fp32 copy
    on the host.
    """
    from safetensors import safe_open

    root = Path(path).expanduser()
    config = read_config(path)
    vlm = build(config)
    expected = expected_weights(vlm)
    files = _shard_files(root, path)
    _check_headers(root, path, files, expected)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # safetensors reads "cuda" as cuda:0
        device = torch.device("cuda", torch.cuda.current_device())
    for f in files:
        state = {}
        with safe_open(str(root / f), framework="pt", device=str(device)) as fh:
            for name in fh.keys():
                if name in expected:
                    t = fh.get_tensor(name)
                    state[_ours(name)] = t.to(dtype) if t.is_floating_point() else t
        vlm.load_state_dict(state, strict=False, assign=True)
        del state
    if vlm.llm.config.tie_word_embeddings:
        vlm.llm.tie_weights()
    vlm.reset_buffers(device)
    left = [n for n, t in [*vlm.named_parameters(), *vlm.named_buffers()] if t.is_meta]
    if left:  # the header check makes this unreachable unless the model changes
        raise PolicyError(f"policy.checkpoint={path!r}: no values for {left[:5]}.")
    return vlm, config


def load_tokenizer(path: str):
    """The checkpoint's own tokenizer (``tokenizer.json``, or Llama's ``tokenizer.model``)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model")):
        raise PolicyError(f"policy.checkpoint={path!r}: no tokenizer.json or "
                          "tokenizer.model in that directory.")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
