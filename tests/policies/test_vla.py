"""The OpenVLA-OFT-style policy (tiny, random weights, fp32): shapes, log-probs, masks."""

import pytest
import torch
from tensordict import TensorDict

from m2flow.envs.base import EnvSpec
from m2flow.policies import PolicyConfig, PolicyError, make_policy

TASKS = ("pick up the bowl", "open the top drawer of the cabinet and put the black bowl inside")
KW = {"image_size": 32, "vision": ["timm/vit_tiny_patch16_224"], "chunk": 2, "hidden_size": 64,
      "intermediate_size": 128, "num_heads": 4}


def spec(tasks=TASKS):
    return EnvSpec({"rgb": (32, 32, 3), "wrist_rgb": (32, 32, 3), "state": (8,), "task": ()}, 7,
                   (-1.0,) * 7, (1.0,) * 7, 10, tasks=tasks)


def policy(tasks=TASKS, seed=0, **kw):
    torch.manual_seed(seed)
    return make_policy(PolicyConfig(name="openvla_oft", kwargs={**KW, **kw}), spec(tasks))


def obs(b=3, task=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    img = lambda: torch.randint(0, 256, (b, 32, 32, 3), dtype=torch.uint8, generator=g)  # noqa: E731
    return TensorDict({"rgb": img(), "wrist_rgb": img(), "state": torch.randn(b, 8, generator=g),
                       "task": torch.tensor(task if task is not None else [i % 2 for i in range(b)])},
                      batch_size=[b])


def test_act_shapes_and_training_log_probs_equal_the_rollouts():
    p = policy()
    o = obs()
    out = p.act(TensorDict({"obs": o}, batch_size=[3]))
    assert out["action"].shape == (3, 2, 7) and out["action_tokens"].shape == (3, 14)
    assert out["action"].abs().max() <= 1.0
    ev = p.evaluate_actions(TensorDict({"obs": o, "action_tokens": out["action_tokens"]}, batch_size=[3]))
    assert torch.allclose(ev["token_log_prob"], out["token_log_prob"], atol=1e-5, rtol=0)
    assert torch.allclose(ev["log_prob"], out["log_prob"], atol=1e-5, rtol=0)
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


def test_placeholders_attend_to_each_other_but_the_prefix_does_not_see_them():
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
        make_policy(PolicyConfig(name="openvla_oft", kwargs=KW), s)
    with pytest.raises(PolicyError, match="policy.kwargs.chunks"):
        make_policy(PolicyConfig(name="openvla_oft", kwargs={"chunks": 8}), spec())


def ar_policy(**kw):
    torch.manual_seed(0)
    kwargs = {**KW, **kw}
    kwargs.pop("chunk")
    return make_policy(PolicyConfig(name="openvla", kwargs=kwargs), spec())


def test_openvla_autoregressive_log_probs_equal_and_tokens_depend_on_earlier_ones():
    p = ar_policy(value_head=True)
    o = obs()
    out = p.act(TensorDict({"obs": o}, batch_size=[3]))
    assert out["action"].shape == (3, 1, 7) and out["action_tokens"].shape == (3, 7)
    ev = p.evaluate_actions(TensorDict({"obs": o, "action_tokens": out["action_tokens"]}, batch_size=[3]))
    assert torch.allclose(ev["token_log_prob"], out["token_log_prob"], atol=1e-5, rtol=0)
    assert torch.allclose(ev["value"], out["value"], atol=1e-5)
    # causal: token 0's logits ignore the later tokens; token 3's depend on token 2
    a = out["action_tokens"].clone()
    b = a.clone()
    b[:, 2] = (b[:, 2] + 7) % 256
    la, lb = p._forward(o, a)[0], p._forward(o, b)[0]
    assert torch.allclose(la[:, :3], lb[:, :3], atol=1e-6)
    assert not torch.allclose(la[:, 3], lb[:, 3])


def test_openvla_greedy_decoding_is_each_steps_argmax():
    p = ar_policy()
    o = obs(b=2)
    out = p.act(TensorDict({"obs": o}, batch_size=[2]), deterministic=True)
    logits = p._forward(o, out["action_tokens"])[0]
    assert torch.equal(logits.argmax(-1), out["action_tokens"])


def test_openvla_refuses_chunks():
    with pytest.raises(PolicyError, match="openvla_oft"):
        make_policy(PolicyConfig(name="openvla", kwargs={**KW, "chunk": 4}), spec())


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


def test_bfloat16_forward_gives_the_same_log_probs_at_rollout_and_training():
    p = policy(dtype="bfloat16")
    assert p.vlm.llm.get_input_embeddings().weight.dtype == torch.bfloat16
    o = obs()
    out = p.act(TensorDict({"obs": o}, batch_size=[3]))
    ev = p.evaluate_actions(TensorDict({"obs": o, "action_tokens": out["action_tokens"]}, batch_size=[3]))
    assert torch.equal(ev["token_log_prob"], out["token_log_prob"])


def test_prompt_suffix_ids_end_every_prompt():
    p = policy(prompt_suffix_ids=[5])
    last = [row[valid].tolist()[-1] for row, valid in zip(p.prompt_ids, p.prompt_valid)]
    assert last == [5, 5]
