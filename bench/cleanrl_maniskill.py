"""Runs cleanRL's ``sac_continuous_action.py``, unmodified, on a ManiSkill3 task through its
CPU backend, and records every training episode's outcome (``bench/sac_peer.py`` starts it).

    python bench/cleanrl_maniskill.py CLEANRL_DIR EPISODES_JSONL -- <cleanRL's arguments>

cleanRL makes its envs with ``gym.make(args.env_id)``. This file registers
``m2flow-peer/<task>`` (e.g. ``m2flow-peer/PushCube-v1``): the ManiSkill task with one env on
the CPU backend (``sim_backend="physx_cpu"``), state observations, the control and reward modes
given in ``M2FLOW_PEER_ENV`` (JSON, m2flow's env config fields ``control_mode``,
``reward_mode``), run to its time limit (``ignore_terminations``, as m2flow's
``maniskill_pushcube`` env does), behind ManiSkill's own ``CPUGymWrapper`` (numpy, unbatched).
A wrapper outside it (inside cleanRL's ``RecordEpisodeStatistics``) appends one JSON line per finished episode to EPISODES_JSONL: env steps so
far, seconds since ``M2FLOW_PEER_T0`` (the launch, as the bench timed it), success at any step,
success at the end and the return. Then cleanRL's script runs as ``__main__`` with
CLEANRL_DIR on ``sys.path`` (its ``cleanrl_utils``).

cleanRL pins gymnasium 0.29.1 (its vector env hands back ``final_observation``), so this runs
in the bench's peer environment (``sac_peer.py --peer-venv``), not in m2flow's.
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
    ``RecordEpisodeStatistics`` refuses an ``info["episode"]`` that is already there)."""

    def __init__(self, env, path: Path, t0: float):
        super().__init__(env)
        self.out, self.t0, self.steps = open(path, "a"), t0, 0
        self.success_once, self.ret = False, 0.0

    def reset(self, **kwargs):
        self.success_once, self.ret = False, 0.0
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        self.ret += float(reward)
        self.success_once |= bool(info["success"])
        if terminated or truncated:
            self.out.write(json.dumps({
                "steps": self.steps, "seconds": time.time() - self.t0,
                "success_once": self.success_once, "success_at_end": bool(info["success"]),
                "return": self.ret}) + "\n")
            self.out.flush()
        return obs, reward, terminated, truncated, info


def register(task: str, episodes: Path, t0: float, env_cfg: dict) -> str:
    import mani_skill.envs  # noqa: F401  (registers the tasks)
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    def make(**_):
        env = gym.make(task, num_envs=1, obs_mode="state", sim_backend="physx_cpu",
                       control_mode=env_cfg["control_mode"], reward_mode=env_cfg["reward_mode"])
        return EpisodeLog(CPUGymWrapper(env, ignore_terminations=True), episodes, t0)

    name = f"m2flow-peer/{task}"
    gym.register(name, entry_point=make, disable_env_checker=True)
    return name


def main() -> None:
    cleanrl, episodes = Path(sys.argv[1]), Path(sys.argv[2])
    rest = sys.argv[sys.argv.index("--") + 1:]
    env_cfg = json.loads(os.environ["M2FLOW_PEER_ENV"])
    t0 = float(os.environ.get("M2FLOW_PEER_T0", time.time()))
    register(env_cfg["task"], episodes, t0, env_cfg)
    script = cleanrl / "cleanrl" / "sac_continuous_action.py"
    sys.path.insert(0, str(cleanrl))
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
