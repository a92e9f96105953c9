"""The OpenVLA and OpenVLA-OFT policies (tiny, random weights, fp32): shapes, log-probs against
transformers' own Llama forward, masks."""

import math

import pytest
import torch
from tensordict import TensorDict

from m2flow.envs.base import EnvSpec
from m2flow.policies import PolicyError, make_policy, policy_config

TASKS = ("pick up the bowl", "open the top drawer of the cabinet and put the black bowl inside")
KW = {"image_size": 32, "vision": ["timm/vit_tiny_patch16_224"], "chunk": 2, "hidden_size": 64,
      "intermediate_size": 128, "num_heads": 4}


def spec(tasks=TASKS):
    return EnvSpec({"rgb": (32, 32, 3), "wrist_rgb": (32, 32, 3), "state": (8,), "task": ()}, 7,
                   (-1.0,) * 7, (1.0,) * 7, 10, tasks=tasks)


def policy(tasks=TASKS, seed=0, **kw):
    torch.manual_seed(seed)
    return make_policy(policy_config(name="openvla_oft", **{**KW, **kw}), spec(tasks))


def obs(b=3, task=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    img = lambda: torch.randint(0, 256, (b, 32, 32, 3), dtype=torch.uint8, generator=g)  # noqa: E731
    return TensorDict({"rgb": img(), "wrist_rgb": img(), "state": torch.randn(b, 8, generator=g),
                       "task": torch.tensor(task if task is not None else [i % 2 for i in range(b)])},
                      batch_size=[b])


def test_act_shapes_and_training_log_probs_are_differentiable():
    p = policy()
    o = obs()
    out = p.act(TensorDict({"obs": o}, batch_size=[3]))
    assert out["action"].shape == (3, 2, 7) and out["action_tokens"].shape == (3, 14)
    assert out["action"].abs().max() <= 1.0
    ev = p.evaluate_actions(TensorDict({"obs": o, "action_tokens": out["action_tokens"]}, batch_size=[3]))
    assert ev["token_log_prob"].shape == (3, 14) and ev["log_prob"].shape == (3,)
    ev["log_prob"].sum().backward()  # differentiable for the learner
    assert p.queries.grad is not None and p.vlm.projector.fc1.weight.grad is not None


def test_prompt_padding_is_invisible():
    # task 0's prompt is padded in a policy that also knows the longer task 1, not in one
    # that knows task 0 alone; same weights, so the same logits
    a, b = policy(), policy(tasks=TASKS[:1])
    b.load_state_dict(a.state_dict())
    o = obs(b=2, task=[0, 0])
    la, lb = a._forward(o)[0], b._forward(o)[0]
    assert a.prompt_valid[0].sum() < a.prompt_valid.shape[1]  # really padded
    assert torch.allclose(la, lb, atol=1e-5)


def test_the_first_action_reads_the_last_placeholder_bidirectional_attention():
    p = policy()
    o = obs(b=1, task=[1])
    base = p._forward(o)[0]
    with torch.no_grad():
        p.queries[-1].add_(1.0)  # change only the last placeholder
    changed = p._forward(o)[0]
    assert not torch.allclose(base[:, 0], changed[:, 0])  # the first placeholder saw it


def test_samples_are_action_bins_even_when_text_tokens_dominate():
    p = policy(top_k=5)
    with torch.no_grad():  # make every text token far likelier than any action bin
        w = p.vlm.llm.get_output_embeddings().weight
        w[: -256] = w[: -256].sign() * 10
    out = p.act(TensorDict({"obs": obs()}, batch_size=[3]))
    assert out["action_tokens"].min() >= 0 and out["action_tokens"].max() < 256
    ids = out["action_tokens"] + p.actions.first_id
    assert ids.min() >= p.actions.vocab_size - 256


def test_top_k_one_is_greedy():
    p = policy(top_k=1)
    o = TensorDict({"obs": obs()}, batch_size=[3])
    assert torch.equal(p.act(o)["action_tokens"], p.act(o, deterministic=True)["action_tokens"])


def test_state_only_env_is_refused_with_the_fix():
    s = EnvSpec({"state": (8,)}, 7, (-1.0,) * 7, (1.0,) * 7, 10)
    with pytest.raises(PolicyError, match="env.obs_mode=rgb"):
        make_policy(policy_config(name="openvla_oft", **KW), s)
    with pytest.raises(PolicyError, match="policy 'openvla_oft' has no setting 'chunks'"):
        make_policy(policy_config(name="openvla_oft", chunks=8), spec())


def ar_policy(**kw):
    torch.manual_seed(0)
    kwargs = {**KW, **kw}
    kwargs.pop("chunk")
    return make_policy(policy_config(name="openvla", **kwargs), spec())


PROMPT = "In: What action should the robot take to {}?\nOut:"  # OpenVLA's, written out


@torch.no_grad()
def llama_bin_log_probs(p, o, bins, temperature):
    """(B, A, 256) log-probs of every action bin at each of the A action positions, from one
    teacher-forced pass of the Hugging Face ``LlamaForCausalLM`` (its own causal mask and
    positions) per env, unpadded: ``<s>``, the image patches, the proprio token, the prompt
    tokenised here, then ``bins``' tokens; log-softmax at ``temperature`` by a plain loop."""
    first = p.tokenizer.vocab_size - 256  # OpenVLA: the last 256 ids of the base vocabulary
    emb = p.vlm.llm.get_input_embeddings()
    images = p._images(o)  # (B, n, S, S, 3) after OpenVLA's preprocessing (tested on its own)
    b_, a_ = bins.shape
    out = torch.zeros(b_, a_, 256)
    for b in range(b_):
        text = p.tokenizer(PROMPT.format(TASKS[int(o["task"][b])]), add_special_tokens=False)
        ids = torch.tensor([text["input_ids"] + (bins[b, :-1] + first).tolist()])
        embeds = torch.cat([emb(torch.tensor([[p.tokenizer.bos_token_id]])),
                            p.vlm.image_tokens(images[b : b + 1]),
                            p.proprio(o["state"][b : b + 1].float())[:, None], emb(ids)], dim=1)
        logits = p.vlm.llm(inputs_embeds=embeds).logits[0].float()  # (L, V)
        L = logits.shape[0]
        for j in range(a_):  # the position before action token j predicts it
            z = logits[L - a_ + j, first : first + 256] / temperature
            out[b, j] = z - torch.logsumexp(z, dim=0)
    return out


def test_openvla_kv_cached_sampling_reports_llamas_teacher_forced_log_probs():
    p = ar_policy(temperature=0.7)
    o = obs()  # tasks 0, 1, 0: task 0's prompt is padded in the batch
    out = p.act(TensorDict({"obs": o}, batch_size=[3]))
    want = llama_bin_log_probs(p, o, out["action_tokens"], 0.7)
    want = want.gather(-1, out["action_tokens"][..., None]).squeeze(-1)  # (B, A)
    assert (want + math.log(256)).abs().max() > 0.05  # far from uniform: a real check
    assert torch.allclose(out["token_log_prob"], want, atol=1e-4, rtol=0)
    ev = p.evaluate_actions(TensorDict({"obs": o, "action_tokens": out["action_tokens"]},
                                       batch_size=[3]))  # the learner's pass
    assert torch.allclose(ev["token_log_prob"], want, atol=1e-4, rtol=0)


def test_openvla_greedy_kv_cached_decode_is_llamas_argmax_at_each_step():
    p = ar_policy()
    o = obs()
    out = p.act(TensorDict({"obs": o}, batch_size=[3]), deterministic=True)
    want = llama_bin_log_probs(p, o, out["action_tokens"], 1.0)
    assert torch.equal(want.argmax(-1), out["action_tokens"])
    assert len(set(out["action_tokens"].flatten().tolist())) > 1  # not one bin everywhere


def test_openvla_cached_decode_passes_the_cache_as_the_installed_transformers_names_it():
    """No deprecated ``past_key_values=`` on a transformers that calls it ``cache`` (5.40
    removes the old name; where the old name is the only one, it is what is passed)."""
    import warnings

    p = ar_policy()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        out = p.act(TensorDict({"obs": obs()}, batch_size=[3]), deterministic=True)
    assert out["action_tokens"].shape[0] == 3


def test_openvla_tokens_depend_on_earlier_ones_only():
    p = ar_policy(value_head=True)
    o = obs()
    a = p.act(TensorDict({"obs": o}, batch_size=[3]))["action_tokens"]
    b = a.clone()
    b[:, 2] = (b[:, 2] + 7) % 256
    la, lb = p._forward(o, a)[0], p._forward(o, b)[0]
    # causal: tokens 0-2's logits ignore token 2 and later; token 3's depend on token 2
    assert torch.allclose(la[:, :3], lb[:, :3], atol=1e-6)
    assert not torch.allclose(la[:, 3], lb[:, 3])


def test_openvla_refuses_chunks():
    with pytest.raises(PolicyError, match="openvla_oft"):
        make_policy(policy_config(name="openvla", **{**KW, "chunk": 4}), spec())


def test_lora_trains_adapters_only_and_starts_as_the_base_model():
    base, lora = policy(), policy(lora_rank=4)
    lora.load_state_dict(base.state_dict(), strict=False)  # same base weights
    o = obs()
    assert torch.allclose(base._forward(o)[0], lora._forward(o)[0], atol=1e-6)  # B = 0 at init
    trainable = {n for n, p in lora.vlm.llm.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    out = lora.act(TensorDict({"obs": o}, batch_size=[3]))
    lora.evaluate_actions(TensorDict({"obs": o, "action_tokens": out["action_tokens"]},
                             batch_size=[3]))["log_prob"].sum().backward()
    assert any(p.grad is not None for n, p in lora.vlm.llm.named_parameters() if "lora_B" in n)


def test_bfloat16_log_probs_are_the_float32_models_within_bfloat16_precision():
    p16, p32 = policy(dtype="bfloat16"), policy(dtype="float32")  # same seed: same weights
    assert p16.vlm.llm.get_input_embeddings().weight.dtype == torch.bfloat16
    o = obs()
    out = p16.act(TensorDict({"obs": o}, batch_size=[3]))
    ev = p32.evaluate_actions(TensorDict({"obs": o, "action_tokens": out["action_tokens"]},
                                         batch_size=[3]))
    assert (ev["token_log_prob"] + math.log(256)).abs().max() > 0.1  # far from uniform
    assert torch.allclose(out["token_log_prob"], ev["token_log_prob"], atol=0.02, rtol=0)


def test_prompt_suffix_ids_end_every_prompt():
    p = policy(prompt_suffix_ids=[5])
    last = [row[valid].tolist()[-1] for row, valid in zip(p.prompt_ids, p.prompt_valid)]
    assert last == [5, 5]
