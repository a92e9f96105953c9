"""Does pipelining pay? Sequential (S=1) vs pipelined (S=2, 4) collection, against its bound.

Everything below runs in ONE process tree and is timed in interleaved rounds (this machine's
speed drifts from minute to minute; numbers taken minutes apart are not comparable):

  T_sim     env alone: the same envs, random actions, on the env's cores   (ms per step)
  T_infer   policy alone on recorded observations, on the rollout's cores   (ms per step)
  plain     cleanRL-style loop in this process: policy.act + env.step + buffer writes, env
            processes on the env's cores and the loop on the rollout's cores
  S=1,2,4   EmbodiedRunner collection with that many pipeline stages (one runner whose env
            worker holds 4 env groups, so only the stage count changes between modes)

  bound       (T_sim + T_infer) / max(T_sim, T_infer): the best speedup overlap can give
  speedup     best pipelined throughput / S=1 throughput
  efficiency  speedup / bound
  overhead    1 - S=1 throughput / plain-loop throughput (what the framework costs)

The placement is cluster=split_cores: env (and its simulator processes) on core 0, rollout on
core 1, so simulation and inference have resources of their own to overlap on. On a GPU machine
(no Ray there), ``--cluster gpu_inprocess``: rollout on GPU 0, simulators rendering on it.

    python bench/pipeline.py                  # the default case (rgb 128 px, ResNet-50 CNN)
    python bench/pipeline.py --case state     # state obs, MLP: inference is tiny
    python bench/pipeline.py --case vla       # tiny VLA on PickCube rgb 64 px
    python bench/pipeline.py --case all
    python bench/pipeline.py --case mjlab_vla --cluster mjlab_gpu_inprocess --num-envs 256  # GPU
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import record
import torch
from tensordict import TensorDict

from m2flow.cli.common import load_run_config
from m2flow.embodied.runner import EmbodiedRunner
from m2flow.envs import make_env
from m2flow.pipelines import Channel, Placement, WorkerGroup
from m2flow.pipelines.worker import Worker, pin_process
from m2flow.policies import make_policy

CASES = {
    "rgb": ("maniskill_pushcube_ppo_cnn",
            ["env.image_size=128", "policy=cnn_resnet18", "policy.encoder=timm/resnet50",
             # as measured (bench/README.md): the image critic, no auxiliary loss
             "env.privileged_state=false", "policy.critic=shared",
             "policy.state_aux=0"]),
    "state": ("maniskill_pushcube_ppo_mlp", []),
    # the tiny OpenVLA-OFT-style VLA (ViT-tiny 64 px + 2-layer Llama, chunk 1) on PickCube rgb
    "vla": ("maniskill_pickcube_ppo_openvla_tiny", []),
    # a larger small VLA (backbone at 128 px, 4-layer Llama of width 256): inference ~ simulation
    "vla128": ("maniskill_pickcube_ppo_openvla_tiny",
               ["policy.image_size=128", "policy.hidden_size=256",
                "policy.num_layers=4", "policy.intermediate_size=512"]),
    # GPU simulation: mjlab's Lift-Cube-Yam-Rgb (MuJoCo Warp, its batch renderer) with the tiny
    # VLA on its one camera at 64 px, then an OpenVLA-OFT-shaped ~1B (a Llama of Llama-3.2-1B's
    # shape, ViT-B/16 at 224 px; bf16 on CUDA). Each stage's envs are an mjlab env of their own.
    "mjlab_vla": ("mjlab_liftcube_ppo_openvla_tiny", []),
    "mjlab_vla1b": ("mjlab_liftcube_ppo_openvla_tiny",
                    ["env.image_size=224", "policy.image_size=224",
                     "policy.vision=[timm/vit_base_patch16_224]",
                     "policy.hidden_size=2048", "policy.num_layers=16",
                     "policy.num_heads=32", "policy.intermediate_size=8192"]),
}
FEW_STEPS = ("rgb", "vla", "vla128", "mjlab_vla", "mjlab_vla1b")  # slow cases: fewer steps per round
DEFAULT_CASE = "rgb"
STAGES = (1, 2, 4)


class Sink(Worker):
    """Takes the runner's trajectories (no learner: the bench times collection only)."""

    def drain(self, ch, keys):
        for k in keys:
            ch.get(key=k, timeout=600)


