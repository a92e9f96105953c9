"""Successful demonstrations from Meta-World's scripted experts, with the observations m2flow's
env gives a policy, in ManiSkill's trajectory format (the command is ``m2flow-demos
env=metaworld_mt50``, :mod:`m2flow.cli.demos`).

The experts are Meta-World's own: ``metaworld.policies.ENV_POLICY_MAP``, one short class per
task that reads the 39-dim state (``_parse_obs`` names its slices: hand, gripper, object,
goal) and moves to the next waypoint (``get_action``). They act on that state only; in
``rgb`` mode the env is built with ``env.privileged_state=true`` so that the state reaches
the expert, and the file keeps it as ``obs/privileged`` beside the camera and the proprio.

For each task of the env's suite in order (``spec.tasks``), seeds ``demos.seed``,
``demos.seed + 1``, ... are tried until ``demos.episodes_per_task`` are kept (or
``demos.max_tries_per_task`` spent). An episode starts from its seed on m2flow's env (the
initial state of that seed, as in training and evaluation), runs the expert until its first
success or the env's time limit, and is kept only if Meta-World's ``info["success"]`` came.

The dataset (``demos.output``: ``X.h5`` and ``X.json``) is the layout of
:mod:`m2flow.embodied.demos.maniskill` (RecordEpisode's): groups ``traj_<i>`` with
``obs/<key>`` (T+1, ...) (``rgb`` gzip-compressed uint8, ``state``, ``privileged`` float32,
``task`` int64), ``actions`` (T, 4) float32, ``rewards`` (T,) float32 (the env's reward mode),
``success``, ``terminated``, ``truncated`` (T,) bool; the JSON has ``env_info``,
``source_type`` ``"scripted_expert"`` and ``episodes`` (``episode_id``, ``episode_seed``,
``reset_kwargs`` (seed and task), ``task``, ``task_name``, ``elapsed_steps``, ``success``,
``language_instruction``, ``prompt``) plus an ``m2flow`` entry with the env config and each
task's ``tried`` and ``kept``. ``algorithm=bc algorithm.dataset=X.h5`` trains on it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from m2flow import keys
from m2flow.embodied.demos import dataset
from m2flow.embodied.demos.dataset import (Episode, TaskTally, check_env_and_output,
                                            dataset_paths, write_trajectories)
from m2flow.envs import EnvConfig

CONFIG_DIR = "demos"
DEFAULT_CONFIG = "metaworld"
SCHEMA = "metaworld_demos_schema"
TRIES_PER_KEPT = 3  # demos.max_tries_per_task's default: this many seeds per episode asked
FIRST_SEED = 100_000
"""demos.seed's default: far past the seeds m2flow-eval starts a suite's episodes from (episode
e of a task from seed e), so no evaluated initial state is among the demonstrations'."""


@dataclass
class DemosOptions:
    """What ``m2flow-demos`` records from Meta-World's experts and where it writes it."""

    episodes_per_task: int = 10
    """Successful episodes to keep per task of the suite."""
    output: Optional[str] = None
    """Path of the dataset: writes OUTPUT.h5 and OUTPUT.json (a trailing .h5 is dropped);
    None: demos/metaworld_<suite>_<obs mode><image size>, e.g. demos/metaworld_MT50_rgb64."""
    seed: int = FIRST_SEED
    """First seed tried for each task; then seed + 1, ... (default: past evaluation's)."""
    max_tries_per_task: Optional[int] = None
    """Seeds to try per task at most; None: 3 x episodes_per_task."""
    overwrite: bool = False
    """Replace an existing dataset at OUTPUT."""


@dataclass
class DemosConfig:
    """``m2flow-demos`` on Meta-World: the env (m2flow's env config) and the demos options."""

    env: EnvConfig = field(default_factory=EnvConfig)
    """The env as training builds it; ``num_envs`` is not used (one env, one episode at a
    time)."""
    demos: DemosOptions = field(default_factory=DemosOptions)


@dataclass
class Demo(Episode):
    """One kept episode (:class:`.dataset.Episode`) of task ``task`` (index in ``spec.tasks``)
    from seed ``seed``; ``actions`` are (T, 4)."""

    seed: int
    task: int


Tally = TaskTally
"""What happened to the seeds, in all and per task index."""


def expert(task_name: str):
    """Meta-World's scripted expert of ``task_name`` (e.g. 'reach-v3')."""
    from metaworld.policies import ENV_POLICY_MAP

    return ENV_POLICY_MAP[task_name]()


