"""The failure table: for each failure a test injects, the phase, the seconds from the
injection to the one-line failure on stderr, the exit code and what the run kept.

A pytest plugin, so the failure tests themselves are what is measured (no second copy of
them); they assert that a run ended and what it kept, never seconds::

    python -m pytest -p bench.failure_timings -m "" tests/e2e/test_stalls.py ...

It watches each test, changing nothing it does:

- the first SIGKILL, SIGSTOP, SIGINT or SIGTERM the test's own code sends (``os.kill``,
  ``os.killpg``; not those sent by m2flow code running in the test's process) is the
  injection, with the process it went to;
- each ``m2flow-*`` command the test starts (``subprocess.Popen``, also under
  ``subprocess.run``): its stderr file (the line's time is the file's last write, when that
  write is the line) or captured stderr, its exit code and when it exited, and the
  processes still marked with its test tag (``M2FLOW_*_TEST``) at the end of the test;
- in-process tests report through ``tests/failure_notes.py`` (the file this plugin names in
  ``M2FLOW_FAILURE_NOTES``); ``tests/e2e/test_bad_input.py``'s driver times its cases itself.

Where no injection was seen (a bad argument, Ray's memory monitor set to kill at once, an
algorithm that raises) the seconds count from the command's start. Rows go to
``--failure-table`` (CSV, default ``bench/failure_timings.csv``, appended test by test) and,
as a markdown table, to the end of pytest's report, with the 1-minute load average at the
injection and at the end of the test.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

INJECTING = {signal.SIGKILL, signal.SIGSTOP, signal.SIGINT, signal.SIGTERM}
FIELDS = ["test", "outcome", "injected", "phase", "to_line_s", "from", "exit", "checkpoint",
          "kept", "left", "load_at_injection", "load_at_end", "line"]
_kill, _killpg, _Popen = os.kill, os.killpg, subprocess.Popen
TESTS = os.sep + "tests" + os.sep


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _title(pid: int) -> str:
    """What the process is, in a few words: a Ray actor's title, an m2flow command, a
    simulator process (forked by the fork server)."""
    cmd = _cmdline(pid)
    if cmd.startswith("ray::"):
        return cmd.split()[0]
    if "forkserver" in cmd or "multiprocessing" in cmd:
        return "simulator process"
    if m := re.search(r"m2flow\.cli\.(\w+)", cmd):
        return f"m2flow-{m[1]}"
    return cmd[:40] or f"pid {pid}"


def _is_command(args) -> bool:
    text = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
    return "m2flow.cli." in text or bool(re.search(r"(^|/)m2flow-\w+", text))


class _Test:
    """What one test did: its injection, its commands, its notes."""

    def __init__(self):
        self.injected = None  # (time, what, load average)
        self.commands = []  # the Recorded Popen objects
        self.outcome = ""


class Recorded(_Popen):
    """``subprocess.Popen`` that remembers the m2flow commands a test starts."""

    current: _Test | None = None

    def __init__(self, args, *a, **kw):
        self.m2_start, self.m2_end, self.m2_err = time.time(), None, None
        stderr = kw.get("stderr")
        self.m2_err_file = getattr(stderr, "name", None) if stderr is not None else None
        env = kw.get("env") or {}
        self.m2_tags = [f"{k}={v}" for k, v in env.items()
                        if k.startswith("M2FLOW_") and k.endswith("_TEST")]
        super().__init__(args, *a, **kw)
        if Recorded.current is not None and _is_command(args):
            Recorded.current.commands.append(self)

    def _ended(self, rc):
        if rc is not None and self.m2_end is None:
            self.m2_end = time.time()
        return rc

    def poll(self):
        return self._ended(super().poll())

    def wait(self, timeout=None):
        return self._ended(super().wait(timeout))

    def communicate(self, *a, **kw):
        out, err = super().communicate(*a, **kw)
        self._ended(self.returncode)
        if err is not None:
            self.m2_err = err if isinstance(err, str) else err.decode(errors="replace")
        return out, err


def _last_line(text: str) -> str:
    from tests.stderr import run_lines

    lines = run_lines(text)
    return lines[-1] if lines else ""


def _phase(line: str) -> str:
    m = re.search(r"(?:failed|interrupted|out of memory) during ([a-z][a-z -]*?)(?= after|;|:)",
                  line)
    return m[1] if m else ""


def _checkpoint(line: str) -> str:
    """The checkpoint the line offers (to resume from; for a refused one, the newest good
    one beside it), and whether it loads (its iteration). A refused file is not offered."""
    m = re.search(r"The newest good checkpoint beside it: (\S+\.pt)\.", line)
    if m is None and ": config error: " not in line:
        m = re.search(r"; checkpoint (\S+\.pt)[;.]", line)
    if m is None:
        if "no checkpoint" in line:
            return "none written"
        kept = re.search(r"(\d+) of \d+ kept; wrote (\S+) with them", line)  # m2flow-demos
        return f"{kept[2]}: {kept[1]} demos" if kept else ""
    from m2flow.runs import checkpoint

    try:
        state = checkpoint.load(m[1], mmap=True)
        return f"{Path(m[1]).name}: loads, iteration {state.get('iteration')}"
    except Exception as e:  # noqa: BLE001 - the table says so
        return f"{Path(m[1]).name}: does not load ({type(e).__name__})"


def _left(tags: list[str]) -> str:
    if not tags:
        return ""
    found = 0
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and any(
                    t.encode() in (proc / "environ").read_bytes().split(b"\0") for t in tags):
                found += 1
        except OSError:
            continue
    return str(found)


class FailureTimings:
    def __init__(self, config):
        self.path = Path(config.getoption("failure_table") or
                         Path(config.rootpath) / "bench" / "failure_timings.csv")
        fd, self.notes = tempfile.mkstemp(prefix="m2flow_failure_notes_", suffix=".jsonl")
        os.close(fd)
        os.environ["M2FLOW_FAILURE_NOTES"] = self.notes
        self.rows, self.test = [], None

    # -- watching a test ------------------------------------------------------------------
    def _inject(self, pid: int, sig: int) -> None:
        test = self.test
        if test is None or test.injected is not None or sig not in INJECTING:
            return
        caller = sys._getframe(2).f_code.co_filename
        if TESTS not in caller:  # m2flow's own kills (a hung simulator ended) are no injection
            return
        test.injected = (time.time(), f"{signal.Signals(sig).name} to {_title(pid)}",
                         os.getloadavg()[0])

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        self.test = Recorded.current = _Test()

        def kill(pid, sig):
            self._inject(pid, sig)
            return _kill(pid, sig)

        def killpg(pgid, sig):
            self._inject(pgid, sig)
            return _killpg(pgid, sig)

        os.kill, os.killpg, subprocess.Popen = kill, killpg, Recorded

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        if self.test is not None and (report.when == "call" or report.outcome != "passed"):
            self.test.outcome = self.test.outcome or report.outcome

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item):
        os.kill, os.killpg, subprocess.Popen = _kill, _killpg, _Popen
        test, self.test, Recorded.current = self.test, None, None
        if test is not None:
            row = self._row(item, test)
            if row is not None:
                self._write(row)

    # -- one row --------------------------------------------------------------------------
    def _notes(self, nodeid: str) -> list[dict]:
        out = []
        with open(self.notes) as f:
            for raw in f:
                entry = json.loads(raw)
                if entry["test"] == nodeid:
                    out.append(entry)
        return out

    def _row(self, item, test: _Test) -> dict | None:
        notes = self._notes(item.nodeid)
        row = dict.fromkeys(FIELDS, "")
        row.update(test=item.nodeid, outcome=test.outcome, load_at_end=f"{os.getloadavg()[0]:.1f}")
        start = t_line = None
        line, kept = "", []
        if test.commands:
            cmd = test.commands[-1]
            start, row["exit"] = cmd.m2_start, cmd.returncode
            text = cmd.m2_err
            if text is None and cmd.m2_err_file and os.path.exists(cmd.m2_err_file):
                text = Path(cmd.m2_err_file).read_text(errors="replace")
                raw = [s for s in text.splitlines() if s.strip()]
                line = _last_line(text)
                if raw and raw[-1] == line and line.startswith("m2flow-"):
                    t_line = os.stat(cmd.m2_err_file).st_mtime  # its last write: the line
            elif text is not None:
                line = _last_line(text)
            t_line = t_line or cmd.m2_end  # else: when it exited
            row["left"] = _left(cmd.m2_tags)
        driven = item.funcargs.get("driven") if hasattr(item, "funcargs") else None
        cid = item.funcargs.get("cid") if hasattr(item, "funcargs") else None
        if not test.commands and driven and cid in driven:  # test_bad_input's driver
            r = driven[cid]
            row.update(exit=r["code"], to_line_s=f"{r['seconds']:.2f}", injected="the input")
            row["from"] = "start"
            line = _last_line(r["stderr"])
            kept.append("Ray not started" if not r["ray_started"] else "Ray started")
        for n in notes:
            if n["event"] == "injected" and test.injected is None:
                test.injected = (n["t"], n.get("what", ""), n.get("load", os.getloadavg()[0]))
            elif n["event"] == "line":
                t_line, line = n["t"], n.get("line", line)
                row["exit"] = n.get("code", row["exit"])
                start = start or n.get("start")
            elif n["event"] == "kept":
                kept += [f"{k}={v}" for k, v in n.items() if k not in ("test", "event", "t")]
        if test.injected is None and start is None and not row["to_line_s"] and not notes:
            return None  # nothing injected, no command: not a failure test
        if test.injected is not None:
            t0, row["injected"], load = test.injected
            row["load_at_injection"], row["from"] = f"{load:.1f}", "injection"
        else:
            t0, row["from"] = start, row["from"] or "start"
            row["injected"] = row["injected"] or "(at start)"
        if t_line is not None and t0 is not None:
            row["to_line_s"] = f"{t_line - t0:.1f}"
        row.update(phase=_phase(line), checkpoint=_checkpoint(line), line=line,
                   kept="; ".join(kept))
        return row

    def _write(self, row: dict) -> None:
        self.rows.append(row)
        new = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            if new:
                w.writeheader()
            w.writerow(row)

    def pytest_terminal_summary(self, terminalreporter):
        if not self.rows:
            return
        tr = terminalreporter
        tr.section("failure table")
        cols = [c for c in FIELDS if c != "line"]
        tr.write_line("| " + " | ".join(cols) + " |")
        tr.write_line("|" + "---|" * len(cols))
        for row in self.rows:
            tr.write_line("| " + " | ".join(str(row[c]) for c in cols) + " |")
        tr.write_line(f"(rows, with each line, appended to {self.path})")

    def pytest_unconfigure(self, config):
        os.environ.pop("M2FLOW_FAILURE_NOTES", None)
        os.unlink(self.notes)


def pytest_addoption(parser):
    parser.addoption("--failure-table", default=None,
                     help="CSV the failure table's rows are appended to "
                          "(default bench/failure_timings.csv)")


def pytest_configure(config):
    config.pluginmanager.register(FailureTimings(config), "failure_timings")
