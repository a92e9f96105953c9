"""Where one LIBERO env step's time goes: m2flow's env (LiberoTaskEnv) in one process, with
timers around robosuite's parts.

A robosuite step is ``control_timestep / model_timestep`` substeps (LIBERO: 0.05 / 0.002 = 25),
each ``sim.forward`` + the OSC controller (``_pre_action``) + ``mj_step`` + the observables
(``_update_observables``, which render each camera once per step); then the reward (LIBERO's
success predicate) and the observation dict. m2flow then checks the predicate again, builds the
proprio and turns each frame 180 degrees. A reset is robosuite's hard reset (the scene's model,
sim and render context built again), the init state, and ``settle_steps`` no-op steps.

Per look (one child process each, one after another: a robosuite process renders with one GL
context), ms per env step of each part, exclusive of the parts inside it ('observables' is
without its cameras, 'robosuite rest' is robosuite's step loop itself); then the reset's parts,
the same reset rendering every frame (the settle steps' and robosuite's own, thrown away) and
today's again, and env steps/s over a whole episode (a reset plus the suite's limit of steps).

    python bench/libero_step_time.py [--suite libero_spatial] [--steps 20] [--looks ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import multiprocessing as mp
import os
import time
from collections import defaultdict

LOOKS = {  # name -> LiberoEnvConfig settings (+ keep: what fast_rendering keeps of LIBERO's look)
    "standard 128": dict(obs_mode="rgb", image_size=128),
    "no reflections 128": dict(obs_mode="rgb", image_size=128, keep=dict(msaa=True)),
    "no MSAA 128": dict(obs_mode="rgb", image_size=128, keep=dict(reflections=True)),
    "fast 128": dict(obs_mode="rgb", image_size=128, render_quality="fast"),
    "fast 128 agent": dict(obs_mode="rgb", image_size=128, render_quality="fast",
                           wrist_camera=False),
    "standard 64": dict(obs_mode="rgb", image_size=64),
    "fast 64": dict(obs_mode="rgb", image_size=64, render_quality="fast"),
    "fast 64 agent": dict(obs_mode="rgb", image_size=64, render_quality="fast",
                          wrist_camera=False),
    "state": dict(obs_mode="state"),
}
STEP_PARTS = ("forward", "controller", "physics", "observables", "render agentview",
              "render robot0_eye_in_hand", "reward (success)", "get observations",
              "robosuite rest", "m2flow success", "m2flow obs (flip)", "m2flow rest")
RESET_PARTS = ("hard reset", "  scene model", "  compile", "  render context", "  free old sim",
               "init state", "settle steps", "reset rest")


class Timers:
    """Seconds per part, summed, both inclusive (``incl``) and exclusive of the timed parts
    called inside it (``excl``: controllers call ``sim.forward``, observables render);
    ``phase`` ('step', 'reset', 'warm-up') prefixes every part."""

    def __init__(self):
        self.incl, self.excl, self.phase = defaultdict(float), defaultdict(float), "step"
        self.calls = defaultdict(int)
        self.inner = []  # per open call: seconds of the timed calls inside it

    def wrap(self, obj, attr: str, part: str, by_camera: bool = False) -> None:
        inner = getattr(obj, attr)

        def timed(*a, **kw):
            t = time.perf_counter()
            self.inner.append(0.0)
            try:
                return inner(*a, **kw)
            finally:
                dt, nested = time.perf_counter() - t, self.inner.pop()
                if self.inner:
                    self.inner[-1] += dt
                name = (self.phase, f"{part} {kw.get('camera_name')}" if by_camera else part)
                self.incl[name] += dt
                self.calls[name] += 1
                self.excl[name] += dt - nested

        setattr(obj, attr, timed)


def measure(suite: str, look: dict, steps: int) -> dict:
    """In a child process: one env of ``look``, a timed reset, the same reset rendering every
    frame (as m2flow did before it skipped those thrown away) and again as today, 3 warm-up and
    ``steps`` timed steps of random actions (seed 0); seconds per part of a step and of the
    reset."""
    import numpy as np

    from m2flow.envs import env_config
    from m2flow.envs import libero
    from m2flow.envs.libero import SUITE_MAX_STEPS, LiberoTaskEnv
    from m2flow.envs.libero_compat import fast_rendering, frames_unrendered

    look = dict(look)
    keep = look.pop("keep", None)
    cfg = env_config(name=f"LIBERO/{suite}", num_envs=1, **look)
    env = LiberoTaskEnv(suite, [0], 0, SUITE_MAX_STEPS[suite], cfg)
    if keep:  # one of fast's two changes alone (from the next reset on)
        fast_rendering(env.env.env, **keep)
    tm = Timers()
    rs = env.env.env  # robosuite's env (LIBERO's ControlEnv wraps it)
    from robosuite.utils.binding_utils import MjRenderContext, MjSim

    # on the class: a hard reset builds a new sim, and a reset's unrendered frames
    # (m2flow.envs.libero_compat.frames_unrendered) replace MjSim.render for a while
    tm.wrap(MjSim, "forward", "forward")
    tm.wrap(MjSim, "step", "physics")
    tm.wrap(MjSim, "render", "render", by_camera=True)
    for obj, attr, part in ((rs, "_pre_action", "controller"),
                            (rs, "_update_observables", "observables"),
                            (rs, "_post_action", "reward (success)"),
                            (rs, "_get_observations", "get observations"),
                            (rs, "step", "robosuite step"),
                            (env.env, "check_success", "m2flow success"),
                            (env, "_obs", "m2flow obs (flip)")):
        tm.wrap(obj, attr, part)
    tm.wrap(MjRenderContext, "_set_mujoco_context_and_buffers", "render context")
    for attr, part in (("_load_model", "scene model"), ("_initialize_sim", "compile"),
                       ("_destroy_sim", "free old sim")):
        tm.wrap(rs, attr, part)
    tm.wrap(env.env, "reset", "hard reset")
    tm.wrap(env.env, "set_init_state", "init state")
    tm.phase = "reset"
    t = time.perf_counter()
    env.reset(seed=0)
    reset_s = time.perf_counter() - t
    tm.phase = "other resets"
    # the same reset rendering every frame, as before m2flow skipped the ones thrown away,
    # between two more of today's resets
    again = []
    for render_all in (True, False):
        if render_all:
            libero.frames_unrendered = lambda skip=True: contextlib.nullcontext()
        t = time.perf_counter()
        env.reset(seed=0)
        again.append(time.perf_counter() - t)
        libero.frames_unrendered = frames_unrendered
    rng = np.random.default_rng(0)
    tm.phase = "warm-up"
    for _ in range(3):
        env.step(rng.uniform(-1, 1, 7))
    tm.phase = "step"
    t = time.perf_counter()
    for _ in range(steps):
        env.step(rng.uniform(-1, 1, 7))
    step_s = (time.perf_counter() - t) / steps
    env.close()
    per = {k: tm.excl["step", k] / steps for k in STEP_PARTS}
    per["robosuite rest"] = tm.excl["step", "robosuite step"] / steps
    per["m2flow rest"] = step_s - sum(tm.incl["step", k] for k in (
        "robosuite step", "m2flow success", "m2flow obs (flip)")) / steps
    res = {k: tm.incl["reset", k.strip()] for k in RESET_PARTS[:-3]}
    res["init state"] = tm.incl["reset", "init state"]
    res["settle steps"] = tm.incl["reset", "robosuite step"]
    res["reset rest"] = reset_s - res["hard reset"] - res["init state"] - res["settle steps"]
    renders = [k for k in tm.calls if k[0] == "reset" and k[1].startswith("render ")
               and k[1] != "render context"]
    res["renders"] = (sum(tm.calls[k] for k in renders), sum(tm.incl[k] for k in renders))
    res["every frame rendered"], res["again"] = again
    return dict(step=per, step_s=step_s, reset=res, reset_s=reset_s,
                substeps=int(round(rs.control_timestep / rs.model_timestep)),
                settle=cfg.settle_steps, limit=SUITE_MAX_STEPS[suite])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", default="libero_spatial")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--looks", nargs="+", default=list(LOOKS), choices=list(LOOKS))
    args = p.parse_args()
    ctx = mp.get_context("spawn")  # robosuite picks its GL backend at import: a fresh process
    out = {}
    for look in args.looks:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
            out[look] = pool.submit(measure, args.suite, LOOKS[look], args.steps).result()
        print(f"{look}: {out[look]['step_s'] * 1e3:.0f} ms per step", flush=True)
    first = out[args.looks[0]]
    print(f"\nLIBERO/{args.suite} task 0, {args.steps} random steps after 3, "
          f"{first['substeps']} substeps a step, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}; ms per env step (share of the step)")
    width = max(len(k) for k in STEP_PARTS + RESET_PARTS) + 2
    print(f"{'':<{width}}" + "".join(f"{look:>20}" for look in args.looks))
    for part in STEP_PARTS:
        cells = ((out[lk]["step"][part], out[lk]["step_s"]) for lk in args.looks)
        print(f"{part:<{width}}" + "".join(f"{v * 1e3:>12.1f} ({v / t:>4.0%})" for v, t in cells))
    print(f"{'step':<{width}}" + "".join(f"{out[lk]['step_s'] * 1e3:>20.1f}" for lk in args.looks))
    print(f"reset, s ({first['settle']} settle steps)")
    for part in RESET_PARTS:
        print(f"{part:<{width}}" + "".join(f"{out[lk]['reset'][part]:>20.2f}" for lk in args.looks))
    print(f"{'reset':<{width}}" + "".join(f"{out[lk]['reset_s']:>20.2f}" for lk in args.looks))
    for what in ("every frame rendered", "again"):  # rendering every frame: as before ee7c203
        print(f"{what:<{width}}" + "".join(f"{out[lk]['reset'][what]:>20.2f}"
                                           for lk in args.looks))
    print(f"{'frames rendered (s)':<{width}}" + "".join(
        f"{out[lk]['reset']['renders'][0]:>12} ({out[lk]['reset']['renders'][1]:>5.2f})"
        for lk in args.looks))
    print(f"env steps/s, steps only / episode of {first['limit']} + reset (reset's share)")
    for lk in args.looks:
        o = out[lk]
        episode = o["reset_s"] + o["limit"] * o["step_s"]
        print(f"  {lk:<20}{1 / o['step_s']:>8.2f} / {o['limit'] / episode:>6.2f}"
              f"  ({o['reset_s'] / episode:.0%})")


if __name__ == "__main__":
    main()
