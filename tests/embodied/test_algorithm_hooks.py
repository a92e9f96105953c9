"""The hooks the learner worker calls on an algorithm besides ``prepare`` and ``train``
(parameter groups, the step size's schedule, the critic warm-up), and that the learner reads
no field of one algorithm's config: its own are those of the base AlgorithmConfig. The update
loops themselves: tests/embodied/test_algorithm_updates.py."""

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from m2flow.embodied.workers import learner_worker
from m2flow.embodied.algorithms import (
    ALGORITHMS,
    AlgorithmConfig,
    AlgorithmError,
    check_field,
    register_algorithm,
)
from m2flow.embodied.algorithms.grpo import GRPO, GRPOConfig
from m2flow.embodied.algorithms.ppo import PPO, PPOConfig
from m2flow.embodied.workers.learner_worker import LearnerWorker
from m2flow.envs import EnvSpec
from m2flow.pipelines import RankResources, WorkerInfo
from m2flow.policies import make_policy, policy_config
from tests.embodied.test_algorithm_registry import ToyAlgorithm, ToyConfig

SPEC = EnvSpec({"state": (3,)}, 2, (-1.0, -1.0), (1.0, 1.0), 8)
POLICY = policy_config(name="mlp", hidden_sizes=[8])


@pytest.fixture
def registry(monkeypatch):
    """Registrations made by a test are gone after it."""
    monkeypatch.setattr(ALGORITHMS, "_table", dict(ALGORITHMS._table))
    return ALGORITHMS


def _policy():
    torch.manual_seed(0)
    return make_policy(POLICY, SPEC, device="cpu")


# -- the step size's schedule ---------------------------------------------------------------
def test_ppo_anneals_its_step_size_linearly_to_zero_over_the_run():
    ppo = PPO(PPOConfig(learning_rate=1e-3, anneal_lr=True), action_dim=2, seed=0)
    # 1e-3 * (1 - i / 4), worked by hand
    want = {0: 1e-3, 1: 7.5e-4, 2: 5e-4, 3: 2.5e-4, 4: 0.0}
    for i, lr in want.items():
        assert ppo.learning_rate(i, num_iterations=4) == pytest.approx(lr, rel=1e-12, abs=0), i
    # the same iteration of a longer run: a step size of its own length's schedule
    assert ppo.learning_rate(2, num_iterations=10) == pytest.approx(8e-4, rel=1e-12)
    # a run of no iterations counts as one (no division by zero)
    assert ppo.learning_rate(0, num_iterations=0) == 1e-3


def test_without_annealing_the_step_size_is_constant_and_grpo_inherits_the_schedule():
    ppo = PPO(PPOConfig(learning_rate=3e-4), action_dim=2, seed=0)
    assert [ppo.learning_rate(i, num_iterations=5) for i in (0, 3, 4)] == [3e-4] * 3
    grpo = GRPO(GRPOConfig(learning_rate=2e-5, anneal_lr=True), action_dim=2, seed=0)
    assert grpo.learning_rate(3, num_iterations=4) == pytest.approx(5e-6, rel=1e-12)


def test_ppos_adaptive_step_size_starts_at_learning_rate_and_is_its_state():
    ppo = PPO(PPOConfig(learning_rate=1e-3, lr_schedule="adaptive"), action_dim=2, seed=0)
    assert ppo.learning_rate(0, num_iterations=4) == 1e-3
    assert ppo.adapt_learning_rate({"approx_kl": 0.05}) == pytest.approx(1e-3 / 1.5, rel=1e-12)
    assert ppo.learning_rate(3, num_iterations=4) == pytest.approx(1e-3 / 1.5, rel=1e-12)
    other = PPO(PPOConfig(learning_rate=1e-3, lr_schedule="adaptive"), action_dim=2, seed=0)
    other.load_state_dict(ppo.state_dict())
    assert other.learning_rate(0, num_iterations=4) == ppo.learning_rate(0, num_iterations=4)


