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
logprobs               float32  (B, C)      log-prob of each sampled token under
                                            log_softmax(raw logits / temperature), before
                                            the top-k cut (0 past the mask)
=====================  =======  ==========  ============================================

``hf`` (transformers ``generate`` with its KV cache) is the default and runs anywhere. A vLLM
or SGLang backend implements the same three methods on GPU machines and registers in
``ENGINES``: ``generate``, ``weight_receiver`` (where the learner's weights go after each step)
and ``release_cache`` (free the KV cache before the device goes to the learner). Its log-probs
must be of the same distribution (raw logits / temperature, before top-k), since the learner's
ratio divides by them. Sizes scale with (B, C) only: an engine keeps no (B, C, V) logits
(``HFEngine``'s docstring has the numbers).

Weights arrive in buckets of bounded bytes, never as one state dict (a 7B model's is ~15 GB,
more than a local Ray object store holds; see :mod:`m2flow.runs.weights`). The receiver an
engine returns takes one sync as ``begin(keys, full=..., stage=...)``, ``receive(bucket)`` per
:class:`~m2flow.runs.weights.WeightBucket`, then ``finish()``; names are the Hugging Face
state-dict names of the learner's model; tensors come in the learner's dtype (fp32 masters)
and are cast on load; a tensor larger than a bucket comes as row ranges of its first dimension
(``bucket.rows``). ``HFEngine`` loads into its model with
:class:`~m2flow.runs.weights.WeightReceiver`. A backend whose model takes whole named tensors
(vLLM's and SGLang's ``model.load_weights(iterable of (name, tensor))``, which also fuse q/k/v
and gate/up) holds a row-cut tensor's ranges until it is whole (one tensor at a time), and must
raise :class:`~m2flow.runs.weights.WeightSyncError` as ``WeightReceiver`` does when a name is
not its model's or an announced tensor did not arrive by ``finish()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.reasoning.config import GenerationConfig
from m2flow.runs.weights import WeightReceiver


class GenerationEngine(ABC):
    def __init__(self, model, tokenizer, cfg: GenerationConfig, device: str):
        self.model, self.tokenizer, self.cfg, self.device = model, tokenizer, cfg, device

    @abstractmethod
    def generate(self, prompts: list[str], n: int, *, greedy: bool = False,
                 seed: int = 0) -> TensorDict:
        """``n`` completions of each prompt (the table above)."""

    @abstractmethod
    def weight_receiver(self) -> WeightReceiver:
        """The receiving side of weight syncs into the model that generates (the contract is
        the module docstring's); one object kept for the engine's life."""

    def release_cache(self) -> None:
        """Frees any KV cache kept between calls (none for ``hf``: generate builds its own)."""


class HFEngine(GenerationEngine):
    """``model.generate`` with a KV cache; sampling seeded per call.

    Memory: the log-probs are gathered step by step (:class:`SampledLogprobs`), never from
    stacked logits: ``output_logits=True`` would keep (B, C, V) fp32 for the whole call,
    32 prompts x 8 samples x 1024 tokens x a 152k vocabulary = 159 GB. What it keeps is one
    step's (B, V) log-softmax (256 x 152k x 4 B = 156 MB) and (B, C) log-probs.

    The model's own generation config is replaced by one holding only its token ids: a chat
    checkpoint's ``generation_config.json`` (e.g. Qwen2.5-Instruct: repetition_penalty 1.05,
    top_p 0.8, top_k 20) would otherwise change the sampling distribution behind
    ``rollout.temperature``/``rollout.top_k``, and the log-probs the learner divides by.
    """

    def __init__(self, model, tokenizer, cfg: GenerationConfig, device: str):
        super().__init__(model, tokenizer, cfg, device)
        model.generation_config = plain_generation_config(model.generation_config)
        self._receiver = WeightReceiver(model)

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int, *, greedy: bool = False,
                 seed: int = 0) -> TensorDict:
        tok, cfg = self.tokenizer, self.cfg
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        kwargs = dict(max_new_tokens=cfg.max_new_tokens, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, num_return_sequences=n)
        # (a dict output would also return the KV cache, kept until this call ends)
        recorder = None
        if greedy:
            kwargs.update(do_sample=False)
        else:
            from transformers import LogitsProcessorList

            recorder = SampledLogprobs(cfg.temperature)
            kwargs.update(do_sample=True, temperature=cfg.temperature, top_k=cfg.top_k,
                          top_p=1.0, logits_processor=LogitsProcessorList([recorder]))
        self.model.eval()
        devices = [torch.device(self.device)] if str(self.device).startswith("cuda") else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            sequences = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        p = ids.shape[1]
        comp = sequences[:, p:]
        b, c = comp.shape[0], cfg.max_new_tokens
        completion = torch.full((b, c), tok.pad_token_id, dtype=torch.long, device=comp.device)
        completion[:, : comp.shape[1]] = comp
        logprobs = torch.zeros(b, c)
        if recorder is not None:
            logprobs[:, : comp.shape[1]] = recorder.finish(comp).cpu()
        cmask = completion_mask(completion, tok.eos_token_id)
        return TensorDict({
            keys.PROMPT_IDS: ids.repeat_interleave(n, dim=0).cpu(),
            keys.PROMPT_MASK: mask.bool().repeat_interleave(n, dim=0).cpu(),
            keys.COMPLETION_IDS: completion.cpu(),
            keys.COMPLETION_MASK: cmask.cpu(),
            keys.LOGPROBS: logprobs * cmask.cpu(),
        }, batch_size=[b])

    def weight_receiver(self) -> WeightReceiver:
        """Loads buckets into the model's own tensors (cast to its dtype, on its device, or in
        host memory while it is offloaded)."""
        return self._receiver


class SampledLogprobs:
    """A transformers logits processor that records the log-prob of each sampled token
    under ``log_softmax(raw logits / T)``.

    transformers runs custom processors after its own (none with
    :func:`plain_generation_config`) and before the sampling warpers (temperature, top-k), so
    the scores seen here are the raw logits, and the recorded distribution is the documented
    one (before top-k). A processor runs before its step's token is drawn: each call keeps
    the step's (B, V) log-softmax and gathers the previous one at the token then appended to
    ``input_ids``; :meth:`finish` gathers the last step's. Kept at any time: one (B, V), and
    the (B,) gathered per step.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.pending: torch.Tensor | None = None  # (B, V) fp32: the last step's log-softmax
        self.taken: list[torch.Tensor] = []  # (B,) per generated token, in order

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.taken.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, completion: torch.Tensor) -> torch.Tensor:
        """(B, L) log-probs of ``completion`` (B, L), the tokens ``generate`` returned (steps
        it ran and then dropped, if any, come after them and are cut off)."""
        length = completion.shape[1]
        if len(self.taken) < length and self.pending is not None:
            self.taken.append(self.pending.gather(-1, completion[:, length - 1 :]).squeeze(-1))
        self.pending = None
        if not self.taken:
            return torch.zeros(completion.shape, device=completion.device)
        return torch.stack(self.taken[:length], dim=1)


def plain_generation_config(config):
    """A transformers ``GenerationConfig`` with ``config``'s token ids and nothing else: no
    sampling defaults shipped with a checkpoint (repetition penalty, top-p, ...); ``generate``
    fills what is unset with its neutral defaults or the call's arguments.

    >>> from transformers import GenerationConfig
    >>> shipped = GenerationConfig(eos_token_id=2, repetition_penalty=1.05, top_p=0.8)
    >>> plain = plain_generation_config(shipped)
    >>> plain.eos_token_id, plain.repetition_penalty, plain.top_p
    (2, None, None)
    """
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                              pad_token_id=config.pad_token_id)


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
