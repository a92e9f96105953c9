"""How much faster do ManiSkill rgb envs step on a CPU with lighter visual meshes?

``env.visual_mesh_fraction`` keeps that fraction of each untextured visual mesh's triangles
(m2flow/envs/meshes.py). This bench builds the same env batch at each fraction, alive at
once, times them in interleaved rounds of random-action steps (this machine's speed drifts
from minute to minute), and reports env steps/s, the speed-up against the published meshes
(1.0), the triangles drawn, and how far the images move (mean absolute difference of the
first observation over the same seeds, in levels of 255). With ``--frame PNG`` it also
writes one camera frame per fraction side by side (128 px, 2x enlarged).

    python bench/render_detail.py [--task ManiSkill/PushCube-v1] [--num-envs 8]
        [--image-size 64] [--fractions 1.0 0.1 0.05 0.02] [--steps 50] [--rounds 3]
        [--frame docs/render_detail.png]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import record
import torch

from m2flow.envs import env_config, make_env
from m2flow.envs.maniskill import ManiSkillEnvConfig


def env_cfg(args, fraction: float) -> ManiSkillEnvConfig:
    return env_config(name=args.task, num_envs=args.num_envs, obs_mode="rgb",
                      image_size=args.image_size, control_mode="pd_ee_delta_pos",
                      visual_mesh_fraction=fraction)


def triangles(task: str, fraction: float) -> int:
    """Visual triangles of the scene's bodies, as the camera draws them."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401
    import sapien

    from m2flow.envs import meshes

    env = gym.make(task.split("/", 1)[1], num_envs=1, sim_backend="physx_cpu",
                   obs_mode="rgb", render_backend="cpu")
    if fraction < 1:
        meshes.install(env, fraction)
    total = 0
    for entity in env.unwrapped.scene.sub_scenes[0].entities:
        for c in entity.components:
            if isinstance(c, sapien.render.RenderBodyComponent):
                total += sum(p.get_triangles().shape[0] for s in c.render_shapes
                             if hasattr(s, "parts") for p in s.parts)
    env.close()
    return total


def frame(args, fractions) -> None:
    from PIL import Image

    images = []
    for f in fractions:
        env = make_env(env_config(name=args.task, num_envs=1, obs_mode="rgb", image_size=128,
                                  control_mode="pd_ee_delta_pos", visual_mesh_fraction=f))
        images.append(env.reset(seed=[0])["obs", "rgb"][0].numpy())
        env.close()
    row = np.concatenate(images, axis=1)
    big = (row.shape[1] * 2, row.shape[0] * 2)
    Image.fromarray(row).resize(big, Image.NEAREST).save(args.frame)
    print(f"frames ({', '.join(map(str, fractions))}, left to right) -> {args.frame}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="ManiSkill/PushCube-v1")
    p.add_argument("--num-envs", type=int, default=8)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.1, 0.05, 0.02])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--frame", default=None, help="write one 128 px frame per fraction here")
    args = p.parse_args()
    seeds = list(range(args.num_envs))
    envs = {f: make_env(env_cfg(args, f)) for f in args.fractions}
    first = {f: env.reset(seed=seeds)["obs", "rgb"].to(torch.int16) for f, env in envs.items()}
    rates: dict[float, list[float]] = {f: [] for f in envs}
    gen = torch.Generator().manual_seed(0)
    try:
        for rnd in range(args.rounds + 1):
            k = 5 if rnd == 0 else args.steps
            actions = [torch.rand(args.num_envs, 4, generator=gen) * 2 - 1 for _ in range(k)]
            for f, env in envs.items():
                t = time.perf_counter()
                for a in actions:
                    env.step(a)
                if rnd > 0:
                    rates[f].append(k * args.num_envs / (time.perf_counter() - t))
    finally:
        for env in envs.values():
            env.close()
    base = statistics.median(rates[args.fractions[0]])
    print(f"\n{args.task}, {args.num_envs} envs, rgb {args.image_size} px, {args.rounds} "
          f"interleaved rounds of {args.steps} random-action steps, {os.cpu_count()} CPUs")
    print(f"{'fraction':>9}{'triangles':>11}{'env steps/s':>13}{'(min-max)':>14}"
          f"{'speed-up':>10}{'image diff':>12}")
    rows = []
    for f in args.fractions:
        med = statistics.median(rates[f])
        diff = (first[f] - first[args.fractions[0]]).abs().float().mean().item()
        print(f"{f:>9.3g}{triangles(args.task, f):>11,}{med:>13.0f}"
              f"{f'({min(rates[f]):.0f}-{max(rates[f]):.0f})':>14}{med / base:>10.2f}"
              f"{diff:>12.2f}")
        rows.append((f"{args.task} rgb{args.image_size}", args.num_envs,
                     f"visual_mesh_fraction={f:g}", med))
    record.append("render_detail", rows)
    if args.frame:
        frame(args, args.fractions)


if __name__ == "__main__":
    main()
