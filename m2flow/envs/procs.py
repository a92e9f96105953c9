"""Single gymnasium envs behind one interface, in this process or one subprocess each.

A *slot* holds one env and steps it with same-step auto-reset: when an episode ends, the
slot resets the env at once and returns the final observation beside the new episode's
first one. ``LocalSlots`` keeps the envs in this process; ``ProcessSlots`` runs each in its
own process (forkserver, so a live renderer in the parent is never forked) and survives a
process that dies or hangs: it is killed, started again with the same env and the same reset
options (the same task), and that env's step comes back marked ``discarded`` with the first
observation of a fresh episode. Nothing from the lost episode is returned as if it were data.

The processes are forked from a *fork server* (one per set of preloaded modules, in each
process that owns slots): a fresh interpreter that imports once what every simulator process
shares (torch, gymnasium, the simulator's package: :class:`EnvRecipe` names them), with thread
counts set to one before those imports, and then forks a process per env. The forked processes
share those modules' memory copy-on-write instead of importing their own copy, and start in
milliseconds instead of seconds. Nothing live is ever forked: the server never builds an env,
opens a renderer or touches CUDA; each process builds its own env after the fork. A server that
dies is started again on the next fork.

Large observation arrays (images) come back through a shared-memory block per process instead
of the pickled message (:mod:`m2flow.envs.shm`; ``shared_memory`` says which arrays), which the
slots own: a restarted process attaches to its slot's block, and ``close`` unlinks them all.
"""

from __future__ import annotations

import gc
import io
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from typing import Any, Callable, Optional, Sequence

import gymnasium as gym
import numpy as np

from m2flow.envs import shm
from m2flow.envs.base import EnvError
from m2flow.envs.shm import ObsBlock

log = logging.getLogger(__name__)

RESTART_SEED_STRIDE = 1_000_003  # a restarted env's reset seed: its last seed + k * this
# a simulator process steps one env on one core (the placement counts one core per process);
# set in the fork server before it imports torch, numpy or MKL, which read them at load
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
               "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
SIM_THREADS = "1"
BASE_PRELOAD = ("numpy", "gymnasium", "m2flow.envs.procs")  # what every env process runs
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


_servers: dict = {}
_servers_lock = threading.Lock()
_environ_lock = threading.Lock()


def fork_server(preload: Sequence[str] = (), environ: Sequence[tuple] = ()) -> "_ForkServer":
    """This process's fork server for ``preload`` and ``environ`` (one per distinct pair),
    launched now if it is not running. It imports in the background: call this early (before
    the parent's own heavy imports) and the imports of both overlap.

    >>> fork_server().pid > 0
    True
    """
    key = (BASE_PRELOAD + tuple(m for m in preload if m not in BASE_PRELOAD),
           tuple(sorted(environ)))
    with _servers_lock:
        server = _servers.get(key)
        if server is None:
            server = _servers[key] = _ForkServer(*key)
    server.ensure_running()
    return server


