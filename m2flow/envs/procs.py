"""Single gymnasium envs behind one interface, in this process or in subprocesses.

A *slot* holds one env and steps it with same-step auto-reset: when an episode ends, the
slot resets the env at once and returns the final observation beside the new episode's
first one. ``LocalSlots`` keeps the envs in this process; ``ProcessSlots`` runs them in
processes (forkserver, so a live renderer in the parent is never forked), one env each or
``envs_per_process`` each, and survives a process that dies or hangs: it is killed, started
again with the same envs and the same reset options (the same tasks), and each of its envs'
steps comes back marked ``discarded`` with the first observation of a fresh episode. Nothing
from a lost episode is returned as if it were data.

The processes are forked from a *fork server* (:mod:`m2flow.envs.fork`) that imported once
what every simulator process shares, so they start in milliseconds and share those modules'
memory.

Large observation arrays (images) come back through a shared-memory block per env instead of
the pickled message (:mod:`m2flow.envs.shm`; ``shared_memory`` says which arrays), which the
slots own: a restarted process attaches to its envs' blocks, and ``close`` unlinks them all.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import gymnasium as gym
import numpy as np

from m2flow.envs import shm
from m2flow.envs.base import EnvError
from m2flow.envs.config import ProcessEnvConfig
from m2flow.envs.fork import ServerProcess, fork_server
from m2flow.envs.shm import ObsBlock


def env_server(preload: Sequence[str] = (), environ: Sequence[tuple] = ()):
    """The fork server env processes of ``preload`` and ``environ`` are forked from (this
    module is among its preloads: every env process runs it); launched now if it is not
    running. An adapter calls this early, so the server's imports overlap its own."""
    return fork_server((__name__, *preload), environ)

log = logging.getLogger(__name__)

RESTART_SEED_STRIDE = 1_000_003  # a restarted env's reset seed: its last seed + k * this
SERVER_EXIT_WAIT_S = 10.0  # a fork server that refused a fork has this long to finish dying


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


def step_env(env: gym.Env, action, frames: bool = True) -> StepResult:
    """Steps ``env`` and resets it if the episode ended (same-step auto-reset).

    ``frames=False``: nobody reads this step's images (an action chunk's inner step), so an
    env that defines ``step_without_frames(action)`` (LIBERO's) takes that step instead and
    need not render them; any other env steps as usual.
    """
    step = env.step if frames else getattr(env, "step_without_frames", env.step)
    obs, reward, terminated, truncated, info = step(action)
    result = StepResult(obs, obs, float(reward), bool(terminated), bool(truncated),
                        bool(np.asarray(info.get("success", False)).any()))
    if terminated or truncated:
        result.obs, _ = env.reset()
    return result


@dataclass(frozen=True)
class EnvRecipe:
    """A picklable env factory plus what the processes that build it should share.

    Args:
        make: builds one env (called in the env's process).
        preload: modules the fork server imports once for every process it forks. Only
            modules whose import starts no thread, renderer or CUDA context belong here.
        environ: ``(name, value)`` pairs the server sets before those imports, for modules
            that read a variable at import (``MUJOCO_GL``, ...).

    >>> recipe = EnvRecipe(lambda: gym.make("CartPole-v1"), preload=("torch",))
    >>> recipe().observation_space.shape
    (4,)
    """

    make: Callable[[], gym.Env]
    preload: tuple = ()
    environ: tuple = ()

    def __call__(self) -> gym.Env:
        return self.make()


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

    def reset_async(self, seeds: Sequence[Optional[int]],
                    options: Sequence[Optional[dict]]) -> None:
        self._reset_args = (seeds, options)

    def reset_wait(self) -> list:
        (seeds, options), self._reset_args = self._reset_args, None
        return self.reset(seeds, options)

    def step_async(self, actions: np.ndarray, frames: bool = True) -> None:
        self._actions = actions, frames

    def step_wait(self) -> list[StepResult]:
        (actions, frames), self._actions = self._actions, None
        return [step_env(env, a, frames) for env, a in zip(self.envs, actions)]

    def close(self) -> None:
        for env in self.envs:
            env.close()


