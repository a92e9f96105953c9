"""mjlab tasks (MuJoCo Warp) as ``mjlab/<task id>``, e.g. ``mjlab/Mjlab-Cartpole-Balance``.

One ``BatchedEnv`` over mjlab's ``ManagerBasedRlEnv``: all envs are one MuJoCo Warp batch in
the env worker's own process, on the device its placement gives (``cuda:k``, or the CPU,
where Warp compiles the same kernels for the host). Observations, rewards and actions stay
torch tensors on that device through the step loop; the env worker moves them only where its
channel needs to.

Tasks: any in mjlab's registry (``mjlab.tasks.registry.list_tasks()``): Cartpole balance and
swing-up, Lift-Cube-Yam (state, ``-Rgb``, ``-Depth``), Go1/G1 velocity, ... Their robot assets
ship in the wheel; nothing is downloaded.

Observations: mjlab's ``actor`` group is ``("obs", "state")`` (its noise included: the
policy's view); with ``env.privileged_state=true`` its ``critic`` group (noise-free, and for
Lift-Cube-Rgb the cube's pose) is ``("obs", "privileged")`` for
``policy.critic=privileged``. ``env.obs_mode=rgb`` or ``depth`` needs a task with a
camera group (``-Rgb``/``-Depth``): ``("obs", "rgb")`` (S, S, 3) uint8 or ``("obs", "depth")``
(S, S, 1) float32 in [0, 1] (mjlab's normalised depth), S = ``env.image_size``, rendered by
MuJoCo Warp's batch renderer.

Episodes: mjlab runs with ``auto_reset=False``, so a step returns the true final
observation; envs that ended are then reset with ``reset(env_ids=...)`` (mjlab's own manual
loop) and their first observation goes under the root ``"obs"`` (m2flow's auto-reset
contract). mjlab's terminations are ``terminated`` and its time-outs ``truncated`` (both
``terminated`` for a finite-horizon task). ``env.ignore_terminations=true`` drops every
termination term but the time-out. ``env.max_episode_steps`` sets mjlab's
``episode_length_s``.

Success: the task's command term's ``compute_success()`` (Lift-Cube: the cube within the
threshold of its goal) at each step; the env worker turns it into success at any step and at
the episode's end. A task without one (Cartpole, locomotion) reports False.

Seeds: mjlab seeds the process's global RNGs (torch, numpy, random, Warp), not an env. A
seeded ``reset(seed)`` resets env i alone after seeding with ``seed[i]``, so an env's initial
state depends on its seed only and envs given one seed (a GRPO group) start alike; that is
one mjlab reset per env (``env.seeded_resets=per_env``). ``batch`` resets all envs at
once after seeding with the first seed: one call, reproducible, but equal seeds do not give
equal states. Unseeded resets (the auto-resets) draw from the RNG stream.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.envs.base import BatchedEnv, EnvError, EnvSpec
from m2flow.envs.config import EnvConfig
from m2flow.registry import Requires, suggest

log = logging.getLogger(__name__)

PREFIX = "mjlab/"
ACTOR, CRITIC = "actor", "critic"
IMAGE_MODES = ("rgb", "depth")
OBS_MODES = ("state",) + IMAGE_MODES
SEEDED_RESETS = ("per_env", "batch")


@dataclass
class MjlabEnvConfig(EnvConfig):
    """``mjlab/<task>``: the common settings and mjlab's own."""

    privileged_state: bool = False
    """Also return the task's ``critic`` observation group (noise-free; for Lift-Cube-Rgb the
    cube's pose) as ``("obs", "privileged")``, for a critic only (``policy.critic=privileged``)."""
    seeded_resets: str = "per_env"
    """'per_env': a seeded reset resets each env alone after seeding with its seed (its state
    is a function of its seed; one mjlab reset per env); 'batch': one reset of all envs after
    seeding with the first seed (fast for thousands of GPU envs; equal seeds give different
    states, so not for GRPO groups)."""
    build_seed: int = 0
    """Seeds the RNGs before the env is built (mjlab's start-up randomisation)."""
    play: bool = False
    """mjlab's 'play' variant of the task (no observation noise, no curriculum)."""


