"""``algorithm.name=ppo_fails_at_2``: PPO whose loss raises in the learner step of the second
iteration, as a loss that diverges would; ``algorithm.name=ppo_save_hangs_at_2``: PPO whose
state, asked for once the second iteration's update is done, never comes, as a checkpoint
save that hangs would. For the tests of how a failed run ends."""

import time

from m2flow.embodied.algorithms.ppo import PPO

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


ALGORITHM = PPOFailsAt2
SAVE_HANGS = PPOSaveHangsAt2
