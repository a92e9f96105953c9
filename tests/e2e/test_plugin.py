"""A simulator from an outside package: pip-installed, found through entry points, trained
by the real CLI, with no change to m2flow (the package is tests/plugin/)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

PLUGIN = Path(__file__).parent.parent / "plugin"


def test_pip_installed_plugin_env_trains_one_ppo_iteration(tmp_path):
    site, src = tmp_path / "site", tmp_path / "plugin"
    shutil.copytree(PLUGIN, src, ignore=shutil.ignore_patterns("__pycache__"))  # builds stay out of the repo
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(src)],
        check=True, capture_output=True, text=True,
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    cli = Path(sys.executable).with_name("m2flow-train")
    run = subprocess.run(
        [str(cli), "env=toy_reach", "cluster=inprocess", "runner.num_iterations=1",
         "runner.rollout_steps=20", "runner.eval_episodes=4", "runner.progress_bar=false",
         f"runner.log_dir={tmp_path / 'runs'}"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "done: 1 iterations, 80 env steps" in run.stdout
    assert "4 envs of toy/Reach-v0" in (next((tmp_path / "runs").glob("*/*/train.log"))).read_text()
