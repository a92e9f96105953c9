"""OpenVLA-OFT for RL (issue 13, items 3, 5, 12): the forward equals a transcription of
openvla-oft's discrete-token ``predict_action`` (with the transformers-openvla-oft fork's fully
bidirectional Llama) on a checkpoint with a proprio projector in the published file layout;
unsupported published layouts are refused at start-up; under LoRA only the adapters and the
named heads train; ``dtype=auto`` follows the device the policy is built for."""

import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict

from m2flow.envs.base import EnvSpec
from m2flow.policies import PolicyConfig, PolicyError, make_policy, policy_config
from m2flow.policies import registry
from m2flow.policies.vla import checkpoint
from m2flow.policies.vla.oft import OpenVLAOFTPolicy
from m2flow.policies.vla.text import prompt

TASKS = ("pick up the bowl", "open the top drawer of the cabinet and put the black bowl inside")
KW = {"image_size": 32, "vision": ["timm/vit_tiny_patch16_224"], "chunk": 2, "hidden_size": 64,
      "intermediate_size": 128, "num_heads": 4, "image_keys": ["rgb"], "center_crop": False}
KEY = "libero_spatial_no_noops"
STATS = {KEY: {
    "action": {"q01": [-0.5, -0.4, -0.3, -0.2, -0.1, -0.6, 0.0], "q99": [0.5] * 6 + [1.0],
               "mask": [True] * 6 + [False]},
    "proprio": {"q01": [-0.3] * 8, "q99": [0.3] * 8, "mask": [True] * 7 + [False]},
}}
SUFFIX = 5  # stands in for Llama-2's empty token 29871 at the end of the prompt
TEMPERATURE = 1.6


def spec():
    return EnvSpec({"rgb": (32, 32, 3), "state": (8,), "task": ()}, 7, (-1.0,) * 7, (1.0,) * 7,
                   10, tasks=TASKS)


