"""The algorithm registry: lookups, override rule, schemas, and a plugin algorithm that runs
through the learner without touching m2flow."""

import dataclasses
from dataclasses import dataclass
from importlib.resources import files

import pytest
import torch
from tensordict import TensorDict

from m2flow.embodied.algorithms import (
    ALGORITHMS,
    BUILTINS,
    Algorithm,
    AlgorithmConfig,
    AlgorithmError,
    algorithm_class,
    register_algorithm,
    register_schemas,
    registered_algorithms,
)
from m2flow.embodied.algorithms.base import flatten_valid, loss_metrics
from m2flow.embodied.workers.learner_worker import LearnerWorker
from m2flow.envs import EnvSpec
from m2flow.pipelines import RankResources, WorkerInfo
from m2flow.policies import policy_config

SPEC = EnvSpec({"state": (3,)}, 2, (-1.0, -1.0), (1.0, 1.0), 8)


@pytest.fixture
def registry(monkeypatch):
    """Registrations made by a test are gone after it."""
    monkeypatch.setattr(ALGORITHMS, "_table", dict(ALGORITHMS._table))
    return ALGORITHMS


def test_builtins_are_listed_and_load_lazily():
    assert {"ppo", "grpo", "bc"} <= set(registered_algorithms())
    assert isinstance(ALGORITHMS._table["bc"], str)  # a "module:Class" string until looked up


def test_only_the_table_makes_an_algorithm():
    """A module of algorithms/ is an algorithm by its line in BUILTINS alone: a helper is never
    one, and every other module there has its line."""
    import pkgutil

    from m2flow.embodied import algorithms
    from m2flow.embodied.algorithms import helpers

    modules = {m.name for m in pkgutil.iter_modules(algorithms.__path__)} - {"base", "helpers"}
    assert {t.split(":")[0].rsplit(".", 1)[1] for t in BUILTINS.values()} == modules
    helpers = {m.name for m in pkgutil.iter_modules(helpers.__path__)}
    assert helpers and not helpers & set(ALGORITHMS._table)


@pytest.mark.parametrize("name", registered_algorithms())
def test_every_algorithm_has_a_config_schema_and_a_yaml(name):
    cls = algorithm_class(name)
    assert issubclass(cls, Algorithm)
    assert dataclasses.is_dataclass(cls.config_class)
    assert issubclass(cls.config_class, AlgorithmConfig)
    yaml = (files("m2flow.configs") / "algorithm" / f"{name}.yaml").read_text()
    assert f"- {name}_schema" in yaml


def test_an_unknown_name_suggests_the_closest():
    with pytest.raises(AlgorithmError,
                       match=r"Unknown algorithm 'grp0'\. Known: .*Did you mean 'grpo'\?"):
        algorithm_class("grp0")


def test_replacing_a_name_needs_override(registry):
    register_algorithm("test/toy", ToyAlgorithm)
    register_algorithm("test/toy", ToyAlgorithm)  # the same class again: fine
    with pytest.raises(AlgorithmError, match="already registered.*override=True"):
        register_algorithm("test/toy", OtherToy)
    register_algorithm("test/toy", OtherToy, override=True)
    assert algorithm_class("test/toy") is OtherToy


def test_register_schemas_stores_one_node_per_algorithm(registry):
    from hydra.core.config_store import ConfigStore

    register_algorithm("test/toy", ToyAlgorithm)
    cs = ConfigStore()
    register_schemas(cs)
    stored = cs.list("algorithm")
    assert {"ppo_schema.yaml", "grpo_schema.yaml", "bc_schema.yaml"} <= set(stored)
    assert cs.load("algorithm/bc_schema.yaml").node._metadata.object_type.__name__ == "BCConfig"


# -- a plugin's algorithm: its config, prepare and loss; nothing in m2flow changes ----------
@dataclass
class ToyConfig(AlgorithmConfig):
    name: str = "test/toy"
    """Registered name."""
    scale: float = 1.0
    """Weight of the log-likelihood of the actions taken."""
    update_epochs: int = 1
    """One pass."""


