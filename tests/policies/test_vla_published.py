"""OpenVLA checkpoints as published (openvla/openvla-7b), not as m2flow's own writer makes them.

The key list below is a transcription of openvla-7b's ``model.safetensors.index.json``: the
module trees of OpenVLA's ``modeling_prismatic.py`` (timm 0.9 ViTs made with ``num_classes=0``,
DINOv2's LayerScale ``gamma`` renamed ``scale_factor`` by ``ls_apply_patch``; SigLIP keeps its
attention pool) with Llama-2-7B under ``language_model``. Its sizes at full scale reproduce the
index's ``metadata.total_size`` to the byte; shrunk, it is written here with safetensors itself
and loaded by m2flow, whose outputs are compared with timm's and transformers' own models.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tensordict import TensorDict

from m2flow.envs.base import EnvSpec
from m2flow.policies import PolicyError, make_policy, policy_config
from m2flow.policies.vla import checkpoint
from m2flow.policies.vla.text import tiny_tokenizer

DINO, SIGLIP = "vision_backbone.featurizer.", "vision_backbone.fused_featurizer."
LM = "language_model."
TOTAL_SIZE = 15082474368  # openvla-7b's index, metadata.total_size: bytes of bf16 tensors
DINO_ID, SIGLIP_ID = "vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"
# OpenVLA's preprocessor_config.json: per backbone pixel means and stds
MEANS = ((0.485, 0.456, 0.406), (0.5, 0.5, 0.5))
STDS = ((0.229, 0.224, 0.225), (0.5, 0.5, 0.5))


def published_layout(D, Dm, Dd, S, Sm, Sd, H, F, L, V, img, P=14, reg=4):
    """name -> shape of every tensor of openvla-7b's index. D, Dm, Dd: DINOv2's width, MLP width,
    blocks; S, Sm, Sd: SigLIP's; H, F, L, V: Llama's hidden, MLP, layers, padded vocabulary."""
    g = (img // P) ** 2  # patches per image
    out = {DINO + "cls_token": (1, 1, D), DINO + "reg_token": (1, reg, D),
           DINO + "pos_embed": (1, g, D),  # DINOv2 with registers: no pos_embed for prefixes
           DINO + "patch_embed.proj.weight": (D, 3, P, P), DINO + "patch_embed.proj.bias": (D,),
           DINO + "norm.weight": (D,), DINO + "norm.bias": (D,)}
    for i in range(Dd):
        b = f"{DINO}blocks.{i}."
        out |= {b + "norm1.weight": (D,), b + "norm1.bias": (D,),
                b + "attn.qkv.weight": (3 * D, D), b + "attn.qkv.bias": (3 * D,),
                b + "attn.proj.weight": (D, D), b + "attn.proj.bias": (D,),
                b + "ls1.scale_factor": (D,),
                b + "norm2.weight": (D,), b + "norm2.bias": (D,),
                b + "mlp.fc1.weight": (Dm, D), b + "mlp.fc1.bias": (Dm,),
                b + "mlp.fc2.weight": (D, Dm), b + "mlp.fc2.bias": (D,),
                b + "ls2.scale_factor": (D,)}
    out |= {SIGLIP + "pos_embed": (1, g, S),  # no class token
            SIGLIP + "patch_embed.proj.weight": (S, 3, P, P),
            SIGLIP + "patch_embed.proj.bias": (S,),
            SIGLIP + "norm.weight": (S,), SIGLIP + "norm.bias": (S,),
            SIGLIP + "attn_pool.latent": (1, 1, S),
            SIGLIP + "attn_pool.q.weight": (S, S), SIGLIP + "attn_pool.q.bias": (S,),
            SIGLIP + "attn_pool.kv.weight": (2 * S, S), SIGLIP + "attn_pool.kv.bias": (2 * S,),
            SIGLIP + "attn_pool.proj.weight": (S, S), SIGLIP + "attn_pool.proj.bias": (S,),
            SIGLIP + "attn_pool.norm.weight": (S,), SIGLIP + "attn_pool.norm.bias": (S,),
            SIGLIP + "attn_pool.mlp.fc1.weight": (Sm, S), SIGLIP + "attn_pool.mlp.fc1.bias": (Sm,),
            SIGLIP + "attn_pool.mlp.fc2.weight": (S, Sm), SIGLIP + "attn_pool.mlp.fc2.bias": (S,)}
    for i in range(Sd):
        b = f"{SIGLIP}blocks.{i}."
        out |= {b + "norm1.weight": (S,), b + "norm1.bias": (S,),
                b + "attn.qkv.weight": (3 * S, S), b + "attn.qkv.bias": (3 * S,),
                b + "attn.proj.weight": (S, S), b + "attn.proj.bias": (S,),
                b + "norm2.weight": (S,), b + "norm2.bias": (S,),
                b + "mlp.fc1.weight": (Sm, S), b + "mlp.fc1.bias": (Sm,),
                b + "mlp.fc2.weight": (S, Sm), b + "mlp.fc2.bias": (S,)}
    v = D + S  # fused projector: (D + S) -> 4 (D + S) -> H -> H
    out |= {"projector.fc1.weight": (4 * v, v), "projector.fc1.bias": (4 * v,),
            "projector.fc2.weight": (H, 4 * v), "projector.fc2.bias": (H,),
            "projector.fc3.weight": (H, H), "projector.fc3.bias": (H,)}
    out |= {LM + "model.embed_tokens.weight": (V, H), LM + "model.norm.weight": (H,),
            LM + "lm_head.weight": (V, H)}
    for i in range(L):
        b = f"{LM}model.layers.{i}."
        out |= {b + f"self_attn.{p}_proj.weight": (H, H) for p in "qkvo"}
        out |= {b + "mlp.gate_proj.weight": (F, H), b + "mlp.up_proj.weight": (F, H),
                b + "mlp.down_proj.weight": (H, F),
                b + "input_layernorm.weight": (H,), b + "post_attention_layernorm.weight": (H,)}
    return out


FULL = dict(D=1024, Dm=4096, Dd=24, S=1152, Sm=4304, Sd=27, H=4096, F=11008, L=32, V=32064, img=224)
# openvla-7b's config.json (norm_stats cut to two of its Open-X datasets)
PUBLISHED_CONFIG = {
    "arch_specifier": "no-align+fused-gelu-mlp",
    "architectures": ["OpenVLAForActionPrediction"],
    "hf_llm_id": "meta-llama/Llama-2-7b-hf",
    "image_resize_strategy": "resize-naive",
    "image_sizes": [224, 224],
    "llm_backbone_id": "llama2-7b-pure",
    "llm_max_length": 2048,
    "model_type": "openvla",
    "n_action_bins": 256,
    "norm_stats": {
        "bridge_orig": {"action": {"mask": [True] * 6 + [False], "q01": [-0.03] * 6 + [0.0],
                                   "q99": [0.03] * 6 + [1.0]}},
        "fractal20220817_data": {"action": {"mask": [True] * 6 + [False],
                                            "q01": [-0.2] * 6 + [0.0], "q99": [0.2] * 6 + [1.0]}},
    },
    "output_projector_states": False,
    "pad_to_multiple_of": 64,
    "pad_token_id": 32000,
    "text_config": {"model_type": "llama", "pad_token_id": 32000, "torch_dtype": "bfloat16",
                    "vocab_size": 32064},
    "timm_model_ids": [DINO_ID, SIGLIP_ID],
    "timm_override_act_layers": [None, None],
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_fused_vision_backbone": True,
    "vision_backbone_id": "dinosiglip-vit-so-224px",
}
TOK = tiny_tokenizer(512)
TINY = dict(D=32, Dm=128, Dd=3, S=48, Sm=96, Sd=3, H=64, F=128, L=2, V=len(TOK) + 64, img=42)
TINY_TIMM = [{"embed_dim": 32, "depth": 3, "num_heads": 2, "mlp_ratio": 4.0},
             {"embed_dim": 48, "depth": 3, "num_heads": 2, "mlp_ratio": 2.0}]
TINY_TEXT = {"model_type": "llama", "vocab_size": TINY["V"], "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 4, "bos_token_id": TOK.bos_token_id,
             "eos_token_id": TOK.eos_token_id, "pad_token_id": TOK.pad_token_id,
             "torch_dtype": "bfloat16"}


def random_tensor(name, shape, g):
    """Values that make every tensor matter: LayerScale and norms far from their inits."""
    if name.endswith("scale_factor"):
        return 0.3 + 0.7 * torch.rand(shape, generator=g)
    if "norm" in name and name.endswith("weight"):
        return 1 + 0.2 * torch.randn(shape, generator=g)
    fan_in = math.prod(shape[1:]) if len(shape) > 1 and "token" not in name else 4
    return torch.randn(shape, generator=g) / math.sqrt(fan_in)


def write_published(path, seed=0, dtype=torch.bfloat16, shards=3):
    """A shrunk openvla-7b in its own naming, written with safetensors (not m2flow's writer)."""
    g = torch.Generator().manual_seed(seed)
    layout = published_layout(**TINY)
    state = {k: random_tensor(k, s, g).to(dtype) for k, s in layout.items()}
    names, weight_map = list(state), {}
    per = -(-len(names) // shards)
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i * per : (i + 1) * per]
        save_file({k: state[k] for k in part}, str(path / fname), metadata={"format": "pt"})
        weight_map |= {k: fname for k in part}
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
         "weight_map": weight_map}))
    config = {**PUBLISHED_CONFIG, "image_sizes": [TINY["img"]] * 2, "text_config": TINY_TEXT,
              "pad_token_id": TOK.pad_token_id, "m2flow_timm_kwargs": TINY_TIMM}
    (path / "config.json").write_text(json.dumps(config))
    (path / "dataset_statistics.json").write_text(json.dumps(PUBLISHED_CONFIG["norm_stats"]))
    TOK.save_pretrained(str(path))
    return {k: v.float() for k, v in state.items()}


