"""Meta-World (Farama, MuJoCo) as ``MetaWorld/<task>`` and its suites ``MetaWorld/MT10``,
``MetaWorld/MT50``, ``MetaWorld/ML45-train`` and ``MetaWorld/ML45-test``.

Task: a Sawyer arm on a table, 50 tasks (``reach-v3`` ... ``window-close-v3``). A suite lists
its tasks in Meta-World's own order (``metaworld.env_dict``: ``MT10_V3``, ``MT50_V3``,
``ML45_V3``); ``spec.tasks`` holds each task's language instruction and ``("obs", "task")``
the task's index in that list. ``env.task_ids`` picks a subset.

Initial states: Meta-World draws each episode's object and goal positions (the task's
``rand_vec``) uniformly from the task's ``_random_reset_space``, redrawing where the task
rejects a draw (e.g. a goal too close to the object), as its benchmarks' goal generation does
(``metaworld._make_tasks``); here the draw comes from the env's own generator seeded with the
episode seed (Meta-World's ``seeded_rand_vec``), so a seed gives one initial state whatever
env, process or batch runs it. An auto-reset without a seed continues that generator.

Observations (``env.obs_mode``):

- ``state``: ``state`` (39,) float32, Meta-World's observation: hand position (3), gripper
  opening (1), the objects' positions and quaternions (14, zero-padded), the same 18 of the
  step before, and the goal position (3; zeros in the ML45 suites, whose goal is hidden as
  Meta-World's meta-learning benchmarks hide it; ``env.goal_observable`` overrides);
  ``task`` () int64;
- ``rgb``: ``rgb`` (S, S, 3) uint8 with S = ``env.image_size`` from ``env.camera``, ``state``
  (4,) the proprio (hand position, gripper opening), ``task``; with ``env.privileged_state``
  also ``privileged`` (39,), the ``state`` observation above (for a critic, and what the
  scripted experts read).

The default camera is RLinf's (``rlinf/envs/metaworld/metaworld_env.py``): ``corner2`` moved
to (0.75, 0.075, 0.7) and the frame turned 180 degrees, "to align with" the LeRobot MT50
dataset its π0 checkpoints are fine-tuned on. ``env.render_quality=fast`` drops the 4x MSAA
and the shadow maps (Meta-World's 4096 px shadow maps dominate a software renderer's frame
time); ``standard`` is Meta-World's look.

Actions: 4-dim in [-1, 1]: end-effector delta position (x 1 cm) and gripper effort (+1
closes). Success: Meta-World's own ``info["success"]``. Reward (``env.reward_mode``):
``sparse`` (default, as RLinf's MT50 runs: 1 in a step where the task succeeds) or ``dense``
(Meta-World's v2 shaped reward, 0-10 per step). Success ends the episode unless
``env.ignore_terminations``; the time limit is RLinf's 100 steps unless
``env.max_episode_steps``.

Instructions: :data:`INSTRUCTIONS`, one per task, from RLinf's
``rlinf/envs/metaworld/metaworld_config.json`` (``TASK_DESCRIPTIONS``), the text its Meta-World
VLAs read. Difficulty: :data:`DIFFICULTY`, the easy (28) / medium (11) / hard (6) / very hard
(5) split of Seo et al., "Masked World Models for Visual Control" (CoRL 2022, appendix), which
RLinf's MT50 table reports and lists in the same file (``DIFFICULTY_TO_TASKS``).

Processes: ``env.processes=false`` (default) steps every env in this process; ``true`` gives
each env its own process (forked from a server that imported MuJoCo and Meta-World once), so
envs simulate and render on several cores at once. The default is the one that collects
faster where no core is free (a shared CPU machine): there the messages of each step cost
more than the overlap gains; ``bench/metaworld_procs.py`` measures both, in env steps/s and
in CPU time per env step.

MuJoCo: Meta-World 3.1.1 pins MuJoCo 3.3.0; m2flow runs it on its one MuJoCo (3.11.0, for
LIBERO and mjlab): the ``[metaworld]`` extra resolves Meta-World 3.0.0 (MuJoCo >= 3.0) and
``scripts/install.sh`` puts 3.1.1 over it with ``--no-deps`` (``pyproject.toml`` says why). Its
scripted experts still solve the tasks there (``tests/envs/test_metaworld.py`` on a few,
``bench/metaworld_experts.py`` on all 50).
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field, replace
from typing import List, Optional

import gymnasium as gym
import numpy as np

from m2flow import keys
from m2flow.envs.base import EnvError
from m2flow.envs.config import ProcessEnvConfig
from m2flow.envs.procs import EnvRecipe, check_processes, env_server
from m2flow.envs.vector import GymVectorEnv
from m2flow.registry import Requires, suggest

INSTRUCTIONS = {  # RLinf's metaworld_config.json, TASK_DESCRIPTIONS (see the module docstring)
    "assembly-v3": "Pick up a nut and place it onto a peg",
    "basketball-v3": "Dunk the basketball into the basket",
    "bin-picking-v3": "Grasp the puck from one bin and place it into another bin",
    "box-close-v3": "Grasp the cover and close the box with it",
    "button-press-topdown-v3": "Press a button from the top",
    "button-press-topdown-wall-v3": "Bypass a wall and press a button from the top",
    "button-press-v3": "Press a button",
    "button-press-wall-v3": "Bypass a wall and press a button",
    "coffee-button-v3": "Push a button on the coffee machine",
    "coffee-pull-v3": "Pull a mug from a coffee machine",
    "coffee-push-v3": "Push a mug under a coffee machine",
    "dial-turn-v3": "Rotate a dial 180 degrees",
    "disassemble-v3": "Pick a nut out of a peg",
    "door-close-v3": "Close a door with a revolving joint",
    "door-lock-v3": "Lock the door by rotating the lock clockwise",
    "door-open-v3": "Open a door with a revolving joint",
    "door-unlock-v3": "Unlock the door by rotating the lock counter-clockwise",
    "hand-insert-v3": "Insert the gripper into a hole",
    "drawer-close-v3": "Push and close a drawer",
    "drawer-open-v3": "Open a drawer",
    "faucet-open-v3": "Rotate the faucet counter-clockwise",
    "faucet-close-v3": "Rotate the faucet clockwise",
    "hammer-v3": "Hammer a screw on the wall",
    "handle-press-side-v3": "Press a handle down sideways",
    "handle-press-v3": "Press a handle down",
    "handle-pull-side-v3": "Pull a handle up sideways",
    "handle-pull-v3": "Pull a handle up",
    "lever-pull-v3": "Pull a lever down 90 degrees",
    "peg-insert-side-v3": "Insert a peg sideways",
    "pick-place-wall-v3": "Pick a puck, bypass a wall and place the puck",
    "pick-out-of-hole-v3": "Pick up a puck from a hole",
    "reach-v3": "Reach a goal position",
    "push-back-v3": "Push the puck to a goal",
    "push-v3": "Push the puck to a goal",
    "pick-place-v3": "Pick and place a puck to a goal",
    "plate-slide-v3": "Slide a plate into a cabinet",
    "plate-slide-side-v3": "Slide a plate into a cabinet sideways",
    "plate-slide-back-v3": "Get a plate from the cabinet",
    "plate-slide-back-side-v3": "Get a plate from the cabinet sideways",
    "peg-unplug-side-v3": "Unplug a peg sideways",
    "soccer-v3": "Kick a soccer into the goal",
    "stick-push-v3": "Grasp a stick and push a box using the stick",
    "stick-pull-v3": "Grasp a stick and pull a box with the stick",
    "push-wall-v3": "Bypass a wall and push a puck to a goal",
    "reach-wall-v3": "Bypass a wall and reach a goal",
    "shelf-place-v3": "Pick and place a puck onto a shelf",
    "sweep-into-v3": "Sweep a puck into a hole",
    "sweep-v3": "Sweep a puck off the table",
    "window-open-v3": "Push and open a window",
    "window-close-v3": "Push and close a window",
}
DIFFICULTY = {  # Seo et al. 2022's split, as RLinf's DIFFICULTY_TO_TASKS lists it
    "easy": (
        "button-press-v3", "button-press-topdown-v3", "button-press-topdown-wall-v3",
        "button-press-wall-v3", "coffee-button-v3", "dial-turn-v3", "door-close-v3",
        "door-lock-v3", "door-open-v3", "door-unlock-v3", "drawer-close-v3", "drawer-open-v3",
        "faucet-close-v3", "faucet-open-v3", "handle-press-v3", "handle-press-side-v3",
        "handle-pull-v3", "handle-pull-side-v3", "lever-pull-v3", "plate-slide-v3",
        "plate-slide-back-v3", "plate-slide-back-side-v3", "plate-slide-side-v3", "reach-v3",
        "reach-wall-v3", "window-close-v3", "window-open-v3", "peg-unplug-side-v3",
    ),
    "medium": (
        "basketball-v3", "bin-picking-v3", "box-close-v3", "coffee-pull-v3", "coffee-push-v3",
        "hammer-v3", "peg-insert-side-v3", "push-wall-v3", "soccer-v3", "sweep-v3",
        "sweep-into-v3",
    ),
    "hard": ("assembly-v3", "hand-insert-v3", "pick-out-of-hole-v3", "pick-place-v3",
             "push-v3", "push-back-v3"),
    "very_hard": ("shelf-place-v3", "disassemble-v3", "stick-pull-v3", "stick-push-v3",
                  "pick-place-wall-v3"),
}
SUITES = {  # suite -> (metaworld.env_dict attribute, its key or None, goal observable)
    "MT10": ("MT10_V3", None, True),
    "MT50": ("MT50_V3", None, True),
    "ML45-train": ("ML45_V3", "train", False),
    "ML45-test": ("ML45_V3", "test", False),
}
SUITE_SIZES = {"MT10": 10, "MT50": 50, "ML45-train": 45, "ML45-test": 5}
OBS_MODES = ("state", "rgb")
REWARD_MODES = ("sparse", "dense")
GL_BACKENDS = ("egl", "osmesa")
RENDER_QUALITIES = ("standard", "fast")
DEFAULT_MAX_STEPS = 100  # RLinf's Meta-World episodes
STATE_DIM = 39
PROPRIO_DIM = 4  # hand position (3) and gripper opening (1): the first entries of the state
ACTION_DIM = 4
RLINF_CAMERA = "corner2"
RLINF_CAMERA_POS = (0.75, 0.075, 0.7)
# imported once by the fork server of the env processes (none opens a GL context on import)
PRELOAD = ("mujoco", "metaworld", "m2flow.envs.metaworld")


@dataclass
class MetaWorldEnvConfig(ProcessEnvConfig):
    """``MetaWorld/<task or suite>``: the common settings, those of env processes, and
    Meta-World's own."""

    task_ids: Optional[List[int]] = None
    """Task indices of the suite to run (None: all); ``spec.tasks`` lists them in this order."""
    processes: bool = False
    """True: one process per env (renders on several cores); False: every env in this
    process (no messages per step)."""
    camera: str = RLINF_CAMERA
    """Meta-World camera for ``rgb``: topview, corner, corner2, corner3, corner4,
    behindGripper, gripperPOV."""
    camera_pos: Optional[List[float]] = field(default_factory=lambda: list(RLINF_CAMERA_POS))
    """Where that camera is moved to (RLinf's view); None: the camera's own position."""
    rotate_image: bool = True
    """Turn the frame 180 degrees (RLinf's view of corner2)."""
    render_quality: str = "standard"
    """'standard': Meta-World's look (4x MSAA, shadows); 'fast': neither."""
    gl: str = "egl"
    """MuJoCo's OpenGL backend: 'egl' (Mesa or GPU EGL) or 'osmesa' (software)."""
    privileged_state: bool = False
    """With ``obs_mode=rgb``, also ``("obs", "privileged")``: the 39-dim state observation."""
    goal_observable: Optional[bool] = None
    """Goal position in the state observation; None: the suite's convention (MT and one
    task: yes; ML45: no)."""
    task_one_hot: bool = False
    """Append a one-hot of the task index (over the env's tasks) to ``state``: Meta-World's
    ``use_one_hot`` (its MT benchmarks' task encoding), for a state policy without a task
    embedding of its own."""


