"""``algorithm=sac`` with ``policy=sac_mlp``: the squashed Gaussian's log-prob against torch's
own transformed distribution; one update of the engine's SAC against a plain cleanRL-style
update of copies of the same networks; the replay buffer through a checkpoint; bad fields."""


import pytest
import torch
from tensordict import TensorDict
from torch.distributions import Normal, TransformedDistribution
from torch.distributions.transforms import AffineTransform, TanhTransform

from m2flow.embodied.algorithms import AlgorithmError
from m2flow.embodied.algorithms.sac import SAC, SACConfig
from m2flow.envs import EnvSpec
from m2flow.policies import make_policy, policy_config
from m2flow.policies.sac import LOG_STD_MAX, LOG_STD_MIN
from m2flow.runs import seeding
from m2flow.runs.learner import Trainer

OBS, ACT, B = 3, 2, 16
SPEC = EnvSpec({"state": (OBS,)}, ACT, (-1.0, -2.0), (1.0, 2.0), 50)
ADAM_EPS = 1e-5  # the learner's


def policy(seed=0):
    torch.manual_seed(seed)
    return make_policy(policy_config(name="sac_mlp", hidden_sizes=[16, 16], activation="relu",
                                     normalize_obs=False, init_alpha=0.5), SPEC)


def traj(n=2, t=8, seed=0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    term = torch.rand(n, t, generator=g) < 0.2
    trunc = ~term & (torch.rand(n, t, generator=g) < 0.2)
    return TensorDict({
        "obs": {"state": torch.randn(n, t, OBS, generator=g)},
        "action": torch.rand(n, t, ACT, generator=g) * 2 - 1, "log_prob": torch.zeros(n, t),
        "next": {"obs": {"state": torch.randn(n, t, OBS, generator=g)},
                 "reward": torch.randn(n, t, generator=g), "terminated": term,
                 "truncated": trunc, "done": term | trunc}}, batch_size=[n, t])


def test_the_log_prob_is_torchs_tanh_transformed_gaussian():
    pi = policy()
    obs = TensorDict({"state": torch.randn(B, OBS)}, batch_size=[B])
    torch.manual_seed(1)
    action, log_prob = pi.sample(obs)
    mean, log_std = pi.actor(obs["state"]).chunk(2, -1)
    std = (LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(log_std) + 1)).exp()
    dist = TransformedDistribution(Normal(mean, std), [
        TanhTransform(), AffineTransform(pi.action_bias, pi.action_scale)])
    ref = dist.log_prob(action).sum(-1)
    assert torch.allclose(log_prob, ref, atol=1e-3)  # (eps in the log of the Jacobian)
    again = pi.evaluate_actions(TensorDict({"obs": obs, "action": action}, [B]))["log_prob"]
    assert torch.allclose(again, log_prob, atol=1e-3)


def reference_update(pi, mb, cfg: SACConfig, target_entropy: float):
    """One SAC update the cleanRL way, on its own optimisers: critics, actor, temperature,
    Polyak; the noise drawn in the same order as the engine's (seeded by the caller)."""
    q_opt = torch.optim.Adam(pi.critic.parameters(), lr=cfg.critic_learning_rate, eps=ADAM_EPS)
    a_opt = torch.optim.Adam(pi.actor.parameters(), lr=cfg.learning_rate, eps=ADAM_EPS)
    t_opt = torch.optim.Adam([pi.log_alpha], lr=cfg.alpha_learning_rate, eps=ADAM_EPS)
    obs, next_obs = mb["obs"], mb["next", "obs"]
    with torch.no_grad():
        next_a, next_logp = pi.sample(next_obs)
        tq = pi.q_target(next_obs, next_a)
        alpha = pi.log_alpha.exp()
        y = mb["next", "reward"] + cfg.gamma * (1 - mb["next", "terminated"].float()) * (
            torch.min(tq[:, 0], tq[:, 1]) - alpha * next_logp)
    q = pi.q(obs, mb["action"])
    qf_loss = ((q[:, 0] - y) ** 2).mean() + ((q[:, 1] - y) ** 2).mean()
    q_opt.zero_grad()
    qf_loss.backward()
    q_opt.step()
    a, logp = pi.sample(obs)
    q = pi.q(obs, a)
    actor = (pi.log_alpha.exp().detach() * logp - torch.min(q[:, 0], q[:, 1])).mean()
    a_opt.zero_grad()
    actor.backward()
    a_opt.step()
    alpha_loss = (-pi.log_alpha.exp() * (logp.detach() + target_entropy)).mean()
    t_opt.zero_grad()
    alpha_loss.backward()
    t_opt.step()
    with torch.no_grad():
        for t, o in zip(pi.critic_target.parameters(), pi.critic.parameters()):
            t.copy_(cfg.tau * o + (1 - cfg.tau) * t)


