"""Behaviour cloning through the generic learner loop, checked on the policy's actions."""

import pytest
import torch
from tensordict import TensorDict

from m2flow.embodied.algorithms import AlgorithmError
from m2flow.embodied.algorithms.bc import BCConfig
from m2flow.embodied.workers.learner_worker import LearnerWorker
from m2flow.envs import EnvSpec
from m2flow.pipelines import RankResources, WorkerInfo
from m2flow.policies import policy_config

SPEC = EnvSpec({"state": (4,)}, 2, (-5.0, -5.0), (5.0, 5.0), 8)
W = torch.tensor([[1.0, -0.5, 0.0, 2.0], [0.5, 1.0, -1.5, 0.0]])  # the expert: a = W s + b
B = torch.tensor([0.3, -0.2])


def expert(state):
    return state @ W.T + B


def obs(n, seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"state": torch.randn(n, 4, generator=g)}, batch_size=[n])


def write_dataset(path, n=32, t=16):
    o = obs(n * t, seed=1).reshape(n, t)  # (N, T)
    valid = torch.ones(n, t, dtype=torch.bool)
    valid[:, -2:] = False  # steps a crash lost: their actions are garbage
    action = expert(o["state"])
    action[~valid] = 100.0
    torch.save(TensorDict({"obs": o, "action": action, "valid": valid}, batch_size=[n, t]), path)


class _EnvTrajectories:
    """What the env workers send every iteration; BC logs it and trains on the dataset."""

    def get(self, key=0, timeout=None):
        o = obs(2, seed=0).reshape(2, 1)
        return TensorDict({"obs": o, "action": torch.zeros(2, 1, 2)}, batch_size=[2, 1])


def learner(**bc):
    info = WorkerInfo("learner", 0, 1, RankResources(0, 1.0, ()), "local")
    return LearnerWorker(info, policy_config(name="mlp", hidden_sizes=[64, 64]), BCConfig(**bc),
                         SPEC, seed=0, num_iterations=300)


def action_error(worker) -> float:
    """Mean squared distance of the policy's mean action to the expert's, on new states."""
    test = obs(512, seed=2)
    with torch.no_grad():
        act = worker.policy.act(TensorDict({"obs": test}, [512]), deterministic=True)["action"]
    return float(((act - expert(test["state"])) ** 2).sum(-1).mean())


@pytest.mark.parametrize("loss", ["nll", "mse"])
def test_bc_clones_a_linear_expert(tmp_path, loss):
    write_dataset(tmp_path / "expert.pt")
    worker = learner(dataset=str(tmp_path / "expert.pt"), loss=loss, batch_size=128,
                     learning_rate=3e-3)
    before = action_error(worker)
    for i in range(250):
        metrics = worker.update(_EnvTrajectories(), env_ranks=[0], iteration=i)
    after = action_error(worker)
    assert before > 1.0 and after < before / 10, (before, after)
    assert "loss/loss_bc" in metrics and metrics["loss/learning_rate"] == 3e-3


def test_the_sample_depends_on_the_iteration_only(tmp_path):
    write_dataset(tmp_path / "expert.pt")
    a, b = (learner(dataset=str(tmp_path / "expert.pt"), batch_size=16) for _ in range(2))
    traj = _EnvTrajectories().get()
    first, _ = a.algorithm.prepare(a.policy, traj, iteration=3, staleness=0)
    again, _ = b.algorithm.prepare(b.policy, traj, iteration=3, staleness=0)
    other, _ = a.algorithm.prepare(a.policy, traj, iteration=4, staleness=0)
    assert torch.equal(first["obs", "state"], again["obs", "state"])
    assert not torch.equal(first["obs", "state"], other["obs", "state"])
    assert (first["action"].abs() < 100).all()  # invalid steps are not in the dataset


def test_a_missing_dataset_is_one_clear_error(tmp_path):
    path = tmp_path / "nope.pt"
    with pytest.raises(AlgorithmError) as e:
        learner(dataset=str(path))
    text = str(e.value)
    assert text.startswith(f"algorithm.dataset={str(path)!r}: no such file") and "\n" not in text


