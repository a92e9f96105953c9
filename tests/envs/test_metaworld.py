"""MetaWorld/<task or suite> on the real simulator: the suites list Meta-World's own tasks with
their instructions and difficulty; an episode is Meta-World's own env run on the same goal
(same observations, dense rewards and success); a seed gives one initial state whether the env
runs alone, beside others or in its own process; images are Meta-World's own render from
RLinf's camera; the scripted experts solve tasks of each difficulty on the installed MuJoCo;
bad configs raise EnvError naming the field."""

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("MUJOCO_GL", "egl")  # before MuJoCo's import: it reads it once
pytest.importorskip("metaworld")

from m2flow.embodied.demos.metaworld import expert, run_episode  # noqa: E402
from m2flow.envs import EnvError, env_config, make_env  # noqa: E402
from m2flow.envs.metaworld import (  # noqa: E402
    DIFFICULTY, INSTRUCTIONS, RLINF_CAMERA, RLINF_CAMERA_POS, difficulty)

# easy, easy, medium, hard, very hard: tasks whose experts solved seeds 0-9 within RLinf's
# 100 steps on MuJoCo 3.11 (bench/metaworld_experts.py), so a failure here is a regression
EXPERT_TASKS = ("reach-v3", "drawer-open-v3", "coffee-push-v3", "pick-place-v3",
                "stick-push-v3")
EXPERT_SEEDS = (0, 1)


def test_suites_are_metaworlds_task_lists_with_instructions_and_levels():
    from metaworld import env_dict

    assert set(INSTRUCTIONS) == set(env_dict.ALL_V3_ENVIRONMENTS)
    levels = {level: len(tasks) for level, tasks in DIFFICULTY.items()}
    assert levels == {"easy": 28, "medium": 11, "hard": 6, "very_hard": 5}
    assert sorted(t for tasks in DIFFICULTY.values() for t in tasks) == sorted(INSTRUCTIONS)
    for suite, names in (("MT10", list(env_dict.MT10_V3)), ("MT50", list(env_dict.MT50_V3)),
                         ("ML45-train", list(env_dict.ML45_V3["train"])),
                         ("ML45-test", list(env_dict.ML45_V3["test"]))):
        env = make_env(env_config(name=f"MetaWorld/{suite}", num_envs=1))
        try:
            assert list(env.task_names) == names
            assert list(env.spec.tasks) == [INSTRUCTIONS[n] for n in names]
            assert env.spec.max_episode_steps == 100 and env.spec.action_dim == 4
        finally:
            env.close()
    assert difficulty("stick-pull-v3") == "very_hard"


def _metaworld_own_env(name: str, rand_vec: np.ndarray):
    """Meta-World's own env of ``name`` set to goal ``rand_vec`` through its task API (a
    ``Task`` as its MT benchmarks make them), not through the adapter's seeded draw."""
    from metaworld import _encode_task
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS

    cls = ALL_V3_ENVIRONMENTS[name]
    env = cls()
    env.set_task(_encode_task(name, dict(rand_vec=rand_vec, env_cls=cls,
                                         partially_observable=False)))
    return env


@pytest.mark.parametrize("name", ["push-v3", "door-open-v3"])
def test_an_episode_is_metaworlds_own_env_on_the_same_goal(name):
    env = make_env(env_config(name=f"MetaWorld/{name}", num_envs=1, reward_mode="dense"))
    try:
        obs = env.reset(seed=[5])["obs"]
        sim = env.slots.envs[0].sim
        ref = _metaworld_own_env(name, sim._last_rand_vec.copy())
        ref_obs, _ = ref.reset()
        np.testing.assert_allclose(obs["state"][0].numpy(), ref_obs.astype(np.float32))
        policy = expert(name)
        for _ in range(60):
            action = policy.get_action(ref_obs).astype(np.float32)
            out = env.step(torch.from_numpy(action)[None])
            ref_obs, ref_reward, _, _, info = ref.step(action)
            if out["next", "done"][0]:
                break
            np.testing.assert_allclose(out["obs", "state"][0].numpy(),
                                       ref_obs.astype(np.float32), rtol=1e-6, atol=1e-6)
            assert out["next", "reward"][0].item() == pytest.approx(ref_reward, rel=1e-5)
            assert bool(out["next", "success"][0]) == bool(info["success"])
        assert np.abs(ref_obs[4:7] - obs["state"][0, 4:7].numpy()).max() > 1e-3  # it moved
    finally:
        env.close()


