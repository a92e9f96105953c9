"""The reasoning workload: GRPO for causal language models (data, generation engines,
rewards, rollout/reward/learner workers, runner) on the run layer and the engine. Never
imports ``m2flow.embodied``."""