class Reference:
    """OpenVLA's forward from timm's and transformers' own models and the published tensors."""

    def __init__(self, state):
        import timm
        from transformers import LlamaConfig, LlamaForCausalLM

        self.vits = []
        for prefix, model, kw in ((DINO, DINO_ID, TINY_TIMM[0]), (SIGLIP, SIGLIP_ID, TINY_TIMM[1])):
            vit = timm.create_model(model, pretrained=False, num_classes=0,
                                    img_size=TINY["img"], **kw)
            vit.load_state_dict({k[len(prefix):].replace("scale_factor", "gamma"): v
                                 for k, v in state.items() if k.startswith(prefix)})
            self.vits.append(vit.eval())
        self.proj = {k: v for k, v in state.items() if k.startswith("projector.")}
        text = {k: v for k, v in TINY_TEXT.items() if k not in ("model_type", "torch_dtype")}
        self.llm = LlamaForCausalLM(LlamaConfig(**text)).eval()
        self.llm.load_state_dict({k[len(LM):]: v for k, v in state.items() if k.startswith(LM)})

    @staticmethod
    def second_to_last_block(vit, x):
        """timm 0.9's ``get_intermediate_layers(x, n={depth - 2})``, as OpenVLA calls it."""
        x = vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(x))))
        for blk in vit.blocks[:-1]:
            x = blk(x)
        return x[:, vit.num_prefix_tokens:]

    @torch.no_grad()
    def patches(self, images):
        """uint8 (B, H, W, 3) at the backbones' size -> projected patches (B, P, H)."""
        x = images.permute(0, 3, 1, 2).float() / 255
        feats = [self.second_to_last_block(vit, (x - torch.tensor(m).view(1, 3, 1, 1))
                                           / torch.tensor(s).view(1, 3, 1, 1))
                 for vit, m, s in zip(self.vits, MEANS, STDS)]
        h = torch.cat(feats, dim=-1)
        p = self.proj
        h = F.gelu(F.linear(h, p["projector.fc1.weight"], p["projector.fc1.bias"]))
        h = F.gelu(F.linear(h, p["projector.fc2.weight"], p["projector.fc2.bias"]))
        return F.linear(h, p["projector.fc3.weight"], p["projector.fc3.bias"])

    @torch.no_grad()
    def logits(self, images, ids):
        """Llama's logits (B, L, V) for <s>, the image patches, then token ``ids`` (B, T)."""
        emb = self.llm.get_input_embeddings()
        bos = emb(torch.full((ids.shape[0], 1), TOK.bos_token_id))
        return self.llm(inputs_embeds=torch.cat([bos, self.patches(images), emb(ids)], 1)).logits