def obs(b=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDict({
        "rgb": torch.randint(0, 256, (b, 32, 32, 3), dtype=torch.uint8, generator=g),
        "state": torch.randn(b, 8, generator=g) * 0.4,  # some beyond q01/q99: clipped
        "task": torch.tensor([i % 2 for i in range(b)]),
    }, batch_size=[b])


@pytest.fixture(scope="module")
def oft_checkpoint_dir(tmp_path_factory):
    """A tiny OpenVLA checkpoint plus openvla-oft's proprio_projector--<step>_checkpoint.pt,
    saved by DDP (keys prefixed ``module.``), as finetune.py writes it."""
    path = tmp_path_factory.mktemp("oft")
    torch.manual_seed(0)
    base = make_policy(policy_config(name="openvla_oft", **{**KW, "use_proprio": False}),
                       spec())
    checkpoint.save(base.vlm, str(path), base.opts.vision, base.tokenizer, norm_stats=STATS)
    g = torch.Generator().manual_seed(3)
    h = base.vlm.hidden_size
    proprio = {"module.fc1.weight": torch.randn(h, 8, generator=g) * 0.3,
               "module.fc1.bias": torch.randn(h, generator=g) * 0.1,
               "module.fc2.weight": torch.randn(h, h, generator=g) * 0.1,
               "module.fc2.bias": torch.randn(h, generator=g) * 0.1}
    torch.save(proprio, path / "proprio_projector--50000_checkpoint.pt")
    return path, {k.removeprefix("module."): v for k, v in proprio.items()}


def loaded_policy(path, **kw):
    torch.manual_seed(1)  # the heads m2flow adds start differently than the saved model's
    kwargs = {**KW, "checkpoint": str(path), "unnorm_key": KEY, "gripper": "libero",
              "prompt_suffix_ids": [SUFFIX], "dtype": "float32", "temperature": TEMPERATURE,
              **kw}
    return make_policy(policy_config(name="openvla_oft", **kwargs), spec())


# -- a transcription of openvla-oft's predict_action (discrete tokens, no action head) -------
IGNORE_INDEX = -100


def upstream_predict_action(p, proprio_sd, image, state, task, chunk=2, action_dim=7):
    """Batch size 1, as openvla-oft evaluates. Returns (bin logits (Q, 256), actions)."""
    tok, vlm = p.tokenizer, p.vlm
    vocab = tok.vocab_size
    action_token_begin_idx = vocab - 257  # Llama-2: 31743
    stop_index = tok.eos_token_id  # Llama-2: 2
    ids = [tok.bos_token_id] + tok(prompt(task), add_special_tokens=False)["input_ids"]
    input_ids = torch.tensor([ids + [SUFFIX]])  # "insert the empty token if absent"
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    num_prompt_tokens = input_ids.shape[-1] - 1
    q = action_dim * chunk
    # _prepare_input_for_action_prediction / _prepare_labels_for_action_prediction
    input_ids = torch.cat([input_ids, torch.ones(1, q, dtype=torch.long),
                           torch.full((1, 1), stop_index)], dim=-1)
    labels = torch.cat([labels, torch.full((1, q + 1), action_token_begin_idx + 1)], dim=-1)
    labels[:, -1] = stop_index
    # _process_action_masks (get_current_action_mask | get_next_actions_mask)
    cumsum = torch.cumsum(labels != IGNORE_INDEX, dim=1)
    is_action = labels > action_token_begin_idx
    all_actions_mask = (((1 <= cumsum) & (cumsum <= action_dim)) | (cumsum > action_dim)) & is_action
    input_embeddings = vlm.llm.get_input_embeddings()(input_ids)
    input_embeddings = input_embeddings * ~all_actions_mask.unsqueeze(-1)
    patches = vlm.image_tokens(image[None, None])  # (1, P, h)
    # normalize_proprio (BOUNDS_Q99), then ProprioProjector: fc1, GELU, fc2
    st = STATS[KEY]["proprio"]
    lo, hi, mask = np.array(st["q01"]), np.array(st["q99"]), np.array(st["mask"])
    s = np.clip(np.where(mask, 2 * (state - lo) / (hi - lo + 1e-8) - 1, state), -1.0, 1.0)
    s = torch.tensor(s, dtype=torch.float32)[None]
    proprio = F.linear(F.gelu(F.linear(s, proprio_sd["fc1.weight"], proprio_sd["fc1.bias"])),
                       proprio_sd["fc2.weight"], proprio_sd["fc2.bias"])
    patches = torch.cat([patches, proprio[:, None]], dim=1)
    num_patches = patches.shape[1]
    mm = torch.cat([input_embeddings[:, :1], patches, input_embeddings[:, 1:]], dim=1)
    # the fork's SdpaAttention: every row takes the last row of the causal mask (no padding
    # here: every key), i.e. full bidirectional attention
    n = mm.shape[1]
    logits = vlm.llm(inputs_embeds=mm, attention_mask=torch.zeros(1, 1, n, n)).logits
    logits = logits[0, num_patches + num_prompt_tokens : num_patches + num_prompt_tokens + q]
    bin_logits = logits[:, vocab - 256 : vocab]
    token_ids = (bin_logits.argmax(-1) + vocab - 256).numpy()
    bins = np.linspace(-1, 1, 256)
    centers = (bins[:-1] + bins[1:]) / 2.0
    discretized = np.clip(vocab - token_ids - 1, a_min=0, a_max=centers.shape[0] - 1)
    normalized = centers[discretized].reshape(chunk, action_dim)
    a = STATS[KEY]["action"]
    q01, q99, amask = np.array(a["q01"]), np.array(a["q99"]), np.array(a["mask"])
    actions = np.where(amask, 0.5 * (normalized + 1) * (q99 - q01 + 1e-8) + q01, normalized)
    # run_libero_eval.process_action: normalize_gripper_action(binarize) + invert
    actions[..., -1] = -np.sign(2 * actions[..., -1] - 1)
    return bin_logits, actions


def test_forward_equals_openvla_ofts_predict_action_on_a_published_layout(oft_checkpoint_dir):
    path, proprio_sd = oft_checkpoint_dir
    p = loaded_policy(path)
    for name, t in proprio_sd.items():  # the projector came from the file
        assert torch.equal(p.proprio.state_dict()[name], t)
    o = obs()
    with torch.no_grad():
        logits = p._forward(o)[0]  # a padded batch: the two tasks' prompts differ in length
        det = p.act(TensorDict({"obs": o}, batch_size=[3]), deterministic=True)
        sampled = p.act(TensorDict({"obs": o}, batch_size=[3]))
        for i in range(3):
            ref_logits, ref_actions = upstream_predict_action(
                p, proprio_sd, o["rgb"][i], o["state"][i].double().numpy(), TASKS[i % 2])
            torch.testing.assert_close(logits[i], ref_logits, atol=1e-4, rtol=1e-4)
            np.testing.assert_allclose(det["action"][i].numpy(), ref_actions, atol=1e-5)
            # RLinf's log-probs: log-softmax of logits / temperature over the 256 bins
            ref_logp = F.log_softmax(ref_logits / TEMPERATURE, -1)
            torch.testing.assert_close(
                sampled["token_log_prob"][i],
                ref_logp.gather(-1, sampled["action_tokens"][i][:, None]).squeeze(-1),
                atol=1e-4, rtol=1e-4)
    assert set(det["action"][..., -1].unique().tolist()) <= {-1.0, 0.0, 1.0}  # binarised


@pytest.mark.parametrize("file, what", [
    ("action_head--150000_checkpoint.pt", "continuous action head"),
    ("noisy_action_projector--150000_checkpoint.pt", "diffusion"),
    ("vision_backbone--150000_checkpoint.pt", "FiLM"),
])
def test_continuous_and_film_oft_layouts_are_refused_at_start_up(tmp_path, file, what):
    (tmp_path / "config.json").write_text(json.dumps({"use_fused_vision_backbone": True}))
    (tmp_path / file).write_bytes(b"")
    cfg = policy_config(name="openvla_oft", checkpoint=str(tmp_path))
    with pytest.raises(PolicyError, match=rf"has {re.escape(file)}: .*{what}.*it loads OFT "
                                          r"checkpoints that decode discrete action tokens") as e:
        OpenVLAOFTPolicy.check_config(cfg, SimpleNamespace(obs_mode="rgb"))
    assert "\n" not in str(e.value)


def test_film_in_config_and_a_missing_proprio_projector_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"use_film": True}))
    env = SimpleNamespace(obs_mode="rgb")
    with pytest.raises(PolicyError, match="use_film: true"):
        OpenVLAOFTPolicy.check_config(
            policy_config(name="openvla_oft", checkpoint=str(tmp_path)), env)
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(PolicyError, match=r"use_proprio=true, .*no proprio_projector--\*\.pt"):
        OpenVLAOFTPolicy.check_config(policy_config(name="openvla_oft", checkpoint=str(tmp_path), use_proprio=True), env)


