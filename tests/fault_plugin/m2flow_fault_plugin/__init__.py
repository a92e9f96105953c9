"""``algorithm.name=ppo_fails_at_2``: PPO whose loss raises in the learner step of the second
iteration, as a loss that diverges would; for the tests of how a failed run ends."""

from m2flow.embodied.algorithms.ppo import PPO

FAILING_ITERATION = 1  # the second iteration (they count from 0)


class LossDiverged(ArithmeticError):
    """The loss of a learner step is not finite (here: on purpose)."""


class PPOFailsAt2(PPO):
    def prepare(self, policy, traj, *, iteration: int, staleness: int):
        self.iteration = iteration
        return super().prepare(policy, traj, iteration=iteration, staleness=staleness)

    def loss(self, policy, mb):
        if self.iteration == FAILING_ITERATION:
            raise LossDiverged(f"loss is nan in the learner step of iteration {self.iteration}")
        return super().loss(policy, mb)


ALGORITHM = PPOFailsAt2
