"""The default job learns: PushCube-v1 from state to >= 0.9 deterministic success.

Slow (minutes): run with `make test-slow`.
"""

import pytest

from m2flow.cli.common import load_run_config
from m2flow.embodied.runner import EmbodiedRunner


@pytest.mark.slow
def test_default_job_reaches_ninety_percent_success(tmp_path):
    cfg = load_run_config(
        "maniskill_pushcube_ppo_mlp",
        [f"runner.log_dir={tmp_path}", "runner.progress_bar=false"],
    )
    runner = EmbodiedRunner(cfg)
    try:
        result = runner.train()
    finally:
        runner.close()
    assert result["eval/success_once"] >= 0.9, result
