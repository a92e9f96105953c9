"""Same-machine transport of channel items: Unix sockets between processes.

A channel carries one item per env step and stage, and a Ray actor call per item would cost a
large part of a ManiSkill step. Between processes on one machine a channel instead sends
length-prefixed frames over a Unix socket, a small fraction of a Ray call's round trip
(docs/results.md#engine-and-tests): the receiving worker
listens on one socket per channel, and each (producer process, key) pair holds one
connection, so items of a key arrive in order and a key's full queue never blocks another key.

Flow control matches the Ray path: the receiver answers each frame with one byte once the
item is in its key's queue (or once that stayed full for the put's timeout), and a producer
sends the next frame of a key only after the previous answer: at most one item in flight.

Items are pickled (protocol 5); a TensorDict travels as its flat leaves (numpy arrays) plus
batch size, which is several times cheaper than pickling the TensorDict object.

Device data crosses a process boundary in host memory, copied at the sender (:func:`to_host`):
every tensor of an item that leaves its process (this socket path, and the Ray call a channel
makes to another machine) is moved to the CPU leaf by leaf, whatever the TensorDict's own
``device`` says (None: its leaves may sit anywhere). The receiver gets CPU tensors and moves
them to its own device (``batch.to(self.device)``). Why not hand CUDA memory over as it is:

- a receiver on another node, or one placed without a GPU (an env worker on CPU, the driver),
  cannot open it: a pickled CUDA tensor fails to load there;
- CUDA IPC (``torch.multiprocessing``'s handles) only works on one node and between processes
  that see the same device, while each worker here sees only its own GPUs under its own
  ``CUDA_VISIBLE_DEVICES`` numbering; the producer must also keep every sent storage alive
  until the consumer has let go of it, which a bounded channel of per-step items cannot track;
- pickling a CUDA TensorDict whole copies GPU -> host -> GPU anyway, only later and hidden.

The copies of one item start together (``non_blocking=True``: PyTorch allocates their host side
in pinned memory, from its caching host allocator, so they run as DMA) and the sender waits
once per device before the bytes leave. A put to a rank in the same process (the local
backend, or a worker feeding itself) hands the item over as it is, on its device.
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
    item = to_host(item)
    if type(item) is not _TENSORDICT:
        return item
    leaves = []
    for k, v in item.items(include_nested=True, leaves_only=True):
        leaves.append((k, v.numpy() if v.dtype in _NUMPY_DTYPES else v))
    return _PackedTD(tuple(item.batch_size), leaves)


def _unpack(packed: Any) -> Any:
    if type(packed) is not _PackedTD:
        return packed
    leaves = [(k, torch.from_numpy(v) if not isinstance(v, torch.Tensor) else v)
              for k, v in packed.leaves]
    return _TENSORDICT(_nest(leaves), batch_size=packed.batch_size)


def _nest(leaves: list) -> dict:
    """``[(key or nested key tuple, value)]`` -> nested dicts, as a TensorDict takes them."""
    nested: dict = {}
    for k, v in leaves:
        k = (k,) if isinstance(k, str) else k
        d = nested
        for part in k[:-1]:
            d = d.setdefault(part, {})
        d[k[-1]] = v
    return nested


def to_host(item: Any) -> Any:
    """``item`` with every tensor in host memory: the form in which data leaves a process.

    A TensorDict (any ``device``; None: each leaf may sit on its own device) comes back with
    the same keys and batch size and CPU leaves (``device='cpu'``); a tensor, or a list, tuple
    or dict of them, likewise; anything else as it is. Leaves already on the CPU are not
    copied, and an item with nothing off the CPU comes back itself.

    >>> from tensordict import TensorDict
    >>> td = TensorDict({"obs": {"state": torch.zeros(2, 3)}}, batch_size=[2])
    >>> to_host(td) is td
    True
    """
    if _TENSORDICT is not None and isinstance(item, _TENSORDICT_BASE):
        return _tensordict_to_host(item)
    if isinstance(item, torch.Tensor):
        return item if item.device == _CPU else _host_copies([item])[0]
    if type(item) in (list, tuple):
        return type(item)(to_host(v) for v in item)
    if type(item) is dict:
        return {k: to_host(v) for k, v in item.items()}
    return item


def _tensordict_to_host(td) -> Any:
    leaves = list(td.items(include_nested=True, leaves_only=True))
    away = [i for i, (_, v) in enumerate(leaves)
            if isinstance(v, torch.Tensor) and v.device != _CPU]
    if not away and td.device in (None, _CPU):
        return td
    copies = _host_copies([leaves[i][1] for i in away])
    for i, copy in zip(away, copies):
        leaves[i] = (leaves[i][0], copy)
    return _TENSORDICT(_nest(leaves), batch_size=td.batch_size, device=_CPU)


def _host_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of ``tensors``. CUDA ones are all started before any is waited for
    (``non_blocking``: into pinned host memory), then each device's stream is waited for
    once, so the copies are complete when this returns."""
    copies = [t.to(_CPU, non_blocking=t.is_cuda) for t in tensors]
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()
    return copies