def images(b=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, TINY["img"], TINY["img"], 3), dtype=torch.uint8, generator=g)


def test_the_published_config_builds_openvla_7b_with_every_published_tensor(tmp_path):
    layout = published_layout(**FULL)
    assert sum(math.prod(s) * 2 for s in layout.values()) == TOTAL_SIZE  # the transcription
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_CONFIG))
    vlm = checkpoint.build(checkpoint.read_config(str(tmp_path)))  # on meta: no memory
    assert checkpoint.expected_weights(vlm) == layout
    assert vlm.num_patches == 256 and vlm.llm.config.rms_norm_eps == 1e-6  # Llama defaults


def test_a_shrunk_published_checkpoint_loads_and_computes_what_timm_and_llama_do(tmp_path):
    state = write_published(tmp_path)
    ref = Reference(state)
    vlm, config = checkpoint.load(str(tmp_path))
    assert config["use_fused_vision_backbone"] and config["n_action_bins"] == 256
    img = images()
    patches = vlm.image_tokens(img[:, None])
    assert torch.allclose(patches, ref.patches(img), atol=1e-5, rtol=1e-4)
    ids = torch.tensor([TOK("In: What action should the robot take to pick up the bowl?\nOut:",
                            add_special_tokens=False)["input_ids"]] * 2)
    want = ref.logits(img, ids)  # (B, L, V)
    embeds = torch.cat([vlm.embed_tokens(torch.full((2, 1), TOK.bos_token_id)), patches,
                        vlm.embed_tokens(ids)], dim=1)
    L = embeds.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool).tril().expand(2, L, L)
    with torch.no_grad():
        hidden = vlm.hidden_states(embeds, causal, torch.arange(L).expand(2, L))
        got = vlm.action_logits(hidden, TOK.vocab_size - 256, 256)
    assert torch.allclose(got, want[..., TOK.vocab_size - 256 : TOK.vocab_size], atol=1e-4)


