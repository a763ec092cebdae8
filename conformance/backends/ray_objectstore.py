"""A transport on Ray's object store: column blocks in plasma, an index actor for the keys.

put turns each column into one block (a numpy payload: dense `values`, or jagged `values` +
`offsets`) and `ray.put`s it once; the index actor records key -> (block, row), the tags and the
column's layout, and holds the block refs (as a borrower). Ray makes the putting process the
block's owner (`ray.put(_owner=)` was removed in Ray 2.56), and an owner's blocks die with it:
so a client reopened by address in another process (a rank, a rollout worker) hands its
payloads to the index actor, which puts them itself and owns them (one more copy), and they
outlive the writer. get asks the actor where each row lives, fetches the blocks with one
`ray.get` (zero-copy from shared memory) and copies the rows out into fresh tensors, so nothing
returned aliases the store. Every call has a timeout: a dead index actor or object owner gives
a BackendUnavailable, a hung one a BackendTimeout, never a hang.

Memory is freed per block: a block is released when no key of it remains (clear) or when the
transport closes (the index actor, the last holder of every block ref, is killed).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator, Sequence

from rlconform.conformance.backend import Backend, package_version
from rlconform.conformance.backends import _procs
from rlconform.reference_impl.dataplane import (
    check_get,
    check_name,
    check_names,
    check_tags,
    copy_tags,
)

DEFAULT_TIMEOUT_S = float(os.environ.get("RLCONFORM_RAY_TIMEOUT_S", "60"))
INDEX_NAMESPACE = "rlconform"  # the index actors are named, so a rank process can find one
DENSE, JAGGED = "dense", "jagged"


def _ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError("the ray-objectstore backend needs `pip install ray`") from exc
    return ray


class _Index:
    """partition -> key -> {"rows": {field: (block_no, row)}, "tags": dict}; layouts per field.

    Runs as a Ray actor with no CPU reserved. Errors come back as ("error", kind, message)
    values rather than raised, so the driver raises a clean KeyError/ValueError instead of a
    RayTaskError with the actor's traceback in its message.
    """

    def __init__(self) -> None:
        self.parts: dict[str, dict[str, dict]] = {}
        self.layouts: dict[str, dict[str, tuple]] = {}
        self.blocks: dict[int, list] = {}  # block_no -> [ObjectRef]: held here, so kept alive
        self.users: dict[int, int] = {}  # block_no -> live (key, field) rows pointing at it
        self.next_block = 0

    def pid(self) -> int:
        return os.getpid()

    def _drop_row(self, block_no: int) -> None:
        self.users[block_no] -= 1
        if self.users[block_no] == 0:
            del self.users[block_no], self.blocks[block_no]

    def put(self, partition: str, keys: list[str], blocks: dict[str, tuple], tags):
        layouts = self.layouts.get(partition, {})
        for name, (layout, _ref) in blocks.items():
            old = layouts.get(name)
            if old is not None and old != layout:
                return ("error", "ValueError", f"column {name!r} in partition {partition!r} was "
                        f"written as {old}, now as {layout}")
        part = self.parts.setdefault(partition, {})
        playouts = self.layouts.setdefault(partition, {})
        for name, (layout, ref) in blocks.items():
            no, self.next_block = self.next_block, self.next_block + 1
            self.blocks[no], self.users[no] = ref, 0
            playouts[name] = layout
            for i, k in enumerate(keys):
                rows = part.setdefault(k, {"rows": {}, "tags": {}})["rows"]
                if name in rows:
                    self._drop_row(rows[name][0])
                rows[name] = (no, i)
                self.users[no] += 1
            if self.users[no] == 0:
                del self.users[no], self.blocks[no]
        for i, k in enumerate(keys):
            entry = part.setdefault(k, {"rows": {}, "tags": {}})
            if tags is not None:
                entry["tags"].update(tags[i])
        return ("ok",)

    def put_payloads(self, partition: str, keys: list[str], payloads: dict[str, tuple], tags):
        """put for a client in another process: the blocks are put here, so this actor owns
        them and they outlive the writer (a block is owned by the process that put it)."""
        import ray

        return self.put(partition, keys, {name: (layout, [ray.put(payload)])
                                          for name, (layout, payload) in payloads.items()}, tags)

    def locate(self, partition: str, keys: list[str], fields: list[str]):
        """For each field: its layout, the blocks it needs, and (block index, row) per key."""
        part = self.parts.get(partition, {})
        missing = [k for k in keys if k not in part]
        if missing:
            return ("error", "KeyError", f"keys {missing[:8]} not in partition {partition!r}")
        out, refs, index = {}, [], {}
        for name in fields:
            if name not in self.layouts.get(partition, {}):
                return ("error", "KeyError", f"field {name!r} not stored in partition "
                        f"{partition!r}")
            lacking = [k for k in keys if name not in part[k]["rows"]]
            if lacking:
                return ("error", "KeyError", f"field {name!r} missing for keys {lacking[:8]} "
                        f"in partition {partition!r}")
            where: list[list[int]] = []  # runs [block index, first row, last row + 1]
            for k in keys:
                no, row = part[k]["rows"][name]
                if no not in index:
                    index[no] = len(refs)
                    refs.append(self.blocks[no])
                b = index[no]
                if where and where[-1][0] == b and where[-1][2] == row:
                    where[-1][2] = row + 1  # the next row of the same block: one run
                else:
                    where.append([b, row, row + 1])
            out[name] = (self.layouts[partition][name], where)
        return ("ok", out, refs, [dict(part[k]["tags"]) for k in keys])

    def list(self, partition: str):
        return ("ok", list(self.parts.get(partition, {})))  # a partition holding no keys: []

    def clear(self, partition: str, keys: list[str] | None):
        part = self.parts.get(partition, {})
        if keys is None:
            keys = list(part)
            self.layouts.pop(partition, None)
        missing = [k for k in keys if k not in part]
        if missing:
            return ("error", "KeyError", f"cannot clear keys {missing[:8]}: not in partition "
                    f"{partition!r}")
        for k in keys:
            for no, _row in part.pop(k)["rows"].values():
                self._drop_row(no)
        if not part and partition not in self.layouts:
            self.parts.pop(partition, None)
        return ("ok",)


_ERRORS = {"KeyError": KeyError, "ValueError": ValueError}


def _to_payload(name: str, col, n: int) -> tuple[tuple, dict]:
    """(layout, payload) of a column; the payload holds numpy arrays Ray stores zero-copy."""
    import torch

    if not isinstance(col, torch.Tensor):
        raise TypeError(f"column {name!r} is a {type(col).__name__}; columns are tensors")
    if col.dim() == 0:  # before size(0), which raises IndexError on it
        raise ValueError(f"column {name!r} is 0-d; a column needs one row per key")
    if col.size(0) != n:
        raise ValueError(f"column {name!r} has {col.size(0)} rows for {n} keys")
    if col.is_nested:
        if col.layout is not torch.jagged:
            raise TypeError(f"column {name!r} is a strided nested tensor; use layout=torch.jagged")
        from rlconform.reference_impl.dataplane import jagged_parts, jagged_rows

        layout = (JAGGED, str(col.dtype), tuple(col.shape[2:]))
        values, offsets, lengths = jagged_parts(col)
        if lengths is not None:  # rows that do not tile their values: send the rows alone
            rows = jagged_rows(col)
            values = torch.cat(rows) if rows else values[:0]
            offsets = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()])
        return layout, {"values": _numpy(values), "offsets": offsets.cpu().numpy()}
    return (DENSE, str(col.dtype), tuple(col.shape[1:])), {"values": _numpy(col)}


# numpy has no bfloat16 / float8: such tensors travel as same-width integers and are viewed back.
_SAME_WIDTH_INT = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _numpy(t):
    import torch

    t = t.detach().cpu().contiguous()
    try:
        return t.numpy()
    except TypeError:
        return t.view(getattr(torch, _SAME_WIDTH_INT[t.element_size()])).numpy()


def _dtype(name: str):
    import torch

    return getattr(torch, name.removeprefix("torch."))


def _from_rows(layout: tuple, blocks: list[dict], where: list[list[int]]):
    """A fresh tensor (one copy) holding rows `lo:hi` of block `b` for each run [b, lo, hi] in
    `where`, in order (keys that sit back to back in one block come as one run)."""
    import numpy as np
    import torch

    from rlconform.reference_impl.dataplane import copy_bytes, jagged_from_values

    kind, dtype_name, trailing = layout
    dtype = _dtype(dtype_name)
    first = blocks[where[0][0]]["values"]
    if kind == DENSE:
        out = np.empty((sum(hi - lo for _b, lo, hi in where), *first.shape[1:]),
                       dtype=first.dtype)
        at = 0
        for b, lo, hi in where:
            out[at:at + hi - lo] = blocks[b]["values"][lo:hi]
            at += hi - lo
        return torch.from_numpy(out).view(dtype)
    lengths: list[int] = []
    spans: list[list[int]] = []  # [block, first value, last value + 1]; adjacent ones merged
    for b, lo, hi in where:
        off = blocks[b]["offsets"][lo:hi + 1]
        lengths.extend(np.diff(off).tolist())
        a, z = int(off[0]), int(off[-1])
        if spans and spans[-1][0] == b and spans[-1][2] == a:
            spans[-1][2] = z
        else:
            spans.append([b, a, z])
    values = np.empty((sum(lengths), *first.shape[1:]), dtype=first.dtype)
    # one copy out of shared memory, over the machine's cores when large (exact: raw bytes)
    copy_bytes(values.reshape(-1).view(np.uint8),
               [blocks[b]["values"][a:z].reshape(-1).view(np.uint8) for b, a, z in spans])
    return jagged_from_values(torch.from_numpy(values).view(dtype), lengths)


class RayObjectStoreTransport:
    """The rlconform transport surface on Ray's object store (see the module docstring)."""

    def __init__(self, timeout_s: float | None = None, address: dict | None = None):
        ray = _ray()
        if address is not None and not ray.is_initialized():  # a rank process: join the cluster
            ray.init(address=address["ray"], log_to_driver=False, configure_logging=False)
        if not ray.is_initialized():
            raise RuntimeError("Ray is not running: enter the backend's session "
                               "(Backend.session) before making a transport")
        self._ray = ray
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self._owner = address is None
        if self._owner:
            self._name = f"rlconform-index-{uuid.uuid4().hex[:12]}"
            self.index = ray.remote(num_cpus=0, max_restarts=0)(_Index).options(
                name=self._name, namespace=INDEX_NAMESPACE).remote()
        else:
            self._name = address["index"]
            try:
                self.index = ray.get_actor(self._name, namespace=INDEX_NAMESPACE)
            except ValueError:
                raise _procs.BackendUnavailable(f"ray-objectstore index {self._name!r} is gone: "
                                                "its owner closed the transport") from None
        self._closed = False

    def address(self) -> dict:
        """Where another process reopens this store: the Ray cluster and the index actor's
        name (capability `multiprocess`; `RayObjectStoreTransport(address=...)` there). Blocks
        that process puts are owned by it (see the module docstring)."""
        return {"ray": self._ray.get_runtime_context().gcs_address, "index": self._name}

    def _wait(self, refs, what: str):
        ray = self._ray
        if self._closed:
            raise RuntimeError("transport is closed")
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise _procs.BackendTimeout(f"ray-objectstore {what} did not answer within "
                                        f"{self.timeout_s:g}s") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
            raise _procs.BackendUnavailable(f"ray-objectstore {what} failed: the index actor or "
                                            f"a block owner is gone ({type(exc).__name__}: "
                                            f"{str(exc).splitlines()[0]})") from None

    def _ask(self, method: str, *args):
        answer = self._wait(getattr(self.index, method).remote(*args), method)
        if answer[0] == "error":
            raise _ERRORS[answer[1]](answer[2])
        return answer[1:]

    def put(self, partition: str, keys: Sequence[str], columns: dict,
            tags: Sequence[dict] | None = None) -> None:
        check_name("partition", partition)
        try:
            keys = check_names("key", keys)
        except ValueError as exc:
            raise ValueError(f"put got duplicated keys in partition {partition!r}: {exc}") \
                if "repeated" in str(exc) else exc from None
        check_tags(tags, len(keys))
        staged = {check_name("field", name): _to_payload(name, col, len(keys))
                  for name, col in columns.items()}
        if not keys:  # a put of no keys stores nothing (the contract: no key, no partition)
            return
        tags = list(tags) if tags is not None else None
        if not self._owner:
            # a block belongs to the process that put it and dies with it: from another
            # process, the index actor puts the blocks itself, so they outlive this client
            self._ask("put_payloads", partition, keys, staged, tags)
            return
        # a list around each ref keeps Ray from resolving it into the block when it is passed
        blocks = {name: (layout, [self._ray.put(payload)])
                  for name, (layout, payload) in staged.items()}
        self._ask("put", partition, keys, blocks, tags)

    def get(self, partition: str, keys: Sequence[str], select_fields: Sequence[str] | None = None
            ) -> tuple[dict, list[dict]]:
        keys, fields = check_get(partition, keys, select_fields)
        located, refs, tags = self._ask("locate", partition, keys, fields)
        blocks = self._wait([r[0] for r in refs], "block fetch") if refs else []
        if not keys:
            return {name: _empty(layout) for name, (layout, _w) in located.items()}, []
        # one copy per row: a key asked twice arrives as one pickled object shared by its rows
        return {name: _from_rows(layout, blocks, where)
                for name, (layout, where) in located.items()}, copy_tags(tags)

    def list(self, partition: str) -> list[str]:
        return self._ask("list", check_name("partition", partition))[0]

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> None:
        check_name("partition", partition)
        self._ask("clear", partition, check_names("key", keys) if keys is not None else None)

    def close(self) -> None:
        """Kill the index actor: it holds the last ref to every block, so all are freed. A
        transport reopened by address only lets go of its handle: the store is its owner's."""
        if not self._closed:
            self._closed = True
            if self._owner:
                with contextlib.suppress(Exception):
                    self._ray.kill(self.index)


