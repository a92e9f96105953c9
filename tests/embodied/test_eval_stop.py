"""Training-time evaluation that ends early when it cannot change the stop decision, and the
stop after K evaluations in a row: hand-worked cases, and a real run that shows both."""

import torch

from m2flow.cli.train import main as train
from m2flow.embodied.eval_protocol import can_reach
from m2flow.embodied.stop_rules import SuccessStop
from m2flow.runs import checkpoint


def test_can_reach_hand_worked():
    # 64 episodes, target 0.9 (57.6 successes): after 16 with 9 successes, 9 + 48 = 57 < 57.6
    assert not can_reach([True] * 9 + [False] * 7, 48, 0.9)
    assert can_reach([True] * 10 + [False] * 6, 48, 0.9)  # 10 + 48 = 58 >= 57.6
    # exactly reachable counts as reachable (0.3 * 10 is 3.0000000000000004 in floats)
    assert can_reach([True] + [False] * 7, 2, 0.3)
    assert not can_reach([False] * 8, 2, 0.3)
    assert can_reach([], 4, 1.0)


def test_success_stop_needs_k_in_a_row():
    rule = SuccessStop(0.8, evals=2)
    assert [rule.update(s) for s in (0.85, 0.7, 0.81, 0.8)] == [False, False, False, True]
    assert "in 2 evaluations in a row" in rule.describe(0.8)
    assert [SuccessStop(0.8).update(s) for s in (0.5, 0.8)] == [False, True]
    never = SuccessStop(None, evals=1)
    assert not any(never.update(s) for s in (0.0, 1.0))


def _eval_lines(out: str) -> list[str]:
    return [line.split(" | ")[0] for line in out.splitlines() if line.startswith("eval gym/")]


def test_training_eval_ends_once_the_threshold_is_out_of_reach(tmp_path, capsys):
    """Pendulum never succeeds. Target 0.5 of 6 episodes on 2 envs (3 rounds): after round 1
    (0/2) 4 more could make 4/6; after round 2 (0/4) at most 2/6 < 0.5: the third round is
    skipped. The curtailed checkpoint is never best.pt."""
    common = ["env=gym_pendulum", "cluster=inprocess", "env.num_envs=2", "runner.rollout_steps=8",
              "runner.num_iterations=1", "runner.eval_episodes=6", "runner.stop_at_success=0.5",
              "runner.progress_interval_s=0", "runner.progress_bar=false"]
    assert train([*common, f"runner.log_dir={tmp_path / 'cut'}"]) == 0
    out = capsys.readouterr().out
    assert _eval_lines(out) == ["eval gym/Pendulum-v1: 2/6 ep", "eval gym/Pendulum-v1: 4/6 ep"]
    ckpt = next((tmp_path / "cut").glob("*/*/checkpoints/last.pt"))
    metrics = checkpoint.load(ckpt)["metrics"]
    assert metrics["eval/curtailed"] == 1.0 and metrics["eval/episodes"] == 4.0
    assert not (ckpt.parent / "best.pt").exists()

    assert train([*common, "runner.eval_curtail=false", f"runner.log_dir={tmp_path / 'full'}"]) == 0
    out = capsys.readouterr().out
    assert _eval_lines(out) == [f"eval gym/Pendulum-v1: {n}/6 ep" for n in (2, 4, 6)]
    full = checkpoint.load(next((tmp_path / "full").glob("*/*/checkpoints/last.pt")))["metrics"]
    assert full["eval/episodes"] == 6.0 and "eval/curtailed" not in full
    # both evaluated the same policy (the same training before it)
    cut_policy = checkpoint.load(ckpt)["learner"]["policy"]
    full_policy = checkpoint.load(
        next((tmp_path / "full").glob("*/*/checkpoints/last.pt")))["learner"]["policy"]
    assert all(torch.equal(cut_policy[k], w) for k, w in full_policy.items())


def test_a_stop_reached_on_few_episodes_is_confirmed_on_more():
    """runner.stop_confirm_episodes: an evaluation of 64 at 0.92 is run again over 256; the
    stop counts the 256 (0.85: no stop; 0.91: stop), and nothing is re-run below the target.
    The runner's ``evaluate`` with a stand-in ``run_eval`` (episodes -> a success rate): the
    real loop's 256 start with the 64's episodes (tests/embodied/test_eval_loop.py)."""
    from types import SimpleNamespace

    from m2flow.embodied.config import RunnerConfig
    from m2flow.embodied.runner import EmbodiedRunner

    def runner(rates):
        calls = []

        def run_eval(episodes=None, reach=None, known=None):
            n = episodes or 64
            calls.append((n, reach, known))
            return {"eval/success_once": rates[n], "eval/episodes": float(n)}

        r = RunnerConfig(eval_episodes=64, stop_at_success=0.9, stop_confirm_episodes=256)
        fake = SimpleNamespace(cfg=SimpleNamespace(runner=r), drain=lambda: None,
                               run_eval=run_eval, timings=lambda: {},
                               _success_stop=SuccessStop(0.9), last_evaluation="the 64")
        return fake, calls

    fake, calls = runner({64: 0.92, 256: 0.85})
    out = EmbodiedRunner.evaluate(fake)
    assert calls == [(64, 0.9, None), (256, 0.9, "the 64")]  # the 64 are not run again
    assert out["eval/episodes"] == 256.0 and out["eval/confirming"] == 1.0
    assert EmbodiedRunner.stop_reason(fake, out) is None  # the 256 did not reach 0.9

    fake, calls = runner({64: 0.92, 256: 0.91})
    out = EmbodiedRunner.evaluate(fake)
    assert "0.910 >= runner.stop_at_success=0.9" in EmbodiedRunner.stop_reason(fake, out)

    fake, calls = runner({64: 0.88})
    assert EmbodiedRunner.evaluate(fake)["eval/episodes"] == 64.0 and len(calls) == 1