def test_one_update_equals_a_plain_cleanrl_style_update():
    cfg = SACConfig(name="sac", batch_size=B, learning_starts=16, utd=1 / 16, tau=0.1,
                    learning_rate=1e-3, critic_learning_rate=2e-3, alpha_learning_rate=5e-3)
    pi, ref = policy(), policy()
    ref.load_state_dict(pi.state_dict())
    sac = SAC(cfg, action_dim=ACT, seed=0)
    trainer = Trainer(pi, lambda params: torch.optim.Adam(sac.param_groups(pi, params),
                                                          lr=cfg.learning_rate, eps=ADAM_EPS))
    trainer.set_lr(cfg.learning_rate)
    batch, _ = sac.prepare(pi, traj(), iteration=0, staleness=0)  # 16 transitions: 1 update
    # the minibatch the engine will draw, drawn here from the same generator state
    before = {n: p.detach().clone() for n, p in pi.named_parameters()}
    gen = torch.Generator().manual_seed(seeding.derive(0, seeding.LEARN, 0, 0)[0])
    mb = sac.buffer.sample(B, generator=gen)
    torch.manual_seed(5)
    metrics = sac.train(pi, batch, trainer, iteration=0, seed=0)
    assert metrics["loss/updates"] == 1.0
    torch.manual_seed(5)
    reference_update(ref, mb, cfg, target_entropy=-ACT)
    for (n, p), (_, r) in zip(pi.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p, r, atol=1e-6), n
        if not n.startswith("critic_target"):
            assert not torch.equal(p, before[n]), n  # every trained part moved
    assert not torch.equal(dict(pi.named_parameters())["critic_target.0.0.weight"],
                           before["critic_target.0.0.weight"])  # and the targets trailed


def test_the_replay_buffer_comes_back_from_a_checkpoint(tmp_path):
    cfg = SACConfig(name="sac", batch_size=4, learning_starts=1000)
    sac, pi = SAC(cfg, action_dim=ACT, seed=0), policy()
    sac.prepare(pi, traj(seed=1), iteration=0, staleness=0)
    torch.save(sac.state_dict(), tmp_path / "algo.pt")
    again = SAC(cfg, action_dim=ACT, seed=0)
    again.load_state_dict(torch.load(tmp_path / "algo.pt", weights_only=False))
    again.prepare(pi, traj(seed=2), iteration=1, staleness=0)  # the next iteration's rows
    saved, now = sac.buffer.stored(), again.buffer.stored()
    assert len(again.buffer) == 32 and torch.equal(now[:16]["obs", "state"],
                                                   saved["obs", "state"])
    assert again.owed == pytest.approx(sac.owed + cfg.utd * 16)
    without = SAC(SACConfig(name="sac", checkpoint_buffer=False), action_dim=ACT, seed=0)
    without.prepare(pi, traj(seed=1), iteration=0, staleness=0)
    assert without.state_dict()["buffer"] is None


@pytest.mark.parametrize("field, value", [
    ("gamma", 0.0), ("tau", 1.5), ("batch_size", 0), ("buffer_size", 10),
    ("learning_starts", -1), ("utd", 0.0), ("policy_frequency", 0),
    ("critic_learning_rate", 0.0), ("max_grad_norm", 0.0), ("demo_ratio", 1.0), ("num_demos", 0),
])
def test_validate_names_the_field_and_the_fix(field, value):
    with pytest.raises(AlgorithmError) as e:
        SACConfig(name="sac", **{field: value}).validate()
    assert str(e.value).startswith(f"algorithm.{field}={value!r}: ") and "\n" not in str(e.value)


def test_sac_refuses_a_policy_without_twin_critics():
    pi = make_policy(policy_config(name="mlp", hidden_sizes=[8]), SPEC)
    with pytest.raises(ValueError, match="use policy=sac_mlp"):
        SAC(SACConfig(name="sac"), action_dim=ACT, seed=0).param_groups(pi, list(pi.parameters()))


