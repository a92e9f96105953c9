"""The reasoning learner's checkpoints (CPU copies, the KL reference kept across a resume)
and its precision (fp32 masters under a bf16 model.dtype)."""

import copy

import pytest
import torch

from m2flow.reasoning.learner_worker import map_tensors
from tests.reasoning.common import (
    ListChannel,
    learner_config,
    make_learner,
    scored_groups,
    tiny_engine,
)


def tensors(obj):
    """Every tensor inside a nested dict/list/tuple, in order."""
    found = []
    map_tensors(obj, lambda t: found.append(t) or t)
    return found


def train(learner, steps=2, lr=1e-3):
    groups = scored_groups(tiny_engine())
    learner.trainer.set_lr(lr)
    for step in range(steps):
        learner.update(ListChannel([g.clone() for g in groups]), num_groups=4, iteration=step)


def test_the_walk_reaches_tensors_of_every_device_and_keeps_the_rest():
    """``meta`` tensors stand for CUDA ones (a CPU machine has no other device)."""
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, device="meta")},
                       1: {"exp_avg_sq": torch.zeros(3, device="meta")}},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}]}
    seen = []

    def to_cpu(t):
        seen.append(t.device.type)
        return torch.full(t.shape, 7.0)  # what a copy to the host would give

    out = map_tensors(state, to_cpu)
    assert sorted(seen) == ["cpu", "meta", "meta"]
    assert all(t.device.type == "cpu" for t in tensors(out))
    assert out["state"][1]["exp_avg_sq"].shape == (3,)
    assert out["param_groups"] == state["param_groups"]


def test_state_dict_is_cpu_copies_not_the_live_tensors():
    learner = make_learner(learner_config())
    train(learner, steps=1)
    state = learner.state_dict()
    live = tensors(learner.optimizer.state_dict()["state"])
    saved = tensors(state["optimizer"]["state"])
    assert len(saved) == len(live) > 0 and "reference" in state
    assert all(t.device.type == "cpu" for t in tensors(state))
    for s, t in zip(saved, live):
        assert torch.equal(s, t) and s.data_ptr() != t.data_ptr()
    train(learner, steps=1)  # the live state moves on; what was saved does not
    later = tensors(learner.optimizer.state_dict()["state"])
    assert not all(torch.equal(s, t) for s, t in zip(saved, later))


def test_resume_keeps_the_original_kl_reference():
    learner = make_learner(learner_config(kl_coef=0.05))
    reference = {k: v.clone() for k, v in learner.ref.state_dict().items()}
    train(learner, steps=2)
    state = learner.state_dict()
    assert any(not torch.equal(state["model"][k], reference[k]) for k in reference)  # moved

    cfg = learner_config(kl_coef=0.05)
    cfg.seed = 1  # other initial weights: nothing can match by coincidence
    resumed = make_learner(cfg)
    resumed.load_state_dict(copy.deepcopy(state))
    for k, v in resumed.ref.state_dict().items():
        assert torch.equal(v, reference[k]), k
    for k, v in resumed.model.state_dict().items():
        assert torch.equal(v, state["model"][k]), k


def test_bf16_model_dtype_trains_fp32_masters_that_a_tiny_step_moves():
    """A bf16 weight of size ~0.02 has a spacing of ~1e-4: lr 1e-6 would round away. The
    learner's parameters are fp32 and move as a plain fp32 AdamW step on the same gradients
    moves them (its first step is lr * g / (|g| + eps): any scale of g gives the same)."""
    cfg = learner_config(kl_coef=0.0)
    cfg.model.dtype = "bfloat16"
    learner = make_learner(cfg)
    assert learner.trainer.precision == "bf16"
    params = [p for p in learner.model.parameters() if p.requires_grad]
    assert params and all(p.dtype == torch.float32 for p in params)
    before = [p.detach().clone() for p in params]
    grads = []
    step = learner.trainer.step

    def spy(**kwargs):
        grads.extend(None if p.grad is None else p.grad.clone() for p in params)
        return step(**kwargs)

    learner.trainer.step = spy
    train(learner, steps=1, lr=1e-6)

    plain = [b.clone().requires_grad_(True) for b in before]
    for p, g in zip(plain, grads):
        p.grad = g
    torch.optim.AdamW(plain, lr=1e-6, weight_decay=0.0).step()
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(params, before))
    expected = sum(int((p.detach() != b).sum()) for p, b in zip(plain, before))
    as_bf16 = sum(int((p.detach().bfloat16() != b.bfloat16()).sum()) for p, b in zip(plain, before))
    assert expected > 1000 and abs(changed - expected) <= 0.01 * expected
    assert as_bf16 < 0.05 * expected  # bf16 weights: all but the ones nearest 0 round back


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_state_dict_of_a_cuda_learner_is_on_the_cpu_and_loads_back():
    learner = make_learner(learner_config(), gpus=(0,))
    train(learner, steps=1)
    state = learner.state_dict()
    assert all(t.device.type == "cpu" for t in tensors(state))
    resumed = make_learner(learner_config(), gpus=(0,))
    resumed.load_state_dict(state)
    assert all(t.device.type == "cuda" for t in tensors(resumed.optimizer.state_dict()["state"])
               if t.dim())  # AdamW's step counters stay on the CPU, as torch keeps them
