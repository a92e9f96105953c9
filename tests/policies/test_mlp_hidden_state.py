"""``policy.kwargs.actor_hidden_state``: dims of the state the actor never reads."""

import pytest
import torch
from tensordict import TensorDict

from m2flow.envs import EnvSpec
from m2flow.policies import PolicyConfig, PolicyError, make_policy

SPEC = EnvSpec({"state": (6,)}, 2, (-1.0, -1.0), (1.0, 1.0), 20)


def policy(hidden):
    torch.manual_seed(0)
    cfg = PolicyConfig(name="mlp", hidden_sizes=[16], normalize_obs=False,
                       kwargs={"actor_hidden_state": hidden})
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
    assert text.startswith(f"policy.kwargs.actor_hidden_state={bad}:") and "\n" not in text