def check_config(cfg: MetaWorldEnvConfig) -> tuple[str, int]:
    """(the task or suite of ``cfg.name``, its number of tasks); EnvError for a setting the
    adapter cannot honour. Imports no simulator."""
    what = cfg.name.split("/", 1)[1]
    if what not in SUITES and what not in INSTRUCTIONS:
        known = [*SUITES, *INSTRUCTIONS]
        raise EnvError(
            f"env.name={cfg.name!r}: Meta-World has no task or suite {what!r}; use "
            f"MetaWorld/<suite> ({', '.join(SUITES)}) or MetaWorld/<task> (e.g. "
            f"MetaWorld/reach-v3).{suggest(what, known)}")
    if cfg.obs_mode not in OBS_MODES:
        raise EnvError(f"env.obs_mode={cfg.obs_mode!r}: Meta-World gives {list(OBS_MODES)} "
                       "('rgb': camera image + proprio; 'state': its 39-dim observation).")
    if cfg.reward_mode not in (None, *REWARD_MODES):
        raise EnvError(f"env.reward_mode={cfg.reward_mode!r}: use 'sparse' (success; the "
                       "default) or 'dense' (Meta-World's shaped reward).")
    for name, value, allowed in (("gl", cfg.gl, GL_BACKENDS),
                                 ("render_quality", cfg.render_quality, RENDER_QUALITIES)):
        if value not in allowed:
            raise EnvError(f"env.{name}={value!r}: use one of {list(allowed)}.")
    if cfg.privileged_state and cfg.obs_mode == "state":
        raise EnvError("env.privileged_state=true adds the state beside camera images; with "
                       "env.obs_mode=state the policy sees it already. Set env.obs_mode=rgb "
                       "or env.privileged_state=false.")
    if cfg.camera_pos is not None and len(cfg.camera_pos) != 3:
        raise EnvError(f"env.camera_pos={list(cfg.camera_pos)}: give x, y, z (3 numbers) "
                       "or null for the camera's own position.")
    if cfg.max_episode_steps is not None and cfg.max_episode_steps < 1:
        raise EnvError(f"env.max_episode_steps={cfg.max_episode_steps}: must be >= 1 (null: "
                       f"{DEFAULT_MAX_STEPS}).")
    n = SUITE_SIZES.get(what, 1)
    ids = cfg.task_ids
    if ids is not None and (not ids or any(not 0 <= t < n for t in ids)):
        raise EnvError(f"env.task_ids={list(ids)}: {cfg.name} has tasks 0-{n - 1}; give a "
                       "non-empty list of those or null for all.")
    check_processes(cfg)
    return what, n