def _empty(layout: tuple):
    import torch

    kind, dtype_name, trailing = layout
    values = torch.empty((0, *trailing), dtype=_dtype(dtype_name))
    if kind == DENSE:
        return values
    return torch.nested.nested_tensor_from_jagged(values, offsets=torch.zeros(1, dtype=torch.long))


@contextlib.contextmanager
def session() -> Iterator[None]:
    """Ray with one CPU and a small object store (RLCONFORM_RAY_OBJECT_STORE_MB, default 1024)."""
    mb = int(os.environ.get("RLCONFORM_RAY_OBJECT_STORE_MB", "1024"))
    with _procs.ray_cluster(num_cpus=1, object_store_mb=mb):
        yield


backend = Backend(
    name="ray-objectstore",
    description="column blocks in Ray's object store (ray.put/ray.get, owned by an index "
    "actor that maps keys to blocks, tags and layouts)",
    transport=RayObjectStoreTransport,
    capabilities=frozenset({"partitions", "bfloat16", "multiprocess"}),
    session=session,
    notes={s: "a transport over Ray's object store: the codec, meta, batch ops, trainer and "
              "rollout around it are the training framework's" for s in
           ("codec", "meta", "batch_ops", "trainer", "rollout")} | {
        "object_columns": "not mapped: column blocks hold raw tensor bytes; per-row Python "
                          "objects would travel pickled, which this adapter does not do"},
    version=package_version("ray", "Ray"),
)
