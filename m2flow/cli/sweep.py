"""``m2flow-train -m``: a sweep of runs (Hydra's sweeper and launcher), then a summary table.

    m2flow-train -m seed=0,1,2                                 # three seeds of the default job
    m2flow-train -m seed=0,1 algorithm.learning_rate=1e-4,3e-4  # the product: four jobs

Every job's config is checked before any job runs; each job trains in its own run directory
(``runner.log_dir/<run_name>/<stamp>``) and gives one row of the summary (also written to
``summary.md`` in the sweep folder, ``runner.log_dir/multirun/<stamp>``).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

from m2flow.cli.common import (
    EXIT_CONFIG, interruptible, load_run_config, setup_logging, train_command)
from m2flow.cli.workloads import run_config, workload
from m2flow.runs.control import RunControl, launch


def multirun(config_name: str, overrides: Sequence[str], show_cfg: bool = False) -> int:
    """``m2flow-train -m``: every job's config checked first (one config-error line, nothing
    run), then Hydra's sweeper and launcher run the jobs (:class:`SweepJob`), each in its own
    run directory; a summary table at the end (also ``summary.md`` in the sweep folder).
    Exit code 0 when every job ended well, 1 otherwise."""
    from omegaconf import OmegaConf

    from m2flow.configs import ConfigError
    from m2flow.configs.loader import multirun as hydra_multirun
    from m2flow.configs.loader import sweep_jobs

    try:
        jobs = sweep_jobs(overrides)
        cfgs = []
        for i, (job, swept) in enumerate(zip(jobs, _swept(jobs))):
            try:
                cfgs.append(load_run_config(config_name, job))
            except ConfigError as e:
                raise ConfigError(f"{e} (job {i} of the sweep: "
                                  f"{shlex.join(swept) or 'no overrides'})") from None
    except ConfigError as e:
        print(f"m2flow-train: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if show_cfg:
        for i, (job, cfg) in enumerate(zip(jobs, cfgs)):
            print(f"# job {i}: {shlex.join(job)}\n{OmegaConf.to_yaml(OmegaConf.structured(cfg))}")
        return 0
    setup_logging()
    control = RunControl()  # one for the whole sweep: a Ctrl-C stops the job and the sweep
    task = SweepJob(config_name, len(jobs), control)
    hydra_args = _sweep_defaults(overrides, cfgs[0].runner.log_dir) + list(overrides)

    def sweep() -> int:
        try:
            returns = hydra_multirun(config_name, task, hydra_args)
        except ConfigError as e:
            print(f"m2flow-train: {e}", file=sys.stderr)
            return EXIT_CONFIG
        return _report(returns, jobs)

    return interruptible("m2flow-train", sweep, control=control,
                         command=lambda ckpt: train_command(config_name, task.current, ckpt))


class SweepJob:
    """One job of ``m2flow-train -m`` as Hydra's launcher calls it, with the job's composed
    config: checked as a single run's, trained, and summed up in a row (job, overrides,
    eval success, env steps, wall time, run dir, status). A job that fails gives a row (and
    its one line on stderr), not an exception, so the sweep goes on; Ctrl-C ends the sweep.
    A plain object of this module, so a launcher plugin can pickle it into another process
    (its ``control`` then starts afresh there: see ``RunControl.__getstate__``)."""

    def __init__(self, config_name: str, num_jobs: int, control: RunControl):
        self.config_name, self.num_jobs, self.control = config_name, num_jobs, control
        self.current: list[str] = []  # the overrides of the job under way (in this process)

    def __call__(self, composed) -> dict:
        import time

        from hydra.core.hydra_config import HydraConfig

        from m2flow.pipelines.futures import Stopped
        from m2flow.runs.failure import RunFailed, RunInterrupted
        from m2flow.runs.run_files import config_yaml

        hc = HydraConfig.get()
        self.current = list(hc.overrides.task)
        row = {"job": hc.job.num, "overrides": self.current, "sweep_dir": hc.sweep.dir,
               "run_dir": None, "success": None, "env_steps": None, "wall_s": 0.0}
        print(f"multirun: job {hc.job.num} ({hc.job.num + 1} of {self.num_jobs}): "
              f"{shlex.join(self.current) or 'no overrides'}", flush=True)
        t0 = time.perf_counter()
        runs, before, text, cfg = None, set(), None, None
        try:
            cfg = run_config(composed)
            runs = Path(cfg.runner.log_dir) / cfg.run_name
            before, text = set(runs.glob("*")), config_yaml(cfg)
            self.control.begin()  # this job's start-up (a failure before its session names it)
            self.control.launch = launch(self.config_name, self.current)  # in its checkpoints
            rc = workload(cfg.workload).train(cfg, self.control)
            row["status"] = "ok" if rc == 0 else f"exit {rc}"
        except (Stopped, RunInterrupted, KeyboardInterrupt):
            raise  # ends the sweep (Hydra hands it on; interruptible says where)
        except Exception as e:  # this job's failure, in the table; the sweep goes on
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            row["status"] = f"failed: {type(e).__name__}: {first}".rstrip(": ")
            if isinstance(e, RunFailed):
                row["status"] = e.headline()
            self._say_failed(hc.job.num, e, cfg)
        row["wall_s"] = time.perf_counter() - t0
        if runs is not None:
            row.update(_run_results(runs, before, text))
        return row

    def _say_failed(self, job: int, e: Exception, cfg) -> None:
        """The failed job's one line on stderr, as a single run ends with (the traceback in
        its run's ``train.log``), with the command that resumes or repeats this job."""
        from m2flow.runs.failure import RunFailed, run_failed

        if not isinstance(e, RunFailed):
            if cfg is None:  # its config did not load: the status says why
                return
            w = workload(cfg.workload)
            e = run_failed(e, cfg, phase=self.control.phase,
                           hint=w.memory_hint(cfg) if w.memory_hint else "")
        command = lambda ckpt: train_command(self.config_name, self.current, ckpt)  # noqa: E731
        print(f"m2flow-train: job {job}: {e.describe(command)}", file=sys.stderr, flush=True)


