"""The reference transport: an in-memory, partitioned key/value column store.

It is what every other transport is measured against: a column comes back in the layout it was
written (dense as dense with its shape, jagged as jagged, 1-D as `(N,)`, an `ObjectColumn` of
per-row dicts as an `ObjectColumn`: capability `object_columns`), a missing partition,
key or field raises `KeyError` naming it, tags travel 1:1 with keys, and stored data never
aliases a caller's tensor (one copy in at put, one copy out at get).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .objects import ObjectColumn

DENSE, JAGGED, OBJECT = "dense", "jagged", "object"


@dataclass(frozen=True)
class Layout:
    kind: str  # DENSE or JAGGED
    dtype: torch.dtype
    trailing: tuple[int, ...]  # dense: row shape; jagged: dims after the ragged one


def column_layout(name: str, col: Tensor) -> Layout:
    if not isinstance(col, Tensor):
        raise TypeError(f"column {name!r} is a {type(col).__name__}; columns are tensors "
                        "(dense, or jagged nested with layout=torch.jagged)")
    if col.is_nested:
        if col.layout is not torch.jagged:
            raise TypeError(f"column {name!r} is a strided nested tensor; use layout=torch.jagged")
        return Layout(JAGGED, col.dtype, tuple(col.shape[2:]))
    if col.dim() == 0:
        raise ValueError(f"column {name!r} is 0-d; a column needs one row per key")
    return Layout(DENSE, col.dtype, tuple(col.shape[1:]))


def split_rows(name: str, col: Tensor, n: int) -> tuple[Layout, list[Tensor]]:
    """Copy a column once and return per-key row views into the copy."""
    layout = column_layout(name, col)
    rows = int(col.size(0))
    if rows != n:
        raise ValueError(f"column {name!r} has {rows} rows for {n} keys")
    if layout.kind == JAGGED:
        values = col.values().detach().clone()
        offsets = col.offsets().tolist()
        lengths = col.lengths()  # set when rows do not tile `values` (gaps between rows)
        ends = ([offsets[i + 1] for i in range(n)] if lengths is None
                else [offsets[i] + int(lengths[i]) for i in range(n)])
        return layout, [values[offsets[i]:ends[i]] for i in range(n)]
    block = col.detach().clone()
    return layout, list(block.unbind(0))


def jagged_from_values(values: Tensor, lengths: Sequence[int]) -> Tensor:
    """A jagged nested tensor whose row i is the next `lengths[i]` entries of `values` (a view,
    no copy); zero-length rows allowed."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    torch.cumsum(torch.as_tensor(lengths, dtype=torch.long), 0, out=offsets[1:])
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


def _contiguous_span(rows: list[Tensor]) -> Tensor | None:
    """One clone of the stored block when `rows` are back-to-back views of it (keys fetched in
    the order they were put): a single copy instead of one per row."""
    if len(rows) < 2 or any(not r.is_contiguous() for r in rows):
        return None
    base = rows[0].untyped_storage().data_ptr()
    if any(r.untyped_storage().data_ptr() != base for r in rows):
        return None
    step = rows[0].element_size()
    for a, b in zip(rows, rows[1:]):
        if a.data_ptr() + a.numel() * step != b.data_ptr():
            return None
    first, last = rows[0], rows[-1]
    n = (last.data_ptr() - first.data_ptr()) // step + last.numel()
    flat = torch.empty(0, dtype=first.dtype).set_(first.untyped_storage(),
                                                  first.storage_offset(), (n,))
    return flat.view(-1, *first.shape[1:]).clone()


def join_rows(name: str, layout: Layout, rows: list[Tensor]) -> Tensor:
    """One fresh tensor in the written layout from stored rows (a copy, never a view)."""
    if layout.kind == JAGGED:
        values = _contiguous_span(rows)
        if values is None:
            values = (torch.cat(rows) if rows
                      else torch.empty((0, *layout.trailing), dtype=layout.dtype))
        return jagged_from_values(values, [r.shape[0] for r in rows])
    if not rows:
        return torch.empty((0, *layout.trailing), dtype=layout.dtype)
    return torch.stack(rows)