# -- LoRA: what trains, in which dtype --------------------------------------------------------
def tiny_policy(**kw):
    torch.manual_seed(0)
    return make_policy(policy_config(name="openvla_oft", **{**KW, **kw}), spec())


def test_under_lora_only_adapters_and_named_heads_train_and_a_step_leaves_the_rest_untouched():
    from m2flow.runs.learner import Trainer

    p = tiny_policy(lora_rank=4, dtype="bfloat16", value_head=True)
    names = [n for n, _ in p.named_parameters()]
    # peft names its adapters <layer>.lora_A.<adapter>.weight / lora_B; the default heads
    expected = {n for n in names if re.search(r"\.lora_[AB]\.", n)}
    expected |= {n for n in names if n.split(".")[0] in ("proprio", "value_head")}
    assert {n for n, t in p.named_parameters() if t.requires_grad} == expected
    assert p.critic_parameter_names() == ["value_head.weight", "value_head.bias"]  # warm-up's
    dtypes = dict((n, t.dtype) for n, t in p.named_parameters())
    assert {dtypes[n] for n in names if ".lora_" in n} == {torch.float32}
    assert dtypes["vlm.projector.fc1.weight"] == torch.bfloat16
    assert dtypes["vlm.llm.model.layers.0.self_attn.q_proj.base_layer.weight"] == torch.bfloat16

    trainer = Trainer(p, lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1))
    before = {n: t.detach().clone() for n, t in p.named_parameters()}
    o = obs()
    out = p.act(TensorDict({"obs": o}, batch_size=[3]))
    trainer.zero_grad()
    with trainer.autocast():
        ev = p.evaluate_actions(TensorDict({"obs": o, "action_tokens": out["action_tokens"]},
                                           batch_size=[3]))
        loss = -ev["log_prob"].mean() + ev["value"].pow(2).mean()
    trainer.backward(loss)
    trainer.step()
    after = dict(p.named_parameters())
    frozen = [n for n in names if n not in expected]
    assert any(n.startswith("vlm.backbones.") for n in frozen)
    assert all(torch.equal(after[n], before[n]) for n in frozen)  # bit-identical
    changed = {n for n in expected if not torch.equal(after[n], before[n])}
    assert any(".lora_B." in n for n in changed)
    assert {"proprio.fc1.weight", "value_head.weight"} <= changed


