"""An out-of-tree transport on a real persistent store: Redis (Debian's `redis-server`, the
`redis` client from PyPI). Run it from a fresh clone with one command:

    python3 -m pip install nox && python3 -m nox -s redis_example

(the session installs redis-server with apt-get when it runs as root, starts it on loopback on a
free port, runs the clauses, checks the server holds no key afterwards and stops it by PID).
Against a server of your own: `RLCONFORM_REDIS_URL=redis://host:6379/15 nox -s conformance --
--backend examples.redis_store:backend --requirements redis`; use a scratch database, and
expect it to hold exactly what it held before when the run ends.

Store layout. Names are escaped (`urllib.parse.quote(name, safe="")`: never a `:`), so every
record's Redis key is `<prefix><kind>:<partition>[:<key>]` and no two (partition, key) pairs
meet in one record:
- `row:<p>:<k>`   a hash: field name -> the row's raw bytes (`torch.Tensor.view(uint8)`:
                  exact for every dtype, bfloat16 included, with no numpy dtype needed), and
                  `tags` -> the row's tag in typed JSON (below);
- `keys:<p>`      a set of the partition's keys (escaped);
- `layout:<p>`    a hash: field -> its layout, one per (partition, field): `{"kind": "dense" |
                  "jagged", "dtype", "trailing"}`; a put in another layout is refused; the
                  partition exists while this hash does (so a partition whose keys were all
                  cleared lists []);
- a row's shape: dense rows have the recorded trailing shape; a jagged row's first dim is its
  byte count / (element size x trailing), so 0-d rows (a 1-D column) and empty rows (a media-free
  sample) need no header of their own; only where a trailing dim is 0 (rows of no bytes, whatever
  their length) the row's hash holds its length beside it (`n:<field>`).
Tags are typed JSON: every value is a pair [type, payload] (tuple, list, dict with its key
types, str, int, float, bool, None), so tuples, int keys, nan, inf and -0.0 come back as they
were put; nothing is unpickled from a store another process writes. Names and tags are checked
with the contract's own validators (rlconform.reference_impl.dataplane check_name, check_tags).

What the suite found in the first version (one hash per `partition:key`, JSON tags, a key set
at `partition:__keys__`, a dtype/shape header per row; written in an afternoon): a put of a 1-D
column crashed (`view(torch.uint8)` of a 0-d row); a key named `__keys__` hit the key set
(Redis WRONGTYPE); partition `p:a` key `b` and partition `p` key `a:b` were one record
(DP-NAME-ISOLATION); tuples came back as lists (DP-TAG-VALUES); a field re-put in another
layout was accepted per key (DP-LAYOUT-CONFLICT); a get of no keys crashed in `torch.stack`
and a put of no keys sent `SADD` with no member (DP-EMPTY). docs/writing-a-transport.md walks
through each.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from urllib.parse import quote, unquote

import torch

from rlconform.conformance.backend import Backend, StoreUnreachable
from rlconform.reference_impl.dataplane import check_get, check_name, check_names, check_tags

URL_ENV = "RLCONFORM_REDIS_URL"


def _q(name: str) -> str:
    return quote(name, safe="")


# -- typed JSON for tags ----------------------------------------------------------------------
def _enc(v):
    if v is None:
        return ["n", None]
    if isinstance(v, bool):
        return ["b", v]
    if isinstance(v, int):
        return ["i", str(v)]  # JSON numbers are doubles in other readers: ints travel as text
    if isinstance(v, float):
        return ["f", repr(v)]  # 'nan', 'inf', '-0.0' round-trip through float()
    if isinstance(v, str):
        return ["s", v]
    if isinstance(v, tuple):
        return ["t", [_enc(x) for x in v]]
    if isinstance(v, list):
        return ["l", [_enc(x) for x in v]]
    return ["d", [[_enc(k), _enc(x)] for k, x in v.items()]]


def _dec(pair):
    kind, p = pair
    if kind == "n":
        return None
    if kind == "b":
        return bool(p)
    if kind == "i":
        return int(p)
    if kind == "f":
        return float(p)
    if kind == "s":
        return p
    if kind == "t":
        return tuple(_dec(x) for x in p)
    if kind == "l":
        return [_dec(x) for x in p]
    return {_dec(k): _dec(x) for k, x in p}


def _dump_tag(tag: dict) -> bytes:
    return json.dumps(_enc(tag), ensure_ascii=False).encode("utf-8")


def _load_tag(raw: bytes | None) -> dict:
    return {} if raw is None else _dec(json.loads(raw))


# -- columns --------------------------------------------------------------------------------
def _layout(name: str, col) -> dict:
    if not isinstance(col, torch.Tensor):
        raise TypeError(f"column {name!r} is a {type(col).__name__}; columns are tensors")
    if col.is_nested:
        if col.layout is not torch.jagged:
            raise TypeError(f"column {name!r} is a strided nested tensor; use layout=torch.jagged")
        return {"kind": "jagged", "dtype": str(col.dtype).removeprefix("torch."),
                "trailing": list(col.values().shape[1:])}
    if col.dim() == 0:
        raise ValueError(f"column {name!r} is 0-d; a column needs one row per key")
    return {"kind": "dense", "dtype": str(col.dtype).removeprefix("torch."),
            "trailing": list(col.shape[1:])}


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().reshape(-1)  # reshape: a 0-d row has no bytes view
    if t.numel() and t.stride(0) != 1:  # a one-element `x[::2]` keeps its stride through
        t = t.clone(memory_format=torch.contiguous_format)  # `.contiguous()`: ask for strides 1
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _rows(col: torch.Tensor) -> list[torch.Tensor]:
    return list(col.unbind()) if col.is_nested else list(col.unbind(0))


def _no_bytes(layout: dict) -> bool:
    """Whether the layout's rows hold no bytes whatever their length (a trailing dim is 0):
    then a jagged row's length is stored beside it (`n:<field>`), not counted from its bytes."""
    return layout["kind"] == "jagged" and math.prod(layout["trailing"]) == 0


