"""Channels: named, typed, keyed FIFO queues into a worker group, with back-pressure.

The queue of a channel lives in the process of the worker that reads it; there is no relay.
``put`` from the same process is a plain queue put; from another process on the same machine
it is one frame on a Unix socket into that worker (:mod:`m2flow.pipelines.transport`; a
fraction of a Ray call's cost, docs/results.md#engine-and-tests); from another machine it is
one Ray call. An item that leaves its process, either way,
has its tensors copied to host memory first (``transport.to_host``: GPU data crosses as CPU
tensors, and the receiver moves them to its device); a same-process put hands it over as is.
A remote Ray put returns once sent; the next put on the same key first waits for the
previous one to land, so each producer keeps at most one item in flight per key: order is
kept, a key's full queue still blocks the producer (one item later), and errors surface at the
next put or at ``flush()``. Each key (e.g. a pipeline stage, (env rank, stage)) has its own
FIFO and is read by one rank, ``rank_of(key)``.

>>> from m2flow.pipelines import Cluster, ClusterConfig, WorkerGroup, RankResources, Worker
>>> g = WorkerGroup(Cluster(ClusterConfig(backend="local")), "sink", Worker,
...                 [RankResources(0, 1.0, ())])
>>> ch = Channel("obs", g, capacity=2, item_type=int)
>>> ch.put(7, key=0); ch.get(key=0)
7
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import uuid
from typing import Any, Hashable, Optional

from m2flow.pipelines import transport
from m2flow.pipelines.errors import WorkerError

_ENDPOINTS: dict[tuple[str, int], "_Endpoint"] = {}
_LOCK = threading.Lock()
CLOSED_CHECK_S = 0.2  # a get or put waiting on a key notices this soon that it was closed


class ChannelTimeout(TimeoutError):
    """A put found a key's queue full, or a get found it empty, for longer than the timeout."""


