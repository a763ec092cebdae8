"""The reference transport, reachable from other processes: no Ray, no server binary.

`ServedDataPlane` is the in-memory data plane (dataplane.py) that can also be opened from
another process on the same machine. `address()` starts serving it (once, lazily) on a loopback
socket from a thread of the owning process and returns a picklable `StoreAddress`;
`StoreClient(address)` is the transport surface over that socket, for a data-parallel rank
(reference_impl/ranks.py). The owner's own calls never touch the socket.

Wire: each request is one `pickle` message over `multiprocessing.connection` (authenticated
with a random key): `(method, args)`; columns travel as raw bytes with dtype and shape (dense)
or values + row lengths (jagged), never as pickled tensors, so nothing is shared between
processes and nothing aliases: the store copies on put and on get as in process. Errors raised
by the store come back as the same exception type with the same message (`KeyError` naming a
missing partition, key or field). A client call waits at most `timeout_s`; a store that is gone
gives `StoreUnavailable`.
"""

from __future__ import annotations

import contextlib
import pickle
import secrets
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener

import torch
from torch import Tensor

from .bitexact import as_bytes
from .dataplane import InMemoryDataPlane, column_layout, jagged_from_values
from .objects import ObjectColumn

DEFAULT_TIMEOUT_S = 60.0


class StoreUnavailable(RuntimeError):
    """The served store did not answer (its process is gone, or it timed out)."""


@dataclass(frozen=True)
class StoreAddress:
    """Where a served reference store listens (loopback), and the key that authenticates."""

    host: str
    port: int
    authkey: bytes

    def __repr__(self) -> str:  # never print the key
        return f"StoreAddress({self.host}:{self.port})"


# -- columns as bytes -------------------------------------------------------------------------
def _tensor(raw: bytes, dtype: torch.dtype, shape: Sequence[int]) -> Tensor:
    if not raw:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(tuple(shape))


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def pack_column(name: str, col) -> tuple:
    """A column as plain bytes: ("dense", dtype, shape, raw) or ("jagged", dtype, trailing,
    raw values, row lengths); an `ObjectColumn` (capability `object_columns`) as ("object",
    rows), its tensors pickled by value. Validates like the store does (tensor, jagged layout,
    >= 1-D)."""
    if isinstance(col, ObjectColumn):
        return ("object", col.clone().rows)
    layout = column_layout(name, col)
    if layout.kind == "jagged":
        rows = col.unbind()
        lengths = [int(r.shape[0]) for r in rows]
        values = (torch.cat(rows) if rows
                  else torch.empty((0, *layout.trailing), dtype=col.dtype))
        return ("jagged", str(col.dtype), list(layout.trailing), as_bytes(values), lengths)
    return ("dense", str(col.dtype), list(col.shape), as_bytes(col))


def unpack_column(packed: tuple):
    if packed[0] == "object":
        return ObjectColumn(packed[1])
    kind, dtype = packed[0], _dtype(packed[1])
    if kind == "dense":
        return _tensor(packed[3], dtype, packed[2])
    trailing, raw, lengths = packed[2], packed[3], packed[4]
    values = _tensor(raw, dtype, (sum(lengths), *trailing))
    return jagged_from_values(values, lengths)


def pack_columns(columns: dict[str, Tensor]) -> dict[str, tuple]:
    return {name: pack_column(name, col) for name, col in columns.items()}


def unpack_columns(packed: dict[str, tuple]) -> dict[str, Tensor]:
    return {name: unpack_column(p) for name, p in packed.items()}


_ERRORS = {"KeyError": KeyError, "ValueError": ValueError, "TypeError": TypeError,
           "RuntimeError": RuntimeError, "IndexError": IndexError}


def _send(conn: Connection, obj) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection):
    return pickle.loads(conn.recv_bytes())


