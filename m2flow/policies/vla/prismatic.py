"""OpenVLA's Prismatic design: vision backbone(s) -> MLP projector -> Llama-style causal LM.

Image patches from a ``timm`` ViT (or, as OpenVLA, the patch features of two ViTs side by side,
DINOv2 + SigLIP, concatenated per patch), taken after the second-to-last block as OpenVLA does,
are projected into the LM's embedding space and
placed after the BOS token, before the prompt. The LM is ``transformers``' ``LlamaForCausalLM``
built from a config (random weights) or loaded from a local directory.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from m2flow.policies.base import PolicyError

PIXEL_MAX = 255.0
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def vision_backbone(name: str, image_size: int, **overrides) -> nn.Module:
    """A randomly initialised timm ViT that returns patch features (no hub download).

    ``overrides`` go to ``timm.create_model`` as OpenVLA passes them (``act_layer``, e.g.
    ``"quick_gelu"`` for CLIP) or to shrink the named architecture (``embed_dim``, ``depth``,
    ``num_heads``, ``mlp_ratio``) while keeping its kind (registers, LayerScale, pooling)."""
    import timm

    model = name.removeprefix("timm/")
    if model.split(".")[0] not in timm.list_models():
        raise PolicyError(
            f"policy.vision={name!r}: timm has no model {model!r}; use a ViT name from "
            "timm.list_models(), e.g. 'timm/vit_tiny_patch16_224'."
        )
    try:
        return timm.create_model(model, pretrained=False, num_classes=0, img_size=image_size,
                                 **overrides)
    except TypeError:
        raise PolicyError(
            f"policy.vision={name!r} is not a ViT (it takes no img_size) or does not take "
            f"{sorted(overrides)}; the VLA policies need patch tokens from a ViT."
        ) from None


class Projector(nn.Module):
    """OpenVLA's projector: 2 layers for one backbone, 3 (wider) for a fused pair."""

    def __init__(self, vision_dim: int, llm_dim: int, fused: bool):
        super().__init__()
        if fused:
            self.fc1 = nn.Linear(vision_dim, 4 * vision_dim)
            self.fc2 = nn.Linear(4 * vision_dim, llm_dim)
            self.fc3 = nn.Linear(llm_dim, llm_dim)
        else:
            self.fc1 = nn.Linear(vision_dim, llm_dim)
            self.fc2 = nn.Linear(llm_dim, llm_dim)
            self.fc3 = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc2(F.gelu(self.fc1(x)))
        return self.fc3(F.gelu(x)) if self.fc3 is not None else x


