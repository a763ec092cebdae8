"""An out-of-tree backend in one file: a transport that keeps every column as serialized bytes.

Run it through the suite with

    nox -s conformance -- --backend examples.bytes_transport:backend

(from the repository root; any importable `module:attribute` works). It shows the whole adapter
contract: provide the surface as a factory, declare capabilities, record at put time what get
needs to give every column back in the layout it was written (one layout per partition and
field: a put in another layout is refused), and refuse the names and tags the contract refuses
(its own validators, `check_name` / `check_get` / `check_tags`). examples/redis_store.py is the same on a
persistent store; docs/writing-a-transport.md walks through both.
"""

from __future__ import annotations

import copy
import io

import torch

from rlconform.conformance.backend import Backend
from rlconform.reference_impl.dataplane import (
    JAGGED,
    check_get,
    check_name,
    check_names,
    check_tags,
    column_layout,
)


def _dump(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t.contiguous(), buf)
    return buf.getvalue()


def _load(b: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(b), weights_only=True)


def _layout(name: str, col: torch.Tensor) -> tuple:
    """(jagged, dtype, trailing dims); refuses what is not a column (a list, a strided nested
    tensor, a 0-d tensor) with the reference's own check, naming the field."""
    layout = column_layout(name, col)
    return layout.kind == JAGGED, layout.dtype, layout.trailing


class BytesTransport:
    """partition -> key -> field -> bytes of that key's row; one layout per (partition, field)."""

    def __init__(self) -> None:
        self._rows: dict = {}
        self._tags: dict = {}
        self._layouts: dict = {}  # partition -> field -> (jagged?, dtype, trailing dims)

    def put(self, partition, keys, columns, tags=None):
        check_name("partition", partition)
        keys = check_names("key", keys)
        check_tags(tags, len(keys))
        layouts = self._layouts.get(partition, {})
        new = {}
        for name, col in columns.items():  # check everything before storing anything
            check_name("field", name)
            layout = new[name] = _layout(name, col)
            if int(col.size(0)) != len(keys):
                raise ValueError(f"column {name!r} has {col.size(0)} rows for {len(keys)} keys")
            if layouts.get(name, layout) != layout:
                raise ValueError(f"column {name!r} in partition {partition!r} was written as "
                                 f"{layouts[name]}, now as {layout}")
        if not keys:
            return  # a put of no keys stores nothing
        part = self._rows.setdefault(partition, {})
        for name, col in columns.items():
            self._layouts.setdefault(partition, {})[name] = new[name]
            for k, row in zip(keys, col.unbind()):
                part.setdefault(k, {})[name] = _dump(row)
        ptags = self._tags.setdefault(partition, {})
        for i, k in enumerate(keys):
            part.setdefault(k, {})
            ptags.setdefault(k, {}).update(copy.deepcopy(tags[i]) if tags else {})

    def get(self, partition, keys, select_fields):
        keys, names = check_get(partition, keys, select_fields)  # refused before any lookup
        part = self._rows.get(partition, {})
        missing = [k for k in keys if k not in part]
        if missing:
            raise KeyError(f"keys {missing} not in partition {partition!r}")
        out = {}
        for name in names:
            if name not in self._layouts.get(partition, {}) or any(name not in part[k] for k in keys):
                raise KeyError(f"field {name!r} missing in partition {partition!r}")
            jagged, dtype, trailing = self._layouts[partition][name]
            rows = [_load(part[k][name]) for k in keys]
            if jagged:
                values = torch.cat(rows) if rows else torch.empty((0, *trailing), dtype=dtype)
                offsets = torch.tensor([0] + [r.shape[0] for r in rows]).cumsum(0)
                out[name] = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
            else:
                out[name] = torch.stack(rows) if rows else torch.empty((0, *trailing),
                                                                       dtype=dtype)
        return out, [copy.deepcopy(self._tags[partition][k]) for k in keys]

    def list(self, partition):
        return list(self._rows.get(check_name("partition", partition), {}))

    def clear(self, partition, keys=None):
        check_name("partition", partition)
        if keys is None:
            for d in (self._rows, self._tags, self._layouts):
                d.pop(partition, None)
            return
        keys = check_names("key", keys)
        missing = [k for k in keys if k not in self._rows.get(partition, {})]
        if missing:  # check before removing anything: a refused clear removes nothing
            raise KeyError(f"cannot clear keys {missing}: not in partition {partition!r}")
        for k in keys:
            self._rows[partition].pop(k)
            self._tags[partition].pop(k, None)

    def close(self):
        self._rows.clear()


backend = Backend(
    name="bytes-transport",
    description="example out-of-tree transport: torch.save'd rows in a dict",
    transport=BytesTransport,
    capabilities={"partitions", "bfloat16"},
)
