"""Registry sweep and the batched-env contract, on real simulators."""

import pytest
import torch

from m2flow.envs import (
    EnvConfig,
    EnvError,
    env_class,
    make_env,
    register_env,
    registered_envs,
)
from m2flow.envs.gymnasium_env import GymnasiumEnv


def concrete_ids():
    ids = []
    for name in registered_envs():
        ids += list(getattr(env_class(name), "EXAMPLE_IDS", ())) if name.endswith("/*") else [name]
    return ids


@pytest.mark.parametrize("env_id", concrete_ids())
def test_every_registered_env_steps_a_batch(env_id):
    env = make_env(EnvConfig(name=env_id, num_envs=2))
    try:
        obs = env.reset(seed=[0, 1])["obs"]
        assert set(obs.keys()) == set(env.spec.obs_shapes)
        for _ in range(5):
            out = env.step(torch.rand(2, env.spec.action_dim) * 2 - 1)
        assert out.batch_size == torch.Size([2])
        for key, shape in env.spec.obs_shapes.items():
            assert out["obs", key].shape == (2, *shape)
            assert out["next", "obs", key].shape == (2, *shape)
        assert out["next", "reward"].dtype == torch.float32
        for flag in ("terminated", "truncated", "done", "success"):
            assert out["next", flag].dtype == torch.bool and out["next", flag].shape == (2,)
        assert out.device in (None, torch.device("cpu"))
    finally:
        env.close()


def test_auto_reset_hands_back_final_and_first_observation():
    env = make_env(EnvConfig(name="gym/Pendulum-v1", num_envs=2, max_episode_steps=3))
    env.reset(seed=[0, 1])
    outs = [env.step(torch.zeros(2, 1)) for _ in range(3)]
    last = outs[-1]
    assert last["next", "truncated"].all() and last["next", "done"].all()
    assert not last["next", "terminated"].any()
    # the final obs continues the episode; the root obs is a fresh start
    assert not torch.equal(last["next", "obs", "state"], last["obs", "state"])
    assert torch.equal(outs[1]["obs", "state"], outs[1]["next", "obs", "state"])


def test_same_seeds_give_the_same_rollout():
    def run():
        env = make_env(EnvConfig(name="gym/Pendulum-v1", num_envs=2))
        env.reset(seed=[3, 4])
        return env.step(torch.ones(2, 1))["next", "obs", "state"]

    assert torch.equal(run(), run())


def test_unknown_env_lists_registered_names():
    with pytest.raises(EnvError, match=r"Unknown env 'Nope/Task-v1'. Known: .*ManiSkill/\*"):
        make_env(EnvConfig(name="Nope/Task-v1"))


def test_unknown_maniskill_task_suggests_the_closest():
    with pytest.raises(EnvError, match="Did you mean 'PushCube-v1'"):
        make_env(EnvConfig(name="ManiSkill/PushCub-v1"))


def test_maniskill_task_with_missing_assets_says_how_to_get_them():
    with pytest.raises(EnvError, match="download_asset"):
        make_env(EnvConfig(name="ManiSkill/PickSingleYCB-v1"))


def test_obs_mode_the_adapter_cannot_render_is_rejected():
    with pytest.raises(EnvError, match="obs_mode='depth'"):
        make_env(EnvConfig(name="ManiSkill/PushCube-v1", obs_mode="depth"))


def test_register_twice_needs_override():
    register_env("Test/Twice-v1", GymnasiumEnv)
    with pytest.raises(EnvError, match="override=True"):
        register_env("Test/Twice-v1", "some.module:Other")
    register_env("Test/Twice-v1", "some.module:Other", override=True)
    assert "Test/Twice-v1" in registered_envs()


def test_decorator_registration_is_found_by_make_env():
    @register_env("Test/Pendulum-v1", override=True)
    class Pendulum(GymnasiumEnv):
        def __init__(self, cfg, device="cpu"):
            cfg.name = "gym/Pendulum-v1"
            super().__init__(cfg, device)

    env = make_env(EnvConfig(name="Test/Pendulum-v1", num_envs=2))
    assert isinstance(env, Pendulum) and env.spec.action_dim == 1


