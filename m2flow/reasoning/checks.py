"""Start-up checks of a reasoning config: every mistake is one line naming the field, the
value and the fix, before any worker starts.

In order: names (engine, reward, data source, dtype), the libraries they need (``pip install
'm2flow[reasoning]'`` adds them), the ranges of each settings group's fields (checked by its
class's ``validate()``, then the ``runner`` fields every workload shares and ``seed``) and
the tiny model's shape, paths (model directory, data files, ``resume``,
``eval.checkpoint``), and the cluster and its placement on this machine (one worker per
component; pipelined modes need rollout and learner on different devices).
"""

from __future__ import annotations

from pathlib import Path

from m2flow.configs import ConfigError
from m2flow.fields import field_error
from m2flow.reasoning.config import ReasoningConfig
from m2flow.registry import Requires
from m2flow.runs.checks import check_cluster_config, check_file, check_resume, check_runner_base

COMPONENTS = ("rollout", "reward", "learner")  # the runner's (m2flow.reasoning.runner.COMPONENTS)
UNUSED_COMPONENTS = ("env",)  # the shared cluster groups (local, inprocess) also place an env
DATA_SOURCES = ("arithmetic", "jsonl", "parquet")
FILE_SOURCES = ("jsonl", "parquet")


def check_reasoning_config(cfg: ReasoningConfig) -> None:
    """Names, ranges, paths and placement of ``cfg``; raises a one-line ValueError
    (``m2flow.cli.common`` prints it as the config error)."""
    check_names(cfg)
    check_installed(cfg)
    for group in (cfg.data, cfg.model.tiny, cfg.rollout, cfg.algorithm, cfg.warm_start,
                  cfg.runner, cfg.eval):
        group.validate()
    check_runner_base(cfg)
    check_tiny_model(cfg)
    check_paths(cfg)
    check_placement(cfg)


def check_names(cfg: ReasoningConfig) -> None:
    """Engine, reward, data source, dtype and tiny architecture names."""
    from m2flow.reasoning.engine import ENGINES
    from m2flow.reasoning.model import ARCHITECTURES
    from m2flow.reasoning.reward import REWARDS

    checks = [
        ("rollout.engine", cfg.rollout.engine, sorted(ENGINES)),
        ("algorithm.reward", cfg.algorithm.reward, sorted(REWARDS)),
        ("data.source", cfg.data.source, list(DATA_SOURCES)),
        ("model.dtype", cfg.model.dtype, ["auto", "float32", "bfloat16", "float16"]),
        ("model.tiny.architecture", cfg.model.tiny.architecture, list(ARCHITECTURES)),
    ]
    for field, value, known in checks:
        if value not in known:
            raise ConfigError(f"config error: {field}={value!r} is not one of {known}.")


def check_installed(cfg: ReasoningConfig) -> None:
    """The libraries the run imports beyond m2flow's own: transformers (model, tokenizer,
    generation) always, math-verify for its reward, pyarrow for a Parquet data file."""
    d = cfg.data
    parquet = d.source in FILE_SOURCES and any(
        str(p).endswith(".parquet") for p in (d.train_path, d.test_path) if p)
    needs = [("the reasoning workload", ("transformers",), True),
             ("algorithm.reward=math_verify", ("math_verify",),
              cfg.algorithm.reward == "math_verify"),
             ("a .parquet data file", ("pyarrow",), parquet)]
    for what, modules, used in needs:
        if used:
            Requires(modules, "m2flow[reasoning]").check(
                what, lambda line: ConfigError(f"config error: {line}"))


def check_tiny_model(cfg: ReasoningConfig) -> None:
    """The tiny preset's attention heads divide its width (when no model.path is given)."""
    t = cfg.model.tiny
    if cfg.model.path is not None:
        return
    if t.hidden_size % t.num_attention_heads:
        raise field_error("model.tiny.hidden_size", t.hidden_size,
                          f"must be a multiple of model.tiny.num_attention_heads="
                          f"{t.num_attention_heads}.")
    if t.num_attention_heads % t.num_key_value_heads:
        raise field_error("model.tiny.num_attention_heads", t.num_attention_heads,
                          f"must be a multiple of model.tiny.num_key_value_heads="
                          f"{t.num_key_value_heads}.")


def check_paths(cfg: ReasoningConfig) -> None:
    """The model directory, data files, ``eval.checkpoint`` and ``resume``."""
    model = cfg.model.path
    if model is not None and not (Path(model).expanduser() / "config.json").is_file():
        raise ConfigError(
            f"config error: model.path={cfg.model.path!r} is not a local Hugging Face model "
            "directory (no config.json there); point it at one, or set model.path=null for "
            "the tiny preset."
        )
    d = cfg.data
    if d.source in FILE_SOURCES:
        if not d.train_path:
            raise field_error("data.train_path", d.train_path,
                              f"data.source={d.source} reads a local file; give its path.")
        unit = "line" if d.source == "jsonl" else "row"
        fix = f"give a local {d.source} file (one problem per {unit})"
        for field in ("data.train_path", "data.test_path"):
            path = getattr(d, field.split(".")[1])
            check_file(field, path, fix)
    if cfg.eval.checkpoint is not None:  # m2flow-eval: resume is its run's, not read
        check_file("eval.checkpoint", cfg.eval.checkpoint,
                   "give a .pt written by m2flow-train for a reasoning config")
    else:
        check_resume(cfg.resume, "reasoning")


def check_placement(cfg: ReasoningConfig) -> None:
    """Placement on this machine; one worker per component; pipelined modes (anything but
    collocated) need rollout and learner on different devices."""
    from m2flow.pipelines import offloads_for

    for name in COMPONENTS:
        comp = cfg.cluster.placement.components.get(name)
        if comp is not None and comp.workers != 1:
            raise field_error(f"cluster.placement.components.{name}.workers", comp.workers,
                              "the reasoning runner uses one rank per component; set it to 1.")
    placement = check_cluster_config(cfg.cluster, COMPONENTS, UNUSED_COMPONENTS)
    if cfg.cluster.weight_sync == "dist":
        raise field_error("cluster.weight_sync", "dist",
                          "the reasoning runner sends weights to its one rollout rank as Ray "
                          "objects; set cluster.weight_sync=auto (or ray).")
    if placement is None or placement.mode == "collocated":
        return
    offloads = offloads_for(placement.shares_device, ["rollout", "learner"],
                            cfg.cluster.context_switch)
    if any(offloads.values()):
        raise ConfigError(
            f"config error: cluster.placement.mode={placement.mode} runs rollout and learner at "
            "the same time, but they share a GPU (or cluster.context_switch=always asks them to "
            "take turns); give them disjoint gpus or set cluster.placement.mode=collocated."
        )


def memory_hint(cfg: ReasoningConfig) -> str:
    """The fields that size a reasoning run's memory, with their values: the fix an
    out-of-memory line gives (``m2flow.runs.session.RunOutOfMemory``).

    >>> from m2flow.cli.common import load_run_config
    >>> memory_hint(load_run_config("reasoning_arith_grpo_tiny", []))  # doctest: +ELLIPSIS
    'lower algorithm.micro_batch_size (now ...) or algorithm.prompts_per_step x rollout.n (now ... x ... completions a step)'
    """
    a = cfg.algorithm
    return (f"lower algorithm.micro_batch_size (now {a.micro_batch_size}) or "
            f"algorithm.prompts_per_step x rollout.n (now {a.prompts_per_step} x {cfg.rollout.n} "
            "completions a step)")
