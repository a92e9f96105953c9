"""The GPU path at full size: what scripts/gpu_check.sh measures on a CUDA machine.

    python bench/gpu.py vla --kind openvla|oft [--batches 8 32 64] [--train-batches 8 32]
        A full-size OpenVLA-shaped policy (DINOv2 ViT-L/14 + SigLIP So400m/14 at 224 px, fused;
        a Llama-2-7B-shaped LM: width 4096, 32 layers, 32 heads, MLP 11008), random weights,
        bf16 on the GPU, LoRA rank 32 on the LM (fp32 adapters): ``act`` latency per batch size
        (median of 5 after a warm-up) and peak memory; then one learner step per batch size
        (``evaluate_actions``, a PPO-shaped loss, backward, AdamW on the trainable parameters):
        time and peak memory (``--gradient-checkpointing``: with the LM's layers recomputed). ``oft``: OpenVLA-OFT's parallel decoding of an 8-action chunk with
        a proprio token; ``openvla``: one action per call, 7 tokens decoded one by one.
        The LM's vocabulary is the tiny BPE's (768), not Llama-2's 32,064: the embedding and
        output rows it lacks are 0.26 B parameters (0.5 GB in bf16).
    python bench/gpu.py pi0 [--variant pi0|pi05] [--batches 64] [--train-batches 8 32]
        A full-size π0 / π0.5 (openpi's published layout: SigLIP So400m/14 at 224 px, a Gemma
        2B prefix, a Gemma 300M action expert; ``policy.size=full``), random weights, bf16 on
        the GPU, LoRA rank 32 (fp32 adapters, projections and value head): ``act`` (prefix once,
        then the chunk denoised in ``--denoise-steps`` Euler steps, Flow-SDE) latency and peak
        memory per batch size; then one PPO-shaped learner step per batch size
        (``evaluate_actions`` on the stored chains, backward, AdamW). The tokenizer is a
        synthetic word-level one with PaliGemma's vocabulary size (257,152), written to a
        temporary folder: the machine has no network and the model's embedding rows are all
        there whatever the ids mean.
    python bench/gpu.py render [--num-envs 16] [--steps 60] [--image-size 128]
        ManiSkill PushCube-v1 rgb through m2flow's make_env: one simulator process per env,
        CPU physics, SAPIEN rendering on the GPU (render_backend=gpu): env steps/s.
    python bench/gpu.py qwen --out DIR
        Writes a Qwen2.5-0.5B-shaped causal LM (random weights, bf16, vocabulary 151,936) with
        the reasoning preset's character tokenizer to DIR, for model.path=DIR.
    python bench/gpu.py physx
        Whether SAPIEN's GPU PhysX (ManiSkill's physx_cuda backend) starts here.

Each subcommand prints its numbers and appends one JSON line to ``--results`` (if given).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

LLAMA2_7B = {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "intermediate_size": 11008}
OPENVLA_VISION = ["timm/vit_large_patch14_reg4_dinov2.lvd142m",
                  "timm/vit_so400m_patch14_siglip_224"]
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128,
        "vision": ["timm/vit_tiny_patch16_224"], "image_size": 32}  # --tiny: a CPU smoke run


def _emit(args, record: dict) -> None:
    print(json.dumps(record))
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")


def _gib(n: float) -> float:
    return round(n / 2**30, 2)


def _cpu_counters() -> None:
    """--tiny on a CPU: the CUDA memory counters and synchronisation answer 0 / nothing."""
    torch.cuda.reset_peak_memory_stats = torch.cuda.synchronize = lambda *a: None
    torch.cuda.memory_allocated = torch.cuda.max_memory_allocated = lambda *a: 0


def _act_and_learn(policy, batch, act_batches, train_batches, stored: list, dev: str,
                   rec: dict) -> None:
    """Into ``rec``: ``act`` latency (median of 5 after a warm-up) and peak memory per batch
    size of ``act_batches``; then per batch size of ``train_batches`` one PPO-shaped learner
    step timed (median of 2 after a warm-up): ``evaluate_actions`` on the act outputs named
    ``stored`` (what the rollout keeps for the learner), the ratio times random advantages,
    the value loss, backward, AdamW on the trainable parameters. ``batch(b)``: observations."""
    from tensordict import TensorDict

    chunk = getattr(policy, "chunk", 1)
    policy.eval()
    for b in act_batches:
        obs = batch(b)
        try:
            torch.cuda.reset_peak_memory_stats()
            times = []
            with torch.no_grad():
                for i in range(6):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    policy.act(TensorDict({"obs": obs}, batch_size=[b]))
                    torch.cuda.synchronize()
                    if i:
                        times.append(time.perf_counter() - t)
            ms = 1e3 * statistics.median(times)
            rec["act"][b] = {"ms": round(ms, 1), "env_steps_per_s": round(b * chunk / ms * 1e3, 1),
                             "peak_gib": _gib(torch.cuda.max_memory_allocated())}
        except torch.OutOfMemoryError:
            rec["act"][b] = "out of memory"
        print(f"act batch {b}: {rec['act'][b]}", flush=True)

    policy.train()
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-5)
    for b in train_batches:
        obs = batch(b)
        try:
            with torch.no_grad():
                out = policy.act(TensorDict({"obs": obs}, batch_size=[b]))
            data = TensorDict({"obs": obs, **{k: out[k] for k in stored}}, batch_size=[b])
            adv = torch.randn(b, device=dev)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = []
            for i in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                ev = policy.evaluate_actions(data)
                ratio = torch.exp(ev["log_prob"] - out["log_prob"].detach())
                loss = -(ratio * adv).mean()
                if "value" in ev.keys():
                    loss = loss + 0.5 * (ev["value"] - adv).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                if i:
                    times.append(time.perf_counter() - t)
            rec["learn"][b] = {"s": round(statistics.median(times), 3),
                               "peak_gib": _gib(torch.cuda.max_memory_allocated()),
                               "finite": bool(torch.isfinite(loss).item())}
        except torch.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            rec["learn"][b] = "out of memory"
        print(f"learner step batch {b}: {rec['learn'][b]}", flush=True)


def vla(args) -> None:
    from tensordict import TensorDict

    from m2flow.envs.base import EnvSpec
    from m2flow.policies import make_policy, policy_config

    oft = args.kind == "oft"
    dev = "cpu" if args.tiny else "cuda"
    if args.tiny:
        _cpu_counters()
    size = TINY if args.tiny else {**LLAMA2_7B, "vision": OPENVLA_VISION, "image_size": 224}
    settings = {**size, "image_keys": ["rgb"],
              "chunk": 8 if oft else 1, "lora_rank": 32, "dtype": "float32" if args.tiny else "bfloat16",
              "use_proprio": oft, "trainable": ["proprio", "value_head"],
              "gradient_checkpointing": args.gradient_checkpointing}
    spec = EnvSpec({"rgb": (224, 224, 3), "state": (8,), "task": ()}, 7, (-1.0,) * 7,
                   (1.0,) * 7, 200, tasks=("pick up the red cube and place it on the plate",))
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    torch.manual_seed(0)
    policy = make_policy(policy_config("openvla_oft" if oft else "openvla", **settings),
                         spec, device=dev)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t
    n_params = sum(p.numel() for p in policy.parameters())
    n_train = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    weights = torch.cuda.memory_allocated()
    rec = {"bench": f"vla_{args.kind}" + ("_ckpt" if args.gradient_checkpointing else ""),
           "params_b": round(n_params / 1e9, 2),
           "trainable_m": round(n_train / 1e6, 1), "build_s": round(build_s, 1),
           "weights_gib": _gib(weights), "act": {}, "learn": {}}

    def batch(b: int) -> TensorDict:
        g = torch.Generator().manual_seed(b)
        return TensorDict({
            "rgb": torch.randint(0, 256, (b, 224, 224, 3), dtype=torch.uint8, generator=g),
            "state": torch.randn(b, 8, generator=g) * 0.3,
            "task": torch.zeros(b, dtype=torch.long)}, batch_size=[b]).to(dev)

    _act_and_learn(policy, batch, args.batches, args.train_batches, ["action_tokens"], dev, rec)
    masters = {p.dtype for p in policy.parameters() if p.requires_grad}
    rec["trainable_dtypes"] = sorted(str(d) for d in masters)
    _emit(args, rec)


def _synthetic_tokenizer(folder: str, vocab: int) -> str:
    """A word-level tokenizer of ``vocab`` ids ('<pad>', '<eos>', '<bos>', '<unk>', then
    't4', 't5', ...), saved to ``folder`` for ``AutoTokenizer.from_pretrained``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<eos>", "<bos>", "<unk>"]
    words = {w: i for i, w in enumerate(special)}
    words.update({f"t{i}": i for i in range(len(special), vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                            bos_token="<bos>", unk_token="<unk>").save_pretrained(folder)
    return folder


def pi0(args) -> None:
    import tempfile

    from tensordict import TensorDict

    from m2flow.envs.base import EnvSpec
    from m2flow.policies import make_policy, policy_config
    from m2flow.policies.vla import pi0_model as pm

    dev = "cpu" if args.tiny else "cuda"
    if args.tiny:
        _cpu_counters()
    settings = {"variant": args.variant, "image_keys": ["rgb"], "chunk": args.chunk,
                "denoise_steps": args.denoise_steps, "noise_method": "flow_sde",
                "lora_rank": 32, "dtype": "float32" if args.tiny else "bfloat16"}
    if not args.tiny:
        folder = tempfile.mkdtemp(prefix="paligemma_tok_")
        settings.update(size="full", tokenizer=_synthetic_tokenizer(folder, pm.PALIGEMMA_VOCAB))
    img = 64 if args.tiny else 224
    spec = EnvSpec({"rgb": (img, img, 3), "state": (9,)}, 7, (-1.0,) * 7, (1.0,) * 7, 200,
                   tasks=("push the cube to the goal",))
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    torch.manual_seed(0)
    policy = make_policy(policy_config("pi0", **settings), spec, device=dev)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t
    n_params = sum(p.numel() for p in policy.parameters())
    n_train = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    rec = {"bench": f"pi0_{args.variant}", "params_b": round(n_params / 1e9, 2),
           "trainable_m": round(n_train / 1e6, 1), "build_s": round(build_s, 1),
           "weights_gib": _gib(torch.cuda.memory_allocated()), "chunk": args.chunk,
           "denoise_steps": args.denoise_steps, "act": {}, "learn": {}}

    def batch(b: int) -> TensorDict:
        g = torch.Generator().manual_seed(b)
        return TensorDict({
            "rgb": torch.randint(0, 256, (b, img, img, 3), dtype=torch.uint8, generator=g),
            "state": torch.randn(b, 9, generator=g) * 0.3}, batch_size=[b]).to(dev)

    _act_and_learn(policy, batch, args.batches, args.train_batches,
                   ["flow_chain", "flow_step"], dev, rec)
    rec["trainable_dtypes"] = sorted(str(d) for d in
                                     {p.dtype for p in policy.parameters() if p.requires_grad})
    _emit(args, rec)


def render(args) -> None:
    from m2flow.envs import env_config, make_env

    cfg = env_config(name="ManiSkill/PushCube-v1", num_envs=args.num_envs, obs_mode="rgb",
                     image_size=args.image_size, render_backend=args.render_backend,
                     sim_backend="cpu")
    t = time.perf_counter()
    env = make_env(cfg)
    try:
        obs = env.reset(seed=list(range(args.num_envs)))["obs"]
        start_s = time.perf_counter() - t
        n, a = args.num_envs, env.spec.action_dim
        for _ in range(5):
            env.step(torch.rand(n, a) * 2 - 1)
        t = time.perf_counter()
        for _ in range(args.steps):
            out = env.step(torch.rand(n, a) * 2 - 1)
        dt = time.perf_counter() - t
        img = out["next", "obs", "rgb"].float()
        rec = {"bench": f"render_{args.render_backend}", "num_envs": n, "image_size": args.image_size,
               "env_steps_per_s": round(n * args.steps / dt, 1), "start_s": round(start_s, 1),
               "image_mean": round(img.mean().item(), 1), "image_std": round(img.std().item(), 1),
               "obs_keys": sorted(obs.keys())}
    finally:
        env.close()
    _emit(args, rec)


def qwen(args) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from m2flow.reasoning.model import tiny_tokenizer

    tok = tiny_tokenizer()
    # Qwen2.5-0.5B's shape (its config.json), the vocabulary included
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                      num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    _emit(args, {"bench": "qwen_written", "params_b": round(n / 1e9, 3), "path": args.out})


def physx(args) -> None:
    import sapien

    try:
        sapien.physx.enable_gpu()
        ok, why = True, ""
    except Exception as e:  # SAPIEN fetches libPhysXGpu_64.so from GitHub at first use
        ok, why = False, f"{type(e).__name__}: {str(e)[:200]}"
    _emit(args, {"bench": "physx_gpu", "enabled": ok, "error": why,
                 "physx_version": sapien.physx.version()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", help="append one JSON line here")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("vla")
    s.add_argument("--kind", choices=["openvla", "oft"], default="oft")
    s.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    s.add_argument("--train-batches", type=int, nargs="+", default=[8, 32])
    s.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (a smoke run)")
    s.add_argument("--gradient-checkpointing", action="store_true",
                   help="policy.gradient_checkpointing: recompute LM layers in backward")
    s = sub.add_parser("pi0")
    s.add_argument("--variant", choices=["pi0", "pi05"], default="pi0")
    s.add_argument("--chunk", type=int, default=5, help="actions per call (RLinf's ManiSkill π0: 5)")
    s.add_argument("--denoise-steps", type=int, default=4, help="Euler steps (RLinf's: 4)")
    s.add_argument("--batches", type=int, nargs="+", default=[64])
    s.add_argument("--train-batches", type=int, nargs="+", default=[8, 32])
    s.add_argument("--tiny", action="store_true", help="the tiny preset on the CPU (a smoke run)")
    s = sub.add_parser("render")
    s.add_argument("--num-envs", type=int, default=16)
    s.add_argument("--steps", type=int, default=60)
    s.add_argument("--image-size", type=int, default=128)
    s.add_argument("--render-backend", default="gpu", help="cpu: lavapipe (a CPU smoke run)")
    s = sub.add_parser("qwen")
    s.add_argument("--out", required=True)
    sub.add_parser("physx")
    args = p.parse_args()
    {"vla": vla, "pi0": pi0, "render": render, "qwen": qwen, "physx": physx}[args.cmd](args)


if __name__ == "__main__":
    main()
