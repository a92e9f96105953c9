from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from m2flow.envs import EnvSpec
from m2flow.policies import PolicyError, make_policy, policy_config, registered_policies
from m2flow.policies.registry import policy_class

STATE_SPEC = EnvSpec({"state": (7,)}, 3, (-1.0,) * 3, (1.0,) * 3, 50)
RGB_SPEC = EnvSpec({"rgb": (64, 64, 3), "state": (5,)}, 3, (-1.0,) * 3, (1.0,) * 3, 50)
SPECS = {"mlp": STATE_SPEC, "cnn": RGB_SPEC, "openvla": RGB_SPEC, "openvla_oft": RGB_SPEC,
         "sac_mlp": STATE_SPEC, "sac_cnn": RGB_SPEC, "flow_mlp": STATE_SPEC,
         "pi0": RGB_SPEC}  # a newly registered policy needs an entry here


def random_obs(spec, n):
    obs = {}
    for key, shape in spec.obs_shapes.items():
        if key == "rgb":
            obs[key] = torch.randint(0, 256, (n, *shape), dtype=torch.uint8)
        else:
            obs[key] = torch.randn(n, *shape)
    return TensorDict({"obs": obs}, batch_size=[n])


@pytest.mark.parametrize("name", registered_policies())
@pytest.mark.parametrize("n", [2, 16])
def test_every_policy_acts_and_evaluates_consistently(name, n):
    assert name in SPECS, f"add an EnvSpec for policy {name!r} to SPECS"
    torch.manual_seed(0)
    pi = make_policy(policy_config(name=name), SPECS[name])
    b = random_obs(SPECS[name], n)
    with torch.no_grad():
        out = pi.act(b)
    # (n, 3), or (n, chunk, 3) for a policy that decodes action chunks
    assert out["action"].shape[0] == n and out["action"].shape[-1] == 3
    assert out["action"].dtype == torch.float32
    assert out["log_prob"].shape == (n,) and out["value"].shape == (n,)
    b.update(out)
    ev = pi.evaluate_actions(b)
    torch.testing.assert_close(ev["log_prob"], out["log_prob"])
    torch.testing.assert_close(ev["value"], out["value"])
    assert (ev["entropy"] > -1e9).all()


@pytest.mark.parametrize("name", registered_policies())
def test_every_policy_is_built_on_the_device_make_policy_is_given(name):
    """``make_policy(..., device=)``: built there (policies whose ``__init__`` takes a device)
    or moved there (the others); ``meta`` stands in for a GPU and allocates nothing."""
    pi = make_policy(policy_config(name=name), SPECS[name], device="meta")
    assert {t.device.type for t in [*pi.parameters(), *pi.buffers()]} == {"meta"}


def test_deterministic_action_is_the_mean_and_repeatable():
    pi = make_policy(policy_config(name="mlp"), STATE_SPEC)
    b = TensorDict({"obs": {"state": torch.randn(4, 7)}}, batch_size=[4])
    a1, a2 = (pi.act(b, deterministic=True)["action"] for _ in range(2))
    torch.testing.assert_close(a1, a2)


@pytest.mark.parametrize("name", registered_policies())
def test_every_policys_deterministic_action_does_not_depend_on_its_batch(name):
    """Evaluation's promise: one observation acted on alone, or as row 3 of a batch of 9,
    gets the same deterministic action, whatever drew from the global generator between the
    calls. A flow policy whose ODE starts from a random draw fails this."""
    torch.manual_seed(0)
    pi = make_policy(policy_config(name=name), SPECS[name]).eval()
    batch = random_obs(SPECS[name], 9)
    with torch.no_grad():
        torch.manual_seed(1)
        in_batch = pi.act(batch, deterministic=True)["action"][3]
        torch.manual_seed(2)
        alone = pi.act(batch[3:4], deterministic=True)["action"][0]
    torch.testing.assert_close(alone, in_batch, rtol=1e-5, atol=1e-5)


