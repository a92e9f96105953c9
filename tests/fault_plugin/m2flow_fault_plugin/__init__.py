"""``algorithm.name=ppo_fails_at_2``: PPO whose loss raises in the learner step of the second
iteration, as a loss that diverges would; ``algorithm.name=ppo_save_hangs_at_2``: PPO whose
state, asked for once the second iteration's update is done, never comes, as a checkpoint
save that hangs would; ``algorithm.name=ppo_marks_save``: PPO whose state, asked for by the
second iteration's checkpoint, writes its process's pid to the file named by
``M2FLOW_MARK_SAVE`` and then takes ``MARK_PAUSE_S`` more; ``policy.name=mlp_marks_phases``:
the Gaussian MLP, which writes its process's pid to the file named by

- ``M2FLOW_MARK_COLLECTION`` when it samples its ``MARK_AT``-th action (in the middle of the
  second iteration's collection of a run of 64 rollout steps);
- ``M2FLOW_MARK_START`` (a line appended) when it is built, in a rollout worker's constructor
  (the learner's, which builds its copy at the same time, marks nothing), which then takes
  ``MARK_PAUSE_S`` more;
- ``M2FLOW_MARK_SYNC`` when weights are loaded into it for the ``SYNC_MARK_AT``-th time (the
  rollout's copy: a sync of a tiny MLP is one bucket, one load), which then takes
  ``MARK_PAUSE_S`` more;

so that a test stops the worker in that phase, not in another it is busy in (a weight sync
is over in moments). For the tests of how a failed run ends and of stalled workers."""

import os
import time
from pathlib import Path

from m2flow.embodied.algorithms.ppo import PPO
from m2flow.policies.mlp import GaussianMLPPolicy

FAILING_ITERATION = 1  # the second iteration (they count from 0)


class LossDiverged(ArithmeticError):
    """The loss of a learner step is not finite (here: on purpose)."""


class _Counting(PPO):
    """PPO that knows the iteration of its latest update."""

    def prepare(self, policy, traj, *, iteration: int, staleness: int):
        self.iteration = iteration
        return super().prepare(policy, traj, iteration=iteration, staleness=staleness)


class PPOFailsAt2(_Counting):
    def loss(self, policy, mb):
        if self.iteration == FAILING_ITERATION:
            raise LossDiverged(f"loss is nan in the learner step of iteration {self.iteration}")
        return super().loss(policy, mb)


class PPOSaveHangsAt2(_Counting):
    def state_dict(self):
        if getattr(self, "iteration", None) == FAILING_ITERATION:
            time.sleep(3600)  # until the run ends this worker
        return super().state_dict()


MARK_AT = 64 + 16  # the 16th step of the second iteration's collection (64 steps each)
# the loads of a run's weights into the rollout's copy: the full sync of start-up, then one
# per iteration: the third is the second iteration's sync, after the first checkpoint
SYNC_MARK_AT = 3
MARK_PAUSE_S = 5.0  # a marked phase lasts this long at least: the test stops it meanwhile


def _mark(variable: str, pause: bool = True) -> None:
    """Writes this process's pid to the file named by ``variable`` (if set), then pauses."""
    mark = os.environ.get(variable)
    if mark:
        Path(mark).write_text(str(os.getpid()))
        if pause:
            time.sleep(MARK_PAUSE_S)


class PPOMarksSave(_Counting):
    def state_dict(self):
        if getattr(self, "iteration", None) == FAILING_ITERATION:
            _mark("M2FLOW_MARK_SAVE")
        return super().state_dict()


class MLPMarksPhases(GaussianMLPPolicy):
    sampled = 0
    loads = 0

    def __init__(self, cfg, env_spec):
        super().__init__(cfg, env_spec)
        mark = os.environ.get("M2FLOW_MARK_START")
        if mark and b"RolloutWorker" in Path("/proc/self/cmdline").read_bytes():  # (Ray's title)
            with open(mark, "a") as f:
                f.write(f"{os.getpid()}\n")
            time.sleep(MARK_PAUSE_S)

    def act(self, batch, deterministic: bool = False):
        if not deterministic:
            self.sampled += 1
            if self.sampled == MARK_AT:
                _mark("M2FLOW_MARK_COLLECTION", pause=False)
        return super().act(batch, deterministic)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        self.loads += 1
        if self.loads == SYNC_MARK_AT:
            _mark("M2FLOW_MARK_SYNC")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


ALGORITHM = PPOFailsAt2
SAVE_HANGS = PPOSaveHangsAt2
MARKS_SAVE = PPOMarksSave
MARKS_PHASES = MLPMarksPhases