def suite_tasks(what: str) -> tuple[str, ...]:
    """The task names of suite ``what`` in Meta-World's order (a task name: itself)."""
    if what not in SUITES:
        return (what,)
    from metaworld import env_dict

    attr, split, _ = SUITES[what]
    table = getattr(env_dict, attr)
    return tuple((table[split] if split else table).keys())


def difficulty(task: str) -> str:
    """The task's level in Seo et al.'s split (:data:`DIFFICULTY`): easy ... very_hard."""
    return next(level for level, tasks in DIFFICULTY.items() if task in tasks)


def _gl_loaded() -> bool:
    """MuJoCo in this process renders off-screen without a display (it was imported with
    MUJOCO_GL set to egl or osmesa)."""
    from mujoco.rendering.classic import gl_context  # read MUJOCO_GL when mujoco was imported

    return gl_context._MUJOCO_GL in GL_BACKENDS


def gl_environ(gl: str) -> tuple:
    """The variables MuJoCo reads at import to pick its OpenGL backend, as (name, value)."""
    env = {"MUJOCO_GL": gl}
    if gl == "osmesa":
        env["PYOPENGL_PLATFORM"] = os.environ.get("PYOPENGL_PLATFORM", "osmesa")
    return tuple(sorted(env.items()))


def release_gl_context(renderer) -> None:
    """Leaves no EGL context current on this thread after ``renderer`` drew a frame. MuJoCo's
    renderer makes its context current before each frame and leaves it so; but a Ray actor
    runs its calls on a pool of threads (``pipelines.launch``: ``max_concurrency``), and EGL
    refuses to make a context current on one thread while it is current on another
    (``EGL_BAD_ACCESS`` from ``eglMakeCurrent``: an env built and reset in one call, then
    rendered in the next). OSMesa binds a context to any thread: nothing to do."""
    ctx = getattr(renderer, "_gl_context", None)
    if ctx is None or type(ctx).__module__ != "mujoco.egl":
        return
    import mujoco.egl as mjegl

    mjegl.EGL.eglMakeCurrent(mjegl.EGL_DISPLAY, mjegl.EGL.EGL_NO_SURFACE,
                             mjegl.EGL.EGL_NO_SURFACE, mjegl.EGL.EGL_NO_CONTEXT)


