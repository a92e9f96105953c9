"""OpenVLA-OFT policy: one forward pass decodes a whole action chunk in parallel.

The forward is openvla-oft's discrete-token one (``predict_action`` with no action head, as
SimpleVLA-RL's ``generate_action_verl`` and RLinf's ``OpenVLAOFTForRLActionPrediction`` run it
for RL). Sequence (per env): ``<s>``, the image patches (agent view, then wrist: openvla-oft's
``num_images_in_input``), one proprio token (``ProprioProjector``: fc1, GELU, fc2), the prompt
tokens (``prompt_suffix_ids`` ends them; Llama-2 checkpoints: the empty token 29871),
``chunk x action_dim`` action placeholders whose embeddings are zero (``queries``, a parameter
that starts at zero and trains only where ``trainable`` says so), then the stop token ``</s>``
(``stop_token``). Attention is fully bidirectional over the non-padding positions (the
``transformers-openvla-oft`` fork's Llama); padding of shorter prompts is masked out and
skipped by the rotary positions, so every env's sequence behaves as if unpadded.

Action token k is read, as a language model predicts the next token, from the position
*before* placeholder k (the last prompt token for k = 0): its LM-head logits restricted to the
256 action-bin ids (the last 256 of the tokenizer's vocabulary) form a categorical over bins,
sampled with temperature and top-k for RL, argmax when deterministic. Log-probs are of the
sampled bins under ``softmax(logits / temperature)`` over all 256 bins, computed the same way at
rollout and in training (RLinf's ``compute_logprobs_from_logits``; with ``top_k`` > 0 RLinf
scores under the top-k-truncated distribution instead, the same at its published ``top_k: -1``).
An optional value head reads the last prompt token's state (RLinf's critic input), or a
privileged critic the simulator state (``critic``).

Images go through OpenVLA's evaluation preprocessing first (:mod:`.preprocess`: JPEG round trip
and Lanczos3 resize for frames of another size, centre crop); decoded actions are un-normalised
with the checkpoint's statistics and, with ``gripper: libero``, put in LIBERO's gripper
convention. Published layouts that load: see :mod:`.oft_checkpoint`; the settings and their
checks: :mod:`.oft_config`.

Outputs of ``act``: ``action`` (B, chunk, action_dim) float, in the env's units;
``action_tokens`` (B, chunk * action_dim) int64 bin ids; ``token_log_prob`` (same shape);
``log_prob`` (B,) their sum; ``value`` (B,).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from m2flow import keys
from m2flow.policies.action_tokenizer import N_BINS, ActionStats, ActionTokenizer
from m2flow.policies.base import Policy, PolicyError
from m2flow.policies import critics, hidden_state
from m2flow.policies.vla import checkpoint as vla_checkpoint
from m2flow.policies.vla import oft_checkpoint
from m2flow.policies.vla import preprocess
from m2flow.policies.vla.oft_config import (
    PROPRIO_HIDDEN, OFTPolicyConfig, check_config, check_settings, weights_dtype)
from m2flow.policies.vla.prismatic import Prismatic
from m2flow.policies.vla.text import prompt, tiny_tokenizer
from m2flow.registry import Requires

PRIVILEGED_HIDDEN = [256, 256]


class ProprioProjector(nn.Module):
    """openvla-oft's ``ProprioProjector``: the state -> one LM embedding (fc1, GELU, fc2)."""

    def __init__(self, proprio_dim: int, llm_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(proprio_dim, llm_dim)
        self.fc2 = nn.Linear(llm_dim, llm_dim)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(state)))


