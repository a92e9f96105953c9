"""``m2flow-plot``: the curves it reads are the scalars a run wrote; it draws a PNG of several
runs; a folder that is not a run is one line."""

import struct

import pytest
from torch.utils.tensorboard import SummaryWriter

from m2flow.cli.plot import main
from m2flow.runs.plot import read_run

# (step, eval/success_once) of two runs, written below as RunLogger writes them
RUN_A = [(800, 0.25), (1600, 0.5), (2400, 0.75)]
RUN_B = [(800, 0.0), (1600, 0.125)]


def write_run(root, name, points, extra=True):
    run = root / "maniskill_pushcube_ppo_mlp" / name
    w = SummaryWriter(str(run / "tb"))
    for step, value in points:
        w.add_scalar("eval/success_once", value, step)
        if extra:
            w.add_scalar("env/return", 10 * value, step)
    w.close()
    return run


def png_size(path):
    """(width, height) from the PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_read_run_gives_back_the_written_points(tmp_path):
    run = write_run(tmp_path, "20261123-000000", RUN_A)
    curves = read_run(run)
    assert curves["eval/success_once"].steps == [s for s, _ in RUN_A]
    assert curves["eval/success_once"].values == pytest.approx([v for _, v in RUN_A])
    assert curves["env/return"].values == pytest.approx([10 * v for _, v in RUN_A])
    seconds = curves["eval/success_once"].seconds
    assert seconds[0] >= 0 and seconds == sorted(seconds)


def test_two_runs_overlaid_into_one_png(tmp_path, capsys):
    a = write_run(tmp_path, "a", RUN_A)
    b = write_run(tmp_path, "b", RUN_B, extra=False)  # no env/return: left out of that panel
    out = tmp_path / "curves.png"
    assert main([str(a), str(b), "-o", str(out)]) == 0
    width, height = png_size(out)
    assert width > 500 and height > 300
    assert "2 run(s)" in capsys.readouterr().out


def test_a_folder_that_is_not_a_run_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no tb/ folder" in err[0]


def test_metrics_no_run_logged_are_named(tmp_path, capsys):
    a = write_run(tmp_path, "a", RUN_A)
    assert main([str(a), "--metrics", "eval/accuracy", "-o", str(tmp_path / "x.png")]) == 2
    assert "eval/accuracy" in capsys.readouterr().err


def test_a_resumed_run_continues_the_clock_of_the_run_it_resumed(tmp_path):
    # source run: steps 800, 1600, 2400 at wall 1000, 1100, 1300 s; it was resumed from its
    # step-1600 checkpoint, and the resumed run logged 1600 and 2400 at wall 5000, 5060 s
    # (an hour later): on the plot the resumed run starts at 100 s, where its source was.
    src = tmp_path / "maniskill_pushcube_ppo_mlp" / "first"
    w = SummaryWriter(str(src / "tb"))
    for step, wall in [(800, 1000.0), (1600, 1100.0), (2400, 1300.0)]:
        w.add_scalar("eval/success_once", 0.5, step, walltime=wall)
    w.close()
    resumed = tmp_path / "maniskill_pushcube_ppo_mlp" / "second"
    w = SummaryWriter(str(resumed / "tb"))
    for step, wall in [(1600, 5000.0), (2400, 5060.0)]:
        w.add_scalar("eval/success_once", 0.75, step, walltime=wall)
    w.close()
    (resumed / "config.yaml").write_text(f"resume: {src}/checkpoints/iter_00002.pt\n")
    assert read_run(resumed)["eval/success_once"].seconds == pytest.approx([100.0, 160.0])
    assert read_run(src)["eval/success_once"].seconds == pytest.approx([0.0, 100.0, 300.0])
    (resumed / "config.yaml").write_text("resume: null\n")  # not resumed: its own clock
    assert read_run(resumed)["eval/success_once"].seconds == pytest.approx([0.0, 60.0])


def test_a_baseline_report_gives_its_levels_and_a_bad_one_is_one_line(tmp_path, capsys):
    import json

    from m2flow.runs.plot import read_baseline

    report = tmp_path / "results.json"  # the fields m2flow-eval writes, two tasks
    report.write_text(json.dumps({
        "checkpoint": "runs/maniskill_pickcube_bc_mlp/20261127-000000/checkpoints/last.pt",
        "episodes": 8, "mean_success_once": 0.375, "mean_success_at_end": 0.125,
        "tasks": [{"mean_return": 10.0}, {"mean_return": 30.0}]}))
    label, levels = read_baseline(report)
    assert label == "maniskill_pickcube_bc_mlp, m2flow-eval 8 episodes"
    assert levels == {"eval/success_once": 0.375, "eval/success_at_end": 0.125,
                      "eval/return": 20.0}
    a = write_run(tmp_path, "a", RUN_A)
    assert main([str(a), "--baseline", str(report), "-o", str(tmp_path / "c.png")]) == 0
    capsys.readouterr()
    (tmp_path / "bad.json").write_text("{}")
    assert main([str(a), "--baseline", str(tmp_path / "bad.json"), "-o",
                 str(tmp_path / "d.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not an m2flow-eval results.json" in err[0]