class ToyAlgorithm(Algorithm):
    """Raises the log-likelihood of every action taken (no advantages), in one step."""

    config_class = ToyConfig

    def prepare(self, policy, traj, *, iteration, staleness):
        batch = flatten_valid(traj)
        return batch, {"toy/samples": float(batch.shape[0])}

    def train(self, policy, batch, trainer, *, iteration, seed):
        terms = trainer.gradients(batch, lambda mb: self.loss(policy, mb))
        terms["grad_norm"] = trainer.step()
        return loss_metrics(terms, early_stop=False)

    def loss(self, policy, mb):
        lp = policy.evaluate_actions(mb)["log_prob"]
        return TensorDict({"loss_toy": -self.cfg.scale * lp.mean()}, batch_size=[])


class OtherToy(ToyAlgorithm):
    pass


class _OneItem:
    def __init__(self, item):
        self.item = item

    def get(self, key=0, timeout=None):
        return self.item


def test_a_registered_toy_algorithm_runs_one_learner_update(registry):
    register_algorithm("test/toy", ToyAlgorithm)
    info = WorkerInfo("learner", 0, 1, RankResources(0, 1.0, ()), "local")
    worker = LearnerWorker(info, policy_config(name="mlp", hidden_sizes=[8]),
                           ToyConfig(learning_rate=1e-2), SPEC, seed=0, num_iterations=1)
    g = torch.Generator().manual_seed(0)
    traj = TensorDict({"obs": {"state": torch.randn(2, 5, 3, generator=g)},
                       "action": torch.randn(2, 5, 2, generator=g),
                       "valid": torch.ones(2, 5, dtype=torch.bool)}, batch_size=[2, 5])
    traj["valid"][1, 3:] = False

    def log_lik():
        with torch.no_grad():
            return worker.policy.evaluate_actions(traj.reshape(-1))["log_prob"].mean()

    before = log_lik()
    metrics = worker.update(_OneItem(traj), env_ranks=[0], iteration=0)
    assert metrics["toy/samples"] == 8.0
    assert metrics["loss/total"] == metrics["loss/loss_toy"]
    assert log_lik() > before


# -- Hydra: each algorithm's config is its own schema node ----------------------------------
def test_algorithm_groups_compose_with_their_own_schema():
    from m2flow.cli.common import load_run_config
    from m2flow.configs import ConfigError

    ppo = load_run_config("maniskill_pushcube_ppo_mlp", ["algorithm.gae_lambda=0.5"])
    assert type(ppo.algorithm).__name__ == "PPOConfig" and ppo.algorithm.gae_lambda == 0.5
    with pytest.raises(ConfigError, match="algorithm.gae_lambda is not a field of GRPOConfig"):
        load_run_config("maniskill_pushcube_ppo_mlp",
                        ["algorithm=grpo", "algorithm.gae_lambda=0.5"])
    bc = load_run_config("maniskill_pushcube_ppo_mlp", ["algorithm=bc", "algorithm.dataset=x.pt"])
    assert type(bc.algorithm).__name__ == "BCConfig" and bc.algorithm.loss == "nll"


def test_a_plugin_algorithm_without_train_is_refused_at_start_up_in_one_line(registry):
    """An algorithm written for the interface before it owned its update loop (``prepare`` and
    ``loss``, no ``train``) is named, with what it lacks, by the start-up checks; before, the
    learner worker died on Python's abstract-class TypeError after every worker had started."""
    from m2flow.cli.common import load_run_config
    from m2flow.configs import ConfigError
    from m2flow.embodied.checks import check_names

    class OldStyle(Algorithm):
        config_class = ToyConfig

        def prepare(self, policy, traj, *, iteration, staleness):
            return traj, {}

        def loss(self, policy, mb):
            return TensorDict({}, batch_size=[])

    register_algorithm("test/toy", OldStyle)
    cfg = load_run_config("maniskill_pushcube_ppo_mlp", [])
    cfg.algorithm = ToyConfig()
    with pytest.raises(ConfigError, match=r"^config error: algorithm.name: algorithm 'test/toy' "
                                          r"\(.*OldStyle\) does not implement train, which every "
                                          r"algorithm must; see docs/extending.md\.$"):
        check_names(cfg)
    register_algorithm("test/toy", ToyAlgorithm, override=True)
    check_names(cfg)  # a complete one passes
