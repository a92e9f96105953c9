"""Each on-policy algorithm's own update loop (``train``: PPO, GRPO, BC) over the Trainer's
pieces, against the loop written out here: the seeded minibatch order (one permutation per
epoch), one clipped Adam step per minibatch, the reported means, the early stop at
``target_kl`` after an epoch, and micro-batches that leave the update as it was. SAC's loop:
tests/embodied/test_sac.py; several ranks: tests/embodied/test_data_parallel.py."""

import copy

import pytest
import torch
from tensordict import TensorDict

from m2flow.embodied.algorithms.bc import BC, BCConfig
from m2flow.embodied.algorithms.grpo import GRPO, GRPOConfig
from m2flow.embodied.algorithms.ppo import PPO, PPOConfig
from m2flow.envs import EnvSpec
from m2flow.policies import make_policy, policy_config
from m2flow.runs import seeding
from m2flow.runs.learner import Trainer

SPEC = EnvSpec({"state": (5,)}, 2, (-1.0, -1.0), (1.0, 1.0), 50)
ROWS, EPOCHS, MINIBATCHES, LR, SEED, ITERATION = 24, 3, 4, 1e-2, 5, 2
ALGORITHMS = ("ppo", "grpo", "bc")


def setup(off_policy: float = 0.3):
    """An MLP policy and a prepared batch (B,): behaviour log-probs ``off_policy`` noise away
    from the policy's own (0: the policy's, so the KL starts at 0), advantages far from
    normalised, the actions as expert targets for BC."""
    torch.manual_seed(0)
    policy = make_policy(policy_config(name="mlp", hidden_sizes=[16], normalize_obs=False), SPEC)
    g = torch.Generator().manual_seed(1)
    b = TensorDict({"obs": {"state": torch.randn(ROWS, 5, generator=g)}}, batch_size=[ROWS])
    with torch.no_grad():
        b.update(policy.act(b))
    b["log_prob"] = b["log_prob"] + off_policy * torch.randn(ROWS, generator=g)
    b["advantage"] = 1.0 + 2.0 * torch.randn(ROWS, generator=g)
    b["return"] = torch.randn(ROWS, generator=g)
    return policy, b


def algorithm(name: str, tmp_path, **cfg):
    sizes = dict(learning_rate=LR, update_epochs=EPOCHS, num_minibatches=MINIBATCHES, **cfg)
    if name == "ppo":
        return PPO(PPOConfig(**{"norm_adv": False, "target_kl": None, **sizes}), action_dim=2,
                   seed=SEED)
    if name == "grpo":
        return GRPO(GRPOConfig(group_size=2, **sizes), action_dim=2, seed=SEED)
    path = tmp_path / "demos.pt"  # BC's dataset: read at construction, not by train
    torch.save(TensorDict({"obs": {"state": torch.zeros(2, 5)}, "action": torch.zeros(2, 2)},
                          batch_size=[2]), path)
    return BC(BCConfig(dataset=str(path), **sizes), action_dim=2, seed=SEED)


def update(algo, policy, batch):
    """A copy of ``policy`` after ``algo.train`` on ``batch``; the metrics; each minibatch's
    rows (the ``return`` column, distinct floats) in the order the loss saw them."""
    pi = copy.deepcopy(policy)
    trainer = Trainer(pi, lambda p: torch.optim.Adam(p, lr=LR, eps=1e-5), precision="fp32",
                      max_grad_norm=algo.cfg.max_grad_norm)
    seen, loss = [], algo.loss
    algo.loss = lambda policy, mb: seen.append(mb["return"].tolist()) or loss(policy, mb)
    metrics = algo.train(pi, batch, trainer, iteration=ITERATION, seed=SEED)
    return pi, metrics, seen


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_update_is_cleanrls_loop_bit_for_bit(name, tmp_path):
    """Epochs of a permutation drawn from the (seed, LEARN, iteration) generator, cut into
    minibatches of B / num_minibatches; per minibatch zero, backward of the ``loss_*`` sum,
    clip, Adam step; the metrics the minibatches' means."""
    policy, batch = setup()
    algo = algorithm(name, tmp_path)
    pi, metrics, seen = update(algo, policy, batch)

    ref = copy.deepcopy(policy)
    opt = torch.optim.Adam(ref.parameters(), lr=LR, eps=1e-5)
    gen = torch.Generator().manual_seed(seeding.derive(SEED, seeding.LEARN, ITERATION, 0)[0])
    size = ROWS // MINIBATCHES
    rows, sums, plain = [], {}, algorithm(name, tmp_path)
    for _ in range(EPOCHS):
        perm = torch.randperm(ROWS, generator=gen)
        for start in range(0, ROWS, size):
            mb = batch[perm[start:start + size]]
            rows.append(mb["return"].tolist())
            terms = plain.loss(ref, mb)
            opt.zero_grad()
            sum(v for k, v in terms.items() if k.startswith("loss_")).backward()
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), algo.cfg.max_grad_norm)
            opt.step()
            for k, v in {**terms, "grad_norm": norm}.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach())
    assert seen == rows and len(rows) == EPOCHS * MINIBATCHES
    for (n, a), b in zip(pi.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), n
    assert not torch.equal(pi.actor_mean[0].weight, policy.actor_mean[0].weight)  # it learned
    for k, v in sums.items():
        assert metrics[f"loss/{k}"] == v / len(rows), k
    assert metrics["loss/early_stop"] == 0.0
    assert metrics["loss/total"] == sum(v / len(rows) for k, v in sums.items()
                                        if k.startswith("loss_"))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_micro_batches_leave_the_update_as_one_backward_per_minibatch(name, tmp_path):
    policy, batch = setup()
    whole, m_whole, _ = update(algorithm(name, tmp_path), policy, batch)
    split, m_split, seen = update(algorithm(name, tmp_path, micro_batch_size=4), policy, batch)
    assert {len(rows) for rows in seen} == {4, 2}  # minibatches of 6: 4 + 2 rows
    for (n, a), b in zip(whole.named_parameters(), split.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=n)
    for k, v in m_whole.items():
        assert m_split[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_the_update_stops_after_the_epoch_whose_last_minibatch_passes_target_kl(name,
                                                                                 tmp_path):
    """On-policy behaviour log-probs: the KL starts at 0 and grows as the policy moves. A
    target between the first and second epochs' last-minibatch KLs ends the update after
    the second epoch (its 4 minibatches all run); one above every KL never does."""
    policy, batch = setup(off_policy=0.0)
    kls = []
    algo = algorithm(name, tmp_path)
    loss = algo.loss
    algo.loss = lambda policy, mb: (lambda t: kls.append(float(t["approx_kl"])) or t)(
        loss(policy, mb))
    _, full, _ = update(algo, policy, batch)
    last = kls[MINIBATCHES - 1::MINIBATCHES]  # each epoch's last minibatch
    assert full["loss/early_stop"] == 0.0 and len(last) == EPOCHS
    assert 0 < last[0] < last[1]

    _, stopped, seen = update(algorithm(name, tmp_path, target_kl=(last[0] + last[1]) / 2),
                              policy, batch)
    assert len(seen) == 2 * MINIBATCHES and stopped["loss/early_stop"] == 1.0
    _, kept, seen = update(algorithm(name, tmp_path, target_kl=2 * max(kls)), policy, batch)
    assert len(seen) == EPOCHS * MINIBATCHES and kept["loss/early_stop"] == 0.0
