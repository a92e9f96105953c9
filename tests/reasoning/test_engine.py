"""The ``hf`` engine's sampling and log-probs against a plain loop over the Hugging Face
model's own forward, and the memory it keeps."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.reasoning.common import tiny_engine

PROMPTS = ["Q: a\nA:", "Q: a longer one\nA:"]


def plain_loop(model, out, temperature):
    """Per completion token, one teacher-forced forward of the unpadded prefix:
    (log_softmax(logits / T) at the sampled token, its rank among the raw logits)."""
    logprobs = torch.zeros(out["completion_ids"].shape)
    ranks = torch.zeros(out["completion_ids"].shape, dtype=torch.long)
    for b in range(out.batch_size[0]):
        prompt = out["prompt_ids"][b][out["prompt_mask"][b]]
        completion = out["completion_ids"][b][out["completion_mask"][b]]
        for j, token in enumerate(completion.tolist()):
            ids = torch.cat([prompt, completion[:j]])[None]
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, -1].double()
            logprobs[b, j] = torch.log_softmax(logits / temperature, -1)[token]
            ranks[b, j] = (logits > logits[token]).sum()
    return logprobs, ranks


def test_logprobs_are_the_raw_distribution_over_temperature_and_sampling_cuts_top_k():
    """The documented contract: log_softmax(raw logits / T), before the top-k cut; the
    tokens themselves are drawn from the top k only."""
    engine = tiny_engine(temperature=0.7, top_k=5)
    out = engine.generate(PROMPTS, 4, seed=3)
    mask = out["completion_mask"]
    expected, ranks = plain_loop(engine.model, out, 0.7)
    assert mask.sum() > 10
    torch.testing.assert_close(out["logprobs"][mask], expected[mask], atol=1e-5, rtol=0)
    assert ranks[mask].max() < 5
    assert (out["logprobs"][~mask] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_logprobs_on_cuda_equal_the_plain_loop():
    engine = tiny_engine(temperature=0.7, top_k=5)
    engine.model.to("cuda")
    engine.device = "cuda"
    out = engine.generate(PROMPTS, 4, seed=3)
    mask = out["completion_mask"]
    engine.model.to("cpu")
    expected, ranks = plain_loop(engine.model, out, 0.7)
    torch.testing.assert_close(out["logprobs"][mask], expected[mask], atol=1e-4, rtol=0)
    assert ranks[mask].max() < 5


def test_top_k_zero_samples_the_whole_vocabulary():
    """rollout.top_k=0 means no cut, not transformers' default of 50 (the tiny vocabulary
    has 101 tokens, near-uniform at init)."""
    engine = tiny_engine(temperature=1.0, top_k=0)
    out = engine.generate(PROMPTS, 4, seed=3)
    _, ranks = plain_loop(engine.model, out, 1.0)
    assert ranks[out["completion_mask"]].max() >= 50


def test_a_checkpoints_shipped_sampling_settings_do_not_apply():
    """A checkpoint's generation_config.json may ship e.g. no_repeat_ngram_size (or Qwen's
    repetition_penalty); the engine samples from logits / T alone, which may repeat a token."""
    engine = tiny_engine(temperature=1.0)
    engine.model.generation_config.no_repeat_ngram_size = 1  # as if loaded with the model
    engine = type(engine)(engine.model, engine.tokenizer, engine.cfg, "cpu")
    out = engine.generate(PROMPTS, 4, seed=3)
    repeats = 0
    for b in range(out.batch_size[0]):
        seen = set(out["prompt_ids"][b][out["prompt_mask"][b]].tolist())
        for token in out["completion_ids"][b][out["completion_mask"][b]].tolist():
            repeats += token in seen
            seen.add(token)
    assert repeats > 0
    expected, _ = plain_loop(engine.model, out, 1.0)
    mask = out["completion_mask"]
    torch.testing.assert_close(out["logprobs"][mask], expected[mask], atol=1e-5, rtol=0)


class LargestVocabTensor(TorchDispatchMode):
    """The most elements of any tensor an op produces with one row per sequence and the
    vocabulary as its last dimension (logits and what is computed from them; not the
    (hidden, V) view of the output embedding)."""

    def __init__(self, rows, vocab):
        super().__init__()
        self.rows, self.vocab, self.largest = rows, vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == self.rows
                    and t.shape[-1] == self.vocab):
                self.largest = max(self.largest, t.numel())
        return out


def test_generation_never_holds_logits_for_every_step():
    """(B, C, V) logits would be 159 GB at 32 prompts x 8 x 1024 tokens x 152k; what one
    step needs is (B, V)."""
    b, c = 4 * len(PROMPTS), 8
    engine = tiny_engine(max_new=c)
    vocab = engine.model.config.vocab_size
    with LargestVocabTensor(b, vocab) as seen:
        out = engine.generate(PROMPTS, 4, seed=3)
    assert out["completion_mask"].sum(-1).max() > 2  # several steps ran
    assert 0 < seen.largest <= b * vocab < b * c * vocab
