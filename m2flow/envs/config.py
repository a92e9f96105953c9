"""The settings every env has; each adapter's own dataclass extends them.

An adapter names its settings class as ``config_class`` (``BatchedEnv``'s default: this
base); the registry stores it as Hydra schema ``env/<schema>`` (``m2flow.registry.
schema_name``: ``ManiSkill/*`` -> ``maniskill_schema``), and an env group file starts with
``defaults: [<schema>, _self_]``, so every key of it is checked against that class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from m2flow.fields import at_least, check_bound, one_of, optional

SIM_BACKENDS = ("auto", "cpu", "gpu")


@dataclass
class EnvConfig:
    """Which simulator, how many envs, and how they observe and act."""

    name: str = MISSING
    """Registered env id, e.g. 'ManiSkill/PushCube-v1' or 'gym/Pendulum-v1'."""
    num_envs: int = 8
    """Envs stepped together by one env worker (CPU simulators: in simulator processes)."""
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
    image_size: int = 64
    """Camera width and height for image obs modes."""

    def validate(self) -> None:
        """Raises FieldError naming the first of these fields out of range (an adapter's own
        fields are its ``check_config`` hook's)."""
        check_bound(self, "env.num_envs", at_least(1),
                    "set the envs each env worker steps (e.g. 8)")
        check_bound(self, "env.max_episode_steps", optional(at_least(1), "the simulator's limit"),
                    "set the episode time limit in steps")
        check_bound(self, "env.image_size", at_least(1),
                    "set the camera width and height in pixels (e.g. 64)")
        check_bound(self, "env.sim_backend", one_of(SIM_BACKENDS),
                    "'auto' simulates on the env worker's GPU if it has one")


@dataclass
class ProcessEnvConfig(EnvConfig):
    """The settings of adapters that run one simulator process per env (ManiSkill's CPU
    backend, LIBERO, a plugin's ``GymVectorEnv(..., processes=True)``); their
    ``check_config`` calls ``m2flow.envs.procs.check_processes``."""

    step_timeout_s: float = 300.0
    """A step or reset that takes longer counts as a hung process, which is killed and
    restarted (its episode is discarded)."""
    max_restarts: int = 3
    """Restarts of one simulator process in a row (no episode finished between them) before
    the run ends, naming the env, its task and the process's last error: a simulator that
    dies on every reset or step is not restarted forever. 0: never restart."""
    shared_memory: str = "auto"
    """Which observation arrays come back through shared memory instead of a pickled message:
    'auto' those of 16 KiB or more (images; state vectors stay messages), 'on' every array,
    'off' none (see bench/README.md#obs_transferpy)."""
