"""Data-parallel learners: 2 gloo ranks on CPU update a policy as one rank does on the same
global batch.

Tolerance: the ranks sum their gradients in another order than one rank does, and the
advantage statistics come from summed moments, so the weights agree up to float rounding;
after one PPO update (3 epochs x 4 minibatches, Adam) the measured max difference is about
1e-7 against ``ATOL = 1e-5``. A gradient that is not summed over the ranks, or advantages
normalised per rank, moves weights by about the learning rate (1e-2 here): 1000x the tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.algorithms.grpo import GRPOConfig
from m2flow.embodied.algorithms.ppo import PPO, PPOConfig, ppo_loss
from m2flow.embodied.workers.learner_worker import LearnerWorker, env_ranks_of, learner_rank
from m2flow.envs import EnvSpec
from m2flow.pipelines import RankResources, WorkerInfo, distributed
from m2flow.policies import make_policy, policy_config
from m2flow.runs import checkpoint, seeding
from m2flow.runs.learner import Trainer
from tests.embodied.test_learner import trajectory

ATOL, RTOL = 1e-5, 1e-5
SPEC = EnvSpec({"state": (4,)}, 2, (-1.0, -1.0), (1.0, 1.0), 8)
POLICY = policy_config(name="mlp", hidden_sizes=[16])
SEED, ITERATION = 3, 2
EPOCHS, MINIBATCHES, LR, MAX_GRAD_NORM = 3, 4, 1e-2, 0.5


def flat_batch(rows: int = 64) -> TensorDict:
    """A prepared PPO batch (B,) whose advantages have a mean and scale far from (0, 1)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return TensorDict({"obs": {"state": r(rows, 4)}, "action": r(rows, 2),
                       "log_prob": r(rows) - 2.0, "value": r(rows),
                       "advantage": 3.0 * r(rows) + 2.0, "return": r(rows)}, batch_size=[rows])


def ppo_config(target_kl=None, micro_batch_size=None) -> PPOConfig:
    return PPOConfig(learning_rate=LR, update_epochs=EPOCHS, num_minibatches=MINIBATCHES,
                     max_grad_norm=MAX_GRAD_NORM, norm_adv=True, target_kl=target_kl,
                     micro_batch_size=micro_batch_size)


def policy():
    torch.manual_seed(SEED)
    return make_policy(POLICY, SPEC, device="cpu")


def reference_update(batch: TensorDict, cfg: PPOConfig) -> tuple[dict, int]:
    """One process, written out plainly: the seeded permutation of the whole batch, advantages
    normalised per minibatch, one Adam step per minibatch, the KL stop after an epoch."""
    pi = policy()
    opt = torch.optim.Adam(pi.parameters(), lr=LR, eps=1e-5)
    gen = torch.Generator().manual_seed(seeding.derive(SEED, seeding.LEARN, ITERATION, 0)[0])
    size = batch.shape[0]
    mb_size = size // MINIBATCHES
    for epoch in range(EPOCHS):
        perm = torch.randperm(size, generator=gen)
        for start in range(0, size, mb_size):
            mb = batch[perm[start:start + mb_size]].clone()
            adv = mb["advantage"]
            mb["advantage"] = (adv - adv.mean()) / (adv.std() + 1e-8)
            terms = ppo_loss(pi, mb, clip_coef=cfg.clip_coef, vf_coef=cfg.vf_coef,
                             ent_coef=cfg.ent_coef)
            opt.zero_grad()
            sum(v for k, v in terms.items() if k.startswith("loss_")).backward()
            torch.nn.utils.clip_grad_norm_(pi.parameters(), MAX_GRAD_NORM)
            opt.step()
        if cfg.target_kl is not None and float(terms["approx_kl"]) > cfg.target_kl:
            return pi.state_dict(), epoch + 1
    return pi.state_dict(), EPOCHS


def _trainer_rank(rank: int, spec, out_dir: str, target_kl, micro, split) -> None:
    """A rank of the Trainer test: PPO's update on its rows of the global batch."""
    dp = distributed.join(spec, rank, "cpu")
    try:
        torch.set_num_threads(1)
        pi = policy()
        if rank == 1:  # a different start: the group must begin from rank 0's weights
            torch.nn.init.normal_(pi.actor_mean[0].weight)
        algo = PPO(ppo_config(target_kl, micro), action_dim=2, seed=SEED)
        algo.data_parallel = dp
        trainer = Trainer(pi, lambda p: torch.optim.Adam(p, lr=LR, eps=1e-5), precision="fp32",
                          max_grad_norm=MAX_GRAD_NORM, data_parallel=dp)
        batch = flat_batch()
        mine = batch[:split] if rank == 0 else batch[split:]
        terms = algo.train(pi, mine, trainer, iteration=ITERATION, seed=SEED)
        torch.save({"weights": pi.state_dict(), "terms": terms}, f"{out_dir}/rank{rank}.pt")
    finally:
        distributed.leave()


def spawn(fn, *args) -> None:
    spec = distributed.ProcessGroupSpec("127.0.0.1", distributed.free_port(), 2, "gloo",
                                        timeout_s=120)
    mp.start_processes(fn, args=(spec, *args), nprocs=2, start_method="spawn")


def assert_weights_close(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=ATOL, rtol=RTOL,
                                   msg=lambda m, k=k: f"{k}: {m}")
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in want)