class _Endpoint:
    def __init__(self, uid: str, capacity: int, rank: int, listen: bool):
        self.uid, self.capacity = uid, capacity
        self._fifos: dict[Hashable, queue.Queue] = {}
        self._lock = threading.Lock()
        self.closed = False
        self.listener = (
            transport.Listener(f"{uid.split('#')[1]}-{rank}", self._deliver) if listen else None
        )

    def _deliver(self, key: Hashable, item: Any, timeout: Optional[float]) -> bool:
        """An item from the socket: waits while its key's queue is full; False if it stayed full."""
        fifo = self.fifo(key)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.closed:
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            try:
                fifo.put(item, timeout=max(0.0, wait))
                return True
            except queue.Full:
                if deadline is not None and time.monotonic() >= deadline:
                    return False
        return False

    def fifo(self, key: Hashable) -> queue.Queue:
        with self._lock:
            if key not in self._fifos:
                self._fifos[key] = queue.Queue(maxsize=self.capacity)
            return self._fifos[key]

    def put(self, key: Hashable, item: Any, timeout: Optional[float]) -> None:
        fifo = self.fifo(key)
        for wait in self._slices(key, timeout):
            try:
                return fifo.put(item, timeout=wait)
            except queue.Full:
                pass
        raise ChannelTimeout(
            f"channel {self.uid.split('#')[0]!r} key {key!r} stayed full "
            f"({self.capacity} items) for {timeout:g} s: its reader is not reading."
        )

    def get(self, key: Hashable, timeout: Optional[float]):
        """The key's oldest item; ``queue.Empty`` after ``timeout`` seconds."""
        fifo = self.fifo(key)
        for wait in self._slices(key, timeout):
            try:
                return fifo.get(timeout=wait)
            except queue.Empty:
                pass
        raise queue.Empty

    def _slices(self, key: Hashable, timeout: Optional[float]):
        """Waits of at most ``CLOSED_CHECK_S`` until ``timeout``; a closed endpoint (its
        worker group shut down, e.g. after Ctrl-C) ends a wait in this process at once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            yield CLOSED_CHECK_S if left is None else max(0.0, min(CLOSED_CHECK_S, left))
            if self.closed:
                raise RuntimeError(f"channel {self.uid.split('#')[0]!r} key {key!r} was "
                                   "closed while waited on (its worker group was shut down).")
            if left is not None and left <= CLOSED_CHECK_S:
                return


def open_endpoint(uid: str, rank: int, capacity: int, listen: bool = False):
    """Hosts the key queues of ``uid`` for ``rank`` here; ``listen``: also accept socket puts.

    Returns ``(hostname, socket address)`` (address None without ``listen``).
    """
    with _LOCK:
        if (uid, rank) not in _ENDPOINTS:
            _ENDPOINTS[(uid, rank)] = _Endpoint(uid, capacity, rank, listen)
        listener = _ENDPOINTS[(uid, rank)].listener
    return transport.hostname(), listener.address if listener else None


def close_endpoint(uid: str, rank: int) -> None:
    with _LOCK:
        endpoint = _ENDPOINTS.pop((uid, rank), None)
    if endpoint is not None:
        endpoint.closed = True
        if endpoint.listener is not None:
            endpoint.listener.close()


def local_endpoint(uid: str, rank: int) -> Optional[_Endpoint]:
    return _ENDPOINTS.get((uid, rank))


class Channel:
    """A named queue into ``receiver`` (a WorkerGroup); picklable, so workers can hold it.

    Args:
        name: what errors call it.
        receiver: the worker group whose ranks read from it.
        capacity: items per key before ``put`` blocks (back-pressure). Default 2.
        item_type: every item must be an instance of it. Default ``object``.
        routes: optional ``{key: rank}``; otherwise an int key (or a tuple's first int)
            modulo the receiver's world size picks the rank.
    """

    def __init__(
        self,
        name: str,
        receiver,
        *,
        capacity: int = 2,
        item_type: type = object,
        routes: Optional[dict] = None,
    ):
        if capacity < 1:
            raise ValueError(f"channel {name!r}: capacity={capacity} must be >= 1.")
        self.name = name
        self.uid = f"{name}#{uuid.uuid4().hex[:8]}"
        self.capacity = capacity
        self.item_type = item_type
        self.routes = dict(routes or {})
        self.world_size = receiver.world_size
        bad = {k: r for k, r in self.routes.items() if not 0 <= r < self.world_size}
        if bad:
            raise ValueError(
                f"channel {name!r}: routes {bad} point at ranks its receiver "
                f"'{receiver.name}' does not have (ranks 0-{self.world_size - 1})."
            )
        self.backend = receiver.backend
        self._handles = list(receiver.handles) if receiver.backend == "ray" else None
        self._in_flight: dict = {}  # key -> ObjectRef of this producer's last remote put
        # per rank: (hostname, Unix socket address) of its endpoint, for same-machine puts
        # (the receiver's worker class: this module knows workers only through their group)
        self._addresses = receiver.call(receiver.worker_cls._m2flow_open_channel, self.uid,
                                        capacity).wait()
        self._receiver = receiver

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_receiver"] = None  # workers need the handles, not the group object
        state["_in_flight"] = {}  # in-flight puts belong to the process that made them
        return state

    def rank_of(self, key: Hashable) -> int:
        try:
            if key in self.routes:
                return self.routes[key]
        except TypeError:
            raise KeyError(f"channel {self.name!r}: key {key!r} is not hashable.") from None
        head = key[0] if isinstance(key, tuple) and key else key
        if not isinstance(head, int) or isinstance(head, bool):
            raise KeyError(
                f"channel {self.name!r}: key {key!r} has no route; use an int key (or a tuple "
                "starting with an int) or pass routes={key: rank}."
            )
        return head % self.world_size

    def put(self, item: Any, key: Hashable = 0, timeout: Optional[float] = None) -> None:
        """Enqueues ``item`` under ``key``; blocks while that key's queue is full. Tensors that
        leave this process go as CPU copies (see the module docstring)."""
        if not isinstance(item, self.item_type):
            raise TypeError(
                f"channel {self.name!r} carries {self.item_type.__name__}, "
                f"got {type(item).__name__}."
            )
        rank = self.rank_of(key)
        endpoint = local_endpoint(self.uid, rank)
        if endpoint is not None:
            endpoint.put(key, item, timeout)
            return
        if self._handles is None:
            raise RuntimeError(f"channel {self.name!r} is closed or was never opened.")
        host, address = self._addresses[rank]
        if address is not None and host == transport.hostname():
            self._put_socket(address, rank, key, item, timeout)
            return
        import ray

        previous = self._in_flight.pop(key, None)
        if previous is not None:
            ray.get(previous)
        self._in_flight[key] = self._handles[rank]._m2flow_channel_put.remote(
            self.uid, key, transport.to_host(item), timeout
        )

    def _put_socket(self, address: str, rank: int, key, item, timeout) -> None:
        with self._socket_errors(f"key {key!r}", timeout):
            transport.send(address, (self.uid, rank, key), key, item, timeout)

    def _settle_sockets(self) -> None:
        with self._socket_errors(None, None):
            transport.settle(self.uid)

    @contextlib.contextmanager
    def _socket_errors(self, where: Optional[str], timeout: Optional[float]):
        try:
            yield
        except TimeoutError as e:
            if where is None:  # from flush(): the key and timeout come with the error
                key, timeout = e.args
                where = f"key {key!r}"
            after = f" for {timeout:g} s" if timeout is not None else ""
            raise ChannelTimeout(
                f"channel {self.name!r} {where} stayed full ({self.capacity} items){after}: its "
                "reader is not reading."
            ) from None
        except ConnectionError as e:
            raise WorkerError(
                f"channel {self.name!r}: a rank of its receiver is gone (its process died or "
                f"the channel was closed): {e}"
            ) from None

    def flush(self) -> None:
        """Waits until every item this producer put has landed (raises the first error)."""
        self._settle_sockets()
        if self._in_flight:
            import ray

            refs, self._in_flight = list(self._in_flight.values()), {}
            ray.get(refs)

    def get(self, key: Hashable = 0, timeout: Optional[float] = None) -> Any:
        """Dequeues the oldest item of ``key``; must run in the process of its rank."""
        rank = self.rank_of(key)
        endpoint = local_endpoint(self.uid, rank)
        if endpoint is None:
            raise RuntimeError(
                f"channel {self.name!r}: key {key!r} is read by rank {rank} of its receiver; "
                "get() was called from a process that does not host that rank."
            )
        try:
            return endpoint.get(key, timeout)
        except queue.Empty:
            raise ChannelTimeout(
                f"channel {self.name!r} key {key!r} got nothing for {timeout:g} s: its "
                "producer is slow, stuck or dead."
            ) from None

    def qsize(self, key: Hashable = 0) -> int:
        """Items waiting under ``key``; only in the process that hosts its rank."""
        endpoint = local_endpoint(self.uid, self.rank_of(key))
        if endpoint is None:
            raise RuntimeError(f"channel {self.name!r}: key {key!r} is not hosted here.")
        return endpoint.fifo(key).qsize()

    def close(self) -> None:
        transport.close_connections(self.uid)
        if self._receiver is not None and self._receiver.handles:
            self._receiver.call(self._receiver.worker_cls._m2flow_close_channel, self.uid).wait()