def test_privileged_critic_scores_the_simulator_state_trains_under_lora_and_needs_the_env():
    """``critic=privileged``: the value is an MLP of the normalised ("obs", "privileged")
    vector and the task's one-hot (computed here by hand), no value head exists, the actor's tokens do not depend on
    it, and under LoRA it is what trains during the critic warm-up."""
    from m2flow.envs import env_config

    torch.manual_seed(0)
    priv_spec = EnvSpec({"rgb": (32, 32, 3), "state": (8,), "task": (), "privileged": (11,)}, 7,
                        (-1.0,) * 7, (1.0,) * 7, 10, tasks=TASKS)
    cfg = policy_config(name="openvla_oft", **{**KW, "lora_rank": 4, "critic": "privileged"})
    p = make_policy(cfg, priv_spec)
    assert p.value_head is None
    assert set(p.critic_parameter_names()) == {n for n, _ in p.named_parameters()
                                               if n.startswith("critic.")}
    assert all(t.requires_grad for t in p.critic.parameters())
    o = obs(4)
    o["privileged"] = torch.randn(4, 11) * 3 + 1
    p.observe(TensorDict({"obs": o}, batch_size=[4]))
    x = o["privileged"]
    z = ((x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + 1e-8)).clamp(-10, 10)
    z = torch.cat([z, F.one_hot(o["task"].long(), len(TASKS)).float()], -1)  # the env's tasks
    h = torch.tanh(F.linear(z, p.critic.net[0].weight, p.critic.net[0].bias))
    h = torch.tanh(F.linear(h, p.critic.net[2].weight, p.critic.net[2].bias))
    by_hand = F.linear(h, p.critic.net[4].weight, p.critic.net[4].bias).squeeze(-1)
    out = p.act(TensorDict({"obs": o}, batch_size=[4]), deterministic=True)
    torch.testing.assert_close(out["value"], by_hand)
    torch.testing.assert_close(p.value(o), by_hand)
    o2 = o.clone()
    o2["privileged"] = torch.randn(4, 11)
    out2 = p.act(TensorDict({"obs": o2}, batch_size=[4]), deterministic=True)
    assert torch.equal(out2["action_tokens"], out["action_tokens"])
    assert not torch.allclose(out2["value"], out["value"])
    with pytest.raises(PolicyError, match="env.privileged_state=true"):
        registry.policy_class("openvla_oft").check_config(
            cfg, env_config(name="ManiSkill/PushCube-v1", obs_mode="rgb"))
    with pytest.raises(PolicyError, match="env.privileged_state=true"):
        make_policy(cfg, spec())
    with pytest.raises(PolicyError, match="policy.critic='value'"):
        make_policy(policy_config(name="openvla_oft", **{**KW, "critic": "value"}), spec())


