"""The planner's pure core: cost-model fits, the contention rule, the search on hand-built
graphs whose best plan is known, refusals, and the plan file composing into a config."""

import math

import pytest

from m2flow.embodied.graph import graph as embodied_graph
from m2flow.pipelines.planner.costmodel import fit_memory, fit_time
from m2flow.pipelines.planner.graph import ComponentSpec, Graph, Phase
from m2flow.pipelines.planner.planfile import read_plan_file, write_plan_file
from m2flow.pipelines.planner.profiles import Memory, Node, Profile, Timing
from m2flow.pipelines.planner.calibration import models_for
from m2flow.pipelines.planner.search import Block, PlanError, makespan, predict, search

SIM_S = 0.010  # CPU seconds of one env step in its own process


def profile(node, *, infer_per_item=0.001, infer_fixed=0.0, infer_threads_help=False,
            learn=0.2, sizes=(2, 4, 8, 16), gpu_infer=None, gpu_learn=None, reset_s=0.0):
    """A synthetic embodied profile: simulators one process per env, inference linear in
    the batch (on one thread; more threads help only with ``infer_threads_help``)."""
    p = Profile("embodied", node)
    counts = sorted({1, node.cores})
    for n in sizes:
        for c in counts:
            p.add_time("env", "step", size=n, cores=c, seconds=0.001 + SIM_S * n / min(c, n))
            p.add_time("env", "reset", size=n, cores=c, seconds=reset_s * n / min(c, n))
            speed = c if infer_threads_help else 1
            p.add_time("rollout", "infer", size=n, cores=c,
                       seconds=infer_fixed + infer_per_item * n / speed)
            if gpu_infer is not None:
                p.add_time("rollout", "infer", size=n, cores=0, seconds=gpu_infer * n,
                           device="cuda")
    for c in counts:
        p.add_time("learner", "learn", size=800, cores=c, seconds=learn)
    if gpu_learn is not None:
        p.add_time("learner", "learn", size=800, cores=0, seconds=gpu_learn, device="cuda")
    p.add_memory("env", size=2, mb=400)
    p.add_memory("env", size=16, mb=1800)
    p.add_memory("learner", size=800, mb=500)
    return p


FACTS = {"total_envs": 16, "rollout_steps": 50, "chunk": 1, "group": 1}


def test_time_fit_recovers_lines_per_core_count_and_amdahl_between():
    ts = [Timing("rollout", "infer", x, c, 0.002 + 0.001 * x / c) for x in (2, 8, 16)
          for c in (1, 8)]
    m = fit_time(ts)
    assert m.fit_error < 1e-6
    assert m.seconds(32, 1) == pytest.approx(0.002 + 0.032)
    assert m.seconds(32, 8) == pytest.approx(0.002 + 0.004)
    assert m.seconds(32, 4) == pytest.approx(0.002 + 0.008)  # between: S + P/c
    assert m.work(32) == pytest.approx(0.034)


def test_time_fit_of_one_process_per_item_caps_cores_at_the_size():
    p = profile(Node(cores=4))
    m = models_for(p, embodied_graph(FACTS))
    step = m.time_model("env", "step")
    assert step.seconds(2, 4) == pytest.approx(0.001 + SIM_S)  # 2 envs use 2 of the cores
    assert step.seconds(12, 4) == pytest.approx(0.001 + 3 * SIM_S)
    assert step.seconds(12, 3) == pytest.approx(0.001 + 4 * SIM_S)  # a core count not measured


def test_a_slower_multi_thread_measurement_is_kept_not_forced_faster():
    ts = [Timing("rollout", "infer", x, c, 0.001 * x * (1 if c == 1 else 3)) for x in (2, 8)
          for c in (1, 2)]
    m = fit_time(ts)
    assert m.seconds(8, 2) == pytest.approx(0.024) and m.seconds(8, 1) == pytest.approx(0.008)


def test_memory_fit_is_linear_in_size():
    m = fit_memory([Memory("env", 2, 400), Memory("env", 16, 1800)])
    assert m.mb(8) == pytest.approx(1000)


