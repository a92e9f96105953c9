"""Causal language models: a local Hugging Face directory, or a tiny random-init preset.

The tiny preset's tokenizer is built here with the ``tokenizers`` package: one token per
printable ASCII character plus <pad>/<bos>/<eos>/<unk>, so nothing is downloaded.

>>> tok = tiny_tokenizer()
>>> tok.decode(tok("Q: 2+3?\\nA: 5")["input_ids"])
'Q: 2+3?\\nA: 5'
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

from m2flow.reasoning.config import ModelConfig

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
ARCHITECTURES = ("qwen2", "llama")


class ModelError(ValueError):
    """A model path or preset that cannot be loaded, named with the field to fix."""


def tiny_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` over printable ASCII."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        unk_token="<unk>", padding_side="left",
    )


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ModelError(f"model.dtype={name!r}: use auto, float32, bfloat16 or float16.") from None


def tiny_model(cfg: ModelConfig, tokenizer):
    """A random-init Qwen2 or Llama of the preset's size (seed it with torch.manual_seed)."""
    import transformers

    t = cfg.tiny
    if t.architecture not in ARCHITECTURES:
        raise ModelError(f"model.tiny.architecture={t.architecture!r}: use one of {list(ARCHITECTURES)}.")
    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[t.architecture]
    config = config_cls(
        vocab_size=len(tokenizer), hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        max_position_embeddings=t.max_position_embeddings, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return model_cls(config)


def load_model(cfg: ModelConfig, device: str = "cpu"):
    """(model, tokenizer) on ``device`` in ``cfg.dtype``: from ``cfg.path`` or the tiny preset."""
    if cfg.path is None:
        tokenizer = tiny_tokenizer()
        model = tiny_model(cfg, tokenizer)
    else:
        from transformers import AutoModelForCausalLM

        path = Path(cfg.path).expanduser()
        if not (path / "config.json").is_file():
            raise ModelError(
                f"model.path={cfg.path!r} is not a Hugging Face model directory (no config.json); "
                "give a local directory written by save_pretrained (or model.path=null for the "
                "tiny preset)."
            )
        tokenizer = load_tokenizer(cfg)
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=resolve_dtype(cfg.dtype, device)
        )
    model = model.to(device=device, dtype=resolve_dtype(cfg.dtype, device))
    if cfg.gradient_checkpointing:
        # transformers >= 5.x names it activation checkpointing (the old name warns)
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      completion_start: int, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of tokens ``input_ids[:, completion_start:]`` under ``model``, (B, C).

    Inputs are left-padded prompts followed by completions; positions count real tokens only,
    as ``generate`` counts them, so the values equal the ones sampling saw.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids, use_cache=False).logits
    logits = logits[:, completion_start - 1 : -1].float() / temperature
    targets = input_ids[:, completion_start:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer alone (the reward worker decodes; it needs no model)."""
    if cfg.path is None:
        return tiny_tokenizer()
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(cfg.path).expanduser()
    config = path / "tokenizer_config.json"
    cls = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    # A plain tokenizer.json (like the tiny preset's) saved next to a Qwen2/Llama config: Auto
    # would pick the model type's tokenizer class and replace its pre-tokenizer.
    loader = PreTrainedTokenizerFast if cls in GENERIC_TOKENIZERS else AutoTokenizer
    tokenizer = loader.from_pretrained(path, local_files_only=True, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
