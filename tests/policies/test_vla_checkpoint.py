"""m2flow's own writer and loader round trip (``checkpoint.save`` then ``load``) and the errors
for directories that are not checkpoints; the published naming itself: test_vla_published.py."""

import json

import pytest
import torch
from safetensors import safe_open
from tensordict import TensorDict

from m2flow.policies import PolicyError, make_policy, policy_config
from m2flow.policies.vla import checkpoint
from tests.policies.test_vla import KW, obs, spec

STATS = {"libero_spatial_no_noops": {"action": {
    "q01": [-0.5] * 6 + [0.0], "q99": [0.5] * 6 + [1.0], "mask": [True] * 6 + [False]}}}


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    # OpenVLA has no proprio input: with it off, every parameter comes from the checkpoint
    kwargs = {k: v for k, v in {**KW, "use_proprio": False, **kw}.items() if k != "chunk"}
    return make_policy(policy_config(name="openvla", **kwargs), spec())


def test_published_layout_loads_and_the_logits_equal_the_originals(tmp_path):
    original = tiny(vision=["timm/vit_tiny_patch16_224", "timm/vit_tiny_patch16_224"])  # fused
    checkpoint.save(original.vlm, str(tmp_path), original.opts.vision, original.tokenizer,
                    norm_stats=STATS)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert "vision_backbone.featurizer.blocks.0.attn.qkv.weight" in names
    assert "vision_backbone.fused_featurizer.patch_embed.proj.weight" in names
    assert {"projector.fc1.weight", "projector.fc3.weight"} <= names
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in names
    assert "language_model.lm_head.weight" in names
    shard = tmp_path / sorted(set(index["weight_map"].values()))[0]
    with safe_open(str(shard), "pt") as f:
        assert set(f.keys()) <= names
    assert json.loads((tmp_path / "config.json").read_text())["use_fused_vision_backbone"]

    loaded = tiny(seed=1, checkpoint=str(tmp_path), unnorm_key="libero_spatial_no_noops")
    o = obs(b=2)
    tokens = torch.randint(0, 256, (2, 7))
    a = original._forward(o, tokens)[0]
    b = loaded._forward(o, tokens)[0]
    assert torch.equal(a, b)  # fp32, the same modules: identical
    # the checkpoint's dataset statistics un-normalise the actions
    out = loaded.act(TensorDict({"obs": o}, batch_size=[2]), deterministic=True)
    assert out["action"][..., :6].abs().max() <= 0.5 and (out["action"][..., 6] >= -1).all()


def test_a_missing_or_foreign_directory_is_named(tmp_path):
    with pytest.raises(PolicyError, match="no config.json"):
        tiny(checkpoint=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(PolicyError, match="OpenVLA checkpoint"):
        tiny(checkpoint=str(tmp_path))


def test_parameters_that_do_not_match_are_reported(tmp_path):
    original = tiny()
    checkpoint.save(original.vlm, str(tmp_path), original.opts.vision, original.tokenizer,
                    shards=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] += 1  # the checkpoint lacks a layer's weights
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PolicyError, match="missing"):
        tiny(checkpoint=str(tmp_path))
