"""``policy=flow_mlp``: flow matching, the Euler sampler and the log-probs of Flow-Noise's and
Flow-SDE's chains, each against a computation by hand or a plain loop over torch's Normal."""

import math

import pytest
import torch
from tensordict import TensorDict
from torch.distributions import Normal

from m2flow import keys
from m2flow.envs import EnvSpec
from m2flow.policies import PolicyError, make_policy, policy_config
from m2flow.policies.flow import sample_time, sde_sigma, sde_step, time_embedding, time_grid


def linear_policy(w, b, *, state_dim, chunk, steps=4, low=-1.0, high=1.0, **kw):
    """A flow_mlp whose velocity is one linear layer over [state, chunk, time features] with
    the given weights, raw (unnormalised) state, one action dim in [low, high]."""
    spec = EnvSpec({"state": (state_dim,)}, 1, (low,), (high,), 50)
    pi = make_policy(policy_config(name="flow_mlp", hidden_sizes=[], normalize_obs=False,
                                   chunk=chunk, denoise_steps=steps, time_embed_dim=2, **kw),
                     spec)
    with torch.no_grad():
        pi.velocity_head.weight.copy_(torch.tensor(w))
        pi.velocity_head.bias.copy_(torch.tensor(b))
    return pi


def obs_batch(state):
    state = torch.as_tensor(state, dtype=torch.float32)
    return TensorDict({"obs": {"state": state}}, batch_size=[state.shape[0]])


def test_flow_matching_loss_against_a_hand_worked_example():
    """v = [s + 2 x_1 + 0.1, -x_2] (time features weighted 0), actions in [0, 2]:
    sample 1: a = [1.2, 0.6] -> [0.2, -0.4] normalised, ε = [1, -0.5], t = 0.25, s = 0.5:
    x_t = [0.4, -0.425], u = [0.8, -0.1], v = [1.4, 0.425]: ((0.6)² + 0.525²)/2 = 0.3178125;
    sample 2: a = [1, 1.5] -> [0, 0.5], ε = [0.5, 0.5], t = 0.5, s = -1:
    x_t = [0.25, 0.5], u = [0.5, 0], v = [-0.4, -0.5]: (0.81 + 0.25)/2 = 0.53."""
    pi = linear_policy([[1.0, 2.0, 0.0, 0.0, 0.0], [0.0, 0.0, -1.0, 0.0, 0.0]], [0.1, 0.0],
                       state_dim=1, chunk=2, low=0.0, high=2.0)
    batch = obs_batch([[0.5], [-1.0]])
    batch["action"] = torch.tensor([[[1.2], [0.6]], [[1.0], [1.5]]])
    eps = torch.tensor([[[1.0], [-0.5]], [[0.5], [0.5]]])
    loss = pi.bc_loss(batch, eps=eps, t=torch.tensor([0.25, 0.5]))
    torch.testing.assert_close(loss, torch.tensor([0.3178125, 0.53]))


def test_flow_matching_times_follow_openpis_beta():
    """t = 0.001 + 0.999 * Beta(1.5, 1): P(t <= x) = ((x - 0.001) / 0.999) ** 1.5."""
    t = sample_time(200_000, torch.Generator().manual_seed(0))
    assert 0.001 <= float(t.min()) and float(t.max()) <= 1.0
    for x in (0.1, 0.5, 0.9):
        assert abs(float((t <= x).float().mean()) - ((x - 0.001) / 0.999) ** 1.5) < 0.005


def test_time_embedding_by_hand():
    """Periods 0.004 and 4 at t = 0.5: angles 250π and π/4."""
    r = math.sqrt(0.5)
    torch.testing.assert_close(time_embedding(torch.tensor([0.5]), 4),
                               torch.tensor([[0.0, r, 1.0, r]]), atol=1e-4, rtol=0)


