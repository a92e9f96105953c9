"""The reasoning workload as the command line sees it: schemas, checks, train and evaluate."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Optional

from m2flow.configs import schema
from m2flow.reasoning.config import ReasoningConfig
from m2flow.runs.control import RunControl
from m2flow.runs.workload import Workload


def register_schemas() -> None:
    schema.store("reasoning_schema", ReasoningConfig)


def check(cfg: ReasoningConfig) -> None:
    from m2flow.reasoning.checks import check_reasoning_config

    check_reasoning_config(cfg)


def train(cfg: ReasoningConfig, control: Optional[RunControl] = None) -> int:
    from m2flow.reasoning.runner import ReasoningRunner

    runner = ReasoningRunner(cfg, control=control)
    try:
        result = runner.train()
    finally:
        runner.close()
    print(
        f"done: {result['iterations']} GRPO steps in {result['loop_s'] / 60:.1f} min ({result['wall_s']:.0f} s "
        f"with warm start and evals); held-out accuracy "
        f"{result.get('eval/accuracy_start', float('nan')):.3f} before GRPO -> "
        f"{result.get('eval/accuracy', float('nan')):.3f} after; checkpoint {result['checkpoint']}"
    )
    return 0


def evaluate(cfg: ReasoningConfig, state: Optional[dict],
             control: Optional[RunControl] = None) -> int:
    """Greedy held-out accuracy of a checkpoint (or of the initial weights); writes
    results.json and results.md with sample completions."""
    import time

    from m2flow.reasoning.runner import ReasoningRunner

    t0 = time.perf_counter()
    runner = ReasoningRunner(cfg, train=False, control=control)
    try:
        if state is not None:
            runner.load_policy(state)
        report = runner.eval_accuracy(cfg.eval.size, cfg.eval.samples)
    finally:
        runner.close()
    report["wall_s"] = time.perf_counter() - t0
    report["checkpoint"] = cfg.eval.checkpoint
    out = _eval_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    lines = [f"# held-out accuracy: {report['accuracy']:.3f} ({report['problems']} problems)", "",
             "| question | answer | completion | correct |", "|---|---|---|---|"]
    for s in report["samples"]:
        cells = [s["question"], s["answer"], s["completion"].replace("\n", " "), str(s["correct"])]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print(f"eval: held-out accuracy {report['accuracy']:.3f} over {report['problems']} problems, "
          f"mean response {report['response_len']:.1f} tokens, {report['wall_s']:.0f} s; "
          f"report in {out}")
    print(json.dumps({"eval/accuracy": report["accuracy"],
                      "eval/problems": float(report["problems"]),
                      "eval/response_len": report["response_len"]}))
    return 0


def _eval_dir(cfg: ReasoningConfig) -> Path:
    if cfg.eval.output_dir:
        return Path(cfg.eval.output_dir)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    if cfg.eval.checkpoint:
        return Path(cfg.eval.checkpoint).resolve().parent.parent / "eval" / stamp
    return Path(cfg.runner.log_dir) / "eval" / cfg.run_name / stamp


def memory_hint(cfg: ReasoningConfig) -> str:
    from m2flow.reasoning.checks import memory_hint as hint

    return hint(cfg)


WORKLOAD = Workload(
    name="reasoning",
    schema="reasoning_schema",
    config_class=ReasoningConfig,
    register_schemas=register_schemas,
    check=check,
    train=train,
    evaluate=evaluate,
    memory_hint=memory_hint,
    eval_shorthands={"size": "eval.size", "samples": "eval.samples"},
)
