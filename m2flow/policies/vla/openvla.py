"""OpenVLA-style policy: the action's tokens are decoded one after another after the prompt.

Same Prismatic model, inputs and action bins as :mod:`m2flow.policies.vla.oft`, but no
placeholders: token j of the action is predicted from the prompt and tokens 1..j-1 (causal),
one action per call (OpenVLA's 7 tokens). Sampling is restricted to the 256 action bins
(temperature, top-k); the training forward recomputes every token's log-prob in one
teacher-forced pass. The value head reads the hidden state of the last prompt token.

Rollout encodes the prefix once and then decodes token by token against a KV cache; the
log-probs it reports come from the same teacher-forced pass the learner runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.policies.action_tokenizer import N_BINS
from m2flow.policies.base import PolicyError
from m2flow.policies.vla.oft import OpenVLAOFTPolicy
from m2flow.policies.vla.oft_config import OFTPolicyConfig


@dataclass
class OpenVLAPolicyConfig(OFTPolicyConfig):
    """``policy.name=openvla``: openvla_oft's settings, one action per call."""

    chunk: int = 1
    """Actions decoded per call: OpenVLA decodes one (1 is the only value)."""


class OpenVLAPolicy(OpenVLAOFTPolicy):
    config_class = OpenVLAPolicyConfig

    @staticmethod
    def check_config(policy_cfg: OpenVLAPolicyConfig, env_cfg) -> None:
        _check_chunk(policy_cfg.chunk)
        OpenVLAOFTPolicy.check_config(policy_cfg, env_cfg)

    def __init__(self, cfg: OpenVLAPolicyConfig, env_spec, device: str = "cpu"):
        _check_chunk(cfg.chunk)
        super().__init__(cfg, env_spec, device=device)
        del self.queries  # no placeholders: the tail is the action tokens themselves

    def _step(self, obs: TensorDict, bins: torch.Tensor, keep: int):
        """Hidden states and bin logits of the last ``keep`` positions, after the prompt and
        the action tokens ``bins`` (B, j) chosen so far."""
        tail = self.vlm.embed_tokens(bins + self.actions.first_id)
        hidden = self._hidden(obs, tail, bidirectional_tail=False, keep=keep)
        return hidden, self.vlm.action_logits(hidden, self.actions.first_id, N_BINS).float()

    def _forward(self, obs: TensorDict, bins: Optional[torch.Tensor] = None):
        """Teacher-forced: logits (B, A, 256) of each of ``bins``' tokens, the value, and the
        LM's state at the last prompt token (B, h)."""
        b, a = obs.batch_size[0], self.action_dim
        dev = self.vlm.projector.fc1.weight.device
        if bins is None:
            bins = torch.zeros(b, a, dtype=torch.long, device=dev)
        hidden, logits = self._step(obs, bins[:, : a - 1].to(dev), keep=a)
        return logits, self._value(obs, hidden[:, 0]), hidden[:, 0]

    @torch.no_grad()
    def act(self, batch: TensorDict, deterministic: bool = False) -> TensorDict:
        obs = batch[keys.OBS]
        b = obs.batch_size[0]
        dev = self.vlm.projector.fc1.weight.device
        from transformers import DynamicCache

        # the prefix once, then one token at a time against the KV cache
        empty = torch.zeros(b, 0, self.vlm.hidden_size, device=dev)
        embeds, allowed, positions, valid = self._sequence(obs, empty, bidirectional_tail=False)
        cache = DynamicCache(config=self.vlm.llm.config)
        hidden = self.vlm.hidden_states(embeds, allowed, positions, cache=cache)[:, -1:]
        value = self._value(obs, hidden[:, 0])
        keys_valid, pos = valid, positions[:, -1:]
        chosen = []
        for j in range(self.action_dim):
            if j:
                pos = pos + 1
                keys_valid = torch.cat([keys_valid, keys_valid.new_ones(b, 1)], dim=1)
                tok = self.vlm.embed_tokens(chosen[-1][:, None] + self.actions.first_id)
                hidden = self.vlm.hidden_states(tok, keys_valid[:, None, :], pos, cache=cache)
            logits = self.vlm.action_logits(hidden, self.actions.first_id, N_BINS).float()
            chosen.append(self._sample(logits[:, 0], deterministic))
        bins = torch.stack(chosen, dim=1)
        logits, _, _ = self._forward(obs, bins)  # the same numbers the learner will compute
        tok_logp = self._log_probs(logits).gather(-1, bins[..., None]).squeeze(-1)
        return TensorDict({
            keys.ACTION: self._to_actions(bins),
            keys.ACTION_TOKENS: bins,
            keys.TOKEN_LOG_PROB: tok_logp,
            keys.LOG_PROB: tok_logp.sum(-1),
            keys.VALUE: value if value is not None else torch.zeros(b, device=dev),
        }, batch_size=[b])

    def evaluate_actions(self, batch: TensorDict) -> TensorDict:
        bins = batch[keys.ACTION_TOKENS].long()
        logits, value, features = self._forward(batch[keys.OBS], bins)
        logp = self._log_probs(logits)
        tok_logp = logp.gather(-1, bins[..., None]).squeeze(-1)
        b = bins.shape[0]
        return self._with_aux(TensorDict({
            keys.TOKEN_LOG_PROB: tok_logp,
            keys.LOG_PROB: tok_logp.sum(-1),
            keys.ENTROPY: -(logp.exp() * logp).sum(-1).mean(-1),
            keys.VALUE: value if value is not None else torch.zeros(b, device=bins.device),
        }, batch_size=[b]), batch[keys.OBS], features)


def _check_chunk(chunk: int) -> None:
    if chunk != 1:
        raise PolicyError(f"policy.chunk={chunk}: policy.name=openvla decodes one action per "
                          "call; use policy.name=openvla_oft for action chunks.")