def test_a_malformed_dataset_is_one_clear_error(tmp_path):
    torch.save({"obs": torch.zeros(3, 4)}, tmp_path / "dict.pt")
    with pytest.raises(AlgorithmError, match=r"dict.pt' holds a dict, not a TensorDict"):
        learner(dataset=str(tmp_path / "dict.pt"))
    torch.save(TensorDict({"obs": obs(3, 0)}, [3]), tmp_path / "no_action.pt")
    with pytest.raises(AlgorithmError, match=r"it needs 'obs' and 'action'"):
        learner(dataset=str(tmp_path / "no_action.pt"))
    (tmp_path / "text.pt").write_text("not a tensor file")
    with pytest.raises(AlgorithmError, match=r"text.pt': cannot be read by torch.load"):
        learner(dataset=str(tmp_path / "text.pt"))


@pytest.mark.parametrize("option, value", [("num_demos", 3), ("noop_threshold", 0.01)])
def test_episode_options_need_an_episode_dataset(tmp_path, option, value):
    write_dataset(tmp_path / "expert.pt")
    with pytest.raises(AlgorithmError,
                       match=rf"algorithm.{option}={value}: reads the episodes of an .h5"):
        learner(dataset=str(tmp_path / "expert.pt"), **{option: value})


# -- on m2flow-demos datasets -------------------------------------------------------------


@pytest.fixture(scope="module")
def demos_h5(tmp_path_factory):
    """One PushCube demonstration (16 px rgb + state) written by m2flow-demos."""
    from m2flow.embodied.demos import maniskill as demos

    out = tmp_path_factory.mktemp("demos") / "push16"
    cfg = demos.load_demos_config(overrides=[
        "env=maniskill_pushcube_rgb", "env.image_size=16", "demos.seed=2", "demos.episodes=1",
        f"demos.output={out}"])
    kept, _, spec = demos.generate(cfg, log=lambda line: None)
    h5_path, _ = demos.save(demos.output_stem(cfg), kept, cfg.env, spec)
    return str(h5_path), spec, kept


def demo_learner(path, spec, policy_cfg, **bc):
    info = WorkerInfo("learner", 0, 1, RankResources(0, 1.0, ()), "local")
    return LearnerWorker(info, policy_cfg, BCConfig(dataset=path, **bc), spec, seed=0,
                         num_iterations=300)


class _DemoTrajectories:
    def __init__(self, obs):
        self.obs = obs

    def get(self, key=0, timeout=None):
        return TensorDict({"obs": self.obs[:2].unsqueeze(1)}, batch_size=[2, 1])


def test_h5_dataset_is_the_episodes_steps_with_their_actions(demos_h5):
    from m2flow.embodied.algorithms.helpers.expert_data import load_dataset

    path, spec, kept = demos_h5
    data = load_dataset(path, 4)  # (M,)
    t = len(kept[0].actions)
    assert data.shape == (t,) and torch.equal(data["action"], torch.from_numpy(kept[0].actions))
    assert torch.equal(data["obs", "rgb"], torch.from_numpy(kept[0].obs["rgb"][:t]))  # not T+1
    chunks = load_dataset(path, 4, chunk=3)["action"]  # (M, 3, A)
    assert torch.equal(chunks[0], data["action"][:3]) and torch.equal(chunks[-1, 2], chunks[-1, 0])
    with pytest.raises(AlgorithmError, match=r"algorithm.num_demos=2: .* holds 1 episodes"):
        load_dataset(path, 4, num_demos=2)
    with pytest.raises(AlgorithmError, match=r"no such file; write one with m2flow-demos"):
        load_dataset(path + ".missing.h5", 4)


def test_bc_mlp_reproduces_the_demonstrated_actions(demos_h5):
    path, spec, _ = demos_h5
    state_spec = EnvSpec({"state": spec.obs_shapes["state"]}, 4, spec.action_low,
                         spec.action_high, spec.max_episode_steps)
    worker = demo_learner(path, state_spec, policy_config(name="mlp", hidden_sizes=[64, 64]),
                          loss="mse", batch_size=64, learning_rate=3e-3)
    data = worker.algorithm.expert.episodes[0]  # the training set (T,)
    traj = _DemoTrajectories(data["obs"])

    def error():
        with torch.no_grad():
            act = worker.policy.act(TensorDict({"obs": data["obs"]}, data.shape),
                                    deterministic=True)["action"]
        return float(((act - data["action"]) ** 2).sum(-1).mean())

    before = error()
    losses = [worker.update(traj, env_ranks=[0], iteration=i)["loss/loss_bc"] for i in range(300)]
    after = error()
    assert losses[-1] < losses[0] / 10 and after < before / 20 and after < 0.01, (before, after)


