"""Successful demonstrations of LIBERO's pick-and-place suites from a scripted expert
(:mod:`m2flow.embodied.demos.libero_expert`), recorded through m2flow's own LIBERO env (the
command is ``m2flow-demos env=libero_object``, :mod:`m2flow.cli.demos`).

Every task of ``env.task_ids`` (all of the suite by default) is tried from LIBERO's own init
states ``demos.first_init_state``, ... (``demos.init_states_per_task`` of them; 50 is all):
the env resets with that seed (init state ``seed % 50``, then its settle steps), the expert
plans from the privileged state (the env is built with ``env.privileged_state=true``) and
acts; an episode is kept only if the task's BDDL predicate holds (the env's ``success``,
which ends the episode) within the suite's time limit. Success per task is printed at the end
of each task and saved in the JSON (``success_per_task``).

The dataset (``demos.output``: ``X.h5`` and ``X.json``) is the layout of
:mod:`m2flow.embodied.demos.maniskill` (ManiSkill's RecordEpisode): groups ``traj_<i>`` with
``obs/<key>`` (T+1, ...) for every key the env gives (``rgb``, ``wrist_rgb`` (T+1, S, S, 3)
uint8, gzip; ``state`` (T+1, 8); ``privileged`` (T+1, P); ``task`` (T+1,) int64),
``actions`` (T, 7) float32 (OSC_POSE, gripper -1 open / +1 closed), ``rewards``,
``success``, ``terminated``, ``truncated`` (T,); the JSON's ``episodes`` give each episode's
``task`` (index in ``spec.tasks``), ``task_name``, ``language_instruction`` and ``prompt``,
``init_state`` and ``reset_kwargs``, and its top level ``env_info``, ``tasks`` (the
instructions in order), ``privileged_layout`` (per task: (name, start, stop)) and
``success_per_task``. ``algorithm=bc algorithm.dataset=X.h5`` trains on it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from m2flow.embodied.demos import dataset
from m2flow.embodied.demos.dataset import (Episode, TaskTally, check_env_and_output,
                                            dataset_paths, write_trajectories)
from m2flow.envs.libero import LiberoEnvConfig

CONFIG_DIR = "demos"
DEFAULT_CONFIG = "libero"
SUITES = ("libero_object", "libero_spatial")
"""The suites whose tasks the expert has grasps and places for (pick-and-place only)."""
INIT_STATES = 50  # LIBERO's init states per task


@dataclass
class LiberoDemosOptions:
    """What ``m2flow-demos`` records for a LIBERO suite and where it writes it."""

    init_states_per_task: int = INIT_STATES
    """Init states tried per task (LIBERO has 50: all of them by default)."""
    first_init_state: int = 0
    """The first init state tried; then the next ones (wrapping at 50)."""
    output: Optional[str] = None
    """Path of the dataset: writes OUTPUT.h5 and OUTPUT.json (a trailing .h5 is dropped);
    None: demos/<suite>_<obs mode><image size>, e.g. demos/libero_object_rgb128."""
    overwrite: bool = False
    """Replace an existing dataset at OUTPUT."""
    action_noise: float = 0.0
    """> 0: Gaussian noise of this std (action units) added to the arm's part of each action
    the env executes (position and rotation deltas, dims 0-5; not the gripper), while
    ``actions`` records the expert's own: the demos then show the expert recovering from the
    drift a sampled policy makes (DART, Laskey et al. 2017). Without it a clone has never
    seen its hand turned off the expert's path, and its sampled actions (OSC_POSE: 0.5 rad per
    rotation unit) fail where its mean succeeds. Each episode's noise is seeded by its task
    and init state; ``executed_actions`` holds what ran (replaying those repeats the
    episode)."""


@dataclass
class LiberoDemosConfig:
    """``m2flow-demos`` for LIBERO: the env (m2flow's env config) and the demos options."""

    env: LiberoEnvConfig = field(default_factory=LiberoEnvConfig)
    """The env as training builds it; ``privileged_state`` is set (the expert reads it) and
    ``num_envs`` is 1 (one env records one episode at a time)."""
    demos: LiberoDemosOptions = field(default_factory=LiberoDemosOptions)


@dataclass
class Demo(Episode):
    """One kept episode (:class:`.dataset.Episode`) of task ``task`` (index in ``spec.tasks``)
    from LIBERO's init state ``init_state``; ``actions`` are (T, 7)."""

    task: int
    init_state: int
    executed: Optional[np.ndarray] = None
    """The actions the env ran (T, 7), where ``demos.action_noise`` perturbed them; None:
    ``actions`` ran."""
    action_noise: float = 0.0
    """``demos.action_noise`` when it was recorded."""


@dataclass
class Tally(TaskTally):
    """Outcomes of a recording run, per task (index in ``spec.tasks``)."""

    steps: int = 0
    """Env steps taken (kept or not; settle steps not counted)."""


# -- record -------------------------------------------------------------------------------


ARM_DIMS = 6  # OSC_POSE's position and rotation deltas; the gripper is dim 6


def record_episode(env, expert, layout, task: int, seed: int,
                   action_noise: float = 0.0) -> tuple[bool, Demo]:
    """One episode of ``expert`` in ``env`` (one env) on ``task`` from init state ``seed``:
    (success at its end, the episode). ``action_noise``: ``demos.action_noise``."""
    import torch

    from m2flow import keys
    from m2flow.embodied.demos.libero_expert import named

    priv = keys.leaf(keys.PRIVILEGED)
    out = env.reset(seed=[seed], task=[task])
    obs = [{k: v[0].numpy() for k, v in out["obs"].items()}]
    expert.reset(named(obs[0][priv], layout))
    rng = np.random.default_rng([task, seed]) if action_noise > 0 else None
    actions, executed, rewards, success, terminated, truncated = [], [], [], [], [], []
    while True:
        a = expert.act(named(obs[-1][priv], layout))
        ran = a if rng is None else perturbed(a, rng, action_noise)
        out = env.step(torch.from_numpy(ran)[None])
        nxt = out["next"][0]
        actions.append(a)
        executed.append(ran)
        obs.append({k: v.numpy() for k, v in nxt["obs"].items()})
        success.append(bool(nxt["success"]))
        rewards.append(float(nxt["reward"]))
        terminated.append(bool(nxt["terminated"]))
        truncated.append(bool(nxt["truncated"]))
        if bool(nxt["done"]):
            break
    demo = Demo(task=task, init_state=seed % INIT_STATES,
                obs={k: np.stack([o[k] for o in obs]) for k in obs[0]},
                actions=np.stack(actions).astype(np.float32),
                rewards=np.array(rewards, dtype=np.float32), success=np.array(success),
                terminated=np.array(terminated), truncated=np.array(truncated),
                executed=None if rng is None else np.stack(executed).astype(np.float32),
                action_noise=float(action_noise))
    return success[-1], demo


def perturbed(action: np.ndarray, rng: np.random.Generator, std: float) -> np.ndarray:
    """``action`` with N(0, std) added to its arm dims (0-5), clipped to [-1, 1]; the
    gripper's dim as it was.

    >>> a = np.array([0.5, 0, 0, 0, 0, 0.999, 1.0], dtype=np.float32)
    >>> b = perturbed(a, np.random.default_rng(0), 0.1)
    >>> b.dtype, float(b[6]), bool(b[5] <= 1.0), [round(float(x), 4) for x in b[:2] - a[:2]]
    (dtype('float32'), 1.0, True, [0.0126, -0.0132])
    """
    out = action.astype(np.float32, copy=True)
    out[:ARM_DIMS] = np.clip(out[:ARM_DIMS] + rng.normal(0.0, std, ARM_DIMS), -1.0, 1.0)
    return out


def task_list(env_cfg: LiberoEnvConfig) -> list:
    """(index in ``spec.tasks``, suite task id, objects in slot order) of each task recorded."""
    from m2flow.envs.libero import suite_tasks
    from m2flow.envs.libero_privileged import task_objects

    suite = env_cfg.name.split("/", 1)[1]
    tasks = suite_tasks(suite, env_cfg.assets_path)
    ids = list(range(len(tasks))) if env_cfg.task_ids is None else list(env_cfg.task_ids)
    return [(k, t, task_objects(tasks[t][2])) for k, t in enumerate(ids)]


def generate(cfg: LiberoDemosConfig, log: Callable[[str], None] = print):
    """(the kept demos (module docstring), the tally, the env's spec). A
    ``KeyboardInterrupt`` ends it early with the demos kept so far and ``tally.interrupted``."""
    from m2flow.embodied.demos.libero_expert import expert_for
    from m2flow.envs import make_env
    from m2flow.envs.libero_privileged import privileged_dim, privileged_layout

    d = cfg.demos
    env = make_env(replace(cfg.env, num_envs=1))
    spec = env.spec
    slots = (spec.obs_shapes["privileged"][0] - privileged_dim(0)) // privileged_dim(1)
    demos, tally = [], Tally()
    start = time.perf_counter()
    try:
        for k, task_id, objects in task_list(cfg.env):
            expert = expert_for(objects)
            layout = privileged_layout(objects, slots)
            for i in range(d.init_states_per_task):
                seed = (d.first_init_state + i) % INIT_STATES
                t0 = time.perf_counter()
                ok, demo = record_episode(env, expert, layout, k, seed, d.action_noise)
                tally.count(k, ok)
                tally.steps += len(demo.actions)
                if ok:
                    demos.append(demo)
                log(f"task {task_id} init state {seed}: "
                    f"{'kept' if ok else 'failed'}, {len(demo.actions)} steps "
                    f"({time.perf_counter() - t0:.1f} s)")
            tried, kept = tally.per_task.get(k, [0, 0])
            log(f"task {task_id} ({spec.tasks[k]}): success {kept}/{tried}")
    except KeyboardInterrupt:
        tally.interrupted = True
    finally:
        env.close()
    tally.seconds = time.perf_counter() - start
    return demos, tally, spec


# -- the dataset ------------------------------------------------------------------------


def output_stem(cfg: LiberoDemosConfig) -> Path:
    """OUTPUT without its .h5: demos.output, or demos/<suite>_<obs mode><size>."""
    return dataset.output_stem(cfg.demos.output, cfg.env)


def save(stem: Path, demos: list, env_cfg: LiberoEnvConfig, spec,
         tally: Optional[Tally] = None) -> tuple[Path, Path]:
    """Writes ``stem``.h5 and ``stem``.json (the module docstring's layout); with ``tally``,
    the JSON's ``success_per_task``: {task index: instruction, tried, kept, success}."""
    from m2flow.envs.libero import suite_tasks
    from m2flow.envs.libero_privileged import privileged_dim, privileged_layout
    from m2flow.policies.vla.text import prompt

    h5_path, json_path = dataset_paths(stem)
    suite = env_cfg.name.split("/", 1)[1]
    tasks = task_list(env_cfg)
    names = suite_tasks(suite, env_cfg.assets_path)
    slots = (spec.obs_shapes["privileged"][0] - privileged_dim(0)) // privileged_dim(1)

    def describe(i: int, demo: Demo) -> dict:
        text = spec.tasks[demo.task]
        return dict(
            episode_id=i, episode_seed=demo.init_state,
            reset_kwargs=dict(seed=demo.init_state, task=demo.task),
            control_mode="OSC_POSE", elapsed_steps=len(demo.actions),
            success=bool(demo.success[-1]), task=demo.task,
            task_name=names[tasks[demo.task][1]][0], init_state=demo.init_state,
            language_instruction=text, prompt=prompt(text), action_noise=demo.action_noise)

    episodes = write_trajectories(h5_path, demos, describe)
    meta = dict(
        env_info=dict(env_id=env_cfg.name, env_kwargs=asdict(env_cfg),
                      max_episode_steps=spec.max_episode_steps),
        source_type="scripted",
        source_desc=("m2flow's scripted LIBERO expert (m2flow.embodied.demos.libero_expert) "
                     "from the privileged state, OSC_POSE; LIBERO's own init states; episodes "
                     "whose BDDL predicate holds only, each up to its first success"),
        action_noise=max((d.action_noise for d in demos), default=0.0),
        tasks=list(spec.tasks),
        privileged_layout={str(k): [(n, s.start, s.stop) for n, s in privileged_layout(o, slots)]
                           for k, _, o in tasks},
        m2flow=dict(env=asdict(env_cfg), obs_keys=sorted(demos[0].obs) if demos else []),
        episodes=episodes,
    )
    if tally is not None:
        meta["success_per_task"] = {
            str(k): dict(instruction=spec.tasks[k], tried=n, kept=m, success=m / n if n else None)
            for k, (n, m) in sorted(tally.per_task.items())}
    json_path.write_text(json.dumps(meta, indent=2))
    return h5_path, json_path


# -- the command ------------------------------------------------------------------------


def closing_line(cfg: LiberoDemosConfig, tally: Tally, demos: list, h5_path: Path) -> str:
    """``m2flow-demos``' last line: success per task (by the suite's task id), what was
    kept and written."""
    ids = cfg.env.task_ids or list(range(_suite_size(cfg.env)))  # the suite's task ids
    rates = " ".join(f"{ids[k]}:{m}/{n}" for k, (n, m) in sorted(tally.per_task.items()))
    steps = sum(len(d.actions) for d in demos)
    rate = tally.steps / tally.seconds if tally.seconds else 0.0
    return (f"m2flow-demos: {tally.tried} episodes tried, kept {tally.kept} ({steps} steps) in "
            f"{tally.seconds:.0f} s ({rate:.1f} env steps/s); success per task {rates}; "
            f"wrote {h5_path} and its .json")


def wanted(cfg: LiberoDemosConfig) -> int:
    """Episodes tried: init states per task x tasks."""
    n = len(cfg.env.task_ids) if cfg.env.task_ids is not None else _suite_size(cfg.env)
    return cfg.demos.init_states_per_task * n


def succeeded(cfg: LiberoDemosConfig, tally: Tally) -> bool:
    """``m2flow-demos`` exits 0: every task was tried and kept at least one episode."""
    return bool(tally.per_task) and all(m > 0 for _, m in tally.per_task.values())


def _suite_size(env_cfg: LiberoEnvConfig) -> int:
    from m2flow.envs.libero import SUITE_NUM_TASKS

    return SUITE_NUM_TASKS[env_cfg.name.split("/", 1)[1]]


def register_schema() -> None:
    """``libero_demos_schema`` and the env adapters' settings (``env/<schema>``)."""
    from m2flow.configs import schema
    from m2flow.envs.registry import register_schemas as register_envs

    schema.store("libero_demos_schema", LiberoDemosConfig)
    register_envs(schema)


def load_demos_config(config_name: str = DEFAULT_CONFIG, overrides=()) -> LiberoDemosConfig:
    """``m2flow/configs/demos/<config_name>.yaml`` with ``overrides``, checked; bad input is a
    ConfigError of one line."""
    from m2flow.configs import ConfigError, load_config, to_object
    register_schema()
    cfg: LiberoDemosConfig = to_object(load_config(f"{CONFIG_DIR}/{config_name}", overrides))
    family, _, suite = cfg.env.name.partition("/")
    if family != "LIBERO" or suite not in SUITES:
        raise ConfigError(
            f"config error: env.name={cfg.env.name!r}: the scripted LIBERO expert has grasps "
            f"for the pick-and-place suites LIBERO/{', LIBERO/'.join(SUITES)}; pick one "
            "(env=libero_object or env=libero_spatial).")
    d = cfg.demos
    if not 1 <= d.init_states_per_task <= INIT_STATES or not 0 <= d.first_init_state < INIT_STATES:
        raise ConfigError(
            f"config error: demos.init_states_per_task={d.init_states_per_task} and "
            f"demos.first_init_state={d.first_init_state}: LIBERO has {INIT_STATES} init states "
            f"per task; give 1-{INIT_STATES} and 0-{INIT_STATES - 1}.")
    cfg.env.privileged_state, cfg.env.num_envs = True, 1  # the expert reads it; one at a time
    check_env_and_output(cfg.env, output_stem(cfg), cfg.demos.overwrite)
    return cfg
