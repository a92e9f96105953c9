"""Does the planner pick the best plan? Every plan of the search space run for real.

Profiles the config's components (or reads ``--profile``), predicts every plan as
``m2flow-plan`` does, then runs every feasible plan for ``--iterations`` real iterations
(collect, update, weight sync; after one warm-up) and prints, fastest measured first:
predicted and measured seconds per iteration and their error. Then a confirmation: the
fastest of 80 plans timed 3 iterations each is as much the luckiest draw as the fastest plan
(one overlapped CNN plan timed 1.13, 6.16, 0.29 s), so the chosen plan and the ``--confirm``
fastest measured ones run again for ``--confirm-iterations`` each. Its last line: the chosen
plan's time against the best one (confirmed; the planner is right if within 10 %), and how
many predictions were within 20 % of what was measured.

Embodied plans that differ only in pipeline stages or learner overlap share one runner (its
env workers built with 4 env groups, so the stage count changes without a restart); every
other plan builds its own, one at a time, in one Ray. ``--rollout-steps`` shortens every
iteration (plans and runs alike), so the whole space fits in a sitting.

    python bench/planner.py --config-name maniskill_pushcube_ppo_mlp
    python bench/planner.py --config-name maniskill_pushcube_ppo_cnn --rollout-steps 16
    python bench/planner.py --config-name X --profile plans/X.profile.json --iterations 2
    python bench/planner.py --limit 2    # the two runner builds of the best predicted plans
    python bench/planner.py --config-name X --from-log LOG --profile P --confirm 3
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import record

from m2flow.cli.common import load_run_config
from m2flow.cli.workloads import planner
from m2flow.pipelines import Cluster
from m2flow.cli.planning import config_of, measure
from m2flow.pipelines.planner.profiles import Profile
from m2flow.pipelines.planner.calibration import models_for
from m2flow.pipelines.planner.search import search

WITHIN_BEST = 0.10  # the bar: the chosen plan within 10 % of the best measured
WITHIN_PREDICTED = 0.20  # and predictions within 20 % of measured


def runs_of(preds, graph, elastic_groups: bool):
    """Feasible plans grouped by what needs a runner of its own: the placement and the env
    workers (embodied: stages and overlap change at run time)."""
    groups: dict[str, list] = {}
    for p in preds:
        if not p.feasible:
            continue
        key = p.plan.label(graph).rsplit(";", 1)[0] if elastic_groups else p.plan.label(graph)
        groups.setdefault(key, []).append(p)
    return groups


def measure_embodied(config, overrides, group, iterations, out):
    """Times each plan of ``group`` (one placement) on one runner into ``out``: its stages
    and overlap are set between measurements, the plans without overlap first (a run can
    start overlapping, but data collected ahead cannot be un-staled)."""
    from m2flow.embodied.runner import EmbodiedRunner

    first = group[0].plan
    cfg = config_of(config, [*overrides, "runner.progress_bar=false"], first, planner_graph,
                    elastic=True)
    runner = EmbodiedRunner(cfg)
    it = 0
    try:
        for pred in sorted(group, key=lambda p: p.plan.overlap):
            runner.drain()
            runner.set_stages(pred.plan.stages)
            runner.cfg.runner.overlap_learner = pred.plan.overlap
            times = []
            for k in range(iterations + 1):
                times.append(runner.iterate(it)["perf/iteration_s"])
                it += 1
            out[pred.plan.label(planner_graph)] = statistics.fmean(times[1:])
            print(f"  {out[pred.plan.label(planner_graph)]:8.3f} s (predicted {pred.iteration_s:8.3f}; "
                  f"{', '.join(f'{t:.2f}' for t in times[1:])}) {pred.plan.label(planner_graph)}",
                  flush=True)
        runner.drain()
    finally:
        runner.close()


def measure_one(config, overrides, pred, graph, iterations):
    cfg = config_of(config, [*overrides, "runner.progress_bar=false"], pred.plan, graph)
    times = planner(cfg.workload).measure_iterations(cfg, iterations)
    m = statistics.fmean(times)
    print(f"  {m:8.3f} s (predicted {pred.iteration_s:8.3f}; {', '.join(f'{t:.2f}' for t in times)}) "
          f"{pred.plan.label(planner_graph)}", flush=True)
    return {pred.plan.label(planner_graph): m}


def main() -> None:
    global planner_graph
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config-name", default="maniskill_pushcube_ppo_mlp")
    p.add_argument("--profile", default=None, help="a .profile.json from m2flow-plan")
    p.add_argument("--iterations", type=int, default=3, help="timed iterations per plan")
    p.add_argument("--rollout-steps", type=int, default=0, help="0: the config's")
    p.add_argument("--limit", type=int, default=0,
                   help="run only the first N runner builds, best predicted first (0: all)")
    p.add_argument("--from-log", default=None,
                   help="report again from a log this script printed (each plan's timed "
                        "iterations) and its --profile: nothing runs but --confirm")
    p.add_argument("--confirm", type=int, default=None,
                   help="then run the chosen plan and the N fastest measured ones again for "
                        "--confirm-iterations each, and judge on those (default 3; 0 with "
                        "--from-log)")
    p.add_argument("--confirm-iterations", type=int, default=8)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.confirm is None:
        args.confirm = 0 if args.from_log else 3
    if args.from_log:
        return report_from_log(args)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    overrides = list(args.overrides)
    if args.rollout_steps:
        overrides.append(f"runner.rollout_steps={args.rollout_steps}")
    cfg = load_run_config(args.config_name, overrides)
    module = planner(cfg.workload)
    if args.profile:
        prof = Profile.load(args.profile)
        graph = module.graph_of(prof.facts)
    else:  # as m2flow-plan: profile, then calibrate the framework's cost on the config as it is
        prof, graph = measure(cfg)
        prof.save(Path("bench") / f"planner_{args.config_name}.profile.json")
    planner_graph = graph
    preds = search(graph, models_for(prof, graph), prof.node)
    chosen = preds[0].plan.label(planner_graph)
    embodied = cfg.workload == "embodied"
    groups = runs_of(preds, graph, elastic_groups=embodied)
    if args.limit:
        groups = dict(list(groups.items())[: args.limit])
    print(f"planner bench: {args.config_name}, {sum(len(g) for g in groups.values())} feasible "
          f"plans in {len(groups)} runner builds, {args.iterations} iterations each", flush=True)
    cluster = Cluster(cfg.cluster)  # one Ray for every runner
    try:
        measured = run_groups(groups, args.config_name, overrides, graph, args.iterations,
                              embodied)
        confirmed = confirm(preds, measured, chosen, graph, args, overrides, embodied)
    finally:
        cluster.shutdown()
    report(preds, measured, chosen, graph, args, prof, confirmed=confirmed)


def run_groups(groups: dict, config: str, overrides, graph, iterations: int,
               embodied: bool) -> dict[str, float]:
    """Each group's plans timed ({label: mean seconds per iteration}); a plan the run
    refuses is printed and left out."""
    measured: dict[str, float] = {}
    for key, group in groups.items():
        print(f"runner: {key}", flush=True)
        try:
            if embodied:
                measure_embodied(config, overrides, group, iterations, measured)
            else:
                for pred in group:
                    measured.update(measure_one(config, overrides, pred, graph, iterations))
        except Exception as e:  # a plan the run refuses is a finding, not the end
            print(f"  failed: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
    return measured


def confirm(preds, measured, chosen, graph, args, overrides, embodied) -> dict[str, float]:
    """The fastest of many plans timed a few iterations each is the luckiest draw as much as
    the fastest plan (a minimum over noisy means is biased low, the more plans the more):
    the chosen plan and the ``--confirm`` fastest measured ones run again, each on a runner
    of its own, for ``--confirm-iterations``; the verdict is taken on these."""
    k = args.confirm
    if not k or not measured:
        return {}
    fastest = sorted(measured, key=measured.get)[:k]
    labels = list(dict.fromkeys([chosen, *fastest]))
    by_label = {p.plan.label(graph): p for p in preds}
    groups = {label: [by_label[label]] for label in labels if label in by_label}
    print(f"confirmation: {len(groups)} plans again, {args.confirm_iterations} iterations each",
          flush=True)
    return run_groups(groups, args.config_name, overrides, graph, args.confirm_iterations,
                      embodied)


def report_from_log(args) -> None:
    """The report of an earlier run from its log (each plan's printed iterations, summarised
    as the bench summarises them now) and its profile (the calibration's iterations likewise),
    the plans predicted again."""
    global planner_graph
    import re

    if not args.profile:
        raise SystemExit("planner bench: --from-log needs the run's --profile "
                         "(bench/planner_<config>.profile.json)")
    prof = Profile.load(args.profile)
    for run in prof.facts.get("calibration", {}).get("runs", []):
        run["seconds"] = statistics.fmean(run.get("times", [run["seconds"]]))
    graph = planner(prof.workload).graph_of(prof.facts)
    planner_graph = graph
    preds = search(graph, models_for(prof, graph), prof.node)
    measured, logged = {}, {}
    section = measured  # the exhaustive pass, then its confirmation's runs
    for line in Path(args.from_log).read_text().splitlines():
        if line.startswith("confirmation:"):
            section = logged
        m = re.match(r"\s+[\d.]+ s \(predicted\s+[\d.]+; ([\d., ]+)\) (.*)", line)
        if m:
            section[m[2].strip()] = statistics.fmean(float(x) for x in m[1].split(","))
    chosen = preds[0].plan.label(graph)
    confirmed = logged
    if args.confirm:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        overrides = list(args.overrides)
        if args.rollout_steps:
            overrides.append(f"runner.rollout_steps={args.rollout_steps}")
        cfg = load_run_config(args.config_name, overrides)
        cluster = Cluster(cfg.cluster)
        try:
            confirmed = confirm(preds, measured, chosen, graph, args, overrides,
                                cfg.workload == "embodied")
        finally:
            cluster.shutdown()
    report(preds, measured, chosen, graph, args, prof, keep=False, confirmed=confirmed)


def report(preds, measured, chosen, graph, args, prof, keep: bool = True,
           confirmed: dict | None = None) -> None:
    rows = sorted((p for p in preds if p.plan.label(planner_graph) in measured),
                  key=lambda p: measured[p.plan.label(planner_graph)])
    print(f"\n== {args.config_name}: {prof.node.cores} cores, {prof.node.gpus} GPUs, "
          f"{len(rows)} plans run, {args.iterations} iterations each (mean, after a warm-up)")
    for run in prof.facts.get("calibration", {}).get("runs", []):
        times = ", ".join(f"{t:.3f}" for t in run.get("times", [run["seconds"]]))
        print(f"calibration: the config's own plan at S={run['stages']}"
              f"{' with overlap' if run['overlap'] else ''}: {run['seconds']:.3f} s "
              f"(mean of {times})")
    print(f"{'measured':>9}  {'predicted':>9}  {'error':>6}  plan")
    for pr in rows:
        m = measured[pr.plan.label(planner_graph)]
        mark = "  <- chosen" if pr.plan.label(planner_graph) == chosen else ""
        print(f"{m:>9.3f}  {pr.iteration_s:>9.3f}  {100 * (pr.iteration_s / m - 1):>+5.0f}%  "
              f"{pr.plan.label(planner_graph)}{mark}")
    if not rows or chosen not in measured:
        print("planner: the chosen plan did not run")
        return
    best = measured[rows[0].plan.label(planner_graph)]
    ratio = measured[chosen] / best
    good = sum(abs(pr.iteration_s / measured[pr.plan.label(planner_graph)] - 1) <= WITHIN_PREDICTED
               for pr in rows)
    chosen_err = preds[0].iteration_s / measured[chosen] - 1
    verdict = (f"chosen {measured[chosen]:.3f} s against the best {best:.3f} s: "
               f"{ratio:.2f}x ({'within' if ratio <= 1 + WITHIN_BEST else 'NOT within'} 10 %); "
               f"chosen plan predicted {100 * chosen_err:+.0f}%; {good} of {len(rows)} "
               f"predictions within 20 %")
    if confirmed and chosen in confirmed:
        print(f"every plan, {args.iterations} iterations: {verdict}")
        print(f"\nconfirmation: the chosen plan and the fastest measured ones again, "
              f"{args.confirm_iterations} iterations each")
        by_label = {p.plan.label(planner_graph): p for p in preds}
        for label in sorted(confirmed, key=confirmed.get):
            pred = by_label[label].iteration_s
            mark = "  <- chosen" if label == chosen else ""
            print(f"{confirmed[label]:>9.3f}  {pred:>9.3f}  "
                  f"{100 * (pred / confirmed[label] - 1):>+5.0f}%  {label}{mark}")
        best_c = min(confirmed.values())
        ratio_c = confirmed[chosen] / best_c
        err_c = preds[0].iteration_s / confirmed[chosen] - 1
        verdict = (f"chosen {confirmed[chosen]:.3f} s against the best confirmed "
                   f"{best_c:.3f} s: {ratio_c:.2f}x "
                   f"({'within' if ratio_c <= 1 + WITHIN_BEST else 'NOT within'} 10 %); "
                   f"chosen plan predicted {100 * err_c:+.0f}%; {good} of {len(rows)} "
                   f"predictions within 20 % (every plan, {args.iterations} iterations)")
    print(f"planner: {verdict}")
    if not keep:
        return
    record.append("planner", [(args.config_name, 0, pr.plan.label(planner_graph),
                               graph.steps_per_iteration / measured[pr.plan.label(planner_graph)])
                              for pr in rows])


planner_graph = None

if __name__ == "__main__":
    main()
