"""End to end on real ManiSkill envs: the CLI in-process, and Ray workers with resume."""

import json

import torch

from m2flow.cli import load_run_config
from m2flow.runs import checkpoint
from m2flow.cli import evaluate, train
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
    assert metrics["eval/episodes"] == 2 and 0.0 <= metrics["eval/success"] <= 1.0


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
