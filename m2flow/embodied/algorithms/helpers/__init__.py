"""Pieces the algorithms share, none of them an algorithm: advantage estimation
(:mod:`.advantages`), the policy ratio's unit (:mod:`.losses`), a behaviour-cloning term inside
an RL loss (:mod:`.demo_term`), demonstrations as a policy trains on them
(:mod:`.expert_data`), SAC's maths (:mod:`.offpolicy`), the replay buffer (:mod:`.replay`)
and image augmentation (:mod:`.augment`)."""