def test_unknown_policy_lists_known_names():
    with pytest.raises(PolicyError, match=r"Unknown policy 'mpl'. Known: .*mlp.*Did you mean 'mlp'"):
        make_policy(policy_config(name="mpl"), STATE_SPEC)


def test_mlp_refuses_image_only_observations():
    spec = EnvSpec({"rgb": (64, 64, 3)}, 3, (-1.0,) * 3, (1.0,) * 3, 50)
    with pytest.raises(PolicyError, match="obs_mode=state"):
        make_policy(policy_config(name="mlp"), spec)


def test_running_norm_over_batches_equals_statistics_of_all_data():
    from m2flow.policies.normalizer import RunningNorm

    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, 3, generator=g) * 5 + 2 for n in (7, 1, 30)]
    norm = RunningNorm(3)
    for p in parts:
        norm.update(p)
    full = torch.cat(parts)
    torch.testing.assert_close(norm.mean, full.mean(0))
    torch.testing.assert_close(norm.var, full.var(0, unbiased=False))


def test_normalizer_travels_in_the_state_dict():
    pi = make_policy(policy_config(name="mlp"), STATE_SPEC)
    pi.observe(TensorDict({"obs": {"state": torch.randn(5, 7) + 3}}, batch_size=[5]))
    twin = make_policy(policy_config(name="mlp"), STATE_SPEC)
    twin.load_state_dict(pi.state_dict())
    b = TensorDict({"obs": {"state": torch.randn(4, 7)}}, batch_size=[4])
    torch.testing.assert_close(twin.value(b["obs"]), pi.value(b["obs"]))


@pytest.mark.parametrize("name", ["mlp", "flow_mlp", "sac_mlp", "cnn"])
def test_hold_obs_norm_keeps_the_loaded_statistics_through_updates(name):
    """``policy.hold_obs_norm``: a warm-started policy's state statistics stay the
    checkpoint's through every ``observe``; without it the same batch moves them."""
    spec = SPECS[name]
    trained = make_policy(policy_config(name=name, normalize_obs=True), spec)
    first = random_obs(spec, 64)
    first["obs", "state"] = first["obs", "state"] * 3 + 2
    trained.observe(first)
    norm_name = "state_norm" if name == "cnn" else "obs_norm"
    loaded = {k: v.clone() for k, v in trained.state_dict().items() if k.startswith(norm_name)}
    torch.testing.assert_close(loaded[f"{norm_name}.mean"], first["obs", "state"].mean(0))
    later = random_obs(spec, 32)
    later["obs", "state"] = later["obs", "state"] * 0.5 - 4
    for hold in (True, False):
        pi = make_policy(policy_config(name=name, normalize_obs=True, hold_obs_norm=hold), spec)
        pi.load_state_dict(trained.state_dict())
        pi.observe(later)
        now = {k: v for k, v in pi.state_dict().items() if k.startswith(norm_name)}
        moved = [not torch.equal(now[k], loaded[k]) for k in loaded]
        assert not any(moved) if hold else all(moved), (hold, moved)
    x = later["obs", "state"]
    by_hand = (x - loaded[f"{norm_name}.mean"]) / torch.sqrt(loaded[f"{norm_name}.var"] + 1e-8)
    held = make_policy(policy_config(name=name, normalize_obs=True, hold_obs_norm=True), spec)
    held.load_state_dict(trained.state_dict())
    held.observe(later)
    norm = held.state_norm if name == "cnn" else held.obs_norm
    torch.testing.assert_close(norm(x), by_hand.clamp(-10, 10))


@pytest.mark.parametrize("size", [32, 64, 128])
@pytest.mark.parametrize("state", [True, False])
def test_cnn_reads_any_image_size_with_or_without_state(size, state):
    torch.manual_seed(0)
    shapes = {"rgb": (size, size, 3), **({"state": (5,)} if state else {})}
    spec = EnvSpec(shapes, 3, (-1.0,) * 3, (1.0,) * 3, 50)
    pi = make_policy(policy_config(name="cnn", hidden_sizes=[16]), spec)
    b = random_obs(spec, 2)
    with torch.no_grad():
        out = pi.act(b)
    assert out["action"].shape == (2, 3) and torch.isfinite(out["action"]).all()
    assert pi.value(b["obs"]).shape == (2,)


