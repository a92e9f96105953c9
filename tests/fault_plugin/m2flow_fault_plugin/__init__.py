"""``algorithm.name=ppo_fails_at_2``: PPO whose loss raises in the learner step of the second
iteration, as a loss that diverges would; ``algorithm.name=ppo_save_hangs_at_2``: PPO whose
state, asked for once the second iteration's update is done, never comes, as a checkpoint
save that hangs would; ``policy.name=mlp_marks_collection``: the Gaussian MLP, which writes
the file named by ``M2FLOW_MARK_COLLECTION`` when it samples its ``MARK_AT``-th action (in the
middle of the second iteration's collection of a run of 64 rollout steps), so that a test
stops the rollout worker in that phase, not in another it is busy in (a weight sync). For the
tests of how a failed run ends and of stalled workers."""

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


class MLPMarksCollection(GaussianMLPPolicy):
    sampled = 0

    def act(self, batch, deterministic: bool = False):
        if not deterministic:
            self.sampled += 1
            mark = os.environ.get("M2FLOW_MARK_COLLECTION")
            if mark and self.sampled == MARK_AT:
                Path(mark).write_text(str(os.getpid()))
        return super().act(batch, deterministic)


ALGORITHM = PPOFailsAt2
SAVE_HANGS = PPOSaveHangsAt2
MARKS_COLLECTION = MLPMarksCollection
