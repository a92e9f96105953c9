"""The time-breakdown plot and table, and the RunLogger writing them on close."""

import random

from m2flow.runs.logger import RunLogger
from m2flow.runs.timeline import breakdown_table, plot_time_breakdown

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PHASES = {"env": ("sim", "wait", "send"), "rollout": ("infer", "wait"),
          "learner": ("learn", "weight_sync")}


def synthetic_history(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    history = []
    for it in range(n):
        m = {f"time/{c}_{p}": rng.uniform(0.05, 0.5) for c, ps in PHASES.items() for p in ps}
        m |= {"iteration": it, "perf/iteration_s": 2.0 + rng.random(),
              "perf/env_steps_per_s": 1000.0 + rng.random(), "env/return": rng.random()}
        history.append(m)
    return history


def test_plot_writes_a_small_png(tmp_path):
    out = plot_time_breakdown(synthetic_history(5), tmp_path / "t.png")
    assert out == tmp_path / "t.png"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) < 200_000


def test_plot_without_time_keys_writes_nothing(tmp_path):
    history = [{"iteration": i, "perf/iteration_s": 1.0} for i in range(3)]
    assert plot_time_breakdown(history, tmp_path / "t.png") is None
    assert list(tmp_path.iterdir()) == []


def test_table_lists_every_component_and_phase():
    table = breakdown_table(synthetic_history(5))
    for component, phases in PHASES.items():
        rows = [line.split() for line in table.splitlines() if line.startswith(component + " ")]
        assert {r[1] for r in rows} >= set(phases)
        assert all(r[-1].endswith("%") for r in rows)
    assert breakdown_table([{"perf/iteration_s": 1.0}]) == ""


def test_run_logger_writes_the_plot_on_close(tmp_path):
    logger = RunLogger(tmp_path, 3, bar=False)
    for it, metrics in enumerate(synthetic_history(3)):
        metrics.pop("iteration")  # the logger adds it itself
        logger.log(it, 100 * (it + 1), metrics)
    logger.close()
    assert (tmp_path / "time_breakdown.png").read_bytes()[:8] == PNG_MAGIC
    assert "learner" in (tmp_path / "train.log").read_text()


def test_run_logger_survives_a_failing_plot(tmp_path, monkeypatch):
    def broken(history, path):
        raise RuntimeError("no display")

    monkeypatch.setattr("m2flow.runs.logger.plot_time_breakdown", broken)
    logger = RunLogger(tmp_path, 1, bar=False)
    logger.log(0, 10, synthetic_history(1)[0])
    logger.close()
    assert "time breakdown not written" in (tmp_path / "train.log").read_text()
    assert not (tmp_path / "time_breakdown.png").exists()
