"""``policy=pi0``: openpi's attention rules against hand-written masks, adaRMS by hand, the
π0 / π0.5 switch, PPO's ratio at the rollout's weights, and the full-size layout against the
names and shapes of openpi's published checkpoints (``data/pi0_names.txt``,
``data/pi05_names.txt``: derived from openpi's own ``PI0Pytorch`` by
``data/derive_pi0_names.py``, whose docstring gives the commit and the command)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tensordict import TensorDict

from m2flow.envs import EnvSpec
from m2flow.policies import PolicyError, make_policy, policy_config
from m2flow.policies.vla import pi0_model as pm
from m2flow.policies.vla.pi0 import Prefix
from m2flow.policies.vla.pi0_checkpoint import published_layout

DATA = Path(__file__).parent / "data"
SPEC = EnvSpec({"rgb": (64, 64, 3), "state": (9,)}, 4, (-1.0,) * 4, (1.0,) * 4, 50)


def tiny(variant="pi0", **kw):
    torch.manual_seed(0)
    return make_policy(policy_config(name="pi0", variant=variant, **kw), SPEC)


def obs_batch(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"obs": {
        "rgb": torch.randint(0, 256, (n, 64, 64, 3), dtype=torch.uint8, generator=g),
        "state": torch.randn(n, 9, generator=g)}}, batch_size=[n])


def read_layout(name):
    out = {}
    for line in (DATA / name).read_text().splitlines():
        if not line.startswith("#"):
            key, shape = line.split()
            out[key] = tuple(int(d) for d in shape.split(","))
    return out


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_the_joint_mask_follows_openpis_rules_on_a_hand_written_example(variant):
    """Prefix: 2 tokens and 1 of padding; suffix: π0's state token then 2 actions (π0.5: the 2
    actions). Rows are queries, columns keys."""
    pi = tiny(variant, chunk=2)
    wp = pi.prefix_width
    ctx = Prefix(torch.randn(1, 3, wp), torch.tensor([[True, True, False]]),
                 torch.zeros(1, 32))
    _, allowed, positions, _ = pi._suffix(ctx, torch.randn(1, 2, 4), torch.tensor([0.5]))
    if variant == "pi0":
        expected = [[1, 1, 0, 0, 0, 0],  # the prefix: bidirectional, blind to the suffix
                    [1, 1, 0, 0, 0, 0],
                    [0, 0, 0, 0, 0, 0],  # padding attends nothing and nobody attends it
                    [1, 1, 0, 1, 0, 0],  # the state: the prefix and itself
                    [1, 1, 0, 1, 1, 1],  # the actions: everything before and each other
                    [1, 1, 0, 1, 1, 1]]
        assert positions.tolist() == [[0, 1, 1, 2, 3, 4]]  # padding takes no position
    else:
        expected = [[1, 1, 0, 0, 0],
                    [1, 1, 0, 0, 0],
                    [0, 0, 0, 0, 0],
                    [1, 1, 0, 1, 1],
                    [1, 1, 0, 1, 1]]
    assert allowed[0].int().tolist() == expected


def test_reused_prefix_keys_give_the_joint_passs_velocity():
    """Rollout and learner run the prefix once and each denoising step on its cached keys and
    values; BC runs prefix and suffix as one sequence. Both are the same function."""
    for variant in ("pi0", "pi05"):
        pi = tiny(variant)
        for p in pi.parameters():  # adaRMS starts at zero weights: make the time matter
            p.data.add_(0.02 * torch.randn_like(p))
        prefix = pi._prefix(obs_batch(3)["obs"])
        x, t = torch.randn(3, 4, 4), torch.tensor([1.0, 0.5, 0.25])
        v_joint, _ = pi._velocity(prefix, x, t)
        v_cached, _ = pi._velocity(pi._run_prefix(prefix), x, t)
        assert v_joint.abs().mean() > 1e-3
        torch.testing.assert_close(v_cached, v_joint, rtol=1e-4, atol=1e-5)


def test_adarms_against_a_hand_computation():
    norm = pm.AdaRMSNorm(2, 1, eps=0.0)
    with torch.no_grad():
        norm.dense.weight.copy_(torch.tensor([[1.0], [2.0], [0.5], [0.0], [3.0], [-1.0]]))
        norm.dense.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0]))
    x, cond = torch.tensor([[[3.0, 4.0]]]), torch.tensor([[2.0]])
    y, gate = norm(x, cond)
    # rms = √((9 + 16) / 2) = √12.5; scale = (2, 4), shift = (1, 1), gate = (6, -2)
    rms = 12.5 ** 0.5
    want = [3 / rms * 3 + 1, 4 / rms * 5 + 1]
    assert y[0, 0].tolist() == pytest.approx(want, rel=1e-6)
    assert gate[0, 0].tolist() == [6.0, -2.0]
    assert pm._gated(torch.ones(2), torch.tensor([1.0, 2.0]), gate[0, 0]).tolist() == [7.0, -3.0]


def test_the_variant_switches_the_time_conditioning():
    """π0: time enters the action tokens (action-time MLP), the expert's norms are plain;
    π0.5: the tokens ignore time, which reaches the expert as adaRMS conditioning."""
    x, t1, t2 = torch.randn(2, 4, 32), torch.tensor([0.9, 0.9]), torch.tensor([0.1, 0.1])
    state = torch.randn(2, 32)
    pi0, pi05 = tiny("pi0").model, tiny("pi05").model
    tok1, ar1, c1 = pi0.embed_suffix(state, x, t1)
    tok2, _, _ = pi0.embed_suffix(state, x, t2)
    assert c1 is None and tok1.shape[1] == 5 and ar1.tolist() == [1, 1, 0, 0, 0]
    assert not torch.allclose(tok1[:, 1:], tok2[:, 1:]) and torch.equal(tok1[:, 0], tok2[:, 0])
    tok1, ar1, c1 = pi05.embed_suffix(None, x, t1)
    tok2, _, c2 = pi05.embed_suffix(None, x, t2)
    assert tok1.shape[1] == 4 and ar1.tolist() == [1, 0, 0, 0] and torch.equal(tok1, tok2)
    assert not torch.allclose(c1, c2)
    expert0 = pi0.paligemma_with_expert.gemma_expert.model
    expert5 = pi05.paligemma_with_expert.gemma_expert.model
    assert not isinstance(expert0.layers[0].input_layernorm, pm.AdaRMSNorm)
    assert all(isinstance(m, pm.AdaRMSNorm) for m in
               (expert5.norm, *[l.input_layernorm for l in expert5.layers]))
    assert hasattr(pi0, "state_proj") and not hasattr(pi05, "state_proj")


@pytest.mark.parametrize("variant, method", [("pi0", "flow_noise"), ("pi05", "flow_sde")])
def test_ppo_ratio_is_exactly_one_at_the_rollouts_weights(variant, method):
    """The learner's log-probs of the stored chain equal the rollout's bit for bit on the
    rollout's batch (ratio 1, no clipping), within 1e-5 on a minibatch of it (CPU kernels
    round differently at another batch size); the policy loss reaches the expert, the
    prefix Gemma and the vision tower."""
    from m2flow.embodied.algorithms.ppo import ppo_loss
    from m2flow.runs.rl import level_log_probs

    from tests.embodied.test_keys import unknown

    pi = tiny(variant, noise_method=method)
    b = obs_batch(4)
    with torch.no_grad():
        out = pi.act(b)
    assert unknown(out) == set() and out["flow_chain"].shape == (4, 5, 4, 4)
    b.update(out)
    b["advantage"], b["return"] = torch.randn(4), torch.randn(4)
    terms = ppo_loss(pi, b, clip_coef=0.2, vf_coef=0.5, ent_coef=0.0)
    assert float(terms["approx_kl"]) == 0.0 and float(terms["clip_fraction"]) == 0.0
    new, old = level_log_probs(pi.evaluate_actions(b), b, "action", 4)
    assert torch.equal(new.detach(), old) and old.abs().min() > 0
    mb = b[torch.tensor([3, 0, 2])]
    torch.testing.assert_close(pi.evaluate_actions(mb)["log_prob"], mb["log_prob"],
                               rtol=0, atol=1e-5)
    terms["loss_policy"].backward()
    pwe = pi.model.paligemma_with_expert
    for w in (pwe.gemma_expert.model.layers[0].self_attn.q_proj.weight,
              pwe.language_model.layers[0].mlp.up_proj.weight,
              pwe.paligemma.model.vision_tower.vision_model.embeddings.patch_embedding.weight):
        assert w.grad is not None and w.grad.abs().sum() > 0


@pytest.mark.parametrize("variant, listed", [("pi0", "pi0_names.txt"),
                                             ("pi05", "pi05_names.txt")])
def test_the_full_size_model_on_meta_has_openpis_published_names_and_shapes(variant, listed):
    """What m2flow builds for ``size=full`` (never materialised) against the list derived from
    openpi's own model: every tensor its converted ``model.safetensors`` holds."""
    cfg = policy_config(name="pi0", variant=variant, size="full", tokenizer="unused")
    with torch.device("meta"):
        model = pm.build(cfg, pm.PALIGEMMA_VOCAB)
    layout, tied = published_layout(model)
    assert layout == read_layout(listed)
    assert tied == {"paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight":
                    "paligemma_with_expert.paligemma.lm_head.weight"}
    assert {p.device.type for p in model.parameters()} == {"meta"}