def test_makespan_adds_the_cpu_work_of_activities_sharing_cores():
    cores = frozenset({0, 1})
    sim = Block(wall=1.0, work=2.0, cpus=cores)  # fills both cores
    learner = Block(wall=0.5, work=1.0, cpus=cores)
    assert makespan([sim, learner]) == pytest.approx(1.5)  # nothing to overlap
    apart = Block(wall=1.0, work=1.0, cpus=frozenset({0}))
    other = Block(wall=0.8, work=0.8, cpus=frozenset({1}))
    assert makespan([apart, other]) == pytest.approx(1.0)  # own cores: the longer one


def test_simulators_filling_the_cores_and_a_tiny_policy_give_the_plain_plan():
    node = Node(cores=2)
    g = embodied_graph(FACTS)
    preds = search(g, models_for(profile(node, infer_per_item=1e-5), g), node)
    best = preds[0]
    assert (best.plan.stages, best.plan.overlap, best.plan.workers) == (1, False, 1)
    # one step of 16 envs on 2 cores, inference on one thread, 50 steps, then the update
    per_step = 0.001 + SIM_S * 8 + 1e-5 * 16
    assert best.iteration_s == pytest.approx(50 * per_step + 0.2, rel=1e-6)
    fastest = min(p.iteration_s for p in preds if p.feasible)
    assert best.iteration_s <= fastest * 1.1  # what overlap might save is not worth staleness


def test_inference_as_slow_as_simulation_on_cores_of_its_own_pipelines():
    """Env on core 0 (8 ms of sim per step for 8 envs), rollout on core 1 (8 ms per 8
    observations): with S=2 the two overlap and a step costs about one of them."""
    node = Node(cores=2)
    facts = dict(FACTS, total_envs=8)
    g = embodied_graph(facts)
    p = profile(node, infer_per_item=SIM_S, sizes=(2, 4, 8))
    preds = {pr.plan.label(): pr for pr in search(g, models_for(p, g), node) if pr.feasible}
    split = "hybrid: env core 0, rollout core 1, learner any core 2t; "
    seq, piped = preds[split + "S=1"], preds[split + "S=2"]
    assert seq.breakdown["loop"] == pytest.approx(50 * (0.081 + 0.080))
    # per step: the env worker's two stages one after another (2 x 41 ms) bound it
    assert piped.breakdown["loop"] == pytest.approx(50 * 2 * (0.001 + 4 * SIM_S))
    assert piped.iteration_s < seq.iteration_s


def gpu_inference_profile(node, *, per_call: float, per_item: float) -> Profile:
    """16 env processes of 4 ms a step on 4 cores; inference on the GPU at each stage's batch
    size (4, 8, 16: the profiler's ``sizes_of``), ``per_call + per_item x batch`` seconds."""
    p = Profile("embodied", node)
    for n in (4, 8, 16):
        for c in (1, node.cores):
            p.add_time("env", "step", size=n, cores=c, seconds=0.004 * n / min(c, n))
            p.add_time("env", "reset", size=n, cores=c, seconds=0.0)
            p.add_time("rollout", "infer", size=n, cores=c, seconds=0.1 * n)
        p.add_time("rollout", "infer", size=n, cores=0, seconds=per_call + per_item * n,
                   device="cuda")
    for c in (1, node.cores):
        p.add_time("learner", "learn", size=800, cores=c, seconds=5.0)
    p.add_time("learner", "learn", size=800, cores=0, seconds=0.2, device="cuda")
    p.add_memory("env", size=4, mb=400)
    p.add_memory("env", size=16, mb=1800)
    p.add_memory("learner", size=800, mb=500)
    return p