def test_the_openvla_policy_on_a_published_checkpoint_decodes_llamas_greedy_tokens(tmp_path):
    ref = Reference(write_published(tmp_path))
    kwargs = {"checkpoint": str(tmp_path), "unnorm_key": "bridge_orig", "use_proprio": False,
              "image_keys": ["rgb"], "value_head": False}
    env = EnvSpec({"rgb": (TINY["img"], TINY["img"], 3), "task": ()}, 7, (-1.0,) * 7, (1.0,) * 7,
                  10, tasks=("pick up the bowl",))
    p = make_policy(policy_config(name="openvla", **kwargs), env)
    o = TensorDict({"rgb": images(), "task": torch.zeros(2, dtype=torch.long)}, batch_size=[2])
    out = p.act(TensorDict({"obs": o}, batch_size=[2]), deterministic=True)
    seen = p._images(o)[:, 0]  # after OpenVLA's evaluation preprocessing (tested on its own)
    prompt = TOK("In: What action should the robot take to pick up the bowl?\nOut:",
                 add_special_tokens=False)["input_ids"]
    first = TOK.vocab_size - 256
    for b in range(2):  # greedy decoding, one teacher-forced Llama pass per env
        ids = torch.tensor([prompt + (out["action_tokens"][b] + first).tolist()])
        logits = ref.logits(seen[b : b + 1], ids)[0, -8:-1, first : first + 256]
        assert logits.argmax(-1).tolist() == out["action_tokens"][b].tolist()
    # bridge_orig's statistics un-normalise: +-0.03 on the arm, the gripper untouched
    assert out["action"][..., :6].abs().max() <= 0.03 + 1e-6


