"""The reasoning workload as the planner's component graph: each generate call's
completions go rollout -> reward (a chain), then the GRPO update, on the step's batch after
the chain (collocated) or streamed as groups arrive (rollout and learner on their own
devices), then the weight sync.

What a plan sets: the placement (``cluster`` keys) and the generate calls per step
(``rollout.prompts_per_call``), the reasoning runner's pipeline granularity.

>>> g = graph({"prompts_per_step": 32, "n": 8})
>>> g.items, g.stages, g.knob_overrides(search_plan(stages=4))
(256, (1, 2, 4, 8), ['rollout.prompts_per_call=8'])
"""

from __future__ import annotations

from typing import Any, Mapping

from m2flow.pipelines.planner.graph import ComponentSpec, Graph, Phase

CALLS = (1, 2, 4, 8)
"""Generate calls per step the search tries (each streams its groups on as it returns)."""


def facts(cfg, param_mb: float) -> dict[str, Any]:
    """What the graph needs from a reasoning config (``ReasoningConfig``)."""
    return {"prompts_per_step": cfg.algorithm.prompts_per_step, "n": cfg.rollout.n,
            "param_mb": param_mb}


def graph(f: Mapping[str, Any]) -> Graph:
    """The component graph of a reasoning run with facts ``f`` (see :func:`facts`)."""
    prompts, n = int(f["prompts_per_step"]), int(f["n"])

    def knobs(plan, elastic: bool = False) -> list[str]:
        return [f"rollout.prompts_per_call={prompts // plan.stages}"]

    return Graph(
        workload="reasoning",
        components=(ComponentSpec("rollout", gpu=True),
                    ComponentSpec("reward", threads=False),
                    ComponentSpec("learner", gpu=True)),
        loop=(Phase("rollout", "generate"), Phase("reward", "score")),
        cycle=False,
        rounds=1,
        items=prompts * n,
        train=Phase("learner", "learn"),
        samples=prompts * n,
        steps_per_iteration=prompts * n,
        sync=Phase("learner", "sync"),
        sync_size=float(f.get("param_mb", 0.0)),
        switch=(Phase("rollout", "offload"), Phase("learner", "onload"),
                Phase("learner", "offload"), Phase("rollout", "onload")),
        pinned=("rollout", "learner"),
        stages=tuple(k for k in CALLS if prompts % k == 0),
        group=n,
        stream_train=True,
        stages_label="calls",
        item_unit="completion",
        throughput_unit="completions/s",
        knob_overrides=knobs,
    )


def search_plan(stages: int):
    """A bare plan with ``stages`` generate calls (for examples and tests)."""
    from m2flow.pipelines.planner.search import Plan

    return Plan("collocated", (), stages=stages)
