"""``m2flow-eval``: per-task protocol, report files and videos, on real envs (LIBERO, gymnasium)."""

import json

import imageio.v2 as imageio
import pytest

from m2flow.configs import ConfigError
from m2flow.cli.eval import main as evaluate
from m2flow.embodied.eval_protocol import plan
from m2flow.cli.common import load_eval_config

QUIET = ["cluster=inprocess", "runner.progress_bar=false"]


def test_libero_eval_writes_per_task_results_and_videos(tmp_path, capsys):
    out = tmp_path / "report"
    rc = evaluate([
        "env=libero_spatial", "policy=cnn", "episodes_per_task=1", "max_steps=4",
        "env.kwargs.task_ids=[0,3,7]", "env.image_size=64", "videos_per_task=1",
        f"output_dir={out}", "runner.progress_interval_s=0", *QUIET,
    ])
    assert rc == 0
    stdout = capsys.readouterr().out
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["eval/episodes"] == 3.0
    # a progress line per round: episodes done, success so far, the task reached
    last = [line for line in stdout.splitlines() if line.startswith("eval LIBERO")][-1]
    assert last.startswith("eval LIBERO/libero_spatial: 3/3 ep | success ")
    assert "| task 3/3 pick up the black bowl on the stove" in last

    report = json.loads((out / "results.json").read_text())
    assert [t["task"] for t in report["tasks"]] == [0, 1, 2]
    assert report["tasks"][1]["name"].startswith("pick up the black bowl on the cookie box")
    assert all(t["episodes"] == 1 and t["mean_length"] == 4 for t in report["tasks"])
    assert report["max_steps"] == 4 and report["episodes_per_task"] == 1
    table = (out / "results.md").read_text()
    assert "| 2 | pick up the black bowl on the stove" in table and "mean over tasks" in table

    videos = sorted((out / "videos").iterdir())
    assert len(videos) == 3
    for j, v in enumerate(videos):
        outcome = "success" if report["tasks"][j]["success_once"] == 1.0 else "failure"
        assert v.name.startswith(f"task{j:02d}_") and v.name.endswith(f"_ep00_{outcome}.mp4")
        frames = list(imageio.get_reader(v).iter_data())
        assert len(frames) == 5  # the reset frame and one per step
        assert frames[0].shape == (64, 64, 3)


def test_one_task_env_without_checkpoint_counts_exactly_the_episodes_asked(tmp_path, capsys):
    rc = evaluate(["env=gym_pendulum", "policy=mlp", "episodes=5", "env.num_envs=2",
                   f"output_dir={tmp_path}", *QUIET])
    assert rc == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert len(report["tasks"]) == 1 and report["tasks"][0]["episodes"] == 5
    assert report["tasks"][0]["name"] == "gym/Pendulum-v1"
    assert not (tmp_path / "videos").exists()  # no image observation to make videos of
    assert "mean success" in capsys.readouterr().out


def test_plan_lays_out_every_episode_once_and_pads_the_last_round():
    rounds = plan(num_tasks=10, per_task=3, ranks=2, envs_per_rank=4, base_seed=0,
                  videos_per_task=2)
    slots = [s for r in rounds for row in r for s in row]
    counted = [(s.task, s.episode) for s in slots if s.episode is not None]
    assert sorted(counted) == [(j, e) for j in range(10) for e in range(3)]
    assert len(rounds) == 4 and len(slots) == 32
    assert all(s.seed == s.episode for s in slots if s.episode is not None)  # init state e
    assert sum(s.video for s in slots) == 20


def test_one_task_plan_uses_training_evaluation_seeds():
    from m2flow.runs import seeding

    rounds = plan(num_tasks=1, per_task=4, ranks=1, envs_per_rank=2, base_seed=7,
                  videos_per_task=0, one_task_env=True)
    assert [s.seed for s in rounds[1][0]] == seeding.derive(7, seeding.EVAL, 1, 0, 2)


def test_eval_config_errors_name_the_fix():
    with pytest.raises(ConfigError, match="env/libero_spatail.*libero_spatial"):
        load_eval_config(["env=libero_spatail"])
    with pytest.raises(ConfigError, match="Drop one"):
        load_eval_config(["checkpoint=x.pt", "config=eval"])


def test_videos_of_a_chunked_policy_have_every_env_step(tmp_path):
    rc = evaluate(["env=libero_spatial", "policy=openvla_oft_tiny", "episodes_per_task=1",
                   "max_steps=16", "env.kwargs.task_ids=[0]", "env.image_size=64",
                   "videos_per_task=1", f"output_dir={tmp_path}", *QUIET])
    assert rc == 0
    (video,) = (tmp_path / "videos").iterdir()
    assert len(list(imageio.get_reader(video).iter_data())) == 1 + 16  # 2 chunks of 8


def test_the_report_counts_success_once_and_at_end_per_task(tmp_path):
    """Hand-made episodes through ``run_protocol`` and ``write_report``: task 0's two episodes
    reached the goal, one of them left it again; task 1's one reached it only at its end, the
    other was lost to a simulator restart (counted in neither)."""
    from types import SimpleNamespace

    from m2flow.embodied.episodes import EvalEpisode
    from m2flow.embodied.eval_protocol import run_protocol, write_report
    from m2flow.runs.logger import Progress

    outcomes = [(True, False, False), (True, True, False), (True, True, False),
                (True, True, True)]  # (success_once, success_at_end, discarded), slot by slot
    lines = []

    class Runner:
        spec = SimpleNamespace(tasks=("push it", "pull it"), max_episode_steps=4)
        env = SimpleNamespace(world_size=1)
        session = SimpleNamespace(progress=lambda desc, total, bar=True: Progress(
            desc, total, write=lines.append, every_s=0))

        def eval_round(self, per_rank, deterministic=True):
            return [[EvalEpisode(seed=s, success_once=o, success_at_end=e, discarded=d)
                     for s, (o, e, d) in zip(per_rank[0].seeds, outcomes)]]

    cfg = SimpleNamespace(
        env=SimpleNamespace(name="LIBERO/x", num_envs=4), policy=SimpleNamespace(name="cnn"),
        runner=SimpleNamespace(eval_episodes=4), seed=0,
        eval=SimpleNamespace(episodes_per_task=2, episodes=0, max_steps=None, videos_per_task=0,
                             deterministic=True, checkpoint=None))
    report = run_protocol(Runner(), cfg, progress=False)
    assert lines[-1].startswith("eval LIBERO/x: 4/4 ep | success 1.00/0.67 | task 2/2")
    write_report(report, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    t0, t1 = saved["tasks"]
    assert (t0["episodes"], t0["success_once"], t0["success_at_end"]) == (2, 1.0, 0.5)
    assert (t1["episodes"], t1["success_once"], t1["success_at_end"], t1["discarded"]) == (
        1, 1.0, 1.0, 1)
    assert saved["mean_success_once"] == 1.0 and saved["mean_success_at_end"] == 0.75
    table = (tmp_path / "results.md").read_text()
    assert "| success_once | success_at_end |" in table
    assert "| 0 | push it | 1.000 | 0.500 | 2 |" in table
    assert "| **mean over tasks** | **1.000** | **0.750** | 3 |" in table
