"""Same-machine transport of channel items: Unix sockets between processes.

A Ray actor call costs ~0.5-1 ms here; a channel carries one item per env step and stage, so
that would be most of a ManiSkill step. Between processes on one machine a channel instead
sends length-prefixed frames over a Unix socket (~40 us round trip): the receiving worker
listens on one socket per channel, and each (producer process, lane) pair holds one
connection, so items of a lane arrive in order and a full lane never blocks another lane.

Flow control matches the Ray path: the receiver answers each frame with one byte once the
item is in its lane (or once the lane stayed full for the put's timeout), and a producer
sends the next frame of a lane only after the previous answer: at most one item in flight.

Items are pickled (protocol 5); a TensorDict travels as its flat leaves (numpy arrays) plus
batch size, which is several times cheaper than pickling the TensorDict object.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import tempfile
import threading
from typing import Any, Callable, Hashable, Optional

import torch

_HEADER = struct.Struct("!Q")  # frame length


# -- codec ---------------------------------------------------------------------------------
LANDED, FULL = b"\x01", b"\x00"  # the receiver's answer to each frame


def encode(key: Hashable, item: Any, timeout: Optional[float] = None) -> bytes:
    return pickle.dumps((key, timeout, _pack(item)), protocol=5)


def decode(data: bytes) -> tuple[Hashable, Optional[float], Any]:
    key, timeout, packed = pickle.loads(data)
    return key, timeout, _unpack(packed)


class _PackedTD:
    __slots__ = ("batch_size", "leaves")

    def __init__(self, batch_size, leaves):
        self.batch_size, self.leaves = batch_size, leaves


def _pack(item: Any) -> Any:
    if type(item) is not _TENSORDICT or item.device not in (None, _CPU):
        return item
    leaves = []
    for k, v in item.items(include_nested=True, leaves_only=True):
        leaves.append((k, v.numpy() if v.dtype in _NUMPY_DTYPES else v))
    return _PackedTD(tuple(item.batch_size), leaves)


def _unpack(packed: Any) -> Any:
    if type(packed) is not _PackedTD:
        return packed
    nested: dict = {}
    for k, v in packed.leaves:
        k = (k,) if isinstance(k, str) else k
        d = nested
        for part in k[:-1]:
            d = d.setdefault(part, {})
        d[k[-1]] = torch.from_numpy(v) if not isinstance(v, torch.Tensor) else v
    return _TENSORDICT(nested, batch_size=packed.batch_size)


def _tensordict_class():
    try:
        from tensordict import TensorDict
    except ImportError:  # the engine works without tensordict; items are then pickled as-is
        return None
    return TensorDict


_TENSORDICT = _tensordict_class()
_CPU = torch.device("cpu")
_NUMPY_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32,
                 torch.int16, torch.int8, torch.uint8, torch.bool}


# -- receiving side ------------------------------------------------------------------------
class Listener:
    """Accepts producer connections; hands each item to ``deliver(key, item, timeout)``.

    ``deliver`` blocks while the lane is full and returns False if it stayed full for the
    put's timeout (the item is dropped and the producer told so).
    """

    def __init__(self, name: str, deliver: Callable[[Hashable, Any, Optional[float]], bool]):
        self.address = os.path.join(
            tempfile.gettempdir(), f"m2flow-{os.getpid()}-{name}.sock"
        )
        if os.path.exists(self.address):
            os.unlink(self.address)
        self._deliver = deliver
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(64)
        self._conns: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"m2flow-accept-{name}").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            self._conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True,
                             name="m2flow-channel-reader").start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed:
                data = _recv_frame(conn)
                if data is None:
                    return  # the producer closed its end
                key, timeout, item = decode(data)
                landed = self._deliver(key, item, timeout)
                try:
                    conn.sendall(LANDED if landed else FULL)
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        for s in [self._sock, *self._conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        try:
            os.unlink(self.address)
        except FileNotFoundError:
            pass


def _recv_frame(conn: socket.socket) -> Optional[bytes]:
    head = _recv_exact(conn, _HEADER.size)
    if head is None:
        return None
    return _recv_exact(conn, _HEADER.unpack(head)[0])


def _recv_exact(conn: socket.socket, n: int) -> Optional[bytes]:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = conn.recv_into(view[got:], n - got)
        except OSError:
            return None
        if k == 0:
            return None
        got += k
    return bytes(buf)


# -- sending side --------------------------------------------------------------------------
class _Connection:
    def __init__(self, address: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(address)
        except OSError as e:
            self.sock.close()
            raise ConnectionError(str(e)) from None
        self.lock = threading.Lock()
        self.pending: Optional[float] = None  # timeout of the frame still unanswered, if any

    def settle(self) -> None:
        """Waits for the answer to the frame in flight (raises TimeoutError if it was FULL)."""
        if self.pending is None:
            return
        timeout, self.pending = self.pending, None
        # the receiver answers within the put's timeout; a silent one is hung or dead
        self.sock.settimeout(None if timeout is None else timeout + _GRACE_S)
        try:
            answer = self.sock.recv(1)
        except (socket.timeout, TimeoutError):
            raise ConnectionError("the receiver stopped answering") from None
        if answer == b"":
            raise ConnectionError("the receiver closed the connection")
        if answer == FULL:
            raise TimeoutError


_GRACE_S = 30.0
_CONNECTIONS: dict[tuple, _Connection] = {}
_CONNECTIONS_LOCK = threading.Lock()


def send(address: str, lane: tuple, key: Hashable, item: Any, timeout: Optional[float]) -> None:
    """Sends one item to the listener at ``address`` on this process's connection for ``lane``
    once the lane's previous item has landed. Raises ``TimeoutError`` if a put found its lane
    full for its timeout, ``ConnectionError`` if the receiver is gone."""
    frame = encode(key, item, timeout)
    conn = _connection(address, lane)
    with conn.lock:
        try:
            conn.settle()
            conn.sock.settimeout(None)
            conn.sock.sendall(_HEADER.pack(len(frame)) + frame)
            conn.pending = timeout
        except TimeoutError:
            raise
        except OSError as e:  # ConnectionError is one
            _drop(lane)
            raise ConnectionError(str(e)) from None


def settle(uid: str) -> None:
    """Waits until every item this process sent on channel ``uid`` has landed."""
    with _CONNECTIONS_LOCK:
        conns = [(lane, c) for lane, c in _CONNECTIONS.items() if lane[0] == uid]
    for lane, conn in conns:
        with conn.lock:
            conn_timeout = conn.pending
            try:
                conn.settle()
            except TimeoutError:
                raise TimeoutError(lane[2], conn_timeout) from None
            except OSError as e:
                _drop(lane)
                raise ConnectionError(str(e)) from None


def _connection(address: str, lane: tuple) -> _Connection:
    with _CONNECTIONS_LOCK:
        conn = _CONNECTIONS.get(lane)
        if conn is None:
            conn = _CONNECTIONS[lane] = _Connection(address)
        return conn


def _drop(lane: tuple) -> None:
    with _CONNECTIONS_LOCK:
        conn = _CONNECTIONS.pop(lane, None)
    if conn is not None:
        conn.sock.close()


def close_connections(uid: str) -> None:
    """Closes this process's connections of channel ``uid`` (lane tuples start with it)."""
    with _CONNECTIONS_LOCK:
        lanes = [lane for lane in _CONNECTIONS if lane[0] == uid]
    for lane in lanes:
        _drop(lane)


def hostname() -> str:
    return socket.gethostname()
