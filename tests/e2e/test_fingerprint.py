"""Learning fingerprints: the logged scalars of a short default job and of the reasoning tiny
job, at a small size, against a record kept in the repository.

The default job's runs across everything that can alter a run after its first iterations:
training goes on after each of two evaluations and two checkpoints, and every evaluation is
judged by the job's own stop rule (``stop_at_success`` 0.9), which curtails it after its first
round of two (it can no longer reach 0.9): the episodes it runs, and so the env workers'
state after it, are the rule's. A fresh policy does not succeed in six iterations, so the
stop itself is not reached; the rule's decisions are unit-tested beside it
(``tests/embodied/test_eval_stop.py``). The last checkpoint (``last.pt``: its iteration, env
steps, and per tensor group the sum of absolute values) is part of the record.

Both runs are deterministic (fixed seed, CPU, Ray workers as the configs place them), so a
change anywhere in what they compute (env, policy, algorithm, seeding, the run loop) shows
up here as a changed number, not weeks later as a slower default job. A change of the
numbers on purpose updates the record in the same commit, saying why:

    M2FLOW_UPDATE_RECORDS=1 bash scripts/test.sh tests/e2e/test_fingerprint.py

The reasoning run is a process of its own in which the simulator and VLA stacks are not found
(tests/stacks.py), so it also shows that the reasoning workload, Ray workers included, needs
none of m2flow's extras but ``[reasoning]``.

Scalars are compared within ``RTOL`` (float32 TensorBoard values; a different CPU can round
a sum differently), timing scalars (``time/``, ``perf/``) are not compared, and a scalar that
appears or disappears is a difference too.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from m2flow.cli.train import main as train
from tests.stacks import without_stacks

RECORDS = Path(__file__).resolve().parent.parent / "records"
UPDATE = os.environ.get("M2FLOW_UPDATE_RECORDS") == "1"
RTOL, ATOL = 1e-5, 1e-7
# (rtol, atol) of the scalars whose rounding another CPU model or kernel version moves past
# RTOL where every other scalar agrees: explained variance, 1 - var(target - value) /
# var(target), whose absolute error is that ratio's relative rounding error however near 0 it
# is (moved by up to 2.4e-5), and the gradient norm, one float32 sum of squares over every
# parameter (moved by 1.1e-5 relative)
TOLERANCES = {"loss/explained_variance": (0.0, 1e-4), "loss/grad_norm": (1e-4, 0.0)}
UNTIMED = ("time/", "perf/", "switch/")  # wall-clock figures: never reproducible

EMBODIED = [  # the default job (maniskill_pushcube_ppo_mlp) with 4 envs, 6 iterations:
    # evaluations (8 episodes, two rounds, curtailed by the stop rule) and checkpoints at 2, 4, 6
    "env.num_envs=4", "runner.num_iterations=6", "runner.eval_interval=2",
    "runner.eval_episodes=8", "runner.checkpoint_interval=2", "runner.progress_bar=false",
]
REASONING = [  # the reasoning tiny job: a short warm start (some answers right), 3 GRPO steps
    "--config-name", "reasoning_arith_grpo_tiny", "warm_start.steps=80", "runner.num_steps=3",
    "runner.eval_interval=3", "data.test_size=32", "runner.checkpoint_interval=0",
    "runner.progress_bar=false",
]


PACKAGES = ("torch", "numpy", "sapien", "mani_skill", "transformers", "ray", "tensordict")


def environment() -> dict[str, str]:
    """What else decides the numbers: the packages that compute them and the CPU model. A
    difference with a record made elsewhere names these too, to tell code from machine."""
    from importlib.metadata import version

    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    return {"cpu": cpu, **{p: version(p.replace("_", "-")) for p in PACKAGES}}


def scalars(run_dir: Path) -> dict[str, dict[str, float]]:
    """Every untimed TensorBoard scalar of a run: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {str(e.step): e.value for e in acc.Scalars(tag)}
            for tag in sorted(acc.Tags()["scalars"]) if not tag.startswith(UNTIMED)}


