"""Behaviour cloning through the generic learner loop, checked on the policy's actions."""

import pytest
import torch
from tensordict import TensorDict

from m2flow.embodied.algorithms import AlgorithmError
from m2flow.embodied.algorithms.bc import BCConfig
from m2flow.embodied.learner_worker import LearnerWorker
from m2flow.envs import EnvSpec
from m2flow.pipelines import RankResources, WorkerInfo
from m2flow.policies import PolicyConfig

SPEC = EnvSpec({"state": (4,)}, 2, (-5.0, -5.0), (5.0, 5.0), 8)
W = torch.tensor([[1.0, -0.5, 0.0, 2.0], [0.5, 1.0, -1.5, 0.0]])  # the expert: a = W s + b
B = torch.tensor([0.3, -0.2])


def expert(state):
    return state @ W.T + B


def obs(n, seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"state": torch.randn(n, 4, generator=g)}, batch_size=[n])


def write_dataset(path, n=32, t=16):
    o = obs(n * t, seed=1).reshape(n, t)  # (N, T)
    valid = torch.ones(n, t, dtype=torch.bool)
    valid[:, -2:] = False  # steps a crash lost: their actions are garbage
    action = expert(o["state"])
    action[~valid] = 100.0
    torch.save(TensorDict({"obs": o, "action": action, "valid": valid}, batch_size=[n, t]), path)


class _EnvTrajectories:
    """What the env workers send every iteration; BC logs it and trains on the dataset."""

    def get(self, key=0, timeout=None):
        o = obs(2, seed=0).reshape(2, 1)
        return TensorDict({"obs": o, "action": torch.zeros(2, 1, 2)}, batch_size=[2, 1])


def learner(**bc):
    info = WorkerInfo("learner", 0, 1, RankResources(0, 1.0, ()), "local")
    return LearnerWorker(info, PolicyConfig(name="mlp", hidden_sizes=[64, 64]), BCConfig(**bc),
                         SPEC, seed=0, num_iterations=300)


def action_error(worker) -> float:
    """Mean squared distance of the policy's mean action to the expert's, on new states."""
    test = obs(512, seed=2)
    with torch.no_grad():
        act = worker.policy.act(TensorDict({"obs": test}, [512]), deterministic=True)["action"]
    return float(((act - expert(test["state"])) ** 2).sum(-1).mean())


@pytest.mark.parametrize("loss", ["nll", "mse"])
def test_bc_clones_a_linear_expert(tmp_path, loss):
    write_dataset(tmp_path / "expert.pt")
    worker = learner(dataset=str(tmp_path / "expert.pt"), loss=loss, batch_size=128,
                     learning_rate=3e-3)
    before = action_error(worker)
    for i in range(250):
        metrics = worker.update(_EnvTrajectories(), env_ranks=[0], iteration=i)
    after = action_error(worker)
    assert before > 1.0 and after < before / 10, (before, after)
    assert "loss/loss_bc" in metrics and metrics["loss/learning_rate"] == 3e-3


def test_the_sample_depends_on_the_iteration_only(tmp_path):
    write_dataset(tmp_path / "expert.pt")
    a, b = (learner(dataset=str(tmp_path / "expert.pt"), batch_size=16) for _ in range(2))
    traj = _EnvTrajectories().get()
    first, _ = a.algorithm.prepare(a.policy, traj, iteration=3, staleness=0)
    again, _ = b.algorithm.prepare(b.policy, traj, iteration=3, staleness=0)
    other, _ = a.algorithm.prepare(a.policy, traj, iteration=4, staleness=0)
    assert torch.equal(first["obs", "state"], again["obs", "state"])
    assert not torch.equal(first["obs", "state"], other["obs", "state"])
    assert (first["action"].abs() < 100).all()  # invalid steps are not in the dataset


def test_a_missing_dataset_is_one_clear_error(tmp_path):
    path = tmp_path / "nope.pt"
    with pytest.raises(AlgorithmError) as e:
        learner(dataset=str(path))
    text = str(e.value)
    assert text.startswith(f"algorithm.dataset={str(path)!r}: no such file") and "\n" not in text


def test_a_malformed_dataset_is_one_clear_error(tmp_path):
    torch.save({"obs": torch.zeros(3, 4)}, tmp_path / "dict.pt")
    with pytest.raises(AlgorithmError, match=r"dict.pt' holds a dict, not a TensorDict"):
        learner(dataset=str(tmp_path / "dict.pt"))
    torch.save(TensorDict({"obs": obs(3, 0)}, [3]), tmp_path / "no_action.pt")
    with pytest.raises(AlgorithmError, match=r"it needs 'obs' and 'action'"):
        learner(dataset=str(tmp_path / "no_action.pt"))
    (tmp_path / "text.pt").write_text("not a tensor file")
    with pytest.raises(AlgorithmError, match=r"text.pt': cannot be read by torch.load"):
        learner(dataset=str(tmp_path / "text.pt"))