def _column(layout: dict, raws: list[bytes], lengths: list[bytes | None]) -> torch.Tensor:
    """A column from its rows' bytes and stored lengths (`n:<field>`, read only where the
    layout's rows hold no bytes: `_no_bytes`)."""
    dtype = getattr(torch, layout["dtype"])
    trailing = layout["trailing"]
    width = torch.empty((), dtype=dtype).element_size() * math.prod(trailing)
    flat = torch.frombuffer(bytearray(b"".join(raws)), dtype=torch.uint8) if any(raws) else \
        torch.empty(0, dtype=torch.uint8)
    values = flat.view(dtype)
    if layout["kind"] == "dense":
        return values.reshape(len(raws), *trailing)
    rows = [int(n) for n in lengths] if _no_bytes(layout) else [len(r) // width for r in raws]
    offsets = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.long)
    return torch.nested.nested_tensor_from_jagged(values.reshape(sum(rows), *trailing),
                                                  offsets=offsets)


class RedisTransport:
    """The transport surface on one Redis database (see the module docstring)."""

    def __init__(self, address: dict | None = None):
        import redis

        self._address = dict(address or _session_address())
        self.r = redis.Redis(host=self._address["host"], port=self._address["port"],
                             db=self._address["db"])
        self.prefix = self._address["prefix"]

    def address(self) -> dict:
        """Where another process reopens this store (capability `multiprocess`)."""
        return dict(self._address)

    def _k(self, kind: str, partition: str, key: str | None = None) -> str:
        tail = f":{_q(key)}" if key is not None else ""
        return f"{self.prefix}{kind}:{_q(partition)}{tail}"

    def put(self, partition: str, keys: Sequence[str], columns: dict,
            tags: Sequence[dict] | None = None) -> None:
        check_name("partition", partition)
        keys = check_names("key", keys)
        check_tags(tags, len(keys))
        layouts = {check_name("field", n): _layout(n, c) for n, c in columns.items()}
        for name, col in columns.items():
            if int(col.size(0)) != len(keys):
                raise ValueError(f"column {name!r} has {col.size(0)} rows for {len(keys)} keys")
        if not keys:  # the contract: a put of no keys stores nothing
            return
        stored = self.r.hgetall(self._k("layout", partition))
        for name, layout in layouts.items():
            old = stored.get(name.encode())
            if old is not None and json.loads(old) != layout:
                raise ValueError(f"column {name!r} in partition {partition!r} was written as "
                                 f"{json.loads(old)}, now as {layout}")
        old_tags = self.r.pipeline()
        for k in keys:
            old_tags.hget(self._k("row", partition, k), "tags")
        merged = []
        for i, raw in enumerate(old_tags.execute()):
            tag = _load_tag(raw)
            tag.update(tags[i] if tags is not None else {})
            merged.append(tag)
        pipe = self.r.pipeline(transaction=True)
        if layouts:
            pipe.hset(self._k("layout", partition),
                      mapping={n: json.dumps(lay) for n, lay in layouts.items()})
        else:
            pipe.hsetnx(self._k("layout", partition), "", "{}")  # the partition exists
        rows = {name: _rows(col) for name, col in columns.items()}
        for i, k in enumerate(keys):
            pipe.hset(self._k("row", partition, k), mapping={
                "tags": _dump_tag(merged[i]),
                **{f"f:{name}": _raw(rows[name][i]) for name in columns},
                **{f"n:{name}": int(rows[name][i].shape[0]) for name in columns
                   if _no_bytes(layouts[name])}})
        pipe.sadd(self._k("keys", partition), *[_q(k) for k in keys])
        pipe.execute()

    def _layouts(self, partition: str) -> dict[str, dict]:
        raw = self.r.hgetall(self._k("layout", partition))
        return {n.decode(): json.loads(v) for n, v in raw.items() if n}

    def get(self, partition: str, keys: Sequence[str], select_fields: Sequence[str] | None = None
            ) -> tuple[dict, list[dict]]:
        keys, fields = check_get(partition, keys, select_fields)
        layouts = self._layouts(partition)
        for f in fields:
            if f not in layouts:
                raise KeyError(f"field {f!r} not stored in partition {partition!r}")
        pipe = self.r.pipeline()
        for k in keys:
            pipe.hmget(self._k("row", partition, k),
                       ["tags", *[f"f:{f}" for f in fields], *[f"n:{f}" for f in fields]])
        found = pipe.execute()
        missing = [k for k, got in zip(keys, found) if got[0] is None]
        if missing:
            raise KeyError(f"keys {missing[:8]} not in partition {partition!r}")
        out = {}
        for j, f in enumerate(fields, start=1):
            raws = [got[j] for got in found]
            lengths = [got[j + len(fields)] for got in found]
            lacking = [k for k, r in zip(keys, raws) if r is None]
            if lacking:
                raise KeyError(f"field {f!r} missing for keys {lacking[:8]} in partition "
                               f"{partition!r}")
            out[f] = _column(layouts[f], raws, lengths)
        return out, [_load_tag(got[0]) for got in found]

    def list(self, partition: str) -> list[str]:
        check_name("partition", partition)
        members = self.r.smembers(self._k("keys", partition))  # none held: []
        return [unquote(m.decode()) for m in members]

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> None:
        check_name("partition", partition)
        if keys is None:
            members = self.r.smembers(self._k("keys", partition))
            names = [self._k("row", partition, unquote(m.decode())) for m in members]
            self.r.delete(*names, self._k("keys", partition), self._k("layout", partition))
            return
        keys = check_names("key", keys)
        if not keys:
            return
        present = self.r.smismember(self._k("keys", partition), [_q(k) for k in keys])
        missing = [k for k, there in zip(keys, present) if not there]
        if missing:
            raise KeyError(f"cannot clear keys {missing[:8]}: not in partition {partition!r}")
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(*[self._k("row", partition, k) for k in keys])
        pipe.srem(self._k("keys", partition), *[_q(k) for k in keys])
        pipe.execute()

    def close(self) -> None:
        self.r.close()


