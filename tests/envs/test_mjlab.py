"""``mjlab/<task>`` against mjlab's own env on Warp's CPU device: the adapter and a plain loop
over ``ManagerBasedRlEnv`` (mjlab's manual-reset API), built alike from one seed and fed the
same actions, give equal observations, rewards, terminations and time-outs across episode
boundaries of both kinds; a seed gives one initial state; bad configs name the field.

The first build compiles MuJoCo Warp's kernels for the CPU (about a minute; cached in Warp's
kernel cache, ``~/.cache/warp``)."""

import pytest
import torch

from m2flow import keys
from m2flow.envs import EnvError, env_config, make_env

TASK = "M2flowTest-Cartpole-Bounded"
LIMIT = 25  # steps: a time-out inside the test's 70 steps
BOUND = 0.3  # |cart position| beyond which the episode terminates (a failure, not a time-out)
SEEDS = [3, 3, 5, 7]
STEPS = 70


def cart_out_of_bounds(env) -> torch.Tensor:
    """Termination: the cart left [-BOUND, BOUND] (per env, bool)."""
    cart = env.scene["cartpole"].data.joint_pos[:, 0]  # the slider
    return cart.abs() > BOUND


def bounded_cartpole_cfg():
    """mjlab's Cartpole-Balance with a failure termination beside its time-out."""
    from mjlab.managers.termination_manager import TerminationTermCfg
    from mjlab.tasks.cartpole.cartpole_env_cfg import cartpole_balance_env_cfg

    cfg = cartpole_balance_env_cfg()
    cfg.terminations["cart_out"] = TerminationTermCfg(func=cart_out_of_bounds)
    return cfg


@pytest.fixture(scope="module", autouse=True)
def bounded_task():
    """Registers the test task through mjlab's own registry, as a user's package would."""
    import mjlab.tasks  # noqa: F401
    from mjlab.tasks.cartpole.cartpole_env_cfg import cartpole_ppo_runner_cfg
    from mjlab.tasks.registry import _REGISTRY, list_tasks, register_mjlab_task

    if TASK not in list_tasks():
        register_mjlab_task(task_id=TASK, env_cfg=bounded_cartpole_cfg(),
                            play_env_cfg=bounded_cartpole_cfg(), rl_cfg=cartpole_ppo_runner_cfg())
    yield
    _REGISTRY.pop(TASK, None)


def actions() -> torch.Tensor:
    return (torch.rand(STEPS, len(SEEDS), 1, generator=torch.Generator().manual_seed(0)) * 2
            - 1) * 3.0


def run_adapter(device: str = "cpu") -> dict:
    env = make_env(env_config(name=f"mjlab/{TASK}", num_envs=len(SEEDS), max_episode_steps=LIMIT,
                              privileged_state=True), device=device)
    try:
        assert env.spec.max_episode_steps == LIMIT
        first = env.reset(seed=SEEDS)[keys.OBS]
        rec = {k: [] for k in ("obs", "next_obs", "privileged", "reward", "terminated",
                               "truncated", "done")}
        for a in actions().to(device):
            out = env.step(a)
            rec["obs"].append(out[keys.STATE])
            rec["next_obs"].append(out[keys.NEXT_OBS][keys.leaf(keys.STATE)])
            rec["privileged"].append(out[keys.NEXT_OBS][keys.leaf(keys.PRIVILEGED)])
            for k, key in (("reward", keys.REWARD), ("terminated", keys.TERMINATED),
                           ("truncated", keys.TRUNCATED), ("done", keys.DONE)):
                rec[k].append(out[key])
        return {"first": first[keys.leaf(keys.STATE)],
                **{k: torch.stack(v) for k, v in rec.items()}}
    finally:
        env.close()


def run_mjlab(device: str = "cpu") -> dict:
    """mjlab's own env and its manual-reset loop, written out: seed, build, reset each env
    after seeding with its seed, then step; an env that ended is reset by ``env_ids``."""
    from mjlab.envs import ManagerBasedRlEnv
    from mjlab.tasks.registry import load_env_cfg
    from mjlab.utils.random import seed_rng

    cfg = load_env_cfg(TASK)
    cfg.scene.num_envs = len(SEEDS)
    cfg.auto_reset = False
    cfg.episode_length_s = LIMIT * cfg.sim.mujoco.timestep * cfg.decimation
    seed_rng(0)  # the adapter's env.build_seed
    env = ManagerBasedRlEnv(cfg, device=device)
    try:
        assert env.max_episode_length == LIMIT
        env.reset()
        for i, s in enumerate(SEEDS):
            seed_rng(s)
            obs, _ = env.reset(env_ids=torch.tensor([i], device=device))
        first = obs["actor"].clone()
        rec = {k: [] for k in ("obs", "next_obs", "privileged", "reward", "terminated",
                               "truncated", "done")}
        for a in actions().to(device):
            obs, reward, terminated, time_out, _ = env.step(a)
            rec["next_obs"].append(obs["actor"].clone())
            rec["privileged"].append(obs["critic"].clone())
            rec["reward"].append(reward.clone())
            rec["terminated"].append(terminated.clone())
            rec["truncated"].append(time_out.clone())
            done = terminated | time_out
            rec["done"].append(done)
            now = obs["actor"].clone()
            if done.any():
                ended = done.nonzero().flatten()
                fresh, _ = env.reset(env_ids=ended)
                now[ended] = fresh["actor"][ended]
            rec["obs"].append(now)
        return {"first": first, **{k: torch.stack(v) for k, v in rec.items()}}
    finally:
        env.close()


