"""``m2flow-demos env=metaworld_*``: Meta-World's scripted experts recorded through m2flow's
env, in the .h5/.json layout of the ManiSkill demos, from seeds evaluation does not use;
replaying a file's actions in a fresh env from its seeds gives its observations back and
succeeds; BC's reader loads it."""

import json
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("MUJOCO_GL", "egl")  # before MuJoCo's import: it reads it once
pytest.importorskip("metaworld")
h5py = pytest.importorskip("h5py")

from m2flow.cli.demos import main  # noqa: E402
from m2flow.cli.common import EXIT_CONFIG  # noqa: E402
from m2flow.embodied.algorithms.helpers.expert_data import read_demos  # noqa: E402
from m2flow.embodied.eval_protocol import MULTI_TASK_EPISODES  # noqa: E402
from m2flow.envs import env_config, make_env  # noqa: E402
from m2flow.envs.metaworld import INSTRUCTIONS  # noqa: E402

TASKS = (0, 1)  # MT10's reach-v3 and push-v3
PER_TASK = 2
SIZE = 32


@pytest.fixture(scope="module")
def rgb_demos(tmp_path_factory):
    stem = tmp_path_factory.mktemp("mw") / "mt10_rgb"
    code = main(["env=metaworld_mt10", "env.obs_mode=rgb", f"env.image_size={SIZE}",
                 "env.render_quality=fast", f"env.task_ids=[{TASKS[0]},{TASKS[1]}]",
                 f"demos.episodes_per_task={PER_TASK}", f"demos.output={stem}"])
    assert code == 0
    return stem


def test_the_file_holds_n_successful_episodes_per_task_with_rgb_and_state(rgb_demos):
    meta = json.loads(rgb_demos.with_suffix(".json").read_text())
    episodes = meta["episodes"]
    assert [e["task_name"] for e in episodes] == ["reach-v3"] * PER_TASK + ["push-v3"] * PER_TASK
    assert all(e["language_instruction"] == INSTRUCTIONS[e["task_name"]] for e in episodes)
    assert meta["source_type"] == "scripted_expert"
    # m2flow-eval starts episode e of a task from seed e: none of those is a demo's
    assert min(e["episode_seed"] for e in episodes) >= MULTI_TASK_EPISODES
    with h5py.File(rgb_demos.with_suffix(".h5"), "r") as f:
        assert sorted(f) == [f"traj_{i}" for i in range(len(episodes))]
        for e in episodes:
            g = f[f"traj_{e['episode_id']}"]
            t = g["actions"].shape[0]
            assert g["actions"].shape == (t, 4) and t == e["elapsed_steps"] <= 100
            assert g["obs/rgb"].shape == (t + 1, SIZE, SIZE, 3) and g["obs/rgb"].dtype == np.uint8
            assert g["obs/state"].shape == (t + 1, 4) and g["obs/privileged"].shape == (t + 1, 39)
            assert (g["obs/task"][:] == e["task"]).all()
            assert g["success"][-1] and not g["success"][:-1].any()
            assert g["rewards"][-1] == 1.0 and g["terminated"][-1]


def test_replaying_the_actions_from_the_seeds_gives_the_file_back(rgb_demos):
    meta = json.loads(rgb_demos.with_suffix(".json").read_text())
    env = make_env(env_config(name="MetaWorld/MT10", num_envs=1, task_ids=list(TASKS)))
    try:
        with h5py.File(rgb_demos.with_suffix(".h5"), "r") as f:
            for e in meta["episodes"]:
                g = f[f"traj_{e['episode_id']}"]
                states = [env.reset(**{k: [v] for k, v in e["reset_kwargs"].items()})
                          ["obs", "state"][0]]
                for a in g["actions"][:]:
                    out = env.step(torch.from_numpy(a)[None])
                    states.append(out["next", "obs", "state"][0])
                assert bool(out["next", "success"][0])
                np.testing.assert_allclose(torch.stack(states).numpy(), g["obs/privileged"][:],
                                           rtol=1e-5, atol=1e-5)
    finally:
        env.close()


def test_bc_reads_the_file_with_the_task_index(rgb_demos):
    episodes = read_demos(str(rgb_demos.with_suffix(".h5")), action_dim=4)
    assert len(episodes) == PER_TASK * len(TASKS)
    assert episodes[-1]["obs", "task"].unique().tolist() == [1]
    assert episodes[0]["obs", "rgb"].dtype == torch.uint8


def test_a_bad_demos_config_is_one_line(tmp_path, capsys):
    code = main(["env=metaworld_mt10", "demos.episodes_per_task=0",
                 f"demos.output={tmp_path / 'x'}"])
    assert code == EXIT_CONFIG
    err = capsys.readouterr().err.strip()
    assert "demos.episodes_per_task" in err and len(err.splitlines()) == 1