def test_cnn_gradients_reach_the_conv_weights_through_evaluate():
    torch.manual_seed(0)
    pi = make_policy(policy_config(name="cnn", hidden_sizes=[16]), RGB_SPEC)
    b = random_obs(RGB_SPEC, 4)
    b["action"] = torch.randn(4, 3)
    ev = pi.evaluate_actions(b)
    (ev["log_prob"].sum() + ev["value"].sum()).backward()
    for conv in (m for m in pi.encoder.modules() if isinstance(m, torch.nn.Conv2d)):
        assert conv.weight.grad is not None and conv.weight.grad.abs().sum() > 0


PRIV_SPEC = EnvSpec({"rgb": (36, 36, 3), "state": (5,), "privileged": (9,)}, 3, (-1.0,) * 3,
                    (1.0,) * 3, 50)


def test_cnn_privileged_critic_reads_only_the_simulator_state_and_the_actor_never_does():
    torch.manual_seed(0)
    pi = make_policy(policy_config(name="cnn", hidden_sizes=[16],
                                   critic="privileged"), PRIV_SPEC)
    b = random_obs(PRIV_SPEC, 4)
    pi.observe(b)  # the privileged vector is normalised by what the policy has seen
    other_image = b.clone()
    other_image["obs", "rgb"] = torch.randint(0, 256, (4, 36, 36, 3), dtype=torch.uint8)
    other_image["obs", "state"] = torch.randn(4, 5)
    torch.testing.assert_close(pi.value(other_image["obs"]), pi.value(b["obs"]))
    other_priv = b.clone()
    other_priv["obs", "privileged"] = torch.randn(4, 9)
    assert not torch.allclose(pi.value(other_priv["obs"]), pi.value(b["obs"]))
    det = pi.act(b, deterministic=True)["action"]
    torch.testing.assert_close(pi.act(other_priv, deterministic=True)["action"], det)
    # by hand: the critic MLP over (x - mean) / std of the privileged vector
    x = b["obs", "privileged"]
    z = (x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + 1e-8)
    torch.testing.assert_close(pi.value(b["obs"]), pi.critic.net(z).squeeze(-1))
    # the value loss trains the critic alone: no gradient reaches the image encoder
    b["action"] = torch.randn(4, 3)
    pi.evaluate_actions(b)["value"].sum().backward()
    assert all(p.grad is None for p in pi.encoder.parameters())
    assert all(p.grad is not None for p in pi.critic.parameters())


def test_cnn_privileged_critic_needs_the_envs_privileged_state():
    from m2flow.envs import env_config

    cfg = policy_config(name="cnn", critic="privileged")
    env_cfg = env_config(name="ManiSkill/PushCube-v1", obs_mode="rgb")
    with pytest.raises(PolicyError, match="env.privileged_state=true"):
        policy_class("cnn").check_config(cfg, env_cfg)
    with pytest.raises(PolicyError, match="env.privileged_state=true"):
        make_policy(cfg, RGB_SPEC)
    with pytest.raises(PolicyError, match="policy.critic='actor'"):
        make_policy(policy_config(name="cnn", critic="actor"), PRIV_SPEC)


STATE_PRIV_SPEC = EnvSpec({"state": (5,), "privileged": (9,)}, 3, (-1.0,) * 3, (1.0,) * 3, 50)