def test_launch_bound_gpu_inference_keeps_one_stage():
    """A small policy on a GPU costs about the same per call at any batch (kernel launches,
    the H100 run of 2026-11-25), so S stages call it S times a step: one stage wins. Where
    inference scales with the batch, S=2 halves the step. Hand-worked, 50 steps + 0.2 s."""
    node = Node(cores=4, gpus=1, gpu_memory_mb=80_000)
    g = embodied_graph(FACTS)
    one = "collocated: env any core, rollout gpu0, learner gpu0; S="

    launch = search(g, models_for(gpu_inference_profile(node, per_call=0.020, per_item=0), g),
                    node)
    by = {p.plan.label(g): p for p in launch if p.feasible}
    assert by[one + "1"].breakdown["loop"] == pytest.approx(50 * (0.016 + 0.020))  # sim, infer
    assert by[one + "2"].breakdown["loop"] == pytest.approx(50 * 2 * 0.020)  # 2 calls a step
    assert by[one + "4"].breakdown["loop"] == pytest.approx(50 * 4 * 0.020)
    assert launch[0].plan.stages == 1
    assert launch[0].iteration_s == pytest.approx(50 * 0.036 + 0.2)

    batch = search(g, models_for(gpu_inference_profile(node, per_call=0, per_item=0.001), g),
                   node)
    by = {p.plan.label(g): p for p in batch if p.feasible}
    assert by[one + "1"].breakdown["loop"] == pytest.approx(50 * (0.016 + 0.016))
    assert by[one + "2"].breakdown["loop"] == pytest.approx(50 * 0.016)  # the two overlap
    assert batch[0].iteration_s == pytest.approx(50 * 0.016 + 0.2)


def test_resets_of_every_stage_start_at_once_for_envs_in_processes():
    """4 env processes, 0.5 CPU-s per reset: on 2 cores they reset in 1 s at any stage
    count (the env worker starts every group's reset before it waits for any); one after
    another, 4 stages of one env would take 4 x 0.5 s. On one core: 2 s either way."""
    node = Node(cores=2)
    g = embodied_graph(dict(FACTS, total_envs=4))
    p = profile(node, sizes=(1, 2, 4), reset_s=0.5)
    preds = {pr.plan.label(g): pr for pr in search(g, models_for(p, g), node) if pr.feasible}
    for s in (1, 2, 4):
        both = preds[f"collocated: env any core, rollout any core 1t, learner any core 1t; S={s}"]
        assert both.breakdown["before"] == pytest.approx(1.0)
        one = preds[f"hybrid: env core 0, rollout core 1, learner any core 1t; S={s}"]
        assert one.breakdown["before"] == pytest.approx(2.0)


def test_learner_overlap_pays_on_a_gpu_of_its_own_not_on_shared_cores():
    g = embodied_graph(FACTS)
    cpu = Node(cores=2)
    best_cpu = search(g, models_for(profile(cpu, learn=1.0), g), cpu)[0]
    assert not best_cpu.plan.overlap
    gpus = Node(cores=8, gpus=2, gpu_memory_mb=80_000)
    p = profile(gpus, learn=30.0, gpu_infer=0.0001, gpu_learn=2.0)
    best = search(g, models_for(p, g), gpus)[0]
    assert best.plan.overlap
    assert best.plan.placement("learner").gpus != best.plan.placement("rollout").gpus


def test_a_plan_needing_a_device_the_profile_never_measured_is_infeasible_with_why():
    node = Node(cores=4, gpus=1)
    g = embodied_graph(FACTS)
    preds = search(g, models_for(profile(node), g), node)
    gpu = [p for p in preds if p.plan.placement("rollout").gpus]
    assert gpu and all(not p.feasible for p in gpu)
    assert "the profile has no timings of learner.learn on cuda" in gpu[0].infeasible


def test_infeasible_resources_are_refused_with_a_clear_message():
    g = embodied_graph(FACTS)
    small = Node(cores=2, memory_mb=1000)
    with pytest.raises(PlanError, match=r"no plan of the embodied workload fits this node "
                                        r"\(2 cores, 0 GPUs, 1.0 GB\).*host memory"):
        search(g, models_for(profile(small), g), small)
    with pytest.raises(PlanError, match="offers 0 CPU cores"):
        search(g, models_for(profile(Node(cores=1)), g), Node(cores=0))
    preds = search(g, models_for(profile(Node(cores=2)), g), Node(cores=2))
    disagg = [p for p in preds if p.plan.mode == "disaggregated"]
    assert disagg and all("add up to 3 > 2 cores" in p.infeasible for p in disagg
                          if p.plan.workers == 1)


