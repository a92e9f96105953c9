"""Fork servers: where simulator processes are forked from.

Simulator processes (:mod:`m2flow.envs.procs`) are forked from a *fork server* (one per set of
preloaded modules, in each process that owns slots): a fresh interpreter that imports once
what every simulator process shares (torch, gymnasium, the simulator's package:
:class:`~m2flow.envs.procs.EnvRecipe` names them), with thread counts set to one before those
imports, and then forks a process per env. The forked processes
share those modules' memory copy-on-write instead of importing their own copy, and start in
milliseconds instead of seconds. Nothing live is ever forked: the server never builds an env,
opens a renderer or touches CUDA; each process builds its own env after the fork. A server that
dies is started again on the next fork.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import threading
import time
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from typing import Optional, Sequence

# a simulator process steps one env on one core (the placement counts one core per process);
# set in the fork server before it imports torch, numpy or MKL, which read them at load
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
               "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
SIM_THREADS = "1"
BASE_PRELOAD = ("numpy", "gymnasium")  # what every env process runs (and procs, its own)


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


class ServerProcess(mp.context.ForkServerProcess):
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
