"""``LearnerWorker.init_weights``: another run's policy weights, a fresh optimiser."""

import pytest
import torch

from m2flow.embodied.algorithms.grpo import GRPOConfig
from m2flow.embodied.algorithms.ppo import PPOConfig
from m2flow.embodied.workers.learner_worker import LearnerWorker
from m2flow.envs import EnvSpec
from m2flow.pipelines import RankResources, WorkerInfo
from m2flow.policies import policy_config
from m2flow.runs.checkpoint import CheckpointError

SPEC = EnvSpec({"state": (6,)}, 3, (-1.0,) * 3, (1.0,) * 3, 20)


def learner(algo, seed, hidden=(32, 32)):
    info = WorkerInfo("learner", 0, 1, RankResources(0, 1.0, ()), "local")
    return LearnerWorker(info, policy_config(name="mlp", hidden_sizes=list(hidden)), algo, SPEC,
                         seed=seed, num_iterations=10)


def test_the_weights_are_the_checkpoints_and_what_it_lacks_keeps_its_own():
    # a checkpoint without the value head, as a BC run of a VLA with value_head: false writes
    source = {k: w for k, w in learner(GRPOConfig(group_size=2), seed=1).get_weights().items()
              if not k.startswith("critic")}
    target = learner(PPOConfig(), seed=2)
    own = target.get_weights()
    critic = sorted(k for k in own if k.startswith("critic"))

    missing = target.init_weights(source, source="init_from=x.pt")
    after = target.get_weights()
    assert missing == critic
    for k, w in source.items():
        assert torch.equal(after[k], w), k
    for k in critic:  # the value head BC/GRPO never trained: its initial values
        assert torch.equal(after[k], own[k]), k
    assert any(not torch.equal(source[k], own[k]) for k in source)  # seeds 1 and 2 differ
    assert target.optimizer.state_dict()["state"] == {}


def test_another_policy_size_is_one_line_naming_the_source():
    source = learner(GRPOConfig(group_size=2), seed=1, hidden=(16, 16)).get_weights()
    target = learner(GRPOConfig(group_size=2), seed=2)
    with pytest.raises(CheckpointError) as e:
        target.init_weights(source, source="init_from=runs/bc")
    text = str(e.value)
    assert text.startswith("init_from=runs/bc: its tensor ") and "shape" in text and "\n" not in text
