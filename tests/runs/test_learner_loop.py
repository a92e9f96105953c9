"""The learner pieces an algorithm's loop calls (``m2flow.runs.learner``: ``Trainer``'s
minibatches, gradients and step) against plain-torch references: micro-batching, fp32
masters with bf16 autocast, clipping, the seeded minibatch order; and PPO's loop over them
against a plain loop written out."""

import copy

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from m2flow.embodied.algorithms.ppo import PPO, PPOConfig
from m2flow.envs import EnvSpec
from m2flow.policies import make_policy, policy_config
from m2flow.runs import seeding
from m2flow.runs.learner import Means, Trainer, minibatch_generator, total_loss

SPEC = EnvSpec({"state": (5,)}, 2, (-1.0, -1.0), (1.0, 1.0), 50)


def ppo_setup(n=40, seed=0):
    """An MLP policy and a flat PPO batch whose ratios and advantages are not trivial."""
    torch.manual_seed(seed)
    policy = make_policy(policy_config(name="mlp", hidden_sizes=[16], normalize_obs=False), SPEC)
    g = torch.Generator().manual_seed(seed + 1)
    obs = TensorDict({"state": torch.randn(n, 5, generator=g)}, batch_size=[n])
    b = TensorDict({"obs": obs}, batch_size=[n])
    with torch.no_grad():
        b.update(policy.act(b))
    b["log_prob"] = b["log_prob"] + 0.3 * torch.randn(n, generator=g)  # ratios off 1: some clip
    b["advantage"] = 2.0 + 3.0 * torch.randn(n, generator=g)  # mean far from 0: normalising matters
    b["return"] = torch.randn(n, generator=g)
    return policy, b


def adam(lr=1e-2):
    return lambda params: torch.optim.Adam(params, lr=lr, eps=1e-5)


def ppo_update(policy, batch, *, iteration=3, seed=0, **cfg) -> tuple[torch.nn.Module, dict]:
    """A copy of ``policy`` after ``PPO.train`` on ``batch`` (Adam, clip 0.5), its metrics."""
    ppo = PPO(PPOConfig(**{"update_epochs": 2, "num_minibatches": 2, "target_kl": None, **cfg}),
              action_dim=2, seed=0)
    pi = copy.deepcopy(policy)
    trainer = Trainer(pi, adam(), precision="auto", max_grad_norm=0.5)
    return pi, ppo.train(pi, batch, trainer, iteration=iteration, seed=seed)