def expert_state(obs) -> np.ndarray:
    """The 39-dim state an expert reads, from one env's observation (a TensorDict row)."""
    from m2flow.envs.metaworld import STATE_DIM

    key = keys.leaf(keys.PRIVILEGED) if keys.leaf(keys.PRIVILEGED) in obs.keys() \
        else keys.leaf(keys.STATE)
    return obs[key][:STATE_DIM].double().numpy()  # without env.task_one_hot's entries


def run_episode(env, policy, seed: int, task: int) -> Demo:
    """One episode of ``policy`` on env 0 of ``env`` (a one-env MetaWorld env) from ``seed`` on
    task ``task``, up to its first success or the end of the episode."""
    import torch

    out = env.reset(seed=[seed], task=[task])
    obs = [out["obs"][0]]
    actions, rewards, success, terminated, truncated = [], [], [], [], []
    while True:
        action = np.asarray(policy.get_action(expert_state(obs[-1])), dtype=np.float32)
        out = env.step(torch.from_numpy(action)[None])
        nxt = out["next"][0]
        obs.append(nxt["obs"])
        actions.append(np.clip(action, -1.0, 1.0))  # what the env applied
        rewards.append(float(nxt["reward"]))
        success.append(bool(nxt["success"]))
        terminated.append(bool(nxt["terminated"]))
        truncated.append(bool(nxt["truncated"]))
        if success[-1] or bool(nxt["done"]):
            break
    return Demo(seed=seed, task=task,
                obs={k: np.stack([o[k].numpy() for o in obs]) for k in obs[0].keys()},
                actions=np.stack(actions), rewards=np.array(rewards, dtype=np.float32),
                success=np.array(success), terminated=np.array(terminated),
                truncated=np.array(truncated))


def recording_env(env_cfg: EnvConfig):
    """m2flow's env for the experts: one env, in this process, with the state they read."""
    from m2flow.envs import make_env

    return make_env(recording_config(env_cfg))


def recording_config(env_cfg: EnvConfig) -> EnvConfig:
    """``env_cfg`` as the experts' env is built: one env, in this process, with the state."""
    rgb = env_cfg.obs_mode != "state"
    return replace(env_cfg, num_envs=1, processes=False,
                   privileged_state=env_cfg.privileged_state or rgb)


def generate(cfg: DemosConfig, log: Callable[[str], None] = print):
    """(demos of ``cfg.env``'s tasks (see the module docstring), the tally, the env's spec).
    A ``KeyboardInterrupt`` ends it early with the demos kept so far and
    ``tally.interrupted``."""
    d = cfg.demos
    tries = d.max_tries_per_task or TRIES_PER_KEPT * d.episodes_per_task
    env, demos, tally = recording_env(cfg.env), [], Tally()
    start = time.perf_counter()
    try:
        for task, name in enumerate(env.task_names):
            policy, counts = expert(name), tally.per_task.setdefault(task, [0, 0])
            t0 = time.perf_counter()
            for seed in range(d.seed, d.seed + tries):
                if counts[1] >= d.episodes_per_task:
                    break
                demo = run_episode(env, policy, seed, task)
                tally.count(task, bool(demo.success[-1]))
                if demo.success[-1]:
                    demos.append(demo)
            log(f"task {task} {name}: kept {counts[1]}/{d.episodes_per_task} of {counts[0]} "
                f"tried ({time.perf_counter() - t0:.1f} s)")
    except KeyboardInterrupt:
        tally.interrupted = True
    finally:
        env.close()
    tally.seconds = time.perf_counter() - start
    return demos, tally, env.spec


def task_names(env_cfg: EnvConfig) -> tuple:
    """Meta-World's names of the env's tasks, in ``spec.tasks`` order."""
    from m2flow.envs.metaworld import suite_tasks

    names = suite_tasks(env_cfg.name.split("/", 1)[1])
    return names if env_cfg.task_ids is None else tuple(names[t] for t in env_cfg.task_ids)


# -- the dataset ------------------------------------------------------------------------


def output_stem(cfg: DemosConfig) -> Path:
    """OUTPUT without its .h5: demos.output, or demos/metaworld_<suite>_<obs mode><size>."""
    return dataset.output_stem(cfg.demos.output, cfg.env, "metaworld_")


