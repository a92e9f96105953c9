import pytest
import torch
from tensordict import TensorDict

from m2flow.embodied.algorithms import AlgorithmError
from m2flow.embodied.algorithms.ppo import PPO, PPOConfig, ppo_loss
from m2flow.envs import EnvSpec
from m2flow.pipelines.distributed import DataParallel
from m2flow.policies import make_policy, policy_config
from m2flow.runs.rl import normalized_advantages

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
    return make_policy(policy_config(name="mlp", hidden_sizes=[16]), SPEC)


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
    terms = ppo_loss(pi, b, **LOSS_KW)
    assert terms["clip_fraction"].item() == 1.0
    terms["loss_policy"].backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in pi.actor_mean.parameters())


def test_loss_terms_by_hand_at_ratio_one():
    """Ratio 1: policy loss = -mean(A); value loss = 0.5 vf mean((V - R)^2)."""
    pi = policy()
    b = batch(pi)
    terms = ppo_loss(pi, b, **LOSS_KW)
    torch.testing.assert_close(terms["loss_policy"], -b["advantage"].mean())
    torch.testing.assert_close(terms["loss_value"],
                               0.25 * ((b["value"] - b["return"]) ** 2).mean())
    assert terms["loss_entropy"].item() < 0  # an entropy *bonus*


def test_advantages_are_normalised_over_the_whole_minibatch():
    mb = TensorDict({"advantage": torch.tensor([1.0, 2.0, 3.0, 6.0])}, [4])
    out = normalized_advantages(mb, DataParallel())
    # mean 3, sample std sqrt(14/3)
    expected = (torch.tensor([1.0, 2.0, 3.0, 6.0]) - 3.0) / (14 / 3) ** 0.5
    torch.testing.assert_close(out["advantage"], expected)
    assert mb["advantage"][0] == 1.0  # the caller's batch is not changed
    one = mb[:1]  # one row has no std: left as it is
    assert normalized_advantages(one, DataParallel()) is one


class _TokenCritic:
    """Per-token log-probs and values fixed by the test (a VLA with a value head, reduced to
    what ``ppo_loss`` reads)."""

    def __init__(self, token_log_prob, value):
        self.token_log_prob, self.value = token_log_prob, value

    def evaluate_actions(self, mb):
        tok = self.token_log_prob
        return TensorDict({"token_log_prob": tok, "log_prob": tok.sum(-1), "value": self.value,
                           "entropy": torch.zeros(len(mb))}, batch_size=mb.batch_size)


@pytest.mark.parametrize("level,policy_loss", [
    # sample 0 (A=+1): token ratios 1.5, 1.0 -> -1.2 (clipped), -1.0; the action's 1.5 -> -1.2
    # sample 1 (A=-1): token ratios 1.0, 0.5 -> 1.0, 0.8 (clipped below: the max is 0.8);
    # the action's 0.5 -> 0.8. Means: token (-1.2 - 1 + 1 + 0.8) / 4, action (-1.2 + 0.8) / 2
    ("token", -0.1),
    ("action", -0.2),
    ("chunk", -0.2),
])
def test_ppo_loss_at_each_logprob_level_by_hand(level, policy_loss):
    old = torch.zeros(2, 2)
    new = torch.log(torch.tensor([[1.5, 1.0], [1.0, 0.5]]))
    mb = TensorDict({"token_log_prob": old, "log_prob": old.sum(-1), "value": torch.zeros(2),
                     "advantage": torch.tensor([1.0, -1.0]), "return": torch.tensor([1.0, 3.0])},
                    batch_size=[2])
    terms = ppo_loss(_TokenCritic(new, torch.tensor([0.0, 1.0])), mb, **LOSS_KW, level=level,
                     action_dim=2)
    assert terms["loss_policy"].item() == pytest.approx(policy_loss)
    # 0.5 * mean((0 - 1)^2, (1 - 3)^2) = 1.25, times vf_coef 0.5, at every level
    assert terms["loss_value"].item() == pytest.approx(0.625)


def test_stop_early_at_target_kl():
    ppo = PPO(PPOConfig(target_kl=0.05), action_dim=2, seed=0)
    assert ppo.stop_early({"approx_kl": 0.06}) and not ppo.stop_early({"approx_kl": 0.04})
    assert not PPO(PPOConfig(target_kl=None), action_dim=2, seed=0).stop_early({"approx_kl": 9.0})


@pytest.mark.parametrize("field,value", [
    ("learning_rate", -1.0), ("update_epochs", 0), ("num_minibatches", 0),
    ("micro_batch_size", 0), ("max_grad_norm", 0.0), ("precision", "fp8"), ("gamma", 0.0),
    ("gamma", 1.5), ("gae_lambda", -0.1), ("clip_coef", 0.0), ("vf_coef", -1.0),
    ("ent_coef", -0.1), ("target_kl", 0.0), ("logprob_level", "tokens"),
    ("lr_schedule", "cosine"), ("desired_kl", 0.0),
])
def test_validate_names_the_field_the_value_and_the_fix(field, value):
    cfg = PPOConfig(**{field: value})
    with pytest.raises(AlgorithmError) as e:
        cfg.validate()
    text = str(e.value)
    assert text.startswith(f"algorithm.{field}={value!r}: ") and "\n" not in text
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("other, fix", [
    ({"anneal_lr": True}, "set algorithm.anneal_lr=false, or lr_schedule=fixed to anneal."),
])
def test_the_adaptive_step_size_with_a_schedule_it_excludes_is_one_error_naming_the_fix(other, fix):
    cfg = PPOConfig(lr_schedule="adaptive", **other)
    with pytest.raises(AlgorithmError) as e:
        cfg.validate()
    text = str(e.value)
    assert text.startswith("algorithm.lr_schedule='adaptive': ") and text.endswith(fix)
    assert "\n" not in text


def test_the_default_config_is_valid():
    PPOConfig().validate()
    PPOConfig(micro_batch_size=4, precision="bf16", target_kl=None).validate()
    PPOConfig(logprob_level="token").validate()
    PPOConfig(lr_schedule="adaptive", desired_kl=0.02).validate()