def test_mlp_privileged_critic_reads_only_the_privileged_vector_and_the_actor_the_state():
    """``policy=mlp policy.critic=privileged`` (an mjlab task's critic group): the value
    is the critic MLP of the normalised privileged vector (by hand), the actor's mean does not
    see it, and the ELU activation is ELU."""
    torch.manual_seed(0)
    pi = make_policy(policy_config(name="mlp", hidden_sizes=[16], activation="elu",
                                   critic="privileged"), STATE_PRIV_SPEC)
    b = random_obs(STATE_PRIV_SPEC, 6)
    b["obs", "privileged"] = torch.randn(6, 9) * 3 + 1
    pi.observe(b)
    other_state = b.clone()
    other_state["obs", "state"] = torch.randn(6, 5)
    torch.testing.assert_close(pi.value(other_state["obs"]), pi.value(b["obs"]))
    det = pi.act(b, deterministic=True)["action"]
    assert not torch.allclose(pi.act(other_state, deterministic=True)["action"], det)
    other_priv = b.clone()
    other_priv["obs", "privileged"] = torch.randn(6, 9)
    torch.testing.assert_close(pi.act(other_priv, deterministic=True)["action"], det)
    x = b["obs", "privileged"]
    z = (x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + 1e-8)
    lin = [m for m in pi.critic.net if isinstance(m, torch.nn.Linear)]
    by_hand = lin[1](torch.nn.functional.elu(lin[0](z))).squeeze(-1)
    torch.testing.assert_close(pi.value(b["obs"]), by_hand)


def test_a_multi_task_privileged_critic_reads_which_task_is_run():
    """In an env with 3 tasks, the privileged critic's MLP reads the normalised privileged
    vector followed by the task's one-hot (by hand): the same state scores differently per
    task. A one-task env's critic reads the vector alone (the test above)."""
    torch.manual_seed(0)
    spec = EnvSpec({"state": (5,), "task": (), "privileged": (9,)}, 3, (-1.0,) * 3, (1.0,) * 3,
                   50, tasks=("push it", "pull it", "lift it"))
    pi = make_policy(policy_config(name="mlp", hidden_sizes=[16], activation="elu",
                                   critic="privileged"), spec)
    b = random_obs(spec, 6)
    b["obs", "privileged"] = torch.randn(6, 9) * 3 + 1
    b["obs", "task"] = torch.tensor([0, 1, 2, 0, 1, 2])
    pi.observe(b)
    x = b["obs", "privileged"]
    z = (x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + 1e-8)
    z = torch.cat([z, torch.eye(3)[b["obs", "task"]]], -1)  # (6, 12)
    lin = [m for m in pi.critic.net if isinstance(m, torch.nn.Linear)]
    assert lin[0].in_features == 12
    by_hand = lin[1](torch.nn.functional.elu(lin[0](z))).squeeze(-1)
    torch.testing.assert_close(pi.value(b["obs"]), by_hand)
    other_task = b.clone()
    other_task["obs", "task"] = (b["obs", "task"] + 1) % 3
    assert not torch.allclose(pi.value(other_task["obs"]), pi.value(b["obs"]))


def test_mlp_privileged_critic_needs_the_envs_privileged_state():
    from m2flow.envs import env_config

    cfg = policy_config(name="mlp", critic="privileged")
    with pytest.raises(PolicyError, match="env.privileged_state=true"):
        policy_class("mlp").check_config(cfg, env_config(name="mjlab/Mjlab-Lift-Cube-Yam"))
    with pytest.raises(PolicyError, match="env.privileged_state=true"):
        make_policy(cfg, EnvSpec({"state": (5,)}, 3, (-1.0,) * 3, (1.0,) * 3, 50))
    with pytest.raises(PolicyError, match=r"policy 'mlp' has no setting 'feature_dim'"):
        make_policy(policy_config(name="mlp", feature_dim=8), STATE_PRIV_SPEC)


