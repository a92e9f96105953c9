"""Helpers of the end-to-end tests that clone a planner: one demonstration written by
m2flow-demos (as a user's ``m2flow-demos ...`` writes it), and a run's logged scalars."""

from pathlib import Path

from m2flow.embodied.demos import maniskill as demos_mod


def one_demo(folder: Path, overrides: list[str]) -> Path:
    """The .h5 file of one demonstration the motion planner solved, under ``folder``, with
    m2flow-demos' ``overrides`` (its env and obs mode)."""
    cfg = demos_mod.load_demos_config(overrides=[
        *overrides, "env.max_episode_steps=100", "demos.episodes=1", "demos.max_tries=3",
        f"demos.output={folder / 'demos'}"])
    kept, _, spec = demos_mod.generate(cfg, log=lambda line: None)
    assert kept, "the planner solved no episode"
    h5_path, _ = demos_mod.save(demos_mod.output_stem(cfg), kept, cfg.env, spec)
    return h5_path


def logged(run_dir: Path, tag: str) -> list[float]:
    """The values of scalar ``tag`` in a run directory's TensorBoard events, in order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]
