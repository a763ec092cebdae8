"""A plain in-memory model of the transport contract (docs/ARCHITECTURE.md "Transport surface").

partition -> key -> field -> row, the tags of each key, and one layout per partition and field.
Each call answers what every store must answer: a result, or the errors the contract allows
(`Expect`). The model is written from the contract's text, not from the reference store, so a
defect shared by the reference and a store would still show; only the contract's executable
name and tag rules (`check_name`, `check_tags`) are shared, being the contract itself.

The three questions the contract settles here:
- a get that names a key twice returns its row twice (one row per key named, in order);
- a clear that names a key the partition does not hold raises KeyError and removes nothing;
- list of a partition that holds no keys (never written, cleared, emptied) returns [].
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlconform.fixtures.values import DENSE, JAGGED, OBJECT, REGISTRY_DTYPES, Layout
from rlconform.reference_impl.bitexact import tensor_difference
from rlconform.reference_impl.dataplane import check_name, check_names, check_tags
from rlconform.reference_impl.objects import ObjectColumn, row_difference

from ._check import tag_difference

REFUSE = (TypeError, ValueError)  # what refused input raises: either


@dataclass(frozen=True)
class Expect:
    """What a call must do: succeed (`errors` empty), raise one of `errors`, or, with `may`,
    either succeed or raise one of `errors` (a dtype outside the registry)."""

    errors: tuple[type[BaseException], ...] = ()
    why: str = ""
    may: bool = False

    @property
    def ok(self) -> bool:
        return not self.errors


OK = Expect()


@dataclass
class Partition:
    rows: dict[str, dict[str, object]] = field(default_factory=dict)  # key -> field -> row
    tags: dict[str, dict] = field(default_factory=dict)
    layouts: dict[str, Layout] = field(default_factory=dict)


class _Refused(Exception):
    def __init__(self, errors, why: str):
        super().__init__(why)
        self.expect = Expect(tuple(errors), why)


def layout_of(name: str, col) -> Layout:
    """The layout the contract records for column `col`, or _Refused."""
    if isinstance(col, ObjectColumn):
        return Layout(OBJECT, None, ())
    if not isinstance(col, Tensor):
        raise _Refused(REFUSE, f"column {name!r} is a {type(col).__name__}, not a tensor")
    if col.is_nested:
        if col.layout is not torch.jagged:
            raise _Refused(REFUSE, f"column {name!r} is a strided nested tensor")
        return Layout(JAGGED, col.dtype, tuple(col.values().shape[1:]))
    if col.dim() == 0:
        raise _Refused(REFUSE, f"column {name!r} is 0-d")
    return Layout(DENSE, col.dtype, tuple(col.shape[1:]))


def rows_of(layout: Layout, col) -> list:
    """The column's rows as the model keeps them: copies that share nothing with `col`."""
    if layout.kind == OBJECT:
        return [copy.deepcopy(r) for r in col.rows]
    if layout.kind == JAGGED:
        return [r.clone() for r in col.unbind()]
    return [r.clone() for r in col.unbind(0)]


def _rows(col) -> int:
    return len(col) if isinstance(col, ObjectColumn) else int(col.size(0))


