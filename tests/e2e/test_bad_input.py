"""Malformed configs fail at start-up: exit code 2, one line on stderr naming the field,
before Ray, a worker or a simulator starts (and before ``runs/`` is written). That is what
makes the error quick; the seconds are not asserted (timings belong to benchmarks, and a
loaded CI machine made a 10 s bound flaky).

Most cases run in one driver process (this file run as a script) that calls
``m2flow.cli.train`` / ``m2flow.cli.eval`` for each and records the exit code, the stderr lines, the
seconds and whether Ray was started; a few run as separate processes of the installed
console scripts, which proves the exit code a user sees.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

SUBPROCESS_TIMEOUT_S = 300  # generous: a hang must fail the test, not the CI job
TRAIN, EVAL = "m2flow-train", "m2flow-eval"
REASONING = ["--config-name", "reasoning_arith_grpo_tiny"]
LIBERO = ["--config-name", "libero_spatial_ppo_cnn"]
MJLAB = ["--config-name", "mjlab_cartpole_ppo_mlp"]


def _machine() -> tuple[int, int]:
    """(cores, GPUs) of this machine, counted as the cluster counts them."""
    import torch

    return len(os.sched_getaffinity(0)), torch.cuda.device_count()


OLD_POLICY_FILE = """\
defaults:
  - mlp_schema
  - _self_
name: mlp
kwargs:
  actor_hidden_state: [[9, 18]]
