"""A checkpoint that cannot be resumed is refused at start-up in one line (exit 2), before
any worker runs: one of another config, names what differs; a truncated one, names the newest
good checkpoint beside it. Made by a real (tiny, in-process) run."""

from __future__ import annotations

import os
import shutil
import time

import pytest

import m2flow

from m2flow.cli.train import main as train
from tests.failure_notes import note

COMMON = ["env=gym_pendulum", "cluster=inprocess", "env.num_envs=2", "runner.rollout_steps=8",
          "runner.eval_interval=0", "runner.eval_episodes=2", "runner.progress_bar=false"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    logs = tmp_path_factory.mktemp("runs")
    assert train([*COMMON, "runner.num_iterations=2", "runner.checkpoint_interval=1",
                  f"runner.log_dir={logs}"]) == 0
    return next(logs.glob("*/*/checkpoints"))


def _refused(capsys, args, logs, common=COMMON) -> str:
    before = set(logs.rglob("*"))
    start = time.time()  # for the failure table (bench/failure_timings.py); not asserted
    code = train([*common, "runner.num_iterations=3", f"runner.log_dir={logs}", *args])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    note("line", line=err[-1] if err else "", code=code, start=start)
    assert code == 2, err
    assert len(err) == 1, err
    assert set(logs.rglob("*")) == before  # no run directory written: nothing started
    return err[0]


def test_a_checkpoint_of_another_config_names_what_differs(run_dir, tmp_path, capsys):
    line = _refused(capsys, [f"resume={run_dir / 'last.pt'}", "policy.hidden_sizes=[32]"],
                    tmp_path)
    assert "resume=" in line and "another config" in line
    assert "policy.hidden_sizes=[256, 256, 256] there, [32] here" in line
    line = _refused(capsys, [f"resume={run_dir / 'last.pt'}", "algorithm=sac", "policy=sac_mlp"],
                    tmp_path)
    assert "algorithm.name=ppo there, sac here" in line and "policy.name=mlp there, sac_mlp here" in line


def test_a_truncated_checkpoint_names_the_newest_good_one(run_dir, tmp_path, capsys):
    folder = tmp_path / "checkpoints"
    shutil.copytree(run_dir, folder)
    last = folder / "iter_00002.pt"
    os.truncate(last, last.stat().st_size // 2)
    line = _refused(capsys, [f"resume={last}"], tmp_path / "logs")
    assert f"resume={last}" in line and "not a checkpoint m2flow can read" in line
    assert line.endswith(f"The newest good checkpoint beside it: {folder / 'iter_00001.pt'}.")


def test_a_checkpoint_of_a_newer_format_names_the_version_that_wrote_it(run_dir, tmp_path,
                                                                         capsys):
    import torch

    from m2flow.runs import checkpoint

    state = torch.load(run_dir / "last.pt", weights_only=False)
    assert (state["format"], state["m2flow_version"]) == (checkpoint.FORMAT, m2flow.__version__)
    state.update(format=checkpoint.FORMAT + 1, m2flow_version="9.9.0")
    newer = tmp_path / "newer" / "iter_00002.pt"
    checkpoint.save(newer, state)
    line = _refused(capsys, [f"resume={newer}"], tmp_path / "logs")
    assert (f"was written by m2flow 9.9.0 in checkpoint format {checkpoint.FORMAT + 1}; this "
            f"m2flow ({m2flow.__version__}) reads formats up to {checkpoint.FORMAT}") in line


def test_init_from_a_policy_of_other_shapes_is_refused_naming_the_first_tensor(run_dir, tmp_path,
                                                                                capsys):
    """``init_from`` a checkpoint of the same policy (mlp) with other layers: refused before
    any worker starts (it used to start them all, then fail as the learner loaded it), naming
    the first tensor that does not fit and the setting that made it so. Worked from the MLP's
    layout (``actor_mean``: Linear at 0, 2, 4, 6, activations between; Pendulum: 3
    observations): the checkpoint's second layer is (256, 256), this run's (32, 256)."""
    last = run_dir / "last.pt"
    line = _refused(capsys, [f"init_from={last}", "policy.hidden_sizes=[256,32,256]"], tmp_path)
    assert line == (
        f"m2flow-train: config error: init_from='{last}': its tensor 'actor_mean.2.weight' has "
        "shape (256, 256) where this policy's has (32, 256) (its run's policy.hidden_sizes="
        "[256, 256, 256] there, [256, 32, 256] here); start from a checkpoint of the same "
        "policy (policy= and its settings as the run that wrote it).")
    # the layers the checkpoint lacks keep their initial values: a policy of fewer layers
    # leaves its tensors without a place, named
    line = _refused(capsys, [f"init_from={last}", "policy.hidden_sizes=[256,256]"], tmp_path)
    assert ("this policy has no tensor named 'actor_mean.6.bias', 'actor_mean.6.weight'" in
            line), line
    # a tensor named in init_skip keeps its initial value: not compared; the next one is
    line = _refused(capsys, [f"init_from={last}", "policy.hidden_sizes=[256,32,256]",
                             "init_skip=[actor_mean.2.weight]"], tmp_path)
    assert "its tensor 'actor_mean.2.bias' has shape (256,) where this policy's has (32,)" in \
        line, line


def test_init_from_another_env_compares_the_shapes_the_env_does_not_set(run_dir, tmp_path,
                                                                         capsys):
    """With another env (ManiSkill's PushCube from Pendulum's checkpoint) this run's
    observation and action sizes are not known before its env worker starts: the layers
    between hidden layers, whose shapes the env does not set, are still compared and refused
    in one line, as with the same env."""
    last = run_dir / "last.pt"
    common = [a if not a.startswith("env=") else "env=maniskill_pushcube" for a in COMMON]
    line = _refused(capsys, [f"init_from={last}", "policy.hidden_sizes=[256,32,256]"], tmp_path,
                    common=common)
    assert line.startswith(f"m2flow-train: config error: init_from='{last}': its tensor "
                           "'actor_mean.2.weight' has shape (256, 256) where this policy's has "
                           "(32, 256)"), line


def _eval_refused(capsys, args, logs) -> str:
    from m2flow.cli.eval import main as evaluate

    before = set(logs.rglob("*"))
    code = evaluate([*args, f"output_dir={logs / 'eval'}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(err) == 1, err
    assert set(logs.rglob("*")) == before  # nothing started, nothing written
    return err[0]


def test_evaluation_with_a_policy_override_that_changes_its_tensors_is_refused(tmp_path,
                                                                               capsys):
    """``m2flow-eval checkpoint=`` with a policy override that adds a part the checkpoint
    lacks (Flow-Noise's noise head, on a run that sampled by Flow-SDE) or changes a layer is
    refused at start-up in one line naming the tensors and the setting; it used to start
    every worker, then fail in the weight sync. The noise head's six tensors: two hidden
    layers and the output (``policy.noise_hidden_sizes`` [128, 64]), weight and bias each."""
    logs = tmp_path / "runs"
    assert train([*COMMON, "policy=flow_mlp", "runner.num_iterations=1",
                  f"runner.log_dir={logs}"]) == 0
    last = next(logs.glob("*/*/checkpoints/last.pt"))
    line = _eval_refused(capsys, [f"checkpoint={last}", "policy.noise_method=flow_noise"],
                         tmp_path)
    assert line == (
        f"m2flow-eval: config error: eval.checkpoint='{last}': lacks this policy's tensor(s) "
        "'noise_head.net.0.bias', 'noise_head.net.0.weight', 'noise_head.net.2.bias' and 3 "
        "more (its run's policy.noise_method=flow_sde there, flow_noise here); evaluate it "
        "with the policy settings of the run that wrote it (drop the policy overrides that "
        "add them)."), line
    line = _eval_refused(capsys, [f"checkpoint={last}", "policy.hidden_sizes=[32]"], tmp_path)
    assert "this policy has no tensor named" in line and "policy.hidden_sizes=" in line, line


def test_resuming_with_policy_settings_that_change_its_tensors_is_refused(tmp_path, capsys):
    """``resume=`` with a policy setting that is not among the fields every resume compares
    (``checkpoint_checks.RESUME_IDENTITY``) but changes the policy's tensors (Flow-Noise's noise head on a
    Flow-SDE run; the velocity network's input width with another chunk) is refused at
    start-up in one line naming the tensors and the setting: the learner loads a resumed
    policy strictly, and it used to start every worker, then fail there."""
    logs = tmp_path / "runs"
    assert train([*COMMON, "policy=flow_mlp", "runner.num_iterations=1",
                  f"runner.log_dir={logs}"]) == 0
    last = next(logs.glob("*/*/checkpoints/last.pt"))
    fix = ("resume it with the config it ran with (config.yaml in its run directory), or start "
           "from its weights with init_from=.")
    line = _refused(capsys, [f"resume={last}", "policy=flow_mlp",
                             "policy.noise_method=flow_noise"], tmp_path / "a")
    assert line == (
        f"m2flow-train: config error: resume='{last}': lacks this policy's tensor(s) "
        "'noise_head.net.0.bias', 'noise_head.net.0.weight', 'noise_head.net.2.bias' and 3 "
        f"more (its run's policy.noise_method=flow_sde there, flow_noise here); {fix}"), line
    line = _refused(capsys, [f"resume={last}", "policy=flow_mlp", "policy.chunk=2"],
                    tmp_path / "b")
    assert line.startswith(f"m2flow-train: config error: resume='{last}': its tensor "), line
    assert line.endswith(f"(its run's policy.chunk=4 there, 2 here); {fix}"), line