class StoreModel:
    """The contract's answer to each call, and the state it leaves."""

    def __init__(self) -> None:
        self.parts: dict[str, Partition] = {}

    def snapshot(self) -> dict[str, Partition]:
        return copy.deepcopy(self.parts)

    # -- put ------------------------------------------------------------------------------------
    def check_put(self, partition, keys, columns, tags) -> tuple[Expect, list]:
        """What put must do, and the staged writes when it succeeds."""
        try:
            check_name("partition", partition)
            keys = check_names("key", keys)
            check_tags(tags, len(keys))
            for name in columns:
                check_name("field", name)
        except (TypeError, ValueError) as exc:
            return Expect(REFUSE, f"put refuses it: {exc}"), []
        stored = self.parts.get(partition, Partition()).layouts
        staged, may = [], False
        for name, col in columns.items():
            try:
                layout = layout_of(name, col)
            except _Refused as exc:
                return exc.expect, []
            if _rows(col) != len(keys):
                return Expect(REFUSE, f"column {name!r} has {_rows(col)} rows for "
                                      f"{len(keys)} keys"), []
            old = stored.get(name)
            if old is not None and old != layout:
                return Expect(REFUSE, f"column {name!r} is stored as {old.describe()}, put as "
                                      f"{layout.describe()}"), []
            may = may or (layout.dtype is not None and layout.dtype not in REGISTRY_DTYPES)
            staged.append((name, layout, rows_of(layout, col)))
        if may:
            return Expect(REFUSE, "a dtype outside the registry: stored exactly or refused",
                          may=True), staged
        return OK, staged

    def apply_put(self, partition, keys, staged, tags) -> None:
        if not keys:  # a put of no keys stores nothing: no key, no layout
            return
        part = self.parts.setdefault(partition, Partition())
        for name, layout, rows in staged:
            part.layouts[name] = layout
            for k, r in zip(keys, rows):
                part.rows.setdefault(k, {})[name] = r
        for i, k in enumerate(keys):
            part.rows.setdefault(k, {})
            entry = part.tags.setdefault(k, {})
            if tags is not None:
                entry.update(copy.deepcopy(tags[i]))

    # -- get ------------------------------------------------------------------------------------
    def get(self, partition, keys, select_fields):
        """(Expect, columns as (layout, rows) per field, tags) for a get."""
        if select_fields is None:
            return Expect(REFUSE, "get without select_fields"), None, None
        try:
            check_name("partition", partition)
            for k in keys:
                check_name("key", k)
            for f in select_fields:
                check_name("field", f)
        except (TypeError, ValueError) as exc:
            return Expect(REFUSE, f"get refuses it: {exc}"), None, None
        part = self.parts.get(partition, Partition())
        missing = [k for k in keys if k not in part.rows]
        if missing:
            return Expect((KeyError,), f"keys {missing} are not in partition "
                                       f"{partition!r}"), None, None
        out = {}
        for f in select_fields:
            lacking = [k for k in keys if f not in part.rows[k]]
            if f not in part.layouts or lacking:
                return Expect((KeyError,), f"field {f!r} is not stored for keys "
                                           f"{lacking or keys} of {partition!r}"), None, None
            out[f] = (part.layouts[f], [part.rows[k][f] for k in keys])
        return OK, out, [part.tags[k] for k in keys]

    # -- list and clear -------------------------------------------------------------------------
    def list(self, partition) -> tuple[Expect, list[str] | None]:
        try:
            check_name("partition", partition)
        except (TypeError, ValueError) as exc:
            return Expect(REFUSE, f"list refuses it: {exc}"), None
        part = self.parts.get(partition)
        return OK, sorted(part.rows) if part else []

    def check_clear(self, partition, keys) -> Expect:
        try:
            check_name("partition", partition)
            if keys is not None:
                keys = check_names("key", keys)
        except (TypeError, ValueError) as exc:
            return Expect(REFUSE, f"clear refuses it: {exc}")
        if keys is None:
            return OK
        held = self.parts.get(partition, Partition()).rows
        missing = [k for k in keys if k not in held]
        if missing:
            return Expect((KeyError,), f"clear names keys {missing} that {partition!r} does "
                                       "not hold: KeyError, nothing removed")
        return OK

    def apply_clear(self, partition, keys) -> None:
        if keys is None:
            self.parts.pop(partition, None)
            return
        part = self.parts.get(partition)
        for k in keys:
            del part.rows[k]
            del part.tags[k]


