"""Configs: every entry config composes; mistakes fail at load time with one clear line."""

import json

import pytest
import torch

from m2flow.cli.common import load_run_config
from m2flow.cli.workloads import register_schemas
from m2flow.configs import ConfigError, load_config, to_object
from m2flow.configs.loader import entry_configs


DEMO_CONFIGS = {"maniskill_pickcube_rlpd_mlp": "demos/PickCube-v1_state.h5"}  # m2flow-demos output
# configs that hold the statistics of the checkpoint they start from (policy.hold_obs_norm):
# without init_from= they are refused at start-up with one line
INIT_CONFIGS = ("maniskill_pickcube_ppo_flow_mlp_from_bc", "maniskill_pushcube_ppo_pi0_tiny")
GPU_CONFIGS = ("libero_spatial_grpo_openvla_oft", "reasoning_math_grpo_qwen", "mjlab_liftcube_ppo_cnn",
               "mjlab_liftcube_ppo_mlp", "mjlab_liftcube_ppo_openvla_tiny")


@pytest.mark.parametrize("name", entry_configs())
def test_every_entry_config_composes_and_validates(name, tmp_path, monkeypatch):
    # the GPU-scale configs name local files through variables: point those at stand-ins (the
    # start-up checks look at paths, nothing is loaded)
    stats = {"libero_spatial_no_noops": {"action": {"q01": [0.0] * 7, "q99": [1.0] * 7}}}
    (tmp_path / "config.json").write_text(json.dumps({"norm_stats": stats}))
    (tmp_path / "data.jsonl").write_text("")
    for var in ("M2FLOW_QWEN_PATH", "M2FLOW_OPENVLA_CHECKPOINT"):
        monkeypatch.setenv(var, str(tmp_path))
    for var in ("M2FLOW_MATH_TRAIN", "M2FLOW_MATH_TEST"):
        monkeypatch.setenv(var, str(tmp_path / "data.jsonl"))
    if name in DEMO_CONFIGS:  # the start-up checks want the recorded file to exist
        monkeypatch.chdir(tmp_path)
        (tmp_path / DEMO_CONFIGS[name]).parent.mkdir(parents=True)
        (tmp_path / DEMO_CONFIGS[name]).write_bytes(b"")
    if name in INIT_CONFIGS:
        with pytest.raises(ConfigError, match=r"policy\.hold_obs_norm=.*init_from=") as e:
            load_run_config(name)
        assert "\n" not in str(e.value)
        register_schemas()
        cfg = to_object(load_config(name))  # the schema still accepts every key
    elif name in GPU_CONFIGS and not torch.cuda.is_available():
        # planned on this machine (not on the Ray cluster a config may name), their placement
        # asks for GPU 0 and more cores than there are: refused at start-up with one line
        with pytest.raises(ConfigError, match=r"cluster\.placement\.components\.\w+\.(gpus|cpus)") as e:
            load_run_config(name, ["cluster.address=null"])
        assert "\n" not in str(e.value)
        register_schemas()
        cfg = to_object(load_config(name))  # the schema still accepts every key
    else:
        cfg = load_run_config(name)
    if name.startswith("reasoning_"):
        assert cfg.workload == "reasoning" and cfg.runner.num_steps > 0 and cfg.rollout.n > 1
        return
    assert cfg.workload == "embodied"
    assert cfg.env.name and cfg.policy.name and cfg.runner.num_iterations > 0


def test_gpu_reasoning_config_without_its_model_names_the_variable(monkeypatch):
    monkeypatch.delenv("M2FLOW_QWEN_PATH", raising=False)
    with pytest.raises(ConfigError, match="model.path"):
        load_run_config("reasoning_math_grpo_qwen")


def check(overrides, *fragments):
    with pytest.raises(ConfigError) as e:
        load_run_config("maniskill_pushcube_ppo_mlp", overrides)
    msg = str(e.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, msg


def test_wrong_key_names_the_field_and_suggests():
    check(["env.num_envz=2"], "env.num_envz", "EnvConfig", "Did you mean env.num_envs?")


def test_wrong_type_names_the_field():
    check(["env.num_envs=lots"], "env.num_envs='lots'", "Integer")


def test_wrong_nested_type_names_the_full_path():
    check(["cluster.placement.components.env.cpus=many"], "cluster.placement.components.env.cpus")


def test_the_env_stagings_old_keys_name_their_new_ones():
    """``rollout.pipeline_stages`` and ``rollout.env_groups`` are ``staging.*`` now (the
    reasoning workload's ``rollout`` is its generation, and keeps its keys)."""
    check(["rollout.pipeline_stages=2"], "rollout.pipeline_stages is staging.pipeline_stages "
          "now; write staging.pipeline_stages instead.")
    check(["rollout.env_groups=4"], "write staging.env_groups instead")


def test_unknown_group_option_lists_available():
    check(["env=maniskill_pushcub"], "env/maniskill_pushcub", "maniskill_pushcube")


def test_unknown_env_name_fails_at_load():
    check(["env.name=ManiSkill/PushCub-v1"], "PushCub-v1", "Did you mean 'PushCube-v1'")


def test_unknown_policy_name_fails_at_load():
    check(["policy.name=mpl"], "policy.name", "Did you mean 'mlp'")


def test_unknown_entry_config_lists_the_real_ones():
    with pytest.raises(ConfigError, match="maniskill_pushcube_ppo_mlp"):
        load_run_config("maniskill_pushcub_ppo_mlp")


def test_cli_prints_one_line_and_exits_2(capsys):
    from m2flow.cli.train import main as train

    assert train(["env.num_envz=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("m2flow-train: config error: env.num_envz") and "\n" not in err