def test_proprio_privileged_feeds_the_simulator_state_to_the_proprio_token_and_needs_the_env():
    """``proprio_privileged`` (a control): the proprio projector's input is the visible state
    (``proprio_hidden``'s dims zeroed) followed by ("obs", "privileged"), worked here by hand
    through fc1, GELU, fc2; the actor's bin distribution then depends on the privileged vector."""
    from m2flow.envs import env_config

    torch.manual_seed(0)
    priv_spec = EnvSpec({"rgb": (32, 32, 3), "state": (8,), "task": (), "privileged": (11,)}, 7,
                        (-1.0,) * 7, (1.0,) * 7, 10, tasks=TASKS)
    cfg = policy_config(name="openvla_oft", **{**KW, "proprio_privileged": True,
                                                "proprio_hidden": [[2, 4]]})
    p = make_policy(cfg, priv_spec)
    o = obs(4)
    o["privileged"] = torch.randn(4, 11)
    state = o["state"].clone()
    state[:, 2:4] = 0
    x = torch.cat([state, o["privileged"]], dim=-1)  # (4, 19)
    by_hand = F.linear(F.gelu(F.linear(x, p.proprio.fc1.weight, p.proprio.fc1.bias)),
                       p.proprio.fc2.weight, p.proprio.fc2.bias)
    torch.testing.assert_close(p.proprio(p._state(o, "cpu")), by_hand)
    out = p.act(TensorDict({"obs": o}, batch_size=[4]), deterministic=True)
    o2 = o.clone()
    o2["privileged"] = torch.randn(4, 11) * 5
    out2 = p.act(TensorDict({"obs": o2}, batch_size=[4]), deterministic=True)
    assert not torch.allclose(out2["log_prob"], out["log_prob"])  # the bins' distribution moved
    with pytest.raises(PolicyError, match="policy.proprio_privileged=true.*env.privileged_state"):
        registry.policy_class("openvla_oft").check_config(
            cfg, env_config(name="ManiSkill/PushCube-v1", obs_mode="rgb"))


@pytest.mark.parametrize("key, value", [("patch_size", 8), ("vision_depth", 3)])
def test_patch_size_and_depth_shape_the_tiny_vit_and_are_refused_with_a_checkpoint(tmp_path, key,
                                                                                 value):
    """At 32 px, patch 8 gives 16 patch tokens per image where the name's patch 16 gives 4;
    vision_depth sets the blocks (vit_tiny_patch16_224 has 12), and the tokens are then the
    output of the second-to-last block: block 1 of 3, worked here through timm's own blocks."""
    from m2flow.envs import env_config

    assert tiny_policy().vlm.num_patches == 4 and len(tiny_policy().vlm.backbones[0].blocks) == 12
    p = tiny_policy(**{key: value})
    if key == "patch_size":
        assert p.vlm.num_patches == 16
        assert p.vlm.image_tokens(obs(2)["rgb"][:, None]).shape[1] == 16
    else:
        bb = p.vlm.backbones[0]
        assert len(bb.blocks) == 3
        x = (obs(2)["rgb"].permute(0, 3, 1, 2).float() / 255 - p.vlm.mean0) / p.vlm.std0
        h = bb.patch_drop(bb.pos_drop(bb._pos_embed(bb.patch_embed(x))))
        h = bb.blocks[1](bb.blocks[0](bb.norm_pre(h)))[:, bb.num_prefix_tokens:]
        torch.testing.assert_close(p.vlm.image_tokens(obs(2)["rgb"][:, None]), p.vlm.projector(h))
        with pytest.raises(PolicyError, match="policy.vision_depth=1: must be >= 2"):
            tiny_policy(vision_depth=1)
    cfg = policy_config(name="openvla_oft", **{**KW, key: value, "checkpoint": str(tmp_path)})
    with pytest.raises(PolicyError, match=f"policy.{key}.*drop policy.{key}"):
        registry.policy_class("openvla_oft").check_config(
            cfg, env_config(name="ManiSkill/PushCube-v1", obs_mode="rgb"))


def test_trainable_names_are_checked():
    with pytest.raises(PolicyError, match=r"policy.trainable: 'projektor' .*projector"):
        tiny_policy(lora_rank=4, trainable=["projektor"])