def test_a_reset_group_that_does_not_split_over_workers_is_refused():
    g = embodied_graph(dict(FACTS, total_envs=4, group=4))
    node = Node(cores=2)
    preds = search(g, models_for(profile(node, sizes=(1, 2, 4)), g), node)
    two = next(p for p in preds if p.plan.workers == 2)
    assert "not a multiple of the group of 4" in two.infeasible


def test_a_chain_streams_the_update_when_rollout_and_learner_have_own_cores():
    """Reasoning's shape: generate -> score per call; disaggregated, the learner consumes
    each call's completions as they come, so its time hides behind generation."""
    g = Graph(workload="reasoning",
              components=(ComponentSpec("rollout"), ComponentSpec("reward", threads=False),
                          ComponentSpec("learner")),
              loop=(Phase("rollout", "generate"), Phase("reward", "score")), cycle=False,
              rounds=1, items=64, train=Phase("learner", "learn"), samples=64,
              steps_per_iteration=64, pinned=("rollout", "learner"), stages=(1, 4),
              stream_train=True)
    node = Node(cores=2)
    p = Profile("reasoning", node)
    for x in (16, 64):
        for c in (1, 2):
            p.add_time("rollout", "generate", size=x, cores=c, seconds=0.01 * x)
            p.add_time("reward", "score", size=x, cores=c, seconds=0.0001 * x)
    for c in (1, 2):
        p.add_time("learner", "learn", size=64, cores=c, seconds=0.5)
    best = search(g, models_for(p, g), node)[0]
    assert best.plan.mode == "hybrid" and best.plan.stages == 4
    assert best.iteration_s == pytest.approx(0.64 + 0.0016 + 0.125, rel=1e-3)


def test_the_plan_file_round_trips_into_a_config_that_composes(tmp_path):
    from m2flow.cli.common import load_run_config

    node = Node(cores=2, memory_mb=24_000)
    g = embodied_graph(dict(FACTS, total_envs=4))
    p = profile(node, infer_per_item=SIM_S, sizes=(1, 2, 4))
    preds = search(g, models_for(p, g), node)
    best = next(pr for pr in preds if pr.feasible and pr.plan.mode == "hybrid"
                and pr.plan.stages == 2)
    path = write_plan_file(tmp_path / "plan.yaml", best,
                           config_name="maniskill_pushcube_ppo_mlp", workload="embodied",
                           node=node, knob_overrides=g.knob_overrides(best.plan),
                           label=best.plan.label())
    assert read_plan_file(path).predicted["iteration_s"] == \
        pytest.approx(best.iteration_s, rel=1e-3)
    cfg = load_run_config("maniskill_pushcube_ppo_mlp", [f"cluster.plan={path}"])
    comps = cfg.cluster.placement.components
    assert cfg.cluster.placement.mode == "hybrid" and cfg.cluster.backend == "ray"
    assert comps["env"].cpu_ids == [0] and comps["rollout"].cpu_ids == [1]
    assert (cfg.env.num_envs, cfg.staging.pipeline_stages) == (4, 2)
    assert cfg.runner.overlap_learner is best.plan.overlap
    # the command line's own overrides still win over the plan's
    cfg = load_run_config("maniskill_pushcube_ppo_mlp",
                          [f"cluster.plan={path}", "staging.pipeline_stages=1"])
    assert cfg.staging.pipeline_stages == 1


def test_a_profile_survives_json():
    p = profile(Node(cores=2, memory_mb=math.inf))
    q = Profile.from_json(p.to_json())
    assert q.timings == p.timings and q.memory == p.memory and q.node == p.node