def test_a_fixed_schedule_never_adapts_and_carries_no_state():
    assert PPO(PPOConfig(), action_dim=2, seed=0).adapt_learning_rate({"approx_kl": 9.0}) is None
    for algo in (PPO(PPOConfig(learning_rate=1e-3), action_dim=2, seed=0),
                 GRPO(GRPOConfig(), action_dim=2, seed=0)):  # (the base's defaults)
        assert algo.state_dict() == {}
        algo.load_state_dict({"learning_rate": 5.0})  # (ignored)
        assert algo.learning_rate(0, num_iterations=4) == algo.cfg.learning_rate


# -- PPO's parameter groups and critic warm-up ----------------------------------------------
def test_ppo_puts_the_critic_in_a_group_of_its_own_at_its_step_size():
    policy = _policy()
    params = list(policy.parameters())
    assert PPO(PPOConfig(), action_dim=2, seed=0).param_groups(policy, params) == [
        {"params": params}]
    ppo = PPO(PPOConfig(learning_rate=1e-2, critic_learning_rate=0.1), action_dim=2, seed=0)
    actor, critic = ppo.param_groups(policy, params)
    names = {id(p): n for n, p in policy.named_parameters()}
    assert {names[id(p)] for p in critic["params"]} == {
        "critic.0.weight", "critic.0.bias", "critic.2.weight", "critic.2.bias"}
    assert {names[id(p)] for p in actor["params"]} == {
        "actor_mean.0.weight", "actor_mean.0.bias", "actor_mean.2.weight", "actor_mean.2.bias",
        "actor_log_std"}
    assert "lr" not in actor and critic["lr"] == 0.1
    assert critic["lr_scale"] == pytest.approx(10.0, rel=1e-12)  # 0.1 / 1e-2


