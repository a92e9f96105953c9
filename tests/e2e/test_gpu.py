"""GPU paths: run with `pytest -m gpu` on a CUDA machine (deselected by default)."""

import pytest
import torch

from m2flow.envs import EnvConfig, make_env

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_maniskill_gpu_backend_steps_a_native_batch():
    cfg = EnvConfig(name="ManiSkill/PushCube-v1", num_envs=16, sim_backend="gpu",
                    ignore_terminations=True)
    env = make_env(cfg, device="cuda")
    try:
        obs = env.reset(seed=list(range(16)))["obs"]
        assert obs["state"].device.type == "cuda" and obs["state"].shape[0] == 16
        for _ in range(env.spec.max_episode_steps):  # the last step truncates every env
            out = env.step(torch.rand(16, env.spec.action_dim, device="cuda") * 2 - 1)
        assert out["next", "done"].all() and out["next", "truncated"].all()
        assert not torch.equal(out["next", "obs", "state"], out["obs", "state"])
    finally:
        env.close()