def test_a_calibration_run_adds_what_the_components_miss_to_every_plan():
    from m2flow.cli.common import load_run_config
    from m2flow.pipelines.planner.calibration import calibration

    node = Node(cores=2)
    g = embodied_graph(FACTS)
    p = profile(node)
    plain = {pr.plan.label(g): pr.iteration_s for pr in search(g, models_for(p, g), node)
             if pr.feasible}
    cfg = load_run_config("maniskill_pushcube_ppo_mlp")  # cluster=local: collocated
    p.facts["calibration"] = calibration(cfg.cluster, g, [(1, False, 0.0)])
    models = models_for(p, g)
    assert models.overhead_s == 0.0  # measured faster than predicted: nothing to add
    label = "collocated: env any core, rollout any core 1t, learner any core 2t; S=1"
    p.facts["calibration"] = calibration(cfg.cluster, g, [
        (1, False, plain[label] + 0.5), (1, True, plain[label + " overlap"] + 0.1)])
    calibrated = {pr.plan.label(g): pr for pr in search(g, models_for(p, g), node)
                  if pr.feasible}
    assert calibrated[label].iteration_s == pytest.approx(plain[label] + 0.5)
    assert calibrated[label].breakdown["overhead"] == pytest.approx(0.5)
    for k, v in plain.items():  # overlapped plans hide part of it: their own run says how much
        assert calibrated[k].iteration_s == pytest.approx(v + (0.1 if "overlap" in k else 0.5))


def test_the_updates_time_inside_a_calibration_run_corrects_the_update_at_its_threads():
    """The config's learner has 2 threads; inside the real run its update took 0.5 s where
    the profile timed 0.2 s alone (threads on shared cores): the update at 2 threads is
    predicted at 0.5 s in every plan, the 1-thread update keeps its profiled 0.2 s, and only
    what is still missing becomes the per-iteration overhead (a constant overhead of 0.3 s
    would have slowed the 1-thread plans as much)."""
    from m2flow.cli.common import load_run_config
    from m2flow.pipelines.planner.calibration import calibration

    node = Node(cores=2)
    g = embodied_graph(FACTS)
    p = profile(node, learn=0.2)
    label = "collocated: env any core, rollout any core 1t, learner any core 2t; S=1"
    one_thread = label.replace("learner any core 2t", "learner any core 1t")
    plain = {pr.plan.label(g): pr for pr in search(g, models_for(p, g), node) if pr.feasible}
    assert plain[label].busy["learner"] == pytest.approx(0.2)
    # cluster=local with its learner on 2 cores (the default job gives its MLP's learner one)
    cfg = load_run_config("maniskill_pushcube_ppo_mlp",
                          ["cluster.placement.components.learner.cpus=2"])
    measured = plain[label].iteration_s + 0.3 + 0.1  # 0.3 s slower update, 0.1 s framework
    p.facts["calibration"] = calibration(cfg.cluster, g, [
        (1, False, measured, [measured], {"learner_learn": 0.5, "env_step": 1.0})])
    models = models_for(p, g)
    assert models.in_situ == {("learner", "learn", 2.0): pytest.approx(2.5)}
    assert models.overhead_s == pytest.approx(0.1)
    calibrated = {pr.plan.label(g): pr for pr in search(g, models, node) if pr.feasible}
    assert calibrated[label].busy["learner"] == pytest.approx(0.5)
    assert calibrated[label].iteration_s == pytest.approx(measured)
    assert calibrated[one_thread].busy["learner"] == pytest.approx(0.2)
    assert calibrated[one_thread].iteration_s == pytest.approx(
        plain[one_thread].iteration_s + 0.1)


def test_on_a_predicted_tie_the_plan_pinning_more_components_is_chosen():
    """Equal predictions (the model has no term for what pinning saves): the hybrid plan,
    its loop components on cores of their own, goes first; fewer stages still come before
    pinning, and a pinned plan more than 2 % slower is not taken."""
    from m2flow.pipelines.placement import ComponentPlacement as C
    from m2flow.pipelines.planner.search import Plan, Prediction, _chosen_first

    def pred(mode, pinned, stages, s):
        env, rollout = ((C(cpu_ids=[0], cpus=1), C(cpu_ids=[1], cpus=1)) if pinned
                        else (C(cpus=2), C(cpus=1)))
        plan = Plan(mode, (("env", env), ("rollout", rollout), ("learner", C(cpus=1))),
                    stages=stages, overlap=True)
        return Prediction(plan, iteration_s=s)

    floating = pred("collocated", False, 1, 3.104)
    pinned = pred("hybrid", True, 1, 3.104)
    staged = pred("hybrid", True, 2, 3.050)
    assert _chosen_first([floating, pinned])[0] is pinned
    assert _chosen_first([staged, floating, pinned])[0] is pinned
    assert _chosen_first([staged, floating])[0] is floating  # S=1 before pinning
    slower = pred("hybrid", True, 1, 3.104 * 1.03)
    assert _chosen_first([floating, slower])[0] is floating