def _split_objects(name: str, col: ObjectColumn, n: int) -> tuple[Layout, list]:
    """An object column (capability `object_columns`): per-key rows, copied (dicts and tensors)."""
    if len(col) != n:
        raise ValueError(f"column {name!r} has {len(col)} rows for {n} keys")
    return Layout(OBJECT, None, ()), col.clone().rows


class InMemoryDataPlane:
    """Partition -> key -> field -> row tensor, with one recorded layout per (partition, field)."""

    name = "in-memory"

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, dict[str, Tensor]]] = {}
        self._tags: dict[str, dict[str, dict]] = {}
        self._layouts: dict[str, dict[str, Layout]] = {}
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("transport is closed")

    def put(self, partition: str, keys: Sequence[str], columns: dict[str, Tensor],
            tags: Sequence[dict] | None = None) -> None:
        self._check_open()
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise ValueError(f"put got duplicated keys in partition {partition!r}")
        if tags is not None and len(tags) != len(keys):
            raise ValueError(f"put got {len(tags)} tags for {len(keys)} keys; tags are 1:1")
        layouts = self._layouts.get(partition, {})
        staged: dict[str, tuple[Layout, list[Tensor]]] = {}
        for name, col in columns.items():  # validate everything before storing anything
            layout, rows = (_split_objects(name, col, len(keys)) if isinstance(col, ObjectColumn)
                            else split_rows(name, col, len(keys)))
            old = layouts.get(name)
            if old is not None and old != layout:
                raise ValueError(f"column {name!r} in partition {partition!r} was written as "
                                 f"{old}, now as {layout}")
            staged[name] = (layout, rows)
        part = self._rows.setdefault(partition, {})
        ptags = self._tags.setdefault(partition, {})
        playouts = self._layouts.setdefault(partition, {})
        for name, (layout, rows) in staged.items():
            playouts[name] = layout
            for k, r in zip(keys, rows):
                part.setdefault(k, {})[name] = r
        for i, k in enumerate(keys):
            part.setdefault(k, {})
            entry = ptags.setdefault(k, {})
            if tags is not None:
                entry.update(copy.deepcopy(tags[i]))

    def get(self, partition: str, keys: Sequence[str], select_fields: Sequence[str] | None = None
            ) -> tuple[dict[str, Tensor], list[dict]]:
        self._check_open()
        if select_fields is None:
            raise TypeError("get requires select_fields: name the fields to fetch")
        part = self._partition(partition)
        missing = [k for k in keys if k not in part]
        if missing:
            raise KeyError(f"keys {missing[:8]} not in partition {partition!r}")
        out: dict[str, Tensor] = {}
        for name in select_fields:
            layout = self._layouts[partition].get(name)
            lacking = [k for k in keys if name not in part[k]]
            if layout is None or lacking:
                raise KeyError(f"field {name!r} missing for keys {lacking[:8] or list(keys)[:8]} "
                               f"in partition {partition!r}")
            rows = [part[k][name] for k in keys]
            out[name] = (ObjectColumn(rows).clone() if layout.kind == OBJECT
                         else join_rows(name, layout, rows))
        tags = [copy.deepcopy(self._tags[partition][k]) for k in keys]
        return out, tags

    def _partition(self, partition: str) -> dict:
        try:
            return self._rows[partition]
        except KeyError:
            raise KeyError(f"partition {partition!r} does not exist; known: "
                           f"{sorted(self._rows)}") from None

    def list(self, partition: str) -> list[str]:
        self._check_open()
        return list(self._partition(partition))

    def fields(self, partition: str) -> list[str]:
        self._check_open()
        self._partition(partition)
        return list(self._layouts.get(partition, {}))

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> None:
        self._check_open()
        part = self._partition(partition)
        if keys is None:
            for d in (self._rows, self._tags, self._layouts):
                d.pop(partition, None)
            return
        missing = [k for k in keys if k not in part]
        if missing:
            raise KeyError(f"cannot clear keys {missing[:8]}: not in partition {partition!r}")
        for k in keys:
            del part[k]
            self._tags[partition].pop(k, None)

    def close(self) -> None:
        self._rows.clear()
        self._tags.clear()
        self._layouts.clear()
        self._closed = True