# -- comparing what a store returned with the model -----------------------------------------------
def column_difference(name: str, layout: Layout, rows: list, got) -> str | None:
    """Why column `got` is not the model's `rows` in `layout` (kind, dtype, row shape, row
    count, each row's bits), or None."""
    n = len(rows)
    if layout.kind == OBJECT:
        if not isinstance(got, ObjectColumn):
            return f"column {name!r} came back as {type(got).__name__}, put as object rows"
        if len(got) != n:
            return f"column {name!r} has {len(got)} rows for {n} keys"
        for i, (a, b) in enumerate(zip(rows, got.rows)):
            why = row_difference(i, a, b)
            if why:
                return f"column {name!r} {why}"
        return None
    if not isinstance(got, Tensor):
        return f"column {name!r} came back as {type(got).__name__}, put as {layout.describe()}"
    if layout.kind == JAGGED:
        if not got.is_nested or got.layout is not torch.jagged:
            return f"column {name!r} came back {_describe(got)}, put as {layout.describe()}"
        if got.dtype != layout.dtype:
            return f"column {name!r} came back {got.dtype}, put as {layout.dtype}"
        trailing = tuple(got.values().shape[1:])
        if trailing != layout.trailing:
            return f"column {name!r} came back with rows (j, *{list(trailing)}), put as " \
                   f"(j, *{list(layout.trailing)})"
        got_rows = got.unbind()
        if len(got_rows) != n:
            return f"column {name!r} has {len(got_rows)} rows for {n} keys"
        for i, (a, b) in enumerate(zip(rows, got_rows)):
            why = tensor_difference(a, b)
            if why:
                return f"column {name!r} row {i}: {why}"
        return None
    if got.is_nested:
        return f"column {name!r} came back {_describe(got)}, put as {layout.describe()}"
    want_shape = (n, *layout.trailing)
    if got.dtype != layout.dtype or tuple(got.shape) != want_shape:
        return f"column {name!r} came back {_describe(got)}, put as dense " \
               f"{str(layout.dtype).removeprefix('torch.')} {list(want_shape)}"
    for i, a in enumerate(rows):
        why = tensor_difference(a, got[i])
        if why:
            return f"column {name!r} row {i}: {why}"
    return None


def _describe(t: Tensor) -> str:
    kind = "jagged" if t.is_nested else "dense"
    shape = list(t.values().shape[1:]) if t.is_nested else list(t.shape)
    return f"{kind} {str(t.dtype).removeprefix('torch.')} {shape}"


def tags_difference(want: list, got) -> str | None:
    if not isinstance(got, list):
        return f"tags came back as {type(got).__name__}, not a list"
    if len(got) != len(want):
        return f"{len(got)} tags for {len(want)} keys"
    for i, (a, b) in enumerate(zip(want, got)):
        why = tag_difference(a, b, f"tags[{i}]")
        if why:
            return why
    return None


def shared_between_rows(columns: dict, tags: list) -> str | None:
    """Where two rows of one result share an object (a tag's dict or list, an object row's dict,
    list or tensor memory, or overlapping tensor memory of a column): changing one row of a
    result then changes another. None when the rows share nothing."""
    owners: dict = {}
    spans: list[tuple[int, int, int, int, str]] = []  # (storage, start, end, row, what)

    def visit(v, row: int, what: str) -> str | None:
        if isinstance(v, Tensor):
            span = _span(v)
            if span is not None:
                spans.append((*span, row, what))
            return None
        if isinstance(v, (dict, list)):
            other = owners.setdefault(id(v), (row, what))
            if other[0] != row:
                return f"{what} of row {row} is the same {type(v).__name__} object as " \
                       f"{other[1]} of row {other[0]}"
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                why = visit(x, row, f"{what}[{k!r}]")
                if why:
                    return why
        elif isinstance(v, tuple):
            for k, x in enumerate(v):
                why = visit(x, row, f"{what}[{k}]")
                if why:
                    return why
        return None

    for i, t in enumerate(tags if isinstance(tags, list) else []):
        why = visit(t, i, "tag")
        if why:
            return why
    for name, col in columns.items():
        if isinstance(col, ObjectColumn):
            for i, r in enumerate(col.rows):
                why = visit(r, i, f"column {name!r}")
                if why:
                    return why
        elif isinstance(col, Tensor):
            got_rows = col.unbind() if col.is_nested else list(col.unbind(0)) if col.dim() else []
            for i, r in enumerate(got_rows):
                visit(r, i, f"column {name!r}")
    spans.sort()
    reach = None  # (storage, end, row, what) of the span reaching furthest so far
    for storage, start, end, row, what in spans:
        if reach is not None and reach[0] == storage and start < reach[1] and reach[2] != row:
            return f"{what} of row {row} and {reach[3]} of row {reach[2]} share memory"
        if reach is None or reach[0] != storage or end > reach[1]:
            reach = (storage, end, row, what)
    return None


def _span(t: Tensor) -> tuple[int, int, int] | None:
    """(storage, first byte, end byte) that a strided tensor may touch; None when empty."""
    if t.numel() == 0 or t.is_nested:
        return None
    size = t.element_size()
    start = t.storage_offset()
    last = start + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    storage = t.untyped_storage().data_ptr()
    return storage, storage + start * size, storage + (last + 1) * size
