"""The π0 / π0.5 network in openpi's PyTorch layout (``PI0Pytorch``), from ``transformers``'
own modules: a PaliGemma (SigLIP vision tower, projector, Gemma) for the prefix and a Gemma
action expert for the suffix, one block-causal attention over both.

Parameter names are those of openpi's converted ``model.safetensors``
(``paligemma_with_expert.paligemma.model.{vision_tower,multi_modal_projector,language_model}``,
``paligemma_with_expert.gemma_expert.model.layers.N``, ``action_in_proj``, ``action_out_proj``,
π0's ``state_proj`` and ``action_time_mlp_{in,out}``, π0.5's ``time_mlp_{in,out}`` and the
expert norms' ``dense``), so a published checkpoint loads by name; the expert's ``lm_head``,
which openpi builds and saves but never uses, is kept for the same reason.

Joint attention (openpi's ``PaliGemmaWithExpertModel.forward``): in every layer each stream
normalises its tokens and projects them with its own q/k/v weights; queries, keys and values
of both are concatenated along the sequence, rotated by their positions and attend once under
the mask :func:`attention_mask`; each stream then applies its own output projection, residuals
and MLP. Both Gemmas must share heads, key-value heads and head width.

The mask follows big_vision's ``make_attn_mask`` as openpi uses it: token i attends token j iff
both are valid (not padding) and cumsum(ar)[j] <= cumsum(ar)[i], where ``ar`` marks the tokens
that start a new block. The prefix (images, prompt) is one block of zeros (bidirectional); π0's
suffix is the state token (ar 1), then the action tokens (1, 0, 0, ...): the prefix sees
neither, the state sees the prefix and itself, the actions see everything before and each
other. π0.5's suffix is the action tokens alone (its state is text in the prompt). Since the
prefix never attends the suffix, its keys and values can be computed once and reused for every
denoising step (:meth:`PaliGemmaWithExpert.forward` with ``past``), with the same numbers as
the joint pass.

π0.5's time conditioning is adaRMS (openpi's patched ``GemmaRMSNorm`` with ``cond_dim``):
every norm of the expert is :class:`AdaRMSNorm`, whose ``dense`` maps the time features to a
scale, shift and gate; the gate scales the residual branch it precedes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

PALIGEMMA_VOCAB = 257152  # openpi's PaliGemma vocabulary (and its expert's unused lm_head)
ROPE_THETA = 10000.0  # Gemma's rotary base
NORM_EPS = 1e-6  # Gemma's RMSNorm epsilon
GEMMA_ACT = "gelu_pytorch_tanh"


@dataclass(frozen=True)
class GemmaSize:
    """One Gemma's sizes (openpi's ``gemma.Config``)."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class VisionSize:
    """The SigLIP vision tower's sizes."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    patch: int
    image_size: int


# openpi's ``gemma.get_config`` variants and PaliGemma's SigLIP-So400m/14 at 224 px
GEMMA_2B = GemmaSize(width=2048, depth=18, mlp_dim=16384, num_heads=8, num_kv_heads=1,
                     head_dim=256)
GEMMA_300M = GemmaSize(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1,
                       head_dim=256)
SIGLIP_SO400M = VisionSize(width=1152, depth=27, mlp_dim=4304, num_heads=16, patch=14,
                           image_size=224)


class AdaRMSNorm(nn.Module):
    """openpi's adaptive RMSNorm: with c the conditioning (B, C) and (scale, shift, gate) =
    split(dense(c), 3), y = x / √(mean(x²) + ε) · (1 + scale) + shift, in float32 and cast back
    to x's dtype; returns (y, gate). ``dense`` starts at zero weights (openpi's init), so y
    starts as the plain RMS normalisation and the gate at the bias's third."""

    def __init__(self, dim: int, cond_dim: int, eps: float = NORM_EPS):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)
        nn.init.zeros_(self.dense.weight)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        var = x.float().pow(2).mean(-1, keepdim=True)
        normed = x * torch.rsqrt(var + self.eps)
        scale, shift, gate = self.dense(cond).unsqueeze(1).chunk(3, dim=-1)  # (B, 1, dim) each
        y = normed * (1 + scale.float()) + shift.float()
        return y.to(x.dtype), gate.to(x.dtype)


