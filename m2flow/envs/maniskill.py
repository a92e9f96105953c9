"""ManiSkill3 tasks as ``ManiSkill/<task id>``, e.g. ``ManiSkill/PushCube-v1``.

Task: any registered ManiSkill3 task whose assets are on this machine (PushCube, PickCube,
StackCube, PullCube, PegInsertionSide, ... need none).
Observations: ``("obs", "state")`` (D,) float32; with ``obs_mode=rgb`` also ``("obs", "rgb")``
(H, W, 3) uint8 from the task's camera (``image_size`` square) and ``state`` without the
privileged object poses ManiSkill keeps out of image modes; with ``privileged_state`` also
``("obs", "privileged")`` (P,) float32, the simulator's full state, for a critic only.
Actions: the controller's normalised Box (``control_mode``; e.g. 4 for pd_ee_delta_pos).
Success: the task's own ``evaluate()["success"]``; an episode terminates on success unless
``ignore_terminations`` (then it runs to the time limit).

Backends: on CPU (``sim_backend=cpu``) each env is one SAPIEN process (or
``envs_per_process`` envs to a process), forked from a server that has imported torch, SAPIEN
and ManiSkill once for all of them (:data:`PRELOAD`); on GPU (``sim_backend=gpu``) all envs
are one native GPU batch.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import gymnasium as gym
import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.envs.base import BatchedEnv, EnvError, EnvSpec
from m2flow.envs.config import ProcessEnvConfig
from m2flow.envs.procs import EnvRecipe, check_processes, env_server
from m2flow.registry import Requires, suggest
from m2flow.envs.vector import GymVectorEnv

log = logging.getLogger(__name__)

OBS_MODES = {"state": "state", "rgb": "rgb"}  # m2flow obs_mode -> ManiSkill obs_mode
RENDER_BACKENDS = ("auto", "none", "cpu", "gpu")
REBUILD = {"reconfigure": True}  # rebuilds the SAPIEN scene: PhysX state does not survive
# imported once by the fork server of the CPU env processes (none starts a renderer, a thread
# or CUDA on import); each process then imports only what its task adds
PRELOAD = (
    "torch", "sapien", "mani_skill.envs", "mani_skill.utils.wrappers.gymnasium",
    "mani_skill.utils.wrappers.flatten", "m2flow.envs.maniskill",
)


@dataclass
class ManiSkillEnvConfig(ProcessEnvConfig):
    """``ManiSkill/<task>``: the common settings, those of one process per env (the CPU
    backend), and ManiSkill's own."""

    render_backend: str = "auto"
    """'none', 'cpu' or 'gpu'; 'auto': none for state obs, else gpu if present, else cpu."""
    visual_mesh_fraction: float = 1.0
    """Fraction of the visual-mesh triangles kept when a CPU renders: 1.0 draws the published
    meshes; 0.05 draws 5 % of the robot's, for many more env steps/s through software Vulkan
    at a small change of the image (``m2flow.envs.meshes``). Physics is unchanged. The GPU
    backend always renders the published meshes."""
    privileged_state: bool = False
    """Also return ``("obs", "privileged")``, the simulator's full state (every actor's pose
    and velocities, the robot's joints: ManiSkill's ``get_state()``), for an asymmetric critic
    (``policy=cnn`` with ``policy.critic=privileged``); no actor reads it, so the policy still
    acts from what the camera and proprio show."""
    make_args: Dict[str, Any] = field(default_factory=dict)
    """More keyword arguments of the task's ``gym.make`` (e.g. ``robot_uids``)."""
    envs_per_process: int = 0
    """CPU backend: envs one simulator process holds and steps one after another. 0 (the
    default): one process per CPU core, the envs shared out among them; 1: a process per env,
    stepped in parallel across cores. Where the envs outnumber the cores (16 on 2), a few
    processes of several envs each spend less of a step on messages and context switches
    (bench/README.md#envs_per_processpy). Every env steps as it would alone (its episodes
    drawn from its own seeds); a crashed process discards all of its envs' episodes."""


