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


def test_tree_to_moves_every_tensor_of_an_optimizer_state_and_keeps_the_rest():
    # meta stands in for a device the test machine lacks; the walk is the same for "cpu"
    opt_state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 2)},
                           1: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4)}},
                 "param_groups": [{"lr": 1e-3, "params": [0, 1], "betas": (0.9, 0.999)}]}
    moved = checkpoint.tree_to({"optimizer": opt_state, "extra": [torch.zeros(1), "x"]}, "meta")
    assert moved["optimizer"]["param_groups"] == opt_state["param_groups"]
    assert moved["extra"][1] == "x" and moved["extra"][0].device.type == "meta"
    for i in (0, 1):
        for k, v in moved["optimizer"]["state"][i].items():
            assert v.device.type == "meta" and v.shape == opt_state["state"][i][k].shape
    same = checkpoint.tree_to(opt_state, "cpu")["state"][0]["exp_avg"]  # already there: no copy
    assert same.data_ptr() == opt_state["state"][0]["exp_avg"].data_ptr()
