"""What a failure test injected and what its run kept, for the failure table of
``bench/failure_timings.py`` (a pytest plugin: ``pytest -p bench.failure_timings``).

Nothing is written unless ``M2FLOW_FAILURE_NOTES`` names a file (the plugin sets it): the
tests assert that a run ended and what it kept, never seconds; the seconds go in the table.
Tests whose run is a subprocess need no notes (the plugin sees their signals, their stderr
file and their exit code); in-process ones note where their failure was injected and where
their line came."""

from __future__ import annotations

import json
import os
import time


def note(event: str, **facts) -> None:
    """Appends ``event`` ("injected", "line" or "kept"), the wall-clock time and ``facts``
    (JSON values) for the running test to the notes file, if there is one."""
    path = os.environ.get("M2FLOW_FAILURE_NOTES")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    with open(path, "a") as f:
        f.write(json.dumps({"test": test, "event": event, "t": time.time(), **facts},
                           default=str) + "\n")
