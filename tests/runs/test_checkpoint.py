import os

import pytest
import torch

from m2flow.runs import checkpoint


def state(**values) -> dict:
    """The smallest dict checkpoint.load accepts as an m2flow checkpoint."""
    return {"config": "", "learner": {}, **values}


def test_save_then_load_round_trip(tmp_path):
    path = checkpoint.save(tmp_path / "c.pt", state(w=torch.arange(3)))
    assert torch.equal(checkpoint.load(path)["w"], torch.arange(3))


def test_a_crash_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = checkpoint.save(tmp_path / "c.pt", state(w=1))

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(path, state(w=2))
    monkeypatch.undo()
    assert checkpoint.load(path)["w"] == 1
    assert os.listdir(tmp_path) == ["c.pt"]  # no temp file left behind


def test_last_points_at_the_newest(tmp_path):
    a = checkpoint.save(tmp_path / "iter_1.pt", state(i=1))
    checkpoint.link_latest(a)
    b = checkpoint.save(tmp_path / "iter_2.pt", state(i=2))
    latest = checkpoint.link_latest(b)
    assert checkpoint.load(latest)["i"] == 2


def test_missing_checkpoint_says_what_to_pass(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="m2flow-train"):
        checkpoint.load(tmp_path / "nope.pt")
