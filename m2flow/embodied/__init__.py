"""The embodied workload: algorithms (a registry), env/rollout/learner workers, the runner
and the evaluation protocol, on the run layer and the engine. Never imports
``m2flow.reasoning``."""
