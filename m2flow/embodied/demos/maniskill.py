"""Successful demonstrations from ManiSkill's motion-planning solutions, with the observations
m2flow's env gives a policy, in ManiSkill's own trajectory format (the command is
``m2flow-demos``, :mod:`m2flow.cli.demos`).

Seeds ``demos.seed``, ``demos.seed + 1``, ... are tried until ``demos.episodes`` are kept (or
``demos.max_tries`` seeds are spent). Per seed:

1. **motion plan**: ManiSkill's solution for the task (``mani_skill.examples.motionplanning.panda.
   solutions``: ``solvePushCube``, ``solvePickCube``, ...) drives the Panda in ``pd_joint_pos``;
2. **convert**: ManiSkill's ``replay_trajectory`` conversion (``trajectory.utils.actions.
   conversion.from_pd_joint_pos``) turns those actions into ``env.control_mode``, with its
   closed-loop correction (it tracks the planner's joint targets, up to 4 target steps per
   planner step where an action would be clipped);
3. **replay**: the converted actions go through m2flow's own env (``make_env`` of the env
   config: obs mode, image size, cameras, reward and time limit as in training) from the same
   seed on a rebuilt scene, and its observations are recorded. The episode ends at its first
   success (ManiSkill ends these tasks on success) and is kept only if that comes within the
   env's time limit.

The motion-planning backend is :mod:`m2flow.embodied.demos.screw_planner` (mplib 0.1.1, which
mani-skill 3.0.1 pins, crashes under numpy 2; its screw motion is reimplemented there).

The dataset (``demos.output``: ``X.h5`` and ``X.json``) is RecordEpisode's layout
(``mani_skill.utils.wrappers.record``): groups ``traj_<i>`` with ``obs/<key>`` (T+1, ...)
(``rgb`` (T+1, H, W, 3) uint8, gzip as RecordEpisode writes it; ``state`` (T+1, D) float32),
``actions`` (T, A) float32 in the env's control mode, ``rewards`` (T,) float32 (the env's reward
mode, as in training), ``success``, ``terminated``, ``truncated`` (T,) bool; the JSON has ``env_info`` (env id, kwargs, time limit), ``source_type``
``"motionplanning"``, and ``episodes`` (``episode_id``, ``episode_seed``, ``reset_kwargs``,
``control_mode``, ``elapsed_steps``, ``success``), plus ``language_instruction`` and ``prompt``
(top level and per episode) and an ``m2flow`` entry with the env config. ManiSkill's one-task
envs have no instruction: ``language_instruction`` is ``""`` and ``prompt`` is the text the
VLA policies read for such an env (``m2flow.policies.vla.text.prompt("")``).
``algorithm=bc algorithm.dataset=X.h5`` trains on it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from m2flow.embodied.demos import dataset
from m2flow.embodied.demos.dataset import (Episode, check_env_and_output, dataset_paths,
                                            write_trajectories)
from m2flow.embodied.demos.screw_planner import screw_planner
from m2flow.envs import EnvConfig

CONFIG_DIR = "demos"  # m2flow/configs/demos/: not entry configs of m2flow-train
DEFAULT_CONFIG = "default"
SOURCE_MODE = "pd_joint_pos"  # what ManiSkill's motion planner commands
TARGET_MODES = ("pd_joint_pos", "pd_joint_delta_pos", "pd_joint_target_delta_pos",
                "pd_joint_vel", "pd_ee_delta_pos", "pd_ee_delta_pose")
"""Control modes ManiSkill's ``from_pd_joint_pos`` converts to (and the planner's own)."""
SOLUTIONS = {"PushCube-v1": "solvePushCube", "PickCube-v1": "solvePickCube"}
"""Tasks -> their solution in ``mani_skill.examples.motionplanning.panda.solutions`` (checked
here; StackCube, PullCube and LiftPegUpright also plan with screw motions only)."""
PLAN_STEP_LIMIT = 10_000  # planning/conversion envs: no time limit cuts a plan short


@dataclass
class DemosOptions:
    """What ``m2flow-demos`` generates and where it writes it."""

    episodes: int = 100
    """Successful episodes to keep."""
    output: Optional[str] = None
    """Path of the dataset: writes OUTPUT.h5 and OUTPUT.json (a trailing .h5 is dropped);
    None: demos/<task>_<obs mode><image size>, e.g. demos/PickCube-v1_rgb64."""
    seed: int = 0
    """First seed tried; then seed + 1, ..."""
    max_tries: Optional[int] = None
    """Seeds to try at most; None: 3 x episodes."""
    overwrite: bool = False
    """Replace an existing dataset at OUTPUT."""


@dataclass
class DemosConfig:
    """``m2flow-demos``: the env to record in (m2flow's env config) and the demos options."""

    env: EnvConfig = field(default_factory=EnvConfig)
    """The env as training builds it; ``num_envs`` is not used (one env replays one episode
    at a time)."""
    demos: DemosOptions = field(default_factory=DemosOptions)


@dataclass
class Demo(Episode):
    """One kept episode (:class:`.dataset.Episode`) from seed ``seed``, with the motion
    planner's step count."""

    seed: int
    planner_steps: int


@dataclass
class Tally:
    """Per-seed outcomes of a generation run."""

    tried: int = 0
    planned: int = 0
    """The planner's own episode succeeded (in pd_joint_pos)."""
    converted: int = 0
    """The converted actions succeeded in ManiSkill's conversion env (at any step)."""
    kept: int = 0
    """The replay in m2flow's env succeeded within its time limit."""
    seconds: float = 0.0
    interrupted: bool = False
    """Ctrl-C (or SIGTERM, as the command maps it) ended the run: the demos are those kept."""


# -- motion plan, convert, replay ---------------------------------------------------------


def _recorder():
    import gymnasium as gym

    class ActionRecorder(gym.Wrapper):
        """Keeps the actions stepped since the last reset and each step's success."""

        def reset(self, **kw):
            self.actions, self.success = [], []
            return self.env.reset(**kw)

        def step(self, action):
            a = action.cpu().numpy() if hasattr(action, "cpu") else np.asarray(action)
            self.actions.append(a.astype(np.float32).reshape(-1))
            out = self.env.step(action)
            self.success.append(bool(np.asarray(out[4].get("success", False)).reshape(-1)[0]))
            return out

    return ActionRecorder


class Generator:
    """The three envs of one task (planner, conversion source and target) and m2flow's env."""

    def __init__(self, env_cfg: EnvConfig):
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401  (registers the tasks)
        from mani_skill.examples.motionplanning.panda import solutions

        from m2flow.envs import make_env

        self.task = env_cfg.name.split("/", 1)[1]
        self.control_mode = env_cfg.control_mode
        self.solve = getattr(solutions, SOLUTIONS[self.task])
        kw = dict(obs_mode="none", render_backend="none", sim_backend="physx_cpu",
                  max_episode_steps=PLAN_STEP_LIMIT, **dict(env_cfg.make_args))
        if env_cfg.reward_mode:
            kw["reward_mode"] = env_cfg.reward_mode
        recorder = _recorder()
        self.planner_env = recorder(gym.make(self.task, control_mode=SOURCE_MODE, **kw))
        self.source_env = gym.make(self.task, control_mode=SOURCE_MODE, **kw)
        self.target_env = recorder(gym.make(self.task, control_mode=self.control_mode, **kw))
        self.env = make_env(replace(env_cfg, num_envs=1))
        self.spec = self.env.spec

    def motion_plan(self, seed: int) -> Optional[np.ndarray]:
        """The planner's pd_joint_pos actions (T, 8) if its episode succeeded, else None."""
        try:
            with screw_planner():
                res = self.solve(self.planner_env, seed=seed, debug=False, vis=False)
        except Exception:  # noqa: BLE001 - a solution that raises is a failed plan (run.py's rule)
            return None
        if res == -1 or not self.planner_env.success or not self.planner_env.success[-1]:
            return None
        return np.stack(self.planner_env.actions)

    def convert(self, seed: int, actions: np.ndarray) -> tuple[np.ndarray, Optional[int]]:
        """(the actions in env.control_mode (T', A), the steps they take to the first success
        in ManiSkill's conversion env, or None if they never succeed)."""
        if self.control_mode == SOURCE_MODE:
            success = self.planner_env.success
        else:
            from mani_skill.trajectory.utils.actions import conversion

            self.source_env.reset(seed=seed)
            self.target_env.reset(seed=seed)
            conversion.from_pd_joint_pos(self.control_mode, actions, self.source_env,
                                         self.target_env)
            actions, success = np.stack(self.target_env.actions), self.target_env.success
        return actions, (success.index(True) + 1 if True in success else None)

    def replay(self, seed: int, actions: np.ndarray, planner_steps: int) -> Optional[Demo]:
        """The episode in m2flow's env up to its first success, or None if it has none within
        the time limit."""
        import torch

        out = self.env.reset(seed=[seed], rebuild=True)
        obs = [out["obs"][0]]
        success, terminated, truncated, rewards = [], [], [], []
        for a in actions:
            out = self.env.step(torch.from_numpy(a)[None])
            nxt = out["next"][0]
            obs.append(nxt["obs"])
            success.append(bool(nxt["success"]))
            rewards.append(float(nxt["reward"]))
            terminated.append(bool(nxt["terminated"]))
            truncated.append(bool(nxt["truncated"]))
            if success[-1] or bool(nxt["done"]):
                break
        if not success or not success[-1]:
            return None
        t = len(success)
        return Demo(seed=seed, obs={k: np.stack([o[k].numpy() for o in obs]) for k in obs[0].keys()},
                    actions=actions[:t].astype(np.float32),
                    rewards=np.array(rewards, dtype=np.float32), success=np.array(success),
                    terminated=np.array(terminated), truncated=np.array(truncated),
                    planner_steps=planner_steps)

    def close(self) -> None:
        self.env.close()
        for e in (self.planner_env, self.source_env, self.target_env):
            e.close()


def generate(cfg: DemosConfig, log: Callable[[str], None] = print):
    """(demos of ``cfg.env`` (see the module docstring), what happened to the seeds, the
    env's spec). A ``KeyboardInterrupt`` ends it early with the demos kept so far and
    ``tally.interrupted`` (the seed under way is dropped, and counted as tried)."""
    d = cfg.demos
    tries = d.max_tries if d.max_tries is not None else 3 * d.episodes
    gen, demos, tally = Generator(cfg.env), [], Tally()
    start = time.perf_counter()
    try:
        for seed in range(d.seed, d.seed + tries):
            if len(demos) >= d.episodes:
                break
            t0 = time.perf_counter()
            demo, outcome = _try_seed(gen, seed, tally)
            if demo is not None:
                demos.append(demo)
            log(f"seed {seed}: {outcome} ({len(demos)}/{d.episodes} kept, "
                f"{time.perf_counter() - t0:.1f} s)")
    except KeyboardInterrupt:
        tally.interrupted = True
    finally:
        gen.close()
    tally.kept, tally.seconds = len(demos), time.perf_counter() - start
    return demos, tally, gen.spec


def _try_seed(gen: Generator, seed: int, tally: Tally) -> tuple[Optional[Demo], str]:
    """Plan, convert and replay one seed: (the demo or None, what happened), counted."""
    tally.tried += 1
    source = gen.motion_plan(seed)
    if source is None:
        return None, "planner failed"
    tally.planned += 1
    actions, steps = gen.convert(seed, source)
    if steps is None:
        return None, f"no success after conversion to {gen.control_mode}"
    tally.converted += 1
    limit = gen.spec.max_episode_steps
    if limit is not None and steps > limit:
        return None, f"success after {steps} steps, past the time limit {limit}"
    demo = gen.replay(seed, actions[:steps], len(source))
    if demo is None:
        return None, "no success when replayed in m2flow's env"
    return demo, f"kept, {len(demo.actions)} steps"


# -- the dataset ------------------------------------------------------------------------


def output_stem(cfg: DemosConfig) -> Path:
    """OUTPUT without its .h5: demos.output, or demos/<task>_<obs mode><size>."""
    return dataset.output_stem(cfg.demos.output, cfg.env)


def instruction(spec) -> tuple[str, str]:
    """(language instruction, the prompt a VLA reads) of the env's first task."""
    from m2flow.policies.vla.text import prompt

    text = spec.tasks[0] if spec.tasks else ""
    return text, prompt(text)


def env_kwargs(env_cfg: EnvConfig, limit: Optional[int]) -> dict:
    """The ``gym.make`` keyword arguments of m2flow's ManiSkill env (``env_info.env_kwargs``)."""
    kw = dict(obs_mode=env_cfg.obs_mode, control_mode=env_cfg.control_mode,
              sim_backend="physx_cpu", max_episode_steps=limit, **dict(env_cfg.make_args))
    if env_cfg.reward_mode:
        kw["reward_mode"] = env_cfg.reward_mode
    if env_cfg.obs_mode != "state":
        kw["sensor_configs"] = dict(width=env_cfg.image_size, height=env_cfg.image_size)
    return kw


def save(stem: Path, demos: list[Demo], env_cfg: EnvConfig, spec,
         tally: Optional[Tally] = None) -> tuple[Path, Path]:
    """Writes ``stem``.h5 and ``stem``.json (RecordEpisode's layout; the module docstring);
    with ``tally``, the JSON's ``tally`` says what happened to the seeds tried."""
    h5_path, json_path = dataset_paths(stem)
    text, vla_prompt = instruction(spec)

    def describe(i: int, demo: Demo) -> dict:
        return dict(
            episode_id=i, episode_seed=demo.seed, reset_kwargs=dict(seed=demo.seed),
            control_mode=env_cfg.control_mode, elapsed_steps=len(demo.actions),
            success=bool(demo.success[-1]), language_instruction=text, prompt=vla_prompt,
            planner_steps=demo.planner_steps)

    episodes = write_trajectories(h5_path, demos, describe)
    meta = dict(
        env_info=dict(env_id=env_cfg.name.split("/", 1)[1],
                      env_kwargs=env_kwargs(env_cfg, spec.max_episode_steps),
                      max_episode_steps=spec.max_episode_steps),
        source_type="motionplanning",
        source_desc=("ManiSkill's motion-planning solutions (pd_joint_pos), converted to "
                     f"{env_cfg.control_mode} by ManiSkill's from_pd_joint_pos and replayed in "
                     "m2flow's env; successful episodes only, each up to its first success"),
        language_instruction=text, prompt=vla_prompt,
        m2flow=dict(env=asdict(env_cfg), obs_keys=sorted(demos[0].obs) if demos else []),
        episodes=episodes,
    )
    if tally is not None:
        meta["tally"] = asdict(tally)
    json_path.write_text(json.dumps(meta, indent=2))
    return h5_path, json_path


# -- the command ------------------------------------------------------------------------


def closing_line(cfg: DemosConfig, tally: Tally, demos: list[Demo], h5_path: Path) -> str:
    """``m2flow-demos``' last line: what happened to the seeds and what was written."""
    steps = sum(len(d.actions) for d in demos)
    return (f"m2flow-demos: {tally.tried} episodes tried, motion planner solved {tally.planned}, "
            f"{tally.converted} succeed after conversion, kept {tally.kept} ({steps} steps) in "
            f"{tally.seconds:.0f} s; wrote {h5_path} and its .json")


def wanted(cfg: DemosConfig) -> int:
    """The episodes ``m2flow-demos`` is asked to keep."""
    return cfg.demos.episodes


def succeeded(cfg: DemosConfig, tally: Tally) -> bool:
    """``m2flow-demos`` exits 0: every asked-for episode was kept."""
    return tally.kept >= cfg.demos.episodes


def register_schema() -> None:
    """``demos_schema`` and the env adapters' settings (``env/<schema>``)."""
    from m2flow.configs import schema
    from m2flow.envs.registry import register_schemas as register_envs

    schema.store("demos_schema", DemosConfig)
    register_envs(schema)  # its ``store(name=, node=, group=)`` is a ConfigStore's


def load_demos_config(config_name: str = DEFAULT_CONFIG, overrides=()) -> DemosConfig:
    """``m2flow/configs/demos/<config_name>.yaml`` with ``overrides``, checked; bad input is a
    ConfigError of one line."""
    from m2flow.configs import ConfigError, load_config, to_object
    register_schema()
    cfg: DemosConfig = to_object(load_config(f"{CONFIG_DIR}/{config_name}", overrides))
    family, _, task = cfg.env.name.partition("/")
    if family != "ManiSkill" or task not in SOLUTIONS:
        raise ConfigError(
            f"config error: env.name={cfg.env.name!r}: m2flow-demos has motion-planning "
            f"solutions for ManiSkill/{', ManiSkill/'.join(SOLUTIONS)}; pick one of those.")
    if cfg.env.control_mode not in TARGET_MODES:
        raise ConfigError(
            f"config error: env.control_mode={cfg.env.control_mode!r}: ManiSkill converts "
            f"the planner's {SOURCE_MODE} actions to {', '.join(TARGET_MODES)}; pick one.")
    if cfg.demos.episodes < 1 or (cfg.demos.max_tries is not None and cfg.demos.max_tries < 1):
        raise ConfigError("config error: demos.episodes and demos.max_tries must be >= 1 "
                          f"(got {cfg.demos.episodes} and {cfg.demos.max_tries}).")
    check_env_and_output(cfg.env, output_stem(cfg), cfg.demos.overwrite)
    return cfg