# -- dtype=auto and the device ------------------------------------------------------------------
def test_auto_dtype_follows_the_device_the_policy_is_built_for_not_the_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    p = make_policy(policy_config(name="openvla_oft", **KW), spec(), device="cpu")
    assert {t.dtype for t in p.parameters()} == {torch.float32}


def test_a_policy_class_without_a_device_argument_is_built_then_moved(monkeypatch):
    class Legacy(torch.nn.Module):  # a plugin written for make_policy(cfg, env_spec)
        def __init__(self, cfg, env_spec):
            super().__init__()
            self.head = torch.nn.Linear(env_spec.obs_shapes["state"][0], env_spec.action_dim)

    monkeypatch.setattr(registry.POLICIES, "require", lambda name: Legacy)
    p = registry.make_policy(PolicyConfig(name="legacy"), spec(), device="meta")
    assert p.head.weight.device.type == "meta"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_auto_is_bfloat16_lora_adapters_fp32_and_log_probs_agree():
    torch.manual_seed(0)
    p = make_policy(policy_config(name="openvla_oft", **{**KW, "lora_rank": 4}), spec(),
                    device="cuda")
    assert p.vlm.projector.fc1.weight.dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 and t.is_cuda
               for n, t in p.named_parameters() if ".lora_" in n)
    o = obs().to("cuda")
    out = p.act(TensorDict({"obs": o}, batch_size=[3]))
    ev = p.evaluate_actions(TensorDict({"obs": o, "action_tokens": out["action_tokens"]},
                                       batch_size=[3]))
    assert torch.equal(ev["token_log_prob"], out["token_log_prob"])
    assert math.isfinite(float(out["log_prob"].sum()))


@pytest.mark.parametrize("name", ["openvla_oft", "openvla"])
def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_gradients(name):
    """On the H100 (bench/gpu.py) a 7B LoRA learner step kept ~23 GiB of activations per 8
    samples; with policy.gradient_checkpointing the LM layers run again in the backward
    pass instead (counted here) and the adapters' gradients are those of the plain backward."""
    kw = {**KW, "lora_rank": 4, "chunk": 1 if name == "openvla" else KW["chunk"]}
    torch.manual_seed(0)
    plain = make_policy(policy_config(name=name, **kw), spec())
    ckpt = make_policy(policy_config(name=name, **{**kw, "gradient_checkpointing": True}),
                       spec())
    ckpt.load_state_dict(plain.state_dict())
    o = obs(4)
    with torch.no_grad():
        tokens = plain.act(TensorDict({"obs": o}, batch_size=[4]))["action_tokens"]
    grads, calls = [], []
    for p in (plain, ckpt):
        p.train()
        n = [0]
        # a pre-hook: torch stops a recompute as soon as the saved tensors are back, which is
        # inside the MLP, before a forward hook would run
        mlp = p.vlm.llm.model.layers[0].mlp
        hook = mlp.register_forward_pre_hook(lambda *a: n.__setitem__(0, n[0] + 1))
        ev = p.evaluate_actions(TensorDict({"obs": o, "action_tokens": tokens}, batch_size=[4]))
        loss = ev["log_prob"].pow(2).mean() + ev["value"].pow(2).mean()
        loss.backward()
        hook.remove()
        calls.append(n[0])
        grads.append({k: v.grad for k, v in p.named_parameters() if ".lora_" in k})
    assert calls == [1, 2]  # the checkpointed layer ran again in the backward pass
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for k, g in grads[0].items():
        torch.testing.assert_close(grads[1][k], g, atol=1e-6, rtol=1e-4)
        # lora_B starts at zero, so only lora_B has a gradient at the first step
        assert (g.abs().sum() > 0) == (".lora_B." in k), k