def attention_mask(valid: torch.Tensor, ar: torch.Tensor) -> torch.Tensor:
    """(B, N, N) bool, query i may attend key j: both valid and cumsum(ar)[j] <= cumsum(ar)[i]
    (big_vision's rule, openpi's ``make_att_2d_masks``). ``valid`` (B, N) bool, ``ar`` (B, N)
    or (N,) 0/1: 1 where a token starts a block that earlier tokens cannot see.

    >>> attention_mask(torch.ones(1, 4, dtype=torch.bool), torch.tensor([0, 0, 1, 1]))[0].int()
    tensor([[1, 1, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    cum = torch.cumsum(ar.long().expand(valid.shape), dim=1)
    blocks = cum[:, None, :] <= cum[:, :, None]
    return blocks & valid[:, None, :] & valid[:, :, None]


def _rotary(positions: torch.Tensor, head_dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's rotary (cos, sin), (B, L, head_dim), of integer positions (B, L)."""
    inv = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, device=positions.device,
                                            dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv  # (B, L, head_dim/2)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, L, d) rotated (transformers' ``apply_rotary_pos_emb``, rotate-half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _norm(module: nn.Module, x: torch.Tensor, cond) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(normalised x, gate or None): an adaRMS norm with its conditioning, or Gemma's own."""
    if isinstance(module, AdaRMSNorm):
        return module(x, cond)
    return module(x), None


