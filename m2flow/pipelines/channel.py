"""Channels: named, typed, keyed FIFO queues into a worker group, with back-pressure.

The queue of a channel lives in the process of the worker that reads it. ``put`` from another
process is one Ray call straight into that worker (no relay actor); ``put`` from the same
process is a plain queue put. A remote put returns once sent; the next put on the same lane
first waits for the previous one to land, so each producer keeps at most one item in flight
per lane: order is kept, a full lane still blocks the producer (one item later), and errors
surface at the next put or at ``flush()``. Keys are lanes (e.g. pipeline stages): each key has its own FIFO
and is read by one rank, ``rank_of(key)``.

>>> from m2flow.pipelines import Cluster, ClusterConfig, WorkerGroup, RankResources, Worker
>>> g = WorkerGroup(Cluster(ClusterConfig(backend="local")), "sink", Worker,
...                 [RankResources(0, 1.0, ())])
>>> ch = Channel("obs", g, capacity=2, item_type=int)
>>> ch.put(7, key=0); ch.get(key=0)
7
"""

from __future__ import annotations

import queue
import threading
import uuid
from typing import Any, Hashable, Optional

_ENDPOINTS: dict[tuple[str, int], "_Endpoint"] = {}
_LOCK = threading.Lock()


class ChannelTimeout(TimeoutError):
    """A put found the lane full, or a get found it empty, for longer than the timeout."""


class _Endpoint:
    def __init__(self, uid: str, capacity: int):
        self.uid, self.capacity = uid, capacity
        self._lanes: dict[Hashable, queue.Queue] = {}
        self._lock = threading.Lock()

    def lane(self, key: Hashable) -> queue.Queue:
        with self._lock:
            if key not in self._lanes:
                self._lanes[key] = queue.Queue(maxsize=self.capacity)
            return self._lanes[key]

    def put(self, key: Hashable, item: Any, timeout: Optional[float]) -> None:
        try:
            self.lane(key).put(item, timeout=timeout)
        except queue.Full:
            raise ChannelTimeout(
                f"channel {self.uid.split('#')[0]!r} lane {key!r} stayed full "
                f"({self.capacity} items) for {timeout:g} s: its reader is not reading."
            ) from None


def open_endpoint(uid: str, rank: int, capacity: int) -> None:
    with _LOCK:
        _ENDPOINTS.setdefault((uid, rank), _Endpoint(uid, capacity))


def close_endpoint(uid: str, rank: int) -> None:
    with _LOCK:
        _ENDPOINTS.pop((uid, rank), None)


def local_endpoint(uid: str, rank: int) -> Optional[_Endpoint]:
    return _ENDPOINTS.get((uid, rank))


class Channel:
    """A named queue into ``receiver`` (a WorkerGroup); picklable, so workers can hold it.

    Args:
        name: what errors call it.
        receiver: the worker group whose ranks read from it.
        capacity: items per lane before ``put`` blocks (back-pressure). Default 2.
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
        self._in_flight: dict = {}  # lane -> ObjectRef of this producer's last remote put
        receiver.call("_m2flow_open_channel", self.uid, capacity).wait()
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
        """Enqueues ``item`` on lane ``key``; blocks while that lane is full."""
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
        import ray

        previous = self._in_flight.pop(key, None)
        if previous is not None:
            ray.get(previous)
        self._in_flight[key] = self._handles[rank]._m2flow_channel_put.remote(
            self.uid, key, item, timeout
        )

    def flush(self) -> None:
        """Waits until every item this producer put has landed (raises the first error)."""
        if self._in_flight:
            import ray

            refs, self._in_flight = list(self._in_flight.values()), {}
            ray.get(refs)

    def get(self, key: Hashable = 0, timeout: Optional[float] = None) -> Any:
        """Dequeues the oldest item of lane ``key``; must run in the process of its rank."""
        rank = self.rank_of(key)
        endpoint = local_endpoint(self.uid, rank)
        if endpoint is None:
            raise RuntimeError(
                f"channel {self.name!r}: lane {key!r} is read by rank {rank} of its receiver; "
                "get() was called from a process that does not host that rank."
            )
        try:
            return endpoint.lane(key).get(timeout=timeout)
        except queue.Empty:
            raise ChannelTimeout(
                f"channel {self.name!r} lane {key!r} got nothing for {timeout:g} s: its "
                "producer is slow, stuck or dead."
            ) from None

    def qsize(self, key: Hashable = 0) -> int:
        """Items waiting in lane ``key``; only in the process that hosts its rank."""
        endpoint = local_endpoint(self.uid, self.rank_of(key))
        if endpoint is None:
            raise RuntimeError(f"channel {self.name!r}: lane {key!r} is not hosted here.")
        return endpoint.lane(key).qsize()

    def close(self) -> None:
        if self._receiver is not None and self._receiver.handles:
            self._receiver.call("_m2flow_close_channel", self.uid).wait()
