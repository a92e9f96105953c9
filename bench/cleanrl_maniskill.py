"""Runs a cleanRL script (``sac_continuous_action.py``, ``ppo_continuous_action.py``),
unmodified, on a ManiSkill3 task through its CPU backend, and records every training episode's
outcome (``bench/sac_peer.py`` and ``bench/ppo_peer.py`` start it).

    python bench/cleanrl_maniskill.py CLEANRL_DIR SCRIPT EPISODES_JSONL -- <cleanRL's arguments>

SCRIPT is the script's path in CLEANRL_DIR (``cleanrl/ppo_continuous_action.py``). cleanRL
makes each of its envs with ``gym.make(args.env_id)``. This file registers
``m2flow-peer/<task>`` (e.g. ``m2flow-peer/PushCube-v1``): the ManiSkill task with one env on
the CPU backend (``sim_backend="physx_cpu"``), state observations, the control and reward modes
given in ``M2FLOW_PEER_ENV`` (JSON, m2flow's env config fields ``control_mode``,
``reward_mode`` and ``max_episode_steps``, null or absent: the task's own), run to its time
limit (``ignore_terminations``, as m2flow's ``maniskill_pushcube`` env does), behind
ManiSkill's own ``CPUGymWrapper`` (numpy, unbatched).
A wrapper outside it (inside cleanRL's own wrappers, so it sees the raw reward) appends one
JSON line per finished episode to EPISODES_JSONL: env steps so far of all the process's envs
(a vector env of N makes N of them), seconds since ``M2FLOW_PEER_T0`` (the launch, as the
bench timed it), success at any step, success at the end and the return. Then cleanRL's script
runs as ``__main__`` with CLEANRL_DIR on ``sys.path`` (its ``cleanrl_utils``).

cleanRL pins gymnasium 0.29.1 (its vector env hands back ``final_observation``), so this runs
in the bench's peer environment (``peer_common.peer_python``), not in m2flow's.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

import gymnasium as gym


class EpisodeLog(gym.Wrapper):
    """Appends one line per finished episode to ``path`` (its own sums: cleanRL's
    ``RecordEpisodeStatistics`` refuses an ``info["episode"]`` that is already there).
    ``steps`` counts the steps of every EpisodeLog in the process: a SyncVectorEnv steps its
    envs one after another, so an episode's line says how many env steps the run had taken
    (to within the vector's size), as m2flow's ``env/episodes`` step does."""

    steps = 0  # env steps of all envs in this process

    def __init__(self, env, path: Path, t0: float):
        super().__init__(env)
        self.out, self.t0 = open(path, "a"), t0
        self.success_once, self.ret = False, 0.0

    def reset(self, **kwargs):
        self.success_once, self.ret = False, 0.0
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        EpisodeLog.steps += 1
        self.ret += float(reward)
        self.success_once |= bool(info["success"])
        if terminated or truncated:
            self.out.write(json.dumps({
                "steps": EpisodeLog.steps, "seconds": time.time() - self.t0,
                "success_once": self.success_once, "success_at_end": bool(info["success"]),
                "return": self.ret}) + "\n")
            self.out.flush()
        return obs, reward, terminated, truncated, info


def register(task: str, episodes: Path, t0: float, env_cfg: dict) -> str:
    import mani_skill.envs  # noqa: F401  (registers the tasks)
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    def make(**_):
        limit = {"max_episode_steps": n} if (n := env_cfg.get("max_episode_steps")) else {}
        env = gym.make(task, num_envs=1, obs_mode="state", sim_backend="physx_cpu",
                       control_mode=env_cfg["control_mode"], reward_mode=env_cfg["reward_mode"],
                       **limit)
        return EpisodeLog(CPUGymWrapper(env, ignore_terminations=True), episodes, t0)

    name = f"m2flow-peer/{task}"
    gym.register(name, entry_point=make, disable_env_checker=True)
    return name


def main() -> None:
    cleanrl, script, episodes = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    rest = sys.argv[sys.argv.index("--") + 1:]
    env_cfg = json.loads(os.environ["M2FLOW_PEER_ENV"])
    t0 = float(os.environ.get("M2FLOW_PEER_T0", time.time()))
    register(env_cfg["task"], episodes, t0, env_cfg)
    script = cleanrl / script
    if not script.is_file():
        raise SystemExit(f"{script}: no such cleanRL script; CLEANRL_DIR must be a cleanRL "
                         "checkout (fe8d8a0) and SCRIPT a path in it, e.g. "
                         "cleanrl/ppo_continuous_action.py")
    sys.path.insert(0, str(cleanrl))
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