CUDA = pytest.param("cuda:0", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_adapter_steps_exactly_like_mjlabs_own_env(device):
    """On Warp's CPU device in CI; on CUDA (``pytest -m gpu``) the tensors also stay there."""
    ours = run_adapter(device)
    ref = run_mjlab(device)  # after ours: mjlab's RNGs are the process's, never interleave them
    assert all(v.device == torch.device(device) for v in ours.values())
    # the inputs exercise what is compared: both kinds of episode end, several times
    assert ref["terminated"].sum() >= 2 and ref["truncated"].sum() >= 2, ref["done"].sum(0)
    assert not (ref["terminated"] & ref["truncated"]).all()
    for k in ref:
        assert torch.equal(ours[k], ref[k]), k
    # a step that ended: the final obs under "next", the new episode's first obs at the root
    t, i = ref["done"].nonzero()[0].tolist()
    assert not torch.equal(ours["obs"][t, i], ours["next_obs"][t, i])
    live = ~ref["done"]
    assert torch.equal(ours["obs"][live], ours["next_obs"][live])


def test_a_seed_gives_one_initial_state():
    ours = run_adapter()
    first = ours["first"]
    assert torch.equal(first[0], first[1])  # envs 0 and 1 share seed 3 (a GRPO group)
    assert not torch.equal(first[0], first[2]) and not torch.equal(first[2], first[3])
    again = run_adapter()["first"]
    assert torch.equal(first, again)


def test_success_is_the_tasks_own_and_steps_stay_on_the_device():
    """Lift-Cube's success is its command term's ``compute_success()``: the cube within the
    threshold of its goal. Teleporting the cube onto the goal makes it true."""
    env = make_env(env_config(name="mjlab/Mjlab-Lift-Cube-Yam", num_envs=2, privileged_state=True))
    try:
        assert env.spec.obs_shapes == {"state": (29,), "privileged": (29,)}
        assert env.spec.action_dim == 7
        env.reset(seed=[0, 1])
        out = env.step(torch.zeros(2, 7))
        assert not out[keys.SUCCESS].any()  # the cube starts on the table, the goal above it
        term = env.env.command_manager.get_term("lift_height")
        cube = env.env.scene["cube"]
        pose = cube.data.root_link_pose_w.clone()
        pose[0, :3] = term.command[0]  # env 0's cube onto its goal; env 1's stays
        cube.write_root_link_pose_to_sim(pose[:1], env_ids=torch.tensor([0]))
        out = env.step(torch.zeros(2, 7))
        assert out[keys.SUCCESS].tolist() == [True, False]
        assert out.device == env.device and out[keys.NEXT_OBS].device == env.device
    finally:
        env.close()


def test_episodes_started_part_way_time_out_that_much_sooner():
    """``start_episodes_at`` (``runner.stagger_episodes``): an env started k steps into a
    25-step limit times out after 25 - k steps, then every 25; worked out by hand below."""
    starts = [0, 5, 24, 12]
    env = make_env(env_config(name="mjlab/Mjlab-Cartpole-Balance", num_envs=4,
                              max_episode_steps=LIMIT))
    try:
        assert env.episode_clocks
        env.reset(seed=[0, 1, 2, 3])
        env.start_episodes_at(torch.tensor(starts))
        truncated = torch.stack([env.step(torch.zeros(4, 1))[keys.TRUNCATED]
                                 for _ in range(60)])
    finally:
        env.close()
    # steps (1-based) at which each env times out
    expected = {0: [25, 50], 1: [20, 45], 2: [1, 26, 51], 3: [13, 38]}
    for i, steps in expected.items():
        assert (truncated[:, i].nonzero().flatten() + 1).tolist() == steps, i


# -- config errors (raised before any simulator is built) -------------------------------------
def make(name="mjlab/Mjlab-Cartpole-Balance", **kw):
    return make_env(env_config(name=name, num_envs=1, **kw))


def test_unknown_task_suggests_the_right_one():
    with pytest.raises(EnvError, match=r"env\.name='mjlab/Mjlab-Cartpole-Balanse'.*"
                                       r"Did you mean 'Mjlab-Cartpole-Balance'\?"):
        make("mjlab/Mjlab-Cartpole-Balanse")


@pytest.mark.parametrize("kw, field", [
    ({"obs_mode": "rgb"}, r"env\.obs_mode=rgb: mjlab task 'Mjlab-Cartpole-Balance' has no rgb"),
    ({"obs_mode": "pointcloud"}, r"env\.obs_mode='pointcloud'"),
    ({"control_mode": "pd_ee_delta_pos"}, r"env\.control_mode='pd_ee_delta_pos'"),
    ({"seeded_resets": "some"}, r"env\.seeded_resets='some'"),
    ({"foo": 1}, r"env 'mjlab/Mjlab-Cartpole-Balance' has no setting 'foo'\..* seeded_resets"),
])
def test_bad_config_names_the_field(kw, field):
    with pytest.raises(EnvError, match=field):
        make(**kw)


def test_rgb_needs_the_camera_variant():
    with pytest.raises(EnvError, match=r"'Mjlab-Lift-Cube-Yam-Depth'|'Mjlab-Lift-Cube-Yam-Rgb'"):
        make("mjlab/Mjlab-Lift-Cube-Yam", obs_mode="rgb")