def test_euler_sampler_against_a_hand_worked_two_step_example():
    """v(s, x, t) = s + x, K = 2 (Δ = 1/2): c_1 = c_0 - (c_0 + s)/2 = (c_0 - s)/2,
    c_2 = (c_1 - s)/2 = (c_0 - 3s)/4; the env action maps [-1, 1] to [0, 4] and clips."""
    pi = linear_policy([[1.0, 1.0, 0.0, 0.0]], [0.0], state_dim=1, chunk=1, steps=2,
                       low=0.0, high=4.0)
    s = torch.tensor([0.2, -0.4, 1.0, -2.0])
    torch.manual_seed(0)
    out = pi.act(obs_batch(s[:, None]), deterministic=True)
    c0 = out["flow_chain"][:, 0, 0, 0]
    torch.testing.assert_close(out["flow_chain"][:, 1, 0, 0], (c0 - s) / 2)
    torch.testing.assert_close(out["flow_chain"][:, 2, 0, 0], (c0 - 3 * s) / 4)
    torch.testing.assert_close(out["action"][:, 0], (2 + 2 * (c0 - 3 * s) / 4).clamp(0, 4))
    assert out["action"].shape == (4, 1)  # chunk 1: one action per call
    assert (out["action"] == 4.0).any()  # s = -2 lands outside: clipped, the chain is not


def small_policy(method, **kw):
    spec = EnvSpec({"state": (4,)}, 2, (-1.0,) * 2, (1.0,) * 2, 50)
    torch.manual_seed(0)
    return make_policy(policy_config(name="flow_mlp", hidden_sizes=[16], normalize_obs=False,
                                     chunk=3, denoise_steps=4, noise_method=method, **kw), spec)


def velocity_and_features(pi, s, x, t):
    """The network by hand: its trunk over [state, flattened chunk, time features]."""
    inp = torch.cat([s, x.flatten(1), time_embedding(torch.full((s.shape[0],), t), 32)], -1)
    features = pi.trunk(inp)
    return pi.velocity_head(features).view_as(x), features


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_flow_noise_chain_log_prob_is_normals_summed_by_a_plain_loop(reduce):
    pi = small_policy("flow_noise", logprob_reduce=reduce)
    b = obs_batch(torch.randn(5, 4))
    with torch.no_grad():
        out = pi.act(b)
    chain, s, k_steps = out["flow_chain"], b["obs", "state"], 4
    lo, hi = math.log(0.08 ** 2), math.log(0.16 ** 2)
    log_prob, entropy = torch.zeros(5, 3, 2), torch.zeros(5, 3, 2)
    with torch.no_grad():
        for k in range(k_steps):
            v, f = velocity_and_features(pi, s, chain[:, k], 1 - k / k_steps)
            z = pi.noise_head.net(f).view_as(v)
            std = torch.exp(0.5 * (lo + (hi - lo) * (torch.tanh(z) + 1) / 2))
            assert ((std >= 0.08 - 1e-6) & (std <= 0.16 + 1e-6)).all()
            step = Normal(chain[:, k] - v / k_steps, std)
            log_prob += step.log_prob(chain[:, k + 1])
            entropy += step.entropy()
    if reduce == "mean":  # RLinf's joint_logprob: c_0's N(0, 1) term too, over K + 1 terms
        log_prob = (log_prob + Normal(0.0, 1.0).log_prob(chain[:, 0])) / (k_steps + 1)
        entropy = (entropy + Normal(0.0, 1.0).entropy()) / (k_steps + 1)
    torch.testing.assert_close(out["log_prob"], log_prob.sum((1, 2)))
    torch.testing.assert_close(out["token_log_prob"], log_prob.flatten(1))
    b.update(out)
    ev = pi.evaluate_actions(b)
    torch.testing.assert_close(ev["log_prob"], log_prob.sum((1, 2)))
    torch.testing.assert_close(ev["entropy"], entropy.sum((1, 2)))


def test_flow_noise_std_stays_in_its_range():
    pi = small_policy("flow_noise", noise_std_range=[0.05, 0.2])
    f = torch.randn(3, 16)
    for bias, std in ((100.0, 0.2), (-100.0, 0.05)):
        with torch.no_grad():
            pi.noise_head.net[-1].bias.fill_(bias)
        torch.testing.assert_close(pi.noise_head(f), torch.full((3, 6), std))


