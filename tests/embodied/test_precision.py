"""One list of precisions: an algorithm config accepts exactly the precisions the learner's
Trainer (``m2flow.runs.learner``) can run, and fp16's gradient scaler is refused at start-up
where several learner ranks would each own one."""

import pytest
import torch

from m2flow.embodied.algorithms import AlgorithmError
from m2flow.embodied.algorithms.ppo import PPOConfig
from m2flow.runs.learner import Trainer


def _trainer_runs(precision: str) -> bool:
    try:
        Trainer(torch.nn.Linear(3, 2), lambda p: torch.optim.SGD(p, lr=0.1), precision=precision)
    except ValueError:
        return False
    return True


def _config_accepts(precision: str) -> bool:
    try:
        PPOConfig(precision=precision).validate()
    except AlgorithmError:
        return False
    return True


@pytest.mark.parametrize("precision", ["auto", "fp32", "bf16", "fp16", "fp8", "float16"])
def test_the_config_accepts_what_the_trainer_runs(precision):
    assert _config_accepts(precision) == _trainer_runs(precision)


def test_fp16_with_several_learner_ranks_is_one_start_up_line():
    from m2flow.cli.workloads import register_schemas
    from m2flow.configs import load_config, to_object
    from m2flow.embodied.layout import Layout, check_layout

    register_schemas()
    cfg = to_object(load_config("maniskill_pushcube_ppo_mlp", [
        "cluster.backend=ray", "algorithm.precision=fp16",
        "cluster.placement.components.env.workers=2",
        "cluster.placement.components.learner.workers=2"]))
    with pytest.raises(ValueError, match=r"^config error: algorithm.precision='fp16': adds a "
                                         r"gradient scaler.*use algorithm.precision=bf16 or fp32"):
        check_layout(Layout.of(cfg), cfg)
    cfg.cluster.placement.components["learner"].workers = 1
    check_layout(Layout.of(cfg), cfg)  # one rank owns its scaler