def processes_for(num_envs: int, envs_per_process: int) -> int:
    """Envs per process for ``envs_per_process`` (0: as many processes as this process may
    use cores, the envs shared out evenly; on 2 cores 16 envs run as 2 processes of 8).

    >>> processes_for(16, 1), processes_for(16, 8), processes_for(5, 2)
    (1, 8, 2)
    """
    if envs_per_process:
        return envs_per_process
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return -(-num_envs // max(1, cores or 1))


class ProcessSlots:
    """Envs in processes forked from a fork server, ``envs_per_process`` in each (stepped one
    after another there); a process that dies or hangs past ``timeout`` is replaced from the
    same server (a server that died is started again), and every env of it starts a fresh
    episode.

    Args:
        env_fns: picklable callables that each build one env; where they are
            :class:`EnvRecipe` objects, the server preloads the first one's ``preload`` modules.
        timeout: seconds a step or reset may take before the process counts as hung.
        start_timeout: seconds a process may take to build its envs.
        shared_memory: which observation arrays come back through a shared-memory block
            instead of the pickled message: 'auto' (default) those of at least
            :data:`m2flow.envs.shm.MIN_BYTES` (images), 'on' every fixed-shape array, 'off' none.
        max_restarts: restarts of one process in a row (no episode of it finished between
            them, a replacement that dies before its first reset counting too) before a
            :class:`SimulatorError` ends the run instead; 0: never restart.
        label: ``label(i, last reset options)`` names env i's simulator and task in that
            error (default: "env process i").
        envs_per_process: envs each process holds (the last one may hold fewer); 0: one
            process per core (:func:`processes_for`). One per process steps the envs in
            parallel across cores; several per process spend less of each step on messages
            and context switches where the envs outnumber the cores
            (bench/README.md#envs_per_processpy).
    """

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], timeout: float = 300.0,
                 start_timeout: float = 600.0, shared_memory: str = "auto",
                 max_restarts: int = 3,
                 label: Optional[Callable[[int, Optional[dict]], str]] = None,
                 envs_per_process: int = 1):
        if shared_memory not in shm.MODES:
            raise EnvError(f"env.shared_memory={shared_memory!r}: use one of {list(shm.MODES)} "
                           "('auto' sends images through shared memory, state as messages).")
        if envs_per_process < 0:
            raise EnvError(f"env.envs_per_process={envs_per_process}: must be >= 0; give the "
                           "envs one simulator process steps (1: a process per env; 0: one "
                           "process per core).")
        self.shared_memory = shared_memory
        self.env_fns = list(env_fns)
        self.timeout = timeout
        self.start_timeout = start_timeout
        recipe = self.env_fns[0] if isinstance(self.env_fns[0], EnvRecipe) else EnvRecipe(None)
        self.server = env_server(recipe.preload, recipe.environ)
        self.restarts = 0
        """Processes replaced since construction (dead or hung)."""
        self.max_restarts = max_restarts
        self._label = label or (lambda i, options: f"env process {i}")
        n = len(self.env_fns)
        k = processes_for(n, envs_per_process)
        self._groups = [list(range(i, min(i + k, n))) for i in range(0, n, k)]  # envs of each
        m = len(self._groups)
        self._in_a_row = [0] * m  # restarts of each process since its last finished episode
        self._procs: list = [None] * m
        self._conns: list = [None] * m
        self._seeds: list[Optional[int]] = [None] * n
        self._options: list[Optional[dict]] = [None] * n
        self._sent = [False] * m
        self._blocks: list[Optional[ObsBlock]] = [None] * n  # one per env
        for p in range(m):  # start all first: they build their envs in parallel
            self._spawn(p)
        try:
            spaces = [s for p in range(m) for s in self._recv(p, self.start_timeout, "start")]
            for i, (obs_space, _) in enumerate(spaces):
                fields, nbytes = shm.layout(obs_space, shared_memory)
                if fields:
                    self._blocks[i] = ObsBlock.create(fields, nbytes, tag=str(i))
            for p in range(m):
                self._attach(p)
        except (_Lost, SimulatorError) as e:
            self.close()
            raise SimulatorError(f"{e} (while building its env; no env was started)") from None
        except BaseException:  # e.g. no room for a block: stop the processes, unlink the rest
            self.close()
            raise
        self.observation_space, self.action_space = spaces[0]

    @property
    def pids(self) -> list[int]:
        """Per env, the pid of the process that steps it."""
        return [self._procs[p].pid for p, group in enumerate(self._groups) for _ in group]

    @property
    def shared_keys(self) -> list[tuple]:
        """Per env, the observation keys that come through its shared-memory block (None: the
        whole observation); empty where none does."""
        return [tuple(f.key for f in b.fields) if b else () for b in self._blocks]

    @property
    def shm_names(self) -> list[Optional[str]]:
        """Per env, the name of its shared-memory block (None: it has none)."""
        return [b.name if b else None for b in self._blocks]

    def reset(self, seeds: Sequence[Optional[int]], options: Sequence[Optional[dict]]) -> list:
        self.reset_async(seeds, options)
        return self.reset_wait()

    def reset_async(self, seeds: Sequence[Optional[int]],
                    options: Sequence[Optional[dict]]) -> None:
        """Sends every process its envs' resets; ``reset_wait`` collects the first obs."""
        for i, (s, o) in enumerate(zip(seeds, options)):
            self._seeds[i], self._options[i] = s, o
        for p, group in enumerate(self._groups):
            self._send(p, ("reset", [(self._seeds[i], self._options[i]) for i in group]))

    def reset_wait(self) -> list:
        out = []
        for p in range(len(self._groups)):
            try:
                out.extend(self._recv(p, self.timeout, "reset"))
            except _Lost as e:
                out.extend(self._restart(p, e))
        return out

    def step_async(self, actions: np.ndarray, frames: bool = True) -> None:
        """Starts a step of every env; ``frames``: see :func:`step_env`."""
        for p, group in enumerate(self._groups):
            self._send(p, ("step", (actions[group[0]:group[-1] + 1], frames)))

    def step_wait(self) -> list[StepResult]:
        out = []
        for p in range(len(self._groups)):
            try:
                results = self._recv(p, self.timeout, "step")
            except _Lost as e:
                results = [StepResult(obs, obs, 0.0, False, True, False, discarded=True)
                           for obs in self._restart(p, e)]
            else:
                if any(r.terminated or r.truncated for r in results):
                    self._in_a_row[p] = 0  # it finished an episode: it works
            out.extend(results)
        return out

    def close(self) -> None:
        for p, conn in enumerate(self._conns):
            try:
                if self._sent[p]:  # a step in flight: its answer is not wanted
                    self._procs[p].kill()
                else:
                    conn.send(("close", None))
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        for block in self._blocks:  # after the joins: no process writes or attaches any more
            if block is not None:
                block.close(unlink=True)

    # -- one process ---------------------------------------------------------------------
    def _name(self, p: int) -> str:
        """'env process 3', or 'env process 1 (envs 8-15)' where it steps several."""
        group = self._groups[p]
        envs = f" (envs {group[0]}-{group[-1]})" if len(group) > 1 else ""
        return f"env process {p}{envs}"

    def _spawn(self, p: int) -> None:
        fns = [self.env_fns[i] for i in self._groups[p]]
        for attempt in range(2):
            parent, child = mp.Pipe()
            proc = ServerProcess(self.server, target=_serve, args=(child, fns),
                                  daemon=True, name=f"m2flow-env-{p}")
            try:
                proc.start()
                break
            except (OSError, EOFError) as e:  # the server died (killed, or on a preload import)
                parent.close()
                child.close()
                if attempt == 0 and self.server.wait_exit(SERVER_EXIT_WAIT_S):
                    continue  # it was dying when ensure_running looked: the next try relaunches
                raise SimulatorError(
                    f"the fork server of the env processes (pid {self.server.pid}) did not "
                    f"start {self._name(p)} ({e!r}); if an import of its preload failed, its "
                    f"traceback is printed above. Preload: {self.server.preload}"
                ) from None
        child.close()
        self._procs[p], self._conns[p] = proc, parent
        self._sent[p] = True  # its "ready" message is due

    def _attach(self, p: int) -> None:
        """Tells process p (started) to write its envs' large observations into their blocks
        (nothing where none of its envs has one)."""
        blocks = [self._blocks[i] for i in self._groups[p]]
        if not any(blocks):
            return
        self._send(p, ("attach", [(b.name, b.fields, b.region_bytes) if b else None
                                  for b in blocks]))
        self._sent[p] = False  # not answered (a failure answers the next command)

    def _send(self, p: int, msg) -> None:
        try:
            self._conns[p].send(msg)
        except (OSError, ValueError):
            pass  # dead: the receive that follows finds out and restarts it
        self._sent[p] = True

    def _recv(self, p: int, timeout: float, what: str) -> list:
        conn, proc = self._conns[p], self._procs[p]
        deadline = time.monotonic() + timeout
        while not conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
            if not proc.is_alive():
                raise _Lost(f"{self._name(p)} (pid {proc.pid}) died ({_exit(proc.exitcode)}) "
                            f"during {what}")
            if time.monotonic() >= deadline:
                raise _Lost(f"{self._name(p)} (pid {proc.pid}) did not answer a {what} "
                            f"within {timeout:.0f} s (hung)")
        return self._read(p, what)

    def _read(self, p: int, what: str) -> list:
        """Process p's answer (there is one to read), one entry per env of it, their
        observations out of their blocks."""
        try:
            kind, payload = self._conns[p].recv()
        except (EOFError, OSError):  # its end of the pipe closed: it is dying or dead
            proc = self._procs[p]
            proc.join(timeout=1.0)
            raise _Lost(f"{self._name(p)} (pid {proc.pid}) died ({_exit(proc.exitcode)}) "
                        f"during {what}") from None
        self._sent[p] = False
        if kind == "error":
            raise SimulatorError(f"{self._name(p)} raised during {what}:\n{payload}")
        if what == "start":
            return payload
        return [self._take(self._blocks[i], x) for i, x in zip(self._groups[p], payload)]

    @staticmethod
    def _take(block: Optional[ObsBlock], answer):
        """One env's answer with its observations read out of its block."""
        if block is None:
            return answer
        if not isinstance(answer, StepResult):
            return block.take(answer, shm.OBS)
        obs = block.take(answer.obs, shm.OBS)
        same = answer.final_obs is answer.obs
        final = obs if same else block.take(answer.final_obs, shm.FINAL_OBS)
        return replace(answer, obs=obs, final_obs=final)

    def _restart(self, p: int, cause: "_Lost") -> list:
        """Replaces process p; resets each of its envs as its last reset asked. Returns their
        new first obs. A replacement lost before it answers that reset is replaced again,
        until process p has been restarted ``max_restarts`` times in a row: then a
        SimulatorError names its first env, that env's task and the last error."""
        group = self._groups[p]
        while True:
            n = self._in_a_row[p]
            if n >= self.max_restarts:
                why = (f"lost again after {n} restart{'s' * (n != 1)} in a row with no episode "
                       "finished" if n else "lost") + f" (env.max_restarts={self.max_restarts})"
                envs = ("" if len(group) == 1 else f" (and env {group[1]} with it)"
                        if len(group) == 2 else f" (and envs {group[1]}-{group[-1]} with it)")
                raise SimulatorError(f"{self._label(group[0], self._options[group[0]])}{envs}: "
                                     f"its simulator process was {why}; not restarted any "
                                     f"more. Last error: {cause}")
            self._in_a_row[p] += 1
            self.restarts += 1
            lost = "its episode is" if len(group) == 1 else f"its {len(group)} episodes are"
            log.warning("%s; restarting it (%s discarded)", cause, lost)
            self._replace(p)
            seeds = [None if self._seeds[i] is None else
                     (self._seeds[i] + RESTART_SEED_STRIDE * self.restarts) & 0x7FFFFFFF
                     for i in group]
            try:
                self._recv(p, self.start_timeout, "start")
                self._attach(p)
                self._send(p, ("reset", [(s, self._options[i]) for s, i in zip(seeds, group)]))
                return self._recv(p, self.timeout, "reset")
            except _Lost as e:  # the replacement was lost too
                cause = e

    def _replace(self, p: int) -> None:
        """Kills process p if it lives on, and starts a new one from the server."""
        proc = self._procs[p]
        # exit code 255 without a death: its fork server died, and the process may live on
        if proc.is_alive() or proc.exitcode == 255:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended (and was reaped) since is_alive looked
                pass
        proc.join(timeout=10)
        self._conns[p].close()
        self._spawn(p)


