"""A run whose worker Ray kills for memory ends with one line: which worker, the node's memory,
the fields that size the run's memory (with their values), and the checkpoint to resume from.

The kill is real: Ray's own memory monitor, with its threshold set below what any worker uses
(``RAY_memory_usage_threshold``), in a Ray that the run starts itself."""

import os
import subprocess
import sys
from pathlib import Path

from m2flow.runs.session import RunOutOfMemory
from tests.stderr import run_lines


def test_a_worker_killed_by_rays_memory_monitor_ends_the_run_with_one_line(tmp_path):
    env = {**os.environ, "RAY_memory_usage_threshold": "0.0001",
           "RAY_memory_monitor_refresh_ms": "100", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", "from m2flow.cli.train import main as train; raise SystemExit(train())",
         "--config-name", "maniskill_pushcube_ppo_mlp", "env.num_envs=2", "algorithm.num_minibatches=5",
         "runner.num_iterations=2", f"runner.log_dir={tmp_path}", "runner.progress_bar=false"],
        env=env, capture_output=True, text=True, timeout=240, cwd=Path(__file__).parents[2])
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = run_lines(proc.stderr)[-1]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert line.startswith("m2flow-train: out of memory during start-up: worker "), line
    assert "killed by Ray's memory monitor with the node at " in line, line
    # 2 envs x 50 steps / 5 minibatches = 20 samples a learner step
    assert ("lower env.num_envs (now 2: a simulator process each) or set "
            "algorithm.micro_batch_size (now unset: each learner step takes its whole "
            "minibatch of 20 samples at once)") in line, line
    assert line.endswith("no checkpoint was written."), line


def test_out_of_memory_after_a_checkpoint_says_how_to_resume():
    e = RunOutOfMemory(3, Path("runs/x/1/checkpoints/last.pt"), "learning",
                       cause="worker learner[rank 0] in update(): killed by Ray's memory "
                             "monitor with the node at 22.34GB used of 23.54GB.",
                       hint="lower env.num_envs (now 64)")
    cmd = lambda ckpt: f"m2flow-train env.num_envs=64 resume={ckpt}"  # noqa: E731
    assert e.describe(cmd) == (
        "out of memory during learning after 3 iterations: worker learner[rank 0] in "
        "update(): killed by Ray's memory monitor with the node at 22.34GB used of 23.54GB; "
        "lower env.num_envs (now 64); checkpoint runs/x/1/checkpoints/last.pt; with those "
        "changed, resume with: m2flow-train env.num_envs=64 resume=runs/x/1/checkpoints/last.pt")
    # not an interruption: a sweep records it as the job's failure and goes on
    assert isinstance(e, RuntimeError) and str(e).startswith("out of memory during learning")


def test_a_run_whose_learner_is_killed_for_memory_after_a_checkpoint_names_it(tmp_path,
                                                                            monkeypatch):
    """The runner's side, in process: the learner's second update raises what a call on a
    worker Ray killed for memory raises (pipelines.futures turns Ray's error into it, above);
    the run ends with RunOutOfMemory after 1 iteration, naming the checkpoint it wrote."""
    from m2flow.cli.common import load_run_config
    from m2flow.embodied.workers.learner_worker import LearnerWorker
    from m2flow.embodied.runner import EmbodiedRunner
    from m2flow.pipelines import OutOfMemory

    real, calls = LearnerWorker.update, []

    def update(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OutOfMemory("worker learner[rank 0] in update(): killed by Ray's memory "
                              "monitor with the node at 22.34GB used of 23.54GB.")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LearnerWorker, "update", update)
    cfg = load_run_config("maniskill_pushcube_ppo_mlp", [
        "cluster=inprocess", "env.num_envs=2", "runner.rollout_steps=16",
        "runner.num_iterations=3", "runner.eval_interval=0", "runner.checkpoint_interval=1",
        "runner.progress_bar=false", f"runner.log_dir={tmp_path}"])
    runner = EmbodiedRunner(cfg)
    try:
        try:
            runner.train()
            raise AssertionError("the run went on after its learner was killed")
        except RunOutOfMemory as e:
            stop = e
    finally:
        runner.close()
    assert stop.iteration == 1 and stop.phase == "learning", (stop.iteration, stop.phase)
    assert stop.checkpoint is not None and stop.checkpoint.exists()
    assert stop.checkpoint.name == "iter_00001.pt", stop.checkpoint
    assert "lower env.num_envs (now 2: a simulator process each)" in str(stop)