def task_config(cfg: MjlabEnvConfig):
    """The task's mjlab env config (a fresh copy), or one EnvError line: mjlab missing, an
    unknown task, an obs mode the task cannot give, a setting mjlab tasks do not have."""
    task = cfg.name[len(PREFIX):]
    MjlabEnv.requires.check(f"env.name={cfg.name!r}", EnvError)
    with warnings.catch_warnings():  # mjlab's math module decorates with torch.jit.script,
        warnings.simplefilter("ignore", FutureWarning)  # which torch 2.14 deprecates
        import mjlab.tasks  # noqa: F401  (registers the tasks)
    from mjlab.tasks.registry import list_tasks, load_env_cfg

    if task not in list_tasks():
        raise EnvError(f"env.name={cfg.name!r}: mjlab has no task {task!r}."
                       f"{suggest(task, list_tasks())}")
    if cfg.seeded_resets not in SEEDED_RESETS:
        raise EnvError(f"env.seeded_resets={cfg.seeded_resets!r}: use one of "
                       f"{list(SEEDED_RESETS)}.")
    env_cfg = load_env_cfg(task, play=cfg.play)
    if cfg.obs_mode not in OBS_MODES:
        raise EnvError(f"env.obs_mode={cfg.obs_mode!r}: mjlab tasks give {list(OBS_MODES)}.")
    if cfg.obs_mode in IMAGE_MODES and _camera_group(env_cfg, cfg.obs_mode) is None:
        variants = [t for t in list_tasks() if t.startswith(task) and t != task]
        hint = f" such as {variants[0]!r}" if variants else ""
        raise EnvError(f"env.obs_mode={cfg.obs_mode}: mjlab task {task!r} has no "
                       f"{cfg.obs_mode} camera; use env.obs_mode=state or a task with one{hint}.")
    if ACTOR not in env_cfg.observations:
        raise EnvError(f"env.name={cfg.name!r}: the task has no {ACTOR!r} observation group "
                       f"(groups: {sorted(env_cfg.observations)}); m2flow reads that one.")
    if cfg.privileged_state and CRITIC not in env_cfg.observations:
        raise EnvError(f"env.privileged_state=true: mjlab task {task!r} has no {CRITIC!r} "
                       "observation group; set env.privileged_state=false.")
    for name, value in (("control_mode", cfg.control_mode), ("reward_mode", cfg.reward_mode)):
        if value is not None:
            raise EnvError(f"env.{name}={value!r}: an mjlab task fixes its {name.split('_')[0]}; "
                           f"set env.{name}=null.")
    if cfg.sim_backend not in ("auto", "cpu", "gpu"):
        raise EnvError(f"env.sim_backend={cfg.sim_backend!r}: use 'cpu', 'gpu' or 'auto'.")
    return env_cfg


def _camera_group(env_cfg, mode: str) -> Optional[str]:
    """The observation group whose terms are camera images of ``mode`` (mjlab's vision tasks
    call it 'camera'), or None."""
    for group, group_cfg in env_cfg.observations.items():
        names = list(group_cfg.terms)
        if names and all(n.endswith(f"_{mode}") for n in names):
            return group
    return None


def _device(cfg: MjlabEnvConfig, device: str) -> str:
    if cfg.sim_backend == "cpu":
        return "cpu"
    if cfg.sim_backend == "gpu" or device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise EnvError("env.sim_backend='gpu' but this machine has no CUDA device; set "
                           "env.sim_backend=cpu (or auto).")
        return device if device.startswith("cuda") else "cuda:0"
    return "cpu"