def test_meta_build_and_assign_give_the_eagerly_built_model_and_its_buffers(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    from m2flow.policies.vla.prismatic import Prismatic

    state = write_published(tmp_path)
    vlm, _ = checkpoint.load(str(tmp_path))
    text = {k: v for k, v in TINY_TEXT.items() if k not in ("model_type", "torch_dtype")}
    eager = Prismatic([f"timm/{DINO_ID}", f"timm/{SIGLIP_ID}"], TINY["img"],
                      LlamaForCausalLM(LlamaConfig(**text)), vision_kwargs=TINY_TIMM)
    prefixes = {DINO: "backbones.0.", SIGLIP: "backbones.1.", LM: "llm.",
                "projector.": "projector."}

    def ours(name):
        prefix = next(p for p in prefixes if name.startswith(p))
        return prefixes[prefix] + name[len(prefix):].replace("scale_factor", "gamma")

    eager.load_state_dict({ours(k): v for k, v in state.items()})  # the old way: copy into fp32
    a = dict([*eager.named_parameters(), *eager.named_buffers()])
    b = dict([*vlm.named_parameters(), *vlm.named_buffers()])
    assert a.keys() == b.keys() and {"llm.model.rotary_emb.inv_freq", "mean0", "std1"} <= a.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
        assert b[k].dtype == a[k].dtype and not b[k].is_meta


def test_loading_in_bfloat16_allocates_no_float32_model(tmp_path):
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig
    from m2flow.policies.vla.prismatic import Prismatic

    text = {k: v for k, v in TINY_TEXT.items() if k not in ("model_type", "torch_dtype")}
    vision = ["timm/vit_tiny_patch16_224"]
    checkpoint.save(Prismatic(vision, 32, LlamaConfig(**text)).to(torch.bfloat16), str(tmp_path),
                    vision)  # bf16 on disk, as openvla-7b

    class Fp32Tensors(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if (isinstance(t, torch.Tensor) and t.dtype == torch.float32
                        and not t.is_meta and t.numel() >= 1024):
                    self.seen.append((str(func), tuple(t.shape)))
            return out

    with Fp32Tensors() as mode:
        vlm, _ = checkpoint.load(str(tmp_path), dtype=torch.bfloat16)
    assert mode.seen == []
    assert {p.dtype for p in vlm.parameters()} == {torch.bfloat16}
    assert vlm.llm.model.rotary_emb.inv_freq.dtype == torch.float32  # as transformers keeps it


def test_unnorm_key_must_be_in_the_checkpoints_statistics(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_CONFIG))
    checkpoint.check_unnorm_key(str(tmp_path), "bridge_orig")
    checkpoint.check_unnorm_key(str(tmp_path), None)  # no un-normalisation asked
    with pytest.raises(PolicyError) as e:
        checkpoint.check_unnorm_key(str(tmp_path), "libero_spatial_no_noops")
    assert str(e.value) == (
        "policy.unnorm_key='libero_spatial_no_noops' is not in the checkpoint's "
        f"statistics at {tmp_path}; it has ['bridge_orig', 'fractal20220817_data'].")
    # a fine-tune's key may live in dataset_statistics.json only
    libero = {"libero_spatial_no_noops": {"action": {"q01": [0.0] * 7, "q99": [1.0] * 7}}}
    (tmp_path / "dataset_statistics.json").write_text(json.dumps(libero))
    checkpoint.check_unnorm_key(str(tmp_path), "libero_spatial_no_noops")


@pytest.mark.parametrize("field, value, match", [
    ("arch_specifier", "no-align+gelu-mlp", "arch_specifier"),
    ("n_action_bins", 128, "n_action_bins=128"),
    ("timm_model_ids", [DINO_ID], "needs 2 entries"),
])
def test_published_config_fields_that_cannot_work_are_named(tmp_path, field, value, match):
    (tmp_path / "config.json").write_text(json.dumps({**PUBLISHED_CONFIG, field: value}))
    with pytest.raises(PolicyError, match=match):
        checkpoint.read_config(str(tmp_path))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_loads_straight_onto_the_gpu_in_bfloat16(tmp_path):
    write_published(tmp_path)
    cpu, _ = checkpoint.load(str(tmp_path))
    gpu, _ = checkpoint.load(str(tmp_path), dtype=torch.bfloat16, device="cuda")
    assert {t.device.type for t in [*gpu.parameters(), *gpu.buffers()]} == {"cuda"}
    assert {p.dtype for p in gpu.parameters()} == {torch.bfloat16}
    img = images()
    a = cpu.image_tokens(img[:, None])
    b = gpu.image_tokens(img[:, None].cuda()).float().cpu()
    assert torch.allclose(a, b, atol=0.1 * a.abs().max().item())


@pytest.mark.parametrize("timm_kwargs, match", [
    (None, r"missing \['vision_backbone.featurizer.blocks.10"),  # published sizes: ViT-L, So400m
    ([{**TINY_TIMM[0], "embed_dim": 16}, TINY_TIMM[1]],
     r"cls_token \(1, 1, 32\) \(config.json gives \(1, 1, 16\)\)"),
])
def test_weights_the_config_does_not_describe_are_named_before_any_is_read(tmp_path, timm_kwargs,
                                                                          match):
    write_published(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["m2flow_timm_kwargs"] = timm_kwargs
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PolicyError, match=match) as e:
        checkpoint.load(str(tmp_path))
    assert "config.json does not describe these weights" in str(e.value)
