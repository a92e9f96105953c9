import torch
from tensordict import TensorDict

from m2flow.embodied.ppo import ppo_loss, total_loss
from m2flow.envs import EnvSpec
from m2flow.policies import PolicyConfig, make_policy

SPEC = EnvSpec({"state": (5,)}, 2, (-1.0, -1.0), (1.0, 1.0), 50)
LOSS_KW = dict(clip_coef=0.2, vf_coef=0.5, ent_coef=0.01)


def batch(policy, n=8, seed=0):
    torch.manual_seed(seed)
    obs = TensorDict({"state": torch.randn(n, 5)}, batch_size=[n])
    b = TensorDict({"obs": obs}, batch_size=[n])
    with torch.no_grad():
        b.update(policy.act(b))
    b["advantage"] = torch.randn(n)
    b["return"] = torch.randn(n)
    return b


def policy(seed=0):
    torch.manual_seed(seed)
    return make_policy(PolicyConfig(name="mlp", hidden_sizes=[16]), SPEC)


def test_ratio_one_gives_no_clipping_and_zero_kl():
    pi = policy()
    terms = ppo_loss(pi, batch(pi), **LOSS_KW)
    assert terms["clip_fraction"].item() == 0.0
    assert abs(terms["approx_kl"].item()) < 1e-7


def test_value_loss_gradients_reach_only_the_critic():
    pi = policy()
    ppo_loss(pi, batch(pi), **LOSS_KW)["loss_value"].backward()
    for name, p in pi.named_parameters():
        touched = p.grad is not None and p.grad.abs().sum() > 0
        assert touched == name.startswith("critic"), name


def test_policy_loss_gradients_never_reach_the_critic():
    pi = policy()
    ppo_loss(pi, batch(pi), **LOSS_KW)["loss_policy"].backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in pi.critic.parameters())
    assert pi.actor_log_std.grad.abs().sum() > 0


def test_clipped_ratio_stops_the_policy_gradient():
    pi = policy()
    b = batch(pi)
    b["log_prob"] = b["log_prob"] - 1.0  # ratio e > 1 + clip everywhere
    b["advantage"] = torch.ones(len(b))  # positive advantage: clipped side is active
    terms = ppo_loss(pi, b, norm_adv=False, **LOSS_KW)
    assert terms["clip_fraction"].item() == 1.0
    terms["loss_policy"].backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in pi.actor_mean.parameters())


def test_total_loss_sums_only_loss_terms():
    pi = policy()
    terms = ppo_loss(pi, batch(pi), **LOSS_KW)
    expected = terms["loss_policy"] + terms["loss_value"] + terms["loss_entropy"]
    torch.testing.assert_close(total_loss(terms), expected)
    assert terms["loss_entropy"].item() < 0  # an entropy *bonus*
