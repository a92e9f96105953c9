"""``algorithm=sac`` end to end on gymnasium's Pendulum (in-process): collection and updates
overlap, the replay buffer goes into the checkpoint, and a resumed run says it continues with
it (or, saved without it, that it refills)."""

from m2flow.cli.train import main as train

ENVS, STEPS, ITERS = 4, 8, 6
SMALL = ["env=gym_pendulum", f"env.num_envs={ENVS}", "cluster=inprocess",
         f"runner.rollout_steps={STEPS}", "algorithm.learning_starts=32",
         "algorithm.batch_size=16", "policy.hidden_sizes=[32,32]", "runner.eval_interval=0",
         "runner.eval_episodes=4", "runner.stop_at_success=null", "runner.progress_bar=false"]


def run(tmp_path, capsys, *extra):
    rc = train(["--config-name", "maniskill_pushcube_sac_mlp", *SMALL,
                f"runner.log_dir={tmp_path}", *extra])
    assert rc == 0
    return capsys.readouterr().out


def test_sac_resumes_with_its_replay_buffer(tmp_path, capsys):
    out = run(tmp_path, capsys, f"runner.num_iterations={ITERS}")
    assert f"done: {ITERS} iterations, {ITERS * ENVS * STEPS} env steps" in out
    out = run(tmp_path, capsys, f"runner.num_iterations={ITERS + 2}", "resume=latest")
    stored = ITERS * ENVS * STEPS
    assert f"resume: replay buffer of {stored:,} transitions from the checkpoint" in out
    assert f"done: {ITERS + 2} iterations" in out


def test_a_checkpoint_without_the_buffer_says_the_resumed_run_refills(tmp_path, capsys):
    run(tmp_path, capsys, "runner.num_iterations=2", "algorithm.checkpoint_buffer=false")
    out = run(tmp_path, capsys, "runner.num_iterations=3", "resume=latest")
    assert "resume: no replay buffer in the checkpoint" in out
