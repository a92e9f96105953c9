"""Single gymnasium envs behind one interface, in this process or one subprocess each.

A *slot* holds one env and steps it with same-step auto-reset: when an episode ends, the
slot resets the env at once and returns the final observation beside the new episode's
first one. ``LocalSlots`` keeps the envs in this process; ``ProcessSlots`` runs each in its
own process (forkserver, so a live renderer in the parent is never forked) and survives a
process that dies or hangs: it is killed, started again with the same env and the same reset
options (the same task), and that env's step comes back marked ``discarded`` with the first
observation of a fresh episode. Nothing from the lost episode is returned as if it were data.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import gymnasium as gym
import numpy as np

log = logging.getLogger(__name__)

RESTART_SEED_STRIDE = 1_000_003  # a restarted env's reset seed: its last seed + k * this


@dataclass
class StepResult:
    """One env's step. ``obs`` is the observation to act on next; ``final_obs`` the one the
    step ended in (they differ only where ``terminated or truncated``)."""

    obs: Any
    final_obs: Any
    reward: float
    terminated: bool
    truncated: bool
    success: bool
    discarded: bool = False


class SimulatorError(RuntimeError):
    """A simulator raised an exception (a bug or bad input, not a crash): never retried."""


def step_env(env: gym.Env, action) -> StepResult:
    """Steps ``env`` and resets it if the episode ended (same-step auto-reset)."""
    obs, reward, terminated, truncated, info = env.step(action)
    result = StepResult(obs, obs, float(reward), bool(terminated), bool(truncated),
                        bool(np.asarray(info.get("success", False)).any()))
    if terminated or truncated:
        result.obs, _ = env.reset()
    return result


class LocalSlots:
    """Envs in this process (cheap envs, tests)."""

    restarts = 0

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]]):
        self.envs = [fn() for fn in env_fns]
        self.observation_space = self.envs[0].observation_space
        self.action_space = self.envs[0].action_space
        self._actions = None

    def reset(self, seeds: Sequence[Optional[int]], options: Sequence[Optional[dict]]) -> list:
        return [env.reset(seed=s, options=o)[0] for env, s, o in zip(self.envs, seeds, options)]

    def step_async(self, actions: np.ndarray) -> None:
        self._actions = actions

    def step_wait(self) -> list[StepResult]:
        actions, self._actions = self._actions, None
        return [step_env(env, a) for env, a in zip(self.envs, actions)]

    def close(self) -> None:
        for env in self.envs:
            env.close()


class ProcessSlots:
    """One process per env; a process that dies or hangs past ``timeout`` is replaced.

    Args:
        env_fns: picklable callables that each build one env.
        timeout: seconds a step or reset may take before the process counts as hung.
        start_timeout: seconds a process may take to build its env.
    """

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], timeout: float = 300.0,
                 start_timeout: float = 600.0):
        self.env_fns = list(env_fns)
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.ctx = mp.get_context("forkserver")
        self.restarts = 0
        """Processes replaced since construction (dead or hung)."""
        n = len(self.env_fns)
        self._procs: list = [None] * n
        self._conns: list = [None] * n
        self._seeds: list[Optional[int]] = [None] * n
        self._options: list[Optional[dict]] = [None] * n
        self._sent = [False] * n
        for i in range(n):  # start all first: they build their envs in parallel
            self._spawn(i)
        try:
            spaces = [self._recv(i, self.start_timeout, "start") for i in range(n)]
        except (_Lost, SimulatorError) as e:
            self.close()
            raise SimulatorError(f"{e} (while building its env; no env was started)") from None
        self.observation_space, self.action_space = spaces[0]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def reset(self, seeds: Sequence[Optional[int]], options: Sequence[Optional[dict]]) -> list:
        for i, (s, o) in enumerate(zip(seeds, options)):
            self._seeds[i], self._options[i] = s, o
            self._send(i, ("reset", (s, o)))
        out = []
        for i in range(len(self.env_fns)):
            try:
                out.append(self._recv(i, self.timeout, "reset"))
            except _Lost as e:
                out.append(self._restart(i, e))
        return out

    def step_async(self, actions: np.ndarray) -> None:
        for i, a in enumerate(actions):
            self._send(i, ("step", a))

    def step_wait(self) -> list[StepResult]:
        out = []
        for i in range(len(self.env_fns)):
            try:
                out.append(self._recv(i, self.timeout, "step"))
            except _Lost as e:
                obs = self._restart(i, e)
                out.append(StepResult(obs, obs, 0.0, False, True, False, discarded=True))
        return out

    def close(self) -> None:
        for i, conn in enumerate(self._conns):
            try:
                if self._sent[i]:  # a step in flight: its answer is not wanted
                    self._procs[i].kill()
                else:
                    conn.send(("close", None))
            except (OSError, ValueError):
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self._conns:
            conn.close()

    # -- one process ---------------------------------------------------------------------
    def _spawn(self, i: int) -> None:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_serve, args=(child, self.env_fns[i]), daemon=True,
                                name=f"m2flow-env-{i}")
        proc.start()
        child.close()
        self._procs[i], self._conns[i] = proc, parent
        self._sent[i] = True  # its "ready" message is due

    def _send(self, i: int, msg) -> None:
        try:
            self._conns[i].send(msg)
        except (OSError, ValueError):
            pass  # dead: the receive that follows finds out and restarts it
        self._sent[i] = True

    def _recv(self, i: int, timeout: float, what: str):
        conn, proc = self._conns[i], self._procs[i]
        deadline = time.monotonic() + timeout
        while not conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
            if not proc.is_alive():
                raise _Lost(f"env process {i} (pid {proc.pid}) died with exit code "
                            f"{proc.exitcode} during {what}")
            if time.monotonic() >= deadline:
                raise _Lost(f"env process {i} (pid {proc.pid}) did not answer a {what} "
                            f"within {timeout:.0f} s (hung)")
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            raise _Lost(f"env process {i} (pid {proc.pid}) died during {what}") from None
        self._sent[i] = False
        if kind == "error":
            raise SimulatorError(f"env process {i} raised during {what}:\n{payload}")
        return payload

    def _restart(self, i: int, cause: "_Lost"):
        """Replaces process i; resets it as its last reset asked. Returns the new first obs."""
        self.restarts += 1
        log.warning("%s; restarting it (its episode is discarded)", cause)
        proc = self._procs[i]
        if proc.is_alive():
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended (and was reaped) since is_alive looked
                pass
        proc.join(timeout=10)
        self._conns[i].close()
        self._spawn(i)
        seed = self._seeds[i]
        if seed is not None:
            seed = (seed + RESTART_SEED_STRIDE * self.restarts) & 0x7FFFFFFF
        try:
            self._recv(i, self.start_timeout, "start")
            self._send(i, ("reset", (seed, self._options[i])))
            return self._recv(i, self.timeout, "reset")
        except _Lost as e:  # the replacement failed too: not retried again
            raise SimulatorError(f"{e}, after a restart ({cause})") from None


class _Lost(Exception):
    """A process died or hung (internal: handled by a restart, or a SimulatorError if the
    replacement is lost too)."""


def _serve(conn, env_fn: Callable[[], gym.Env]) -> None:
    """The subprocess: builds one env, then answers reset/step/close until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        env = env_fn()
        conn.send(("ok", (env.observation_space, env.action_space)))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            cmd, arg = conn.recv()
        except (EOFError, KeyboardInterrupt):
            break
        try:
            if cmd == "reset":
                seed, options = arg
                conn.send(("ok", env.reset(seed=seed, options=options)[0]))
            elif cmd == "step":
                conn.send(("ok", step_env(env, arg)))
            elif cmd == "close":
                break
        except Exception:
            conn.send(("error", traceback.format_exc()))
    env.close()