def write_demos(path, episodes=2, t=5, rewards=True):
    """An m2flow-demos layout by hand: states 100 + step (so a row's source is plain)."""
    import h5py

    with h5py.File(path, "w") as f:
        for e in range(episodes):
            g = f.create_group(f"traj_{e}")
            g.create_group("obs").create_dataset(
                "state", data=(100.0 + torch.arange(t + 1)[:, None].repeat(1, OBS)).numpy())
            g.create_dataset("actions", data=torch.zeros(t, ACT).numpy())
            if rewards:
                g.create_dataset("rewards", data=torch.ones(t).numpy())
            done = torch.zeros(t, dtype=torch.bool)
            done[-1] = True
            for name, value in (("terminated", done), ("truncated", torch.zeros(t, dtype=bool)),
                                ("success", done)):
                g.create_dataset(name, data=value.numpy())


def test_rlpd_draws_its_share_of_every_minibatch_from_the_demos(tmp_path):
    write_demos(tmp_path / "d.h5")
    sac = SAC(SACConfig(name="sac", demos=str(tmp_path / "d.h5"), demo_ratio=0.25),
              action_dim=ACT, seed=0)
    sac.prepare(policy(), traj(), iteration=0, staleness=0)
    mb = sac.sampler.sample(400, generator=torch.Generator().manual_seed(0))
    from_demos = mb["obs", "state"][:, 0] >= 100  # online states are N(0, 1)
    assert int(from_demos.sum()) == 100  # 400 x 0.25, exactly
    demo = mb[from_demos]
    # a demo row's next state is the recorded one after it; its last step terminated
    assert torch.equal(demo["next", "obs", "state"], demo["obs", "state"] + 1)
    assert torch.equal(demo["next", "terminated"], demo["obs", "state"][:, 0] == 104)
    assert (demo["next", "reward"] == 1).all()


def test_demos_recorded_without_rewards_are_one_error_naming_the_field(tmp_path):
    write_demos(tmp_path / "old.h5", rewards=False)
    with pytest.raises(AlgorithmError, match=r"^algorithm.demos=.*no rewards.*record it again"):
        SACConfig(name="sac", demos=str(tmp_path / "old.h5")).validate()  # at start-up


def test_sac_cnn_trains_its_encoder_from_the_critics_loss_alone():
    """policy=sac_cnn: the encoder belongs to the critics. With the critics' step size at
    1e-12, one engine update moves the actor by ~its step size and the encoder by nothing:
    the actor's loss (whose Q runs through the encoder) leaves it alone."""
    spec = EnvSpec({"rgb": (36, 36, 3), "state": (OBS,)}, ACT, (-1.0, -2.0), (1.0, 2.0), 50)
    torch.manual_seed(0)
    pi = make_policy(policy_config(name="sac_cnn", hidden_sizes=[16], activation="relu",
                                   normalize_obs=False, feature_dim=8), spec)
    cfg = SACConfig(name="sac", batch_size=B, learning_starts=16, utd=1 / 16,
                    learning_rate=1e-3, critic_learning_rate=1e-12)
    sac = SAC(cfg, action_dim=ACT, seed=0)
    trainer = Trainer(pi, lambda params: torch.optim.Adam(sac.param_groups(pi, params),
                                                          lr=cfg.learning_rate, eps=ADAM_EPS))
    trainer.set_lr(cfg.learning_rate)
    rows = traj()
    g = torch.Generator().manual_seed(3)
    for key in ("obs", ("next", "obs")):
        rows[key]["rgb"] = torch.randint(0, 256, (2, 8, 36, 36, 3), generator=g, dtype=torch.uint8)
    before = {n: p.detach().clone() for n, p in pi.named_parameters()}
    batch, _ = sac.prepare(pi, rows, iteration=0, staleness=0)
    assert sac.train(pi, batch, trainer, iteration=0, seed=0)["loss/updates"] == 1.0
    moved = {n: (p - before[n]).abs().max().item() for n, p in pi.named_parameters()}
    assert all(v < 1e-9 for n, v in moved.items() if n.startswith("critic.encoder.")), moved
    assert max(v for n, v in moved.items() if n.startswith("actor.")) > 1e-4, moved
    assert "critic.encoder.convs.0.weight" in pi.critic_parameter_names()