class OpenVLAOFTPolicy(Policy):
    config_class = OFTPolicyConfig
    requires = Requires(("timm", "transformers"), "m2flow[vla]")  # the vision tower, the LM
    check_config = staticmethod(check_config)  # the settings, at start-up (no weights)

    def __init__(self, cfg: OFTPolicyConfig, env_spec, device: str = "cpu"):
        super().__init__()
        check_settings(cfg)
        o = self.opts = cfg
        shapes = env_spec.obs_shapes
        self.image_keys = [k for k in o.image_keys if k in shapes]
        if not self.image_keys:
            raise PolicyError(
                f"policy.name=openvla_oft reads images {list(o.image_keys)}, but the env "
                f"observes {sorted(shapes)}; set env.obs_mode=rgb (or policy.image_keys)."
            )
        self.action_dim = env_spec.action_dim
        self.chunk = o.chunk  # env steps per call (the env worker runs the chunk)
        self.num_queries = o.chunk * self.action_dim
        self.stats = ActionStats(**o.unnorm) if o.unnorm else None
        self.gripper = preprocess.GRIPPERS[o.gripper]
        dtype = weights_dtype(o.dtype, device)
        proprio_file, self.proprio_stats = None, None
        if o.checkpoint:
            proprio_file = self._load_checkpoint(o, dtype, device)
            use_proprio = proprio_file is not None if o.use_proprio is None else o.use_proprio
            if use_proprio and "state" in shapes:
                self.proprio_stats = ActionStats(**{
                    k: v for k, v in oft_checkpoint.proprio_bounds(
                        self.norm_stats, o.unnorm_key, o.checkpoint).items()
                    if k in ("q01", "q99", "mask")})
        else:
            self.tokenizer = tiny_tokenizer(o.text_vocab)
            with torch.device(device):
                shape = {k: v for k, v in (("patch_size", o.patch_size),
                                           ("depth", o.vision_depth)) if v is not None}
                self.vlm = Prismatic(list(o.vision), o.image_size,
                                     self._tiny_llm(len(self.tokenizer)),
                                     vision_kwargs=[shape] * len(o.vision))
            self.vlm.to(dtype)
            use_proprio = o.use_proprio is not False
        self.use_proprio = use_proprio and "state" in shapes
        # as OpenVLA: the bins are the last 256 ids of the tokenizer's base vocabulary (the
        # LM's embedding table may be padded beyond it)
        self.actions = ActionTokenizer(self.tokenizer.vocab_size)
        h = self.vlm.hidden_size
        with torch.device(device):  # the heads: fp32 (they train, or are tiny)
            extra = (critics.privileged_dim(shapes, "policy.proprio_privileged=true")
                     if o.proprio_privileged else 0)
            self.proprio = (ProprioProjector(shapes["state"][0] + extra, h)
                            if self.use_proprio else None)
            # the placeholders' embeddings: zero, as openvla-oft's masked input embeddings
            self.queries = nn.Parameter(torch.zeros(self.num_queries, h))
            privileged = o.critic == critics.PRIVILEGED
            self.value_head = nn.Linear(h, 1) if o.value_head and not privileged else None
            self.critic = (critics.privileged_critic(env_spec, PRIVILEGED_HIDDEN)
                           if privileged else None)
            self.image_pos = (nn.Parameter(torch.zeros(
                len(self.image_keys) * self.vlm.num_patches, h)) if o.image_positions else None)
            self.state_aux = critics.StateAux.build(h, shapes, o.state_aux)
        if self.proprio is not None and proprio_file is not None:
            self.proprio.load_state_dict(oft_checkpoint.load_proprio(proprio_file))
        ranges = hidden_state.ranges(o.proprio_hidden,
                                     shapes["state"][0] if self.use_proprio else None,
                                     PROPRIO_HIDDEN)
        if ranges and not self.use_proprio:
            raise PolicyError("policy.proprio_hidden hides dims of the proprio token, but "
                              "this policy reads no state; drop the setting.")
        self.register_buffer(  # a constant of the config: not saved
            "proprio_sees", hidden_state.sees(ranges, shapes["state"][0] if ranges else 0,
                                              device=device), persistent=False)
        if o.lora_rank > 0:
            self.vlm.add_lora(o.lora_rank, o.lora_alpha)
            self._freeze_all_but(o.trainable)
            for new in (self.state_aux, self.image_pos):  # not a checkpoint's: always train
                if new is not None:
                    new.requires_grad_(True)
        if o.gradient_checkpointing:
            self.vlm.checkpoint_layers()
        self._set_prompts(env_spec, o, device)

    def _load_checkpoint(self, o: OFTPolicyConfig, dtype: torch.dtype, device) -> Optional[Path]:
        """The VLM (in ``dtype`` on ``device``), tokenizer and statistics of
        ``o.checkpoint``; returns its proprio projector file (or None)."""
        proprio_file = oft_checkpoint.check_options(o)
        self.vlm, _ = vla_checkpoint.load(o.checkpoint, dtype=dtype, device=device)
        self.tokenizer = vla_checkpoint.load_tokenizer(o.checkpoint)
        self.norm_stats = vla_checkpoint.norm_stats(o.checkpoint)
        if o.unnorm_key:
            self.stats = ActionStats.from_openvla(self.norm_stats, o.unnorm_key)
        return proprio_file

    def _set_prompts(self, env_spec, o: OFTPolicyConfig, device) -> None:
        """``prompt_ids`` (n_tasks, P) right-padded and ``prompt_valid`` (n_tasks, P)."""
        tasks = list(env_spec.tasks) or [""]
        ids = [self.tokenizer(prompt(t), add_special_tokens=False)["input_ids"]
               + [int(i) for i in o.prompt_suffix_ids] for t in tasks]
        width = max(len(i) for i in ids)
        pad = self.tokenizer.pad_token_id or 0  # masked out: any id does
        self.register_buffer("prompt_ids", torch.tensor(
            [i + [pad] * (width - len(i)) for i in ids], device=device), persistent=False)
        self.register_buffer("prompt_valid", torch.tensor(
            [[True] * len(i) + [False] * (width - len(i)) for i in ids], device=device),
            persistent=False)

    def trainable_parts(self, names) -> dict[str, nn.Module]:
        """The modules (or parameters) ``policy.trainable`` names, those this policy has."""
        value = self.value_head if self.critic is None else self.critic
        parts = {"proprio": self.proprio, "value_head": value,
                 "queries": self.queries, "projector": self.vlm.projector,
                 "vision": self.vlm.backbones}
        return {n: parts[n] for n in names if parts.get(n) is not None}

    def _freeze_all_but(self, names) -> None:
        """Under LoRA: only the adapters (fp32, peft's convention) and the named parts train;
        every other weight is frozen in the dtype it was built in."""
        for name, param in self.named_parameters():
            param.requires_grad = "lora_" in name
            if "lora_" in name:
                param.data = param.data.float()
        for part in self.trainable_parts(names).values():
            params = [part] if isinstance(part, nn.Parameter) else list(part.parameters())
            for param in params:
                param.requires_grad = True

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
    def _forward(self, obs: TensorDict
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """(bin logits (B, Q, 256), value (B,) or None, the LM's state at the last prompt
        token (B, h)): the placeholders decoded at once."""
        b, q = obs.batch_size[0], self.num_queries
        tail = self.queries.expand(b, -1, -1)
        if self.opts.stop_token:
            stop = torch.full((b, 1), self.tokenizer.eos_token_id, device=self.prompt_ids.device)
            tail = torch.cat([tail, self.vlm.embed_tokens(stop).to(tail.dtype)], dim=1)
        embeds, allowed, positions, _ = self._sequence(obs, tail, bidirectional_tail=True,
                                                       full=True)
        hidden = self.vlm.hidden_states(embeds, allowed, positions)
        # action k is read where the LM predicts the token after: the last prompt token, then
        # placeholders 0 .. q-2
        first = embeds.shape[1] - tail.shape[1] - 1
        hidden = hidden[:, first : first + q]  # (B, Q, h)
        logits = self.vlm.action_logits(hidden, self.actions.first_id, N_BINS).float()
        return logits, self._value(obs, hidden[:, 0]), hidden[:, 0]

    def _value(self, obs: TensorDict, hidden_last_prompt: torch.Tensor) -> Optional[torch.Tensor]:
        """The critic's (B,) values: the privileged critic's, the value head's on the last
        prompt token's state, or None without either."""
        if self.critic is not None:
            return self.critic(obs)
        if self.value_head is None:
            return None
        return self.value_head(hidden_last_prompt.float()).squeeze(-1)

    def _hidden(self, obs: TensorDict, tail: torch.Tensor, bidirectional_tail: bool,
                keep: Optional[int] = None) -> torch.Tensor:
        """LM hidden states of the last ``keep`` positions (default: the tail's length) of
        ``<s>, images, proprio, prompt, tail``; the tail sees itself bidirectionally or not."""
        embeds, allowed, positions, _ = self._sequence(obs, tail, bidirectional_tail)
        keep = tail.shape[1] if keep is None else keep
        return self.vlm.hidden_states(embeds, allowed, positions)[:, embeds.shape[1] - keep :]

    def _images(self, obs: TensorDict) -> torch.Tensor:
        """(B, n, S, S, 3) uint8 at the backbone's size S, preprocessed as OpenVLA's evaluation
        does (:func:`preprocess.prepare_images`)."""
        images = torch.stack([obs[k] for k in self.image_keys], dim=1)  # (B, n, H, W, 3)
        b, n = images.shape[:2]
        o, size = self.opts, self.vlm.image_size
        flat = preprocess.prepare_images(images.reshape(b * n, *images.shape[2:]), size,
                                         resize=o.resize, jpeg=o.jpeg, crop=o.center_crop)
        return flat.reshape(b, n, size, size, 3)

    def _state(self, obs: TensorDict, dev) -> torch.Tensor:
        """The proprio state, normalised to [-1, 1] by the checkpoint's q01/q99 where it has
        them (openvla-oft's ``normalize_proprio``), 0 in ``proprio_hidden``'s dims."""
        state = obs[keys.leaf(keys.STATE)].float().to(dev)
        if self.proprio_stats is not None:
            q01, q99, mask = self.proprio_stats._as(state)
            scaled = 2 * (state - q01) / (q99 - q01 + 1e-8) - 1
            state = torch.where(mask, scaled, state).clamp(-1, 1)
        state = state if self.proprio_sees is None else state * self.proprio_sees
        if self.opts.proprio_privileged:
            state = torch.cat([state, obs[keys.leaf(keys.PRIVILEGED)].float().to(dev)], dim=-1)
        return state

    def _sequence(self, obs: TensorDict, tail: torch.Tensor, bidirectional_tail: bool,
                  full: bool = False):
        """(embeds (B, L, h), allowed (B, L, L), rotary positions (B, L), valid (B, L)) of
        ``<s>, images, proprio, prompt, tail``. Attention: causal, the tail bidirectional among
        itself if ``bidirectional_tail``, or every position sees every valid one if ``full``."""
        images = self._images(obs)
        b = images.shape[0]
        dev = self.prompt_ids.device
        task = obs.get(keys.leaf(keys.TASK), None)
        task = torch.zeros(b, dtype=torch.long, device=dev) if task is None else task.long().to(dev)
        bos = self.vlm.embed_tokens(torch.full((b, 1), self.tokenizer.bos_token_id, device=dev))
        patches = self.vlm.image_tokens(images.to(dev))
        if self.image_pos is not None:
            patches = patches + self.image_pos
        parts = [bos, patches.to(bos.dtype)]
        if self.proprio is not None:
            parts.append(self.proprio(self._state(obs, dev))[:, None].to(bos.dtype))
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
        if full:
            allowed = valid[:, None, :].expand(b, L, L)
        else:
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
        """Bins -> actions in the env's units: bin centres, un-normalised, gripper converted."""
        ids = bins + self.actions.first_id
        a = self.actions.decode(ids).reshape(bins.shape[0], self.opts.chunk, self.action_dim)
        a = self.stats.unnormalize(a) if self.stats is not None else a
        return self.gripper(a) if self.gripper is not None else a

    # -- Policy ----------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, batch: TensorDict, deterministic: bool = False) -> TensorDict:
        logits, value, _ = self._forward(batch[keys.OBS])
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
        logits, value, features = self._forward(batch[keys.OBS])
        logp = self._log_probs(logits)
        bins = batch[keys.ACTION_TOKENS].long()
        tok_logp = logp.gather(-1, bins[..., None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)  # per token
        b = bins.shape[0]
        out = TensorDict({
            keys.TOKEN_LOG_PROB: tok_logp,
            keys.LOG_PROB: tok_logp.sum(-1),
            keys.ENTROPY: entropy.mean(-1),
            keys.VALUE: value if value is not None else torch.zeros(b, device=bins.device),
        }, batch_size=[b])
        return self._with_aux(out, batch[keys.OBS], features)

    def _with_aux(self, out: TensorDict, obs: TensorDict, features: torch.Tensor) -> TensorDict:
        """``out`` with ``policy.state_aux``'s per-sample loss on ``features`` (if it is on)."""
        if self.state_aux is not None:
            out[keys.AUX_LOSS] = self.state_aux.loss(obs, features.float())
        return out

    def value(self, obs: TensorDict) -> torch.Tensor:
        if self.critic is not None:  # no LM forward for it
            return self.critic(obs)
        if self.value_head is None:
            return torch.zeros(obs.batch_size[0], device=self.vlm.projector.fc1.weight.device)
        return self._forward(obs)[1]

    def observe(self, batch: TensorDict) -> None:
        if self.critic is not None:
            self.critic.observe(batch)
        if self.state_aux is not None:
            self.state_aux.observe(batch)
