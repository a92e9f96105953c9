"""``policy.task_embedding``: on a multi-task env the state policies (mlp, cnn, flow_mlp) read
a learned row per task, so that one policy can act differently on the suite's tasks."""

import pytest
import torch
from tensordict import TensorDict

from m2flow.envs import EnvSpec
from m2flow.policies import PolicyError, make_policy, policy_config

TASKS = ("pick up the soup", "pick up the ketchup", "pick up the milk")
STATE = EnvSpec({"state": (5,)}, 2, (-1.0,) * 2, (1.0,) * 2, 50, tasks=TASKS)
RGB = EnvSpec({"rgb": (32, 32, 3), "state": (5,)}, 2, (-1.0,) * 2, (1.0,) * 2, 50, tasks=TASKS)
SPECS = {"mlp": STATE, "cnn": RGB, "flow_mlp": STATE}


def obs_of(spec, task, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    obs = {"state": torch.randn(n, 5, generator=g), "task": torch.as_tensor(task).expand(n)}
    if "rgb" in spec.obs_shapes:
        obs["rgb"] = torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g)
    return TensorDict({"obs": obs}, batch_size=[n])


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_same_state_under_another_task_gets_another_action_only_with_the_embedding(name):
    torch.manual_seed(0)
    for dim, differs in ((16, True), (0, False)):
        pi = make_policy(policy_config(name=name, task_embedding=dim), SPECS[name])
        with torch.no_grad():
            a0, a2 = (pi.act(obs_of(SPECS[name], t), deterministic=True)["action"]
                      for t in (0, 2))
        assert (not torch.allclose(a0, a2)) == differs, (name, dim)


def test_the_mlp_actor_reads_the_normalised_state_then_the_tasks_row():
    """The deterministic action by hand: the actor's MLP on [norm(state), table[task]]."""
    torch.manual_seed(0)
    pi = make_policy(policy_config(name="mlp", task_embedding=3, hidden_sizes=[8]), STATE)
    batch = obs_of(STATE, [2, 0, 1, 2])
    state, task = batch["obs", "state"], batch["obs", "task"]
    by_hand = pi.actor_mean(torch.cat([pi.obs_norm(state), pi.task_emb.table.weight[task]], -1))
    with torch.no_grad():
        torch.testing.assert_close(pi.act(batch, deterministic=True)["action"], by_hand)


def test_one_policy_clones_opposite_actions_of_two_tasks_from_the_same_states():
    """Two tasks whose expert acts +0.5 and -0.5 from the same states: with the embedding BC
    fits both (loss -> 0); without it the best it can do is their mean (loss 0.25)."""
    spec = EnvSpec({"state": (5,)}, 2, (-1.0,) * 2, (1.0,) * 2, 50, tasks=TASKS[:2])
    losses = {}
    for dim in (8, 0):
        torch.manual_seed(0)
        pi = make_policy(policy_config(name="mlp", task_embedding=dim, hidden_sizes=[32]), spec)
        opt = torch.optim.Adam(pi.parameters(), lr=1e-2)
        b0, b1 = obs_of(spec, 0, n=32), obs_of(spec, 1, n=32)  # the same states (seed 0)
        batch = torch.cat([b0, b1])
        target = torch.cat([torch.full((32, 2), 0.5), torch.full((32, 2), -0.5)])
        for _ in range(300):
            loss = ((pi.actor_mean(pi._features(batch["obs"])) - target) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[dim] = loss.item()
    assert losses[8] < 0.01 and losses[0] > 0.2, losses


def test_a_one_task_env_gets_no_embedding_and_old_checkpoints_keep_their_keys():
    spec = EnvSpec({"state": (5,)}, 2, (-1.0,) * 2, (1.0,) * 2, 50)
    pi = make_policy(policy_config(name="mlp"), spec)
    assert pi.task_emb is None and not any("task" in k for k in pi.state_dict())


def test_a_negative_width_and_a_missing_task_index_are_one_line_errors():
    with pytest.raises(PolicyError, match=r"policy.task_embedding=-1: a width >= 0"):
        make_policy(policy_config(name="mlp", task_embedding=-1), STATE)
    pi = make_policy(policy_config(name="mlp"), STATE)
    batch = TensorDict({"obs": {"state": torch.zeros(2, 5)}}, batch_size=[2])
    with pytest.raises(PolicyError, match=r"carry no \('obs', 'task'\)"):
        pi.act(batch)
