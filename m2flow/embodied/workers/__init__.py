"""The embodied workload's workers, one job each, and the pieces only they use.

- :mod:`.env_worker`: steps its envs with actions that arrive on a channel; its parts are
  :mod:`.stages` (envs -> env groups -> pipeline stages), :mod:`.episodes` (episode
  bookkeeping), :mod:`.resets` (reset seeds and tasks), :mod:`.buffer` (the trajectory
  buffer) and :mod:`.env_eval` (evaluation rounds and their video frames);
- :mod:`.rollout_worker`: policy inference for the observations that arrive on a channel;
- :mod:`.learner_worker`: one update on trajectories from a channel (the algorithm's).
"""
