"""The env config: one dataclass shared by every simulator adapter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import MISSING


@dataclass
class EnvConfig:
    """Which simulator, how many envs, and how they observe and act."""

    name: str = MISSING
    """Registered env id, e.g. 'ManiSkill/PushCube-v1' or 'gym/Pendulum-v1'."""
    num_envs: int = 8
    """Envs stepped together by one env worker (CPU simulators: one process each)."""
    obs_mode: str = "state"
    """'state' (vector) or 'rgb' (camera image + state), if the simulator can render it."""
    control_mode: Optional[str] = None
    """Simulator controller, e.g. ManiSkill's 'pd_ee_delta_pos'; None: the simulator's default."""
    reward_mode: Optional[str] = None
    """E.g. ManiSkill's 'normalized_dense' or 'sparse'; None: the simulator's default."""
    ignore_terminations: bool = False
    """Success does not end an episode: it runs to the time limit (ManiSkill's convention for
    dense rewards, where ending an episode on success would cut off its best rewards)."""
    max_episode_steps: Optional[int] = None
    """Time limit (truncation); None: the simulator's registered limit."""
    sim_backend: str = "auto"
    """'cpu', 'gpu', or 'auto' (gpu when the worker was placed on a GPU, else cpu)."""
    render_backend: str = "auto"
    """'none', 'cpu' or 'gpu'; 'auto': none for state obs, else gpu if present, else cpu."""
    image_size: int = 64
    """Camera width and height for image obs modes."""
    visual_mesh_fraction: float = 1.0
    """Fraction of the visual-mesh triangles kept when a CPU renders (ManiSkill): 1.0 draws
    the published meshes; 0.05 draws 5 % of the robot's, ~3.8x the env steps/s through
    software Vulkan at a 64 px image change of ~1/255 (``m2flow.envs.meshes``). Physics is unchanged. The
    GPU backend always renders the published meshes. Checked by the ManiSkill adapter."""
    privileged_state: bool = False
    """ManiSkill: also return ``("obs", "privileged")``, the simulator's full state (every
    actor's pose and velocities, the robot's joints: ManiSkill's ``get_state()``), for an
    asymmetric critic (``policy=cnn`` with ``policy.kwargs.critic=privileged``); no actor reads
    it, so the policy still acts from what the camera and proprio show."""
    step_timeout_s: float = 300.0
    """Envs with one simulator process each: a step or reset that takes longer counts as a
    hung process, which is killed and restarted (its episode is discarded)."""
    shared_memory: str = "auto"
    """Envs with one simulator process each: which observation arrays come back through
    shared memory instead of a pickled message: 'auto' those of 16 KiB or more (images; state
    vectors stay messages), 'on' every array, 'off' none (bench/obs_transfer.py measures both)."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the simulator's constructor."""