class ManiSkillEnv(BatchedEnv):
    """Adapter for ``ManiSkill/<task>``; picks the CPU or GPU backend from ``cfg`` and device."""

    EXAMPLE_IDS = ("ManiSkill/PushCube-v1", "ManiSkill/PickCube-v1")  # the registry sweep's picks
    config_class = ManiSkillEnvConfig
    requires = Requires(("mani_skill", "sapien"), "m2flow[maniskill]")

    @staticmethod
    def check_config(cfg: ManiSkillEnvConfig):
        """Raises EnvError for an unknown task, missing assets or an unsupported obs mode."""
        spec = _registered_task(cfg.name.split("/", 1)[1], cfg.name)
        if cfg.obs_mode not in OBS_MODES:
            raise EnvError(
                f"env.obs_mode={cfg.obs_mode!r}: the ManiSkill adapter renders "
                f"{sorted(OBS_MODES)}; pick one of those."
            )
        if cfg.render_backend not in RENDER_BACKENDS:
            raise EnvError(
                f"env.render_backend={cfg.render_backend!r}: must be one of "
                f"{', '.join(RENDER_BACKENDS)}; 'auto' renders only for image obs modes."
            )
        check_processes(cfg)
        if cfg.envs_per_process < 0:
            raise EnvError(f"env.envs_per_process={cfg.envs_per_process}: must be >= 0; give "
                           "the envs one simulator process steps (1: a process per env; 0: "
                           "one process per CPU core, the envs shared out among them).")
        if not 0.0 < cfg.visual_mesh_fraction <= 1.0:
            raise EnvError(
                f"env.visual_mesh_fraction={cfg.visual_mesh_fraction!r}: keep a fraction of "
                "the visual-mesh triangles in (0, 1]; 1.0 renders the published meshes."
            )
        if cfg.visual_mesh_fraction < 1.0:  # m2flow.envs.meshes simplifies them
            Requires(("fast_simplification",), "m2flow[maniskill]").check(
                f"env.visual_mesh_fraction={cfg.visual_mesh_fraction!r}", EnvError)
        if cfg.privileged_state and cfg.obs_mode == "state":
            raise EnvError(
                "env.privileged_state=true adds the simulator state beside camera images; with "
                "env.obs_mode=state the policy sees that state already. Set env.obs_mode=rgb "
                "or env.privileged_state=false."
            )
        rewards = getattr(spec.cls, "SUPPORTED_REWARD_MODES", None)
        if cfg.reward_mode is not None and rewards and cfg.reward_mode not in rewards:
            raise EnvError(
                f"env.reward_mode={cfg.reward_mode!r}: {cfg.name} has reward modes "
                f"{list(rewards)}; pick one of those (or null for the task's default)."
            )
        controls = _control_modes(spec, cfg.make_args.get("robot_uids"))
        if cfg.control_mode is not None and controls and cfg.control_mode not in controls:
            raise EnvError(
                f"env.control_mode={cfg.control_mode!r}: the robot of {cfg.name} has "
                f"controllers {controls}; pick one of those (or null for its default)."
            )
        return spec

    def __init__(self, cfg: ManiSkillEnvConfig, device: str = "cpu"):
        task = cfg.name.split("/", 1)[1]
        backend = _sim_backend(cfg.sim_backend, device)
        if backend == "cpu":
            env_server(PRELOAD)  # its imports overlap ours (check_config imports ManiSkill)
        spec = self.check_config(cfg)
        limit = cfg.max_episode_steps or spec.max_episode_steps
        kw = dict(
            obs_mode=OBS_MODES[cfg.obs_mode],
            render_backend=_render_backend(cfg, backend),
            max_episode_steps=limit,
            **({"control_mode": cfg.control_mode} if cfg.control_mode else {}),
            **({"reward_mode": cfg.reward_mode} if cfg.reward_mode else {}),
            **(
                {"sensor_configs": dict(width=cfg.image_size, height=cfg.image_size)}
                if cfg.obs_mode != "state"
                else {}
            ),
            **dict(cfg.make_args),
        )
        if backend == "cpu":
            fraction = _mesh_fraction(cfg, kw["render_backend"])
            make = EnvRecipe(
                functools.partial(_make_cpu_env, task, cfg.obs_mode, cfg.ignore_terminations, kw,
                                  fraction, cfg.privileged_state, own_process=True),
                preload=PRELOAD,
            )
            self._impl: BatchedEnv = GymVectorEnv(
                [make] * cfg.num_envs, processes=True, max_episode_steps=limit,
                rebuild_options=REBUILD, timeout=cfg.step_timeout_s,
                shared_memory=cfg.shared_memory, max_restarts=cfg.max_restarts,
                envs_per_process=cfg.envs_per_process,
                name=cfg.name,
            )
        else:
            if cfg.visual_mesh_fraction < 1.0 and cfg.obs_mode != "state":
                log.warning("env.visual_mesh_fraction=%s is for CPU rendering; the GPU backend "
                            "renders the published meshes.", cfg.visual_mesh_fraction)
            self._impl = _ManiSkillGPU(task, cfg, kw, device, limit)
        self.num_envs, self.spec, self.device = cfg.num_envs, self._impl.spec, self._impl.device
        self.steps_in_background = self._impl.steps_in_background

    def reset(self, seed: Optional[Sequence[int]] = None, *, rebuild: bool = False) -> TensorDict:
        return self._impl.reset(seed, rebuild=rebuild)

    def step(self, action: torch.Tensor) -> TensorDict:
        return self._impl.step(action)

    def reset_async(self, seed: Optional[Sequence[int]] = None, *,
                    rebuild: bool = False) -> None:
        self._impl.reset_async(seed, rebuild=rebuild)

    def reset_wait(self) -> TensorDict:
        return self._impl.reset_wait()

    def step_async(self, action: torch.Tensor) -> None:
        self._impl.step_async(action)

    def step_wait(self) -> TensorDict:
        return self._impl.step_wait()

    def close(self) -> None:
        self._impl.close()