def test_cnn_state_aux_predicts_the_normalised_simulator_state_from_the_actors_features():
    """policy.state_aux: a linear head on the actor's features regresses the
    normalised privileged vector; its loss (by hand) reaches PPO's and BC's terms and trains the
    encoder, and the actor's outputs are what they are without it. A target entry that only
    jitters (millimetres: a distractor at rest) is divided by the 0.01 floor, not stretched to
    unit variance."""
    from m2flow.embodied.algorithms.bc import BC
    from m2flow.embodied.algorithms.ppo import ppo_loss

    torch.manual_seed(0)
    pi = make_policy(policy_config(name="cnn", hidden_sizes=[16],
                                   critic="privileged", state_aux=0.5), PRIV_SPEC)
    torch.manual_seed(0)
    plain = make_policy(policy_config(name="cnn", hidden_sizes=[16],
                                      critic="privileged"), PRIV_SPEC)
    b = random_obs(PRIV_SPEC, 4)
    b["obs", "privileged"][:, 0] = 0.5 + 1e-3 * torch.randn(4)  # a resting object's jitter
    pi.observe(b)
    plain.observe(b)
    torch.testing.assert_close(pi.act(b, deterministic=True)["action"],
                               plain.act(b, deterministic=True)["action"])
    b["action"] = torch.randn(4, 3)
    out = pi.evaluate_actions(b)
    # by hand: the features (NatureCNN image features, then the normalised proprio state)
    s = b["obs", "state"]
    feats = torch.cat([pi.encoder(b["obs", "rgb"]),
                       (s - s.mean(0)) / torch.sqrt(s.var(0, unbiased=False) + 1e-8)], -1)
    x = b["obs", "privileged"]
    std = torch.sqrt(x.var(0, unbiased=False) + 1e-8)
    z = (x - x.mean(0)) / torch.where(std < 0.01, torch.full_like(std, 0.01), std)
    assert z[:, 0].abs().max() < 0.5 and z[:, 1:].std(0, unbiased=False).min() > 0.99
    by_hand = 0.5 * ((feats @ pi.state_aux.head.weight.T + pi.state_aux.head.bias - z) ** 2).mean(-1)
    torch.testing.assert_close(out["aux_loss"], by_hand)
    assert float(by_hand.detach().mean()) > 0.01
    b["log_prob"], b["value"] = out["log_prob"].detach(), out["value"].detach()
    b["advantage"], b["return"] = torch.randn(4), torch.randn(4)
    terms = ppo_loss(pi, b, clip_coef=0.2, vf_coef=0.5, ent_coef=0.0)
    torch.testing.assert_close(terms["loss_aux"], by_hand.mean())
    assert "loss_aux" not in ppo_loss(plain, b, clip_coef=0.2, vf_coef=0.5, ent_coef=0.0).keys()
    # BC.loss reads only its loss name and whether this iteration pretrains the auxiliary loss
    bc = SimpleNamespace(cfg=SimpleNamespace(loss="nll"), aux_only=False)
    torch.testing.assert_close(BC.loss(bc, pi, b)["loss_aux"], by_hand.mean())
    assert "loss_aux" not in BC.loss(bc, plain, b).keys()
    pi.zero_grad()
    out["aux_loss"].sum().backward()  # the auxiliary loss alone trains the encoder
    conv = next(m for m in pi.encoder.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.grad is not None and conv.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in pi.actor_mean.parameters())


def test_cnn_state_aux_is_refused_without_the_envs_privileged_state_or_below_zero():
    from m2flow.envs import env_config

    env_cfg = env_config(name="ManiSkill/PushCube-v1", obs_mode="rgb")
    with pytest.raises(PolicyError, match="state_aux=1.0 reads.*env.privileged_state=true"):
        policy_class("cnn").check_config(policy_config(name="cnn", state_aux=1.0),
                                         env_cfg)
    with pytest.raises(PolicyError, match="policy.state_aux=-1.0: must be >= 0"):
        make_policy(policy_config(name="cnn", state_aux=-1.0), PRIV_SPEC)


def test_cnn_refuses_state_only_observations():
    with pytest.raises(PolicyError, match="env.obs_mode=rgb"):
        make_policy(policy_config(name="cnn"), STATE_SPEC)


def test_cnn_refuses_unknown_settings():
    with pytest.raises(PolicyError, match="policy 'cnn' has no setting 'feature_dims'. "
                                          "Did you mean 'feature_dim'"):
        make_policy(policy_config(name="cnn", feature_dims=64), RGB_SPEC)


TIMM_KWARGS = {"encoder": "timm/resnet18", "feature_dim": 32}