class MjlabEnv(BatchedEnv):
    """Adapter for ``mjlab/<task>`` (see the module docstring)."""

    EXAMPLE_IDS = ("mjlab/Mjlab-Cartpole-Balance",)  # the registry sweep's pick
    episode_clocks = True
    config_class = MjlabEnvConfig
    requires = Requires(("mjlab", "mujoco_warp", "warp"), "m2flow[mjlab]")

    @staticmethod
    def check_config(cfg: MjlabEnvConfig):
        """Raises EnvError for what the adapter cannot build; builds nothing."""
        return task_config(cfg)

    def __init__(self, cfg: MjlabEnvConfig, device: str = "cpu"):
        env_cfg = task_config(cfg)
        self.seeded_resets = cfg.seeded_resets
        from mjlab.envs import ManagerBasedRlEnv
        from mjlab.tasks.registry import load_rl_cfg
        from mjlab.utils.random import seed_rng

        self.seed_rng = seed_rng
        env_cfg.scene.num_envs = cfg.num_envs
        env_cfg.auto_reset = False
        env_cfg.seed = None  # seeded here, not in mjlab's constructor (it would print)
        step_dt = env_cfg.sim.mujoco.timestep * env_cfg.decimation
        if cfg.max_episode_steps:  # mjlab: ceil(episode_length_s / step_dt) steps
            env_cfg.episode_length_s = (cfg.max_episode_steps - 0.5) * step_dt
        if cfg.ignore_terminations:
            env_cfg.terminations = {k: t for k, t in env_cfg.terminations.items() if t.time_out}
        self.image_group = None
        if cfg.obs_mode in IMAGE_MODES:
            self.image_group = _camera_group(env_cfg, cfg.obs_mode)
            _set_image_size(env_cfg, cfg.image_size)
        self.finite_horizon = bool(env_cfg.is_finite_horizon)
        self.obs_mode, self.privileged = cfg.obs_mode, cfg.privileged_state
        import warp as wp

        wp.config.log_level = wp.LOG_WARNING  # no line per compiled kernel module
        dev = _device(cfg, device)
        log.info("mjlab: building %s, %d envs on %s (MuJoCo Warp compiles its kernels on first "
                 "use, about a minute on a CPU; cached in %s)", cfg.name, cfg.num_envs, dev,
                 wp.config.kernel_cache_dir or "Warp's kernel cache")
        seed_rng(cfg.build_seed)
        with _quiet_mjlab():
            self.env = ManagerBasedRlEnv(env_cfg, device=dev)
        self.num_envs = cfg.num_envs
        self.device = torch.device(self.env.device)
        self._success = _success_term(self.env)
        clip = load_rl_cfg(cfg.name[len(PREFIX):]).clip_actions
        obs, _ = self.env.reset()
        shapes = {k: tuple(v.shape[1:]) for k, v in self._obs(obs).items()}
        act_dim = int(self.env.action_manager.total_action_dim)
        bound = float(clip) if clip is not None else math.inf
        self.spec = EnvSpec(obs_shapes=shapes, action_dim=act_dim,
                            action_low=(-bound,) * act_dim, action_high=(bound,) * act_dim,
                            max_episode_steps=int(self.env.max_episode_length))

    # -- BatchedEnv ------------------------------------------------------------------------
    def reset(self, seed: Optional[Sequence[int]] = None, *, rebuild: bool = False) -> TensorDict:
        """Resets every env (see the module docstring for seeds). ``rebuild`` changes nothing:
        an mjlab reset rewrites the whole state of the envs it resets."""
        if seed is None:
            obs, _ = self.env.reset()
        elif self.seeded_resets == "batch" or self.num_envs == 1:
            self.seed_rng(int(seed[0]))
            obs, _ = self.env.reset()
        else:
            if len(seed) != self.num_envs:
                raise ValueError(f"reset got {len(seed)} seeds for {self.num_envs} envs")
            for i, s in enumerate(seed):
                self.seed_rng(int(s))
                obs, _ = self.env.reset(env_ids=torch.tensor([i], device=self.device))
        return TensorDict({keys.OBS: self._obs(obs)}, batch_size=[self.num_envs],
                          device=self.device)

    def step(self, action: torch.Tensor) -> TensorDict:
        action = self.clip_action(action.to(self.device, torch.float32))
        obs, reward, terminated, time_outs, _ = self.env.step(action)
        # copies: mjlab rewrites these buffers in place at its next step
        reward = reward.float().clone()
        terminated, time_outs = terminated.bool().clone(), time_outs.bool().clone()
        if self.finite_horizon:  # the time limit ends the task: no value beyond it
            terminated, time_outs = terminated | time_outs, torch.zeros_like(time_outs)
        done = terminated | time_outs
        success = self._success() if self._success else torch.zeros_like(done)
        final = self._obs(obs)
        first = final
        ended = done.nonzero().flatten()
        if len(ended):
            fresh, _ = self.env.reset(env_ids=ended)
            first = final.clone()
            first[ended] = self._obs(fresh)[ended]
        return TensorDict(
            {
                keys.OBS: first,
                keys.NEXT_OBS: final,
                keys.REWARD: reward,
                keys.TERMINATED: terminated,
                keys.TRUNCATED: time_outs,
                keys.DONE: done,
                keys.SUCCESS: success.bool(),
            },
            batch_size=[self.num_envs],
            device=self.device,
        )

    def start_episodes_at(self, steps: torch.Tensor) -> None:
        """mjlab counts each env's steps in ``episode_length_buf`` and times it out at
        ``max_episode_length`` (rsl-rl's ``init_at_random_ep_len`` sets the same buffer)."""
        buf = self.env.episode_length_buf
        buf[:] = steps.to(device=buf.device, dtype=buf.dtype)

    def close(self) -> None:
        self.env.close()

    # -- helpers ---------------------------------------------------------------------------
    def _obs(self, obs: dict) -> TensorDict:
        """mjlab's observation groups as m2flow's obs keys (new tensors: mjlab's buffers are
        rewritten by the next step)."""
        out = {keys.leaf(keys.STATE): obs[ACTOR].float().clone()}
        if self.privileged:
            out[keys.leaf(keys.PRIVILEGED)] = obs[CRITIC].float().clone()
        if self.image_group is not None:
            image = obs[self.image_group].permute(0, 2, 3, 1)  # (N, C, H, W) -> (N, H, W, C)
            if self.obs_mode == "rgb":  # mjlab gives uint8 / 255: this is lossless
                out[keys.leaf(keys.RGB)] = (image * 255).round().to(torch.uint8)
            else:
                out[keys.leaf(keys.DEPTH)] = image.float().contiguous()
        return TensorDict(out, batch_size=[self.num_envs], device=self.device)


def _set_image_size(env_cfg, size: int) -> None:
    from mjlab.sensor import CameraSensorCfg

    for sensor in env_cfg.scene.sensors or ():
        if isinstance(sensor, CameraSensorCfg):
            sensor.height = sensor.width = int(size)


def _success_term(env):
    """The per-step success of the task's command term (``compute_success``), or None."""
    manager = env.command_manager
    for name in getattr(manager, "active_terms", None) or []:
        term = manager.get_term(name)
        if hasattr(term, "compute_success"):
            return term.compute_success
    return None


@contextlib.contextmanager
def _quiet_mjlab():
    """mjlab prints tables of its managers while it builds an env; they go to the debug log
    instead of the run's console."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        yield
    log.debug("%s", buf.getvalue())
