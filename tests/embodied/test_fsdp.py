"""Sharded learners (``cluster.placement.components.learner.shard=fsdp``): 2 gloo ranks on
CPU, FSDP2 over the policy, update as one unsharded process does on the same global batch.

Tolerance: as in ``test_data_parallel.py``: the ranks reduce-scatter their gradients in
another summation order than one process adds them, so weights agree up to float rounding;
after one PPO update (3 epochs x 4 minibatches, Adam) the measured max difference is about
6e-8 against ``ATOL = 1e-5``. Gradients averaged over the 2 ranks (FSDP's default divide
factor) instead of summed halve every step's gradient; the clip and Adam's normalisation
absorb much of that, but the weights still end 3e-3 apart (measured), 300x the tolerance. A
sharded method registered with FSDP's own ``register_fsdp_forward_method``, which cannot see
the tensors in the TensorDict a policy returns, reduces no gradient at all: the weights stay
where they started, 0.1 from the one-process update (measured).
"""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict
from torch.distributed.fsdp import FSDPModule

from m2flow import keys
from m2flow.embodied.algorithms.ppo import PPO, PPOConfig
from m2flow.embodied.workers.learner_worker import POLICY_METHODS, LearnerWorker
from m2flow.envs import EnvSpec
from m2flow.pipelines import PlacementError, RankResources, WorkerInfo, distributed
from m2flow.pipelines.fsdp import block_units
from m2flow.pipelines.placement import ComponentPlacement, PlacementConfig, check_placement
from m2flow.policies import make_policy, policy_config
from m2flow.runs.learner import Trainer, minibatch_generator
from tests.embodied.test_data_parallel import (  # noqa: F401
    EPOCHS, ITERATION, LR, MAX_GRAD_NORM, MINIBATCHES, POLICY, SEED, SPEC, Trajectories,
    assert_weights_close, flat_batch, policy, ppo_config, reference_update, spawn,
)