def _control_modes(spec, robot_uids=None) -> list:
    """The control modes of the task's robot, read from its agent class without building
    the task; [] when they cannot be known that way (then the simulator checks)."""
    import inspect

    from mani_skill.agents.registration import REGISTERED_AGENTS

    if robot_uids is None:
        param = inspect.signature(spec.cls.__init__).parameters.get("robot_uids")
        robot_uids = None if param is None else param.default
    if not isinstance(robot_uids, str) or robot_uids not in REGISTERED_AGENTS:
        return []
    agent = REGISTERED_AGENTS[robot_uids].agent_cls
    try:  # a property reading class attributes only, for most robots
        return list(agent._controller_configs.fget(agent))
    except Exception:  # noqa: BLE001 - a robot whose controllers need an instance
        return []


def _registered_task(task: str, name: str):
    import mani_skill.envs  # noqa: F401  (registers the tasks)
    from mani_skill.utils import assets
    from mani_skill.utils.registration import REGISTERED_ENVS

    if task not in REGISTERED_ENVS:
        raise EnvError(
            f"env.name={name!r}: ManiSkill has no task {task!r}."
            f"{suggest(task, sorted(REGISTERED_ENVS))}"
        )
    spec = REGISTERED_ENVS[task]
    missing = []
    for asset_id in spec.asset_download_ids or []:
        ids = (
            assets.expand_data_group_into_individual_data_source_ids(asset_id)
            if asset_id in assets.DATA_GROUPS
            else [asset_id]
        )
        missing += [i for i in ids if not assets.is_data_source_downloaded(i)]
    if missing:
        raise EnvError(
            f"env.name={name!r}: ManiSkill task {task!r} needs assets that are not on this "
            f"machine ({', '.join(sorted(set(missing)))}). Download them first with "
            f"`python -m mani_skill.utils.download_asset {task}`, or pick a task without "
            "assets such as ManiSkill/PushCube-v1."
        )
    return spec