def _exit(code: Optional[int]) -> str:
    """'exit code 3', or the signal that ended a process: 'killed by SIGSEGV'.

    >>> _exit(-9), _exit(1), _exit(None)
    ('killed by SIGKILL', 'exit code 1', 'its pipe closed; no exit code yet')
    """
    if code is None:
        return "its pipe closed; no exit code yet"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


class _Lost(Exception):
    """A process died or hung (internal: handled by a restart, or a SimulatorError if the
    replacement is lost too)."""


def _serve(conn, env_fns: Sequence[Callable[[], gym.Env]]) -> None:
    """The subprocess: builds its envs, then answers reset/step/close for all of them (one
    answer per env, in order) until told to stop, or until its parent is gone (ended with its
    run: a Ctrl-C, a failure). A lost parent ends it quietly: nobody is left to answer, and a
    traceback would only reach the terminal of a run that is ending."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # what the server imported is shared copy-on-write: keep the garbage collector from
    # writing to (and so copying) every page of it
    gc.freeze()
    envs: list = []
    try:
        for fn in env_fns:
            envs.append(fn())
        answer = ("ok", [(env.observation_space, env.action_space) for env in envs])
    except Exception:
        _answer(conn, ("error", traceback.format_exc()))
        return
    blocks: list = [None] * len(envs)  # the parent's, once it says so
    parent = _answer(conn, answer)
    while parent:
        try:
            cmd, arg = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):  # the parent is gone
            parent = False
            break
        answer = None
        try:
            if cmd == "reset":
                obs = [env.reset(seed=seed, options=options)[0]
                       for env, (seed, options) in zip(envs, arg)]
                answer = ("ok", [b.put(o, shm.OBS) if b else o for b, o in zip(blocks, obs)])
            elif cmd == "step":
                actions, frames = arg
                results = [step_env(env, a, frames) for env, a in zip(envs, actions)]
                answer = ("ok", [_put_step(b, r) if b else r for b, r in zip(blocks, results)])
            elif cmd == "attach":
                blocks = [ObsBlock.attach(*a) if a else None for a in arg]
            elif cmd == "close":
                break
        except Exception:
            answer = ("error", traceback.format_exc())
            if cmd == "attach":  # answers the parent's next command: nothing else may follow
                _answer(conn, answer)
                break
        if answer is not None and not _answer(conn, answer):
            parent = False
    try:
        for block in blocks:
            if block is not None:
                block.close()
        for env in envs:
            env.close()
    except Exception:
        if parent:  # the parent reads it in its own error (a dead process)
            raise


def _answer(conn, message) -> bool:
    """Sends ``message`` to the parent; False if the parent is gone (its end of the pipe
    closed: the process ended)."""
    try:
        conn.send(message)
        return True
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return False


def _put_step(block: ObsBlock, result: StepResult) -> StepResult:
    """``result`` with its observations' large arrays in ``block`` (an observation that is
    also the final one is written once)."""
    obs = block.put(result.obs, shm.OBS)
    final = obs if result.final_obs is result.obs else block.put(result.final_obs, shm.FINAL_OBS)
    return replace(result, obs=obs, final_obs=final)


def check_processes(cfg: ProcessEnvConfig) -> None:
    """Raises EnvError for ``step_timeout_s``, ``max_restarts`` or ``shared_memory`` out of
    range: what the
    ``check_config`` of an adapter with these settings calls, at start-up."""
    if not cfg.step_timeout_s > 0:
        raise EnvError(f"env.step_timeout_s={cfg.step_timeout_s}: must be > 0; give the seconds "
                       "a step may take before its process counts as hung (default 300).")
    if cfg.max_restarts < 0:
        raise EnvError(f"env.max_restarts={cfg.max_restarts}: must be >= 0; give how often one "
                       "simulator process may be restarted in a row (0: never; default 3).")
    if cfg.shared_memory not in shm.MODES:
        raise EnvError(f"env.shared_memory={cfg.shared_memory!r}: must be one of "
                       f"{', '.join(shm.MODES)}; 'auto' sends images through shared memory and "
                       "state vectors as messages.")
