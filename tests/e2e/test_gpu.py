"""GPU paths: run with `pytest -m gpu` on a CUDA machine (deselected by default)."""

import pytest
import torch

from m2flow.envs import env_config, make_env
from m2flow.pipelines import RankResources, Worker, WorkerGroup

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def gpu_physx():
    """SAPIEN's GPU PhysX, or a skip that says why (it is downloaded from GitHub at first use:
    the GPU machine of scripts/gpu_check.sh has no network)."""
    from m2flow.envs.base import EnvError
    from m2flow.envs.maniskill import enable_gpu_physx

    try:
        enable_gpu_physx()
    except EnvError as e:
        pytest.skip(str(e))


def test_maniskill_gpu_backend_steps_a_native_batch(gpu_physx):
    cfg = env_config(name="ManiSkill/PushCube-v1", num_envs=16, sim_backend="gpu",
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


def test_maniskill_gpu_envs_of_one_seed_start_alike_and_groups_differ(gpu_physx):
    cfg = env_config(name="ManiSkill/PickCube-v1", num_envs=8, sim_backend="gpu")
    env = make_env(cfg, device="cuda")
    seeds = [101] * 3 + [202] * 3 + [303, 404]
    try:
        for rebuild in (False, True):
            state = env.reset(seed=seeds, rebuild=rebuild)["obs"]["state"]  # (8, D)
            for group in ([0, 1, 2], [3, 4, 5]):
                for i in group[1:]:
                    assert torch.equal(state[i], state[group[0]]), (rebuild, i)
            leaders = state[[0, 3, 6, 7]]
            assert torch.cdist(leaders, leaders).fill_diagonal_(1.0).min() > 0, rebuild
            # the shared state is a real simulator state: stepping all alike keeps them alike
            out = env.step(torch.zeros(8, env.spec.action_dim, device="cuda"))
            nxt = out["next", "obs", "state"]
            torch.testing.assert_close(nxt[1], nxt[0])
            torch.testing.assert_close(nxt[4], nxt[3])
    finally:
        env.close()


def _cuda_learner():
    from m2flow.embodied.algorithms.ppo import PPOConfig
    from m2flow.embodied.workers.learner_worker import LearnerWorker
    from m2flow.pipelines import RankResources, WorkerInfo
    from m2flow.policies import policy_config
    from tests.embodied.test_learner import SPEC

    info = WorkerInfo("learner", 0, 1, RankResources(0, 1.0, (0,)), "local")
    return LearnerWorker(info, policy_config(name="mlp", hidden_sizes=[16]),
                         PPOConfig(learning_rate=1e-2, target_kl=None), SPEC, seed=0,
                         num_iterations=10)


def test_a_cuda_learner_checkpoints_to_host_memory_and_resumes_from_it(tmp_path):
    from m2flow.runs import checkpoint
    from tests.embodied.test_learner import _leaves, _OneItem, trajectory

    traj = [trajectory(seed=s) for s in (0, 1)]
    straight, first = _cuda_learner(), _cuda_learner()
    for i in (0, 1):
        straight.update(_OneItem(traj[i]), env_ranks=[0], iteration=i)
    first.update(_OneItem(traj[0]), env_ranks=[0], iteration=0)
    assert next(iter(first.optimizer.state.values()))["exp_avg"].is_cuda
    state = first.state_dict()
    tensors = [t for t in _leaves(state) if isinstance(t, torch.Tensor)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    path = checkpoint.save(tmp_path / "c.pt", {"config": "", "learner": state})
    resumed = _cuda_learner()
    resumed.load_state_dict(checkpoint.load(path)["learner"])
    assert next(iter(resumed.optimizer.state.values()))["exp_avg"].is_cuda
    resumed.update(_OneItem(traj[1]), env_ranks=[0], iteration=1)
    for k, v in straight.get_weights().items():
        assert torch.equal(resumed.get_weights()[k], v), k


def test_bucketed_weight_sync_from_a_cuda_learner_to_a_cuda_rollout_copy():
    from m2flow.embodied.workers.rollout_worker import RolloutWorker
    from m2flow.pipelines import RankResources, WorkerInfo
    from m2flow.policies import policy_config
    from tests.embodied.test_learner import SPEC, _OneItem, trajectory

    learner = _cuda_learner()
    rollout = RolloutWorker(WorkerInfo("rollout", 0, 1, RankResources(0, 1.0, (0,)), "local"),
                            policy_config(name="mlp", hidden_sizes=[16]), SPEC, seed=1)
    for version, full in ((0, True), (1, False)):
        if version:
            learner.update(_OneItem(trajectory()), env_ranks=[0], iteration=0)
        manifest = learner.prepare_weight_sync(full=full, bucket_mb=2**-10)
        rollout.begin_weight_sync(manifest, version=version)
        for i in range(len(manifest.buckets)):
            bucket = learner.weight_bucket(index=i)
            assert all(t.device.type == "cpu" for t in bucket.whole.values())
            rollout.receive_weight_bucket(bucket)
        rollout.finish_weight_sync()
        for k, v in learner.policy.state_dict().items():
            assert torch.equal(rollout.policy.state_dict()[k], v), k


# -- issue 13: action chunks and placement GPU ids on a real GPU ---------------------------


def test_action_chunks_on_a_maniskill_gpu_batch_combine_on_the_gpu(gpu_physx):
    from m2flow.envs.chunked import ChunkedEnv, combine
    from tests.envs.test_chunked import steps

    # the pure function on CUDA inputs equals its CPU result
    on_gpu, on_cpu = combine(steps("cuda")), combine(steps("cpu"))
    for key, v in on_cpu.items(include_nested=True, leaves_only=True):
        assert on_gpu[key].device.type == "cuda" and torch.equal(on_gpu[key].cpu(), v), key
    # and a real GPU batch stepping (n, K, A) chunks
    cfg = env_config(name="ManiSkill/PushCube-v1", num_envs=8, sim_backend="gpu",
                     max_episode_steps=6)
    env = ChunkedEnv(make_env(cfg, device="cuda"))
    try:
        env.reset(seed=list(range(8)))
        out = env.step(torch.rand(8, 4, env.spec.action_dim, device="cuda") * 2 - 1)
        assert out["next", "num_steps"].device.type == "cuda"
        assert out["next", "step_reward"].shape == (8, 4)
    finally:
        env.close()


def test_placement_gpu_0_is_the_first_visible_gpu_in_a_ray_rank(ray_cluster):
    first = str(torch.cuda.get_device_properties(0).uuid)  # the driver's first visible GPU
    group = WorkerGroup(ray_cluster, "gpu_probe", DeviceProbe, [RankResources(0, 1.0, (0,))])
    try:
        (got,) = group.call(DeviceProbe.where).wait(timeout=120)
    finally:
        group.shutdown()
    assert got == (["cuda:0"], 1, first)


class DeviceProbe(Worker):
    def where(self):
        x = torch.ones(2, device=self.device)
        props = torch.cuda.get_device_properties(x.device)
        return self.devices, torch.cuda.device_count(), str(props.uuid)