class MetaWorldEnv(GymVectorEnv):
    """``MetaWorld/<task or suite>``: ``cfg.num_envs`` envs; env i starts on task
    ``task_ids[i % len(task_ids)]`` and switches at a reset that asks for another."""

    EXAMPLE_IDS = ("MetaWorld/MT10",)
    config_class = MetaWorldEnvConfig
    requires = Requires(("metaworld", "mujoco"), "m2flow[metaworld]")

    @staticmethod
    def check_config(cfg: MetaWorldEnvConfig) -> None:
        """Raises EnvError for an unknown task or suite, or a setting out of range."""
        check_config(cfg)

    def __init__(self, cfg: MetaWorldEnvConfig, device: str = "cpu"):
        what, _ = check_config(cfg)
        environ = gl_environ(cfg.gl)
        if not cfg.processes:  # MuJoCo picks its GL backend when it is first imported
            for k, v in environ:
                os.environ.setdefault(k, v)
            if cfg.obs_mode == "rgb" and os.environ["MUJOCO_GL"] != cfg.gl:
                raise EnvError(
                    f"env.gl={cfg.gl!r}: this process has MUJOCO_GL="
                    f"{os.environ['MUJOCO_GL']!r}, which MuJoCo reads once; set MUJOCO_GL="
                    f"{cfg.gl} before starting, or env.processes=true (each env process "
                    "sets its own).")
            if cfg.obs_mode == "rgb" and "mujoco" in sys.modules and not _gl_loaded():
                raise EnvError(
                    "env.obs_mode=rgb: MuJoCo was imported in this process before MUJOCO_GL "
                    f"was set, so it cannot render headless; set MUJOCO_GL={cfg.gl} before "
                    "starting, or env.processes=true (each env process sets its own).")
        self.requires.check(cfg.name, EnvError)
        names = suite_tasks(what)
        ids = list(range(len(names))) if cfg.task_ids is None else [int(t) for t in cfg.task_ids]
        chosen = tuple(names[t] for t in ids)
        observable = cfg.goal_observable
        if observable is None:
            observable = SUITES[what][2] if what in SUITES else True
        limit = cfg.max_episode_steps or DEFAULT_MAX_STEPS
        if cfg.processes:
            env_server(PRELOAD, environ)
        make = [EnvRecipe(functools.partial(MetaWorldTaskEnv, chosen, i % len(chosen), limit,
                                            observable, cfg),
                          preload=PRELOAD, environ=environ)
                for i in range(cfg.num_envs)]
        super().__init__(make, processes=cfg.processes, max_episode_steps=limit,
                         timeout=cfg.step_timeout_s, tasks=[INSTRUCTIONS[t] for t in chosen],
                         shared_memory=cfg.shared_memory, max_restarts=cfg.max_restarts,
                         name=cfg.name)
        self.task_names = chosen
        """Meta-World's name of each task of ``spec.tasks`` (e.g. 'reach-v3')."""
        self.spec = replace(self.spec, task_groups=tuple(difficulty(t) for t in chosen),
                            task_group_order=tuple(DIFFICULTY))