class _ForkServer(forkserver.ForkServer):
    """multiprocessing's fork server, with its own preload list and environment (the
    module-global one has a single preload list for the whole process)."""

    def __init__(self, preload: tuple, environ: tuple):
        super().__init__()
        self.set_forkserver_preload(list(preload))
        self.environ = {**{v: SIM_THREADS for v in THREAD_VARS}, **dict(environ)}

    @property
    def pid(self) -> Optional[int]:
        return self._forkserver_pid

    @property
    def preload(self) -> list:
        return list(self._preload_modules)

    def wait_exit(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s for a server that was seen dying to end, without reaping
        it (ensure_running reaps it, then launches a new one). True if it has ended."""
        pid, deadline = self._forkserver_pid, time.monotonic() + timeout
        while pid is not None:
            try:
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
            except ChildProcessError:  # reaped already
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def ensure_running(self) -> None:
        # the server inherits this process's environment when it is launched: set its own for
        # the launch (a lock, since os.environ is process-wide), then put ours back
        with _environ_lock:
            saved = {k: os.environ.get(k) for k in self.environ}
            os.environ.update(self.environ)
            try:
                super().ensure_running()
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v


class _ServerPopen(popen_forkserver.Popen):
    """popen_forkserver.Popen through a given server; leaves out the parent's ``__main__``
    (a Ray worker's or a CLI's: the child would import all of it) unless the process object
    refers to it."""

    def __init__(self, process_obj, server: _ForkServer):
        self.server = server
        super().__init__(process_obj)

    def _launch(self, process_obj) -> None:  # popen_forkserver.Popen._launch, server swapped
        prep_data = spawn.get_preparation_data(process_obj._name)
        obj, buf = io.BytesIO(), io.BytesIO()
        mp.context.set_spawning_popen(self)
        try:
            reduction.dump(process_obj, obj)
            if b"__main__" not in obj.getvalue():
                prep_data.pop("init_main_from_path", None)
                prep_data.pop("init_main_from_name", None)
            reduction.dump(prep_data, buf)
        finally:
            mp.context.set_spawning_popen(None)
        buf.write(obj.getvalue())
        self.sentinel, w = self.server.connect_to_new_process(self._fds)
        parent_w = os.dup(w)  # the child's sentinel of this parent
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _ServerProcess(mp.context.ForkServerProcess):
    """A process forked by a given :class:`_ForkServer`."""

    def __init__(self, server: _ForkServer, **kwargs):
        super().__init__(**kwargs)
        self._server = server

    def _Popen(self, process_obj):
        return _ServerPopen(process_obj, self._server)

    def __getstate__(self):  # the server (a lock, fds) stays in the parent
        state = dict(self.__dict__)
        state.pop("_server", None)
        return state


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
    """

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], timeout: float = 300.0,
                 start_timeout: float = 600.0, shared_memory: str = "auto"):
        if shared_memory not in shm.MODES:
            raise EnvError(f"env.shared_memory={shared_memory!r}: use one of {list(shm.MODES)} "
                           "('auto' sends images through shared memory, state as messages).")
        self.shared_memory = shared_memory
        self.env_fns = list(env_fns)
        self.timeout = timeout
        self.start_timeout = start_timeout
        recipe = self.env_fns[0] if isinstance(self.env_fns[0], EnvRecipe) else EnvRecipe(None)
        self.server = fork_server(recipe.preload, recipe.environ)
        self.restarts = 0
        """Processes replaced since construction (dead or hung)."""
        n = len(self.env_fns)
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
        for block in self._blocks:  # after the joins: no process writes or attaches any more
            if block is not None:
                block.close(unlink=True)

    # -- one process ---------------------------------------------------------------------
    def _spawn(self, i: int) -> None:
        for attempt in range(2):
            parent, child = mp.Pipe()
            proc = _ServerProcess(self.server, target=_serve, args=(child, self.env_fns[i]),
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
                raise _Lost(f"env process {i} (pid {proc.pid}) died with exit code "
                            f"{proc.exitcode} during {what}")
            if time.monotonic() >= deadline:
                raise _Lost(f"env process {i} (pid {proc.pid}) did not answer a {what} "
                            f"within {timeout:.0f} s (hung)")
        return self._read(i, what)

    def _read(self, i: int, what: str):
        """Process i's answer (there is one to read), its observations out of its block."""
        try:
            kind, payload = self._conns[i].recv()
        except (EOFError, OSError):
            raise _Lost(f"env process {i} (pid {self._procs[i].pid}) died during {what}") from None
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
        """Replaces process i; resets it as its last reset asked. Returns the new first obs."""
        self.restarts += 1
        log.warning("%s; restarting it (its episode is discarded)", cause)
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
        seed = self._seeds[i]
        if seed is not None:
            seed = (seed + RESTART_SEED_STRIDE * self.restarts) & 0x7FFFFFFF
        try:
            self._recv(i, self.start_timeout, "start")
            if self._blocks[i] is not None:
                self._attach(i)
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
    # what the server imported is shared copy-on-write: keep the garbage collector from
    # writing to (and so copying) every page of it
    gc.freeze()
    try:
        env = env_fn()
        conn.send(("ok", (env.observation_space, env.action_space)))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    block: Optional[ObsBlock] = None  # the parent's, once it says so
    while True:
        try:
            cmd, arg = conn.recv()
        except (EOFError, KeyboardInterrupt):
            break
        try:
            if cmd == "reset":
                seed, options = arg
                obs = env.reset(seed=seed, options=options)[0]
                conn.send(("ok", block.put(obs, shm.OBS) if block else obs))
            elif cmd == "step":
                result = step_env(env, arg)
                conn.send(("ok", _put_step(block, result) if block else result))
            elif cmd == "attach":
                block = ObsBlock.attach(*arg)
            elif cmd == "close":
                break
        except Exception:
            conn.send(("error", traceback.format_exc()))
            if cmd == "attach":  # answers the parent's next command: nothing else may follow
                break
    if block is not None:
        block.close()
    env.close()


def _put_step(block: ObsBlock, result: StepResult) -> StepResult:
    """``result`` with its observations' large arrays in ``block`` (an observation that is
    also the final one is written once)."""
    obs = block.put(result.obs, shm.OBS)
    final = obs if result.final_obs is result.obs else block.put(result.final_obs, shm.FINAL_OBS)
    return replace(result, obs=obs, final_obs=final)
