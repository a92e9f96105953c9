"""The learner worker on a synthetic (N, T) trajectory, in-process."""

import pytest
import torch
from tensordict import TensorDict

from m2flow.embodied.workers.learner_worker import LearnerWorker
from m2flow.embodied.algorithms.ppo import PPOConfig
from m2flow.envs import EnvSpec
from m2flow.pipelines import Channel, Cluster, ClusterConfig, RankResources, WorkerGroup
from m2flow.policies import policy_config

SPEC = EnvSpec({"state": (4,)}, 2, (-1.0, -1.0), (1.0, 1.0), 8)


def trajectory(n=3, t=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    done = torch.zeros(n, t, dtype=torch.bool)
    done[:, -1] = True
    return TensorDict({
        "obs": {"state": r(n, t, 4) + 5.0}, "action": r(n, t, 2), "log_prob": r(n, t),
        "value": r(n, t),
        "next": {"obs": {"state": r(n, t, 4)}, "reward": r(n, t), "terminated": done.clone(),
                 "truncated": torch.zeros_like(done), "done": done, "success": done},
    }, batch_size=[n, t])


@pytest.fixture
def learner():
    cluster = Cluster(ClusterConfig(backend="local", num_gpus=0))
    group = WorkerGroup(cluster, "learner", LearnerWorker, [RankResources(0, 1.0, ())],
                        policy_config(name="mlp", hidden_sizes=[16]),
                        PPOConfig(anneal_lr=True, learning_rate=1e-3), SPEC, seed=0, num_iterations=10)
    yield group, Channel("trajectory", group, item_type=TensorDict)
    group.shutdown()


def test_update_moves_weights_and_reports_loss_terms(learner):
    group, ch = learner
    before = group.call(LearnerWorker.get_weights).wait()[0]
    ch.put(trajectory(), key=0)
    metrics = group.call(LearnerWorker.update, ch, env_ranks=[0], iteration=5).wait()[0]
    after = group.call(LearnerWorker.get_weights).wait()[0]
    assert {"loss/loss_policy", "loss/loss_value", "loss/approx_kl"} <= set(metrics)
    assert metrics["loss/learning_rate"] == pytest.approx(1e-3 * (1 - 5 / 10))
    assert not torch.equal(before["actor_mean.0.weight"], after["actor_mean.0.weight"])
    # the normaliser saw the batch only after the update (mean of obs is about 5)
    assert after["obs_norm.mean"].mean().item() == pytest.approx(5.0, abs=0.5)
    assert before["obs_norm.count"].item() == 0.0


def test_a_stale_trajectory_is_revalued_so_gae_uses_one_critic(learner):
    group, ch = learner
    worker = group.handles[0]
    stale = trajectory()
    worker.algorithm.add_advantages(worker.policy, stale, revalue=True)
    with torch.no_grad():
        now = worker.policy.value(stale["obs"].reshape(-1)).reshape(3, 8)
    torch.testing.assert_close(stale["value"], now)
    fresh = trajectory()
    stored = fresh["value"].clone()
    worker.algorithm.add_advantages(worker.policy, fresh)  # these very weights: values kept
    assert torch.equal(fresh["value"], stored)
    # through update(): actions one update old are accepted with max_staleness=1
    stale = trajectory()
    stale["policy_version"] = torch.full((3, 8), 4)
    ch.put(stale, key=0)
    assert group.call(LearnerWorker.update, ch, env_ranks=[0], iteration=5, max_staleness=1).wait()[0]["perf/staleness"] == 1.0


class _OneItem:
    def __init__(self, item):
        self.item = item

    def get(self, key=0, timeout=None):
        return self.item.clone()


def _learner(**algo):
    from m2flow.pipelines import WorkerInfo

    info = WorkerInfo("learner", 0, 1, RankResources(0, 1.0, ()), "local")
    return LearnerWorker(info, policy_config(name="mlp", hidden_sizes=[16]),
                         PPOConfig(**{"learning_rate": 1e-2, "target_kl": None, **algo}), SPEC,
                         seed=0,
                         num_iterations=10)


def test_micro_batch_size_leaves_the_update_and_its_metrics_unchanged():
    traj = trajectory(n=4)
    whole, split = _learner(), _learner(micro_batch_size=3)  # minibatches of 8: 3 + 3 + 2
    m_whole = whole.update(_OneItem(traj), env_ranks=[0], iteration=0)
    m_split = split.update(_OneItem(traj), env_ranks=[0], iteration=0)
    for k in ("loss/loss_policy", "loss/loss_value", "loss/total", "loss/grad_norm"):
        assert m_split[k] == pytest.approx(m_whole[k], rel=1e-5), k
    # 1 - var(ret - v) / var(ret) near 0.08 amplifies summation-order rounding (seen: 1.5e-6
    # relative): an absolute bound, far below any real difference
    assert m_whole["loss/explained_variance"] == pytest.approx(m_split["loss/explained_variance"],
                                                               abs=1e-5)
    for (name, a), b in zip(whole.policy.named_parameters(), split.policy.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_a_bad_algorithm_config_fails_before_the_policy_is_built():
    from m2flow.embodied.algorithms import AlgorithmError

    with pytest.raises(AlgorithmError, match=r"^algorithm.gae_lambda=2.0: must be in \[0, 1\].$"):
        _learner(gae_lambda=2.0)


def test_critic_values_run_in_micro_batches_equal_to_a_per_sample_loop():
    worker = _learner(micro_batch_size=5)
    policy, rows = worker.policy, []
    real_value = policy.value

    def spy(obs):
        rows.append(obs.shape[0])
        return real_value(obs)

    policy.value = spy
    traj = trajectory(n=4)  # 32 steps
    worker.algorithm.add_advantages(policy, traj, revalue=True)
    assert max(rows) <= 5 and sum(rows) == 2 * 32  # values and next values
    for obs_key, value_key in (("obs", "value"), (("next", "obs"), ("next", "value"))):
        with torch.no_grad():
            loop = torch.cat([real_value(traj[obs_key][i, t : t + 1])
                              for i in range(4) for t in range(8)])
        torch.testing.assert_close(traj[value_key].reshape(-1), loop)


def test_after_the_first_full_sync_the_learner_ships_trainable_params_and_changed_buffers():
    worker = _learner()
    worker.policy.critic.requires_grad_(False)  # frozen: never changes, never shipped again
    first = worker.prepare_weight_sync(full=False, bucket_mb=1.0)
    assert first.full and set(first.keys) == set(worker.policy.state_dict())
    worker.update(_OneItem(trajectory()), env_ranks=[0], iteration=0)  # observe() moves obs_norm
    manifest = worker.prepare_weight_sync(full=False, bucket_mb=1.0)
    trainable = {n for n, p in worker.policy.named_parameters() if p.requires_grad}
    assert not manifest.full and trainable == {
        "actor_mean.0.weight", "actor_mean.0.bias", "actor_mean.2.weight", "actor_mean.2.bias",
        "actor_log_std"}
    assert set(manifest.keys) == trainable | {"obs_norm.mean", "obs_norm.var", "obs_norm.count"}


def test_a_rollout_copy_equals_the_learner_after_bucketed_syncs():
    from types import SimpleNamespace

    from m2flow.embodied.workers.rollout_worker import RolloutWorker
    from m2flow.embodied.runner import EmbodiedRunner

    cluster = Cluster(ClusterConfig(backend="local", num_gpus=0))
    res = [RankResources(0, 1.0, ())]
    learner = WorkerGroup(cluster, "learner", LearnerWorker, res, policy_config(name="mlp", hidden_sizes=[16]),
                          PPOConfig(learning_rate=1e-2, target_kl=None), SPEC, seed=0, num_iterations=10)
    rollout = WorkerGroup(cluster, "rollout", RolloutWorker, res * 2,
                          policy_config(name="mlp", hidden_sizes=[16]), SPEC, seed=1)
    # 1 KB buckets: the 16x16 weights (1 KB) and the rest travel in several
    runner = SimpleNamespace(learner=learner, rollout=rollout, weight_link=None,
                             cfg=SimpleNamespace(runner=SimpleNamespace(weight_sync_bucket_mb=2**-10)))
    try:
        for version in (0, 1):
            if version:
                learner.handles[0].update(_OneItem(trajectory()), env_ranks=[0], iteration=0)
            EmbodiedRunner.sync_weights(runner, version, full=version == 0)
            want = learner.call(LearnerWorker.get_weights).wait()[0]
            for copy in rollout.handles:
                assert copy.version == version
                for k, v in copy.policy.state_dict().items():
                    assert torch.equal(v, want[k]), k
    finally:
        rollout.shutdown()
        learner.shutdown()


def test_a_saved_and_resumed_learner_continues_bit_identically(tmp_path):
    from m2flow.runs import checkpoint

    traj = [trajectory(seed=s) for s in (0, 1)]
    straight = _learner()
    m_straight = [straight.update(_OneItem(traj[i]), env_ranks=[0], iteration=i) for i in (0, 1)]
    first = _learner()
    first.update(_OneItem(traj[0]), env_ranks=[0], iteration=0)
    state = first.state_dict()
    assert state["optimizer"]["state"]  # Adam's moments exist
    tensors = [t for t in _leaves(state) if isinstance(t, torch.Tensor)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    path = checkpoint.save(tmp_path / "c.pt", {"config": "", "learner": state})
    resumed = _learner()
    resumed.load_state_dict(checkpoint.load(path)["learner"])
    m_resumed = resumed.update(_OneItem(traj[1]), env_ranks=[0], iteration=1)
    assert m_resumed["loss/total"] == m_straight[1]["loss/total"]
    for k, v in straight.get_weights().items():
        assert torch.equal(resumed.get_weights()[k], v), k


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


def test_critic_warmup_trains_the_critic_alone_then_everything():
    worker = _learner(critic_warmup=2)
    critic = set(worker.policy.critic_parameter_names())
    assert critic == {n for n, _ in worker.policy.named_parameters() if n.startswith("critic.")}
    before = {n: p.detach().clone() for n, p in worker.policy.named_parameters()}
    for it in (0, 1):
        m = worker.update(_OneItem(trajectory(seed=it)), env_ranks=[0], iteration=it)
        assert m["loss/critic_only"] == 1.0
    after = dict(worker.policy.named_parameters())
    for n, p in after.items():  # the actor bitwise as it was, every critic tensor moved
        assert torch.equal(p, before[n]) == (n not in critic), n
        assert p.requires_grad, n  # put back after the update
    m = worker.update(_OneItem(trajectory(seed=2)), env_ranks=[0], iteration=2)
    assert "loss/critic_only" not in m
    assert not torch.equal(after["actor_mean.0.weight"], before["actor_mean.0.weight"])


def test_the_critic_steps_at_its_own_learning_rate_and_annealing_keeps_the_ratio():
    worker = _learner(critic_learning_rate=0.1, anneal_lr=True)
    actor_group, critic_group = worker.optimizer.param_groups
    critic = {id(p) for n, p in worker.policy.named_parameters() if n.startswith("critic.")}
    assert {id(p) for p in critic_group["params"]} == critic
    assert not critic & {id(p) for p in actor_group["params"]}
    before = {n: p.detach().clone() for n, p in worker.policy.named_parameters()}
    worker.cfg.update_epochs, worker.cfg.num_minibatches = 1, 1  # one Adam step
    worker.update(_OneItem(trajectory()), env_ranks=[0], iteration=5)
    assert actor_group["lr"] == pytest.approx(1e-2 * (1 - 5 / 10))
    assert critic_group["lr"] == pytest.approx(0.1 * (1 - 5 / 10))
    # Adam's first step moves an element by lr * |g| / (|g| + eps): at most its lr, about it
    # where the gradient is large
    after = dict(worker.policy.named_parameters())
    critic_step = (after["critic.0.bias"] - before["critic.0.bias"]).abs().max().item()
    actor_step = (after["actor_mean.0.bias"] - before["actor_mean.0.bias"]).abs().max().item()
    assert critic_step == pytest.approx(0.05, rel=1e-2)
    assert 0.002 < actor_step <= 0.005 * (1 + 1e-6)


def test_the_profiler_times_every_epoch_of_an_update_target_kl_would_stop():
    """The profiler's timed updates reuse one batch, soon stale to the moved policy: PPO's
    target_kl would end them after one epoch, and the planner would time a quarter of the
    run's update (the tiny VLA: 0.69 s profiled, 3.0 s in the run)."""
    from m2flow.embodied.profile import _every_epoch

    def losses(worker, its):
        calls = []
        real = worker.algorithm.loss
        worker.algorithm.loss = lambda policy, mb: calls.append(1) or real(policy, mb)
        for it in its:
            worker.update(_OneItem(trajectory()), env_ranks=[0], iteration=it)
        return len(calls)

    # (update_epochs 4, num_minibatches 4: PPOConfig's defaults; random log-probs: far off)
    stopped = _learner(target_kl=1e-6, critic_warmup=1)
    assert losses(stopped, [1]) == 4  # one epoch of 4 minibatches, then stopped
    full = _learner(target_kl=1e-6, critic_warmup=1)
    _every_epoch(full.algorithm)
    actor = full.policy.actor_mean[0].weight.detach().clone()
    assert losses(full, [0]) == 4 * 4  # every epoch, at the warm-up's iteration
    assert not torch.equal(full.policy.actor_mean[0].weight, actor)  # and the whole policy


# -- rsl-rl's adaptive step size (lr_schedule=adaptive) -------------------------------------
ADAPTIVE = dict(lr_schedule="adaptive", learning_rate=1e-3, desired_kl=0.002)


def _on_policy(worker, traj):
    """``traj`` with the log-probs of the learner's policy now: a fresh rollout's, so each
    update's KL starts at 0 and grows as the policy moves."""
    with torch.no_grad():
        traj["log_prob"] = worker.policy.evaluate_actions(traj.reshape(-1))["log_prob"].reshape(
            traj.shape)
    return traj


def test_a_critic_warmup_leaves_the_adaptive_step_size_where_it_was():
    worker = _learner(critic_warmup=1, **ADAPTIVE)
    m = worker.update(_OneItem(_on_policy(worker, trajectory(seed=0))), env_ranks=[0],
                      iteration=0)
    assert m["loss/critic_only"] == 1.0 and m["loss/approx_kl"] == 0.0
    assert m["loss/learning_rate"] == 1e-3  # not raised 16 times by a KL of 0
    m = worker.update(_OneItem(_on_policy(worker, trajectory(seed=1))), env_ranks=[0],
                      iteration=1)
    assert m["loss/learning_rate"] != 1e-3  # adapting once the actor trains


def test_the_adaptive_step_size_follows_rsl_rls_rule_minibatch_by_minibatch():
    worker = _learner(critic_learning_rate=1e-2, **ADAPTIVE)
    kls, stepped = [], []  # each minibatch's KL as the hook saw it; each step's group lrs
    hook, step = worker.algorithm.adapt_learning_rate, worker.optimizer.step
    worker.algorithm.adapt_learning_rate = lambda t: kls.append(t["approx_kl"]) or hook(t)
    worker.optimizer.step = lambda *a, **k: stepped.append(
        [g["lr"] for g in worker.optimizer.param_groups]) or step(*a, **k)
    reported = [worker.update(_OneItem(_on_policy(worker, trajectory(seed=it))), env_ranks=[0],
                              iteration=it)["loss/learning_rate"] for it in (0, 1)]
    want, lr = [], 1e-3  # rsl-rl's PPO.update, written out: before each minibatch's step
    for kl in kls:
        if kl > 2 * 0.002:
            lr = max(1e-5, lr / 1.5)
        elif 0 < kl < 0.002 / 2:
            lr = min(1e-2, lr * 1.5)
        want.append(lr)
    assert len(stepped) == 2 * 4 * 4  # 2 updates x 4 epochs x 4 minibatches
    assert [s[0] for s in stepped] == pytest.approx(want, rel=1e-12, abs=0)
    assert [s[1] for s in stepped] == pytest.approx([10 * x for x in want], rel=1e-12, abs=0)
    assert reported == pytest.approx([want[15], want[31]], rel=1e-12, abs=0)  # at the end
    moves = {(b > a) - (b < a) for a, b in zip([1e-3] + want, want)}
    assert moves == {-1, 0, 1}  # down, kept and up all happened


def test_the_adapted_step_size_survives_a_checkpoint_and_an_old_one_loads(tmp_path):
    from m2flow.runs import checkpoint

    first = _learner(**ADAPTIVE)
    first.update(_OneItem(_on_policy(first, trajectory())), env_ranks=[0], iteration=0)
    lr = first.algorithm.learning_rate(1, num_iterations=10)
    assert lr != 1e-3  # it moved
    path = checkpoint.save(tmp_path / "c.pt", {"config": "", "learner": first.state_dict()})
    state = checkpoint.load(path)["learner"]
    resumed = _learner(**ADAPTIVE)
    resumed.load_state_dict(state)
    assert resumed.algorithm.learning_rate(1, num_iterations=10) == lr
    traj = trajectory(seed=1)
    m_first = first.update(_OneItem(traj), env_ranks=[0], iteration=1)
    m_resumed = resumed.update(_OneItem(traj), env_ranks=[0], iteration=1)
    assert m_resumed["loss/learning_rate"] == m_first["loss/learning_rate"]
    for k, v in first.get_weights().items():
        assert torch.equal(resumed.get_weights()[k], v), k
    del state["algorithm"]  # a checkpoint from before algorithms had state
    old = _learner(**ADAPTIVE)
    old.load_state_dict(state)
    assert old.algorithm.learning_rate(1, num_iterations=10) == 1e-3
