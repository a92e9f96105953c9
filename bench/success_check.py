"""Does m2flow count PushCube's success as ManiSkill does? One checkpoint's policy, N episodes
in ManiSkill's OWN env loop (``gymnasium.make`` + ManiSkill's ``CPUGymWrapper`` with
``record_metrics``: its ``success_once`` and ``success_at_end``), beside what ``m2flow-eval``
reports for the same checkpoint and number of episodes.

Only the policy comes from m2flow: the checkpoint's weights, deterministic mean actions, and
the processing m2flow's ManiSkill adapter applies (state obs as a float32 vector, actions
clipped to the action space). Episode k starts where ``m2flow-eval`` starts it: seed
``seeding.derive(seed, EVAL, round, rank, num_envs)[i]`` for slot (round, rank, env i), with
the scene rebuilt (``reconfigure``), as evaluation does. As m2flow's rollout worker does, the
policy acts on the ``num_envs`` envs of one (round, rank) in one batch (the padding slots of
the last round included): a matmul's rounding depends on the batch, and over 50 steps of
physics a last-bit difference can move the cube in or out of the goal at the end. Both
figures come with their binomial standard errors, sqrt(p (1 - p) / N).

    .venv/bin/python bench/success_check.py runs/maniskill_pushcube_ppo_mlp/<time>/checkpoints/last.pt
    .venv/bin/python bench/success_check.py CKPT --episodes 100 [m2flow-eval override ...]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.cli.common import load_eval_config
from m2flow.envs import EnvSpec
from m2flow.policies import make_policy
from m2flow.runs import seeding

TASK = "PushCube-v1"
MANISKILL = dict(obs_mode="state", control_mode="pd_ee_delta_pos",
                 reward_mode="normalized_dense")  # the default job's env (env/maniskill_pushcube)


def eval_rounds(cfg, episodes: int) -> list[list[int]]:
    """Per (round, rank), its envs' reset seeds, as m2flow-eval lays out a one-task env's."""
    n, ranks = cfg.env.num_envs, cfg.cluster.placement.components["env"].workers
    return [seeding.derive(cfg.seed, seeding.EVAL, r, rank, n)
            for r in range(math.ceil(episodes / (n * ranks))) for rank in range(ranks)]


def maniskill_loop(cfg, state: dict, episodes: int) -> tuple[list[bool], list[bool]]:
    import mani_skill.envs  # noqa: F401  (registers the tasks)
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    limit = {"max_episode_steps": cfg.env.max_episode_steps} if cfg.env.max_episode_steps else {}
    envs = [CPUGymWrapper(gym.make(TASK, num_envs=1, sim_backend="physx_cpu",
                                   render_backend="none", **MANISKILL, **limit),
                          ignore_terminations=cfg.env.ignore_terminations, record_metrics=True)
            for _ in range(cfg.env.num_envs)]
    space = envs[0].action_space
    spec = EnvSpec({keys.leaf(keys.STATE): envs[0].observation_space.shape},
                   int(space.shape[0]), tuple(map(float, space.low)),
                   tuple(map(float, space.high)), None)
    policy = make_policy(cfg.policy, spec)
    policy.load_state_dict(state["learner"]["policy"])
    low, high = torch.as_tensor(space.low), torch.as_tensor(space.high)
    once, at_end = [], []
    for seeds in eval_rounds(cfg, episodes):
        obs = [env.reset(seed=s, options={"reconfigure": True})[0] for env, s in zip(envs, seeds)]
        ended: list = [None] * len(envs)  # each env's first episode: (success_once, at_end)
        while not all(ended):
            batch = TensorDict({keys.STATE: torch.as_tensor(np.stack(obs), dtype=torch.float32)},
                               batch_size=[len(envs)])
            with torch.no_grad():
                actions = torch.clamp(policy.act(batch, deterministic=True)[keys.ACTION],
                                      low, high).numpy()  # (n, A)
            for i, env in enumerate(envs):
                if ended[i] is None:
                    obs[i], _, terminated, truncated, info = env.step(actions[i])
                    if terminated or truncated:
                        m = info["episode"]
                        ended[i] = (bool(m["success_once"]), bool(m["success_at_end"]))
        left = episodes - len(once)
        once += [e[0] for e in ended][:left]
        at_end += [e[1] for e in ended][:left]
    for env in envs:
        env.close()
    return once, at_end


def m2flow_eval(checkpoint: str, episodes: int, overrides: list[str]) -> dict:
    """Runs ``m2flow-eval`` (the console script beside this interpreter); its results.json."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [str(Path(sys.executable).parent / "m2flow-eval"), f"checkpoint={checkpoint}",
               f"episodes={episodes}", "videos_per_task=0", f"output_dir={out}",
               "runner.progress_bar=false", *overrides]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        return json.loads((Path(out) / "results.json").read_text())


def figure(p: float, n: int) -> str:
    return f"{p:.3f} +- {math.sqrt(p * (1 - p) / max(1, n)):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("overrides", nargs="*", help="more m2flow-eval overrides")
    args = parser.parse_args()
    cfg, state = load_eval_config([f"checkpoint={args.checkpoint}"])
    if cfg.env.name != f"ManiSkill/{TASK}" or any(
            getattr(cfg.env, k) != v for k, v in MANISKILL.items()):
        sys.exit(f"{args.checkpoint}: not a {TASK} {MANISKILL} checkpoint")
    once, at_end = maniskill_loop(cfg, state, args.episodes)
    report = m2flow_eval(args.checkpoint, args.episodes, args.overrides)
    n, m = len(once), report["episodes"]
    print(f"\n{TASK}, {args.checkpoint}, seed {cfg.seed}, mean actions")
    print(f"{'':24s} {'episodes':>8s} {'success_once':>16s} {'success_at_end':>16s}")
    print(f"{'ManiSkill own loop':24s} {n:8d} {figure(sum(once) / n, n):>16s} "
          f"{figure(sum(at_end) / n, n):>16s}")
    print(f"{'m2flow-eval':24s} {m:8d} {figure(report['mean_success_once'], m):>16s} "
          f"{figure(report['mean_success_at_end'], m):>16s}")


if __name__ == "__main__":
    main()