def test_bc_is_not_warned_of_equal_rewards_and_ppo_is():
    """The watch the runner builds for the LIBERO BC recipe and for PPO on the same env: six
    iterations of equal rewards (every episode unsolved) warn PPO at the fifth (the default
    runner.warn_no_signal_iterations), never BC, which learns from its dataset's actions."""
    from types import SimpleNamespace

    from m2flow.cli.workloads import register_schemas
    from m2flow.configs import load_config, to_object
    from m2flow.embodied.layout import Layout
    from m2flow.embodied.runner import EmbodiedRunner

    register_schemas()
    warned = {}
    for name, overrides in (("libero_object_bc_mlp", []),
                            ("libero_object_ppo_mlp_from_bc", [])):
        cfg = to_object(load_config(name, overrides))
        fake = SimpleNamespace(cfg=cfg, layout=Layout.of(cfg))
        EmbodiedRunner.before_loop(fake, logger=None)
        lines = [fake._no_signal.update({"train/reward_spread": 0.0}) for _ in range(6)]
        warned[cfg.algorithm.name] = [i for i, line in enumerate(lines) if line]
    assert warned == {"bc": [], "ppo": [4]}


def test_the_eval_gate_waits_for_the_training_success():
    """runner.eval_gate: hand-worked cases of the runner's rule over the training episodes
    since the last scheduled evaluation (episode-weighted; at the gate runs, below it and with
    no episode ended it waits, no gate always runs), counted in the summary. The window's
    mean differs from its last iteration's, so a gate on one iteration fails these cases."""
    from types import SimpleNamespace

    from m2flow.embodied.config import RunnerConfig
    from m2flow.embodied.runner import EmbodiedRunner
    from m2flow.embodied.stop_rules import TrainingSuccess

    def wanted(gate, iterations, metric="success_once"):
        fake = SimpleNamespace(cfg=SimpleNamespace(runner=RunnerConfig(
            eval_gate=gate, success_metric=metric)), gated_evals=0,
            _training_success=TrainingSuccess(metric))
        for m in iterations:  # what the run loop's watch hands it, iteration by iteration
            fake._training_success.observe(m)
        return EmbodiedRunner.evaluation_wanted(fake, iterations[-1]), fake.gated_evals

    def it(success, episodes=16.0, end=None):
        m = {"env/episodes": episodes, "env/success_once": success}
        return m if end is None else {**m, "env/success_at_end": end}

    # 16 episodes at 0.5, then 8 at 1.0: (8 + 8) / 24 = 0.667 (the last iteration alone: 1.0)
    assert wanted(0.7, [it(0.5), it(1.0, 8.0)]) == (False, 1)
    assert wanted(0.66, [it(0.5), it(1.0, 8.0)]) == (True, 0)
    # 16 at 0.9, then 16 at 0.5: 0.7 (the last alone: 0.5)
    assert wanted(0.7, [it(0.9), it(0.5)]) == (True, 0)
    assert wanted(0.7, [{"env/episodes": 0.0}]) == (False, 1)  # no episode ended
    assert wanted(0.7, [it(0.9, end=0.5)], metric="success_at_end") == (False, 1)
    assert wanted(None, [{}]) == (True, 0)


def test_the_gate_window_starts_at_each_scheduled_evaluation():
    """TrainingSuccess.take empties the window: the next scheduled evaluation sees only the
    episodes after it."""
    from m2flow.embodied.stop_rules import TrainingSuccess

    w = TrainingSuccess("success_once")
    w.observe({"env/episodes": 16.0, "env/success_once": 1.0})
    assert w.take() == 1.0
    w.observe({"env/episodes": 4.0, "env/success_once": 0.25})
    assert w.take() == 0.25 and w.take() is None


def test_a_gated_run_skips_its_scheduled_evaluations_and_trains_the_same(tmp_path, capsys):
    """Pendulum never succeeds: with eval_interval=1 over 3 iterations, a gate of 0.5 leaves
    only the last iteration's evaluation; without it all three run. Skipping them changes
    nothing in training: both runs end with the same weights."""
    common = ["env=gym_pendulum", "cluster=inprocess", "env.num_envs=2", "runner.rollout_steps=8",
              "runner.num_iterations=3", "runner.eval_interval=1", "runner.eval_episodes=2",
              "runner.progress_interval_s=0", "runner.progress_bar=false"]
    ends = {}
    for name, extra in (("gated", ["runner.eval_gate=0.5"]), ("every", [])):
        assert train([*common, *extra, f"runner.log_dir={tmp_path / name}"]) == 0
        ends[name] = len(_eval_lines(capsys.readouterr().out))
    assert ends == {"gated": 1, "every": 3}
    gated, every = (checkpoint.load(next((tmp_path / n).glob("*/*/checkpoints/last.pt")))
                    for n in ("gated", "every"))
    assert gated["global_step"] == every["global_step"] == 3 * 2 * 8
    assert all(torch.equal(gated["learner"]["policy"][k], w)
               for k, w in every["learner"]["policy"].items())
