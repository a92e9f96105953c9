"""Checkpoints written before each env and policy had a settings class of its own (issue 47)
still evaluate: their saved config (written out here by hand, in the old layout: one flat
``env`` with every adapter's fields, options under ``env.kwargs`` and ``policy.kwargs``) is
moved into today's layout when ``m2flow-eval checkpoint=`` reads it."""

import pytest
import torch

from m2flow.cli.common import load_eval_config
from m2flow.configs import ConfigError

# What m2flow wrote for maniskill_pushcube_ppo_cnn (a CNN with a privileged critic, PushCube
# from 64 px images), the fields of the old EnvConfig and PolicyConfig in their order.
OLD_CNN = """\
workload: embodied
env:
  name: ManiSkill/PushCube-v1
  num_envs: 16
  obs_mode: rgb
  control_mode: pd_ee_delta_pos
  reward_mode: normalized_dense
  ignore_terminations: true
  max_episode_steps: 100
  sim_backend: auto
  render_backend: auto
  image_size: 64
  visual_mesh_fraction: 0.05
  privileged_state: true
  step_timeout_s: 300.0
  shared_memory: auto
  kwargs: {}
policy:
  name: cnn
  hidden_sizes:
  - 512
  activation: relu
  normalize_obs: true
  init_log_std: -2.5
  kwargs:
    critic: privileged
    state_aux: 1.0
    actor_hidden_state:
    - - 9
      - 18
algorithm:
  name: ppo
  update_epochs: 8
seed: 1
run_name: maniskill_pushcube_ppo_cnn_from_bc
"""

# The tiny OFT VLA on PushCube: the old PolicyConfig's MLP fields at their defaults (OFT has
# none), every option under kwargs.
OLD_OFT = """\
env:
  name: ManiSkill/PushCube-v1
  num_envs: 8
  obs_mode: rgb
  control_mode: pd_ee_delta_pos
  reward_mode: normalized_dense
  ignore_terminations: true
  max_episode_steps: 100
  sim_backend: auto
  render_backend: auto
  image_size: 64
  visual_mesh_fraction: 0.05
  privileged_state: true
  step_timeout_s: 300.0
  shared_memory: auto
  kwargs: {}
policy:
  name: openvla_oft
  hidden_sizes: [256, 256, 256]
  activation: tanh
  normalize_obs: true
  init_log_std: -0.5
  kwargs:
    vision: [timm/vit_tiny_patch16_224]
    image_size: 64
    image_keys: [rgb, wrist_rgb]
    chunk: 8
    hidden_size: 128
    num_layers: 2
    num_heads: 4
    intermediate_size: 256
    value_head: false
    critic: privileged
    temperature: 0.5
    proprio_hidden: [[9, 18]]
algorithm:
  name: ppo
"""

# gym's Pendulum: ManiSkill's and the process envs' fields at their old defaults, and an
# argument of the gymnasium env under kwargs (the adapter passed them to gym.make).
OLD_GYM = """\
env:
  name: gym/Pendulum-v1
  num_envs: 2
  obs_mode: state
  control_mode: null
  reward_mode: null
  ignore_terminations: false
  max_episode_steps: null
  sim_backend: auto
  render_backend: auto
  image_size: 64
  visual_mesh_fraction: {fraction}
  privileged_state: false
  step_timeout_s: 300.0
  shared_memory: auto
  kwargs:
    g: 9.81
policy:
  name: mlp
  hidden_sizes: [64, 64]
  activation: tanh
  normalize_obs: true
  init_log_std: -0.5
  kwargs: {policy_kwargs}
algorithm:
  name: ppo
"""


def write(tmp_path, config: str):
    path = tmp_path / "last.pt"
    torch.save({"workload": "embodied", "iteration": 3, "config": config,
                "learner": {"policy": {}}, "metrics": {}}, path)
    return path


def test_an_old_cnn_checkpoint_reads_as_the_cnn_and_maniskill_settings(tmp_path):
    cfg, state = load_eval_config([f"checkpoint={write(tmp_path, OLD_CNN)}", "episodes=2"])
    env, policy = cfg.env, cfg.policy
    assert type(env).__name__ == "ManiSkillEnvConfig" and type(policy).__name__ == "CNNPolicyConfig"
    assert (env.visual_mesh_fraction, env.privileged_state, env.max_episode_steps) == (0.05, True, 100)
    assert (policy.critic, policy.state_aux, policy.actor_hidden_state) == ("privileged", 1.0,
                                                                            [[9, 18]])
    assert (policy.hidden_sizes, policy.init_log_std) == ([512], -2.5)
    assert cfg.algorithm.update_epochs == 8 and cfg.seed == 1 and state["iteration"] == 3


def test_an_old_oft_checkpoint_drops_the_mlp_fields_it_never_read(tmp_path):
    cfg, _ = load_eval_config([f"checkpoint={write(tmp_path, OLD_OFT)}",
                               "policy.temperature=0.7"])  # today's spelling on top
    policy = cfg.policy
    assert type(policy).__name__ == "OFTPolicyConfig" and not hasattr(policy, "hidden_sizes")
    assert (policy.critic, policy.value_head, policy.proprio_hidden) == ("privileged", False,
                                                                         [[9, 18]])
    assert policy.temperature == 0.7 and policy.chunk == 8 and policy.stop_token  # a default


def test_an_old_gym_checkpoint_passes_its_kwargs_to_gym_make(tmp_path):
    old = OLD_GYM.format(fraction=1.0, policy_kwargs="{critic: shared}")
    cfg, _ = load_eval_config([f"checkpoint={write(tmp_path, old)}"])
    assert type(cfg.env).__name__ == "GymEnvConfig" and cfg.env.make_args == {"g": 9.81}
    assert not hasattr(cfg.env, "visual_mesh_fraction")
    assert cfg.policy.critic == "shared" and cfg.policy.hidden_sizes == [64, 64]


@pytest.mark.parametrize("fraction, policy_kwargs, fragment", [
    (0.5, "{}", "env.visual_mesh_fraction is not a field of GymEnvConfig"),  # not the default
    (1.0, "{critc: shared}", "policy.critc is not a field of MLPPolicyConfig"),
])
def test_an_old_field_the_settings_lack_is_one_line(tmp_path, fraction, policy_kwargs, fragment):
    old = OLD_GYM.format(fraction=fraction, policy_kwargs=policy_kwargs)
    with pytest.raises(ConfigError) as e:
        load_eval_config([f"checkpoint={write(tmp_path, old)}"])
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_an_old_oft_checkpoint_resumes_under_its_config(tmp_path):
    """``resume=`` compares the checkpoint's config with this one (the policy's layers among
    them): the MLP widths the old PolicyConfig wrote for every policy are no difference."""
    from m2flow.cli.common import load_run_config

    path = write(tmp_path, OLD_OFT)
    cfg = load_run_config("maniskill_pushcube_ppo_openvla_oft_tiny", [f"resume={path}"],
                          make_plan=False)
    assert cfg.resume == str(path)
