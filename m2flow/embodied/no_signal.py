"""The warning of a run that cannot learn: iterations in a row whose batch gives every sample
the same reward (or whose GRPO groups were all filtered), so every advantage is 0."""

from __future__ import annotations

from typing import Optional


class NoSignalWatch:
    """Counts iterations in a row with nothing to learn from (every reward of the batch
    equal, or every GRPO group filtered) and returns a warning line every ``iterations`` of
    them (0: never).

    >>> watch = NoSignalWatch(iterations=2, algorithm="grpo")
    >>> [watch.update({"train/reward_spread": 0.0}) is not None for _ in range(4)]
    [False, True, False, True]
    >>> watch.update({"train/reward_spread": 0.5, "grpo/groups_kept": 0.0}) is not None
    False
    >>> watch.update({"train/reward_spread": 0.5, "grpo/groups_kept": 0.25}), watch.streak
    (None, 0)
    """

    def __init__(self, iterations: int, algorithm: str):
        self.iterations, self.algorithm, self.streak = iterations, algorithm, 0

    def update(self, metrics: dict) -> Optional[str]:
        constant = metrics.get("train/reward_spread", 1.0) == 0.0
        filtered = metrics.get("grpo/groups_kept", 1.0) == 0.0
        if not (constant or filtered):
            self.streak = 0
            return None
        self.streak += 1
        if self.iterations <= 0 or self.streak % self.iterations:
            return None
        what = ("every reward of the batch was the same" if constant else
                "every GRPO group was filtered (its success rate outside "
                "(algorithm.filter_low, algorithm.filter_high))")
        return (
            f"WARNING: no learning signal for {self.streak} iterations in a row: {what}, so "
            f"the advantages are 0 and algorithm={self.algorithm} does not learn. Likely causes: "
            "a sparse success reward the policy never (or always) reaches (longer "
            "runner.rollout_steps / env.max_episode_steps, an easier task, a better starting "
            "checkpoint), a reward the env does not compute for this obs/control mode, or "
            "actions that do not reach the env (action scale, un-normalisation statistics). "
            "runner.warn_no_signal_iterations=0 silences this."
        )