def test_cnn_timm_encoder_acts_and_evaluates_consistently():
    torch.manual_seed(0)
    pi = make_policy(policy_config(name="cnn", hidden_sizes=[16], **TIMM_KWARGS), RGB_SPEC)
    b = random_obs(RGB_SPEC, 4)
    with torch.no_grad():
        out = pi.act(b)
    assert out["action"].shape == (4, 3) and torch.isfinite(out["action"]).all()
    b.update(out)
    with torch.no_grad():
        ev = pi.evaluate_actions(b)
    torch.testing.assert_close(ev["log_prob"], out["log_prob"])
    torch.testing.assert_close(ev["value"], out["value"])
    rgb_nt = b["obs", "rgb"].reshape(2, 2, 64, 64, 3)  # (N, T, H, W, C)
    with torch.no_grad():
        assert pi.encoder(rgb_nt).shape == (2, 2, 32)


def test_cnn_timm_encoder_weights_round_trip(tmp_path):
    torch.manual_seed(0)
    a = make_policy(policy_config(name="cnn", hidden_sizes=[16], **TIMM_KWARGS), RGB_SPEC)
    path = tmp_path / "resnet18.pt"
    torch.save(a.encoder.backbone.state_dict(), path)
    torch.manual_seed(1)
    kwargs = {**TIMM_KWARGS, "encoder_weights": str(path)}
    b = make_policy(policy_config(name="cnn", hidden_sizes=[16], **kwargs), RGB_SPEC)
    a_state, b_state = a.encoder.backbone.state_dict(), b.encoder.backbone.state_dict()
    assert a_state.keys() == b_state.keys()
    for key in a_state:
        torch.testing.assert_close(b_state[key], a_state[key])


def test_cnn_timm_encoder_refuses_missing_weights_file(tmp_path):
    kwargs = {**TIMM_KWARGS, "encoder_weights": str(tmp_path / "nope.pt")}
    with pytest.raises(PolicyError, match="policy.encoder_weights"):
        make_policy(policy_config(name="cnn", **kwargs), RGB_SPEC)


@pytest.mark.parametrize("encoder", ["timm/resnet81", "resnet18"])
def test_cnn_refuses_unknown_encoders_and_suggests_timm_resnet18(encoder):
    with pytest.raises(PolicyError, match=r"policy.encoder=.*timm/resnet18"):
        make_policy(policy_config(name="cnn", encoder=encoder), RGB_SPEC)


def test_timm_encoder_log_probs_do_not_depend_on_train_mode():
    """BatchNorm keeps its running statistics, so the learner (train mode) scores actions as
    the rollout worker (eval mode) chose them: PPO's first ratio is exactly 1."""
    torch.manual_seed(0)
    spec = EnvSpec({"rgb": (64, 64, 3)}, 2, (-1.0,) * 2, (1.0,) * 2, 50)
    cfg = policy_config(name="cnn", hidden_sizes=[16], encoder="timm/resnet10t")
    pi = make_policy(cfg, spec)
    b = TensorDict({"obs": {"rgb": torch.randint(0, 255, (4, 64, 64, 3), dtype=torch.uint8)}},
                   batch_size=[4])
    with torch.no_grad():
        out = pi.eval().act(b)
    b.update(out)
    torch.testing.assert_close(pi.train().evaluate_actions(b)["log_prob"], out["log_prob"])


@pytest.mark.parametrize("std", ["log", "scalar"])
def test_mlp_std_is_the_learned_parameter_or_its_exp(std):
    """``policy.std``: the Gaussian's spread is exp(log-std) or the parameter itself
    (rsl-rl's scalar std, clamped at 1e-6); checked against torch's Normal built by hand."""
    pi = make_policy(policy_config(name="mlp", hidden_sizes=[8], init_log_std=-0.3,
                                   std=std), STATE_SPEC)
    param = pi.actor_std if std == "scalar" else pi.actor_log_std
    with torch.no_grad():
        param.copy_(torch.tensor([0.5, -2.0, 1e-9]) if std == "scalar" else
                    torch.tensor([0.5, -2.0, 0.0]))
    b = random_obs(STATE_SPEC, 4)
    b["action"] = torch.randn(4, 3)
    # by hand: a scalar std's negative and tiny values clamp at 1e-6
    spread = (torch.tensor([0.5, 1e-6, 1e-6]) if std == "scalar" else
              torch.tensor([0.5, -2.0, 0.0]).exp())
    mean = pi.actor_mean(pi._features(b["obs"]))
    ref = torch.distributions.Normal(mean, spread).log_prob(b["action"]).sum(-1)
    torch.testing.assert_close(pi.evaluate_actions(b)["log_prob"], ref)


