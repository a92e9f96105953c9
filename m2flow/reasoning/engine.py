"""Generation engines: the rollout worker's backend for sampling completions.

An engine takes prompts and returns one ``TensorDict`` of ``len(prompts) * n`` completions
(rows ``i*n .. i*n+n-1`` belong to prompt ``i``) with these keys:

=====================  =======  ==========  ============================================
key                    dtype    shape       meaning
=====================  =======  ==========  ============================================
prompt_ids             int64    (B, P)      the prompt, left-padded
prompt_mask            bool     (B, P)      real prompt tokens
completion_ids         int64    (B, C)      sampled tokens, right-padded to max_new_tokens
completion_mask        bool     (B, C)      tokens up to and including the first EOS
logprobs               float32  (B, C)      log-prob of each sampled token under the
                                            sampling distribution (logits / temperature)
=====================  =======  ==========  ============================================

``hf`` (transformers ``generate`` with its KV cache) is the default and runs anywhere. A vLLM
or SGLang backend implements the same three methods on GPU machines and registers in
``ENGINES``: ``generate``, ``load_weights`` (the learner's state dict after each step) and
``release_cache`` (free the KV cache before the device goes to the learner). Its log-probs
must be of the same distribution (raw logits / temperature, before top-k), since the learner's
ratio divides by them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.reasoning.config import GenerationConfig


class GenerationEngine(ABC):
    def __init__(self, model, tokenizer, cfg: GenerationConfig, device: str):
        self.model, self.tokenizer, self.cfg, self.device = model, tokenizer, cfg, device

    @abstractmethod
    def generate(self, prompts: list[str], n: int, *, greedy: bool = False,
                 seed: int = 0) -> TensorDict:
        """``n`` completions of each prompt (the table above)."""

    @abstractmethod
    def load_weights(self, state_dict: dict) -> None:
        """Takes the learner's weights."""

    def release_cache(self) -> None:
        """Frees any KV cache kept between calls (none for ``hf``: generate builds its own)."""


class HFEngine(GenerationEngine):
    """``model.generate`` with a KV cache; sampling seeded per call."""

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int, *, greedy: bool = False,
                 seed: int = 0) -> TensorDict:
        tok, cfg = self.tokenizer, self.cfg
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        kwargs = dict(max_new_tokens=cfg.max_new_tokens, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, return_dict_in_generate=True)
        if greedy:
            kwargs.update(do_sample=False, num_return_sequences=n, temperature=None,
                          top_k=None, top_p=None)
        else:
            kwargs.update(do_sample=True, num_return_sequences=n, temperature=cfg.temperature,
                          top_k=cfg.top_k or None, top_p=None, output_logits=True)
        self.model.eval()
        devices = [torch.device(self.device)] if str(self.device).startswith("cuda") else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        p = ids.shape[1]
        comp = out.sequences[:, p:]
        b, c = comp.shape[0], cfg.max_new_tokens
        completion = torch.full((b, c), tok.pad_token_id, dtype=torch.long, device=comp.device)
        completion[:, : comp.shape[1]] = comp
        logprobs = torch.zeros(b, c)
        if not greedy:
            logits = torch.stack(out.logits, dim=1).float() / cfg.temperature  # (B, L, V)
            lp = torch.log_softmax(logits, dim=-1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
            logprobs[:, : comp.shape[1]] = lp.cpu()
        cmask = completion_mask(completion, tok.eos_token_id)
        return TensorDict({
            keys.PROMPT_IDS: ids.repeat_interleave(n, dim=0).cpu(),
            keys.PROMPT_MASK: mask.bool().repeat_interleave(n, dim=0).cpu(),
            keys.COMPLETION_IDS: completion.cpu(),
            keys.COMPLETION_MASK: cmask.cpu(),
            keys.LOGPROBS: logprobs * cmask.cpu(),
        }, batch_size=[b])

    def load_weights(self, state_dict: dict) -> None:
        self.model.load_state_dict(state_dict)


def completion_mask(ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """True for tokens up to and including the first EOS of each row.

    >>> completion_mask(torch.tensor([[5, 2, 0], [5, 6, 7]]), eos_id=2).tolist()
    [[True, True, False], [True, True, True]]
    """
    is_eos = (ids == eos_id).long()
    return (is_eos.cumsum(-1) - is_eos) == 0


ENGINES: dict[str, type[GenerationEngine]] = {"hf": HFEngine}


def make_engine(model, tokenizer, cfg: GenerationConfig, device: str) -> GenerationEngine:
    try:
        cls = ENGINES[cfg.engine]
    except KeyError:
        raise ValueError(
            f"rollout.engine={cfg.engine!r} is not a generation engine; use one of "
            f"{sorted(ENGINES)} (vLLM/SGLang backends register in m2flow.reasoning.engine.ENGINES)."
        ) from None
    return cls(model, tokenizer, cfg, device)
