"""What a person watching a run sees: progress of long phases as a bar on a terminal and as
periodic lines in a log file, never bar frames in a file."""

import logging

from m2flow.runs.logger import Progress, RunLogger, log


def ticking(*seconds):
    """A clock that returns ``seconds`` one after the other."""
    return iter(seconds).__next__


def test_lines_come_at_most_every_interval_and_once_at_the_end():
    lines = []
    # updates at 5, 16, 20, 31, 40 s; interval 10 s: lines at 16 (>= 10 after 0) and 31
    # (>= 10 after 16), then the last one because the phase is complete
    p = Progress("eval X", 10, write=lines.append, every_s=10.0,
                 clock=ticking(0.0, 5.0, 16.0, 20.0, 31.0, 40.0))
    for i in range(5):
        p.update(2, f"success {i / 4:.2f}")
    p.close()
    assert lines == [
        "eval X: 4/10 ep | success 0.25 | 16 s, about 24 s left",
        "eval X: 8/10 ep | success 0.75 | 31 s, about 8 s left",
        "eval X: 10/10 ep | success 1.00 | 40 s",
    ]


def test_a_short_phase_writes_no_line_and_interval_zero_writes_every_update():
    quiet, every = [], []
    short = Progress("eval", 4, write=quiet.append, every_s=10.0, clock=ticking(0.0, 1.0, 2.0))
    chatty = Progress("eval", 4, write=every.append, every_s=0.0, clock=ticking(0.0, 1.0, 2.0))
    for p in (short, chatty):
        p.update(2)
        p.update(2)
        p.close()
    assert quiet == []
    assert every == ["eval: 2/4 ep | 1 s, about 1 s left", "eval: 4/4 ep | 2 s"]


def test_off_a_terminal_a_phase_writes_lines_to_stdout_and_the_log_file(tmp_path, capsys):
    logger = RunLogger(tmp_path, 3, bar=True, progress_every_s=0.0)
    p = logger.progress("eval Y", 2)
    p.update(1, "success 1.00")
    p.update(1, "success 0.50")
    p.close()
    logger.close()
    out = capsys.readouterr()
    assert "eval Y: 1/2 ep | success 1.00" in out.out and "eval Y: 2/2 ep | success 0.50" in out.out
    assert "\r" not in out.out + out.err  # pytest's capture is not a terminal
    assert "eval Y: 2/2 ep | success 0.50" in (tmp_path / "train.log").read_text()


def test_on_a_terminal_the_bar_shows_progress_and_lines_go_to_the_log_file_only(
        tmp_path, capsys, monkeypatch):
    import m2flow.runs.logger as logger_module

    monkeypatch.setattr(logger_module, "terminal", lambda: True)
    logger = RunLogger(tmp_path, 3, bar=True, progress_every_s=0.0)
    p = logger.progress("eval Z", 2)
    p.update(2, "success 0.50")
    p.close()
    logger.close()
    out = capsys.readouterr()
    assert "eval Z" in out.err  # the bar (tqdm writes to stderr)
    assert "eval Z: 2/2 ep" not in out.out  # no line on the screen under the bar
    assert "eval Z: 2/2 ep | success 0.50" in (tmp_path / "train.log").read_text()