def _sim_backend(requested: str, device: str) -> str:
    if requested == "auto":
        return "gpu" if device.startswith("cuda") else "cpu"
    if requested not in ("cpu", "gpu"):
        raise EnvError(f"env.sim_backend={requested!r}: use 'cpu', 'gpu' or 'auto'.")
    if requested == "gpu" and not torch.cuda.is_available():
        raise EnvError(
            "env.sim_backend='gpu' but this machine has no CUDA device; set env.sim_backend=cpu "
            "(or auto)."
        )
    return requested


def _mesh_fraction(cfg: ManiSkillEnvConfig, render_backend: str) -> float:
    """``env.visual_mesh_fraction`` where a CPU renders (lavapipe), else 1.0: a GPU draws the
    published meshes at no cost worth saving (and state obs render nothing)."""
    if render_backend == "cpu":
        return cfg.visual_mesh_fraction
    if render_backend == "gpu" and cfg.visual_mesh_fraction < 1.0:
        log.warning("env.visual_mesh_fraction=%s is for CPU rendering; rendering on the GPU "
                    "draws the published meshes.", cfg.visual_mesh_fraction)
    return 1.0


def enable_gpu_physx() -> None:
    """Loads SAPIEN's GPU PhysX (``physx_cuda``) or raises one EnvError line saying how to get it.
    SAPIEN fetches ``libPhysXGpu_64.so`` from GitHub at first use, which fails on a machine
    without network (seen on the GPU machine of scripts/gpu_check.sh)."""
    import sapien

    try:
        sapien.physx.enable_gpu()
    except Exception as e:  # requests' ConnectionError, a bad zip, a failed dlopen
        version = sapien.physx.version()
        where = Path.home() / ".sapien" / "physx" / version
        url = ("https://github.com/sapien-sim/physx-precompiled/releases/download/"
               f"{version}/linux-so.zip")
        raise EnvError(
            f"env.sim_backend=gpu: SAPIEN's GPU PhysX library could not be loaded "
            f"({type(e).__name__}); SAPIEN downloads libPhysXGpu_64.so from GitHub on first "
            f"use: unzip {url} into {where} (on a machine without network, copy it there), "
            "or set env.sim_backend=cpu."
        ) from None


def _render_backend(cfg: ManiSkillEnvConfig, sim_backend: str) -> str:
    if cfg.render_backend != "auto":
        return cfg.render_backend
    if cfg.obs_mode == "state":
        return "none"  # nothing to render: no Vulkan device needed
    return "gpu" if sim_backend == "gpu" else "cpu"


def _make_cpu_env(task: str, obs_mode: str, ignore_terminations: bool, kw: dict,
                  visual_mesh_fraction: float = 1.0, privileged: bool = False, *,
                  own_process: bool = False) -> gym.Env:
    """Runs in a subprocess: one single-env ManiSkill task with numpy, unbatched I/O.
    ``own_process``: the process holds only envs of this config (an env server's), so it may
    keep a render material for its life (:func:`_keep_a_render_material`)."""
    import mani_skill.envs  # noqa: F401
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    torch.set_num_threads(1)  # one core per env process; the placement counts them
    if own_process and kw.get("render_backend") == "none":
        _keep_a_render_material()
    # an auto-reset (no seed) draws its episode from this env's own seed stream, not from the
    # process's torch generator, which every env of a process would share
    kw = {"enhanced_determinism": True, **kw}
    env = FreshResetContacts(gym.make(task, num_envs=1, sim_backend="physx_cpu", **kw))
    if visual_mesh_fraction < 1.0:
        from m2flow.envs import meshes

        meshes.install(env, visual_mesh_fraction)
    return CPUGymWrapper(_flatten(env, obs_mode, privileged),
                         ignore_terminations=ignore_terminations)


_RENDER_MATERIALS: list = []  # this process's kept material (see _keep_a_render_material)


def _keep_a_render_material() -> None:
    """Keeps one SAPIEN render material alive for the life of this process.

    Without a render device (``render_backend='none'``, state observations) SAPIEN sets up
    its material resources whenever a material is made while none is alive, and frees them
    with the last one. A scene rebuild (every evaluation reset, ``runner.exact_resets``)
    frees the old scene's materials, and PushCube's cube and goal then pay that set-up for
    each of their three materials, in every env; with one material kept they reuse it
    (``bench/rebuild.py``). Nothing is rendered either way; but the kept material holds
    SAPIEN to no render device, and a renderer on a device fails in that process afterwards
    ("only supports single-GPU rendering"): only processes of envs that never render keep one."""
    if not _RENDER_MATERIALS:
        import sapien

        _RENDER_MATERIALS.append(sapien.render.RenderMaterial())


