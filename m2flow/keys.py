"""Every key of the one batch type that crosses layers: a ``TensorDict``.

Batch dims are ``[num_envs]`` for one step and ``[num_envs, T]`` for a trajectory. Root keys
describe the step's input; ``"next"`` holds what the step produced (TorchRL's convention).

================================  =========  ==============  ===============================
key                               dtype      shape (per env)  written by
================================  =========  ==============  ===============================
("obs", "state")                  float32    (D,)            envs: proprio/state vector
("obs", "rgb")                    uint8      (H, W, 3)       envs: camera image (rgb obs modes)
("obs", "wrist_rgb")              uint8      (H, W, 3)       envs: wrist camera (LIBERO)
"action"                          float32    (A,)            policies.act (raw Gaussian sample)
"log_prob"                        float32    ()              policies.act (of "action")
"value"                           float32    ()              policies.act (critic at "obs")
"policy_version"                  int64      ()              rollout worker: weights' version
("next", "obs", ...)              as obs     as obs          envs.step: obs the step ended in
("next", "reward")                float32    ()              envs.step
("next", "terminated")            bool       ()              envs.step: MDP ended (no bootstrap)
("next", "truncated")             bool       ()              envs.step: time limit (bootstrap)
("next", "done")                  bool       ()              envs.step: terminated | truncated
("next", "success")               bool       ()              envs.step: task predicate now true
("next", "discarded")             bool       ()              envs.step: sim process restarted
("obs", "task")                   int64      ()              multi-task envs: index in spec.tasks
"valid"                           bool       ()              env worker: not in a lost episode
("next", "value")                 float32    ()              embodied.learner: critic at next obs
"advantage"                       float32    ()              embodied.advantages.gae
"return"                          float32    ()              embodied.advantages.gae
================================  =========  ==============  ===============================

``envs.step`` also returns a root ``"obs"``: the observation to act on next, which equals
``("next", "obs")`` except where ``done`` (there it is the first obs of the new episode).
"""

OBS = "obs"
ACTION = "action"
LOG_PROB = "log_prob"
VALUE = "value"
POLICY_VERSION = "policy_version"
NEXT = "next"
REWARD = ("next", "reward")
TERMINATED = ("next", "terminated")
TRUNCATED = ("next", "truncated")
DONE = ("next", "done")
SUCCESS = ("next", "success")
DISCARDED = ("next", "discarded")
VALID = "valid"
NEXT_OBS = ("next", "obs")
NEXT_VALUE = ("next", "value")
ADVANTAGE = "advantage"
RETURN = "return"
