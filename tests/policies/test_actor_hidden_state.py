"""``policy.actor_hidden_state`` (mlp and cnn): dims of the state the actor never reads."""

import pytest
import torch
from tensordict import TensorDict

from m2flow.envs import EnvSpec
from m2flow.policies import PolicyError, make_policy, policy_config

SPEC = EnvSpec({"state": (6,)}, 2, (-1.0, -1.0), (1.0, 1.0), 20)


def policy(hidden):
    torch.manual_seed(0)
    cfg = policy_config(name="mlp", hidden_sizes=[16], normalize_obs=False,
                        actor_hidden_state=hidden)
    return make_policy(cfg, SPEC)


def acts(pi, state):
    with torch.no_grad():
        return pi.act(TensorDict({"obs": {"state": state}}, [state.shape[0]]), deterministic=True)


def test_the_actor_ignores_hidden_dims_and_the_critic_reads_them():
    pi = policy([[2, 4]])
    state = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    moved = state.clone()
    moved[:, 2:4] += 3.0  # only hidden dims
    a, b = acts(pi, state), acts(pi, moved)
    assert torch.equal(a["action"], b["action"])
    assert not torch.allclose(a["value"], b["value"])
    seen = state.clone()
    seen[:, 4] += 3.0  # a dim just past the range: the actor reads it
    assert not torch.allclose(acts(pi, seen)["action"], a["action"])
    # the same weights without the option: the actor is the one fed zeros in those dims
    plain = policy([])
    plain.load_state_dict(pi.state_dict())
    zeroed = state.clone()
    zeroed[:, 2:4] = 0.0
    assert torch.equal(acts(plain, zeroed)["action"], a["action"])


@pytest.mark.parametrize("bad", [[[4, 2]], [[0, 7]], [[1]]])
def test_a_bad_range_is_one_line_naming_the_option(bad):
    with pytest.raises(PolicyError) as e:
        policy(bad)
    text = str(e.value)
    assert text.startswith(f"policy.actor_hidden_state={bad}:") and "\n" not in text


CNN_SPEC = EnvSpec({"rgb": (36, 36, 3), "state": (5,)}, 2, (-1.0, -1.0), (1.0, 1.0), 20)


def cnn(hidden):
    torch.manual_seed(0)
    cfg = policy_config(name="cnn", hidden_sizes=[16], normalize_obs=False,
                        feature_dim=8, actor_hidden_state=hidden)
    return make_policy(cfg, CNN_SPEC)


def test_the_cnn_actor_ignores_hidden_state_dims_but_not_the_image():
    gen = torch.Generator().manual_seed(2)
    rgb = torch.randint(0, 256, (4, 36, 36, 3), generator=gen, dtype=torch.uint8)
    state = torch.randn(4, 5, generator=gen)

    def run(pi, rgb, state):
        with torch.no_grad():
            obs = {"rgb": rgb, "state": state}
            return pi.act(TensorDict({"obs": obs}, [4]), deterministic=True)

    pi = cnn([[1, 3]])
    a = run(pi, rgb, state)
    moved = state.clone()
    moved[:, 1:3] -= 2.0
    b = run(pi, rgb, moved)
    assert torch.equal(a["action"], b["action"])
    assert not torch.allclose(a["value"], b["value"])  # the shared critic reads them
    seen = state.clone()
    seen[:, 0] -= 2.0  # the dim before the range: the 8 image features come first
    assert not torch.allclose(run(pi, rgb, seen)["action"], a["action"])
    assert not torch.allclose(run(pi, 255 - rgb, state)["action"], a["action"])
    plain = cnn(None)
    plain.load_state_dict(pi.state_dict())
    zeroed = state.clone()
    zeroed[:, 1:3] = 0.0
    assert torch.equal(run(plain, rgb, zeroed)["action"], a["action"])


def test_a_cnn_range_past_the_state_is_refused_in_one_line():
    with pytest.raises(PolicyError) as e:
        cnn([[3, 6]])
    assert str(e.value).startswith("policy.actor_hidden_state=[[3, 6]]:")


def test_the_vla_proprio_token_reads_zeros_in_its_hidden_dims():
    """``policy.proprio_hidden`` of openvla_oft: scored on fixed action tokens, a policy
    hiding dims 2-4 is blind to them, sees dim 5, and equals the same weights without the
    option fed zeros there."""
    from tests.policies.test_oft import KW, obs, spec

    def vla(hidden):
        torch.manual_seed(0)
        return make_policy(policy_config(name="openvla_oft",
                                         **{**KW, "proprio_hidden": hidden}), spec())

    def score(pi, o, tokens):
        with torch.no_grad():
            td = TensorDict({"obs": o, "action_tokens": tokens}, [o.shape[0]])
            return pi.evaluate_actions(td)["log_prob"]

    pi, o = vla([[2, 5]]), obs(3)
    tokens = pi.act(TensorDict({"obs": o}, [3]))["action_tokens"]
    base = score(pi, o, tokens)
    moved = o.clone()
    moved["state"][:, 2:5] += 1.5
    assert torch.equal(score(pi, moved, tokens), base)
    seen = o.clone()
    seen["state"][:, 5] += 1.5
    assert not torch.allclose(score(pi, seen, tokens), base)
    plain = vla([])
    plain.load_state_dict(pi.state_dict())
    zeroed = o.clone()
    zeroed["state"][:, 2:5] = 0.0
    torch.testing.assert_close(score(plain, zeroed, tokens), base, rtol=0, atol=0)
    with pytest.raises(PolicyError, match=r"^policy.proprio_hidden=\[\[2, 9\]\]: "):
        vla([[2, 9]])