def save(stem: Path, demos: list[Demo], env_cfg: EnvConfig, spec,
         tally: Optional[Tally] = None) -> tuple[Path, Path]:
    """Writes ``stem``.h5 and ``stem``.json (the module docstring's layout; each task's tried
    and kept from ``tally``, where given)."""
    from m2flow.policies.vla.text import prompt

    h5_path, json_path = dataset_paths(stem)
    names, recorded = task_names(env_cfg), asdict(recording_config(env_cfg))
    counts = tally.per_task if tally is not None else {}

    def describe(i: int, demo: Demo) -> dict:
        text = spec.tasks[demo.task]
        return dict(
            episode_id=i, episode_seed=demo.seed,
            reset_kwargs=dict(seed=demo.seed, task=demo.task), task=demo.task,
            task_name=names[demo.task], elapsed_steps=len(demo.actions),
            success=bool(demo.success[-1]), language_instruction=text, prompt=prompt(text))

    episodes = write_trajectories(h5_path, demos, describe)
    meta = dict(
        env_info=dict(env_id=env_cfg.name, max_episode_steps=spec.max_episode_steps,
                      env_kwargs=recorded),
        source_type="scripted_expert",
        source_desc=("Meta-World's scripted experts (metaworld.policies.ENV_POLICY_MAP) on "
                     "the 39-dim state, in m2flow's env; successful episodes only, each up to "
                     "its first success"),
        m2flow=dict(env=recorded, obs_keys=sorted(demos[0].obs) if demos else [],
                    tasks=[dict(task=k, name=names[k], language_instruction=t,
                                tried=counts.get(k, [0, 0])[0], kept=counts.get(k, [0, 0])[1])
                           for k, t in enumerate(spec.tasks)]),
        episodes=episodes,
    )
    json_path.write_text(json.dumps(meta, indent=2))
    return h5_path, json_path


# -- the command ------------------------------------------------------------------------


def closing_line(cfg: DemosConfig, tally: Tally, demos: list[Demo], h5_path: Path) -> str:
    """``m2flow-demos``' last line: what the experts did and what was written."""
    steps = sum(len(d.actions) for d in demos)
    short = [k for k, (_, kept) in tally.per_task.items() if kept < cfg.demos.episodes_per_task]
    return (f"m2flow-demos: {tally.tried} episodes tried on {len(tally.per_task)} tasks, kept "
            f"{tally.kept} ({steps} steps) in {tally.seconds:.0f} s"
            + (f"; tasks short of {cfg.demos.episodes_per_task}: {short}" if short else "")
            + f"; wrote {h5_path} and its .json")


def wanted(cfg: DemosConfig) -> int:
    """The episodes asked for: per task (the suite's size is known once the env is built)."""
    return cfg.demos.episodes_per_task


def succeeded(cfg: DemosConfig, tally: Tally) -> bool:
    """``m2flow-demos`` exits 0: every task kept the episodes asked for."""
    return bool(tally.per_task) and all(
        kept >= cfg.demos.episodes_per_task for _, kept in tally.per_task.values())


def register_schema() -> None:
    """This recorder's schema and the env adapters' settings (``env/<schema>``)."""
    from m2flow.configs import schema
    from m2flow.envs.registry import register_schemas as register_envs

    schema.store(SCHEMA, DemosConfig)
    register_envs(schema)


def load_demos_config(config_name: str = DEFAULT_CONFIG, overrides=()) -> DemosConfig:
    """``m2flow/configs/demos/<config_name>.yaml`` with ``overrides``, checked; bad input is a
    ConfigError of one line."""
    from m2flow.configs import ConfigError, load_config, to_object
    register_schema()
    cfg: DemosConfig = to_object(load_config(f"{CONFIG_DIR}/{config_name}", overrides))
    if cfg.env.name.split("/", 1)[0] != "MetaWorld":
        raise ConfigError(f"config error: env.name={cfg.env.name!r}: this recorder runs "
                          "Meta-World's experts; pick a MetaWorld/<task or suite> env "
                          "(e.g. env=metaworld_mt50).")
    d = cfg.demos
    if d.episodes_per_task < 1 or (d.max_tries_per_task is not None and d.max_tries_per_task < 1):
        raise ConfigError("config error: demos.episodes_per_task and demos.max_tries_per_task "
                          f"must be >= 1 (got {d.episodes_per_task} and {d.max_tries_per_task}).")
    check_env_and_output(cfg.env, output_stem(cfg), cfg.demos.overwrite)
    return cfg
