"""Every key of the one batch type that crosses layers: a ``TensorDict``.

Batch dims are ``[num_envs]`` for one step and ``[num_envs, T]`` for a trajectory (embodied),
``[n]`` for the n completions of one problem (reasoning). Root keys describe the step's input;
``"next"`` holds what the step produced (TorchRL's convention). Code that writes or reads a key
across a layer uses the constant below, never the bare string, so that this table stays whole
(``tests/embodied/test_keys.py`` fails on a key a registry env or policy writes that is not here).

Embodied (env -> env worker -> channel -> rollout worker -> learner):

================================  =========  ===============  ====================================
key                               dtype      shape (per row)  written by
================================  =========  ===============  ====================================
("obs", "state")                  float32    (D,)             envs: proprio/state vector
("obs", "rgb")                    uint8      (H, W, 3)        envs: camera image (rgb obs modes)
("obs", "wrist_rgb")              uint8      (H, W, 3)        envs: wrist camera (LIBERO)
("obs", "depth")                  float32    (H, W, 1)        envs: depth image in [0, 1] (mjlab)
("obs", "privileged")             float32    (P,)             envs: simulator state, training only
("obs", "task")                   int64      ()               multi-task envs: index in spec.tasks
"action"                          float32    (A,) | (K, A)    policies.act (raw sample; K: chunk)
"action_tokens"                   int64      (Q,)             token policies (VLA): the action bins
"log_prob"                        float32    ()               policies.act / evaluate_actions
"token_log_prob"                  float32    (Q,)             token policies: per action token;
                                                              flow policies: per action dim (H*A)
"entropy"                         float32    ()               policies.evaluate_actions
"value"                           float32    ()               policies.act (critic at "obs")
"aux_loss"                        float32    ()               policies.evaluate_actions: own aux loss
"flow_chain"                      float32    (K+1, H, A)      flow policies.act: the denoising chain
                                                              (normalised action units, unclipped)
"flow_step"                       int64      ()               flow policies.act (flow_sde): the
                                                              chain's one stochastic step
"policy_version"                  int64      ()               rollout workers: weights' version
("next", "obs", ...)              as obs     as obs           envs.step: obs the step ended in
("next", "reward")                float32    ()               envs.step (chunks: summed)
("next", "terminated")            bool       ()               envs.step: MDP ended (no bootstrap)
("next", "truncated")             bool       ()               envs.step: time limit (bootstrap)
("next", "done")                  bool       ()               envs.step: terminated | truncated
("next", "success")               bool       ()               envs.step: task predicate now true
                                                              (chunks: at any of its steps)
("next", "success_at_end")        bool       ()               envs.chunked: success at the last
                                                              step of the episode's part (absent:
                                                              one step, its "success")
("next", "discarded")             bool       ()               envs.step: sim process restarted
("next", "step_reward")           float32    (K,)             envs.chunked: each step's reward
("next", "step_done")             bool       (K,)             envs.chunked: each step's done
("next", "num_steps")             int64      ()               envs.chunked: env steps taken
("next", "frames")                uint8      (K, H, W, 3)     envs.chunked (frames_key): video
"valid"                           bool       ()               env worker / learner: step is a
                                                              sample (not in a lost episode)
("next", "value")                 float32    ()               embodied learner: critic at next obs
"advantage"                       float32    ()               embodied.algorithms (GAE, GRPO)
"return"                          float32    ()               embodied.algorithms (GAE, GRPO)
================================  =========  ===============  ====================================

Reasoning (rollout worker -> reward worker -> learner; P prompt, C completion tokens):

================================  =========  ===============  ====================================
key                               dtype      shape (per row)  written by
================================  =========  ===============  ====================================
"prompt_ids"                      int64      (P,)             reasoning.engine (left-padded)
"prompt_mask"                     bool       (P,)             reasoning.engine
"completion_ids"                  int64      (C,)             reasoning.engine
"completion_mask"                 bool       (C,)             reasoning.engine: up to and incl. eos
"logprobs"                        float32    (C,)             reasoning.engine: per token, masked
"problem"                         int64      ()               reasoning rollout: index in train set
"policy_version"                  int64      ()               reasoning rollout: weights' version
"reward"                          float32    ()               reasoning reward worker
"advantage"                       float32    ()               reasoning learner (group advantages)
================================  =========  ===============  ====================================

``envs.step`` also returns a root ``"obs"``: the observation to act on next, which equals
``("next", "obs")`` except where ``done`` (there it is the first obs of the new episode).
Nested keys are tuples; ``leaf(STATE)`` is the name inside the ``"obs"`` sub-batch (and in
``EnvSpec.obs_shapes``).
"""

from __future__ import annotations

# roots
OBS = "obs"
NEXT = "next"

# observations (under OBS and under NEXT_OBS)
STATE = (OBS, "state")
RGB = (OBS, "rgb")
WRIST_RGB = (OBS, "wrist_rgb")
DEPTH = (OBS, "depth")
PRIVILEGED = (OBS, "privileged")  # env.privileged_state: critic, aux loss; never the actor
TASK = (OBS, "task")

# policy outputs
ACTION = "action"
ACTION_TOKENS = "action_tokens"
LOG_PROB = "log_prob"
TOKEN_LOG_PROB = "token_log_prob"
ENTROPY = "entropy"
VALUE = "value"
AUX_LOSS = "aux_loss"  # per sample, from evaluate_actions: a policy's own auxiliary loss
FLOW_CHAIN = "flow_chain"  # a flow policy's denoising chain, c_0 (noise) .. c_K (the action)
FLOW_STEP = "flow_step"  # Flow-SDE: the index k of the chain's stochastic step c_k -> c_{k+1}
POLICY_VERSION = "policy_version"

# step results
NEXT_OBS = (NEXT, OBS)
REWARD = (NEXT, "reward")
TERMINATED = (NEXT, "terminated")
TRUNCATED = (NEXT, "truncated")
DONE = (NEXT, "done")
SUCCESS = (NEXT, "success")
SUCCESS_AT_END = (NEXT, "success_at_end")  # chunks; a one-step transition's is its SUCCESS
DISCARDED = (NEXT, "discarded")
STEP_REWARD = (NEXT, "step_reward")
STEP_DONE = (NEXT, "step_done")
NUM_STEPS = (NEXT, "num_steps")
FRAMES = (NEXT, "frames")

# env worker and learner
VALID = "valid"
NEXT_VALUE = (NEXT, "value")
ADVANTAGE = "advantage"
RETURN = "return"

# reasoning
PROMPT_IDS = "prompt_ids"
PROMPT_MASK = "prompt_mask"
COMPLETION_IDS = "completion_ids"
COMPLETION_MASK = "completion_mask"
LOGPROBS = "logprobs"
PROBLEM = "problem"
COMPLETION_REWARD = "reward"

# the boolean flags of a step result, which a chunk of steps reduces with "any"
FLAGS = (TERMINATED, TRUNCATED, DONE, SUCCESS, DISCARDED)


def leaf(key) -> str:
    """The last name of a key: ``leaf(STATE) == "state"``, ``leaf(ACTION) == "action"``."""
    return key if isinstance(key, str) else key[-1]


def all_keys() -> set:
    """Every key constant of this module, as full keys (nested ones as tuples).

    >>> ("obs", "task") in all_keys(), "version" in all_keys()
    (True, False)
    """
    return {v for k, v in globals().items()
            if k.isupper() and k != "FLAGS" and isinstance(v, (str, tuple))}