class FreshResetContacts(gym.Wrapper):
    """A reset's observation from the new episode's contacts, not the last episode's.

    ManiSkill computes the observation a reset returns from the PhysX contacts of the last
    simulation step, which on the CPU are those of the previous episode's end: a reset after
    an episode that ended holding the cube reports PickCube's ``is_grasped`` as 1 (any
    observation read from contact forces is stale so). A policy cloned from demonstrations,
    whose episodes all began with fresh contacts, then acts as if it held the cube: with
    ``runner.rollout_steps`` x chunk equal to the episode length, every other iteration's
    episodes began that way (the auto-reset at the episode's end, then the iteration's own
    reset, with no step between). So after a reset that follows a step, this wrapper steps
    the physics once for the contacts of the reset state, puts the state back
    (``px.pack``/``unpack``: every pose, velocity and joint state) and takes the
    observation again. A reset with no step since the scene was built (the first one, or
    one that rebuilds it) has no stale contacts and is left alone."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self._stepped = False

    def step(self, action):
        self._stepped = True
        return self.env.step(action)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        rebuilt = bool((kwargs.get("options") or {}).get("reconfigure", False))
        if self._stepped and not rebuilt:
            base = self.env.unwrapped
            px = base.scene.px
            state = px.pack()
            px.step()
            px.unpack(state)
            info = base.get_info()
            obs = base.get_obs(info)
        self._stepped = False
        return obs, info


def _flatten(env: gym.Env, obs_mode: str, privileged: bool = False) -> gym.Env:
    if obs_mode == "state":
        return env
    from mani_skill.utils.wrappers.flatten import FlattenRGBDObservationWrapper

    env = FlattenRGBDObservationWrapper(env, rgb=True, depth=False, state=True)
    return PrivilegedState(env) if privileged else env


class PrivilegedState(gym.ObservationWrapper):
    """Adds ``privileged``: the simulator's flat state (ManiSkill's ``get_state()``: every
    actor's pose and velocities, each articulation's root pose, joint positions and
    velocities), (num_envs, P) float32, to the flattened rgb observations."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        base = env.unwrapped
        base.update_obs_space(self.observation(dict(base._init_raw_obs)))

    def observation(self, observation: dict) -> dict:
        return {**observation, keys.leaf(keys.PRIVILEGED): self.env.unwrapped.get_state().float()}


