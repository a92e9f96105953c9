"""Text side of a VLA: the instruction prompt and a small tokenizer built locally.

OpenVLA's prompt is ``"In: What action should the robot take to {instruction}?\\nOut:"``. Real
checkpoints bring their own tokenizer (Llama's); tiny presets use a byte-level BPE trained here
on a fixed corpus (LIBERO's instructions and the prompt), so any text encodes, nothing is
downloaded, and the same corpus always gives the same tokenizer.
"""

from __future__ import annotations

import functools
import json

PROMPT = "In: What action should the robot take to {instruction}?\nOut:"
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ACTION_BINS = 256
CORPUS = (
    PROMPT,
    "pick up the black bowl between the plate and the ramekin and place it on the plate",
    "pick up the alphabet soup and place it in the basket",
    "open the middle drawer of the cabinet", "put the bowl on the stove",
    "put the wine bottle on top of the cabinet", "turn on the stove",
    "put both the alphabet soup and the tomato sauce in the basket",
    "push the cube to the goal", "pick up the cube and move it to the goal position",
)


def prompt(instruction: str) -> str:
    """OpenVLA's prompt for one instruction (lower-cased, as OpenVLA does)."""
    return PROMPT.format(instruction=instruction.lower().strip().rstrip("."))


@functools.lru_cache(maxsize=4)
def tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``CORPUS``: at most
    ``vocab_size`` text tokens (ids 0-2 are ``<s>``, ``</s>``, ``<pad>``), then 256 action-bin
    tokens, the last ids of ``vocab_size`` as OpenVLA expects."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS) * 4, trainer=trainer)
    # as in Llama's vocabulary for OpenVLA, the last 256 ids are the action bins: tokens that
    # text never produces, appended to the BPE vocabulary itself (so vocab_size counts them)
    model = json.loads(tok.to_str())["model"]
    vocab = dict(model["vocab"])
    n = len(vocab)
    vocab.update({f"<action_{k:03d}>": n + k for k in range(ACTION_BINS)})
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    full = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    full.pre_tokenizer, full.decoder = tok.pre_tokenizer, tok.decoder
    full.add_special_tokens([BOS, EOS, PAD])
    return PreTrainedTokenizerFast(tokenizer_object=full, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD)