def test_a_seed_gives_one_initial_state_alone_beside_others_or_in_a_process():
    alone = make_env(env_config(name="MetaWorld/MT10", num_envs=1))
    beside = make_env(env_config(name="MetaWorld/MT10", num_envs=3))
    procs = make_env(env_config(name="MetaWorld/MT10", num_envs=2, processes=True))
    try:
        for env in (alone, beside, procs):  # another episode first: the past must not matter
            n = env.num_envs
            env.reset(seed=list(range(100, 100 + n)), task=[1] * n)
            env.step(torch.rand(n, 4) * 2 - 1)
        a = alone.reset(seed=[7], task=[3])["obs", "state"][0]
        b = beside.reset(seed=[1, 7, 9], task=[0, 3, 3])["obs", "state"]
        c = procs.reset(seed=[7, 8], task=[3, 3])["obs", "state"]
        assert torch.equal(a, b[1]) and torch.equal(a, c[0])
        assert not torch.equal(b[1], b[2]) and not torch.equal(c[0], c[1])  # seeds differ
        goal = alone.slots.envs[0].sim.goal_space  # the door's handle goal lies in its box
        assert goal.contains(a[-3:].double().numpy())
    finally:
        for env in (alone, beside, procs):
            env.close()


def test_auto_resets_continue_the_seeded_stream():
    def run():
        env = make_env(env_config(name="MetaWorld/reach-v3", num_envs=1, max_episode_steps=2))
        try:
            env.reset(seed=[3])
            starts = [env.step(torch.zeros(1, 4))["obs", "state"][0] for _ in range(6)][1::2]
        finally:
            env.close()
        return torch.stack(starts)

    first, second = run(), run()
    assert torch.equal(first, second)
    assert not torch.equal(first[0], first[1])  # each auto-reset draws a new goal


def test_rgb_is_metaworlds_own_render_from_rlinfs_camera():
    import gymnasium as gym
    import metaworld  # noqa: F401  (registers Meta-World/MT1)

    size = 48
    env = make_env(env_config(name="MetaWorld/reach-v3", num_envs=1, obs_mode="rgb",
                              image_size=size, privileged_state=True))
    try:
        obs = env.reset(seed=[2])["obs"]
        assert obs["rgb"].shape == (1, size, size, 3) and obs["rgb"].dtype == torch.uint8
        assert obs["state"].shape == (1, 4) and obs["privileged"].shape == (1, 39)
        torch.testing.assert_close(obs["state"], obs["privileged"][:, :4])
        sim = env.slots.envs[0].sim
        ref = gym.make("Meta-World/MT1", env_name="reach-v3", render_mode="rgb_array",
                       camera_name=RLINF_CAMERA, width=size, height=size).unwrapped
        ref.set_task(_task_of(sim))
        ref.reset()
        ref.model.cam_pos[ref.model.camera(RLINF_CAMERA).id] = RLINF_CAMERA_POS
        frame = ref.render()[::-1, ::-1]  # RLinf turns gymnasium's frame 180 degrees
        diff = np.abs(frame.astype(int) - obs["rgb"][0].numpy().astype(int))
        assert diff.mean() < 2.0, diff.mean()
        assert obs["rgb"].float().std() > 10  # a real picture
        ref.close()
    finally:
        env.close()


def test_mt50_labels_each_task_with_its_difficulty_for_the_report():
    """Seo et al.'s split as RLinf's MT50 table counts it: 28 easy, 11 medium, 6 hard and 5
    very hard tasks, each label on its own task (the report's per-group means read these),
    reported in the table's order although MT50's first task (assembly) is a hard one."""
    from collections import Counter

    from m2flow.embodied.eval_protocol import group_means

    env = make_env(env_config(name="MetaWorld/MT50", num_envs=1, obs_mode="state"))
    try:
        groups, names, order = env.spec.task_groups, env.task_names, env.spec.task_group_order
    finally:
        env.close()
    assert Counter(groups) == {"easy": 28, "medium": 11, "hard": 6, "very_hard": 5}
    rows = [{"episodes": 1, "success_once": 0.0, "success_at_end": 0.0}] * len(groups)
    assert [g["group"] for g in group_means(rows, groups, order)] == [
        "easy", "medium", "hard", "very_hard"]
    assert groups[0] == "hard"  # first seen: the order alone puts easy first
    label = dict(zip(names, groups))
    assert (label["reach-v3"], label["basketball-v3"], label["pick-place-v3"],
            label["shelf-place-v3"]) == ("easy", "medium", "hard", "very_hard")


def test_a_chunks_inner_steps_render_nothing_and_change_nothing_else():
    """Chunks of 4 through ChunkedEnv against the same actions one at a time (every frame
    rendered): the frames a policy acts on, and the final frame of an episode that times out
    inside a chunk (step 6 of 8), are the plain loop's to the pixel; an inner step's is black."""
    from m2flow.envs.chunked import ChunkedEnv

    env = make_env(env_config(name="MetaWorld/push-v3", num_envs=2, obs_mode="rgb",
                              image_size=32, max_episode_steps=6))
    try:
        actions = torch.from_numpy(np.random.RandomState(0).uniform(-1, 1, (2, 8, 4))).float()
        env.reset(seed=[3, 4])
        plain = [env.step(a) for a in actions.unbind(1)]
        assert plain[5]["next", "truncated"].all() and not plain[4]["next", "done"].any()
        env.reset(seed=[3, 4])
        env.step_async(actions[:, 0], frames=False)
        inner = env.step_wait()
        assert inner["obs", "rgb"].sum() == 0 and plain[0]["obs", "rgb"].float().std() > 10
        assert torch.equal(inner["obs", "state"], plain[0]["obs", "state"])
        env.reset(seed=[3, 4])
        chunked = ChunkedEnv(env)
        first, second = chunked.step(actions[:, :4]), chunked.step(actions[:, 4:])
        assert torch.equal(first["obs", "rgb"], plain[3]["obs", "rgb"])
        assert torch.equal(second["next", "obs", "rgb"], plain[5]["next", "obs", "rgb"])
        assert torch.equal(second["obs", "rgb"], plain[7]["obs", "rgb"])
        assert (second["next", "num_steps"] == 2).all()
    finally:
        env.close()


