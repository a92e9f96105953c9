"""End to end on real ManiSkill envs: the CLI in-process, and Ray workers with resume."""

import json
import re
import subprocess
import sys

import psutil
import torch

from m2flow.cli.common import load_run_config
from m2flow.runs import checkpoint
from m2flow.cli.eval import main as evaluate
from m2flow.cli.train import main as train
from m2flow.embodied.runner import EmbodiedRunner

TINY = [
    "env.num_envs=2",
    "runner.rollout_steps=16",
    "runner.eval_episodes=2",
    "runner.eval_interval=0",
    "runner.progress_bar=false",
    "policy.hidden_sizes=[32,32]",
]


def test_cli_trains_in_process_and_eval_reads_the_checkpoint(tmp_path, capsys):
    rc = train(["cluster=inprocess", "runner.num_iterations=2", f"runner.log_dir={tmp_path}", *TINY])
    assert rc == 0
    out = capsys.readouterr().out
    assert "done: 2 iterations, 64 env steps" in out
    ckpt = next(tmp_path.glob("*/*/checkpoints/last.pt"))
    run_dir = ckpt.parent.parent
    assert (run_dir / "tb").is_dir() and (run_dir / "train.log").is_file()
    assert (run_dir / "time_breakdown.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log = (run_dir / "train.log").read_text()
    for phase in ("env_sim", "rollout_infer", "learner_learn", "rollout_weight_sync"):
        assert phase in log, phase  # the per-iteration time breakdown

    assert evaluate([f"checkpoint={ckpt}", "episodes=2", "cluster.backend=local"]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["eval/episodes"] == 2 and 0.0 <= metrics["eval/success_once"] <= 1.0


def run(tmp_path, name, *extra):
    cfg = load_run_config(
        "maniskill_pushcube_ppo_mlp",
        [*TINY, "runner.num_iterations=2", "runner.checkpoint_interval=1", "runner.exact_resets=true",
         f"runner.log_dir={tmp_path}", f"run_name={name}", *extra],
    )
    runner = EmbodiedRunner(cfg)
    try:
        runner.train()
        return runner.run_dir / "checkpoints"
    finally:
        runner.close()


def test_ray_run_resumes_to_the_same_weights_as_an_uninterrupted_run(tmp_path, ray_cluster):
    full = run(tmp_path, "full")
    resumed = run(tmp_path, "resumed", f"resume={full / 'iter_00001.pt'}")

    a, b = checkpoint.load(full / "iter_00002.pt"), checkpoint.load(resumed / "iter_00002.pt")
    assert not (resumed / "iter_00001.pt").exists()  # the resumed run really skipped iteration 1
    assert a["global_step"] == b["global_step"] == 2 * 2 * 16
    for k, w in a["learner"]["policy"].items():
        assert torch.equal(w, b["learner"]["policy"][k]), k
    assert a["metrics"]["loss/total"] == b["metrics"]["loss/total"]
    first = checkpoint.load(full / "iter_00001.pt")["learner"]["policy"]
    assert any(not torch.equal(first[k], w) for k, w in a["learner"]["policy"].items())


def run_to_file(path, program, *args):
    """``program`` (``train`` or ``evaluate``: m2flow.cli.train or .eval) in a subprocess whose stdout and
    stderr go to the file ``path``, as ``m2flow-train ... > log 2>&1`` does; its exit code."""
    module = {"train": "train", "evaluate": "eval"}[program]
    code = f"import sys; from m2flow.cli.{module} import main; sys.exit(main())"
    with open(path, "w") as f:
        return subprocess.run([sys.executable, "-c", code, *args], stdout=f,
                              stderr=subprocess.STDOUT, timeout=300).returncode


def test_a_run_logged_to_a_file_has_lines_and_progress_and_no_bar_frames(tmp_path):
    common = ["env=gym_pendulum", "cluster=inprocess", "env.num_envs=2",
              "runner.progress_interval_s=0",  # a progress line at every round
              "runner.stop_at_success=null"]  # every evaluation runs all its rounds
    out = tmp_path / "train.out"
    assert run_to_file(out, "train", *common, "runner.rollout_steps=8",
                       "runner.num_iterations=2", "runner.eval_interval=1",
                       "runner.eval_episodes=4", f"runner.log_dir={tmp_path}") == 0
    text = out.read_text()
    assert "\r" not in text  # no progress bar frames
    lines = text.splitlines()
    assert lines[0].startswith("start-up: building the local cluster, env workers of 2 "
                               "gym/Pendulum-v1 simulators each, policy mlp")
    ready = next(line for line in lines if line.startswith("start-up: ready in "))
    # this machine's memory in use then, against its total as psutil gives it here
    used, total = map(float, re.search(r"; memory ([\d.]+) of ([\d.]+) GB in use$", ready).groups())
    assert total == round(psutil.virtual_memory().total / 2**30, 1) and 0.2 < used < total, ready
    assert [line[:9] for line in lines if line.startswith("it ")] == ["it    0 |", "it    1 |"]
    # 4 episodes on 2 envs: two rounds per evaluation, one evaluation per iteration
    rounds = [line.split(" | ")[0] for line in lines if line.startswith("eval gym/")]
    assert rounds == ["eval gym/Pendulum-v1: 2/4 ep", "eval gym/Pendulum-v1: 4/4 ep"] * 2
    train_log = next(tmp_path.glob("*/*/train.log")).read_text()
    assert "eval gym/Pendulum-v1: 4/4 ep | success 0.00" in train_log

    out = tmp_path / "eval.out"
    ckpt = next(tmp_path.glob("*/*/checkpoints/last.pt"))
    assert run_to_file(out, "evaluate", f"checkpoint={ckpt}", "episodes=6",
                       "runner.progress_interval_s=0", f"output_dir={tmp_path / 'report'}") == 0
    text = out.read_text()
    assert "\r" not in text
    rounds = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("eval gym/")]
    assert rounds == [f"eval gym/Pendulum-v1: {n}/6 ep" for n in (2, 4, 6)]
    assert json.loads(text.splitlines()[-1])["eval/episodes"] == 6.0


def test_episodes_longer_than_an_iteration_are_counted_whole(tmp_path):
    """runner.reset_every_iteration=false: Pendulum's 200-step episodes span four 50-step
    iterations; the episode statistics run on across them, so the episodes that end in the
    fourth report 200 steps (not the 50 of that iteration) and their whole return."""
    from m2flow.runs.plot import read_run

    rc = train(["env=gym_pendulum", "cluster=inprocess", "env.num_envs=2",
                "runner.rollout_steps=50", "runner.reset_every_iteration=false",
                "runner.num_iterations=4", "runner.eval_interval=0", "runner.eval_episodes=2",
                "runner.progress_bar=false", f"runner.log_dir={tmp_path}"])
    assert rc == 0
    run = read_run(next(tmp_path.glob("maniskill_pushcube_ppo_mlp/*")))
    lengths = run["env/episode_len"]
    assert list(lengths.values) == [200.0], (lengths.steps, lengths.values)
    assert run["env/return"].values[0] < -100  # Pendulum: about -1 to -16 a step


def test_max_minutes_ends_the_loop_with_the_iteration_that_passes_it(tmp_path, capsys):
    """runner.max_minutes (every workload's runner): 1000 iterations asked for, a 3 s budget;
    the run stops at the first iteration past it, evaluates and saves that iteration, and says
    why."""
    from m2flow.runs.plot import read_run

    rc = train(["env=gym_pendulum", "cluster=inprocess", "env.num_envs=2",
                "runner.rollout_steps=50", "runner.num_iterations=1000", "runner.max_minutes=0.05",
                "runner.eval_interval=0", "runner.eval_episodes=2", "runner.checkpoint_interval=0",
                "runner.progress_bar=false", f"runner.log_dir={tmp_path}"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "runner.max_minutes=0.05 reached: stopping" in out, out
    run_dir = next(tmp_path.glob("maniskill_pushcube_ppo_mlp/*"))
    iterations = checkpoint.load(run_dir / "checkpoints" / "last.pt")["iteration"]
    assert 1 <= iterations < 1000
    curves = read_run(run_dir)
    loop = curves["perf/iteration_s"]
    assert len(loop.values) == iterations  # every iteration logged, none after the stop
    # the budget was passed by the last iteration and not before it
    assert sum(loop.values[:-1]) <= 3.0 + 1.0 and "eval/success_once" in curves
    assert curves["eval/success_once"].steps == [max(loop.steps)]  # the last one, evaluated


def test_resume_alone_continues_a_run_with_its_own_command(tmp_path, capsys):
    """``m2flow-train resume=<run dir>`` without --config-name: the run's checkpoints keep the
    command it was launched with, so it goes on with its own env (Pendulum here, not the default
    config's PushCube) and its overrides, the ones given now last. A checkpoint that kept no
    command (an older m2flow's) is refused, naming its config.yaml."""
    first = ["--config-name", "maniskill_pushcube_ppo_mlp", "env=gym_pendulum", "cluster=inprocess",
             "env.num_envs=2", "runner.rollout_steps=50", "runner.num_iterations=2",
             "runner.eval_interval=0", "runner.eval_episodes=2", "runner.progress_bar=false",
             f"runner.log_dir={tmp_path}", "run_name=pend"]
    assert train(first) == 0
    run_dir = next((tmp_path / "pend").glob("*"))
    state = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert state["launch"] == {"config_name": "maniskill_pushcube_ppo_mlp", "overrides": first[2:]}
    capsys.readouterr()

    assert train([f"resume={run_dir}", "runner.num_iterations=3"]) == 0
    out = capsys.readouterr().out
    assert ("resume: the run's own command: m2flow-train --config-name maniskill_pushcube_ppo_mlp "
            "env=gym_pendulum cluster=inprocess") in out and "runner.num_iterations=3" in out
    resumed = max((tmp_path / "pend").glob("*"))
    assert resumed != run_dir
    last = checkpoint.load(resumed / "checkpoints" / "last.pt")
    assert last["iteration"] == 3 and "name: gym/Pendulum-v1" in last["config"]
    assert last["launch"]["overrides"][-2:] == [f"resume={run_dir}", "runner.num_iterations=3"]

    del state["launch"]  # as an older m2flow wrote it
    old = tmp_path / "old.pt"
    torch.save(state, old)
    assert train([f"resume={old}", "runner.num_iterations=3"]) == 2
    err = capsys.readouterr().err
    assert "was written by another config" in err and "config.yaml" in err
