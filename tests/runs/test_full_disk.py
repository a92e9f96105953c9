"""A full disk loses nothing: a checkpoint write the system refuses (ENOSPC part-way through
the file) leaves the checkpoint before it loadable and no temp file behind, and the run ends
in one line naming the file, the reason and the checkpoint to resume from (exit 1). The run
is real (tiny, in-process); only the disk is simulated, by a file object whose writes fail
after some bytes, under torch's own writer."""

from __future__ import annotations

import errno
import io
import os

import pytest
import torch

from m2flow.cli.train import main as train
from m2flow.runs import checkpoint
from tests.failure_notes import note

COMMON = ["env=gym_pendulum", "cluster=inprocess", "env.num_envs=2", "runner.rollout_steps=8",
          "runner.eval_interval=0", "runner.eval_episodes=2", "runner.progress_bar=false",
          "runner.checkpoint_interval=1"]


class FillingFile(io.RawIOBase):
    """A file on a disk with ``room`` bytes free: the write that passes it fails with ENOSPC
    (what ``write(2)`` does), after the bytes that fit reached the real file."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        fit = min(len(b), self.room)
        self.f.write(bytes(b[:fit]))
        self.room -= fit
        if fit < len(b):
            note("injected", what="ENOSPC on a checkpoint write")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fit

    def fileno(self) -> int:
        return self.f.fileno()

    def flush(self) -> None:
        if not self.f.closed:
            self.f.flush()

    def close(self) -> None:
        super().close()
        self.f.close()


def fill_disk_after(monkeypatch, saves_ok: int, room: int = 4096) -> None:
    """``checkpoint.save``'s files: the first ``saves_ok`` are written whole, the others
    hit a full disk after ``room`` bytes."""
    real, opened = os.fdopen, [0]

    def fdopen(fd, mode="r", *a, **kw):
        if "w" not in mode:
            return real(fd, mode, *a, **kw)
        opened[0] += 1
        return real(fd, mode, *a, **kw) if opened[0] <= saves_ok else FillingFile(real(fd, "wb"), room)

    monkeypatch.setattr(checkpoint.os, "fdopen", fdopen)


def test_a_refused_write_keeps_the_old_file_and_names_the_reason(tmp_path, monkeypatch):
    path = tmp_path / "iter_00001.pt"
    checkpoint.save(path, {"w": torch.arange(3.0)})
    fill_disk_after(monkeypatch, saves_ok=0)
    with pytest.raises(checkpoint.CheckpointWriteError) as e:
        checkpoint.save(path, {"w": torch.zeros(100_000)})  # over the old file: refused
    assert str(e.value) == (f"could not write {path} (ENOSPC: No space left on device); "
                            "nothing was overwritten")
    assert e.value.errno == errno.ENOSPC
    assert torch.equal(torch.load(path)["w"], torch.arange(3.0))
    assert [p.name for p in tmp_path.iterdir()] == ["iter_00001.pt"]  # no temp file left


def test_a_full_disk_ends_the_run_in_one_line_and_the_last_checkpoint_resumes(
        tmp_path, monkeypatch, capsys):
    logs = tmp_path / "runs"
    fill_disk_after(monkeypatch, saves_ok=1)  # iteration 1's checkpoint fits, 2's does not
    code = train([*COMMON, "runner.num_iterations=3", f"runner.log_dir={logs}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    note("line", line=err[-1] if err else "", code=code)
    assert code == 1, err
    assert len(err) == 1, err
    folder = next(logs.glob("*/*/checkpoints"))
    line = err[0]
    assert "failed during checkpointing after 2 iterations" in line
    assert f"could not write {folder / 'iter_00002.pt'} (ENOSPC: No space left on device)" in line
    assert f"; checkpoint {folder / 'iter_00001.pt'}; resume with: " in line
    assert sorted(p.name for p in folder.iterdir()) == ["iter_00001.pt", "last.pt"]
    assert checkpoint.load(folder / "last.pt")["iteration"] == 1
    monkeypatch.undo()
    assert train([*COMMON, "runner.num_iterations=3", f"runner.log_dir={logs}",
                  f"resume={folder / 'last.pt'}"]) == 0
    note("kept", resumed="from last.pt to the end, exit 0")