def _tensordict_classes():
    try:
        from tensordict import TensorDict, TensorDictBase
    except ImportError:  # the engine works without tensordict; items are then pickled as-is
        return None, None
    return TensorDict, TensorDictBase


_TENSORDICT, _TENSORDICT_BASE = _tensordict_classes()
_CPU = torch.device("cpu")
_NUMPY_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32,
                 torch.int16, torch.int8, torch.uint8, torch.bool}


# -- receiving side ------------------------------------------------------------------------
class Listener:
    """Accepts producer connections; hands each item to ``deliver(key, item, timeout)``.

    ``deliver`` blocks while the key's queue is full and returns False if it stayed full for the
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


def send(address: str, conn_id: tuple, key: Hashable, item: Any,
         timeout: Optional[float]) -> None:
    """Sends one item to the listener at ``address`` on this process's connection ``conn_id``
    ((channel, rank, key)) once the key's previous item has landed. Raises ``TimeoutError`` if
    a put found its key's queue full for its timeout, ``ConnectionError`` if the receiver is
    gone."""
    frame = encode(key, item, timeout)
    conn = _connection(address, conn_id)
    with conn.lock:
        try:
            conn.settle()
            conn.sock.settimeout(None)
            conn.sock.sendall(_HEADER.pack(len(frame)) + frame)
            conn.pending = timeout
        except TimeoutError:
            raise
        except OSError as e:  # ConnectionError is one
            _drop(conn_id)
            raise ConnectionError(str(e)) from None


def settle(uid: str) -> None:
    """Waits until every item this process sent on channel ``uid`` has landed."""
    with _CONNECTIONS_LOCK:
        conns = [(conn_id, c) for conn_id, c in _CONNECTIONS.items() if conn_id[0] == uid]
    for conn_id, conn in conns:
        with conn.lock:
            conn_timeout = conn.pending
            try:
                conn.settle()
            except TimeoutError:
                raise TimeoutError(conn_id[2], conn_timeout) from None
            except OSError as e:
                _drop(conn_id)
                raise ConnectionError(str(e)) from None


def _connection(address: str, conn_id: tuple) -> _Connection:
    with _CONNECTIONS_LOCK:
        conn = _CONNECTIONS.get(conn_id)
        if conn is None:
            conn = _CONNECTIONS[conn_id] = _Connection(address)
        return conn


def _drop(conn_id: tuple) -> None:
    with _CONNECTIONS_LOCK:
        conn = _CONNECTIONS.pop(conn_id, None)
    if conn is not None:
        conn.sock.close()


def close_connections(uid: str) -> None:
    """Closes this process's connections of channel ``uid`` (the connection ids start with it)."""
    with _CONNECTIONS_LOCK:
        conn_ids = [conn_id for conn_id in _CONNECTIONS if conn_id[0] == uid]
    for conn_id in conn_ids:
        _drop(conn_id)


def hostname() -> str:
    return socket.gethostname()