class Local:
    """Env and policy in this process, pinned like the runner's env and rollout workers."""

    def __init__(self, cfg, placement: Placement):
        env_cores = placement.ranks("env")[0].cpu_ids
        self.rollout_cores = placement.ranks("rollout")[0].cpu_ids
        pin_process(env_cores)  # the simulator processes started now inherit the env's cores
        self.env = make_env(cfg.env)
        pin_process(self.rollout_cores)
        torch.set_num_threads(placement.ranks("rollout")[0].threads)
        self.n = self.env.num_envs
        # the rollout's device (cluster=gpu_inprocess: GPU 0), as the runner's rollout worker
        self.device = "cuda:0" if placement.ranks("rollout")[0].gpu_ids else "cpu"
        self.policy = make_policy(cfg.policy, self.env.spec, device=self.device).eval()
        self.obs = self.env.reset(seed=list(range(self.n)))["obs"]
        self.recorded = [self.obs]

    def sim(self, k: int) -> None:
        for _ in range(k):
            out = self.env.step(torch.rand(self.n, self.env.spec.action_dim) * 2 - 1)
            if len(self.recorded) < 8:
                self.recorded.append(out["obs"])
        self.obs = out["obs"]

    def infer(self, k: int) -> None:
        with torch.no_grad():
            for i in range(k):
                obs = self.recorded[i % len(self.recorded)].to(self.device)
                self.policy.act(TensorDict({"obs": obs}, batch_size=[self.n]))["action"].cpu()

    def plain(self, k: int) -> None:
        """cleanRL style: preallocated storage, act, step, write."""
        chunk = int(getattr(self.policy, "chunk", 1))  # VLA policies return (n, chunk, A)
        buf = {
            "obs": self.obs.unsqueeze(0).expand(k, *self.obs.batch_size).clone(),
            "action": torch.zeros(k, self.n, chunk * self.env.spec.action_dim),
            "log_prob": torch.zeros(k, self.n), "value": torch.zeros(k, self.n),
            "reward": torch.zeros(k, self.n), "done": torch.zeros(k, self.n, dtype=torch.bool),
        }
        for t in range(k):
            with torch.no_grad():
                act = self.policy.act(TensorDict({"obs": self.obs.to(self.device)},
                                                 batch_size=[self.n])).cpu()
            out = self.env.step(act["action"].reshape(self.n, chunk, -1)[:, 0])  # (chunk 1)
            buf["obs"][t] = self.obs
            buf["action"][t], buf["log_prob"][t], buf["value"][t] = (
                act["action"].reshape(self.n, -1), act["log_prob"], act["value"])
            buf["reward"][t], buf["done"][t] = out["next", "reward"], out["next", "done"]
            self.obs = out["obs"]

    def close(self) -> None:
        self.env.close()


class M2flow:
    """One runner; its env worker holds 4 env groups, so S=1, 2, 4 use the same simulators."""

    def __init__(self, cfg):
        cfg.runner.reset_every_iteration = False  # time stepping, not resets
        self.runner = EmbodiedRunner(cfg, train=False)
        self.sink = WorkerGroup(self.runner.cluster, "sink", Sink, self.runner.placement.ranks("sink"))
        ranks = self.runner.env_ranks
        self.runner.traj_ch = Channel("trajectory", self.sink, item_type=TensorDict,
                                      routes={e: 0 for e in ranks})
        self.it = itertools.count()

    def run(self, stages: int, k: int) -> None:
        self.runner.set_stages(stages)
        self.runner.cfg.runner.rollout_steps = k
        self.runner.collect(next(self.it))

    def after(self) -> None:
        self.sink.call(Sink.drain, self.runner.traj_ch, self.runner.env_ranks).wait()

    def close(self) -> None:
        self.sink.shutdown()
        self.runner.close()


