"""`ObjectColumn`: a per-sample Python object column, one value per row.

Real frameworks hold a sample's media as a per-row dict of model-input tensors rather than as
packed columns: verl's `non_tensor_batch["multi_modal_inputs"]` (an object array of dicts, `{}`
for a text-only row), OpenRLHF's `Experience.mm_train_inputs` (a list of dicts, None for a
text-only row). An `ObjectColumn` holds such rows: each is None or a dict whose keys are strings
and whose values are tensors or lists of tensors (one per image, where the images of a row
cannot be concatenated).

Operations never share a row's dict between columns (a stage that pops a key from its copy, as
verl's position-id computation pops `mm_token_type_ids`, must not change another batch); the
tensors inside are shared, like the segments of a `PackedTensor`. Comparison is exact: dict keys,
None vs `{}`, list vs tensor, dtype, shape and bits (NaN == NaN, -0.0 != +0.0).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from .bitexact import tensor_difference

Row = dict[str, Any] | None


def _check_value(where: str, value: Any) -> None:
    if isinstance(value, Tensor):
        if value.is_nested:
            raise TypeError(f"{where} is a nested tensor; use a tensor or a list of tensors")
        return
    if isinstance(value, (list, tuple)):
        for k, t in enumerate(value):
            if not isinstance(t, Tensor) or t.is_nested:
                raise TypeError(f"{where}[{k}] is a {type(t).__name__}; list values hold tensors")
        return
    raise TypeError(f"{where} is a {type(value).__name__}; values are tensors or lists of tensors")


def check_row(i: int, row: Any, name: str = "object column") -> None:
    """Raise naming the column, row and key when `row` is not None or a dict of tensors."""
    if row is None:
        return
    if not isinstance(row, dict):
        raise TypeError(f"{name} row {i} is a {type(row).__name__}; rows are dicts or None")
    for key, value in row.items():
        if not isinstance(key, str):
            raise TypeError(f"{name} row {i} has a non-string key {key!r}")
        _check_value(f"{name} row {i} key {key!r}", value)


def bits_equal(a: Tensor, b: Tensor) -> bool:
    """dtype, shape and every bit equal (NaN payloads, -0.0 vs +0.0 and subnormals included)."""
    return tensor_difference(a, b) is None


def value_difference(where: str, want: Any, got: Any) -> str | None:
    """Why value `got` is not exactly `want` (type, length, dtype, shape, bits), or None."""
    if isinstance(want, Tensor):
        if not isinstance(got, Tensor):
            return f"{where} is a {type(got).__name__}, expected a tensor"
        why = tensor_difference(want, got)
        return f"{where} {why}" if why else None
    if not isinstance(got, (list, tuple)):
        return f"{where} is a {type(got).__name__}, expected a list of {len(want)} tensors"
    if len(got) != len(want):
        return f"{where} has {len(got)} tensors, expected {len(want)}"
    for k, (x, y) in enumerate(zip(want, got)):
        why = value_difference(f"{where}[{k}]", x, y)
        if why:
            return why
    return None


def row_difference(i: int, want: Row, got: Row) -> str | None:
    if want is None or got is None:
        if want is None and got is None:
            return None
        return (f"row {i} is {'None' if got is None else _keys(got)}, "
                f"expected {'None' if want is None else _keys(want)}")
    if not isinstance(got, dict):
        return f"row {i} is a {type(got).__name__}, expected a dict"
    if set(want) != set(got):
        return f"row {i} has keys {sorted(got)}, expected {sorted(want)}"
    for key in want:
        why = value_difference(f"row {i} key {key!r}", want[key], got[key])
        if why:
            return why
    return None


def _keys(row: dict) -> str:
    return "{}" if not row else "{" + ", ".join(sorted(row)) + "}"


def _copy_row(row: Row) -> Row:
    """A new dict (and new lists) over the same tensors."""
    if row is None:
        return None
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in row.items()}


class ObjectColumn:
    """Per-sample rows: None or `dict[str, Tensor | list[Tensor]]`."""

    __slots__ = ("rows",)

    def __init__(self, rows: Sequence[Row]):
        if isinstance(rows, (str, bytes, dict, Tensor)) or not hasattr(rows, "__iter__"):
            raise TypeError(f"ObjectColumn takes a sequence of rows, got {type(rows).__name__}")
        rows = list(rows)
        for i, r in enumerate(rows):
            check_row(i, r)
        self.rows: list[Row] = [_copy_row(r) for r in rows]

    @classmethod
    def adopt(cls, rows: Sequence[Row], name: str = "object column") -> ObjectColumn:
        """A column over `rows` as they are, checked but not copied: for an adapter that shows
        a framework's own row objects to the clauses (identity and aliasing stay observable)."""
        rows = list(rows)
        for i, r in enumerate(rows):
            check_row(i, r, name)
        col = cls.__new__(cls)
        col.rows = rows
        return col

    # -- views ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Row:
        return self.rows[i]

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    def is_none(self, i: int) -> bool:
        return self.rows[i] is None

    def keys(self) -> list[str]:
        """Every key of any row, in first-seen order."""
        return list(dict.fromkeys(k for r in self.rows if r for k in r))

    def tensors(self, i: int) -> list[tuple[str, Tensor]]:
        row = self.rows[i] or {}
        return [(k, t) for k, v in row.items()
                for t in (v if isinstance(v, (list, tuple)) else [v])]

    @property
    def dtype(self) -> None:
        return None  # mixed: each key has its own dtype

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for i in range(len(self))
                   for _, t in self.tensors(i))

    # -- batch operations ---------------------------------------------------------------
    def select(self, indices: Sequence[int] | Tensor) -> ObjectColumn:
        """Rows `indices` in that order, each a new dict over the same tensors."""
        if isinstance(indices, Tensor):
            indices = indices.tolist()
        n = len(self.rows)
        for i in indices:
            if not 0 <= int(i) < n:
                raise IndexError(f"row index {i} out of range for {n} rows")
        return ObjectColumn([self.rows[int(i)] for i in indices])

    def slice(self, start: int, stop: int) -> ObjectColumn:
        return self.select(range(*slice(start, stop).indices(len(self.rows))))

    @staticmethod
    def concat(parts: Sequence[ObjectColumn]) -> ObjectColumn:
        if not parts:
            raise ValueError("concat needs at least one ObjectColumn")
        for p in parts:
            if not isinstance(p, ObjectColumn):
                raise TypeError(f"cannot concat an ObjectColumn with a {type(p).__name__}")
        return ObjectColumn([r for p in parts for r in p.rows])

    def map_tensors(self, fn) -> ObjectColumn:
        def one(v):
            return [fn(t) for t in v] if isinstance(v, (list, tuple)) else fn(v)

        return ObjectColumn([None if r is None else {k: one(v) for k, v in r.items()}
                             for r in self.rows])

    def clone(self) -> ObjectColumn:
        return self.map_tensors(lambda t: t.clone())

    def to(self, device: torch.device | str) -> ObjectColumn:
        return self.map_tensors(lambda t: t.to(device))

    # -- comparison ---------------------------------------------------------------------
    def first_difference(self, other: ObjectColumn) -> str | None:
        """Why `other` differs (row count, None vs dict, keys, dtype, shape, bits), or None."""
        if not isinstance(other, ObjectColumn):
            return f"a {type(other).__name__}, expected an ObjectColumn"
        if len(self) != len(other):
            return f"{len(other)} rows, expected {len(self)}"
        for i, (a, b) in enumerate(zip(self.rows, other.rows)):
            why = row_difference(i, a, b)
            if why:
                return why
        return None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ObjectColumn):
            return NotImplemented
        return self.first_difference(other) is None

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = []
        for r in self.rows[:4]:
            shown.append("None" if r is None else "{" + ", ".join(
                f"{k}: {list(v.shape) if isinstance(v, Tensor) else [list(t.shape) for t in v]}"
                for k, v in r.items()) + "}")
        more = ", ..." if len(self) > 4 else ""
        return f"ObjectColumn(rows={len(self)}, [{', '.join(shown)}{more}])"
