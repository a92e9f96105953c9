"""math-verify in a child process of its own, so that its timeout works on any thread.

math-verify bounds each parse and each comparison with ``signal.alarm``, which Python allows
only on the main thread of a process. The reward worker's methods never run there: a Ray
actor runs its calls on threads of its own, and the in-process backend on a thread pool. There
``parse``/``verify`` raise, and the reward turned every completion into 0 (so every group was
filtered and GRPO never trained).

Why a process, not ``parsing_timeout=None``: without the alarm, one pathological answer
(a power tower that sympy sets out to evaluate, a huge polynomial to simplify) can stall the
reward worker for good. A length cap does not bound that (a dozen characters can be enough),
and a thread cannot be stopped from outside. So :class:`MathVerifier` runs math-verify on the
main thread of a child process, where its own per-parse and per-comparison alarms work, and
waits at most ``reply_timeout_s`` for each answer: a child that does not reply (stuck where the
alarm cannot interrupt, e.g. inside C code) is killed, that completion scores 0 with one
warning line, and the next call starts a new child.

Protocol: one JSON line ``[completion, answer]`` per request on the child's stdin, one JSON
number per reply on its stdout. The child exits when its stdin closes (its parent is gone).

>>> verifier = MathVerifier()
>>> verifier.score("so the answer is \\\\boxed{4}", "4"), verifier.score("\\\\boxed{5}", "4")
(1.0, 0.0)
>>> verifier.close()
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

log = logging.getLogger("m2flow")

REPLY_TIMEOUT_S = 60.0
"""How long the parent waits for one reply. math-verify's own alarms (5 s per parse, 5 s per
comparison of one gold/predicted pair) normally answer well within it; this bounds what they
cannot interrupt."""
START_TIMEOUT_S = 120.0
"""How long the first reply may take: the child imports math-verify and sympy first."""


def verify_answer(completion: str, answer: str) -> float:
    """1.0 when math-verify finds the completion's final answer (boxed, LaTeX or plain)
    equivalent to the reference, else 0.0 (anything it cannot parse is wrong, not a crash).
    Call it on a main thread (the child's): elsewhere math-verify's alarm raises."""
    from math_verify import parse, verify

    try:
        gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
        pred = parse(completion)
        if not gold or not pred:
            return 0.0
        return float(verify(gold, pred))
    except Exception:  # noqa: BLE001 - a malformed answer is a wrong answer
        return 0.0


def _child_main() -> None:
    """The child's loop: read a request line, score it on this (main) thread, reply."""
    replies = sys.stdout
    sys.stdout = sys.stderr  # anything a library prints must not corrupt the replies
    for line in sys.stdin:
        completion, answer = json.loads(line)
        replies.write(json.dumps(verify_answer(completion, answer)) + "\n")
        replies.flush()


class MathVerifier:
    """Scores completions with math-verify in a child process; safe to call from any thread
    (calls take turns on the one child)."""

    def __init__(self, reply_timeout_s: float = REPLY_TIMEOUT_S):
        self.reply_timeout_s = reply_timeout_s
        self._proc: Optional[subprocess.Popen] = None
        self._answered = 0  # replies from the current child
        self._lock = threading.Lock()

    def score(self, completion: str, answer: str) -> float:
        """1.0 if ``completion``'s final answer is equivalent to ``answer``, else 0.0."""
        with self._lock:
            proc = self._child()
            try:
                proc.stdin.write(json.dumps([completion, answer]) + "\n")
                proc.stdin.flush()
            except OSError:  # the child is gone (a broken pipe)
                return self._failed(proc, timed_out=False, completion=completion)
            timeout = self.reply_timeout_s if self._answered else START_TIMEOUT_S
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            line = proc.stdout.readline() if ready else None
            if not line:
                return self._failed(proc, timed_out=line is None, completion=completion)
            self._answered += 1
            return float(json.loads(line))

    def _child(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            root = str(Path(__file__).resolve().parents[2])  # the folder holding m2flow/
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True, env=env,
            )
            self._answered = 0
        return self._proc

    def _failed(self, proc: subprocess.Popen, *, timed_out: bool, completion: str) -> float:
        """A child that gave no reply: killed; its completion scores 0. A child that died
        before its first reply could not start (math-verify missing?): that is an error."""
        rc = _end(proc, kill=True)
        self._proc = None
        if not timed_out and self._answered == 0:
            raise RuntimeError(
                f"the math-verify child process exited with code {rc} before scoring anything "
                "(its error is above); install math-verify (pip install 'm2flow[reasoning]') "
                "or use algorithm.reward=exact."
            )
        why = f"gave no answer in {self.reply_timeout_s:g} s" if timed_out else f"died ({rc})"
        log.warning(f"warning: math-verify {why} on a completion of {len(completion)} "
                    "characters; it scores 0 and a new math-verify process starts.")
        return 0.0

    def close(self) -> None:
        """Ends the child (it would also end by itself when this process exits)."""
        with self._lock:
            if self._proc is not None:
                _end(self._proc, kill=False)
                self._proc = None


def _end(proc: subprocess.Popen, *, kill: bool) -> int:
    """Stops a child (closing its stdin ends its loop; ``kill`` or a child that does not
    stop within 5 s: SIGKILL), closes its pipes and returns its exit code."""
    if kill:
        proc.kill()
    try:
        proc.stdin.close()
    except OSError:  # a broken pipe: it is gone already
        pass
    try:
        rc = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    proc.stdout.close()
    return rc


_SHARED: Optional[MathVerifier] = None
_SHARED_LOCK = threading.Lock()


def shared_verifier() -> MathVerifier:
    """This process's one verifier (its child starts on the first score)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = MathVerifier()
            atexit.register(_SHARED.close)
        return _SHARED


if __name__ == "__main__":
    _child_main()