def _gated(x: torch.Tensor, y: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
    """The residual x + y, or x + y·gate under adaRMS (openpi's ``_gated_residual``)."""
    return x + y if gate is None else x + y * gate


def gemma_config(size: GemmaSize, vocab: int):
    """A ``GemmaConfig`` of ``size`` as openpi makes it (``gelu_pytorch_tanh``)."""
    from transformers import GemmaConfig

    return GemmaConfig(vocab_size=vocab, hidden_size=size.width, intermediate_size=size.mlp_dim,
                       num_hidden_layers=size.depth, num_attention_heads=size.num_heads,
                       num_key_value_heads=size.num_kv_heads, head_dim=size.head_dim,
                       hidden_act=GEMMA_ACT, rms_norm_eps=NORM_EPS)


def paligemma_config(vision: VisionSize, text: GemmaSize, vocab: int):
    """A ``PaliGemmaConfig``: SigLIP without its pooling head, its projector onto the Gemma's
    width (openpi's settings: ``projector_hidden_act`` gelu_fast, image token = vocab)."""
    from transformers import PaliGemmaConfig, SiglipVisionConfig

    v = SiglipVisionConfig(hidden_size=vision.width, num_hidden_layers=vision.depth,
                           intermediate_size=vision.mlp_dim, num_attention_heads=vision.num_heads,
                           patch_size=vision.patch, image_size=vision.image_size,
                           vision_use_head=False, projection_dim=text.width,
                           projector_hidden_act="gelu_fast")
    return PaliGemmaConfig(vision_config=v, text_config=gemma_config(text, vocab),
                           projection_dim=text.width, image_token_index=vocab)


class VisionTower(nn.Module):
    """transformers' ``SiglipVisionModel`` under the attribute ``vision_model``."""

    def __init__(self, vision_model: nn.Module):
        super().__init__()
        self.vision_model = vision_model

    def forward(self, pixel_values: torch.Tensor):
        return self.vision_model(pixel_values=pixel_values)


class PaliGemmaWithExpert(nn.Module):
    """``paligemma`` (``PaliGemmaForConditionalGeneration``) and ``gemma_expert``
    (``GemmaForCausalLM`` without its token embedding), run layer by layer with one joint
    attention (module docstring). ``adarms``: the expert's norms are :class:`AdaRMSNorm` on
    conditioning of the expert's width (π0.5)."""

    def __init__(self, vision: VisionSize, prefix: GemmaSize, expert: GemmaSize, vocab: int,
                 adarms: bool):
        super().__init__()
        from transformers import (
            GemmaForCausalLM, PaliGemmaForConditionalGeneration, SiglipVisionModel)

        shared = ("num_heads", "num_kv_heads", "head_dim", "depth")
        if any(getattr(prefix, k) != getattr(expert, k) for k in shared):
            raise ValueError(f"the prefix and the expert Gemma must share {shared} for joint "
                             f"attention; got {prefix} and {expert}.")
        config = paligemma_config(vision, prefix, vocab)
        self.paligemma = PaliGemmaForConditionalGeneration(config)
        # openpi's transformers (4.53) names SigLIP's weights ``vision_tower.vision_model.*``;
        # transformers 5 dropped that level (renaming on load): put it back by name
        if not hasattr(self.paligemma.model.vision_tower, "vision_model"):
            self.paligemma.model.vision_tower = VisionTower(
                SiglipVisionModel(config.vision_config))
        self.gemma_expert = GemmaForCausalLM(gemma_config(expert, vocab))
        self.gemma_expert.model.embed_tokens = None
        if adarms:
            m = self.gemma_expert.model
            for layer in m.layers:
                layer.input_layernorm = AdaRMSNorm(expert.width, expert.width)
                layer.post_attention_layernorm = AdaRMSNorm(expert.width, expert.width)
            m.norm = AdaRMSNorm(expert.width, expert.width)
        self.head_dim, self.depth = prefix.head_dim, prefix.depth
        self.num_heads, self.num_kv_heads = prefix.num_heads, prefix.num_kv_heads

    @property
    def language_model(self):
        return self.paligemma.model.language_model

    def embed_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels (N, 3, S, S) in [-1, 1] -> image tokens (N, P, prefix width): SigLIP's last
        hidden states through the projector (openpi's ``embed_image``)."""
        tower = self.paligemma.model.vision_tower
        dtype = self.paligemma.model.multi_modal_projector.linear.weight.dtype
        feats = tower(pixel_values=pixels.to(dtype)).last_hidden_state
        return self.paligemma.model.multi_modal_projector(feats)

    def embed_language_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (B, L, width) times √width (openpi's prefix scaling)."""
        weight = self.language_model.embed_tokens.weight  # (transformers 5 scales inside its
        emb = F.embedding(ids, weight)                     # embedding, 4.53 did not: by hand)
        return emb * math.sqrt(emb.shape[-1])

    def forward(self, prefix: Optional[torch.Tensor], suffix: Optional[torch.Tensor],
                allowed: torch.Tensor, positions: torch.Tensor, cond: Optional[torch.Tensor] = None,
                past: Optional[list] = None, keep_kv: bool = False):
        """Last hidden states (after the final norms) of ``prefix`` (B, Lp, Wp) and ``suffix``
        (B, Ls, We), either may be None, and, if ``keep_kv``, each layer's rotated (keys,
        values) to pass as ``past`` to a later call. ``allowed`` (B, Lq, Lk) bool over the
        queries (prefix, then suffix) and the keys (``past``'s, then the queries'), ``positions``
        (B, Lq) rotary positions, ``cond`` (B, We) the expert's adaRMS conditioning."""
        streams = [prefix, suffix]
        models = [self.language_model, self.gemma_expert.model]
        conds = [None, cond]
        ref = prefix if prefix is not None else suffix
        mask = torch.zeros(allowed.shape, dtype=ref.dtype, device=ref.device)
        mask = mask.masked_fill(~allowed, torch.finfo(ref.dtype).min)[:, None]  # (B, 1, Lq, Lk)
        cos, sin = _rotary(positions, self.head_dim, ref.dtype)
        kept = []
        for i in range(self.depth):
            streams, kv = self._layer(i, models, streams, conds, mask, cos, sin,
                                      None if past is None else past[i])
            kept.append(kv)
        out = [None if h is None else _norm(m.norm, h, c)[0]
               for h, m, c in zip(streams, models, conds)]
        return out, (kept if keep_kv else None)

    def _layer(self, i: int, models, streams, conds, mask, cos, sin, past):
        """One joint layer: per-stream norms and projections, one attention, per-stream
        output projection, residuals and MLP."""
        qs, ks, vs, gates, lengths = [], [], [], [], []
        for model, h, c in zip(models, streams, conds):
            if h is None:
                gates.append(None)
                lengths.append(0)
                continue
            layer = model.layers[i]
            y, gate = _norm(layer.input_layernorm, h, c)
            gates.append(gate)
            lengths.append(h.shape[1])
            shape = (*y.shape[:-1], -1, self.head_dim)
            att = layer.self_attn
            qs.append(att.q_proj(y).view(shape).transpose(1, 2))  # (B, heads, L, d)
            ks.append(att.k_proj(y).view(shape).transpose(1, 2).to(qs[0].dtype))
            vs.append(att.v_proj(y).view(shape).transpose(1, 2).to(qs[0].dtype))
        q = _rotate(torch.cat([x.to(qs[0].dtype) for x in qs], 2), cos, sin)
        k, v = _rotate(torch.cat(ks, 2), cos, sin), torch.cat(vs, 2)
        if past is not None:
            k, v = torch.cat([past[0].to(k.dtype), k], 2), torch.cat([past[1].to(v.dtype), v], 2)
        rep = self.num_heads // self.num_kv_heads
        att = F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
            attn_mask=mask.to(q.dtype), scale=self.head_dim ** -0.5)
        att = att.transpose(1, 2).flatten(2)  # (B, Lq, heads * d)
        out, start = [], 0
        for model, h, c, gate, n in zip(models, streams, conds, gates, lengths):
            if h is None:
                out.append(None)
                continue
            layer = model.layers[i]
            o_proj = layer.self_attn.o_proj
            o = o_proj(att[:, start:start + n].to(o_proj.weight.dtype))
            h = _gated(h, o.to(h.dtype), gate)
            y, gate2 = _norm(layer.post_attention_layernorm, h, c)
            y = layer.mlp(y.to(layer.mlp.up_proj.weight.dtype))
            out.append(_gated(h, y.to(h.dtype), gate2))
            start += n
        return out, (k, v)

    def add_lora(self, rank: int, alpha: int) -> None:
        """peft LoRA adapters (fp32) on both Gemmas' attention and MLP projections, in place
        (the module tree keeps its names); every other weight here stops training."""
        from peft import LoraConfig, inject_adapter_in_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        for gemma in (self.language_model, self.gemma_expert.model):
            inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                               target_modules=targets), gemma)
        for name, param in self.named_parameters():
            param.requires_grad = "lora_" in name
            if "lora_" in name:
                param.data = param.data.float()


