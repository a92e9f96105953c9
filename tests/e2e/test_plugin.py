"""A simulator from an outside package: pip-installed, found through entry points, trained
by the real CLI, with no change to m2flow (the package is tests/plugin/). Its settings class
is checked like m2flow's own adapters': a key of it passes, a misspelt one is one line. The
plugin depends on m2flow without extras, so its processes do not find the simulator and VLA
stacks (tests/stacks.py)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stacks import without_stacks

PLUGIN = Path(__file__).parent.parent / "plugin"


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> dict:
    """The environment of a process that has the plugin installed (in a temporary folder) and
    no simulator or VLA stack."""
    tmp = tmp_path_factory.mktemp("plugin")
    site, src = tmp / "site", tmp / "plugin"
    shutil.copytree(PLUGIN, src, ignore=shutil.ignore_patterns("__pycache__"))  # builds stay out of the repo
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(src)],
        check=True, capture_output=True, text=True,
    )
    env = without_stacks(tmp / "no_stacks")
    return dict(env, PYTHONPATH=os.pathsep.join([str(site), env["PYTHONPATH"]]))


def train(env: dict, *args: str) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).with_name("m2flow-train")
    return subprocess.run([str(cli), "env=toy_reach", "cluster=inprocess", *args],
                          env=env, capture_output=True, text=True, timeout=300)


def test_pip_installed_plugin_env_trains_one_ppo_iteration(plugin_env, tmp_path):
    run = train(plugin_env, "env.step_size=0.2", "runner.num_iterations=1",
                "runner.rollout_steps=20", "runner.eval_episodes=4", "runner.progress_bar=false",
                f"runner.log_dir={tmp_path / 'runs'}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "done: 1 iterations, 80 env steps" in run.stdout
    assert "4 envs of toy/Reach-v0" in (next((tmp_path / "runs").glob("*/*/train.log"))).read_text()


def test_a_misspelt_setting_of_the_plugin_env_is_one_line(plugin_env, tmp_path):
    run = train(plugin_env, "env.step_sise=0.2", f"runner.log_dir={tmp_path / 'runs'}")
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert ("config error: env.step_sise is not a field of ToyReachConfig (env toy/Reach-v0). "
            "Did you mean env.step_size?") in run.stderr
