"""The demonstrations' NLL inside PPO's and GRPO's loss (``algorithm.demo_coef``)."""

import math

import pytest
import torch
from tensordict import TensorDict

from m2flow.embodied.algorithms import AlgorithmError
from m2flow.embodied.algorithms.grpo import GRPO, GRPOConfig
from m2flow.embodied.algorithms.ppo import PPO, PPOConfig, ppo_loss
from m2flow.envs import EnvSpec
from m2flow.policies import make_policy, policy_config

SPEC = EnvSpec({"state": (3,)}, 2, (-5.0, -5.0), (5.0, 5.0), 20)


def linear_policy():
    """A Gaussian policy whose mean is (0.5, -0.5) whatever the state, std 1."""
    pi = make_policy(policy_config(name="mlp", hidden_sizes=[], normalize_obs=False), SPEC)
    with torch.no_grad():
        pi.actor_mean[0].weight.zero_()
        pi.actor_mean[0].bias.copy_(torch.tensor([0.5, -0.5]))
        pi.actor_log_std.zero_()
    return pi


def demos(path):
    state = torch.randn(2, 3)
    action = torch.tensor([[1.5, -0.5], [0.5, 0.5]])
    torch.save(TensorDict({"obs": {"state": state}, "action": action}, batch_size=[2]), path)
    return str(path)


def rl_minibatch(pi, n=4):
    mb = TensorDict({"obs": {"state": torch.randn(n, 3)}}, batch_size=[n])
    with torch.no_grad():
        mb.update(pi.act(mb))
    mb["advantage"], mb["return"] = torch.randn(n), torch.randn(n)
    return mb


def test_the_term_by_hand_at_its_decayed_weight(tmp_path):
    # each demo step is one unit from the mean in one dim: NLL = 1/2 + 2 x 1/2 log(2 pi);
    # at iteration 2 the weight is 0.5 x 0.5^2
    cfg = PPOConfig(demo_coef=0.5, demo_decay=0.5, demo_dataset=demos(tmp_path / "d.pt"),
                    demo_batch_size=2)
    ppo, pi = PPO(cfg, action_dim=2, seed=0), linear_policy()
    ppo.demos.start(2)
    ppo.demos.next_minibatch()
    mb = rl_minibatch(pi)
    terms = ppo.loss(pi, mb)
    nll = 0.5 + math.log(2 * math.pi)
    assert float(terms["demo_nll"]) == pytest.approx(nll, rel=1e-6)
    assert float(terms["loss_demo"]) == pytest.approx(0.125 * nll, rel=1e-6)
    plain = ppo_loss(pi, mb, clip_coef=cfg.clip_coef, vf_coef=cfg.vf_coef,
                     ent_coef=cfg.ent_coef, action_dim=2)  # the other terms as without it
    for k in plain.keys():
        assert torch.equal(terms[k], plain[k]), k


def test_the_terms_gradient_pulls_the_mean_towards_the_demos(tmp_path):
    cfg = GRPOConfig(group_size=2, demo_coef=1.0, demo_dataset=demos(tmp_path / "d.pt"),
                     demo_batch_size=2)
    grpo, pi = GRPO(cfg, action_dim=2, seed=0), linear_policy()
    grpo.demos.start(0)
    grpo.demos.next_minibatch()
    grpo.demos.terms(pi, "cpu")["loss_demo"].backward()
    # d/d mu of mean_i (a_i - mu)^2 / 2 = -(mean of a - mu) = -((1, 0) - (0.5, -0.5))
    assert torch.allclose(pi.actor_mean[0].bias.grad, torch.tensor([-0.5, -0.5]))


def test_micro_batches_share_a_minibatchs_rows_and_the_next_minibatch_draws_anew(tmp_path):
    path = tmp_path / "d.pt"
    torch.save(TensorDict({"obs": {"state": torch.arange(30.0).reshape(10, 3)},
                           "action": torch.zeros(10, 2)}, batch_size=[10]), path)
    ppo = PPO(PPOConfig(demo_coef=1.0, demo_dataset=str(path), demo_batch_size=4),
              action_dim=2, seed=0)
    pi = linear_policy()
    ppo.demos.start(0)
    rows = []
    for _ in range(2):  # two minibatches of two micro-batches each
        ppo.demos.next_minibatch()
        for _ in range(2):
            ppo.demos.terms(pi, "cpu")
            rows.append(ppo.demos.batch["obs", "state"][:, 0].tolist())
    assert rows[0] == rows[1] and rows[2] == rows[3] and rows[0] != rows[2]
    ppo.demos.start(0)  # the same iteration again (a resumed run): the same rows
    ppo.demos.next_minibatch()
    ppo.demos.terms(pi, "cpu")
    assert ppo.demos.batch["obs", "state"][:, 0].tolist() == rows[0]


@pytest.mark.parametrize("config", [PPOConfig, lambda **kw: GRPOConfig(group_size=2, **kw)])
def test_a_weight_without_demonstrations_is_one_line_naming_the_fix(config):
    with pytest.raises(AlgorithmError) as e:
        config(demo_coef=0.1).validate()
    text = str(e.value)
    assert text.startswith("algorithm.demo_dataset=None:") and "demo_coef=0.1" in text
    assert "\n" not in text


def test_a_flow_policys_term_is_its_flow_matching_loss(tmp_path):
    """Demonstrations hold no denoising chain to score: a flow policy's term is its own
    supervised loss (``Policy.bc_loss``) on the demos' action chunks, with its gradient."""
    pi = make_policy(policy_config(name="flow_mlp", hidden_sizes=[8], chunk=2), SPEC)
    chunks = torch.randn(3, 2, 2)  # (N, chunk, A)
    data = TensorDict({"obs": {"state": torch.randn(3, 3)}, "action": chunks}, batch_size=[3])
    torch.save(data, tmp_path / "d.pt")
    cfg = PPOConfig(demo_coef=1.0, demo_dataset=str(tmp_path / "d.pt"), demo_batch_size=3)
    ppo = PPO(cfg, action_dim=2, seed=0)
    ppo.demos.start(0)
    ppo.demos.next_minibatch()
    mb = rl_minibatch(pi)
    torch.manual_seed(0)  # the term's noise and times
    terms = ppo.loss(pi, mb)
    torch.manual_seed(0)
    expected = pi.bc_loss(ppo.demos.batch).mean()
    assert float(terms["demo_nll"]) == pytest.approx(float(expected), rel=1e-6)
    terms["loss_demo"].backward()
    assert pi.velocity_head.weight.grad.abs().sum() > 0
