"""``m2flow-eval``: per-task protocol, report files and videos, on real envs (LIBERO, gymnasium)."""

import json

import imageio.v2 as imageio
import numpy as np
import pytest

from m2flow.configs import ConfigError
from m2flow.cli.eval import main as evaluate
from m2flow.embodied.eval_protocol import episode_rounds
from m2flow.cli.common import load_eval_config

QUIET = ["cluster=inprocess", "runner.progress_bar=false"]


def test_libero_eval_writes_per_task_results_and_videos(tmp_path, capsys):
    out = tmp_path / "report"
    rc = evaluate([
        "env=libero_spatial", "policy=cnn", "episodes_per_task=1", "max_steps=4",
        "env.task_ids=[0,3,7]", "env.image_size=64", "videos_per_task=1",
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


def test_episode_rounds_lay_out_every_episode_once_and_pads_the_last_round():
    rounds = episode_rounds(num_tasks=10, per_task=3, ranks=2, envs_per_rank=4, base_seed=0,
                            videos_per_task=2)
    slots = [s for r in rounds for row in r for s in row]
    counted = [(s.task, s.episode) for s in slots if s.episode is not None]
    assert sorted(counted) == [(j, e) for j in range(10) for e in range(3)]
    assert len(rounds) == 4 and len(slots) == 32
    assert all(s.seed == s.episode for s in slots if s.episode is not None)  # init state e
    assert sum(s.video for s in slots) == 20


@pytest.mark.parametrize("ranks,envs", [(1, 4), (1, 8), (1, 16), (2, 4), (2, 3)])
def test_one_task_episode_seeds_do_not_depend_on_the_layout(ranks, envs):
    """Episode e's seed is the e-th word of the EVAL purpose's seed sequence (computed here
    with numpy alone), whatever the env workers and envs per worker; fillers never repeat a
    counted episode's seed."""
    n = 20
    words = np.random.SeedSequence([7, 1, 0, 0]).generate_state(n)  # purpose EVAL = 1
    expected = [int(w) & 0x7FFFFFFF for w in words]
    rounds = episode_rounds(num_tasks=1, per_task=n, ranks=ranks, envs_per_rank=envs,
                            base_seed=7, videos_per_task=0, one_task_env=True)
    slots = [s for r in rounds for row in r for s in row]
    assert all(len(r) == ranks and all(len(row) == envs for row in r) for r in rounds)
    seeds = {s.episode: s.seed for s in slots if s.episode is not None}
    assert [seeds[e] for e in range(n)] == expected
    assert not {s.seed for s in slots if s.episode is None} & set(expected)


def test_per_episode_outcomes_do_not_depend_on_num_envs_or_env_workers(tmp_path):
    """One policy, the same 6 ManiSkill episodes run on 2 or 4 envs, and on 2 env workers of
    3: each episode's seed, return and success are the same. Returns differ from episode to
    episode, so an episode started from another's initial state would show."""
    runs = {"2 envs": ["env.num_envs=2"], "4 envs": ["env.num_envs=4"],
            "2 workers": ["env.num_envs=3", "cluster.placement.components.env.workers=2"]}
    outcomes = {}
    for name, layout in runs.items():
        out = tmp_path / name.replace(" ", "_")
        assert evaluate(["env=maniskill_pushcube", "policy=mlp", "episodes=6", "max_steps=20",
                         f"output_dir={out}", *layout, *QUIET]) == 0
        report = json.loads((out / "results.json").read_text())
        outcomes[name] = [(e["episode"], e["seed"], e["success_once"], e["success_at_end"],
                           round(e["return"], 5)) for e in report["per_episode"]]
    assert [o[0] for o in outcomes["2 envs"]] == list(range(6))
    assert len({o[4] for o in outcomes["2 envs"]}) == 6  # every episode's return its own
    assert outcomes["4 envs"] == outcomes["2 envs"]
    assert outcomes["2 workers"] == outcomes["2 envs"]


def test_eval_config_errors_name_the_fix():
    with pytest.raises(ConfigError, match="env/libero_spatail.*libero_spatial"):
        load_eval_config(["env=libero_spatail"])
    with pytest.raises(ConfigError, match="Drop one"):
        load_eval_config(["checkpoint=x.pt", "config=eval"])


def test_videos_of_a_chunked_policy_have_every_env_step(tmp_path):
    rc = evaluate(["env=libero_spatial", "policy=openvla_oft_tiny", "episodes_per_task=1",
                   "max_steps=16", "env.task_ids=[0]", "env.image_size=64",
                   "videos_per_task=1", f"output_dir={tmp_path}", *QUIET])
    assert rc == 0
    (video,) = (tmp_path / "videos").iterdir()
    assert len(list(imageio.get_reader(video).iter_data())) == 1 + 16  # 2 chunks of 8


def _two_task_protocol(episodes, per_task: int, first_episode: int = 0,
                       write=lambda line: None, groups: tuple = ()):
    """``run_protocol`` over a stand-in runner of a two-task env with 4 envs on one env
    worker: ``episodes(per_rank)`` gives each round's ``EvalEpisode`` list (one rank)."""
    from types import SimpleNamespace

    from m2flow.embodied.eval_protocol import run_protocol
    from m2flow.runs.logger import Progress

    class Runner:
        spec = SimpleNamespace(tasks=("push it", "pull it"), max_episode_steps=4,
                               task_groups=groups, task_group_order=())
        layout = SimpleNamespace(env_workers=1, num_envs=4)  # the run's shape it reads
        session = SimpleNamespace(progress=lambda desc, total, bar=True: Progress(
            desc, total, write=write, every_s=0))

        def eval_round(self, per_rank, deterministic=True):
            return [episodes(per_rank)]

    cfg = SimpleNamespace(
        env=SimpleNamespace(name="LIBERO/x", num_envs=4), policy=SimpleNamespace(name="cnn"),
        runner=SimpleNamespace(eval_episodes=4), seed=0,
        eval=SimpleNamespace(episodes_per_task=per_task, episodes=0, max_steps=None,
                             videos_per_task=0, deterministic=True, checkpoint=None,
                             first_episode=first_episode))
    return run_protocol(Runner(), cfg, progress=False)


def test_the_report_counts_success_once_and_at_end_per_task(tmp_path):
    """Hand-made episodes through ``run_protocol`` and ``write_report``: task 0's two episodes
    reached the goal, one of them left it again; task 1's one reached it only at its end, the
    other was lost to a simulator restart (counted in neither)."""
    from m2flow.embodied.eval_report import write_report
    from m2flow.embodied.workers.episodes import EvalEpisode

    outcomes = [(True, False, False), (True, True, False), (True, True, False),
                (True, True, True)]  # (success_once, success_at_end, discarded), slot by slot
    lines = []
    report = _two_task_protocol(
        lambda per_rank: [EvalEpisode(seed=s, success_once=o, success_at_end=e, discarded=d)
                          for s, (o, e, d) in zip(per_rank[0].seeds, outcomes)],
        per_task=2, write=lines.append, groups=("hard", "easy"))
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
    # the env's task groups (Meta-World's difficulty): a mean per group, in the tasks' order
    assert [g["group"] for g in saved["groups"]] == ["hard", "easy"]
    assert "| hard | 1 | 1.000 | 0.500 | 2 |\n| easy | 1 | 1.000 | 1.000 | 1 |" in table


def test_first_episode_moves_every_episode_to_later_initial_states(tmp_path):
    """eval.first_episode=10 on a two-task env: each task's episodes 0-2 start from seeds
    10-12 (LIBERO's init states 10-12), written out for each episode and in the table's
    header; a one-task env's episodes take eval_seeds' entries 10 on."""
    from m2flow.embodied.eval_protocol import episode_rounds
    from m2flow.embodied.eval_report import write_report
    from m2flow.embodied.workers.episodes import EvalEpisode
    from m2flow.runs import seeding

    asked = []

    def episodes(per_rank):
        asked.append((list(per_rank[0].tasks), list(per_rank[0].seeds)))
        return [EvalEpisode(seed=s, success_once=True, success_at_end=True)
                for s in per_rank[0].seeds]

    report = _two_task_protocol(episodes, per_task=3, first_episode=10)
    # 6 episodes on 4 envs: two rounds, the second with two fillers (task 0, seed 10)
    assert asked == [([0, 0, 0, 1], [10, 11, 12, 10]), ([1, 1, 0, 0], [11, 12, 10, 10])]
    write_report(report, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [(e["task"], e["episode"], e["seed"]) for e in saved["per_episode"]] == [
        (0, 0, 10), (0, 1, 11), (0, 2, 12), (1, 0, 10), (1, 1, 11), (1, 2, 12)]
    assert saved["first_episode"] == 10
    assert "3 episodes per task from episode 10's initial state," in (
        tmp_path / "results.md").read_text()
    one = episode_rounds(num_tasks=1, per_task=3, ranks=1, envs_per_rank=4, base_seed=7,
                         videos_per_task=0, one_task_env=True, first=10)
    assert [s.seed for s in one[0][0]] == seeding.eval_seeds(7, 14)[10:14]


def test_training_evaluation_counts_its_episodes_and_matches_m2flow_eval(tmp_path):
    """3 episodes on 2 envs during training (a last round with one filler, not counted), then
    the same checkpoint through m2flow-eval on 4 envs: the same 3 episodes, the same returns."""
    from m2flow.cli.train import main as train
    from m2flow.runs import checkpoint

    assert train(["env=gym_pendulum", "cluster=inprocess", "env.num_envs=2",
                  "runner.rollout_steps=8", "runner.num_iterations=1", "runner.eval_episodes=3",
                  "runner.eval_curtail=false", "runner.progress_bar=false",
                  f"runner.log_dir={tmp_path}"]) == 0
    ckpt = next(tmp_path.glob("*/*/checkpoints/last.pt"))
    metrics = checkpoint.load(ckpt)["metrics"]
    assert metrics["eval/episodes"] == 3.0
    assert evaluate([f"checkpoint={ckpt}", "episodes=3", "env.num_envs=4",
                     f"output_dir={tmp_path / 'report'}", *QUIET]) == 0
    report = json.loads((tmp_path / "report" / "results.json").read_text())
    returns = [e["return"] for e in report["per_episode"]]
    assert len(returns) == 3 and len(set(returns)) == 3
    assert metrics["eval/return"] == pytest.approx(sum(returns) / 3, rel=1e-6)


def _per_episode(tmp_path, name, args):
    out = tmp_path / name
    assert evaluate([*args, f"output_dir={out}", *QUIET]) == 0
    report = json.loads((out / "results.json").read_text())
    return [(e["episode"], e["seed"], e["success_once"], round(e["return"], 4))
            for e in report["per_episode"]]


def test_a_flow_policys_episodes_do_not_depend_on_num_envs(tmp_path):
    """flow_mlp's deterministic chain on 16 Pendulum episodes run 4, 8 and 16 at a time:
    every episode's return is the same. With the chain's starting noise drawn from the global
    generator, an episode's actions depended on how many others shared its batch."""
    runs = {n: _per_episode(tmp_path, f"e{n}", ["env=gym_pendulum", "policy=flow_mlp",
                                                "episodes=16", "max_steps=30",
                                                f"env.num_envs={n}"]) for n in (4, 8, 16)}
    assert [o[0] for o in runs[4]] == list(range(16))
    assert len({o[3] for o in runs[4]}) == 16  # every episode's return its own
    assert runs[8] == runs[4] and runs[16] == runs[4]


@pytest.mark.slow
def test_pi0s_episodes_do_not_depend_on_num_envs(tmp_path):
    """The tiny π0 (the same chain behind a VLA prefix) on 8 PushCube-v1 rgb episodes run 2,
    4 and 8 at a time: every episode's return is the same."""
    args = ["env=maniskill_pushcube_rgb", "policy=pi0_tiny", "policy.image_size=32", "episodes=8",
            "max_steps=10"]
    runs = {n: _per_episode(tmp_path, f"e{n}", [*args, f"env.num_envs={n}"]) for n in (2, 4, 8)}
    assert len({o[3] for o in runs[2]}) == 8
    assert runs[4] == runs[2] and runs[8] == runs[2]