def test_a_run_drifting_from_its_prediction_re_plans_its_stages():
    """Planned with a tiny policy (S=1 on split cores), the run finds inference as slow as
    simulation: its measured component times make S=2 the better plan, and the watch
    switches to it once the median of three iterations drifts past 20 %."""
    from m2flow.pipelines.placement import ComponentPlacement as C
    from m2flow.pipelines.planner.monitor import PlanMonitor
    from m2flow.pipelines.planner.search import Plan

    node = Node(cores=2)
    g = embodied_graph(dict(FACTS, total_envs=8))
    models = models_for(profile(node, infer_per_item=1e-5, sizes=(2, 4, 8)), g)
    plan = Plan("hybrid", (("env", C(cpu_ids=[0], cpus=1)), ("rollout", C(cpu_ids=[1], cpus=1)),
                           ("learner", C(cpus=2))), stages=1)
    pred = predict(plan, g, models, node)
    switched = []
    watch = PlanMonitor(pred.iteration_s, replan=(models, g, node, plan, [1, 2, 4]),
                        timers={"env": "sim", "rollout": "infer", "learner": "learn"})
    infer = 0.080  # per step of 8 envs, where 0.08 ms was predicted
    seen = {"perf/iteration_s": 50 * (0.081 + infer) + 0.2, "time/env_sim": 50 * 0.081,
            "time/rollout_infer": 50 * infer, "time/learner_learn": 0.2}
    lines = []
    for _ in range(3):
        out = watch.observe(seen, switched.append, lines.append)
    assert out["plan/drift"] > 0.2
    assert switched == [2]
    assert "S 1 -> 2" in lines[-1] and "rollout x" in lines[-1]
    assert watch.predicted < seen["perf/iteration_s"] * 0.8  # the new plan's prediction


def test_a_reasoning_plan_composes_with_a_component_its_cluster_option_lacks(tmp_path):
    """cluster=local lists no reward worker; the plan's placement is merged, not overridden."""
    from m2flow.cli.common import load_run_config
    from m2flow.reasoning.graph import graph as reasoning_graph

    node = Node(cores=2)
    g = reasoning_graph({"prompts_per_step": 32, "n": 8})
    p = Profile("reasoning", node)
    for x in (64, 256):
        for c in (1, 2):
            p.add_time("rollout", "generate", size=x, cores=c, seconds=0.004 * x)
            p.add_time("reward", "score", size=x, cores=c, seconds=1e-5 * x)
    for c in (1, 2):
        p.add_time("learner", "learn", size=256, cores=c, seconds=0.6)
    best = search(g, models_for(p, g), node)[0]
    assert best.plan.mode == "hybrid" and best.plan.stages > 1  # streamed, in calls
    path = write_plan_file(tmp_path / "r.yaml", best, config_name="reasoning_arith_grpo_tiny",
                           workload="reasoning", node=node,
                           knob_overrides=g.knob_overrides(best.plan), label=best.plan.label(g))
    cfg = load_run_config("reasoning_arith_grpo_tiny", [f"cluster.plan={path}"])
    comps = cfg.cluster.placement.components
    assert {"rollout", "reward", "learner"} <= set(comps)  # (env: the option is shared)
    assert comps["rollout"].cpu_ids == [0] and comps["learner"].cpu_ids == [1]
    assert cfg.rollout.prompts_per_call == 32 // best.plan.stages