class _NoCritic(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.actor = torch.nn.Linear(2, 2)

    def critic_parameter_names(self):
        return []


def test_ppo_says_which_field_to_change_when_the_policy_has_no_critic_of_its_own():
    policy = _NoCritic()
    ppo = PPO(PPOConfig(critic_learning_rate=0.1, critic_warmup=2), action_dim=2, seed=0)
    with pytest.raises(ValueError, match=r"^algorithm.critic_learning_rate: policy _NoCritic "):
        ppo.param_groups(policy, list(policy.parameters()))
    with pytest.raises(ValueError, match=r"^algorithm.critic_warmup: policy _NoCritic .*"
                                         r"set algorithm.critic_warmup=0\.$"):
        ppo.trained_parameters(policy, 1)
    assert ppo.trained_parameters(policy, 2) is None  # past the warm-up: nothing asked of it


def test_ppo_trains_the_critic_alone_for_critic_warmup_iterations():
    policy = _policy()
    ppo = PPO(PPOConfig(critic_warmup=2), action_dim=2, seed=0)
    critic = ["critic.0.weight", "critic.0.bias", "critic.2.weight", "critic.2.bias"]
    assert [ppo.critic_only(i) for i in (0, 1, 2, 3)] == [True, True, False, False]
    assert sorted(ppo.trained_parameters(policy, 1)) == sorted(critic)
    assert ppo.trained_parameters(policy, 2) is None
    assert PPO(PPOConfig(), action_dim=2, seed=0).trained_parameters(policy, 0) is None


# -- the learner takes its groups and step size from the hooks ------------------------------
@dataclass
class HookedConfig(ToyConfig):
    name: str = "test/hooked"
    """Registered name."""


class Hooked(ToyAlgorithm):
    """The toy algorithm (one step raising the log-likelihood of the actions taken); the
    actor's log-std in a group at half the step size, and the schedule's arguments recorded."""

    config_class = HookedConfig

    def __init__(self, cfg, *, action_dim, seed):
        super().__init__(cfg, action_dim=action_dim, seed=seed)
        self.schedule_calls = []

    def param_groups(self, policy, params):
        std = {id(policy.actor_log_std)}
        return [{"params": [p for p in params if id(p) not in std]},
                {"params": [p for p in params if id(p) in std], "lr_scale": 0.5}]

    def learning_rate(self, iteration, *, num_iterations):
        self.schedule_calls.append((iteration, num_iterations))
        return super().learning_rate(iteration, num_iterations=num_iterations)



class _OneItem:
    def __init__(self, item):
        self.item = item

    def get(self, key=0, timeout=None):
        return self.item


def _traj():
    g = torch.Generator().manual_seed(0)
    return TensorDict({"obs": {"state": torch.randn(2, 4, 3, generator=g)},
                       "action": torch.randn(2, 4, 2, generator=g)}, batch_size=[2, 4])


def _hooked_learner(**cfg) -> LearnerWorker:
    register_algorithm("test/hooked", Hooked)
    info = WorkerInfo("learner", 0, 1, RankResources(0, 1.0, ()), "local")
    return LearnerWorker(info, POLICY, HookedConfig(**cfg), SPEC, seed=0, num_iterations=4)


def test_the_learners_adam_groups_and_step_sizes_come_from_the_algorithms_hooks(registry):
    worker = _hooked_learner(learning_rate=1e-2, anneal_lr=True)
    groups = worker.optimizer.param_groups
    assert len(groups) == 2
    assert [p is worker.policy.actor_log_std for p in groups[1]["params"]] == [True]
    assert len(groups[0]["params"]) == len(list(worker.policy.parameters())) - 1
    assert groups[1]["lr_scale"] == 0.5 and groups[0]["eps"] == learner_worker.ADAM_EPS
    metrics = worker.update(_OneItem(_traj()), env_ranks=[0], iteration=1)
    assert worker.algorithm.schedule_calls == [(1, 4)]  # the learner's num_iterations
    # 1e-2 * (1 - 1 / 4) = 7.5e-3; the log-std's group at half of it
    assert metrics["loss/learning_rate"] == pytest.approx(7.5e-3, rel=1e-12)
    assert groups[0]["lr"] == pytest.approx(7.5e-3, rel=1e-12)
    assert groups[1]["lr"] == pytest.approx(3.75e-3, rel=1e-12)


# -- what the learner reads of the config ---------------------------------------------------
def test_the_learner_reads_only_the_fields_every_algorithm_config_has():
    """Every attribute the learner worker takes from an algorithm config (``algo_cfg``,
    ``self.cfg`` and the ``c`` it binds to it) is a field of the base AlgorithmConfig, and it
    ``getattr``s none: what one algorithm adds reaches the loop through the hooks."""
    tree = ast.parse(Path(learner_worker.__file__).read_text())
    fields = {f.name for f in dataclasses.fields(AlgorithmConfig)}

    def is_cfg(node):
        return (isinstance(node, ast.Name) and node.id in ("algo_cfg", "c")) or (
            isinstance(node, ast.Attribute) and node.attr == "cfg"
            and isinstance(node.value, ast.Name) and node.value.id == "self")

    read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and is_cfg(n.value)}
    assert read and read <= fields, read - fields
    assert {"learning_rate", "precision", "max_grad_norm"} <= read  # (the walk works)
    getattrs = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name) and n.func.id == "getattr"]
    assert not [ast.unparse(n) for n in getattrs if is_cfg(n.args[0])]


def test_check_field_is_public_and_names_the_field_and_its_fix():
    cfg = PPOConfig(gamma=1.5)
    with pytest.raises(AlgorithmError, match=r"^algorithm.gamma=1.5: must be in \(0, 1\]\.$"):
        check_field(cfg, "gamma", 0 < cfg.gamma <= 1, "must be in (0, 1].")
    check_field(cfg, "gamma", True, "unused")  # fine: nothing raised