def test_maniskill_rgb_observations_render_on_this_machine():
    env = make_env(EnvConfig(name="ManiSkill/PushCube-v1", num_envs=2, obs_mode="rgb",
                             image_size=32))
    try:
        obs = env.reset(seed=[0, 1])["obs"]
        assert obs["rgb"].shape == (2, 32, 32, 3) and obs["rgb"].dtype == torch.uint8
        assert obs["rgb"].float().std() > 0  # a real picture, not a blank frame
    finally:
        env.close()


def test_maniskill_privileged_state_is_the_simulators_state_now():
    """``env.privileged_state``: ("obs", "privileged") equals ManiSkill's own get_state() of an
    independent env given the same seed and actions, at the reset and after steps."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401

    cfg = EnvConfig(name="ManiSkill/PushCube-v1", num_envs=2, obs_mode="rgb", image_size=32,
                    control_mode="pd_ee_delta_pos", privileged_state=True)
    env = make_env(cfg)
    ref = gym.make("PushCube-v1", num_envs=1, obs_mode="state", control_mode="pd_ee_delta_pos",
                   sim_backend="physx_cpu", render_backend="none")
    try:
        assert env.spec.obs_shapes["privileged"] == tuple(ref.unwrapped.get_state().shape[1:])
        obs = env.reset(seed=[7, 8])["obs"]
        ref.reset(seed=8)
        torch.testing.assert_close(obs["privileged"][1], ref.unwrapped.get_state()[0].float())
        cube = ref.unwrapped.obj.pose.p[0].float()  # the cube's position is in it
        assert any(torch.allclose(obs["privileged"][1][i:i + 3], cube)
                   for i in range(obs["privileged"].shape[1] - 2))
        action = torch.tensor([[0.0, 0.0, -1.0, 0.0], [0.5, -0.5, -1.0, 0.0]])
        for _ in range(3):
            out = env.step(action)
            ref.step(action[1:])
        moved = out["obs"]["privileged"][1]
        torch.testing.assert_close(moved, ref.unwrapped.get_state()[0].float(), atol=1e-4, rtol=0)
        assert (moved - obs["privileged"][1]).abs().max() > 1e-3  # the arm moved: not the reset's
    finally:
        env.close()
        ref.close()


@pytest.mark.parametrize("name,obs_mode,fix", [
    ("ManiSkill/PushCube-v1", "state", "env.obs_mode=rgb"),
    ("gym/Pendulum-v1", "state", "gym/\\* envs"),
    ("LIBERO/libero_spatial", "rgb", "ManiSkill's does"),
])
def test_privileged_state_where_it_cannot_be_given_is_one_line(name, obs_mode, fix):
    with pytest.raises(EnvError, match=f"env.privileged_state=true.*{fix}"):
        env_class(name).check_config(EnvConfig(name=name, obs_mode=obs_mode,
                                               privileged_state=True))


def test_importing_envs_imports_no_simulator():
    import subprocess
    import sys

    code = "import sys, m2flow.envs; print('mani_skill' in sys.modules or 'sapien' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_gpu_physx_that_cannot_load_is_one_line_naming_the_library_and_the_fix(monkeypatch):
    """On the GPU machine without network (scripts/gpu_check.sh), SAPIEN's download of its GPU
    PhysX library failed with a requests traceback from inside the env worker."""
    import requests
    import sapien

    from m2flow.envs.base import EnvError
    from m2flow.envs.maniskill import enable_gpu_physx

    def offline():
        raise requests.ConnectionError("Failed to resolve 'github.com'")

    monkeypatch.setattr(sapien.physx, "enable_gpu", offline)
    with pytest.raises(EnvError) as e:
        enable_gpu_physx()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("env.sim_backend=gpu: ")
    assert "ConnectionError" in msg and f"/.sapien/physx/{sapien.physx.version()}" in msg
    assert "linux-so.zip" in msg and msg.endswith("or set env.sim_backend=cpu.")
