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


# -- retention: the newest K and the best by evaluation -------------------------------------

def retention_session(tmp_path, keep):
    from dataclasses import dataclass, field

    from m2flow.runs.config import ClusterGroupConfig, RunnerBaseConfig
    from m2flow.runs.session import RunSession

    @dataclass
    class Root:
        cluster: ClusterGroupConfig = field(
            default_factory=lambda: ClusterGroupConfig(backend="local"))
        runner: RunnerBaseConfig = field(default_factory=lambda: RunnerBaseConfig(
            log_dir=str(tmp_path), keep_checkpoints=keep, progress_bar=False))
        run_name: str = "t"
        seed: int = 0

    s = RunSession(Root(), workload="embodied", best_metric="eval/success_once")
    s.open_run(10, 0, []).close()
    return s


def kept(folder):
    return sorted(int(p.stem.split("_")[1]) for p in folder.glob("iter_*.pt"))


def test_keeps_the_last_k_and_the_best_by_evaluation(tmp_path):
    s = retention_session(tmp_path, keep=2)
    folder = s.run_dir / "checkpoints"
    # iteration: eval success (None: no evaluation in that iteration)
    scores = {1: None, 2: 0.5, 3: None, 4: 0.75, 5: 0.25, 6: float("nan")}
    for it, score in scores.items():
        s.save(it, {"learner": {}}, {} if score is None else {"eval/success_once": score})
    # by hand: the best is 4 (0.75; NaN is no score); the newest two are 5 and 6
    assert kept(folder) == [4, 5, 6]
    assert checkpoint.load(folder / "best.pt")["iteration"] == 4
    assert checkpoint.load(folder / "last.pt")["iteration"] == 6

    s.save(7, {"learner": {}}, {"eval/success_once": 0.75})  # a tie goes to the newer
    s.save(8, {"learner": {}}, {"eval/success_once": 0.5})
    assert kept(folder) == [7, 8]  # 4 lost the best to 7; 5 and 6 are no longer the newest
    assert checkpoint.load(folder / "best.pt")["iteration"] == 7
    s.close()


def test_without_evaluations_there_is_no_best_and_keep_zero_keeps_all(tmp_path):
    s = retention_session(tmp_path, keep=0)
    for it in range(1, 5):
        s.save(it, {"learner": {}}, {"env/success_once": 1.0})  # training success does not rank
    folder = s.run_dir / "checkpoints"
    assert kept(folder) == [1, 2, 3, 4] and not (folder / "best.pt").exists()
    s.close()


# -- resume=latest / auto ----------------------------------------------------------------------

def write_run(log_dir, name, stamp, iterations, mtime_ns):
    """A run folder with checkpoints of ``iterations``; last.pt -> the last, written at
    ``mtime_ns``."""
    folder = log_dir / name / stamp / "checkpoints"
    for it in iterations:
        path = checkpoint.save(folder / f"iter_{it:05d}.pt", state(iteration=it))
        checkpoint.link_latest(path)
    os.utime(folder / "last.pt", ns=(mtime_ns, mtime_ns))
    return folder


def test_find_latest_picks_the_newest_checkpoint_of_the_same_run_name(tmp_path):
    s = 10**18
    write_run(tmp_path, "a", "20260101-000000-000000", [2, 4], mtime_ns=s + 300)
    newest = write_run(tmp_path, "a", "20260102-000000-000000", [1], mtime_ns=s + 200)
    write_run(tmp_path, "b", "20260103-000000-000000", [9], mtime_ns=s + 900)  # another run
    (tmp_path / "a" / "20260104-000000-000000").mkdir()  # a run that saved nothing
    # by hand: of a's last.pt files, the first run's was written last (s + 300)
    assert checkpoint.find_latest(tmp_path, "a") == (
        tmp_path / "a" / "20260101-000000-000000" / "checkpoints" / "iter_00004.pt")
    os.utime(newest / "last.pt", ns=(s + 400, s + 400))
    assert checkpoint.find_latest(tmp_path, "a") == newest / "iter_00001.pt"
    assert checkpoint.find_latest(tmp_path, "c") is None


def test_resume_latest_and_auto_in_the_config(tmp_path, capsys):
    from m2flow.cli.common import load_run_config
    from m2flow.configs import ConfigError

    base = ["env=gym_pendulum", "cluster=inprocess", f"runner.log_dir={tmp_path}", "run_name=r"]
    with pytest.raises(ConfigError, match=r"resume=latest: no checkpoint of run 'r' under "):
        load_run_config("maniskill_pushcube_ppo_mlp", [*base, "resume=latest"])
    assert load_run_config("maniskill_pushcube_ppo_mlp", [*base, "resume=auto"]).resume is None
    assert "starting from iteration 0" in capsys.readouterr().out

    folder = tmp_path / "r" / "20260101-000000-000000" / "checkpoints"
    path = checkpoint.save(folder / "iter_00003.pt", {**state(), "workload": "embodied"})
    checkpoint.link_latest(path)
    for word in ("latest", "auto"):
        assert load_run_config("maniskill_pushcube_ppo_mlp", [*base, f"resume={word}"]).resume == str(path)


def test_resolve_a_file_a_run_directory_and_a_folder_of_runs(tmp_path):
    s = 10**18
    old = write_run(tmp_path, "a", "20260101-000000-000000", [2, 4], mtime_ns=s + 100)
    new = write_run(tmp_path, "a", "20260102-000000-000000", [1, 3], mtime_ns=s + 200)
    f = old / "iter_00002.pt"
    assert checkpoint.resolve(f) == f  # a file: itself (an older one than last.pt, too)
    assert checkpoint.resolve(old.parent) == old / "iter_00004.pt"  # run dir: its last.pt's
    assert checkpoint.resolve(tmp_path / "a") == new / "iter_00003.pt"  # runs: the newest
    assert checkpoint.resolve(tmp_path / "nope.pt") == tmp_path / "nope.pt"  # load() says so
    (tmp_path / "a" / "20260104-000000-000000" / "checkpoints").mkdir(parents=True)
    with pytest.raises(checkpoint.CheckpointError, match="run directory without a checkpoint"):
        checkpoint.resolve(tmp_path / "a" / "20260104-000000-000000")
    (tmp_path / "empty").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match=r"no run checkpoint in it .*last\.pt"):
        checkpoint.resolve(tmp_path / "empty")


def test_m2flow_eval_takes_a_folder_of_runs(tmp_path):
    from m2flow.cli.common import load_eval_config, load_run_config
    from m2flow.configs import ConfigError
    from m2flow.runs.run_files import config_yaml

    cfg = load_run_config("maniskill_pushcube_ppo_mlp", ["env=gym_pendulum", "cluster=inprocess"])
    folder = tmp_path / "r" / "20260101-000000-000000" / "checkpoints"
    path = checkpoint.save(folder / "iter_00003.pt", {**state(iteration=3), "workload": "embodied",
                                                       "config": config_yaml(cfg)})
    checkpoint.link_latest(path)
    cfg, loaded = load_eval_config([f"checkpoint={tmp_path / 'r'}", "episodes=2"])
    assert cfg.eval.checkpoint == str(path) and loaded["iteration"] == 3
    assert cfg.env.name == "gym/Pendulum-v1"  # the checkpoint's own config
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^config error: checkpoint=.*empty: .*no run checkpoint"):
        load_eval_config([f"checkpoint={tmp_path / 'empty'}"])