def _task_of(sim):
    from metaworld import _encode_task

    return _encode_task("reach-v3", dict(rand_vec=sim._last_rand_vec.copy(), env_cls=type(sim),
                                         partially_observable=False))


@pytest.mark.parametrize("name", EXPERT_TASKS)
def test_scripted_experts_succeed_on_the_installed_mujoco(name):
    env = make_env(env_config(name=f"MetaWorld/{name}", num_envs=1))
    try:
        policy = expert(name)
        for seed in EXPERT_SEEDS:
            demo = run_episode(env, policy, seed, 0)
            assert demo.success[-1], f"{name} seed {seed}: no success in {len(demo.actions)} steps"
            assert demo.rewards[-1] == 1.0 and demo.rewards[:-1].sum() == 0  # sparse
            assert demo.terminated[-1]
    finally:
        env.close()


def test_task_one_hot_appends_metaworlds_task_encoding_to_the_state():
    plain = make_env(env_config(name="MetaWorld/MT10", num_envs=2, task_ids=[2, 5]))
    hot = make_env(env_config(name="MetaWorld/MT10", num_envs=2, task_ids=[2, 5],
                              task_one_hot=True))
    try:
        assert hot.spec.obs_shapes["state"] == (39 + 2,)
        a = plain.reset(seed=[4, 4], task=[1, 0])["obs", "state"]
        b = hot.reset(seed=[4, 4], task=[1, 0])["obs", "state"]
        assert torch.equal(b[:, :39], a)
        assert b[:, 39:].tolist() == [[0.0, 1.0], [1.0, 0.0]]
    finally:
        plain.close()
        hot.close()


def test_ml45_hides_the_goal_and_mt_shows_it():
    env = make_env(env_config(name="MetaWorld/ML45-test", num_envs=1))
    mt = make_env(env_config(name="MetaWorld/MT50", num_envs=1, task_ids=[0]))
    try:
        assert torch.all(env.reset(seed=[0])["obs", "state"][0, -3:] == 0)
        assert torch.any(mt.reset(seed=[0])["obs", "state"][0, -3:] != 0)
    finally:
        env.close()
        mt.close()


def test_bad_configs_raise_env_errors_naming_the_field():
    with pytest.raises(EnvError, match="Did you mean 'reach-v3'"):
        make_env(env_config(name="MetaWorld/reach-v2"))
    with pytest.raises(EnvError, match="env.task_ids"):
        make_env(env_config(name="MetaWorld/MT10", task_ids=[10]))
    with pytest.raises(EnvError, match="env.privileged_state"):
        make_env(env_config(name="MetaWorld/MT10", privileged_state=True))
    with pytest.raises(EnvError, match="env.reward_mode"):
        make_env(env_config(name="MetaWorld/MT10", reward_mode="normalized_dense"))
    with pytest.raises(EnvError, match="env.obs_mode"):
        make_env(env_config(name="MetaWorld/MT10", obs_mode="depth"))


def test_an_env_renders_from_any_thread():
    """A Ray actor runs its calls on a pool of threads: an env reset (and rendered) in one
    call is stepped in the next, on another thread. EGL refuses a context that is still
    current on the first thread (EGL_BAD_ACCESS), so each frame leaves its context free;
    the frames equal those rendered on one thread."""
    import threading

    def frames(threaded: bool) -> list:
        env = make_env(env_config(name="MetaWorld/reach-v3", num_envs=2, obs_mode="rgb",
                                  image_size=32))
        out = []

        def call(fn):
            if not threaded:
                out.append(fn())
                return
            t = threading.Thread(target=lambda: out.append(fn()))
            t.start()
            t.join()

        try:
            call(lambda: env.reset(seed=[4, 5])["obs", "rgb"])
            for _ in range(2):
                call(lambda: env.step(torch.zeros(2, 4))["next", "obs", "rgb"])
        finally:
            env.close()
        return out

    threaded, plain = frames(True), frames(False)
    assert len(threaded) == 3  # every call's thread rendered (none raised)
    assert all(torch.equal(a, b) for a, b in zip(threaded, plain))
    assert plain[0].float().std() > 10  # a real picture
