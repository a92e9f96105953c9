"""GRPO group resets on real simulators, and action chunks executed as K env steps (issue 5)."""

import pytest
import torch

from m2flow.runs import seeding
from m2flow.embodied.workers.env_worker import EnvWorker
from m2flow.envs import EnvConfig, env_config, make_env
from m2flow.envs.chunked import ChunkedEnv
from m2flow.pipelines import RankResources, WorkerInfo


def group_reset(cfg: EnvConfig, group_size: int, iteration: int = 0):
    info = WorkerInfo("env", 0, 1, RankResources(0, 1.0, ()), "local")
    worker = EnvWorker(info, cfg, seed=0, groups=1, reset_group_size=group_size)
    try:
        return worker._reset(seeding.TRAIN, iteration)[0]
    finally:
        worker.close()


@pytest.mark.parametrize("cfg", [
    env_config(name="ManiSkill/PushCube-v1", num_envs=4, obs_mode="state"),
    pytest.param(env_config(name="LIBERO/libero_spatial", num_envs=4, obs_mode="rgb",
                            image_size=32, settle_steps=0),
                 marks=pytest.mark.slow),  # a minute of 4 LIBERO scenes; the same worker code
], ids=["maniskill", "libero"])
def test_envs_of_a_group_share_their_initial_state_and_groups_differ(cfg):
    obs = group_reset(cfg, group_size=2)
    key = "rgb" if "rgb" in obs.keys() else "state"
    x = obs[key]
    assert torch.equal(x[0], x[1]) and torch.equal(x[2], x[3])
    assert not torch.equal(x[0], x[2])
    if "task" in obs.keys():  # LIBERO: a group is one task
        assert obs["task"][0] == obs["task"][1] and obs["task"][2] == obs["task"][3]


def test_group_size_must_divide_the_envs():
    with pytest.raises(ValueError, match="algorithm.group_size=3"):
        group_reset(env_config(name="gym/Pendulum-v1", num_envs=4), group_size=3)


def test_a_chunk_is_k_steps_with_the_episode_boundary_kept():
    from tests.fakes import (
        register,  # test/Counter: episodes of 5 steps, reward = action
    )

    register()
    env = ChunkedEnv(make_env(env_config(name="test/Counter", num_envs=2)))
    env.reset(seed=[0, 1])
    first = env.step(torch.ones(2, 3, 1))  # steps 1-3
    assert first["next", "reward"].tolist() == [3.0, 3.0]
    assert first["next", "num_steps"].tolist() == [3, 3] and not first["next", "done"].any()
    chunk = torch.tensor([1.0, 10.0, 100.0]).view(1, 3, 1).expand(2, 3, 1)
    second = env.step(chunk)  # steps 4, 5 (episode ends), then step 1 of the next episode
    assert second["next", "done"].all()
    assert second["next", "reward"].tolist() == [11.0, 11.0]  # 100 went to the next episode
    assert second["next", "step_reward"][0].tolist() == [1.0, 10.0, 100.0]
    assert second["next", "step_done"][0].tolist() == [False, True, False]
    assert second["next", "num_steps"].tolist() == [2, 2]
    assert second["next", "obs", "state"][0, 1].item() == 5  # final obs: t = 5
    assert second["obs", "state"][0, 1].item() == 1  # acting on: step 1 of the new episode
    plain = env.step(torch.ones(2, 1))  # (n, A) passes through
    assert "num_steps" not in plain["next"].keys()


def test_a_chunk_can_hand_back_every_steps_frame_for_videos():
    from tensordict import TensorDict

    from m2flow.envs.chunked import combine

    def step(t, done):
        img = torch.full((2, 4, 4, 3), t, dtype=torch.uint8)
        flag = torch.tensor([done, False])
        return TensorDict({"obs": {"rgb": img}, "next": {
            "obs": {"rgb": img}, "reward": torch.ones(2), "done": flag, "terminated": flag,
            "truncated": torch.zeros(2, dtype=torch.bool), "success": flag}}, batch_size=[2])

    out = combine([step(1, False), step(2, True), step(3, False)], frames_key="rgb")
    assert out["next", "frames"].shape == (2, 3, 4, 4, 3)
    assert out["next", "num_steps"].tolist() == [2, 3]  # env 0's episode ended at step 2
    assert out["next", "frames"][0, :, 0, 0, 0].tolist() == [1, 2, 3]
    assert "frames" not in combine([step(1, False)])["next"].keys()