class Prismatic(nn.Module):
    """Images + text embeddings -> LM hidden states.

    Args:
        vision: one timm ViT name, or two (fused, as OpenVLA's DINOv2 + SigLIP).
        image_size: input resolution of the backbones.
        llm: a ``transformers`` Llama config (random init) or a built ``LlamaForCausalLM``.
        vision_kwargs: per backbone, extra ``timm.create_model`` arguments (see
            :func:`vision_backbone`); default none.

    Built under ``torch.device("meta")`` (as the checkpoint loader does, to hold no weights),
    the non-persistent buffers have no values until :meth:`reset_buffers`.
    """

    def __init__(self, vision: list[str], image_size: int, llm,
                 vision_kwargs: Optional[list[dict]] = None):
        super().__init__()
        from transformers import LlamaForCausalLM

        self.vision_kwargs = [dict(k) for k in (vision_kwargs or [{}] * len(vision))]
        if len(self.vision_kwargs) != len(vision):
            raise PolicyError(f"vision_kwargs: one dict per backbone ({len(vision)}), got "
                              f"{len(self.vision_kwargs)}.")
        self.backbones = nn.ModuleList(vision_backbone(n, image_size, **k)
                                       for n, k in zip(vision, self.vision_kwargs))
        grids = {b.patch_embed.num_patches for b in self.backbones}
        if len(grids) != 1:
            raise PolicyError(f"policy.vision={vision}: fused backbones must give the same "
                              f"number of patches at {image_size} px, got {sorted(grids)}.")
        self.num_patches = grids.pop()
        self.image_size = image_size
        self.llm = llm if isinstance(llm, nn.Module) else LlamaForCausalLM(llm)
        dim = self.llm.config.hidden_size
        self.projector = Projector(sum(b.num_features for b in self.backbones), dim,
                                   fused=len(self.backbones) > 1)
        for i, (mean, std) in enumerate(self._pixel_stats()):
            self.register_buffer(f"mean{i}", mean, persistent=False)
            self.register_buffer(f"std{i}", std, persistent=False)

    def _pixel_stats(self, device=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each backbone's pixel (mean, std), (1, 3, 1, 1) fp32, from its timm config."""
        out = []
        for b in self.backbones:
            cfg = b.pretrained_cfg
            out.append(tuple(torch.tensor(cfg.get(k, (0.5,) * 3), dtype=torch.float32,
                                          device=device).view(1, 3, 1, 1)
                             for k in ("mean", "std")))
        return out

    def reset_buffers(self, device="cpu") -> None:
        """Computes the non-persistent buffers on ``device``: each backbone's pixel mean/std and
        the LM's rotary frequencies (fp32, as transformers keeps them). No checkpoint stores
        them, so after a ``meta`` build they must be made here; a module that holds such a
        buffer is rebuilt from its own config (``LlamaRotaryEmbedding(config)``)."""
        for i, (mean, std) in enumerate(self._pixel_stats(device)):
            setattr(self, f"mean{i}", mean)
            setattr(self, f"std{i}", std)
        for name, module in list(self.llm.named_modules()):
            if not any(b.is_meta for b in module.buffers(recurse=False)):
                continue
            if not hasattr(module, "config"):
                raise PolicyError(f"llm.{name}: a buffer without values after a meta build, and "
                                  f"no config to rebuild {type(module).__name__} from.")
            with torch.device("cpu"):
                fresh = type(module)(module.config)
            parent, _, child = name.rpartition(".")
            setattr(self.llm.get_submodule(parent), child, fresh.to(device))

    @property
    def hidden_size(self) -> int:
        return self.llm.config.hidden_size

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.llm.get_input_embeddings()(ids)

    def image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B, n_img, H, W, 3) -> (B, n_img * num_patches, hidden)."""
        b, n = images.shape[:2]
        x = images.reshape(b * n, *images.shape[2:]).permute(0, 3, 1, 2).float() / PIXEL_MAX
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear",
                              antialias=True, align_corners=False)
        feats = []
        for i, bb in enumerate(self.backbones):
            xi = (x - getattr(self, f"mean{i}")) / getattr(self, f"std{i}")
            # as OpenVLA: the patch tokens of the second-to-last block (no final norm)
            (f,) = bb.get_intermediate_layers(xi.to(next(bb.parameters()).dtype),
                                              n={len(bb.blocks) - 2})
            feats.append(f)
        patches = self.projector(torch.cat(feats, dim=-1))  # (B*n, P, hidden)
        return patches.reshape(b, n * self.num_patches, -1)

    def hidden_states(self, embeds: torch.Tensor, allowed: torch.Tensor,
                      positions: torch.Tensor, cache=None) -> torch.Tensor:
        """Last-layer hidden states for ``embeds`` (B, L, hidden) where query i may attend
        key j iff ``allowed[b, i, j]`` (keys: the cached ones, then these); ``positions``
        (B, L) are the rotary positions. ``cache``: a ``DynamicCache`` to read and extend."""
        mask = torch.zeros(allowed.shape, dtype=embeds.dtype, device=embeds.device)
        mask = mask.masked_fill(~allowed, torch.finfo(embeds.dtype).min)[:, None]  # (B,1,L,K)
        kw = {_cache_kwarg(type(self.llm.model).forward): cache}
        out = self.llm.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                             use_cache=cache is not None, **kw)
        return out.last_hidden_state

    def action_logits(self, hidden: torch.Tensor, first_id: int, n_bins: int) -> torch.Tensor:
        """LM-head logits of the action-bin ids ``first_id .. first_id + n_bins - 1`` only (the
        last ids of the tokenizer's vocabulary; the LM's may be padded beyond it)."""
        w = self.llm.get_output_embeddings().weight[first_id : first_id + n_bins]
        return F.linear(hidden, w)

    def add_lora(self, rank: int, alpha: int) -> None:
        """LoRA adapters on the LM's linear layers, in place (peft's
        ``inject_adapter_in_model``: the module tree keeps its names); the LM's own weights
        stop training."""
        from peft import LoraConfig, inject_adapter_in_model

        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                           target_modules=LORA_TARGETS), self.llm)
        for name, param in self.llm.named_parameters():
            param.requires_grad = "lora_" in name

    def checkpoint_layers(self) -> None:
        """Hugging Face activation checkpointing of every LM decoder layer, non-reentrant
        (inputs that need no gradient, as under LoRA, still get their adapters' gradients)."""
        kw = {"use_reentrant": False}
        if hasattr(self.llm, "activation_checkpointing_enable"):  # transformers >= 5.x's name
            self.llm.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            self.llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


@functools.lru_cache(maxsize=None)
def _cache_kwarg(forward) -> str:
    """The name the installed transformers gives the KV cache argument of a decoder's
    ``forward``: ``cache`` in newer releases (5.24 here, where ``past_key_values`` still maps
    to it with a FutureWarning until 5.40 removes it), ``past_key_values`` in older ones."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
