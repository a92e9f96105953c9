"""openpi's converted PyTorch checkpoints (``model.safetensors`` of
``examples/convert_jax_model_to_pytorch.py``) for ``policy=pi0``, from a local directory.

The names are the module tree's own (:mod:`.pi0_model` builds openpi's layout), less the tied
names safetensors' ``save_model`` drops: of the names of one tied tensor it keeps the
alphabetically first, so the PaliGemma's ``lm_head.weight`` is stored and its
``embed_tokens.weight`` is not. ``tests/policies/data/pi0_names.txt`` and ``pi05_names.txt``
list the published tensors, derived from openpi's own model code.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from m2flow.policies.base import PolicyError
from m2flow.policies.vla import pi0_model as pm

SAFETENSORS = "model.safetensors"


def check_path(path: str) -> None:
    """PolicyError unless ``path`` is a directory holding ``model.safetensors``."""
    if not (Path(path).expanduser() / SAFETENSORS).is_file():
        raise PolicyError(f"policy.checkpoint={path!r}: no {SAFETENSORS} there (openpi's "
                          "converted PyTorch checkpoint directory).")


def published_layout(model: nn.Module) -> tuple[dict[str, tuple], dict[str, str]]:
    """(name -> shape of every tensor a saved checkpoint of ``model`` holds, dropped name ->
    the kept name it is tied to): safetensors' ``save_model`` keeps, of the names of one
    tied tensor, the alphabetically first."""
    groups: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    tied = {n: sorted(g)[0] for g in groups.values() for n in sorted(g)[1:]}
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in tied}, tied


def load(o, vocab: int, dtype: torch.dtype, device) -> pm.Pi0Model:
    """The network of a ``policy=pi0`` config ``o`` with the weights of ``o.checkpoint``:
    openpi's converted ``model.safetensors``; the network is built on
    ``meta``, the file's names and shapes checked against it, each tensor read onto ``device``
    in ``dtype`` (the projections in fp32) and assigned; tied names re-tied; the buffers no
    checkpoint stores (rotary frequencies, SigLIP's position ids) made on ``device``."""
    from safetensors import safe_open

    path = Path(o.checkpoint).expanduser() / SAFETENSORS
    with torch.device("meta"):
        model = pm.build(o, vocab)
    expected, tied = published_layout(model)
    with safe_open(str(path), framework="pt") as fh:
        found = {n: tuple(fh.get_slice(n).get_shape()) for n in fh.keys()}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [f"{k} {found[k]} (expected {expected[k]})" for k in expected
             if k in found and found[k] != expected[k]]
    if missing or unexpected or wrong:
        raise PolicyError(f"policy.checkpoint={o.checkpoint!r}: {SAFETENSORS} is not openpi's "
                          f"{o.variant} layout at size={o.size} (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}, shapes {wrong[:3]}); check "
                          "policy.variant and policy.size.")
    state = {}
    with safe_open(str(path), framework="pt", device=str(device)) as fh:
        for name in expected:
            t = fh.get_tensor(name)
            inner = name.startswith("paligemma_with_expert.")
            state[name] = t.to(dtype if inner else torch.float32)
    model.load_state_dict(state, strict=False, assign=True)
    for name, kept in tied.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(kept))
    _make_buffers(model, device)
    return model


def _make_buffers(model: nn.Module, device) -> None:
    """The non-persistent buffers a ``meta`` build leaves without values: rotary modules are
    rebuilt from their config; SigLIP's ``position_ids`` are 0 .. n-1, Gemma's embedding scale
    its own scalar."""
    for name, module in list(model.named_modules()):
        for bname, buf in list(module.named_buffers(recurse=False)):
            if not buf.is_meta:
                continue
            if bname == "embed_scale":  # transformers 5's scaled Gemma embedding
                module.register_buffer(bname, torch.tensor(module.scalar_embed_scale,
                                                            device=device), persistent=False)
            elif bname == "position_ids":
                module.register_buffer(bname, torch.arange(buf.shape[-1], device=device)
                                       .expand(buf.shape), persistent=False)
            elif hasattr(module, "config") and not list(module.parameters(recurse=False)):
                with torch.device(device):
                    fresh = type(module)(module.config)
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, fresh)
                break
            else:
                raise PolicyError(f"{name}.{bname}: a buffer without values after a meta "
                                  "build; m2flow cannot make it.")
