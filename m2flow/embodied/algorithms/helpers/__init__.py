"""Pieces the algorithms share, none of them an algorithm: a behaviour-cloning term inside an
RL loss (:mod:`.demo_term`), demonstrations as a policy trains on them (:mod:`.expert_data`),
SAC's maths (:mod:`.offpolicy`), the replay buffer (:mod:`.replay`) and image augmentation
(:mod:`.augment`). The on-policy maths (GAE, group advantages, the clipped surrogate at a
log-prob level) is :mod:`m2flow.runs.rl`, which the reasoning workload shares."""