@pytest.mark.parametrize("micro", [1, 3, 7])
def test_micro_batches_give_the_unsplit_update(micro):
    policy, batch = ppo_setup()
    whole, t_whole = ppo_update(policy, batch, clip_coef=0.2, ent_coef=0.01)
    split, t_split = ppo_update(policy, batch, clip_coef=0.2, ent_coef=0.01,
                                micro_batch_size=micro)
    assert 0 < t_whole["loss/clip_fraction"] < 1  # the clipped branch is exercised
    moved = max((a - b).abs().max() for a, b in zip(whole.parameters(), policy.parameters()))
    assert moved > 1e-3
    for (name, a), b in zip(whole.named_parameters(), split.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    for k in ("loss_policy", "loss_value", "approx_kl", "grad_norm"):
        assert t_split[f"loss/{k}"] == pytest.approx(t_whole[f"loss/{k}"], rel=1e-5, abs=1e-7)


def test_the_trainers_pieces_accumulate_micro_batches_as_one_backward():
    """``gradients`` with micro-batches of 3 (shares 3/8, 3/8, 2/8) leaves the gradients and
    terms of one backward of the whole minibatch; ``step`` then clips and steps on them."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ref = copy.deepcopy(model)
    trainer = Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), precision="fp32")
    mb = TensorDict({"x": torch.randn(8, 3), "y": torch.randn(8, 2)}, [8])

    def loss_fn(m, net=model):
        err = ((net(m["x"]) - m["y"]) ** 2).sum(-1)
        return TensorDict({"loss_mse": err.mean(), "err_max": err.max().detach()}, [])

    terms = trainer.gradients(mb, loss_fn, micro_batch_size=3)
    whole = loss_fn(mb, ref)
    whole["loss_mse"].backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7)
    assert terms["loss_mse"] == pytest.approx(float(whole["loss_mse"]), rel=1e-6)
    # a diagnostic is weighted like a loss: the shares' maxima, not the minibatch's maximum
    err = ((ref(mb["x"]) - mb["y"]) ** 2).sum(-1).detach()
    by_share = sum(float(e.max()) * len(e) / 8 for e in err.split(3))
    assert terms["err_max"] == pytest.approx(by_share, rel=1e-6)


def test_minibatches_are_the_seeded_permutations_one_per_epoch():
    """Each call draws one ``randperm`` of the whole batch from the generator, cut into
    ``num_minibatches`` slices (10 rows in 3: 3, 3, 3 and a last one of 1)."""
    trainer = Trainer(nn.Linear(1, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    batch = TensorDict({"i": torch.arange(10)}, [10])
    gen = minibatch_generator(seed=5, iteration=2)
    got = [[mb.rows["i"].tolist() for mb in trainer.minibatches(batch, 3, gen)]
           for _ in range(2)]
    want_gen = torch.Generator().manual_seed(seeding.derive(5, seeding.LEARN, 2, 0)[0])
    for epoch in got:
        perm = torch.randperm(10, generator=want_gen).tolist()
        assert epoch == [perm[0:3], perm[3:6], perm[6:9], perm[9:]]
    assert got[0] != got[1]
    assert [mb.total for mb in trainer.minibatches(batch, 3, gen)] == [3, 3, 3, 1]


def test_means_divide_each_sum_by_every_minibatch_added():
    means = Means()
    for terms in ({"loss_a": 1.0, "kl": 0.5}, {"loss_a": 2.0, "kl": 0.25}, {"loss_a": 6.0}):
        means.add(terms)
    assert means.means() == {"loss_a": 3.0, "kl": 0.25}  # (9 / 3, 0.75 / 3)
    assert list(means.means()) == ["loss_a", "kl"] and Means().means() == {}


@pytest.mark.parametrize("norm_adv", [True, False])
def test_ppos_update_equals_a_plain_loop_bit_for_bit(norm_adv):
    """PPO's loop over the Trainer's pieces against the loop written out: same seeds, same
    maths, the same floats."""
    policy, batch = ppo_setup()
    pi, _ = ppo_update(policy, batch, num_minibatches=3, iteration=4, seed=7, norm_adv=norm_adv)

    ref = copy.deepcopy(policy)
    opt = adam()(ref.parameters())
    gen = torch.Generator().manual_seed(seeding.derive(7, seeding.LEARN, 4, 0)[0])
    mb_size = batch.shape[0] // 3
    for _ in range(2):
        perm = torch.randperm(batch.shape[0], generator=gen)
        for start in range(0, batch.shape[0], mb_size):
            mb = batch[perm[start : start + mb_size]]
            out = ref.evaluate_actions(mb)
            log_ratio = out["log_prob"] - mb["log_prob"]
            adv = mb["advantage"]
            if norm_adv and len(mb) > 1:  # 40 = 3 x 13 + 1: the last minibatch has one sample
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            ratio = log_ratio.exp()
            pg = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
            v = 0.5 * ((out["value"] - mb["return"]) ** 2).mean()
            loss = pg + 0.5 * v - 0.0 * out["entropy"].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            opt.step()
    for (name, a), b in zip(pi.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name


def test_bf16_model_gets_fp32_masters_and_a_bf16_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(torch.bfloat16)
    start = copy.deepcopy(model).float()  # the same weights (bf16 -> fp32 is exact)
    trainer = Trainer(model, lambda p: torch.optim.SGD(p, lr=1.0), precision="auto")
    assert trainer.precision == "bf16"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    seen = []
    model[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    x, y = torch.randn(32, 6), torch.randn(32, 3)

    def loss_fn(mb):
        return TensorDict({"loss_mse": ((model(mb["x"]).float() - mb["y"]) ** 2).mean()}, [])

    trainer.gradients(TensorDict({"x": x, "y": y}, [32]), loss_fn)
    trainer.step()
    assert seen == [torch.bfloat16]
    # plain fp32 torch: SGD with lr 1 moves each weight by its gradient
    ((start(x) - y) ** 2).mean().backward()
    for (name, p), p0, ref in zip(model.named_parameters(), copy.deepcopy(start).parameters(),
                                  start.parameters()):
        assert p.dtype == torch.float32
        step = p0.detach() - p.detach()
        scale = ref.grad.abs().max()
        torch.testing.assert_close(step, ref.grad, rtol=0, atol=0.03 * scale, msg=name)


def test_adam_state_of_a_bf16_model_is_fp32_and_the_rollout_copy_loads_it():
    model = nn.Linear(4, 2).to(torch.bfloat16)
    trainer = Trainer(model, adam(), precision="auto", max_grad_norm=1.0)
    with trainer.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    trainer.backward(loss)
    trainer.step()
    state = trainer.optimizer.state[model.weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    rollout = nn.Linear(4, 2).to(torch.bfloat16)
    rollout.load_state_dict(model.state_dict())  # the sync casts the fp32 masters
    assert rollout.weight.dtype == torch.bfloat16
    torch.testing.assert_close(rollout.weight.float(), model.weight.detach(), rtol=1e-2, atol=1e-2)


def test_frozen_half_parameters_stay_half():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(torch.bfloat16)
    model[0].requires_grad_(False)
    Trainer(model, adam())
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32


def test_clipping_and_the_grad_divisor_by_hand():
    w0 = torch.tensor([[3.0, -4.0, 0.0]])
    model = nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(w0)
    trainer = Trainer(model, lambda p: torch.optim.SGD(p, lr=1.0), precision="fp32",
                      max_grad_norm=0.5)
    x = torch.tensor([[2.0, 0.0, 1.0], [4.0, -6.0, 1.0]])
    trainer.backward(model(x).sum())  # gradient: the column sums of x = (6, -6, 2)
    norm = trainer.step(grad_divisor=2.0)  # (3, -3, 1): norm sqrt(19)
    assert norm == pytest.approx(19 ** 0.5, rel=1e-6)
    expected = w0 - torch.tensor([[3.0, -3.0, 1.0]]) * 0.5 / (19 ** 0.5 + 1e-6)
    torch.testing.assert_close(model.weight.detach(), expected)
    assert model.weight.grad is None  # the step zeroes the gradients


def test_total_loss_sums_only_loss_terms():
    terms = TensorDict({"loss_a": torch.tensor(1.5), "loss_b": torch.tensor(-0.5),
                        "approx_kl": torch.tensor(9.0)}, [])
    assert total_loss(terms).item() == 1.0