def sinusoidal(t: torch.Tensor, dim: int) -> torch.Tensor:
    """openpi's ``create_sinusoidal_pos_embedding`` of the flow time (periods 4e-3 to 4)."""
    from m2flow.policies.flow_chain import time_embedding

    return time_embedding(t.float(), dim)


class Pi0Model(nn.Module):
    """``PI0Pytorch``'s modules: ``paligemma_with_expert`` and the projections. ``pi05``:
    adaRMS time conditioning (``time_mlp_in/out``), no state token; else π0's ``state_proj``
    and action-time MLP (``action_time_mlp_in/out``). ``action_dim``: the padded width of
    actions and state (openpi: 32)."""

    def __init__(self, vision: VisionSize, prefix: GemmaSize, expert: GemmaSize, *, vocab: int,
                 action_dim: int, pi05: bool):
        super().__init__()
        self.pi05 = pi05
        self.paligemma_with_expert = PaliGemmaWithExpert(vision, prefix, expert, vocab, pi05)
        w = expert.width
        self.action_in_proj = nn.Linear(action_dim, w)
        self.action_out_proj = nn.Linear(w, action_dim)
        if pi05:
            self.time_mlp_in = nn.Linear(w, w)
            self.time_mlp_out = nn.Linear(w, w)
        else:
            self.state_proj = nn.Linear(action_dim, w)
            self.action_time_mlp_in = nn.Linear(2 * w, w)
            self.action_time_mlp_out = nn.Linear(w, w)

    def embed_suffix(self, state: Optional[torch.Tensor], x: torch.Tensor, t: torch.Tensor):
        """(tokens (B, Ls, We), ar (Ls,), adaRMS conditioning or None) of the noisy actions x
        (B, H, action_dim) at times t (B,), with π0's state token (state (B, action_dim)) first
        (openpi's ``embed_suffix``)."""
        w = self.action_in_proj.out_features
        time_emb = sinusoidal(t, w)  # (B, We)
        act = self.action_in_proj(x)  # (B, H, We)
        if self.pi05:
            cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(time_emb))))
            ar = [1] + [0] * (x.shape[1] - 1)
            return act, torch.tensor(ar, device=x.device), cond
        fused = torch.cat([act, time_emb[:, None].expand_as(act)], dim=-1)
        act = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(fused)))
        tokens = torch.cat([self.state_proj(state)[:, None], act], dim=1)
        ar = [1, 1] + [0] * (x.shape[1] - 1)
        return tokens, torch.tensor(ar, device=x.device), None


def sizes(o) -> tuple[VisionSize, GemmaSize, GemmaSize]:
    """(vision, prefix Gemma, expert Gemma) sizes of a ``policy=pi0`` config ``o``: openpi's
    for ``size=full``, else its tiny fields."""
    if o.size == "full":
        return SIGLIP_SO400M, GEMMA_2B, GEMMA_300M
    heads = dict(depth=o.depth, num_heads=o.num_heads, num_kv_heads=o.num_kv_heads,
                 head_dim=o.head_dim)
    return (VisionSize(width=o.vision_width, depth=o.vision_depth, mlp_dim=o.vision_mlp,
                       num_heads=o.vision_heads, patch=o.patch_size, image_size=o.image_size),
            GemmaSize(width=o.prefix_width, mlp_dim=o.prefix_mlp, **heads),
            GemmaSize(width=o.expert_width, mlp_dim=o.expert_mlp, **heads))


def build(o, vocab: int) -> Pi0Model:
    """The network of ``o`` (on the current default device: ``meta`` for a layout only)."""
    vision, prefix, expert = sizes(o)
    return Pi0Model(vision, prefix, expert, vocab=vocab, action_dim=o.action_dim,
                    pi05=o.variant == "pi05")