# -- the session: a server of our own (by PID), or the one RLCONFORM_REDIS_URL names -----------
_ADDRESS: dict | None = None


def _session_address() -> dict:
    if _ADDRESS is None:
        raise RuntimeError("no Redis session: enter the backend's session first")
    return _ADDRESS


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(address: dict, timeout_s: float) -> Exception | None:
    import redis

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            redis.Redis(host=address["host"], port=address["port"], db=address["db"],
                        socket_connect_timeout=1).ping()
            return None
        except redis.exceptions.RedisError as exc:
            if time.monotonic() > deadline:
                return exc
            time.sleep(0.05)


@contextlib.contextmanager
def redis_server() -> Iterator[dict]:
    """`redis-server` on a free loopback port (no persistence, in a temporary folder), stopped
    by PID on exit; yields its address."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise StoreUnreachable(f"redis-server is not installed (apt-get install redis-server) "
                               f"and {URL_ENV} names no server")
    workdir = tempfile.mkdtemp(prefix="rlconform-redis-")
    address = {"host": "127.0.0.1", "port": _free_port(), "db": 0}
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(address["port"]),
                             "--save", "", "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        why = _ping(address, 10.0)
        if why is not None:
            raise StoreUnreachable(f"redis-server (pid {proc.pid}) did not answer: {why}")
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def session() -> Iterator[None]:
    """Use the server RLCONFORM_REDIS_URL names (StoreUnreachable when it does not answer),
    or start one of our own for the run (`redis_server`)."""
    global _ADDRESS
    url = os.environ.get(URL_ENV)
    with contextlib.ExitStack() as stack:
        if url:
            from urllib.parse import urlparse

            u = urlparse(url)
            address = {"host": u.hostname or "127.0.0.1", "port": u.port or 6379,
                       "db": int((u.path or "/0").lstrip("/") or 0)}
            why = _ping(address, 2.0)
            if why is not None:
                raise StoreUnreachable(f"Redis at {url} ({URL_ENV}): {why}")
        else:
            address = dict(stack.enter_context(redis_server()))
        # every run writes under a prefix of its own: a shared database keeps others' data apart
        address["prefix"] = f"rlc-{uuid.uuid4().hex[:8]}:"
        _ADDRESS = address
        try:
            yield
        finally:
            _ADDRESS = None


def db_size(address: dict) -> int:
    import redis

    return int(redis.Redis(host=address["host"], port=address["port"],
                           db=address["db"]).dbsize())


def main(argv: list[str]) -> int:
    """`nox -s redis_example`: start a server, run the clauses against it (arguments go to
    `rlconform run`), and fail unless the server holds exactly the keys it held before."""
    with redis_server() as address:
        before = db_size(address)
        env = dict(os.environ, **{URL_ENV: f"redis://{address['host']}:{address['port']}/0"})
        code = subprocess.call([sys.executable, "-m", "rlconform.conformance.cli", "run",
                                "--backend", "examples.redis_store:backend", *argv], env=env)
        after = db_size(address)
    print(f"redis-store: the server held {before} keys before the run and {after} after it")
    if after != before:
        print("redis-store: FAILED: the run did not leave the store as it found it")
        return code or 1
    return code


backend = Backend.from_reference(
    "redis-store",
    description="example out-of-tree transport: one Redis hash per row, typed JSON tags",
    transport=RedisTransport,
    session=session,
    capabilities={"partitions", "multiprocess"},
    notes={"object_columns": "rows are raw tensor bytes; per-row dict columns are not stored"},
)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
