"""math-verify rewards where the reward worker really runs: off the main thread (the
in-process backend's thread pool), in a Ray actor, and with a child process that hangs."""

import logging
import os
import signal
import threading

import pytest

from m2flow.pipelines import RankResources, Worker, WorkerGroup
from m2flow.reasoning.math_verify_process import MathVerifier
from m2flow.reasoning.reward import math_verify_reward

# (completion, reference, the value known by hand)
CASES = [
    ("\\boxed{4}", "4", 1.0),
    ("so the answer is \\boxed{5}", "4", 0.0),
    ("so x = $\\frac{1}{2}$", "0.5", 1.0),
    ("it is 41, no: \\boxed{42}", "42", 1.0),
]


def test_math_verify_reward_is_right_on_a_thread():
    got = []
    thread = threading.Thread(target=lambda: got.extend(
        math_verify_reward(c, a) for c, a, _ in CASES))
    thread.start()
    thread.join()
    assert got == [expected for _, _, expected in CASES]


class Scorer(Worker):
    def score(self, cases):
        return [math_verify_reward(c, a) for c, a, _ in cases]


def test_math_verify_reward_is_right_in_a_ray_worker(ray_cluster):
    group = WorkerGroup(ray_cluster, "math_verify_scorer", Scorer, [RankResources(0, 1.0, ())])
    try:
        got = group.call(Scorer.score, CASES).wait()[0]
    finally:
        group.shutdown()
    assert got == [expected for _, _, expected in CASES]


def test_a_child_that_does_not_answer_is_replaced(caplog):
    """A child stuck where math-verify's alarm cannot reach (here: stopped) costs its
    completion a 0 and one warning line; the next call gets a fresh child."""
    verifier = MathVerifier(reply_timeout_s=0.5)
    try:
        assert verifier.score("\\boxed{4}", "4") == 1.0
        stuck = verifier._proc
        os.kill(stuck.pid, signal.SIGSTOP)
        with caplog.at_level(logging.WARNING, logger="m2flow"):
            assert verifier.score("\\boxed{4}", "4") == 0.0
        assert "math-verify gave no answer in 0.5 s" in caplog.text
        assert stuck.poll() is not None  # killed, not left behind
        assert verifier.score("\\boxed{4}", "4") == 1.0
        assert verifier._proc is not stuck
    finally:
        verifier.close()


def test_a_child_that_cannot_start_is_one_clear_error(monkeypatch):
    monkeypatch.setattr("sys.executable", "/bin/false")
    verifier = MathVerifier()
    with pytest.raises(RuntimeError, match=r"install math-verify \(pip install 'm2flow\[reasoning\]'\)"):
        verifier.score("\\boxed{4}", "4")
