"""An out-of-tree backend in one file: a transport that keeps every column as serialized bytes.

Run it through the suite with

    nox -s conformance -- --backend examples.bytes_transport:backend

(from the repository root; any importable `module:attribute` works). It shows the whole adapter
contract: provide the surface as a factory, declare capabilities, and record at put time what
get needs to give every column back in the layout it was written.
"""

from __future__ import annotations

import copy
import io

import torch

from rlconform.conformance.backend import Backend


def _dump(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t.contiguous(), buf)
    return buf.getvalue()


def _load(b: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(b), weights_only=True)


class BytesTransport:
    """partition -> key -> field -> bytes of that key's row; one layout record per field."""

    def __init__(self) -> None:
        self._rows: dict = {}
        self._tags: dict = {}
        self._jagged: dict = {}  # (partition, field) -> written as a jagged nested tensor?

    def put(self, partition, keys, columns, tags=None):
        part = self._rows.setdefault(partition, {})
        for name, col in columns.items():
            if int(col.size(0)) != len(keys):
                raise ValueError(f"column {name!r} has {col.size(0)} rows for {len(keys)} keys")
            self._jagged[partition, name] = col.is_nested
            for k, row in zip(keys, col.unbind()):
                part.setdefault(k, {})[name] = _dump(row)
        ptags = self._tags.setdefault(partition, {})
        for i, k in enumerate(keys):
            part.setdefault(k, {})
            ptags.setdefault(k, {}).update(copy.deepcopy(tags[i]) if tags else {})

    def get(self, partition, keys, select_fields):
        if partition not in self._rows:
            raise KeyError(f"partition {partition!r} does not exist")
        part = self._rows[partition]
        missing = [k for k in keys if k not in part]
        if missing:
            raise KeyError(f"keys {missing} not in partition {partition!r}")
        out = {}
        for name in select_fields:
            if any(name not in part[k] for k in keys):
                raise KeyError(f"field {name!r} missing in partition {partition!r}")
            rows = [_load(part[k][name]) for k in keys]
            out[name] = (torch.nested.nested_tensor(rows, layout=torch.jagged)
                         if self._jagged[partition, name] else torch.stack(rows))
        return out, [copy.deepcopy(self._tags[partition][k]) for k in keys]

    def list(self, partition):
        return list(self._rows.get(partition, {}))

    def clear(self, partition, keys=None):
        if keys is None:
            self._rows.pop(partition, None)
            self._tags.pop(partition, None)
            return
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