# the published sizes -> the tiny preset's (one function: each published size names one
# dimension; the preset keeps heads x head_dim = prefix width and 2 x expert = prefix width)
SHRINK = {2048: 128, 16384: 256, 256: 64, 1024: 64, 4096: 128, 3072: 192, 1152: 64,
          4304: 128, 14: 8, 32: 32, 3: 3}
DEPTH = 2


def shrunk_published_file(path, listed, vocab):
    """A safetensors file with every name of ``listed`` whose layer index is below DEPTH, its
    shape shrunk by SHRINK, random values: the published layout at the tiny preset's sizes."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in read_layout(listed).items():
        parts = name.split(".")
        if "layers" in parts and int(parts[parts.index("layers") + 1]) >= DEPTH:
            continue
        small = tuple(vocab if d == pm.PALIGEMMA_VOCAB else SHRINK[d] for d in shape)
        tensors[name] = torch.randn(small, generator=g) * 0.02
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def test_a_checkpoint_in_openpis_layout_loads_by_name(tmp_path):
    from m2flow.policies.vla.text import tiny_tokenizer

    tensors = shrunk_published_file(tmp_path, "pi05_names.txt", len(tiny_tokenizer(512)))
    pi = make_policy(policy_config(name="pi0", variant="pi05", checkpoint=str(tmp_path)), SPEC)
    state = pi.model.state_dict()
    for name in ("paligemma_with_expert.gemma_expert.model.layers.1.input_layernorm.dense.weight",
                 "paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder."
                 "layers.0.self_attn.q_proj.weight", "time_mlp_in.weight"):
        assert torch.equal(state[name], tensors[name])
    embed = pi.model.paligemma_with_expert.language_model.embed_tokens.weight
    assert torch.equal(embed, tensors["paligemma_with_expert.paligemma.lm_head.weight"])
    out = pi.act(obs_batch(2))
    assert out["action"].shape == (2, 4, 4) and torch.isfinite(out["log_prob"]).all()

    del tensors["time_mlp_out.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(PolicyError, match=r"missing \['time_mlp_out.bias'\]"):
        make_policy(policy_config(name="pi0", variant="pi05", checkpoint=str(tmp_path)), SPEC)
    with pytest.raises(PolicyError, match="policy.variant"):  # π0's layout expected
        make_policy(policy_config(name="pi0", variant="pi0", checkpoint=str(tmp_path)), SPEC)


def test_lora_trains_adapters_projections_and_heads_the_rest_frozen_in_bf16():
    pi = tiny("pi0", lora_rank=4, dtype="bfloat16")
    train = {n for n, p in pi.named_parameters() if p.requires_grad}
    inner = {n for n in train if n.startswith("model.paligemma_with_expert.")}
    assert inner and all("lora_" in n for n in inner)
    assert {"model.action_in_proj.weight", "model.state_proj.weight",
            "value_head.0.weight"} <= train
    dtypes = {n: p.dtype for n, p in pi.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if n in train)
    frozen = [d for n, d in dtypes.items() if n not in train]
    assert frozen and all(d == torch.bfloat16 for d in frozen)
    b = obs_batch(2)
    with torch.no_grad():
        b.update(pi.act(b))
    pi.evaluate_actions(b)["log_prob"].sum().backward()
    lora = [p for n, p in pi.named_parameters() if "lora_B" in n]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)


def test_pi0_settings_are_checked():
    with pytest.raises(PolicyError, match="policy.variant='pi1'"):
        make_policy(policy_config(name="pi0", variant="pi1"), SPEC)
    with pytest.raises(PolicyError, match="policy.size=full needs policy.tokenizer"):
        make_policy(policy_config(name="pi0", size="full"), SPEC)
    with pytest.raises(PolicyError, match="policy.action_dim=4"):
        make_policy(policy_config(name="pi0", action_dim=4), SPEC)
    with pytest.raises(PolicyError, match="policy.checkpoint='/nonexistent'"):
        make_policy(policy_config(name="pi0", checkpoint="/nonexistent"), SPEC)


def test_state_aux_reads_the_prefix_and_matches_a_hand_computation():
    """``policy.state_aux``: BC's loss pair comes from one joint pass; its auxiliary term is
    coef x the mean squared error of the linear head on the prefix alone's valid tokens
    averaged by hand (the padding's left out), against the privileged vector normalised by
    the statistics of the one batch observed; PPO's ``evaluate_actions`` carries the same term."""
    spec = EnvSpec({"rgb": (64, 64, 3), "state": (9,), "privileged": (5,)}, 4,
                   (-1.0,) * 4, (1.0,) * 4, 50, tasks=("push the cube", "push it"))
    torch.manual_seed(0)
    pi = make_policy(policy_config(name="pi0", state_aux=2.5, chunk=4), spec)
    b = obs_batch(3)
    b["obs", "task"] = torch.tensor([0, 1, 1])  # prompts of two lengths: padding
    b["obs", "privileged"] = torch.randn(3, 5, generator=torch.Generator().manual_seed(4)) * 3
    b["action"] = torch.rand(3, 4, 4) * 2 - 1
    pi.observe(b)
    fm, aux = pi.bc_losses(b)
    assert fm.shape == aux.shape == (3,)

    p = pi._prefix(b["obs"])
    allowed = pm.attention_mask(p.valid, torch.zeros(p.valid.shape[1], dtype=torch.long))
    positions = (p.valid.long().cumsum(-1) - 1).clamp_min(0)
    (hidden, _), _ = pi.pwe(p.embeds, None, allowed, positions)
    assert not p.valid.all()  # the prompt's padding is there to be left out
    pooled = torch.stack([hidden[i][p.valid[i]].mean(0) for i in range(3)])
    x = b["obs", "privileged"]  # the running statistics of this one batch, by hand
    target = (x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + 1e-8)
    expected = 2.5 * ((pooled @ pi.state_aux.head.weight.T + pi.state_aux.head.bias
                       - target) ** 2).mean(-1)
    torch.testing.assert_close(aux, expected, rtol=1e-4, atol=1e-5)

    b.update(pi.act(b))
    torch.testing.assert_close(pi.evaluate_actions(b)["aux_loss"], expected, rtol=1e-4,
                               atol=1e-5)
    no_aux = make_policy(policy_config(name="pi0", chunk=4), spec)
    assert no_aux.bc_losses(b)[1] is None and "aux_loss" not in no_aux.evaluate_actions(b).keys()


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_proprio_hidden_dims_do_not_reach_the_velocity(variant):
    """``policy.proprio_hidden=[[2, 5]]``: changing state dims 2-4 leaves the velocity bit for
    bit as it was (π0: the state token; π0.5: the state text), changing dim 6 does not."""
    pi = tiny(variant, proprio_hidden=[[2, 5]])
    for p in pi.parameters():
        p.data.add_(0.02 * torch.randn_like(p))
    obs = obs_batch(2)["obs"]
    x, t = torch.randn(2, 4, 4), torch.tensor([0.7, 0.3])

    def velocity(state):
        o = obs.clone()
        o["state"] = state
        return pi._velocity(pi._prefix(o), x, t)[0]

    base = velocity(obs["state"])
    hidden, seen = obs["state"].clone(), obs["state"].clone()
    hidden[:, 2:5] += 3.0
    seen[:, 6] += 3.0
    assert torch.equal(velocity(hidden), base)
    assert not torch.allclose(velocity(seen), base)
    with pytest.raises(PolicyError, match=r"policy\.proprio_hidden=\[\[2, 30\]\]"):
        tiny(variant, proprio_hidden=[[2, 30]])


def test_hold_obs_norm_keeps_bcs_proprio_statistics_and_so_its_velocity():
    """``policy.hold_obs_norm``: a π0 loaded from a checkpoint and then shown PPO's states of
    another mean and scale keeps the checkpoint's proprio statistics, so its velocity on the
    same inputs is the checkpoint's own, bit for bit; without it the statistics move and the
    velocity with them."""
    trained = tiny(normalize_obs=True)
    first = obs_batch(64)
    first["obs", "state"] = first["obs", "state"] * 3 + 2
    trained.observe(first)
    loaded = {k: v.clone() for k, v in trained.state_dict().items() if k.startswith("obs_norm")}
    torch.testing.assert_close(loaded["obs_norm.mean"], first["obs", "state"].mean(0))
    later = obs_batch(32, seed=2)
    later["obs", "state"] = later["obs", "state"] * 0.5 - 4
    probe, x, t = obs_batch(2, seed=3)["obs"], torch.randn(2, 4, 4), torch.tensor([0.7, 0.3])
    with torch.no_grad():
        reference = trained._velocity(trained._prefix(probe), x, t)[0]
    for hold in (True, False):
        pi = tiny(normalize_obs=True, hold_obs_norm=hold)
        pi.load_state_dict(trained.state_dict())
        pi.observe(later)
        now = {k: v for k, v in pi.state_dict().items() if k.startswith("obs_norm")}
        moved = [not torch.equal(now[k], loaded[k]) for k in loaded]
        assert not any(moved) if hold else all(moved), (hold, moved)
        with torch.no_grad():
            v = pi._velocity(pi._prefix(probe), x, t)[0]
        assert torch.equal(v, reference) if hold else not torch.allclose(v, reference)