def bench_case(case: str, args) -> dict:
    name, overrides = CASES[case]
    cfg = load_run_config(name, [
        *overrides, f"env.num_envs={args.num_envs}", f"cluster={args.cluster}",
        "staging.env_groups=4", "runner.progress_bar=false", *args.set,
    ])
    m2 = M2flow(cfg)  # first: its workers must not inherit this process's pinning
    local = Local(cfg, m2.runner.placement)
    n = args.num_envs
    steps = args.steps or (20 if case in FEW_STEPS else 200)
    modes = {
        "T_sim": local.sim, "T_infer": local.infer, "plain": local.plain,
        **{f"S={s}": (lambda k, s=s: m2.run(s, k)) for s in STAGES},
    }
    secs: dict[str, list[float]] = {m: [] for m in modes}
    phases: dict[str, dict[str, float]] = {}  # m2flow modes: worker seconds per phase
    try:
        for rnd in range(args.rounds + 1):
            for mode, run in modes.items():
                k = max(2, steps // 4) if rnd == 0 else steps
                t = time.perf_counter()
                run(k)
                dt = time.perf_counter() - t
                if mode.startswith("S="):
                    m2.after()
                    timings = m2.runner.timings()
                    if rnd > 0:
                        acc = phases.setdefault(mode, {})
                        for key, v in timings.items():
                            acc[key[5:]] = acc.get(key[5:], 0.0) + v / k / args.rounds
                if rnd > 0:
                    secs[mode].append(dt / k)
    finally:
        m2.close()
        local.close()
    per_step = {m: statistics.median(v) for m, v in secs.items()}
    t_sim, t_infer = per_step["T_sim"], per_step["T_infer"]
    rate = {m: n / per_step[m] for m in ("plain", *(f"S={s}" for s in STAGES))}
    seq = rate["S=1"]
    best = max(STAGES[1:], key=lambda s: rate[f"S={s}"])
    bound = (t_sim + t_infer) / max(t_sim, t_infer)
    speedup = rate[f"S={best}"] / seq
    result = {
        "case": case, "config": name, "cluster": args.cluster, "num_envs": n, "steps": steps, "rounds": args.rounds,
        "t_sim_ms": 1e3 * t_sim, "t_infer_ms": 1e3 * t_infer, "bound": bound,
        "rates": rate, "best": best, "speedup": speedup, "efficiency": speedup / bound,
        "overhead_pct": 100 * (1 - seq / rate["plain"]),
        "min_vs_seq": min(rate[f"S={s}"] / seq for s in STAGES[1:]),
        "phases": phases,
    }
    _print(result, cfg)
    return result


def _print(r: dict, cfg) -> None:
    print(f"\n== case {r['case']}: {cfg.env.name} obs={cfg.env.obs_mode} "
          f"{cfg.env.image_size if cfg.env.obs_mode != 'state' else ''} policy={cfg.policy.name}"
          f"{' ' + cfg.policy.encoder if hasattr(cfg.policy, 'encoder') else ''}, "
          f"{r['num_envs']} envs, {r['rounds']} interleaved rounds of {r['steps']} steps, "
          f"{os.cpu_count()} CPUs, cluster={r['cluster']}")
    print(f"T_sim {r['t_sim_ms']:.1f} ms/step   T_infer {r['t_infer_ms']:.1f} ms/step   "
          f"bound (T_sim+T_infer)/max = {r['bound']:.2f}")
    print(f"{'mode':<8}{'env steps/s':>12}{'vs S=1':>9}{'vs plain':>10}")
    for m, v in r["rates"].items():
        print(f"{m:<8}{v:>12.1f}{v / r['rates']['S=1']:>9.2f}{v / r['rates']['plain']:>10.2f}")
    names = sorted({p for ph in r["phases"].values() for p in ph if not p.startswith("sink")})
    print("worker time per step (ms): " + "  ".join(
        f"{m}: " + " ".join(f"{p}={1e3 * r['phases'][m].get(p, 0):.1f}" for p in names)
        for m in r["phases"]))
    print(f"speedup (S={r['best']}) {r['speedup']:.2f}, efficiency {r['efficiency']:.2f}, "
          f"worst pipelined vs S=1 {r['min_vs_seq']:.2f}, overhead of S=1 vs plain "
          f"{r['overhead_pct']:.1f}%")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default=DEFAULT_CASE, choices=[*CASES, "all"])
    p.add_argument("--num-envs", type=int, default=8)
    p.add_argument("--steps", type=int, default=0, help="steps per mode per round (0: per case)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cluster", default="split_cores",
                   help="gpu_inprocess: rollout on GPU 0, simulators render there (no Ray)")
    p.add_argument("--set", nargs="*", default=[], help="more config overrides (key=value)")
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cases = list(CASES) if args.case == "all" else [args.case]
    results = [bench_case(c, args) for c in cases]
    record.append("pipeline", [(r["case"], r["num_envs"], m, v)
                               for r in results for m, v in r["rates"].items()])
    d = next((r for r in results if r["case"] == DEFAULT_CASE), results[0])
    print(f"pipeline: speedup={d['speedup']:.2f} bound={d['bound']:.2f} "
          f"efficiency={d['efficiency']:.2f} overhead={d['overhead_pct']:.1f}%")


if __name__ == "__main__":
    main()