"""  # a policy group file in the layout before typed settings (issue 47)


def write_inputs(tmp: Path) -> dict[str, str]:
    """Files the ``resume=`` cases point at: text, a torch file that is no checkpoint, a
    checkpoint of the other workload, a folder with no runs in it; and a config folder with
    a policy group file that still sets ``kwargs``."""
    import torch

    (tmp / "notes.txt").write_text("not a checkpoint\n")
    (tmp / "no_runs").mkdir(exist_ok=True)
    torch.save({"weights": torch.zeros(2)}, tmp / "weights.pt")
    torch.save({"workload": "embodied", "config": "{}", "learner": {}}, tmp / "embodied.pt")
    (tmp / "old_configs" / "policy").mkdir(parents=True, exist_ok=True)
    (tmp / "old_configs" / "policy" / "old_mlp.yaml").write_text(OLD_POLICY_FILE)
    return {"{text}": str(tmp / "notes.txt"), "{plain}": str(tmp / "weights.pt"),
            "{other}": str(tmp / "embodied.pt"), "{empty}": str(tmp / "no_runs"),
            "{old_configs}": str(tmp / "old_configs")}


def case_table() -> list[tuple[str, str, list[str], str]]:
    """(id, program, arguments, a fragment the error line must contain: the field)."""
    cores, gpus = _machine()
    return [
        # the list
        ("num_envs_0", TRAIN, ["env.num_envs=0"], "env.num_envs=0"),
        ("num_envs_negative", TRAIN, ["env.num_envs=-3"], "env.num_envs=-3"),
        ("stages_0", TRAIN, ["staging.pipeline_stages=0"], "staging.pipeline_stages=0"),
        ("stages_over_envs", TRAIN, ["staging.pipeline_stages=8", "env.num_envs=2"],
         "staging.pipeline_stages=8"),
        ("cpu_id_beyond_cores", TRAIN,
         [f"cluster.placement.components.rollout.cpu_ids=[{max(7, cores)}]"],
         "cluster.placement.components.rollout.cpu_ids"),
        ("gpu_beyond_gpus", TRAIN, [f"cluster.placement.components.learner.gpus=[{gpus}]"],
         "cluster.placement.components.learner.gpus"),
        ("learning_rate", TRAIN, ["algorithm.learning_rate=-1"], "algorithm.learning_rate"),
        ("lr_schedule", TRAIN, ["algorithm.lr_schedule=cosine"], "algorithm.lr_schedule"),
        ("sac_utd", TRAIN, ["--config-name", "maniskill_pushcube_sac_mlp", "algorithm.utd=0"],
         "algorithm.utd"),
        ("sac_demos_missing", TRAIN, ["--config-name", "maniskill_pushcube_sac_mlp",
                                      "algorithm.demos=no/such.h5"], "algorithm.demos"),
        ("grpo_group", TRAIN, ["algorithm=grpo", "env.num_envs=5", "algorithm.group_size=4"],
         "env.num_envs=5"),
        ("warn_no_signal", TRAIN, ["runner.warn_no_signal_iterations=-1"],
         "runner.warn_no_signal_iterations"),
        ("reasoning_weight_sync_bucket", TRAIN, [*REASONING, "runner.weight_sync_bucket_mb=0"],
         "runner.weight_sync_bucket_mb"),
        ("weight_sync_bucket", TRAIN, ["runner.weight_sync_bucket_mb=0"],
         "runner.weight_sync_bucket_mb"),
        ("grpo_group_split_on_gpu_batches", TRAIN,
         ["algorithm=grpo", "env.num_envs=8", "algorithm.group_size=4", "env.sim_backend=gpu",
          "staging.pipeline_stages=2", "staging.env_groups=4"], "staging.env_groups=4"),
        ("libero_task_ids", TRAIN, ["env=libero_spatial", "env.task_ids=[99]"],
         "env.task_ids"),
        # each env's and policy's own settings (issue 47)
        ("policy_setting_typo", TRAIN, ["--config-name", "maniskill_pushcube_ppo_cnn",
                                        "policy.critc=privileged"],
         "policy.critc is not a field of CNNPolicyConfig (policy cnn). Did you mean "
         "policy.critic? Known fields: name, hidden_sizes"),
        ("env_setting_typo", TRAIN, ["env=libero_spatial", "env.task_id=[0]"],
         "env.task_id is not a field of LiberoEnvConfig (env LIBERO/libero_spatial). Did you "
         "mean env.task_ids? Known fields: name, num_envs"),
        ("env_setting_of_another_adapter", TRAIN,
         ["env=libero_spatial", "env.visual_mesh_fraction=0.05"],
         "env.visual_mesh_fraction is not a field of LiberoEnvConfig"),
        ("env_name_of_another_adapter", TRAIN, ["env.name=gym/Pendulum-v1"],
         "env.name='gym/Pendulum-v1' takes the settings GymEnvConfig, but the env config "
         "gives ManiSkillEnvConfig"),
        ("policy_kwargs_gone", TRAIN, ["policy.kwargs.actor_hidden_state=[[9,18]]"],
         "policy.kwargs is gone: its entries are fields of policy now; write "
         "policy.actor_hidden_state instead of policy.kwargs.actor_hidden_state"),
        ("env_kwargs_gone", TRAIN, ["env=libero_spatial", "env.kwargs.task_ids=[0]"],
         "env.kwargs is gone: its entries are fields of env now; write env.task_ids"),
        ("policy_kwargs_gone_in_a_file", TRAIN,
         ["hydra.searchpath=[file://{old_configs}]", "policy=old_mlp"],
         "policy.kwargs is gone: its entries are fields of policy now; in policy/old_mlp, "
         "move them up one level: policy.actor_hidden_state"),
        ("resume_text_file", TRAIN, ["resume={text}"], "resume="),
        ("resume_torch_file", TRAIN, ["resume={plain}"], "resume="),
        ("gamma", TRAIN, ["algorithm.gamma=1.5"], "algorithm.gamma"),
        ("mlp_with_images", TRAIN, ["env.obs_mode=rgb"], "env.obs_mode=rgb"),
        ("resume_missing", TRAIN, ["resume=/nonexistent/ckpt.pt"], "resume="),
        ("resume_folder_without_runs", TRAIN, ["resume={empty}"], "resume="),
        ("init_from_missing", TRAIN, ["init_from=/nonexistent/ckpt.pt"], "init_from="),
        ("init_from_text_file", TRAIN, ["init_from={text}"], "init_from="),
        ("num_iterations", TRAIN, ["runner.num_iterations=-1"], "runner.num_iterations=-1"),
        # more ranges
        ("keep_checkpoints", TRAIN, ["runner.keep_checkpoints=-1"], "runner.keep_checkpoints"),
        ("progress_interval", TRAIN, ["runner.progress_interval_s=-1"],
         "runner.progress_interval_s"),
        ("resume_latest_none", TRAIN, ["resume=latest"], "resume=latest"),
        ("reasoning_resume_latest_none", TRAIN, [*REASONING, "resume=latest"], "resume=latest"),
        ("eval_episodes", TRAIN, ["runner.eval_episodes=0"], "runner.eval_episodes"),
        ("stop_at_success", TRAIN, ["runner.stop_at_success=1.5"], "runner.stop_at_success"),
        ("stop_after_evals", TRAIN, ["runner.stop_after_evals=0"], "runner.stop_after_evals"),
        ("eval_gate", TRAIN, ["runner.eval_gate=1.5"], "runner.eval_gate=1.5"),
        ("success_metric", TRAIN, ["runner.success_metric=success_end"],
         "runner.success_metric='success_end': must be one of success_once, success_at_end"),
        ("rollout_steps", TRAIN, ["runner.rollout_steps=0"], "runner.rollout_steps"),
        ("channel_timeout", TRAIN, ["runner.channel_timeout_s=0"], "runner.channel_timeout_s"),
        ("stall_timeout", TRAIN, ["runner.stall_timeout_s=-5"],
         "runner.stall_timeout_s=-5.0: must be > 0, or null"),
        ("image_size", TRAIN, ["env.image_size=0"], "env.image_size"),
        ("step_timeout", TRAIN, ["env.step_timeout_s=0"], "env.step_timeout_s"),
        ("envs_per_process", TRAIN, ["env.envs_per_process=-1"],
         "env.envs_per_process=-1: must be >= 0"),
        ("visual_mesh_fraction", TRAIN, ["env.visual_mesh_fraction=0"],
         "env.visual_mesh_fraction"),
        ("max_episode_steps", TRAIN, ["env.max_episode_steps=0"], "env.max_episode_steps"),
        ("sim_backend", TRAIN, ["env.sim_backend=cuda"], "env.sim_backend"),
        ("seed", TRAIN, ["seed=-1"], "seed=-1"),
        ("sweep_bad_value", TRAIN, ["-m", "seed=0,-1"], "seed=-1"),  # before job 0 runs
        ("sweep_bad_type", TRAIN, ["-m", "algorithm.learning_rate=1e-4,fast"],
         "algorithm.learning_rate='fast'"),
        ("sweep_without_multirun", TRAIN, ["seed=0,1"], "-m"),
        ("node_resource_nowhere", TRAIN, ["cluster.placement.components.env.node_resource=gpu_box"],
         "cluster.placement.components.env.node_resource='gpu_box': no node"),
        ("node_resource_and_node", TRAIN, ["cluster=ray_multinode",
                                           "cluster.placement.components.env.node=1"],
         "cluster.placement.components.env: node=1 and node_resource='m2flow_env'"),
        ("rollout_workers_idle", TRAIN, ["cluster.placement.components.rollout.workers=2"],
         "cluster.placement.components.rollout.workers=2: must divide the 1 stages"),
        ("rollout_workers_uneven", TRAIN, ["cluster.placement.components.rollout.workers=2",
                                           "cluster.placement.components.env.workers=3"],
         "cluster.placement.components.rollout.workers=2: must divide the 3 stages"),
        ("weight_sync", TRAIN, ["cluster.weight_sync=nccl"], "cluster.weight_sync='nccl'"),
        ("weight_sync_dist_in_process", TRAIN, ["cluster=inprocess", "cluster.weight_sync=dist"],
         "cluster.weight_sync=dist"),
        ("reasoning_weight_sync_dist", TRAIN, [*REASONING, "cluster.weight_sync=dist"],
         "cluster.weight_sync='dist'"),
        ("hidden_sizes", TRAIN, ["policy.hidden_sizes=[64,0]"], "policy.hidden_sizes"),
        ("activation", TRAIN, ["policy.activation=swish"], "policy.activation"),
        ("control_mode", TRAIN, ["env.control_mode=pd_bogus"], "env.control_mode"),
        ("env_groups_below_stages", TRAIN, ["staging.env_groups=1", "staging.pipeline_stages=2"],
         "staging.env_groups"),
        ("num_minibatches", TRAIN, ["algorithm.num_minibatches=100000"],
         "algorithm.num_minibatches"),
        ("bc_num_minibatches", TRAIN, ["--config-name", "maniskill_pickcube_bc_mlp",
                                       "algorithm.num_minibatches=1000"],
         "algorithm.num_minibatches=1000: must be <= the 512 samples an update trains on "
         "(algorithm.batch_size, drawn from the dataset)"),
        ("grpo_filters", TRAIN,
         ["algorithm=grpo", "algorithm.filter_low=0.8", "algorithm.filter_high=0.2"],
         "algorithm.filter_low"),
        ("grpo_logprob_level", TRAIN, ["algorithm=grpo", "algorithm.logprob_level=word"],
         "algorithm.logprob_level"),
        ("critic_learning_rate", TRAIN, ["algorithm.critic_learning_rate=0"],
         "algorithm.critic_learning_rate"),
        ("overlap_without_staleness", TRAIN,
         ["runner.overlap_learner=true", "runner.max_staleness=0"], "runner.max_staleness"),
        ("cnn_without_images", TRAIN, [*LIBERO, "env.obs_mode=state"], "env.obs_mode=state"),
        ("mjlab_unknown_task", TRAIN, [*MJLAB, "env.name=mjlab/Mjlab-Cartpole-Balanse"],
         "Did you mean 'Mjlab-Cartpole-Balance'"),
        ("mjlab_no_camera", TRAIN, [*MJLAB, "env.obs_mode=rgb"], "env.obs_mode=rgb"),
        ("stagger_with_resets", TRAIN, [*MJLAB, "runner.stagger_episodes=true",
                                        "runner.reset_every_iteration=true"],
         "runner.stagger_episodes=True: needs runner.reset_every_iteration=false"),
        ("stagger_without_clocks", TRAIN, ["runner.stagger_episodes=true",
                                           "runner.reset_every_iteration=false"],
         "runner.stagger_episodes=True: ManiSkill/PushCube-v1 cannot start its episodes"),
        # cluster and placement
        ("backend", TRAIN, ["cluster.backend=mpi"], "cluster.backend"),
        ("context_switch", TRAIN, ["cluster.context_switch=sometimes"], "cluster.context_switch"),
        ("object_store", TRAIN, ["cluster.object_store_memory_mb=10"],
         "cluster.object_store_memory_mb"),
        ("placement_mode", TRAIN, ["cluster.placement.mode=bogus"], "cluster.placement.mode"),
        ("workers_0", TRAIN, ["cluster.placement.components.learner.workers=0"],
         "cluster.placement.components.learner.workers=0"),
        ("learner_workers_not_dividing_env_workers", TRAIN,
         ["cluster.placement.components.learner.workers=2"],
         "cluster.placement.components.learner.workers=2: must divide"),
        ("learner_workers_in_process", TRAIN,
         ["cluster=inprocess", "cluster.placement.components.learner.workers=2",
          "cluster.placement.components.env.workers=2"],
         "cluster.placement.components.learner.workers=2: data-parallel"),
        ("learner_workers_bc", TRAIN,
         ["algorithm=bc", "algorithm.dataset={plain}",
          "cluster.placement.components.learner.workers=2",
          "cluster.placement.components.env.workers=2"],
         "cluster.placement.components.learner.workers=2: algorithm=bc"),
        ("learner_shard", TRAIN, ["cluster.placement.components.learner.shard=zero3"],
         "cluster.placement.components.learner.shard='zero3'"),
        ("unknown_component", TRAIN, ["cluster.placement.components.lerner.cpus=1"],
         "cluster.placement.components.lerner"),
        ("cpus_beyond_node", TRAIN, [f"cluster.placement.components.env.cpus={cores + 1}"],
         "cluster.placement.components.env.cpus"),
        # reasoning
        ("reasoning_n_1", TRAIN, [*REASONING, "rollout.n=1"], "rollout.n=1"),
        ("reasoning_missing_data", TRAIN,
         [*REASONING, "data.source=jsonl", "data.train_path=/nonexistent.jsonl"],
         "data.train_path"),
        ("reasoning_workers_2", TRAIN,
         [*REASONING, "cluster.placement.components.learner.workers=2"],
         "cluster.placement.components.learner.workers=2"),
        ("reasoning_temperature", TRAIN, [*REASONING, "rollout.temperature=0"],
         "rollout.temperature"),
        ("reasoning_max_minutes", TRAIN, [*REASONING, "runner.max_minutes=0"],
         "runner.max_minutes"),
        ("reasoning_tiny_heads", TRAIN, [*REASONING, "model.tiny.num_attention_heads=3"],
         "model.tiny.hidden_size"),
        ("reasoning_kl", TRAIN, [*REASONING, "algorithm.kl_coef=-0.1"], "algorithm.kl_coef"),
        ("reasoning_resume_other_workload", TRAIN, [*REASONING, "resume={other}"], "resume="),
        ("reasoning_cpu_ids", TRAIN,
         [*REASONING, "cluster=reasoning_split_cores",
          f"cluster.placement.components.rollout.cpu_ids=[{max(5, cores)}]"],
         "cluster.placement.components.rollout.cpu_ids"),
        # m2flow-eval
        ("eval_missing_checkpoint", EVAL, ["checkpoint=/nonexistent.pt"], "checkpoint="),
        ("eval_env_typo", EVAL, ["env=libero_spatail"], "libero_spatail"),
        ("eval_episodes_negative", EVAL, ["episodes=-1"], "eval.episodes"),
        ("eval_mlp_on_libero_images", EVAL, ["env=libero_spatial"], "env.obs_mode=rgb"),
        ("eval_max_steps", EVAL, ["max_steps=0"], "eval.max_steps"),
        ("eval_policy_kwargs_gone", EVAL, ["policy.kwargs.critic=privileged"],
         "write policy.critic instead of policy.kwargs.critic"),
    ]


# run as separate processes of the console scripts (exit code, wall time, nothing written)
SEPARATE = ("num_iterations", "gpu_beyond_gpus", "reasoning_n_1", "eval_missing_checkpoint",
            "policy_kwargs_gone")


# (the driver, this file run as a script, imports nothing before its first case)
CASES = {c[0]: c for c in case_table()} if __name__ != "__main__" else {}


@pytest.fixture(scope="module")
def all_cases(tmp_path_factory) -> dict:
    """CASES with the input files written and their paths filled in."""
    paths = write_inputs(tmp_path_factory.mktemp("bad_input"))
    out = {}
    for cid, prog, argv, fragment in CASES.values():
        for key, path in paths.items():
            argv = [a.replace(key, path) for a in argv]
        out[cid] = (cid, prog, argv, fragment)
    return out


@pytest.fixture(scope="module")
def driven(all_cases, tmp_path_factory) -> dict:
    """Every case run in one driver process (cwd: an empty folder); results by id."""
    cwd = tmp_path_factory.mktemp("driver_cwd")
    spec = [[cid, prog, argv] for cid, prog, argv, _ in all_cases.values()]
    out = cwd.parent / "driver_results.json"
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(out)], input=json.dumps(spec),
        cwd=cwd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(cwd.iterdir()) == [], "a malformed config wrote into the working folder"
    return json.loads(out.read_text())


@pytest.mark.parametrize("cid", list(CASES))
def test_malformed_config_is_one_line_exit_2_before_ray(cid, all_cases, driven):
    _, prog, argv, fragment = all_cases[cid]
    r = driven[cid]
    assert r["exception"] is None, f"{prog} {' '.join(argv)} raised:\n{r['exception']}"
    assert r["code"] == 2, f"{prog} {' '.join(argv)}: exit code {r['code']}, stderr {r['stderr']}"
    lines = [line for line in r["stderr"].splitlines() if line.strip()]
    assert len(lines) == 1, f"{prog} {' '.join(argv)}: stderr is not one line:\n{r['stderr']}"
    assert lines[0].startswith(f"{prog}: config error: ") and fragment in lines[0], lines[0]
    assert not r["ray_started"], f"{prog} {' '.join(argv)} started Ray"


@pytest.mark.parametrize("cid", SEPARATE)
def test_console_script_exits_2_with_one_line_before_starting_anything(cid, all_cases, tmp_path):
    _, prog, argv, fragment = all_cases[cid]
    script = Path(sys.executable).parent / prog
    cmd = [str(script), *argv] if script.exists() else [
        sys.executable, "-c", f"import sys; from m2flow.cli.{_entry(prog)} import main as f; "
                              "sys.argv[0] = 'x'; sys.exit(f())", *argv]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: config error: "), proc.stderr
    assert fragment in lines[0], lines[0]
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == [], "nothing may be written before the config is checked"


def test_behaviour_clonings_minibatches_are_checked_against_its_dataset_batch_not_the_envs():
    """BC's update draws ``algorithm.batch_size`` dataset rows; its env collection only logs,
    so one env may feed 4 minibatches (refused before: 1 sample collected < 4)."""
    from m2flow.cli.common import load_run_config
    from m2flow.configs import ConfigError
    from m2flow.embodied import checks as embodied_checks

    cfg = load_run_config("maniskill_pickcube_bc_mlp", ["env.num_envs=1",
                                                       "algorithm.num_minibatches=4"])
    embodied_checks.check_config(cfg)
    with pytest.raises(ConfigError, match="must be <= the 2 samples an update trains on "
                                          r"\(env.num_envs x env workers x runner.rollout_steps"):
        load_run_config("maniskill_pickcube_ppo_mlp", ["env.num_envs=1", "runner.rollout_steps=2",
                                                       "algorithm.num_minibatches=4"])


def test_the_checks_know_the_runners_components():
    from m2flow.embodied import checks as embodied_checks
    from m2flow.embodied.runner import COMPONENTS as EMBODIED
    from m2flow.reasoning import checks as reasoning_checks
    from m2flow.reasoning.runner import COMPONENTS as REASONING_COMPONENTS

    assert embodied_checks.COMPONENTS == EMBODIED
    assert reasoning_checks.COMPONENTS == REASONING_COMPONENTS


@pytest.mark.parametrize("workload, config", [("embodied", "maniskill_pushcube_ppo_mlp"),
                                              ("reasoning", "reasoning_arith_grpo_tiny")])
def test_a_placed_component_the_workload_lacks_is_named_with_a_suggestion(workload, config):
    """(A cluster group listing 'lerner'; the command line cannot add a key to the group.)"""
    from m2flow.cli.common import load_run_config
    from m2flow.cli.workloads import workload as workload_of
    from m2flow.pipelines import ComponentPlacement

    cfg = load_run_config(config, ["runner.num_steps=1"] if workload == "reasoning" else [])
    cfg.cluster.placement.components["lerner"] = ComponentPlacement(cpus=1)
    with pytest.raises(ValueError) as e:  # the CLI prints it as its one config-error line
        workload_of(workload).check(cfg)
    assert str(e.value).startswith("config error: cluster.placement.components.lerner: ")
    assert "Did you mean 'learner'?" in str(e.value)


def _entry(prog: str) -> str:
    return {TRAIN: "train", EVAL: "eval"}[prog]


def _drive(out: Path) -> None:
    """The driver: reads [[id, program, argv], ...] from stdin, runs each in this process,
    writes {id: {code, stderr, seconds, ray_started, exception}} to ``out``."""
    import importlib

    results = {}
    for cid, prog, argv in json.loads(sys.stdin.read()):
        err, code, exc = io.StringIO(), None, None
        t0 = time.perf_counter()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = importlib.import_module(f"m2flow.cli.{_entry(prog)}").main(list(argv))
            except SystemExit as e:  # argparse
                code = e.code
            except BaseException:  # noqa: BLE001 - reported by the test, with its traceback
                exc = traceback.format_exc()
        seconds = time.perf_counter() - t0
        ray = sys.modules.get("ray")
        results[cid] = {"code": code, "stderr": err.getvalue(), "seconds": seconds,
                        "ray_started": bool(ray is not None and ray.is_initialized()),
                        "exception": exc}
        if ray is not None and ray.is_initialized():
            ray.shutdown()
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    _drive(Path(sys.argv[1]))