def test_flow_sde_sigma_by_hand():
    """σ_t = 0.5·√(t/(1-t)) on K = 4's grid; at t = 1 the denominator is 1 - 0.75."""
    got = sde_sigma(time_grid(4)[:-1], 0.5, 0.75)
    by_hand = torch.tensor([0.5 * 2.0, 0.5 * math.sqrt(3.0), 0.5, 0.5 / math.sqrt(3.0)])
    torch.testing.assert_close(got, by_hand)


def test_flow_sde_chain_has_one_stochastic_step_and_its_log_prob_is_that_normals():
    pi = small_policy("flow_sde", noise_level=0.5)
    b = obs_batch(torch.randn(16, 4))
    with torch.no_grad():
        out = pi.act(b)
    chain, step, s, k_steps = out["flow_chain"], out["flow_step"], b["obs", "state"], 4
    assert len(set(step.tolist())) > 1  # each sample draws its own step
    log_prob = torch.zeros(16)
    with torch.no_grad():
        for k in range(k_steps):
            t = 1 - k / k_steps
            x = chain[:, k]
            v, _ = velocity_and_features(pi, s, x, t)
            ode = x - v / k_steps
            sigma = 0.5 * math.sqrt(t / (1 - (t if t < 1 else 0.75)))
            mean = ode - sigma ** 2 / k_steps / (2 * t) * (x + (1 - t) * v)
            here = step == k
            torch.testing.assert_close(chain[~here, k + 1], ode[~here])  # the ODE's elsewhere
            lp = Normal(mean, sigma / math.sqrt(k_steps)).log_prob(chain[:, k + 1]).sum((1, 2))
            log_prob = torch.where(here, lp, log_prob)
    torch.testing.assert_close(out["log_prob"], log_prob)
    b.update(out)
    ev = pi.evaluate_actions(b)
    torch.testing.assert_close(ev["log_prob"], log_prob)
    assert (ev["entropy"] == 0).all()


def test_flow_sde_draws_its_stochastic_step_only_from_sde_steps():
    pi = small_policy("flow_sde", noise_level=0.5, sde_steps=[1, 3])
    b = obs_batch(torch.randn(400, 4))
    with torch.no_grad():
        out = pi.act(b)
    step, chain = out["flow_step"], out["flow_chain"]
    counts = torch.bincount(step, minlength=4).tolist()
    assert counts[0] == counts[2] == 0 and min(counts[1], counts[3]) > 150, counts
    with torch.no_grad():  # the steps not drawn are the ODE's: c_{k+1} = c_k - v/K
        s = b["obs", "state"]
        for k in (0, 2):
            v, _ = velocity_and_features(pi, s, chain[:, k], 1 - k / 4)
            torch.testing.assert_close(chain[:, k + 1], chain[:, k] - v / 4)
    b.update(out)
    torch.testing.assert_close(pi.evaluate_actions(b)["log_prob"], out["log_prob"])


def test_sde_steps_are_checked_against_the_chain():
    spec = EnvSpec({"state": (4,)}, 2, (-1.0,) * 2, (1.0,) * 2, 50)
    for bad in ([4], [], [2, 2], [-1]):
        with pytest.raises(PolicyError, match=r"policy.sde_steps=.*denoise_steps=4"):
            make_policy(policy_config(name="flow_mlp", denoise_steps=4, sde_steps=bad), spec)