def _run_results(runs: Path, before: set, text: Optional[str]) -> dict:
    """The run directory a job made under ``runs`` (``log_dir/run_name``: the folder that is
    new; among several, as parallel jobs of one run name make, the one whose config.yaml is
    the job's ``text``), its last checkpoint's eval success (or accuracy) and env steps."""
    from m2flow.runs import checkpoint

    new = sorted(d for d in runs.glob("*") if d.is_dir() and d not in before)
    if len(new) > 1 and text is not None:
        new = [d for d in new if (d / "config.yaml").is_file()
               and (d / "config.yaml").read_text() == text] or new
    if not new:
        return {}
    out = {"run_dir": str(new[-1])}
    last = new[-1] / "checkpoints" / checkpoint.LAST
    if last.exists():
        try:
            state = checkpoint.load(last, mmap=True)
        except ValueError:
            return out
        metrics = state.get("metrics", {})  # reasoning runs score eval/accuracy
        out["success"] = metrics.get("eval/success_once", metrics.get("eval/accuracy"))
        out["env_steps"] = state.get("global_step")
    return out


def _sweep_defaults(overrides: Sequence[str], log_dir: str) -> list[str]:
    """Hydra settings of a sweep unless the user gives them: its folder (each job's
    ``.hydra`` record in a numbered subfolder) under ``runner.log_dir/multirun``, and
    m2flow's logging rather than Hydra's (jobs print as a single run does)."""
    from datetime import datetime

    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    defaults = {"hydra.sweep.dir": str(Path(log_dir) / "multirun" / stamp),
                "hydra/job_logging": "none", "hydra/hydra_logging": "none"}
    return [f"{k}={v}" for k, v in defaults.items() if k not in given]


def _report(returns: Sequence, jobs: Sequence[Sequence[str]]) -> int:
    """Prints the summary table of a sweep's ``returns`` (Hydra's JobReturns) and writes it to
    ``summary.md`` in the sweep folder; 0 when every job ended well, else 1."""
    rows = []
    for i, ret in enumerate(returns):
        try:
            rows.append(ret.return_value)
        except Exception as e:  # a launcher that could not run the job at all
            rows.append({"job": i, "overrides": list(jobs[i]), "status": f"failed: {e!r}"})
    table = summary_table(rows)
    print(f"\nmultirun: {len(rows)} job(s)\n{table}", flush=True)
    sweep_dir = next((r["sweep_dir"] for r in rows if r.get("sweep_dir")), None)
    if sweep_dir is not None:
        path = Path(sweep_dir) / "summary.md"
        path.write_text(table + "\n")
        print(f"multirun: summary in {path}", flush=True)
    return 0 if rows and all(r.get("status") == "ok" for r in rows) else 1


def summary_table(rows: Sequence[dict]) -> str:
    """A markdown table, one row per job: the overrides that differ between jobs (all of
    them for a single job), eval success, env steps, wall time, run dir and status.

    >>> print(summary_table([{"job": 0, "overrides": ["seed=0", "x=1"], "success": 0.5,
    ...                       "env_steps": 64, "wall_s": 3.2, "run_dir": "runs/a", "status": "ok"},
    ...                      {"job": 1, "overrides": ["seed=1", "x=1"], "status": "exit 1"}]))
    | job | overrides | eval success | env steps | wall s | run dir | status |
    |---|---|---|---|---|---|---|
    | 0 | seed=0 | 0.500 | 64 | 3 | runs/a | ok |
    | 1 | seed=1 | - | - | - | - | exit 1 |
    """
    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = ["| job | overrides | eval success | env steps | wall s | run dir | status |",
             "|---|---|---|---|---|---|---|"]
    for r, shown in zip(rows, _swept([r.get("overrides") or [] for r in rows])):
        lines.append(" | ".join([
            f"| {r.get('job', '-')}", " ".join(shown) or "-", fmt(r.get("success"), ".3f"),
            fmt(r.get("env_steps"), "d"), fmt(r.get("wall_s") or None, ".0f"),
            r.get("run_dir") or "-", f"{r.get('status', '-')} |"]))
    return "\n".join(lines)


def _swept(jobs: Sequence[Sequence[str]]) -> list[list[str]]:
    """Each job's overrides of the keys whose value differs between jobs (a single job: all).

    >>> _swept([["a=1", "seed=0"], ["a=1", "seed=1"]])
    [['seed=0'], ['seed=1']]
    """
    if len(jobs) < 2:
        return [list(j) for j in jobs]
    common = set.intersection(*map(set, jobs))
    keys = {o.split("=", 1)[0] for j in jobs for o in j if o not in common}
    return [[o for o in j if o.split("=", 1)[0] in keys] for j in jobs]