def checkpoint_digest(path: Path) -> dict[str, dict[str, float]]:
    """A checkpoint as fingerprint scalars: its iteration and env steps, and per group of its
    learner's tensors (``policy``, ``optimizer``) the sum of their absolute values, under
    step "0" (so ``differences`` compares them as it does logged scalars)."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)
    out = {"checkpoint/iteration": float(state["iteration"]),
           "checkpoint/global_step": float(state["global_step"])}

    def tensors(x):
        if torch.is_tensor(x):
            yield x
        elif isinstance(x, dict):
            for v in x.values():
                yield from tensors(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                yield from tensors(v)

    for group, value in state["learner"].items():
        floats = [t.double().abs().sum().item() for t in tensors(value) if t.is_floating_point()]
        if floats:
            out[f"checkpoint/{group}_abs_sum"] = sum(floats)
    return {k: {"0": v} for k, v in out.items()}


def differences(recorded: dict, now: dict) -> list[str]:
    """What differs between two fingerprints, one line each (empty: they agree).

    >>> differences({"a": {"1": 1.0}}, {"a": {"1": 1.0 + 1e-9}})
    []
    >>> differences({"a": {"1": 1.0}, "b": {"1": 0.0}}, {"a": {"1": 1.1}, "c": {"1": 0.0}})
    ['a at step 1: recorded 1.0, now 1.1', 'b: recorded, not logged now', 'c: logged now, not recorded']
    >>> ev = "loss/explained_variance"
    >>> differences({ev: {"1": 0.01845}, "r": {"1": 0.01845}}, {ev: {"1": 0.01846}, "r": {"1": 0.01846}})
    ['r at step 1: recorded 0.01845, now 0.01846']
    >>> differences({ev: {"1": 0.4}}, {ev: {"1": 0.4002}})
    ['loss/explained_variance at step 1: recorded 0.4, now 0.4002']
    >>> differences({"loss/grad_norm": {"1": 0.90271}}, {"loss/grad_norm": {"1": 0.90272}})
    []
    >>> differences({"loss/grad_norm": {"1": 0.9027}}, {"loss/grad_norm": {"1": 0.9029}})
    ['loss/grad_norm at step 1: recorded 0.9027, now 0.9029']
    """
    out = []
    for tag in sorted(recorded.keys() | now.keys()):
        if tag not in now:
            out.append(f"{tag}: recorded, not logged now")
        elif tag not in recorded:
            out.append(f"{tag}: logged now, not recorded")
        else:
            for step in sorted(recorded[tag].keys() | now[tag].keys(), key=int):
                a, b = recorded[tag].get(step), now[tag].get(step)
                rtol, atol = TOLERANCES.get(tag, (RTOL, ATOL))
                same = (a is not None and b is not None and
                        (math.isclose(a, b, rel_tol=rtol, abs_tol=atol) or a == b))
                if not same:
                    out.append(f"{tag} at step {step}: recorded {a}, now {b}")
    return out


def check(name: str, args: list[str], tmp_path: Path, env: Optional[dict] = None,
          digest: bool = False) -> None:
    """Runs m2flow-train with ``args`` (in this process, or in a process of its own with
    environment ``env``) and compares its scalars (with ``digest``, its ``last.pt``'s digest
    too) with the record ``name``."""
    argv = [*args, f"runner.log_dir={tmp_path / 'runs'}"]
    if env is None:
        assert train(argv) == 0
    else:
        proc = subprocess.run([sys.executable, "-m", "m2flow.cli.train", *argv], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=540)
        assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = next(p for p in (tmp_path / "runs").glob("*/*") if (p / "tb").is_dir())
    now = scalars(run_dir)
    if digest:
        now.update(checkpoint_digest(run_dir / "checkpoints" / "last.pt"))
    path = RECORDS / f"fingerprint_{name}.json"
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"args": args, "environment": environment(), "scalars": now},
                                   indent=1, sort_keys=True) + "\n")
        return
    recorded = json.loads(path.read_text())
    assert recorded["args"] == args, f"{path.name} was recorded with other arguments"
    diff = differences(recorded["scalars"], now)
    env = environment()
    moved = {k: (v, env.get(k)) for k, v in recorded.get("environment", {}).items()
             if env.get(k) != v}
    assert not diff, (
        f"the {name} run's numbers changed ({len(diff)} differences; first: {diff[:8]}); "
        f"recorded vs now, where they differ: {moved or 'same packages and CPU'}. If "
        f"that is on purpose, update {path.relative_to(RECORDS.parent.parent)} in the same "
        "commit and say why: M2FLOW_UPDATE_RECORDS=1 bash scripts/test.sh "
        "tests/e2e/test_fingerprint.py")


def test_default_job_fingerprint(tmp_path):
    check("embodied", EMBODIED, tmp_path, digest=True)


def test_reasoning_tiny_fingerprint(tmp_path):
    check("reasoning", REASONING, tmp_path, env=without_stacks(tmp_path / "site"))


SIGNAL = {  # per record: (its policy loss, a scalar > 0 only when rewards differ in a group)
    "embodied": ("loss/loss_policy", "train/reward_spread"),
    "reasoning": ("loss/policy", "train/groups_kept"),
}


@pytest.mark.parametrize("name", sorted(SIGNAL))
def test_records_have_signal(name):
    """A fingerprint of a run that learns nothing would miss a broken loss: each recorded run
    has non-zero policy losses and rewards that differ (GRPO: groups kept by its filter)."""
    rec = json.loads((RECORDS / f"fingerprint_{name}.json").read_text())["scalars"]
    loss, spread = SIGNAL[name]
    assert any(abs(v) > 1e-6 for v in rec[loss].values()), rec[loss]
    assert max(rec[spread].values()) > 0, rec[spread]


def test_embodied_record_spans_evaluations_checkpoints_and_the_stop_rule():
    """The default job's record is the run the module docstring says: three evaluations, each
    curtailed by the stop rule, training after the first two, and ``last.pt`` at the end."""
    rec = json.loads((RECORDS / "fingerprint_embodied.json").read_text())["scalars"]
    evals = sorted(map(int, rec["eval/success_once"]))
    trained = sorted(map(int, rec["loss/loss_policy"]))
    assert len(evals) == 3, evals
    assert sum(step > evals[0] for step in trained) >= 2, (evals, trained)
    assert all(v > 0 for v in rec["eval/curtailed"].values()), rec["eval/curtailed"]
    assert rec["checkpoint/iteration"]["0"] == 6.0, rec["checkpoint/iteration"]
    assert rec["checkpoint/global_step"]["0"] == float(evals[-1])