class MetaWorldTaskEnv(gym.Env):
    """One Meta-World env that can switch between ``tasks`` (names):
    ``reset(options={"task": k})`` builds task k's scene; other resets keep the task."""

    def __init__(self, tasks: tuple, task: int, max_steps: int, goal_observable: bool,
                 cfg: MetaWorldEnvConfig):
        for k, v in gl_environ(cfg.gl):
            os.environ.setdefault(k, v)
        self.tasks, self.max_steps, self.cfg = tasks, max_steps, cfg
        self.goal_observable = goal_observable
        self.render_rgb = cfg.obs_mode == "rgb"
        self.sparse = cfg.reward_mode in (None, "sparse")
        self.env = self.renderer = self.task = None
        self.t = 0
        box = lambda n: gym.spaces.Box(-np.inf, np.inf, (n,), np.float32)  # noqa: E731
        spaces = {keys.leaf(keys.TASK): gym.spaces.Box(0, len(tasks) - 1, (), np.int64)}
        one_hot = len(tasks) if cfg.task_one_hot else 0
        if self.render_rgb:
            s = cfg.image_size
            spaces[keys.leaf(keys.RGB)] = gym.spaces.Box(0, 255, (s, s, 3), np.uint8)
            spaces[keys.leaf(keys.STATE)] = box(PROPRIO_DIM + one_hot)
            if cfg.privileged_state:
                spaces[keys.leaf(keys.PRIVILEGED)] = box(STATE_DIM)
        else:
            spaces[keys.leaf(keys.STATE)] = box(STATE_DIM + one_hot)
        self.observation_space = gym.spaces.Dict(spaces)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32)
        self._build(task)

    @property
    def sim(self):
        """The Meta-World env of the current task (``SawyerXYZEnv``)."""
        return self.env

    def _build(self, task: int) -> None:
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS

        self.close()
        env = ALL_V3_ENVIRONMENTS[self.tasks[task]]()
        # as metaworld._make_tasks prepares an env to draw goals, but from env.np_random
        env._freeze_rand_vec, env.seeded_rand_vec, env._set_task_called = False, True, True
        env._set_task_inner()
        if env._partially_observable == self.goal_observable:
            env._partially_observable = not self.goal_observable
            del env.sawyer_observation_space  # a cached_property of the observability
        env.max_path_length = self.max_steps  # its own step refuses to run past this
        self.env, self.task = env, task

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        task = (options or {}).get("task")
        if task is not None and task != self.task:
            if not 0 <= task < len(self.tasks):
                raise ValueError(f"task {task}: this env has tasks 0-{len(self.tasks) - 1}")
            self._build(task)
        if seed is None:  # an auto-reset: the next initial state of the seeded stream
            seed = int(self.np_random.integers(2**31))
        self.env.seed(int(seed))
        obs, _ = self.env.reset()
        self.t = 0
        return self._obs(obs), {}

    def step(self, action):
        return self._step(action, frames=True)

    def step_without_frames(self, action):
        """:meth:`step`, for a step whose frame nobody reads (a chunk's inner step): its
        ``rgb`` is black, unless the episode ends in it. The frame is rendered after the step
        from its end state, so every frame that is rendered is :meth:`step`'s."""
        return self._step(action, frames=False)

    def _step(self, action, frames: bool):
        obs, reward, _, _, info = self.env.step(np.asarray(action, dtype=np.float64))
        self.t += 1
        success = bool(info["success"])
        terminated = success and not self.cfg.ignore_terminations
        truncated = self.t >= self.max_steps and not terminated
        reward = float(success) if self.sparse else float(reward)
        return (self._obs(obs, frames or terminated or truncated), reward, terminated, truncated,
                {"success": success})

    def _obs(self, obs: np.ndarray, frame: bool = True) -> dict:
        state = obs.astype(np.float32)
        out = {keys.leaf(keys.TASK): np.int64(self.task)}
        if self.render_rgb:
            size = self.cfg.image_size
            out[keys.leaf(keys.RGB)] = (self.render_frame() if frame
                                        else np.zeros((size, size, 3), np.uint8))
            if self.cfg.privileged_state:
                out[keys.leaf(keys.PRIVILEGED)] = state
            state = state[:PROPRIO_DIM]
        if self.cfg.task_one_hot:
            state = np.concatenate([state, np.eye(len(self.tasks), dtype=np.float32)[self.task]])
        out[keys.leaf(keys.STATE)] = state.copy() if self.render_rgb else state
        return out

    def render_frame(self) -> np.ndarray:
        """The camera's (S, S, 3) uint8 frame of the current scene."""
        import mujoco

        cfg, model = self.cfg, self.env.model
        if self.renderer is None:
            if cfg.camera_pos is not None:
                model.cam_pos[model.camera(cfg.camera).id] = cfg.camera_pos
            if cfg.render_quality == "fast":
                model.vis.quality.offsamples = 0  # read when the GL context is made
            self.renderer = mujoco.Renderer(model, cfg.image_size, cfg.image_size)
        self.renderer.update_scene(self.env.data, camera=cfg.camera)
        if cfg.render_quality == "fast":
            self.renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        frame = self.renderer.render()
        release_gl_context(self.renderer)
        return np.ascontiguousarray(frame[::-1, ::-1]) if cfg.rotate_image else frame

    def close(self):
        if self.renderer is not None:
            self.renderer.close()
            self.renderer = None
        if self.env is not None:
            self.env.close()
            self.env = None
