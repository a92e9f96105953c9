"""OpenVLA-OFT-style policy: one forward pass decodes a whole action chunk in parallel.

Sequence (per env): ``<s>``, the image patches (agent view, then wrist), one proprio token, the
prompt tokens, then ``chunk x action_dim`` action placeholders. Attention is causal, except
that the placeholders see each other (bidirectional among themselves); padding of shorter
prompts goes in front, masked out and skipped by the rotary positions, so every env's sequence
behaves as if unpadded. Each placeholder's hidden state goes through the LM head restricted to the 256
action-bin ids (the last 256 of the vocabulary): a categorical over bins, sampled with
temperature and top-k for RL, argmax when deterministic. Log-probs are of the sampled bins
under ``softmax(logits / temperature)`` over all 256 bins, computed the same way at rollout and
in training. An optional value head reads the mean placeholder state (for PPO).

Outputs of ``act``: ``action`` (B, chunk, action_dim) float, in the env's units;
``action_tokens`` (B, chunk * action_dim) int64 bin ids; ``token_log_prob`` (same shape);
``log_prob`` (B,) their sum; ``value`` (B,).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from m2flow import keys
from m2flow.policies.action_tokenizer import N_BINS, ActionStats, ActionTokenizer
from m2flow.policies.base import Policy, PolicyError
from m2flow.policies.config import PolicyConfig
from m2flow.policies.vla import checkpoint as vla_checkpoint
from m2flow.policies.vla.prismatic import Prismatic
from m2flow.policies.vla.text import prompt, tiny_tokenizer


@dataclass
class OFTOptions:
    """``policy.kwargs`` of ``policy.name=openvla_oft``."""

    vision: list = field(default_factory=lambda: ["timm/vit_tiny_patch16_224"])
    """One timm ViT, or two fused per patch (OpenVLA: DINOv2 + SigLIP)."""
    image_size: int = 64
    """Backbone resolution (env images are resized to it)."""
    image_keys: list = field(default_factory=lambda: ["rgb", "wrist_rgb"])
    """Image observations to read, in this order (those the env has)."""
    use_proprio: bool = True
    """Add one token projected from ``("obs", "state")``."""
    chunk: int = 8
    """Actions decoded per forward pass (LIBERO's OFT uses 8)."""
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    text_vocab: int = 512
    """Size of the locally built byte-level BPE (the LM vocabulary adds the 256 bins)."""
    temperature: float = 1.0
    top_k: int = 0
    """Sample among the k likeliest bins (0: all)."""
    value_head: bool = True
    """A critic on the mean placeholder state (PPO); GRPO does not need it."""
    unnorm: Optional[dict] = None
    """{q01, q99, mask}: un-normalise actions into env units (None: actions are in [-1, 1])."""
    checkpoint: Optional[str] = None
    """A local directory in OpenVLA's Hugging Face layout: its vision backbones, projector, LM
    and tokenizer replace the tiny ones (vision, image_size and the LM sizes are then its)."""
    unnorm_key: Optional[str] = None
    """With a checkpoint: the dataset whose action statistics (``norm_stats``) un-normalise."""
    prompt_suffix_ids: list = field(default_factory=list)
    """Token ids appended to every prompt; OpenVLA with Llama-2's tokenizer ends prompts with
    the empty token 29871 (its ``predict_action`` adds it)."""
    lora_rank: int = 0
    """> 0: train LoRA adapters (``peft``) of this rank on the LM's linear layers, the LM's own
    weights frozen; 0: train everything."""
    lora_alpha: int = 16
    dtype: str = "auto"
    """'float32', 'bfloat16', or 'auto' (bfloat16 where CUDA is available)."""


def _options(kwargs) -> OFTOptions:
    known = [f.name for f in fields(OFTOptions)]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise PolicyError(f"policy.kwargs.{unknown[0]} is not an option of policy.name="
                          f"'openvla_oft'; use one of {known}.")
    opts = OFTOptions(**kwargs)
    if opts.chunk < 1 or opts.temperature <= 0 or opts.top_k < 0:
        raise PolicyError("policy.kwargs: chunk >= 1, temperature > 0 and top_k >= 0 are needed "
                          f"(got chunk={opts.chunk}, temperature={opts.temperature}, "
                          f"top_k={opts.top_k}).")
    return opts


class OpenVLAOFTPolicy(Policy):
    @staticmethod
    def check_config(policy_cfg: PolicyConfig, env_cfg) -> None:
        """Raises PolicyError for a state-only env, bad ``policy.kwargs`` or a checkpoint
        directory that is not one; loads nothing."""
        name = policy_cfg.name
        if env_cfg.obs_mode == "state":
            raise PolicyError(
                f"policy={name} reads camera images, but env.obs_mode=state renders none; "
                "use env.obs_mode=rgb."
            )
        o = _options(dict(policy_cfg.kwargs))
        sizes = {"image_size": o.image_size, "hidden_size": o.hidden_size,
                 "num_layers": o.num_layers, "num_heads": o.num_heads,
                 "intermediate_size": o.intermediate_size, "text_vocab": o.text_vocab}
        for key, value in (sizes.items() if o.checkpoint is None else ()):  # else: its own
            if value < 1:
                raise PolicyError(f"policy.kwargs.{key}={value}: must be >= 1.")
        if o.checkpoint is None and o.hidden_size % o.num_heads:
            raise PolicyError(
                f"policy.kwargs.hidden_size={o.hidden_size}: must be a multiple of "
                f"policy.kwargs.num_heads={o.num_heads}."
            )
        if o.lora_rank < 0:
            raise PolicyError(f"policy.kwargs.lora_rank={o.lora_rank}: must be >= 0 (0: no LoRA).")
        if o.dtype not in ("auto", "float32", "bfloat16"):
            raise PolicyError(f"policy.kwargs.dtype={o.dtype!r}: use 'auto', 'float32' or "
                              "'bfloat16'.")
        ckpt = o.checkpoint
        if ckpt is not None and not (Path(ckpt).expanduser() / "config.json").is_file():
            raise PolicyError(
                f"policy.kwargs.checkpoint={o.checkpoint!r}: no config.json there; give a local "
                "directory in OpenVLA's Hugging Face layout, or null for the tiny model."
            )

    def __init__(self, cfg: PolicyConfig, env_spec):
        super().__init__()
        o = self.opts = _options(dict(cfg.kwargs))
        shapes = env_spec.obs_shapes
        self.image_keys = [k for k in o.image_keys if k in shapes]
        if not self.image_keys:
            raise PolicyError(
                f"policy.name=openvla_oft reads images {list(o.image_keys)}, but the env "
                f"observes {sorted(shapes)}; set env.obs_mode=rgb (or policy.kwargs.image_keys)."
            )
        self.use_proprio = o.use_proprio and "state" in shapes
        self.action_dim = env_spec.action_dim
        self.chunk = o.chunk  # env steps per call (the env worker runs the chunk)
        self.num_queries = o.chunk * self.action_dim
        self.stats = ActionStats(**o.unnorm) if o.unnorm else None
        if o.checkpoint:
            self.vlm, config = vla_checkpoint.load(o.checkpoint)
            self.tokenizer = vla_checkpoint.load_tokenizer(o.checkpoint)
            if o.unnorm_key:
                self.stats = ActionStats.from_openvla(config.get("norm_stats", {}), o.unnorm_key)
        else:
            self.tokenizer = tiny_tokenizer(o.text_vocab)
            self.vlm = Prismatic(list(o.vision), o.image_size,
                                 self._tiny_llm(len(self.tokenizer)))
        # as OpenVLA: the bins are the last 256 ids of the tokenizer's base vocabulary (the
        # LM's embedding table may be padded beyond it)
        self.actions = ActionTokenizer(self.tokenizer.vocab_size)
        if o.lora_rank > 0:
            _add_lora(self.vlm.llm, o.lora_rank, o.lora_alpha)
        dtype = _dtype(o.dtype)
        self.vlm.to(dtype)
        h = self.vlm.hidden_size
        self.proprio = nn.Linear(shapes["state"][0], h) if self.use_proprio else None
        self.queries = nn.Parameter(torch.randn(self.num_queries, h) * 0.02)
        self.value_head = nn.Linear(h, 1) if o.value_head else None
        tasks = list(env_spec.tasks) or [""]
        ids = [self.tokenizer(prompt(t), add_special_tokens=False)["input_ids"]
               + [int(i) for i in o.prompt_suffix_ids] for t in tasks]
        width = max(len(i) for i in ids)
        pad = self.tokenizer.pad_token_id or 0  # masked out: any id does
        self.register_buffer("prompt_ids", torch.tensor([i + [pad] * (width - len(i)) for i in ids]),
                             persistent=False)
        self.register_buffer("prompt_valid",
                             torch.tensor([[True] * len(i) + [False] * (width - len(i)) for i in ids]),
                             persistent=False)

    def _tiny_llm(self, vocab: int):
        from transformers import LlamaConfig

        o = self.opts
        return LlamaConfig(
            vocab_size=vocab, hidden_size=o.hidden_size, intermediate_size=o.intermediate_size,
            num_hidden_layers=o.num_layers, num_attention_heads=o.num_heads,
            num_key_value_heads=o.num_heads, max_position_embeddings=2048,
            bos_token_id=self.tokenizer.bos_token_id, eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id, tie_word_embeddings=False,
            attn_implementation="sdpa",
        )

    # -- the forward pass ------------------------------------------------------------------
    def _forward(self, obs: TensorDict) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(bin logits (B, Q, 256), value (B,) or None): the placeholders decoded at once."""
        b = obs.batch_size[0]
        hidden = self._hidden(obs, self.queries.expand(b, -1, -1), bidirectional_tail=True)
        logits = self.vlm.action_logits(hidden, self.actions.first_id, N_BINS).float()
        value = (self.value_head(hidden.float().mean(1)).squeeze(-1) if self.value_head
                 else None)
        return logits, value

    def _hidden(self, obs: TensorDict, tail: torch.Tensor, bidirectional_tail: bool,
                keep: Optional[int] = None) -> torch.Tensor:
        """LM hidden states of the last ``keep`` positions (default: the tail's length) of
        ``<s>, images, proprio, prompt, tail``; the tail sees itself bidirectionally or not."""
        embeds, allowed, positions, _ = self._sequence(obs, tail, bidirectional_tail)
        keep = tail.shape[1] if keep is None else keep
        return self.vlm.hidden_states(embeds, allowed, positions)[:, embeds.shape[1] - keep :]

    def _sequence(self, obs: TensorDict, tail: torch.Tensor, bidirectional_tail: bool):
        """(embeds (B, L, h), allowed (B, L, L), rotary positions (B, L), valid (B, L))."""
        images = torch.stack([obs[k] for k in self.image_keys], dim=1)  # (B, n, H, W, 3)
        b = images.shape[0]
        dev = self.vlm.projector.fc1.weight.device
        task = obs.get(keys.leaf(keys.TASK), None)
        task = torch.zeros(b, dtype=torch.long, device=dev) if task is None else task.long().to(dev)
        bos = self.vlm.embed_tokens(torch.full((b, 1), self.tokenizer.bos_token_id, device=dev))
        parts = [bos, self.vlm.image_tokens(images.to(dev))]
        if self.proprio is not None:
            state = obs[keys.leaf(keys.STATE)].float().to(dev)
            parts.append(self.proprio(state)[:, None].to(bos.dtype))
        n_prefix = sum(p.shape[1] for p in parts)
        parts += [self.vlm.embed_tokens(self.prompt_ids[task]), tail.to(bos.dtype)]
        embeds = torch.cat(parts, dim=1)
        L, Q = embeds.shape[1], tail.shape[1]
        valid = torch.ones(b, L, dtype=torch.bool, device=dev)
        valid[:, n_prefix : n_prefix + self.prompt_ids.shape[1]] = self.prompt_valid[task]
        # move the padding of shorter prompts to the front (stable), so the last prompt token
        # is right before the tail in every row
        order = torch.sort(valid.long(), dim=1, stable=True).indices
        embeds = embeds.gather(1, order[..., None].expand_as(embeds))
        valid = valid.gather(1, order)
        allowed = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
        if bidirectional_tail and Q:
            is_tail = torch.zeros(L, dtype=torch.bool, device=dev)
            is_tail[L - Q :] = True
            allowed = allowed | (is_tail[:, None] & is_tail[None, :])
        allowed = allowed[None] & valid[:, None, :]
        positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
        return embeds, allowed, positions, valid

    def _sample(self, logits: torch.Tensor, deterministic: bool) -> torch.Tensor:
        """Bins from bin logits (..., 256): argmax, or sampled with temperature and top-k."""
        if deterministic:
            return logits.argmax(-1)
        scores = logits / self.opts.temperature
        if self.opts.top_k:
            kth = scores.topk(self.opts.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        return torch.distributions.Categorical(logits=scores).sample()

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(logits / self.opts.temperature, dim=-1)

    def _to_actions(self, bins: torch.Tensor) -> torch.Tensor:
        ids = bins + self.actions.first_id
        a = self.actions.decode(ids).reshape(bins.shape[0], self.opts.chunk, self.action_dim)
        return self.stats.unnormalize(a) if self.stats is not None else a

    # -- Policy ----------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, batch: TensorDict, deterministic: bool = False) -> TensorDict:
        logits, value = self._forward(batch[keys.OBS])
        logp = self._log_probs(logits)
        bins = self._sample(logits, deterministic)
        tok_logp = logp.gather(-1, bins[..., None]).squeeze(-1)
        b = bins.shape[0]
        return TensorDict({
            keys.ACTION: self._to_actions(bins),
            keys.ACTION_TOKENS: bins,
            keys.TOKEN_LOG_PROB: tok_logp,
            keys.LOG_PROB: tok_logp.sum(-1),
            keys.VALUE: value if value is not None else torch.zeros(b, device=bins.device),
        }, batch_size=[b])

    def evaluate_actions(self, batch: TensorDict) -> TensorDict:
        logits, value = self._forward(batch[keys.OBS])
        logp = self._log_probs(logits)
        bins = batch[keys.ACTION_TOKENS].long()
        tok_logp = logp.gather(-1, bins[..., None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)  # per token
        b = bins.shape[0]
        return TensorDict({
            keys.TOKEN_LOG_PROB: tok_logp,
            keys.LOG_PROB: tok_logp.sum(-1),
            keys.ENTROPY: entropy.mean(-1),
            keys.VALUE: value if value is not None else torch.zeros(b, device=bins.device),
        }, batch_size=[b])

    def value(self, obs: TensorDict) -> torch.Tensor:
        if self.value_head is None:
            return torch.zeros(obs.batch_size[0], device=self.vlm.projector.fc1.weight.device)
        return self._forward(obs)[1]


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _add_lora(llm: nn.Module, rank: int, alpha: int) -> None:
    """LoRA adapters in place (peft's ``inject_adapter_in_model``: the module tree keeps its
    names); the LM's own weights stop training."""
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                       target_modules=LORA_TARGETS), llm)
    for name, param in llm.named_parameters():
        param.requires_grad = "lora_" in name


def _dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in table:
        raise PolicyError(f"policy.kwargs.dtype={name!r}: use 'auto', 'float32' or 'bfloat16'.")
    return table[name]