@pytest.mark.parametrize("target_kl, micro, split", [
    (None, None, 29),  # rank 0 holds rows [0, 29) of the 64-row global batch, rank 1 the rest
    (1e-3, 5, 29),  # micro-batches of 5 rows; the KL stop after the first epoch
    (None, None, 62),  # rank 1 holds 2 rows: its share of most minibatches is empty
], ids=["all_epochs", "kl_stop_micro_batches", "empty_shares"])
def test_two_ranks_update_equals_one_process_on_the_global_batch(tmp_path, target_kl, micro,
                                                                 split):
    spawn(_trainer_rank, str(tmp_path), target_kl, micro, split)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    want, epochs = reference_update(flat_batch(), ppo_config(target_kl))
    assert (epochs < EPOCHS) == (target_kl is not None)  # the KL stop is really exercised
    for got in ranks:
        assert got["terms"]["loss/early_stop"] == float(epochs < EPOCHS)
        diff = assert_weights_close(got["weights"], want)
        print(f"max |2 ranks - 1 process| = {diff:.2e}")
    for k, w in ranks[0]["weights"].items():  # identical steps: identical weights
        assert torch.equal(w, ranks[1]["weights"][k]), k
    start = policy().state_dict()
    assert any(not torch.allclose(want[k], start[k], atol=1e-3) for k in start)  # it learned


class Trajectories:
    """The channel the learner reads: env rank e's (N, T) trajectory, some steps not valid
    (so the ranks hold unequal numbers of rows), one env of each GRPO group of 2 succeeding."""

    def get(self, key, timeout=None):
        traj = trajectory(n=2, t=8, seed=key)
        traj[keys.VALID] = torch.ones(2, 8, dtype=torch.bool)
        traj[keys.VALID][0, : 2 * key] = False
        traj[keys.SUCCESS][1] = False
        traj[keys.POLICY_VERSION] = torch.full((2, 8), ITERATION)
        return traj


def _learner(algorithm: str, rank: int, world: int, spec=None) -> LearnerWorker:
    info = WorkerInfo("learner", rank, world, RankResources(0, 1.0, ()), "local", spec)
    common = dict(learning_rate=LR, update_epochs=EPOCHS, num_minibatches=MINIBATCHES)
    algo = (PPOConfig(target_kl=None, **common) if algorithm == "ppo"
            else GRPOConfig(group_size=2, **common))
    return LearnerWorker(info, POLICY, algo, SPEC, seed=SEED, num_iterations=10)


def _worker_rank(rank: int, spec, out_dir: str, algorithm: str) -> None:
    torch.set_num_threads(1)
    worker = _learner(algorithm, rank, 2, spec)
    try:
        metrics = worker.update(Trajectories(), env_ranks=[0, 1, 2, 3], iteration=ITERATION)
        torch.save({"weights": worker.get_weights(), "metrics": metrics},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        worker._m2flow_leave_process_group()


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_learner_ranks_split_env_workers_and_update_as_one_learner(tmp_path, algorithm):
    """Env ranks 0-1 go to learner rank 0 and 2-3 to rank 1; GAE and GRPO's groups stay
    within an env worker, so within a rank."""
    assert [learner_rank(e, 4, 2) for e in range(4)] == [0, 0, 1, 1]
    assert env_ranks_of(1, [0, 1, 2, 3], 2) == [2, 3]
    spawn(_worker_rank, str(tmp_path), algorithm)
    one = _learner(algorithm, 0, 1)
    before = one.get_weights()
    want = one.update(Trajectories(), env_ranks=[0, 1, 2, 3], iteration=ITERATION)
    assert not torch.equal(before["actor_mean.0.weight"], one.get_weights()["actor_mean.0.weight"])
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        # weights and the observation statistics (from the global batch) alike
        assert_weights_close(got["weights"], one.get_weights())
        assert got["metrics"].keys() == want.keys()
        for k, v in want.items():
            assert got["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6, nan_ok=True), k


def test_learner_ranks_on_cpu_use_gloo_on_own_gpus_nccl_and_on_a_shared_gpu_gloo():
    cpu, gpu = RankResources(0, 1.0, ()), lambda i: RankResources(0, 1.0, (i,))
    assert distributed.backend_for([cpu, cpu]) == "gloo"
    assert distributed.backend_for([gpu(0), gpu(1)]) == "nccl"
    assert distributed.backend_for([gpu(0), gpu(0)]) == "gloo"  # NCCL: one rank per GPU
    with pytest.raises(ValueError, match="some ranks have GPUs"):
        distributed.backend_for([gpu(0), cpu])


@pytest.mark.slow  # a minute; CI: the ranks' update above and the sharded run under Ray (test_fsdp)
def test_pushcube_ppo_trains_with_two_learner_ranks_under_ray(tmp_path, ray_cluster):
    """The real run: 2 env workers -> 2 learner ranks (gloo), 2 iterations, a checkpoint."""
    from m2flow.cli.common import load_run_config
    from m2flow.embodied.runner import EmbodiedRunner

    cfg = load_run_config("maniskill_pushcube_ppo_mlp", [
        "cluster.placement.components.learner.workers=2",
        "cluster.placement.components.learner.cpus=1",
        "cluster.placement.components.env.workers=2",
        "env.num_envs=2", "runner.rollout_steps=16", "runner.num_iterations=2",
        "runner.eval_interval=0", "runner.eval_episodes=2", "runner.progress_bar=false",
        "policy.hidden_sizes=[32,32]", f"runner.log_dir={tmp_path}"])
    runner = EmbodiedRunner(cfg)
    try:
        assert runner.learner.world_size == 2 and runner.learner.process_group.backend == "gloo"
        result = runner.train()
        ranks = runner.learner.call(LearnerWorker.get_weights).wait()
    finally:
        runner.close()
    assert result["iterations"] == 2 and result["env_steps"] == 2 * 2 * 2 * 16
    for k, w in ranks[0].items():  # one model: every rank's copy alike
        assert torch.equal(w, ranks[1][k]), k
    saved = checkpoint.load(result["checkpoint"])["learner"]["policy"]  # rank 0's
    assert all(torch.equal(saved[k], w) for k, w in ranks[0].items())