def _trainer_rank(rank: int, spec, out_dir: str, micro, split) -> None:
    """A rank of the sharded Trainer: PPO's update on its rows of the global batch."""
    dp = distributed.join(spec, rank, "cpu")
    try:
        torch.set_num_threads(1)
        pi = policy()
        if rank == 1:  # a different start: the group must begin from rank 0's weights
            torch.nn.init.normal_(pi.actor_mean[0].weight)
        algo = PPO(ppo_config(micro_batch_size=micro), action_dim=2, seed=SEED)
        algo.data_parallel = dp
        trainer = Trainer(pi, lambda p: torch.optim.Adam(p, lr=LR, eps=1e-5), precision="fp32",
                          max_grad_norm=MAX_GRAD_NORM, data_parallel=dp, shard="fsdp",
                          forward_methods=POLICY_METHODS)
        shard_rows = pi.actor_mean[0].weight.to_local().shape[0]  # this rank's shard of it
        batch = flat_batch()
        mine = batch[:split] if rank == 0 else batch[split:]
        terms = algo.train(pi, mine, trainer, iteration=ITERATION, seed=SEED)
        weights = trainer.model_state_dict()  # a collective: rank 0 gets the whole tensors
        torch.save({"weights": weights, "terms": terms, "shard_rows": shard_rows},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        distributed.leave()


@pytest.mark.parametrize("micro, split", [
    (None, 29),  # rank 0 holds rows [0, 29) of the 64-row global batch, rank 1 the rest
    (5, 62),  # rank 1 holds 2 rows: zero-weight filler forwards on its empty shares
], ids=["whole_minibatches", "micro_batches_empty_shares"])
def test_sharded_update_equals_one_process_on_the_global_batch(tmp_path, micro, split):
    spawn(_trainer_rank, str(tmp_path), micro, split)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["shard_rows"] + r1["shard_rows"] == 16  # really sharded: hidden 16 split in 2
    assert r0["shard_rows"] < 16
    want, _ = reference_update(flat_batch(), ppo_config())
    diff = assert_weights_close(r0["weights"], want)
    print(f"max |2 sharded ranks - 1 process| = {diff:.2e}")
    assert r1["weights"] == {}  # the whole weights go to rank 0 only
    start = policy().state_dict()
    assert any(not torch.allclose(want[k], start[k], atol=1e-3) for k in start)  # it learned
    assert r0["terms"] == r1["terms"]  # the global minibatch's terms on every rank


def _learner(rank: int, world: int, spec=None, shard: str = "fsdp") -> LearnerWorker:
    info = WorkerInfo("learner", rank, world, RankResources(0, 1.0, (), shard=shard), "local",
                      spec)
    algo = PPOConfig(learning_rate=LR, update_epochs=EPOCHS, num_minibatches=MINIBATCHES,
                     target_kl=None, max_grad_norm=MAX_GRAD_NORM)
    return LearnerWorker(info, POLICY, algo, SPEC, seed=SEED, num_iterations=10)


class Fresh(Trajectories):
    """``Trajectories`` collected with the weights of the update that reads them."""

    def __init__(self, iteration: int):
        self.iteration = iteration

    def get(self, key, timeout=None):
        traj = super().get(key, timeout)
        traj[keys.POLICY_VERSION] = torch.full((2, 8), self.iteration)
        return traj


def _update(worker: LearnerWorker, iteration: int) -> dict:
    return worker.update(Fresh(iteration), env_ranks=[0, 1, 2, 3], iteration=iteration)


def _worker_rank(rank: int, spec, out_dir: str) -> None:
    """Update, sync manifest, checkpoint; another update; the checkpoint loaded, that update
    again. Every call on every rank, as the runner makes them."""
    torch.set_num_threads(1)
    worker = _learner(rank, 2, spec)
    try:
        out = {"metrics": _update(worker, ITERATION), "synced": worker.get_weights()}
        if rank == 0:  # the runner prepares syncs on rank 0 alone
            manifest = worker.prepare_weight_sync(full=False, bucket_mb=1.0)  # a delta sync's
            out["plan"] = (manifest.keys, manifest.specs)
        state = worker.state_dict()  # every rank takes part; rank 0 gets it
        if rank == 0:
            torch.save(state, f"{out_dir}/checkpoint.pt")
        worker.data_parallel.gather_objects(None)  # (a barrier: the file is written)
        _update(worker, ITERATION + 1)
        out["next"] = worker.get_weights()
        worker.load_state_dict(torch.load(f"{out_dir}/checkpoint.pt"))  # as a resume does
        _update(worker, ITERATION + 1)
        out["resumed"] = worker.get_weights()
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        worker._m2flow_leave_process_group()


def test_sharded_learner_syncs_and_checkpoints_whole_weights_and_resumes(tmp_path):
    """The weights a sync sends and a checkpoint holds are the one-rank learner's; the
    checkpoint is an unsharded one (a one-rank learner resumes from it) and a sharded resume
    continues as the run that never stopped."""
    spawn(_worker_rank, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    one = _learner(0, 1, shard="none")
    before = one.get_weights()
    want_metrics = _update(one, ITERATION)
    want_state = copy.deepcopy(one.state_dict())  # (on CPU it holds Adam's live step counts)
    want_manifest = one.prepare_weight_sync(full=False, bucket_mb=1.0)
    _update(one, ITERATION + 1)
    want_next = one.get_weights()

    assert_weights_close(r0["synced"], want_state["policy"])  # weights and obs statistics
    assert not torch.equal(r0["synced"]["actor_mean.0.weight"], before["actor_mean.0.weight"])
    assert r1["synced"] == {}  # rank 0 holds the whole copy
    for k, v in want_metrics.items():
        assert r0["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6, nan_ok=True), k
    assert r0["plan"] == (want_manifest.keys, want_manifest.specs)
    saved = torch.load(tmp_path / "checkpoint.pt")
    assert saved["optimizer"]["param_groups"] == want_state["optimizer"]["param_groups"]
    for i, moments in want_state["optimizer"]["state"].items():  # Adam's, in the same layout
        for name, v in moments.items():
            torch.testing.assert_close(saved["optimizer"]["state"][i][name], v, atol=1e-5,
                                       rtol=1e-5)
    assert_weights_close(r0["next"], want_next)
    for k, v in r0["next"].items():  # resumed = never stopped, bit for bit
        assert torch.equal(r0["resumed"][k], v), k
    other = _learner(0, 1, shard="none")  # a sharded run's checkpoint, resumed unsharded
    other.load_state_dict(saved)
    _update(other, ITERATION + 1)
    assert_weights_close(other.get_weights(), want_next)


def test_shard_modes_are_checked_and_blocks_found():
    with pytest.raises(PlacementError, match=r"learner\.shard='zero3' is not a sharding mode"):
        check_placement(PlacementConfig(components={"learner": ComponentPlacement(shard="zero3")}))
    with pytest.raises(ValueError, match="shard='ddp'"):
        Trainer(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), shard="ddp")
    one = Trainer(policy(), lambda p: torch.optim.SGD(p, lr=0.1), shard="fsdp")
    assert not one.sharded  # one rank: nothing to shard
    assert block_units(policy()) == []  # the MLP policy: the root holds everything


# -- a transformer policy: its blocks sharded one by one --------------------------------------
VLA_KW = {"image_size": 32, "vision": ["timm/vit_tiny_patch16_224"], "chunk": 2,
          "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_layers": 2,
          "image_keys": ["rgb"], "center_crop": False}
VLA_SPEC = EnvSpec({"rgb": (32, 32, 3), "state": (8,), "task": ()}, 7, (-1.0,) * 7, (1.0,) * 7,
                   10, tasks=("pick up the bowl", "open the drawer"))
VLA_ROWS, VLA_LR = 8, 1.0
VLA_CLIP = 100.0  # the norm over the shards is computed; no step is clipped (see the test)


def vla():
    torch.manual_seed(SEED)
    return make_policy(policy_config(name="openvla_oft", **VLA_KW), VLA_SPEC)


def vla_batch() -> TensorDict:
    g = torch.Generator().manual_seed(0)
    n = VLA_ROWS
    obs = {"rgb": torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g),
           "state": torch.randn(n, 8, generator=g) * 0.4, "task": torch.arange(n) % 2}
    tokens = torch.randint(0, 256, (n, VLA_KW["chunk"] * 7), generator=g)
    return TensorDict({"obs": obs, keys.ACTION_TOKENS: tokens}, batch_size=[n])


def vla_loss(pi, mb: TensorDict) -> TensorDict:
    """The demonstrated tokens' mean negative log-likelihood (behaviour cloning's)."""
    return TensorDict({"loss_nll": -pi.evaluate_actions(mb)[keys.TOKEN_LOG_PROB].mean()}, [])


def vla_update(pi, trainer: Trainer, batch: TensorDict) -> dict:
    """One epoch of 2 minibatches in micro-batches of 3, as an algorithm's loop takes them;
    the last minibatch's terms."""
    for mb in trainer.minibatches(batch, 2, minibatch_generator(SEED, 0)):
        terms = trainer.gradients(mb, lambda m: vla_loss(pi, m), micro_batch_size=3)
        terms["grad_norm"] = trainer.step()
    return terms


def _vla_rank(rank: int, spec, out_dir: str) -> None:
    dp = distributed.join(spec, rank, "cpu")
    try:
        torch.set_num_threads(1)
        pi = vla()
        trainer = Trainer(pi, lambda p: torch.optim.SGD(p, lr=VLA_LR), precision="fp32",
                          max_grad_norm=VLA_CLIP, data_parallel=dp, shard="fsdp",
                          forward_methods=POLICY_METHODS)
        units = [type(m).__name__ for m in pi.modules() if isinstance(m, FSDPModule)]
        batch = vla_batch()
        terms = vla_update(pi, trainer, batch[:7] if rank == 0 else batch[7:])
        torch.save({"weights": trainer.model_state_dict(), "units": units, "terms": terms},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        distributed.leave()


def test_sharded_transformer_policy_updates_as_one_process(tmp_path):
    """The tiny OpenVLA-OFT: ViT and Llama blocks each an FSDP unit, the rest the root's.
    Shares of 7 and 1 rows, micro-batches of 3: in the second minibatch rank 0 holds 4 rows
    (2 micro-batches) and rank 1 none (2 filler forwards). SGD, so a gradient of the wrong
    scale shows (Adam's first steps hardly depend on it): averaged instead of summed, the
    weights end 0.97 apart (measured), against 5e-7 here and ``ATOL = 1e-5``."""
    spawn(_vla_rank, str(tmp_path))
    got = torch.load(tmp_path / "rank0.pt")
    assert sorted(set(got["units"])) == ["FSDPBlock", "FSDPLlamaDecoderLayer",
                                         "FSDPOpenVLAOFTPolicy"]
    assert got["units"].count("FSDPLlamaDecoderLayer") == 2
    pi = vla()
    start = {k: v.clone() for k, v in pi.state_dict().items()}
    trainer = Trainer(pi, lambda p: torch.optim.SGD(p, lr=VLA_LR), precision="fp32",
                      max_grad_norm=VLA_CLIP)
    terms = vla_update(pi, trainer, vla_batch())
    want = pi.state_dict()
    diff = assert_weights_close(got["weights"], want)
    print(f"max |2 sharded ranks - 1 process| = {diff:.2e}")
    assert got["terms"]["grad_norm"] == pytest.approx(terms["grad_norm"], rel=1e-5)
    assert got["terms"]["loss_nll"] == pytest.approx(terms["loss_nll"], rel=1e-5)
    moved = sorted(float((want[k] - start[k]).abs().max()) for k in want)
    assert moved[len(moved) // 2] > 1e-3  # it learned, blocks and root alike


def test_ppo_trains_with_sharded_learner_ranks_under_ray(tmp_path, ray_cluster):
    """The real run (Pendulum: a quick start): 2 learner ranks with shard=fsdp (gloo), 2
    iterations, weights broadcast over a link in small buckets; the rollout holds rank 0's
    gathered weights, and the checkpoint (every learner rank asked) holds them too."""
    from m2flow.cli.common import load_run_config
    from m2flow.embodied.workers.rollout_worker import RolloutWorker
    from m2flow.embodied.runner import EmbodiedRunner
    from m2flow.runs import checkpoint

    cfg = load_run_config("maniskill_pushcube_ppo_mlp", [
        "env=gym_pendulum", "env.num_envs=2",
        "cluster.placement.components.learner.workers=2",
        "cluster.placement.components.learner.shard=fsdp",
        "cluster.placement.components.env.workers=2", "cluster.weight_sync=dist",
        "runner.rollout_steps=8", "runner.num_iterations=2", "runner.eval_interval=0",
        "runner.progress_bar=false", "policy.hidden_sizes=[16,16]",
        "runner.weight_sync_bucket_mb=0.0005", f"runner.log_dir={tmp_path}"])
    runner = EmbodiedRunner(cfg)
    try:
        result = runner.train()
        learner = runner.learner.call(LearnerWorker.get_weights).wait()
        rollout = runner.rollout.call(RolloutWorker.get_weights).wait()[0]
    finally:
        runner.close()
    assert result["iterations"] == 2 and learner[1] == {}
    saved = checkpoint.load(result["checkpoint"])["learner"]
    for k, w in learner[0].items():
        assert torch.equal(saved["policy"][k], w) and torch.equal(rollout[k].float(), w), k
    params = [k for k in learner[0] if not k.startswith("obs_norm.")]
    assert sorted(saved["optimizer"]["state"]) == list(range(len(params)))  # Adam's, each
