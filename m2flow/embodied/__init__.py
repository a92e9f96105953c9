"""The embodied workload: ``algorithms/`` (a registry, and the ``helpers/`` they share),
``workers/`` (env, rollout, learner), ``demos/``, and on them the runner and the evaluation
protocol, on the run layer and the engine. Never imports ``m2flow.reasoning``."""