class _ManiSkillGPU(BatchedEnv):
    """All envs in one GPU-simulated ManiSkill batch (needs CUDA)."""

    def __init__(self, task: str, cfg: ManiSkillEnvConfig, kw: dict, device: str, limit):
        import mani_skill.envs  # noqa: F401
        from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

        sim = "physx_cuda" if device == "cuda" else device.replace("cuda", "physx_cuda")
        enable_gpu_physx()
        env = gym.make(task, num_envs=cfg.num_envs, sim_backend=sim, **kw)
        self.vec = ManiSkillVectorEnv(
            _flatten(env, cfg.obs_mode, cfg.privileged_state), auto_reset=True,
            ignore_terminations=cfg.ignore_terminations,
        )
        self.num_envs = cfg.num_envs
        self.device = self.vec.device
        obs_space = self.vec.single_observation_space
        shapes = (
            {k: tuple(s.shape) for k, s in obs_space.spaces.items()}
            if isinstance(obs_space, gym.spaces.Dict)
            else {keys.leaf(keys.STATE): tuple(obs_space.shape)}
        )
        act = self.vec.single_action_space
        self.spec = EnvSpec(
            obs_shapes=shapes,
            action_dim=int(act.shape[0]),
            action_low=tuple(float(x) for x in act.low),
            action_high=tuple(float(x) for x in act.high),
            max_episode_steps=limit,
        )

    def reset(self, seed: Optional[Sequence[int]] = None, *, rebuild: bool = False) -> TensorDict:
        """Resets every env; envs given one seed (a GRPO group) start from one state."""
        seeds = None if seed is None else [int(s) for s in seed]
        obs, _ = self.vec.reset(seed=seeds, options=REBUILD if rebuild else None)
        if seeds is not None:
            obs = share_leader_states(self.vec, group_leaders(seeds), obs)
        return TensorDict({keys.OBS: self._obs(obs)}, batch_size=[self.num_envs])

    def step(self, action: torch.Tensor) -> TensorDict:
        obs, reward, terminated, truncated, info = self.vec.step(
            self.clip_action(action.to(self.device))
        )
        done = terminated | truncated
        final_obs = info.get("final_observation", obs)
        final_info = info.get("final_info", info)
        success = final_info.get("success", torch.zeros_like(done))
        return TensorDict(
            {
                keys.OBS: self._obs(obs),
                keys.NEXT_OBS: self._obs(final_obs),
                keys.REWARD: reward.float(),
                keys.TERMINATED: terminated.bool(),
                keys.TRUNCATED: truncated.bool(),
                keys.DONE: done.bool(),
                keys.SUCCESS: success.bool(),
            },
            batch_size=[self.num_envs],
            device=self.device,
        )

    def close(self) -> None:
        self.vec.close()

    def _obs(self, obs) -> TensorDict:
        if isinstance(obs, dict):
            return TensorDict(dict(obs), batch_size=[self.num_envs])
        return TensorDict({keys.leaf(keys.STATE): obs.float()}, batch_size=[self.num_envs])


# -- one initial state per seed on the GPU backend -------------------------------------------
# ManiSkill's GPU reset seeds torch with the FIRST seed of the list and draws the initial
# states of the whole batch at once (BaseEnv.reset: ``torch.manual_seed(self._episode_seed[0])``
# then ``_initialize_episode(env_idx)``), so envs given the same seed start from different
# states; on the CPU backend each env is its own process seeded with its own seed, and equal
# seeds do give equal states. To keep that meaning on the GPU, after the reset every env takes
# the simulator state of the first env with its seed (its group's leader), through ManiSkill's
# own partial reset to given states (``options["reset_to_env_states"]``), which also recomputes
# the observations. This holds within one GPU batch: a group split over two env groups
# (``staging.env_groups``) gets one state per part.


def group_leaders(seeds: Sequence[int]) -> list[int]:
    """For each env, the index of the first env given the same seed (its group's leader).

    >>> group_leaders([7, 7, 3, 3, 7, 5])
    [0, 0, 2, 2, 0, 5]
    """
    first: dict[int, int] = {}
    return [first.setdefault(int(s), i) for i, s in enumerate(seeds)]


def gather_rows(tree, index: torch.Tensor):
    """Rows ``index`` of every tensor in a nested dict (a ManiSkill state dict, (N, D) each).

    >>> gather_rows({"actors": {"cube": torch.arange(6).view(3, 2)}}, torch.tensor([2, 0]))
    {'actors': {'cube': tensor([[4, 5],
            [0, 1]])}}
    """
    if isinstance(tree, dict):
        return {k: gather_rows(v, index) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor) and tree.dim() > 0:
        return tree[index.to(tree.device)]
    return tree  # not per env


def share_leader_states(vec, leaders: list[int], obs):
    """Sets every env whose leader is another env to that leader's simulator state (one partial
    reset of those envs); returns the observations of all envs afterwards (``obs`` when every
    env leads itself)."""
    followers = [i for i, lead in enumerate(leaders) if lead != i]
    if not followers:
        return obs
    state = vec.base_env.get_state_dict()
    source = torch.tensor([leaders[i] for i in followers])
    env_idx = torch.tensor(followers, device=vec.device)  # ascending: the order states are set in
    options = {"env_idx": env_idx,
               "reset_to_env_states": {"env_states": gather_rows(state, source)}}
    obs, _ = vec.reset(options=options)
    return obs