# -- the owner side -----------------------------------------------------------------------------
class ServedDataPlane(InMemoryDataPlane):
    """The in-memory data plane, servable to other processes (`address()`)."""

    name = "in-memory-served"

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()
        self._listener: Listener | None = None
        self._address: StoreAddress | None = None
        self._conns: list[Connection] = []
        self._stopping = False

    # every call of the surface holds the lock: the serving threads call the same methods
    def put(self, partition, keys, columns, tags=None):
        with self._lock:
            return super().put(partition, keys, columns, tags)

    def get(self, partition, keys, select_fields=None):
        with self._lock:
            return super().get(partition, keys, select_fields)

    def list(self, partition):
        with self._lock:
            return super().list(partition)

    def clear(self, partition, keys=None):
        with self._lock:
            return super().clear(partition, keys)

    def address(self) -> StoreAddress:
        """Serve this store on a loopback port (from now until close) and say where."""
        with self._lock:
            self._check_open()
            if self._address is None:
                key = secrets.token_bytes(32)
                self._listener = Listener(("127.0.0.1", 0), authkey=key)
                host, port = self._listener.address
                self._address = StoreAddress(host, port, key)
                threading.Thread(target=self._accept, name=f"rlconform-store-{port}",
                                 daemon=True).start()
            return self._address

    def _accept(self) -> None:
        listener = self._listener
        while not self._stopping:
            try:
                conn = listener.accept()
            except Exception:  # noqa: BLE001 - closed listener, failed handshake: go on or stop
                if self._stopping:
                    return
                continue
            if self._stopping:
                conn.close()
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        try:
            while True:
                try:
                    method, args = _recv(conn)
                except (EOFError, OSError):
                    return
                except TypeError:
                    # stop() closed this connection under the blocked read (its handle is now
                    # None, which multiprocessing reports as a TypeError)
                    if conn.closed:
                        return
                    raise
                try:
                    answer = ("ok", self._call(method, args))
                except Exception as exc:  # noqa: BLE001 - every error goes back to the caller
                    kind = type(exc).__name__ if type(exc).__name__ in _ERRORS else "RuntimeError"
                    msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
                    answer = ("error", kind, msg)
                try:
                    _send(conn, answer)
                except (EOFError, OSError):
                    return
        finally:
            # stop() may have closed it first, from its own thread: a second close of the
            # handle fails (EBADF), and there is nothing left to release
            with contextlib.suppress(OSError):
                conn.close()

    def _call(self, method: str, args: tuple):
        if method == "put":
            partition, keys, packed, tags = args
            return self.put(partition, keys, unpack_columns(packed), tags)
        if method == "get":
            partition, keys, select_fields = args
            cols, tags = self.get(partition, keys, select_fields)
            return pack_columns(cols), tags
        if method == "list":
            return self.list(*args)
        if method == "clear":
            return self.clear(*args)
        if method == "ping":
            return "pong"
        raise ValueError(f"unknown store method {method!r}")

    def close(self) -> None:
        """Stop serving (clients get StoreUnavailable), then drop every partition."""
        with self._lock:
            self._stopping = True
            listener, self._listener = self._listener, None
            if listener is not None:
                _wake(self._address.host, self._address.port)
                with contextlib.suppress(Exception):
                    listener.close()
            for conn in self._conns:
                with contextlib.suppress(Exception):
                    conn.close()
            self._conns.clear()
            super().close()


def _wake(host: str, port: int) -> None:
    """Unblock a thread waiting in `Listener.accept()`: a bare TCP connect, closed at once (it
    fails the handshake, so accept raises). Never an authenticated `Client`: if the accept
    thread has already left its loop, that handshake would wait forever for a challenge."""
    with contextlib.suppress(OSError):
        socket.create_connection((host, port), timeout=1.0).close()


# -- the client side ----------------------------------------------------------------------------
class StoreClient:
    """The transport surface of a `ServedDataPlane` in another process (see module docstring).

    `close()` closes the connection only: the store and its data belong to the owner.
    """

    name = "in-memory-served-client"

    def __init__(self, address: StoreAddress, timeout_s: float | None = None):
        if not isinstance(address, StoreAddress):
            raise TypeError(f"address must be a StoreAddress (from ServedDataPlane.address()), "
                            f"got {type(address).__name__}")
        self.address = address
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self._lock = threading.Lock()
        try:
            self._conn = Client((address.host, address.port), authkey=address.authkey)
        except OSError as exc:
            raise StoreUnavailable(f"reference store at {address.host}:{address.port} is not "
                                   f"reachable: {exc}") from None
        self._closed = False

    def _ask(self, method: str, *args):
        if self._closed:
            raise RuntimeError("transport is closed")
        where = f"reference store at {self.address.host}:{self.address.port}"
        with self._lock:
            try:
                _send(self._conn, (method, args))
                if not self._conn.poll(self.timeout_s):
                    raise StoreUnavailable(f"{where}: {method} did not answer within "
                                           f"{self.timeout_s:g}s")
                answer = _recv(self._conn)
            except (EOFError, OSError) as exc:
                raise StoreUnavailable(f"{where} is gone ({type(exc).__name__} on {method})") \
                    from None
        if answer[0] == "error":
            raise _ERRORS[answer[1]](answer[2])
        return answer[1]

    def put(self, partition: str, keys: Sequence[str], columns: dict[str, Tensor],
            tags: Sequence[dict] | None = None) -> None:
        self._ask("put", partition, list(keys), pack_columns(columns),
                  None if tags is None else [dict(t) for t in tags])

    def get(self, partition: str, keys: Sequence[str], select_fields: Sequence[str] | None = None
            ) -> tuple[dict[str, Tensor], list[dict]]:
        if select_fields is None:
            raise TypeError("get requires select_fields: name the fields to fetch")
        packed, tags = self._ask("get", partition, list(keys), list(select_fields))
        return unpack_columns(packed), tags

    def list(self, partition: str) -> list[str]:
        return self._ask("list", partition)

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> None:
        self._ask("clear", partition, None if keys is None else list(keys))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(Exception):
                self._conn.close()
