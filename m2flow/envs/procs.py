"""Single gymnasium envs behind one interface, in this process or one subprocess each.

A *slot* holds one env and steps it with same-step auto-reset: when an episode ends, the
slot resets the env at once and returns the final observation beside the new episode's
first one. ``LocalSlots`` keeps the envs in this process; ``ProcessSlots`` runs each in its
own process (forkserver, so a live renderer in the parent is never forked) and survives a
process that dies or hangs: it is killed, started again with the same env and the same reset
options (the same task), and that env's step comes back marked ``discarded`` with the first
observation of a fresh episode. Nothing from the lost episode is returned as if it were data.

The processes are forked from a *fork server* (:mod:`m2flow.envs.fork`) that imported once
what every simulator process shares, so they start in milliseconds and share those modules'
memory.

Large observation arrays (images) come back through a shared-memory block per process instead
of the pickled message (:mod:`m2flow.envs.shm`; ``shared_memory`` says which arrays), which the
slots own: a restarted process attaches to its slot's block, and ``close`` unlinks them all.
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


def step_env(env: gym.Env, action) -> StepResult:
    """Steps ``env`` and resets it if the episode ended (same-step auto-reset)."""
    obs, reward, terminated, truncated, info = env.step(action)
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

    def step_async(self, actions: np.ndarray) -> None:
        self._actions = actions

    def step_wait(self) -> list[StepResult]:
        actions, self._actions = self._actions, None
        return [step_env(env, a) for env, a in zip(self.envs, actions)]

    def close(self) -> None:
        for env in self.envs:
            env.close()


class ProcessSlots:
    """One process per env, forked from a fork server; a process that dies or hangs past
    ``timeout`` is replaced from the same server (a server that died is started again).

    Args:
        env_fns: picklable callables that each build one env; where they are
            :class:`EnvRecipe` objects, the server preloads the first one's ``preload`` modules.
        timeout: seconds a step or reset may take before the process counts as hung.
        start_timeout: seconds a process may take to build its env.
        shared_memory: which observation arrays come back through a shared-memory block
            instead of the pickled message: 'auto' (default) those of at least
            :data:`m2flow.envs.shm.MIN_BYTES` (images), 'on' every fixed-shape array, 'off' none.
        max_restarts: restarts of one process in a row (no episode of it finished between
            them, a replacement that dies before its first reset counting too) before a
            :class:`SimulatorError` ends the run instead; 0: never restart.
        label: ``label(i, last reset options)`` names env i's simulator and task in that
            error (default: "env process i").
    """

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], timeout: float = 300.0,
                 start_timeout: float = 600.0, shared_memory: str = "auto",
                 max_restarts: int = 3,
                 label: Optional[Callable[[int, Optional[dict]], str]] = None):
        if shared_memory not in shm.MODES:
            raise EnvError(f"env.shared_memory={shared_memory!r}: use one of {list(shm.MODES)} "
                           "('auto' sends images through shared memory, state as messages).")
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
        self._in_a_row = [0] * n  # restarts of each process since its last finished episode
        self._procs: list = [None] * n
        self._conns: list = [None] * n
        self._seeds: list[Optional[int]] = [None] * n
        self._options: list[Optional[dict]] = [None] * n
        self._sent = [False] * n
        self._blocks: list[Optional[ObsBlock]] = [None] * n
        for i in range(n):  # start all first: they build their envs in parallel
            self._spawn(i)
        try:
            spaces = [self._recv(i, self.start_timeout, "start") for i in range(n)]
            for i, (obs_space, _) in enumerate(spaces):
                fields, nbytes = shm.layout(obs_space, shared_memory)
                if fields:
                    self._blocks[i] = ObsBlock.create(fields, nbytes, tag=str(i))
                    self._attach(i)
        except (_Lost, SimulatorError) as e:
            self.close()
            raise SimulatorError(f"{e} (while building its env; no env was started)") from None
        except BaseException:  # e.g. no room for a block: stop the processes, unlink the rest
            self.close()
            raise
        self.observation_space, self.action_space = spaces[0]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

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
        """Sends every process its reset; ``reset_wait`` collects the first obs."""
        for i, (s, o) in enumerate(zip(seeds, options)):
            self._seeds[i], self._options[i] = s, o
            self._send(i, ("reset", (s, o)))

    def reset_wait(self) -> list:
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
                result = self._recv(i, self.timeout, "step")
            except _Lost as e:
                obs = self._restart(i, e)
                result = StepResult(obs, obs, 0.0, False, True, False, discarded=True)
            else:
                if result.terminated or result.truncated:
                    self._in_a_row[i] = 0  # it finished an episode: it works
            out.append(result)
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
        for block in self._blocks:  # after the joins: no process writes or attaches any more
            if block is not None:
                block.close(unlink=True)

    # -- one process ---------------------------------------------------------------------
    def _spawn(self, i: int) -> None:
        for attempt in range(2):
            parent, child = mp.Pipe()
            proc = ServerProcess(self.server, target=_serve, args=(child, self.env_fns[i]),
                                  daemon=True, name=f"m2flow-env-{i}")
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
                    f"start env process {i} ({e!r}); if an import of its preload failed, its "
                    f"traceback is printed above. Preload: {self.server.preload}"
                ) from None
        child.close()
        self._procs[i], self._conns[i] = proc, parent
        self._sent[i] = True  # its "ready" message is due

    def _attach(self, i: int) -> None:
        """Tells process i (started) to write its large observations into its block."""
        block = self._blocks[i]
        self._send(i, ("attach", (block.name, block.fields, block.region_bytes)))
        self._sent[i] = False  # not answered (a failure answers the next command)

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
                raise _Lost(f"env process {i} (pid {proc.pid}) died ({_exit(proc.exitcode)}) "
                            f"during {what}")
            if time.monotonic() >= deadline:
                raise _Lost(f"env process {i} (pid {proc.pid}) did not answer a {what} "
                            f"within {timeout:.0f} s (hung)")
        return self._read(i, what)

    def _read(self, i: int, what: str):
        """Process i's answer (there is one to read), its observations out of its block."""
        try:
            kind, payload = self._conns[i].recv()
        except (EOFError, OSError):  # its end of the pipe closed: it is dying or dead
            proc = self._procs[i]
            proc.join(timeout=1.0)
            raise _Lost(f"env process {i} (pid {proc.pid}) died ({_exit(proc.exitcode)}) "
                        f"during {what}") from None
        self._sent[i] = False
        if kind == "error":
            raise SimulatorError(f"env process {i} raised during {what}:\n{payload}")
        block = self._blocks[i]
        if block is None or what == "start":
            return payload
        if not isinstance(payload, StepResult):
            return block.take(payload, shm.OBS)
        obs = block.take(payload.obs, shm.OBS)
        same = payload.final_obs is payload.obs
        final = obs if same else block.take(payload.final_obs, shm.FINAL_OBS)
        return replace(payload, obs=obs, final_obs=final)

    def _restart(self, i: int, cause: "_Lost"):
        """Replaces process i; resets it as its last reset asked. Returns the new first obs.
        A replacement lost before it answers that reset is replaced again, until process i
        has been restarted ``max_restarts`` times in a row: then a SimulatorError names the
        env, its task and the last error."""
        while True:
            n = self._in_a_row[i]
            if n >= self.max_restarts:
                why = (f"lost again after {n} restart{'s' * (n != 1)} in a row with no episode "
                       "finished" if n else "lost") + f" (env.max_restarts={self.max_restarts})"
                raise SimulatorError(f"{self._label(i, self._options[i])}: its simulator process "
                                     f"was {why}; not restarted any more. Last error: {cause}")
            self._in_a_row[i] += 1
            self.restarts += 1
            log.warning("%s; restarting it (its episode is discarded)", cause)
            self._replace(i)
            seed = self._seeds[i]
            if seed is not None:
                seed = (seed + RESTART_SEED_STRIDE * self.restarts) & 0x7FFFFFFF
            try:
                self._recv(i, self.start_timeout, "start")
                if self._blocks[i] is not None:
                    self._attach(i)
                self._send(i, ("reset", (seed, self._options[i])))
                return self._recv(i, self.timeout, "reset")
            except _Lost as e:  # the replacement was lost too
                cause = e

    def _replace(self, i: int) -> None:
        """Kills process i if it lives on, and starts a new one from the server."""
        proc = self._procs[i]
        # exit code 255 without a death: its fork server died, and the process may live on
        if proc.is_alive() or proc.exitcode == 255:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended (and was reaped) since is_alive looked
                pass
        proc.join(timeout=10)
        self._conns[i].close()
        self._spawn(i)


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


def _serve(conn, env_fn: Callable[[], gym.Env]) -> None:
    """The subprocess: builds one env, then answers reset/step/close until told to stop, or
    until its parent is gone (ended with its run: a Ctrl-C, a failure). A lost parent ends it
    quietly: nobody is left to answer, and a traceback would only reach the terminal of a run
    that is ending."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # what the server imported is shared copy-on-write: keep the garbage collector from
    # writing to (and so copying) every page of it
    gc.freeze()
    try:
        env = env_fn()
        answer = ("ok", (env.observation_space, env.action_space))
    except Exception:
        _answer(conn, ("error", traceback.format_exc()))
        return
    block: Optional[ObsBlock] = None  # the parent's, once it says so
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
                seed, options = arg
                obs = env.reset(seed=seed, options=options)[0]
                answer = ("ok", block.put(obs, shm.OBS) if block else obs)
            elif cmd == "step":
                result = step_env(env, arg)
                answer = ("ok", _put_step(block, result) if block else result)
            elif cmd == "attach":
                block = ObsBlock.attach(*arg)
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
        if block is not None:
            block.close()
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
    """Raises EnvError for ``step_timeout_s`` or ``shared_memory`` out of range: what the
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