@pytest.mark.parametrize("method", ["flow_sde", "flow_noise"])
def test_ppo_and_grpo_ratios_are_exactly_one_at_the_rollouts_weights(method):
    """What the learner recomputes from the stored chain equals what the rollout logged, and
    the policy loss's gradient reaches the velocity network (and Flow-Noise's noise head)."""
    from m2flow.embodied.algorithms.grpo import grpo_loss
    from m2flow.embodied.algorithms.ppo import ppo_loss
    from m2flow.runs.rl import level_log_probs

    pi = small_policy(method)
    b = obs_batch(torch.randn(8, 4))
    with torch.no_grad():
        b.update(pi.act(b))
    b["advantage"], b["return"] = torch.randn(8), torch.randn(8)
    terms = ppo_loss(pi, b, clip_coef=0.2, vf_coef=0.5, ent_coef=0.01)
    assert float(terms["approx_kl"]) == 0.0 and float(terms["clip_fraction"]) == 0.0
    assert float(grpo_loss(pi, b, clip_coef=0.2, ent_coef=0.0)["approx_kl"]) == 0.0
    new, old = level_log_probs(pi.evaluate_actions(b), b, "action", 2)
    assert new.shape == (8, 3) and torch.equal(new.detach(), old)  # one ratio per action
    terms["loss_policy"].backward()
    assert pi.velocity_head.weight.grad.abs().sum() > 0
    if method == "flow_noise":
        assert pi.noise_head.net[-1].weight.grad.abs().sum() > 0


def test_sde_step_keeps_the_flows_marginals():
    """A 1-D Gaussian target a ~ N(0.7, 0.3²), whose exact velocity is known: with
    x_t = t·ε + (1-t)·a ~ N(m_t, V_t), m_t = (1-t)·0.7, V_t = (1-t)²·0.09 + t²,
    v(x, t) = E[ε - a | x_t = x] = -0.7 + (t - (1-t)·0.09) / V_t · (x - m_t).
    That velocity is affine in x, so is each step's mean, and the chain's law stays Gaussian:
    its mean and variance go through each step exactly (mean α·m + β, variance α²·P + std²),
    no sampling. Every step of a 200-step chain made stochastic ends at the target's mean and
    variance, as the ODE's marginals do; the same noise without the score term of the drift
    ends three times too wide."""
    mu, var, k_steps = 0.7, 0.09, 200
    grid = time_grid(k_steps).double()

    def final_moments(drift_fix: bool) -> tuple[float, float]:
        m, p = 0.0, 1.0  # c_0 ~ N(0, 1)
        x = torch.tensor([0.0, 1.0], dtype=torch.float64)  # two points fix an affine map
        for k in range(k_steps):
            t = grid[k]
            v = -mu + (t - (1 - t) * var) / ((1 - t) ** 2 * var + t ** 2) * (x - (1 - t) * mu)
            mean, std = sde_step(x, v, t, 1 / k_steps, sde_sigma(t, 0.5, float(grid[1])))
            if not drift_fix:
                mean = x - v / k_steps
            alpha, beta = mean[1] - mean[0], mean[0]
            m, p = alpha * m + beta, alpha ** 2 * p + std[0] ** 2
        return float(m), float(p)

    mean, variance = final_moments(drift_fix=True)
    assert abs(mean - mu) < 1e-6 and abs(variance - var) < 1e-3, (mean, variance)
    assert final_moments(drift_fix=False)[1] > 2.5 * var


def test_flow_mlp_settings_are_checked():
    spec = EnvSpec({"state": (4,)}, 2, (-1.0,) * 2, (1.0,) * 2, 50)
    with pytest.raises(PolicyError, match="policy.noise_method='flow_ode'"):
        make_policy(policy_config(name="flow_mlp", noise_method="flow_ode"), spec)
    with pytest.raises(PolicyError, match=r"policy.noise_std_range=\[0.2, 0.1\]"):
        make_policy(policy_config(name="flow_mlp", noise_method="flow_noise",
                                  noise_std_range=[0.2, 0.1]), spec)
    with pytest.raises(PolicyError, match="logprob_reduce='mean' averages Flow-Noise"):
        make_policy(policy_config(name="flow_mlp", logprob_reduce="mean"), spec)


def test_a_flow_policys_act_writes_only_listed_keys():
    from tests.embodied.test_keys import unknown

    for method in ("flow_sde", "flow_noise"):
        pi = small_policy(method)
        b = obs_batch(torch.randn(3, 4))
        out = pi.act(b)
        assert keys.FLOW_CHAIN in out.keys() and unknown(out) == set()
        b.update(out)
        assert unknown(pi.evaluate_actions(b)) == set()