@pytest.mark.parametrize("name", ["openvla_oft", "openvla"])
def test_state_aux_predicts_the_normalised_state_from_the_value_heads_input_and_needs_the_env(
        name):
    """``state_aux``: coef x the mean squared error of a linear head on the LM's state at the
    last prompt token, against the running-normalised ("obs", "privileged") vector. Worked by
    hand: with the head set to the value head (for every state dim), its prediction is the
    value ``act`` reports, so the loss is coef x mean((value - z)^2) with z normalised here.
    Its gradient alone reaches the vision tower; acting neither reads nor needs the state."""
    from m2flow.envs import env_config

    torch.manual_seed(0)
    priv_spec = EnvSpec({"rgb": (32, 32, 3), "state": (8,), "task": (), "privileged": (11,)}, 7,
                        (-1.0,) * 7, (1.0,) * 7, 10, tasks=TASKS)
    kw = {**KW, "chunk": 1} if name == "openvla" else KW
    p = make_policy(policy_config(name=name, **{**kw, "state_aux": 0.5}), priv_spec)
    o = obs(4)
    o["privileged"] = torch.randn(4, 11) * 3 + 1
    batch = TensorDict({"obs": o}, batch_size=[4])
    p.observe(batch)
    with torch.no_grad():
        p.state_aux.head.weight.copy_(p.value_head.weight.expand(11, -1))
        p.state_aux.head.bias.fill_(p.value_head.bias.item())
    acted = p.act(batch, deterministic=True)
    x = o["privileged"]
    z = ((x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + 1e-8)).clamp(-10, 10)
    by_hand = 0.5 * ((acted["value"][:, None] - z) ** 2).mean(-1)
    batch["action_tokens"] = acted["action_tokens"]
    out = p.evaluate_actions(batch)
    torch.testing.assert_close(out["aux_loss"], by_hand)
    out["aux_loss"].sum().backward()
    assert any(q.grad is not None and q.grad.abs().sum() > 0 for q in p.vlm.backbones.parameters())

    plain = make_policy(policy_config(name=name, **kw), priv_spec)
    plain.load_state_dict({k: v for k, v in p.state_dict().items()
                           if not k.startswith("state_aux.")})
    blind = TensorDict({"obs": obs(4)}, batch_size=[4])  # no "privileged" key at all
    a, b = p.act(blind, deterministic=True), plain.act(blind, deterministic=True)
    assert torch.equal(a["action_tokens"], b["action_tokens"])
    torch.testing.assert_close(a["log_prob"], b["log_prob"])
    assert "aux_loss" not in plain.evaluate_actions(batch).keys()

    with pytest.raises(PolicyError, match="policy.state_aux=-1.0: must be >= 0"):
        make_policy(policy_config(name=name, **{**kw, "state_aux": -1.0}), priv_spec)
    with pytest.raises(PolicyError, match="policy.state_aux=0.5.*env.privileged_state=true"):
        registry.policy_class(name).check_config(
            policy_config(name=name, **{**kw, "state_aux": 0.5}),
            env_config(name="ManiSkill/PushCube-v1", obs_mode="rgb"))


def test_image_positions_add_a_learned_embedding_to_each_image_token():
    """Zero at the start (the policy acts as without it); then each image token's input to
    the LM is its projected patch plus its own row, worked here from the parts."""
    torch.manual_seed(0)
    p = tiny_policy(image_positions=True)
    plain = tiny_policy()
    plain.load_state_dict({k: v for k, v in p.state_dict().items() if k != "image_pos"})
    o = TensorDict({"obs": obs(3)}, batch_size=[3])
    torch.testing.assert_close(p.act(o, deterministic=True)["log_prob"],
                               plain.act(o, deterministic=True)["log_prob"])
    with torch.no_grad():
        p.image_pos.normal_()
    embeds = p._sequence(o["obs"], p.queries[:0].expand(3, -1, -1), bidirectional_tail=False)[0]
    patches = p.vlm.image_tokens(p._images(o["obs"]))
    n = patches.shape[1]
    # row 1 has the longer prompt, so no padding moved before its <s>, then its images
    torch.testing.assert_close(embeds[1, 1:1 + n], patches[1] + p.image_pos)
    assert p.image_pos.requires_grad
    assert not torch.allclose(p.act(o, deterministic=True)["log_prob"],
                              plain.act(o, deterministic=True)["log_prob"])
