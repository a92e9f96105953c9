"""PPO in m2flow beside cleanRL's PPO on the same ManiSkill3 task through the CPU backend, with
the same env count and env steps: env steps and wall time until the training episodes reach a
success rate.

m2flow runs its default job, ``m2flow-train --config-name maniskill_pushcube_ppo_mlp``
(PushCube-v1 from state, 16 envs, 50 steps per env per iteration), with no evaluation before
the end and no early stop. The peer is cleanRL's ``cleanrl/ppo_continuous_action.py``,
unmodified, from a checkout (``--cleanrl``; written against commit fe8d8a0), over ManiSkill's
CPU gym env of the same task, control and reward modes and 50-step episodes
(``bench/cleanrl_maniskill.py``), in the peer environment (``bench/peer_common.py``).

Its flags: ``--num-envs`` the config's env count, and every PPO hyper-parameter cleanRL has a
flag for set to the config's value (:func:`cleanrl_flags` passes those that differ from
cleanRL's defaults): ``--num-steps 50`` (``runner.rollout_steps``: 800 samples per update;
cleanRL's 2048 at 16 envs would be 32,768, and 9 updates in the default job's 320,000 env
steps), ``--gamma 0.8 --gae-lambda 0.9`` (cleanRL's 0.99 and 0.95 suit MuJoCo's 1000-step
episodes; m2flow's are for 50-step ones), ``--update-epochs 8 --num-minibatches 4`` (200
samples per minibatch), ``--no-clip-vloss --target-kl 0.1``; learning rate 3e-4 annealed to
0, clip 0.2, vf 0.5, no entropy bonus and grad-norm 0.5 are both's defaults. So both run the same algorithm with the same numbers, and the rows compare the
implementations. ``--cleanrl-args`` appends flags of your own (the last of a flag wins).

What still differs, and can matter for fairness:

- the network: cleanRL's actor and critic are 64x64 tanh MLPs with a log-std starting at 0
  (std 1); m2flow's are 256x256x256 tanh with a log-std starting at -0.5 (std 0.61);
- observations: cleanRL normalises them with ``NormalizeObservation`` inside each env, so each
  of the 16 envs keeps its own running mean and variance, updated at every step, and clips to
  +-10; m2flow's policy normalises by one running mean and std of all envs, updated by the
  learner once per batch;
- rewards: cleanRL divides each env's reward by a running std of its discounted return
  (``NormalizeReward``, with ``--gamma``) and clips to +-10; m2flow trains on the
  ``normalized_dense`` reward as it comes (in [0, 1]);
- the time limit: cleanRL treats the truncation at 50 steps as a terminal (its GAE does not
  bootstrap), m2flow bootstraps from the final observation's value: at a reward of 1 per step
  (the cube held on the goal) cleanRL's last step's return target lacks 0.8 / (1 - 0.8) = 4,
  and the step k before it 0.8^k of that;
- the env loop: cleanRL's ``SyncVectorEnv`` steps its 16 envs one after another in its own
  process, then runs the policy on their 16 observations; m2flow runs each CPU env in its own SAPIEN process beside
  a rollout and a learner worker. That is part of what the wall time compares;
- resets: both start every env's episode at an iteration's first step (50-step rollouts of
  50-step episodes); m2flow reseeds each iteration's resets, cleanRL seeds its first reset only.

Both are judged alike (``peer_common.first_reach``): the first env step at which the last
``--window`` finished training episodes (sampled actions) succeeded (``success_once``) at
``--target`` or more, and the wall time from the command's launch to then (start-up included).
The runs are sequential; the table comes out as bench/README.md rows.

    python bench/ppo_peer.py --cleanrl /path/to/cleanrl                 # the default job's length
    python bench/ppo_peer.py --cleanrl /path/to/cleanrl --steps 1600    # a smoke run
"""

from __future__ import annotations

import argparse
import shlex

from peer_common import add_arguments, compare, env_config, run_cleanrl, run_m2flow

SCRIPT = "cleanrl/ppo_continuous_action.py"
# cleanRL's flag -> (m2flow's PPOConfig field, cleanRL's default at fe8d8a0)
CLEANRL_PPO = {
    "learning-rate": ("learning_rate", 3e-4),
    "anneal-lr": ("anneal_lr", True),
    "gamma": ("gamma", 0.99),
    "gae-lambda": ("gae_lambda", 0.95),
    "num-minibatches": ("num_minibatches", 32),
    "update-epochs": ("update_epochs", 10),
    "norm-adv": ("norm_adv", True),
    "clip-coef": ("clip_coef", 0.2),
    "clip-vloss": ("clip_vloss", True),
    "ent-coef": ("ent_coef", 0.0),
    "vf-coef": ("vf_coef", 0.5),
    "max-grad-norm": ("max_grad_norm", 0.5),
    "target-kl": ("target_kl", None),
}


def cleanrl_flags(algorithm, *, num_envs: int, num_steps: int) -> list[str]:
    """cleanRL PPO flags that give it m2flow's env count, rollout length and hyper-parameters
    (``algorithm``: a PPOConfig): only those that differ from cleanRL's defaults. Raises
    SystemExit for a setting cleanRL has no flag for.

    >>> from m2flow.embodied.algorithms.ppo import PPOConfig
    >>> cfg = PPOConfig(update_epochs=8, anneal_lr=True)
    >>> print(*cleanrl_flags(cfg, num_envs=16, num_steps=50))  # doctest: +NORMALIZE_WHITESPACE
    --num-envs 16 --num-steps 50 --gamma 0.8 --gae-lambda 0.9 --num-minibatches 4
    --update-epochs 8 --no-clip-vloss --target-kl 0.1
    """
    unmatched = {"lr_schedule": "fixed", "critic_learning_rate": None, "critic_warmup": 0,
                 "demo_coef": 0.0, "logprob_level": "chunk"}
    for field, value in unmatched.items():
        if getattr(algorithm, field) != value:
            raise SystemExit(f"algorithm.{field}={getattr(algorithm, field)!r}: cleanRL's PPO "
                             f"has no such setting; run the peer with {field}={value!r}.")
    if algorithm.max_grad_norm is None:
        raise SystemExit("algorithm.max_grad_norm=null: cleanRL's PPO always clips; set a norm.")
    flags = ["--num-envs", str(num_envs), "--num-steps", str(num_steps)]
    for flag, (field, default) in CLEANRL_PPO.items():
        value = getattr(algorithm, field)
        if value == default:
            continue
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p, config="maniskill_pushcube_ppo_mlp", steps=320_000)
    p.add_argument("--cleanrl-args", default="", help="more cleanRL flags, e.g. '--gamma 0.99'")
    args = p.parse_args()

    from m2flow.cli.common import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    env_cfg = env_config(args)
    cli = ["--env-id", f"m2flow-peer/{env_cfg['task']}", "--total-timesteps", str(args.steps),
           "--seed", str(args.seed), "--no-cuda",
           *cleanrl_flags(cfg.algorithm, num_envs=cfg.env.num_envs,
                          num_steps=cfg.runner.rollout_steps),
           *shlex.split(args.cleanrl_args)]
    compare(args, {
        "m2flow": lambda work: run_m2flow(args, work, label="m2flow PPO ({num_envs} envs)"),
        "cleanrl": lambda work: run_cleanrl(
            args, SCRIPT, cli, env_cfg, work,
            label=f"cleanRL ppo_continuous_action.py ({cfg.env.num_envs} envs)"),
    }, prefix="ppo_peer_")


if __name__ == "__main__":
    main()