def test_mlp_refuses_an_unknown_std():
    with pytest.raises(PolicyError, match=r"policy.std='exp'"):
        make_policy(policy_config(name="mlp", std="exp"), STATE_SPEC)


def test_mlp_inputs_concatenate_the_state_and_the_simulators_poses():
    """``policy.inputs=[state, privileged]``: the control that sees the poses (a suite's
    state baseline). The actor's input is [state, privileged], normalised together."""
    spec = EnvSpec({"state": (3,), "privileged": (4,)}, 2, (-1.0,) * 2, (1.0,) * 2, 50)
    torch.manual_seed(0)
    pi = make_policy(policy_config(name="mlp", inputs=["state", "privileged"]), spec)
    obs = {"state": torch.randn(5, 3), "privileged": torch.randn(5, 4)}
    batch = TensorDict({"obs": obs}, batch_size=[5])
    pi.observe(batch)
    both = torch.cat([obs["state"], obs["privileged"]], -1)
    torch.testing.assert_close(pi.obs_norm.mean, both.mean(0), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        by_hand = pi.actor_mean(pi.obs_norm(both))
        torch.testing.assert_close(pi.act(batch, deterministic=True)["action"], by_hand)
        moved = batch.clone()
        moved["obs", "privileged"] += 1.0
        assert not torch.allclose(pi.act(moved, deterministic=True)["action"], by_hand)


def test_mlp_inputs_are_checked_at_start_up():
    from m2flow.envs import env_config

    pi_cfg = policy_config(name="mlp", inputs=["state", "privileged"])
    env_cfg = env_config("gym/Pendulum-v1")
    with pytest.raises(PolicyError, match=r"env.privileged_state=true"):
        policy_class("mlp").check_config(pi_cfg, env_cfg)
    with pytest.raises(PolicyError, match=r"policy.inputs=\['rgb'\]: distinct keys among"):
        policy_class("mlp").check_config(policy_config(name="mlp", inputs=["rgb"]), env_cfg)


def test_per_dimension_initial_noise_is_what_sampled_actions_spread_by():
    """policy.init_log_std_per_dim: 20,000 sampled actions of one observation spread by
    exp(value) in each dimension (measured, not read back), for the log-std and the scalar
    std; a list of another length is one line naming the field."""
    import math

    from m2flow.envs import EnvSpec
    from m2flow.policies.base import PolicyError
    from m2flow.policies.mlp import GaussianMLPPolicy, MLPPolicyConfig

    spec = EnvSpec({"state": (4,)}, 3, (-1.0,) * 3, (1.0,) * 3, 50)
    values = [-1.0, -3.5, -6.5]
    obs = TensorDict({"state": torch.randn(1, 4).expand(20_000, 4)}, batch_size=[20_000])
    for std in ("log", "scalar"):
        torch.manual_seed(0)
        pi = GaussianMLPPolicy(MLPPolicyConfig(name="mlp", hidden_sizes=[8], std=std,
                                               init_log_std_per_dim=values), spec)
        with torch.no_grad():
            a = pi.act(TensorDict({"obs": obs}, batch_size=[20_000]))["action"]
        spread = a.std(dim=0).tolist()
        for got, v in zip(spread, values):
            assert got == pytest.approx(math.exp(v), rel=0.03), (std, spread)
    with pytest.raises(PolicyError, match=r"^policy.init_log_std_per_dim has 2 values, but "
                                          r"the env's actions have 3 dimensions"):
        GaussianMLPPolicy(MLPPolicyConfig(name="mlp", init_log_std_per_dim=[-1.0, -2.0]), spec)