@pytest.fixture
def one_thread():
    """One intra-op thread: this small model runs several times faster so on two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_bc_openvla_oft_reproduces_the_demonstrated_tokens(demos_h5, one_thread):
    """The tiny OFT policy with chunks of 2: its argmax bins match the expert's (the next 2
    actions of the episode, tokenised) on most of the training set."""
    path, spec, _ = demos_h5
    kwargs = dict(image_size=16, chunk=2, hidden_size=64, intermediate_size=128, num_heads=2,
                  value_head=False, jpeg=False, center_crop=False, resize="bilinear")
    worker = demo_learner(path, spec, policy_config(name="openvla_oft", **kwargs),
                          batch_size=64, learning_rate=3e-3)
    traj = _DemoTrajectories(worker.algorithm.expert.episodes[0]["obs"])
    losses = [worker.update(traj, env_ranks=[0], iteration=i)["loss/loss_bc"] for i in range(200)]
    data = worker.algorithm.expert.data  # (M,): the targets of the chunk-2 policy
    assert data["action"].shape[1:] == (2, 4) and data["action_tokens"].shape[1:] == (8,)
    with torch.no_grad():
        bins = worker.policy.act(TensorDict({"obs": data["obs"]}, data.shape),
                                 deterministic=True)["action_tokens"]
    # the expert's tokens are the tokenizer's: decoding them gives the actions back to a bin
    decoded = worker.policy._to_actions(data["action_tokens"])
    assert (decoded - data["action"]).abs().max() <= 1 / 255 + 1e-6
    same = (bins == data["action_tokens"]).float().mean()
    off = (bins - data["action_tokens"]).abs().float().mean()
    assert losses[-1] < losses[0] / 3 and same > 0.5 and off < 4, (losses[0], losses[-1], same, off)


@pytest.mark.parametrize("policy", ["openvla_oft", "mlp"])
def test_target_noise_moves_each_target_by_a_gaussian_of_that_std(demos_h5, policy):
    """algorithm.target_noise=σ: each iteration's targets are the expert actions plus fresh
    N(0, σ²) noise: for the token policy, the target bins decode (bin centres) to the expert
    action moved by noise of std sqrt(σ² + w²/12) (w = 2/255 a bin's width); for the mlp the
    actions themselves move by σ. Checked on the sample's own expert actions away from the
    ±1 clip; noise 0 leaves the targets exact."""
    path, spec, _ = demos_h5
    if policy == "mlp":
        spec = EnvSpec({"state": spec.obs_shapes["state"]}, 4, spec.action_low,
                       spec.action_high, spec.max_episode_steps)
        cfg = policy_config(name="mlp", hidden_sizes=[8])
    else:
        cfg = policy_config(name="openvla_oft", **dict(
            image_size=16, chunk=2, hidden_size=32, intermediate_size=64, num_heads=2,
            value_head=False, jpeg=False, center_crop=False, resize="bilinear"))
    sigma, diffs = 0.1, []
    noisy = demo_learner(path, spec, cfg, batch_size=10_000, target_noise=sigma)
    exact = demo_learner(path, spec, cfg, batch_size=10_000)
    traj = _DemoTrajectories(noisy.algorithm.expert.episodes[0]["obs"]).get()
    for i in range(20):
        batch, _ = noisy.algorithm.prepare(noisy.policy, traj, iteration=i, staleness=0)
        clean, _ = exact.algorithm.prepare(exact.policy, traj, iteration=i, staleness=0)
        assert torch.equal(batch["obs", "state"], clean["obs", "state"])  # the same sample
        if policy == "mlp":
            moved, target = batch["action"], clean["action"]
        else:
            assert torch.equal(batch["action"], clean["action"])  # the expert's, for the record
            moved = noisy.policy._to_actions(batch["action_tokens"]).reshape(clean["action"].shape)
            target = clean["action"]
            exact_actions = exact.policy._to_actions(clean["action_tokens"])
            assert (exact_actions.reshape(target.shape) - target).abs().max() <= 1 / 255 + 1e-6
        keep = target.abs() < 1 - 4 * sigma
        diffs.append((moved - target)[keep])
    d = torch.cat(diffs)
    width = 2 / 255 if policy != "mlp" else 0.0
    assert d.numel() > 500 and abs(float(d.mean())) < 0.01, (d.numel(), float(d.mean()))
    assert abs(float(d.std()) / (sigma ** 2 + width ** 2 / 12) ** 0.5 - 1) < 0.06, float(d.std())


def test_negative_target_noise_is_refused():
    with pytest.raises(AlgorithmError, match=r"algorithm.target_noise=-0.1: must be >= 0"):
        BCConfig(dataset="x.h5", target_noise=-0.1).validate()


RGB_SPEC = EnvSpec({"rgb": (64, 64, 3), "state": (5,), "privileged": (7,)}, 2,
                   (-1.0, -1.0), (1.0, 1.0), 8)


def _rgb_demos(tmp_path, chunk=()):
    """8 episodes of 4 steps: 64 px frames, a state, a privileged vector, 2-d actions (in
    chunks of ``chunk``, if given)."""
    g = torch.Generator().manual_seed(0)
    n, t = 8, 4
    o = TensorDict({"rgb": torch.randint(0, 256, (n, t, 64, 64, 3), generator=g,
                                         dtype=torch.uint8),
                    "state": torch.randn(n, t, 5, generator=g),
                    "privileged": torch.randn(n, t, 7, generator=g)}, batch_size=[n, t])
    torch.save(TensorDict({"obs": o, "action": torch.rand(n, t, *chunk, 2, generator=g) - 0.5},
                          batch_size=[n, t]), tmp_path / "demos.pt")

    class Trajectories:
        def get(self, key=0, timeout=None):
            return TensorDict({"obs": o[:2, :1].clone(), "action": torch.zeros(2, 1, 2)},
                              batch_size=[2, 1])

    return Trajectories()


def test_aux_pretraining_trains_the_auxiliary_loss_alone_then_clones(tmp_path):
    """``algorithm.aux_pretrain_iterations=2`` on the CNN with ``policy.state_aux``: in
    iterations 0 and 1 the actor's own layers (its mean head and log-std, which only the
    expert actions' loss reaches) stay bit for bit as built, while the encoder and the
    auxiliary head move; from iteration 2 on the actor moves too. Fails if the expert
    actions' loss is trained during pretraining, or never after it."""
    trajectories = _rgb_demos(tmp_path)
    info = WorkerInfo("learner", 0, 1, RankResources(0, 1.0, ()), "local")
    worker = LearnerWorker(info, policy_config(name="cnn", state_aux=1.0),
                           BCConfig(dataset=str(tmp_path / "demos.pt"), batch_size=16,
                                    aux_pretrain_iterations=2), RGB_SPEC, seed=0,
                           num_iterations=10)
    params = lambda: {k: v.detach().clone() for k, v in worker.policy.named_parameters()}
    built = params()
    actor = [k for k in built if k.startswith(("actor_mean.", "actor_log_std"))]
    for i in range(2):
        metrics = worker.update(trajectories, env_ranks=[0], iteration=i)
        assert "loss/loss_aux" in metrics and "loss/loss_bc" not in metrics, metrics
        assert metrics["loss/bc_nll"] > 0
    now = params()
    assert all(torch.equal(now[k], built[k]) for k in actor)
    moved = [k for k in built if not torch.equal(now[k], built[k])]
    assert any(k.startswith("encoder.") for k in moved) and "state_aux.head.weight" in moved
    metrics = worker.update(trajectories, env_ranks=[0], iteration=2)
    assert "loss/loss_bc" in metrics and "loss/loss_aux" in metrics
    after = params()
    assert all(not torch.equal(after[k], built[k]) for k in actor)


def test_aux_pretraining_of_a_flow_vla_trains_tower_and_prefix_not_the_expert(tmp_path):
    """The same on the tiny π0, whose cloning loss is its own (flow matching, one joint pass
    with the auxiliary loss): during pretraining the action expert and the action
    projections, which only the flow-matching loss reaches, stay bit for bit as built, while
    the vision tower, the prefix Gemma and the auxiliary head move; then all of them move."""
    trajectories = _rgb_demos(tmp_path, chunk=(2,))
    info = WorkerInfo("learner", 0, 1, RankResources(0, 1.0, ()), "local")
    worker = LearnerWorker(info, policy_config(name="pi0", state_aux=1.0, chunk=2),
                           BCConfig(dataset=str(tmp_path / "demos.pt"), batch_size=8,
                                    aux_pretrain_iterations=1), RGB_SPEC, seed=0,
                           num_iterations=10)
    params = lambda: {k: v.detach().clone() for k, v in worker.policy.named_parameters()}
    built = params()
    expert = [k for k in built if "gemma_expert" in k or k.startswith("model.action_")]
    assert expert
    metrics = worker.update(trajectories, env_ranks=[0], iteration=0)
    assert "loss/loss_aux" in metrics and "loss/loss_bc" not in metrics, metrics
    now = params()
    moved = {k for k in built if not torch.equal(now[k], built[k])}
    assert not moved & set(expert), sorted(moved & set(expert))
    assert any("vision" in k for k in moved) and any("language_model" in k for k in moved)
    assert "state_aux.head.weight" in moved
    metrics = worker.update(trajectories, env_ranks=[0], iteration=1)
    assert metrics["loss/loss_bc"] > 0 and "loss/loss_aux" in metrics
    after = params()
    assert any(not torch.equal(after[k], built[k]) for k in expert)


def test_aux_pretraining_without_an_auxiliary_loss_is_refused_at_start_up():
    from m2flow.cli.workloads import register_schemas
    from m2flow.configs import load_config, to_object
    from m2flow.embodied.checks import check_config

    register_schemas()
    cfg = to_object(load_config("maniskill_pushcube_bc_cnn",
                                ["algorithm.aux_pretrain_iterations=5", "policy.state_aux=0"]))
    with pytest.raises(ValueError, match=r"algorithm\.aux_pretrain_iterations=5: .*"
                                         r"set policy\.state_aux > 0"):
        check_config(cfg)


def test_a_flat_pt_dataset_without_chunks_is_refused_for_a_chunked_policy(tmp_path):
    """A .pt batch's actions (M, A) for a policy that decodes chunks of 2 (a flow policy, not
    a token one): one line naming the dataset and the shape it needs, at the first sample,
    not a reshape error inside the loss."""
    from m2flow.embodied.algorithms.helpers.expert_data import ExpertData
    from m2flow.policies import make_policy

    spec = EnvSpec({"state": (5,)}, 2, (-1.0, -1.0), (1.0, 1.0), 8)
    torch.save(TensorDict({"obs": {"state": torch.randn(6, 5)}, "action": torch.zeros(6, 2)},
                          batch_size=[6]), tmp_path / "flat.pt")
    policy = make_policy(policy_config(name="flow_mlp", chunk=2), spec)
    data = ExpertData(str(tmp_path / "flat.pt"), 2)
    with pytest.raises(AlgorithmError, match=r"a \.pt dataset needs action \(\.\.\., 2, 2\)"):
        data.sample(policy, 4, torch.Generator().manual_seed(0))


def test_a_dataset_without_the_simulator_state_is_refused_for_an_auxiliary_loss(tmp_path):
    """``policy.state_aux`` predicts ``obs/privileged``: demos recorded without it are one
    line naming the dataset and both fixes at the first sample, not a KeyError in the loss."""
    from m2flow.embodied.algorithms.helpers.expert_data import ExpertData
    from m2flow.policies import make_policy

    g = torch.Generator().manual_seed(0)
    obs = {"rgb": torch.randint(0, 256, (6, 64, 64, 3), generator=g, dtype=torch.uint8),
           "state": torch.randn(6, 5, generator=g)}
    torch.save(TensorDict({"obs": obs, "action": torch.zeros(6, 2)}, batch_size=[6]),
               tmp_path / "no_priv.pt")
    policy = make_policy(policy_config(name="cnn", state_aux=1.0), RGB_SPEC)
    data = ExpertData(str(tmp_path / "no_priv.pt"), 2)
    with pytest.raises(AlgorithmError, match=r"algorithm\.dataset=.*no_priv\.pt' holds no "
                                             r"obs/privileged.*env\.privileged_state=true, or "
                                             r"set policy\.state_aux=0"):
        data.sample(policy, 4, torch.Generator().manual_seed(0))
    with_priv = TensorDict({"obs": {**obs, "privileged": torch.randn(6, 7, generator=g)},
                            "action": torch.zeros(6, 2)}, batch_size=[6])
    torch.save(with_priv, tmp_path / "priv.pt")
    assert ExpertData(str(tmp_path / "priv.pt"), 2).sample(
        policy, 4, torch.Generator().manual_seed(0)).shape == (4,)
