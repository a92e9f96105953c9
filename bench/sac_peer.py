"""SAC in m2flow beside cleanRL's SAC on the same ManiSkill3 task through the CPU backend, for
the same env steps: env steps and wall time until the training episodes reach a success rate.

ManiSkill's own SAC baseline (``examples/baselines/sac/sac.py``) makes its envs with
``sim_backend="gpu"`` and cannot run here, so the peer is cleanRL's
``cleanrl/sac_continuous_action.py``, unmodified, from a checkout (``--cleanrl``; measured at
commit fe8d8a0), over ManiSkill's CPU gym env (``bench/cleanrl_maniskill.py``): one env, one
update of 256 transitions per env step, twin 256x2 critics, gamma 0.99, its other defaults.
It runs in a peer environment with the gymnasium cleanRL pins (0.29.1), made on first use
(``--peer-venv``: a venv that sees m2flow's site-packages behind its own gymnasium).

m2flow runs ``m2flow-train --config-name CONFIG`` (16 envs, overlapped learner), with no
evaluation before the end and no early stop, so both spend their time on the same thing.
Both are judged on their training episodes (the behaviour policy, sampled actions): the first
env step at which the last ``--window`` finished episodes succeeded (``success_once``) at
``--target`` or more, and the wall time from the command's launch to then (start-up
included). The runs are sequential; the table comes out as bench/README.md rows. The pieces
both peer benches share are in ``bench/peer_common.py``.

    python bench/sac_peer.py --cleanrl /path/to/cleanrl --steps 50000
"""

from __future__ import annotations

import argparse

from peer_common import add_arguments, compare, env_config, run_cleanrl, run_m2flow

SCRIPT = "cleanrl/sac_continuous_action.py"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p, config="maniskill_pushcube_sac_mlp", steps=50_000)
    args = p.parse_args()
    env_cfg = env_config(args)
    cli = ["--env-id", f"m2flow-peer/{env_cfg['task']}", "--total-timesteps", str(args.steps),
           "--seed", str(args.seed), "--no-cuda"]
    compare(args, {
        "m2flow": lambda work: run_m2flow(args, work,
                                          label="m2flow SAC ({num_envs} envs, overlapped learner)"),
        "cleanrl": lambda work: run_cleanrl(args, SCRIPT, cli, env_cfg, work,
                                            label="cleanRL sac_continuous_action.py (1 env)"),
    }, prefix="sac_peer_")


if __name__ == "__main__":
    main()
