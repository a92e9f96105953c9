"""The control of a run: how it was launched, what it is doing, whether it was asked to stop
(and by which signal), and whether it is past that decision, only ending its workers.

One :class:`RunControl` per command: the command line makes it (``m2flow.cli.common.
interruptible``), installs its Ctrl-C and SIGTERM handlers (:meth:`RunControl.handle_signals`)
and hands it to the run, whose :class:`~m2flow.runs.session.RunSession` owns it from then on;
a session made without one (a test, a library call) makes its own, which no signal reaches.
Its ``stop`` event is the one the session's cluster gives every wait on its workers
(:mod:`m2flow.pipelines.futures`), so two runs in one process never see each other's stop.

>>> control = RunControl(launch("maniskill_pushcube_ppo_mlp", ["seed=1"]))
>>> control.phase, control.stop_requested, control.launch["overrides"]
('start-up', False, ['seed=1'])
>>> control.request_stop()
>>> control.stop_requested, control.stop_signal, control.exit_code()
(True, None, 130)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Optional, Sequence


def launch(config_name: str, overrides: Sequence[str]) -> dict:
    """How a run was started, as every checkpoint keeps it: ``m2flow-train --config-name
    <config_name> <overrides>``, so that ``m2flow-train resume=<run>`` alone composes the run's
    own config again (``m2flow.cli.common.resumed_launch``).

    >>> launch("gym_pendulum_ppo_mlp", ("seed=2",))
    {'config_name': 'gym_pendulum_ppo_mlp', 'overrides': ['seed=2']}
    """
    return {"config_name": config_name, "overrides": list(overrides)}


class RunControl:
    """The launch, phase, stop request and ending of the run under way.

    Args:
        launch: the command the run was started with (:func:`launch`), kept in its
            checkpoints; None (a run not started by the CLI): they keep none.

    Attributes:
        phase: what the run is doing, in words (``"evaluation"``); the stop and failure lines
            name it (``RunSession.phase`` sets it).
        stop: set once a stop was asked for (Ctrl-C, SIGTERM, :meth:`request_stop`); the
            session's cluster hands it to every wait on its workers.
        stop_signal: the signal that asked for the stop (SIGINT or SIGTERM); None: none did.
        ending: past the stop decision: the run only ends its workers (a second Ctrl-C no
            longer interrupts that).
    """

    def __init__(self, launch: Optional[dict] = None):
        self.launch = launch
        self.phase = "start-up"
        self.stop = threading.Event()
        self.stop_signal: Optional[int] = None
        self.ending = False

    def begin(self) -> None:
        """A new run under this control (each job of a sweep is one): in start-up, not
        ending. A stop asked for earlier stands."""
        self.phase, self.ending = "start-up", False

    def request_stop(self, signum: Optional[int] = None) -> None:
        """From now on every stoppable wait on the run's workers raises ``Stopped`` within
        ``pipelines.futures.WAIT_SLICE_S``; safe to call from a signal handler or a thread.
        ``signum``: the signal that asked (the first one is kept)."""
        if not self.stop.is_set():
            self.stop_signal = signum
        self.stop.set()

    @property
    def stop_requested(self) -> bool:
        return self.stop.is_set()

    def end(self) -> None:
        """The run is past its stop decision and ends its workers (see :meth:`handle_signals`)."""
        self.ending = True

    def exit_code(self) -> int:
        """The exit code of a command this stop ended: 130 after Ctrl-C, 143 after SIGTERM."""
        return 128 + (self.stop_signal or signal.SIGINT)

    def handle_signals(self) -> Callable[[], None]:
        """Makes Ctrl-C stop this run within seconds in any phase; returns the function that
        puts the previous handlers back. Call from the main thread of a command-line program
        (the handlers run there, and reach this control through their closure).

        The first Ctrl-C abandons the phase in flight (start-up, collection, learning,
        evaluation, generation): every wait of the driver on its workers ends within
        ``pipelines.futures.WAIT_SLICE_S`` by raising ``Stopped``, and the runner ends its loop
        (``RunSession.stopped``). If no call of the learner is in flight (the Ctrl-C came
        during collection, evaluation or generation, not mid-update) and the last completed
        iteration has no checkpoint yet, that iteration is saved; a save already under way
        finishes; otherwise the last checkpoint stays the one to resume from. A checkpoint is
        written atomically, never half a file. Then the workers and simulators are ended and
        one line says where the run stopped and the command that resumes it (exit code 130).

        A second Ctrl-C skips or abandons that save. Once the workers are being ended
        (:attr:`ending`), a Ctrl-C is ignored (ending them takes seconds); a third one exits
        at once, leaving behind what was not ended yet. Steps that do not wait on workers
        (starting Ray, building an in-process worker such as a simulator or a model) are not
        cut short: the stop follows when they end.

        SIGTERM (``kill``, a scheduler's stop) is handled as a first Ctrl-C, however often it
        comes; the command then exits with 143 (:meth:`exit_code`).
        """
        presses = 0

        def on_sigint(signum, frame):
            nonlocal presses
            presses += 1
            if presses == 1:
                self.request_stop(signal.SIGINT)
                print("\nCtrl-C: stopping (Ctrl-C again: without saving a checkpoint).",
                      file=sys.stderr, flush=True)
            elif presses >= 3:
                print("\nCtrl-C a third time: exiting now.", file=sys.stderr, flush=True)
                os._exit(128 + signal.SIGINT)
            elif not self.ending:
                raise KeyboardInterrupt
            else:
                print("\nCtrl-C: ending the workers (Ctrl-C again: exit at once).",
                      file=sys.stderr, flush=True)

        def on_sigterm(signum, frame):
            nonlocal presses
            if presses == 0:
                presses = 1
                self.request_stop(signal.SIGTERM)
                print("\nSIGTERM: stopping, as after a first Ctrl-C.", file=sys.stderr,
                      flush=True)

        previous = signal.signal(signal.SIGINT, on_sigint), signal.signal(signal.SIGTERM,
                                                                          on_sigterm)

        def restore() -> None:
            signal.signal(signal.SIGINT, previous[0])
            signal.signal(signal.SIGTERM, previous[1])
        return restore

    def __getstate__(self) -> dict:
        """Pickled (a sweep's job sent to another process by a launcher plugin), a control
        keeps its launch only: a stop request and signal handlers belong to their process."""
        return {"launch": self.launch}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["launch"])
