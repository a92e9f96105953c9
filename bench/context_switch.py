"""How close does a context switch come to the copy bandwidth of this machine?

For MLPs of several sizes with gradients and Adam state populated (one step), it times
``DeviceContext.offload`` (device -> pinned host) and ``onload`` (host -> device), and, in the
same run, a plain copy of the same byte count as one tensor each way
(``torch.empty(n, pin_memory=True).copy_(cuda_tensor)`` and back): the ceiling. It prints the
achieved GB/s and the fraction of the measured ceiling (median of ``--repeats`` after a warm-up
switch, which also pins the host memory once).

Without CUDA, the device is host memory and a DeviceContext moves nothing (no-op mode): the
script says so and prints the no-op timings, then the ``force=True`` copies (what
``cluster.context_switch=always`` does on a CPU), which are host memcpy, against a plain host
copy of the same byte count.

    python bench/context_switch.py [--sizes 1e6 1e7 1e8 1e9] [--repeats 5]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from m2flow.pipelines import DeviceContext

LAYERS = 4  # square Linear layers: params ~ LAYERS * width**2
BYTES_PER_PARAM = 16  # fp32 weight, gradient, Adam exp_avg and exp_avg_sq
GPU_SIZES = (1e6, 1e7, 1e8, 1e9)
CPU_SIZES = (1e6, 1e7)


def model(params: float, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP of ~``params`` parameters after one Adam step (moments and gradients exist)."""
    torch.manual_seed(0)
    width = round(math.sqrt(params / LAYERS))
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width, device=device)
                                for _ in range(LAYERS)])
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    net(torch.randn(8, width, device=device)).square().mean().backward()
    opt.step()
    return net, opt


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str):
    """Seconds ``fn`` took, synchronised with the device, and what it returned."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def switch_times(ctx: DeviceContext, device: str, repeats: int) -> tuple[float, float, int]:
    """Median seconds of offload and of onload after one warm-up switch, and bytes moved."""
    ctx.offload(), ctx.onload()  # warm-up: pins (and caches) the host memory
    offs, ons = [], []
    for _ in range(repeats):
        seconds, stats = timed(ctx.offload, device)
        offs.append(seconds)
        ons.append(timed(ctx.onload, device)[0])
    return statistics.median(offs), statistics.median(ons), stats.bytes


def copy_times(nbytes: int, device: str, repeats: int) -> tuple[float, float]:
    """Median seconds of one plain copy of ``nbytes`` each way (device -> host, host -> device)."""
    cuda = device.startswith("cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
    rounds = range(repeats + 1)
    out = [timed(lambda: host.copy_(dev, non_blocking=cuda), device)[0] for _ in rounds]
    back = [timed(lambda: dev.copy_(host, non_blocking=cuda), device)[0] for _ in rounds]
    return statistics.median(out[1:]), statistics.median(back[1:])  # the first is a warm-up


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / 1e9 / seconds if seconds > 0 else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", help="parameter counts (default: by device)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = args.sizes or (GPU_SIZES if device == "cuda" else CPU_SIZES)
    if device == "cuda":
        free = torch.cuda.mem_get_info()[0]
        sizes = [s for s in sizes if 2 * BYTES_PER_PARAM * s < 0.8 * free]  # model + ceiling copy
        print(f"device {torch.cuda.get_device_name()}, pinned host memory; sizes {sizes}")
    else:
        print("no CUDA: the device is host memory, so DeviceContext runs in no-op mode and "
              "moves nothing.\nThe force=True rows are host-to-host memcpy (what "
              "cluster.context_switch=always does on a CPU), not device transfers.")
    print(f"{'params':>8} {'mode':<14} {'MB':>8} {'offload ms':>10} {'onload ms':>9} "
          f"{'off GB/s':>9} {'on GB/s':>8} {'copy GB/s out/in':>17} {'of copy out/in':>15}")
    modes = ([("switch", False)] if device == "cuda"
             else [("no-op", False), ("force (memcpy)", True)])
    for size in sizes:
        net, opt = model(size, device)
        params = sum(p.numel() for p in net.parameters())
        for mode, force in modes:
            ctx = DeviceContext(device, modules={"net": net}, optimizers={"adam": opt}, force=force)
            off, on, moved = switch_times(ctx, device, args.repeats)
            line = (f"{params / 1e6:>7.1f}M {mode:<14} {moved / 1e6:>8.1f} {1e3 * off:>10.3f} "
                    f"{1e3 * on:>9.3f} ")
            if moved == 0:
                print(line + f"{'-':>9} {'-':>8} {'-':>17} {'-':>15}")
                continue
            c_out, c_in = copy_times(moved, device, args.repeats)
            g_off, g_on, r_out, r_in = (gbps(moved, off), gbps(moved, on),
                                        gbps(moved, c_out), gbps(moved, c_in))
            print(line + f"{g_off:>9.2f} {g_on:>8.2f} {r_out:>8.2f}/{r_in:<8.2f} "
                  f"{g_off / r_out:>7.2f}/{g_on / r_in:.2f}")
        del net, opt, ctx  # the context holds the model too
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
