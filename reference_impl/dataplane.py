"""The reference transport: an in-memory, partitioned key/value column store.

It is what every other transport is measured against: a column comes back in the layout it was
written (dense as dense with its shape, jagged as jagged, 1-D as `(N,)`, an `ObjectColumn` of
per-row dicts as an `ObjectColumn`: capability `object_columns`), a missing partition,
key or field raises `KeyError` naming it, tags travel 1:1 with keys, and stored data never
aliases a caller's tensor (one copy in at put, one copy out at get).

What names and tags may hold is the contract's, not a store's: `check_name` and `check_tags`
below are its executable form (docs/ARCHITECTURE.md "Transport surface" says it in words), and
any transport may call them to reject what the contract excludes with the contract's errors.
"""

from __future__ import annotations

import copy
import itertools
import pickle
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from .objects import ObjectColumn

DENSE, JAGGED, OBJECT = "dense", "jagged", "object"

# -- names and tags: what the contract allows ---------------------------------------------------
# A partition, key or field name is any `str` of 1 to MAX_NAME_BYTES bytes in UTF-8 without NUL:
# separators (`:` `/` `.` `|`), whitespace, glob characters, names that are prefixes of one
# another and names a store uses for its own bookkeeping are all ordinary names, compared as
# exact strings (no case folding, no Unicode normalisation, no trimming). The empty string, NUL
# (C string APIs cut there), lone surrogates (no UTF-8 form) and longer names are refused.
MAX_NAME_BYTES = 1024
# A tag is a dict of plain data: keys `str` or `int`; values None, bool, int in int64, float
# (nan, +-inf and -0.0 included), str (UTF-8 encodable), list, tuple and dict, nested at most
# MAX_TAG_DEPTH deep. Every one comes back as the type it was put (a tuple stays a tuple, an int
# key an int, 1.0 a float). Anything else (a set, bytes, a tensor, a numpy scalar, an object)
# is refused at put.
MAX_TAG_DEPTH = 32
INT64 = (-(2**63), 2**63 - 1)


def check_name(what: str, name) -> str:
    """`name` if the contract allows it as a `what` ("partition", "key", "field") name; else
    TypeError (not a str) or ValueError saying what is wrong."""
    if not isinstance(name, str):
        raise TypeError(f"{what} name {name!r} is a {type(name).__name__}; names are str")
    if not name:
        raise ValueError(f"{what} name is the empty string; a name has 1 to {MAX_NAME_BYTES} "
                         "bytes")
    if "\x00" in name:
        raise ValueError(f"{what} name {name[:40]!r} holds NUL; names never do")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{what} name {name[:40]!r} holds a lone surrogate; names are valid "
                         "Unicode (UTF-8 encodable)") from None
    if size > MAX_NAME_BYTES:
        raise ValueError(f"{what} name {name[:40]!r}... is {size} bytes in UTF-8; at most "
                         f"{MAX_NAME_BYTES}")
    return name


def check_names(what: str, names) -> list[str]:
    """A list of `what` names, each checked, none repeated."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise TypeError(f"{what}s must be a list of str, not {type(names).__name__}")
    out = [check_name(what, n) for n in names]
    if len(set(out)) != len(out):
        dup = sorted({n for n in out if out.count(n) > 1})
        raise ValueError(f"{what} names {dup[:8]} repeated")
    return out


def check_get(partition, keys, select_fields) -> tuple[list[str], list[str]]:
    """`get`'s arguments checked as the contract asks (select_fields required, every name
    valid): the keys and field names as lists. One rule for every store that serves `get`."""
    if select_fields is None:
        raise TypeError("get requires select_fields: name the fields to fetch")
    check_name("partition", partition)
    return [check_name("key", k) for k in keys], [check_name("field", f) for f in select_fields]


def check_tags(tags, n: int) -> None:
    """Raise unless `tags` is None or `n` tags the contract allows (see MAX_TAG_DEPTH above);
    the message names the row and the path inside its tag."""
    if tags is None:
        return
    if isinstance(tags, (str, bytes, dict)) or not isinstance(tags, Sequence):
        raise TypeError(f"tags must be None or a list of dicts, not {type(tags).__name__}")
    if len(tags) != n:
        raise ValueError(f"put got {len(tags)} tags for {n} keys; tags are 1:1")
    for i, tag in enumerate(tags):
        if not isinstance(tag, dict):
            raise TypeError(f"tags[{i}] is a {type(tag).__name__}; a tag is a dict")
        _check_tag_value(tag, f"tags[{i}]", 0)


def _check_tag_value(v, path: str, depth: int) -> None:
    if depth > MAX_TAG_DEPTH:
        raise ValueError(f"{path}: tag nested deeper than {MAX_TAG_DEPTH} (or a cycle)")
    if v is None or isinstance(v, (bool, float)):
        return
    if isinstance(v, int):
        if not INT64[0] <= v <= INT64[1]:
            raise ValueError(f"{path}: int {v} is outside int64; tags hold 64-bit ints")
        return
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{path}: str {v[:40]!r} holds a lone surrogate") from None
        return
    if type(v) in (list, tuple):
        for j, x in enumerate(v):
            _check_tag_value(x, f"{path}[{j}]", depth + 1)
        return
    if type(v) is dict:
        for k, x in v.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(f"{path}: dict key {k!r} is a {type(k).__name__}; tag dict keys "
                                "are str or int")
            _check_tag_value(k, f"{path} key {k!r}", depth + 1)
            _check_tag_value(x, f"{path}[{k!r}]", depth + 1)
        return
    raise TypeError(f"{path}: {type(v).__name__} {str(v)[:40]!r} is not a tag value; tags hold "
                    "None, bool, int, float, str, list, tuple and dict")


@dataclass(frozen=True)
class Layout:
    kind: str  # DENSE or JAGGED
    dtype: torch.dtype
    trailing: tuple[int, ...]  # dense: row shape; jagged: dims after the ragged one


try:  # the jagged layout's tensor class: its fields are read directly (see jagged_parts)
    from torch.nested._internal.nested_tensor import NestedTensor as _NJT
except ImportError:  # pragma: no cover - a torch without it: the public accessors
    _NJT = None


def _is_jagged(col: Tensor) -> bool:
    if _NJT is not None:
        return isinstance(col, _NJT)
    return col.layout is torch.jagged


def is_nested(col: Tensor) -> bool:
    """`col.is_nested`, without the jagged class's Python `__torch_function__` (~9 us a call;
    the codec and the transport ask it of every column on every put, get, encode and decode,
    ~150 times in one GRPO step). An instance of the jagged class is nested by definition; any
    other tensor answers its own C-level property."""
    return (_NJT is not None and isinstance(col, _NJT)) or col.is_nested


def jagged_parts(col: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """`(values, offsets, lengths)` of a jagged column (`lengths` is None when the rows tile
    `values`). The public accessors (`values()`, `.dtype`, `.layout`) of a jagged nested tensor
    go through its Python `__torch_function__`, ~100 us each: several per column on every put,
    get, encode and decode. Its fields are read directly where they exist."""
    if _NJT is not None and isinstance(col, _NJT) and getattr(col, "_ragged_idx", 1) == 1:
        return col._values, col._offsets, col._lengths
    return col.values(), col.offsets(), col.lengths()


def jagged_rows(col: Tensor) -> list[Tensor]:
    """Row views of a jagged column (what `col.unbind()` returns, without its dispatch)."""
    return _row_views(*jagged_parts(col))


def _row_views(values: Tensor, offsets: Tensor, lengths: Tensor | None) -> list[Tensor]:
    starts = offsets.tolist()
    n = len(starts) - 1
    if lengths is None and starts[0] == 0 and starts[-1] == values.shape[0]:
        return list(values.split([b - a for a, b in zip(starts, starts[1:])]))
    ends = starts[1:] if lengths is None else [a + int(k) for a, k in zip(starts,
                                                                         lengths.tolist())]
    return [values[starts[i]:ends[i]] for i in range(n)]


def column_layout(name: str, col: Tensor) -> Layout:
    if not isinstance(col, Tensor):
        raise TypeError(f"column {name!r} is a {type(col).__name__}; columns are tensors "
                        "(dense, or jagged nested with layout=torch.jagged)")
    if is_nested(col):
        if not _is_jagged(col):
            raise TypeError(f"column {name!r} is a strided nested tensor; use layout=torch.jagged")
        values = jagged_parts(col)[0]
        return Layout(JAGGED, values.dtype, tuple(values.shape[1:]))
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
        values, offsets, lengths = jagged_parts(col)
        return layout, _row_views(values.detach().clone(), offsets, lengths)
    block = col.detach().clone()
    return layout, list(block.unbind(0))


# -- copies that use the machine ----------------------------------------------------------------
# torch.cat over many pieces runs one OpenMP region per piece: on many cores the fork/join per
# piece (and, on a busy machine, waiting for a descheduled team member at every barrier) costs
# more than the copy. `gather` instead splits the output into one contiguous byte range per
# thread; each thread copies its range with numpy (a plain memcpy that releases the GIL and opens
# no OpenMP region). Bytes are copied as bytes: exact for every dtype.
PARALLEL_MIN_BYTES = 4 << 20  # below this one thread is faster than handing out work
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < threads:
            _POOL = ThreadPoolExecutor(threads, thread_name_prefix="rlconform-copy")
        return _POOL


def _copy_threads(nbytes: int) -> int:
    """Threads for a copy of `nbytes`: torch's intra-op thread count (so `torch.set_num_threads`
    and OMP_NUM_THREADS govern these copies too), at most one per PARALLEL_MIN_BYTES."""
    return max(1, min(torch.get_num_threads(), nbytes // PARALLEL_MIN_BYTES))


def _as_bytes(t: Tensor):
    return t.reshape(-1).view(torch.uint8).numpy()


def gather(pieces: Sequence[Tensor], dtype: torch.dtype | None = None,
           trailing: tuple[int, ...] = ()) -> Tensor:
    """A fresh contiguous tensor holding `pieces` concatenated on dim 0 (exactly `torch.cat`),
    copied in parallel over the machine's cores when large and on the CPU.

    `pieces` share one dtype (`dtype` when there are none) and their dims after the first
    (`trailing` when there are none)."""
    pieces = list(pieces)
    if not pieces:
        return torch.empty((0, *trailing), dtype=dtype if dtype is not None else torch.float32)
    first = pieces[0]
    threads = _copy_threads(sum(p.numel() for p in pieces) * first.element_size())
    if threads == 1:
        return torch.cat(pieces)
    if first.device.type != "cpu" or first.is_nested:
        return torch.cat(pieces)
    dtype, ndim, trailing = first.dtype, first.dim(), first.shape[1:]
    srcs = []
    try:
        for p in pieces:
            if p.dtype != dtype or p.dim() != ndim or p.shape[1:] != trailing:
                return torch.cat(pieces)  # promotes dtypes, or names the mismatch
            if p.numel():
                srcs.append(_as_bytes(p))
    except (RuntimeError, TypeError):  # numpy cannot see it (grad, conj/neg bit, device)
        return torch.cat(pieces)
    out = torch.empty((sum(int(p.shape[0]) for p in pieces), *trailing), dtype=dtype)
    copy_bytes(_as_bytes(out), srcs, threads)
    return out


def copy_bytes(dst, srcs: Sequence, threads: int | None = None) -> None:
    """Copy 1-D uint8 numpy arrays `srcs` back to back into the 1-D uint8 numpy array `dst`
    (their total length), one contiguous byte range per thread (`threads`: as `gather` picks)."""
    import numpy as np

    if threads is None:
        threads = _copy_threads(len(dst))
    bounds = [len(dst) * k // threads for k in range(threads + 1)]

    def copy_range(lo: int, hi: int) -> None:
        pos = 0
        for src in srcs:
            end = pos + len(src)
            if end > lo and pos < hi:
                a, b = max(lo, pos), min(hi, end)
                np.copyto(dst[a:b], src[a - pos:b - pos])
            if end >= hi:
                break
            pos = end

    if threads == 1:
        copy_range(0, len(dst))
    else:
        list(_pool(threads).map(copy_range, bounds[:-1], bounds[1:]))


def copy_tags(tags: Sequence[dict]) -> list[dict]:
    """A deep copy of each row's tag, rows sharing nothing (like `copy.deepcopy` per row, through
    pickle's C implementation: ~20x faster on hundreds of small JSON-like dicts); a row pickle
    cannot carry gets `copy.deepcopy`."""
    out = []
    for t in tags:
        try:
            out.append(pickle.loads(pickle.dumps(t, protocol=pickle.HIGHEST_PROTOCOL)))
        except Exception:  # noqa: BLE001 - anything pickle cannot carry: the general deep copy
            out.append(copy.deepcopy(t))
    return out


def _direct_njt_matches() -> bool:
    """Whether this torch's jagged class, built directly from (values, offsets), has the form
    the public constructor gives (the class is internal: a torch that changed it falls back).
    Checked without calling the public constructor, which logs an fx-tracing warning on first
    use in torch 2.13."""
    if _NJT is None:
        return False
    try:
        values, offsets = torch.arange(6.0).view(3, 2), torch.tensor([0, 1, 3])
        t = _NJT(values, offsets)
        rows = t.unbind()
        return (t._values is values and t._offsets is offsets and t._lengths is None
                and t._ragged_idx == 1 and t.layout is torch.jagged and t.is_nested
                and t.dim() == 3 and t.shape[0] == 2 and t.dtype == values.dtype
                and len(rows) == 2 and torch.equal(rows[0], values[:1])
                and torch.equal(rows[1], values[1:]))
    except Exception:  # noqa: BLE001 - any difference means: use the public constructor
        return False


_DIRECT_NJT = _direct_njt_matches()


def jagged_from_values(values: Tensor, lengths: Sequence[int]) -> Tensor:
    """A jagged nested tensor whose row i is the next `lengths[i]` entries of `values` (a view,
    no copy); zero-length rows allowed."""
    bounds = [0, *itertools.accumulate(int(n) for n in lengths)]
    offsets = torch.tensor(bounds, dtype=torch.long)
    if _DIRECT_NJT and not values.requires_grad and values.dim() >= 1 and \
            bounds[-1] == values.shape[0] and values.device.type == "cpu":
        # the jagged tensor class built directly: what nested_tensor_from_jagged returns (same
        # values, offsets, shape, dtype), without its dispatch through a view op (~50 us a call)
        return _NJT(values, offsets)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


def _contiguous_span(rows: list[Tensor]) -> Tensor | None:
    """One clone of the stored block when `rows` are back-to-back views of it (keys fetched in
    the order they were put): a single copy instead of one per row."""
    if len(rows) < 2:
        return None
    first, last = rows[0], rows[-1]
    step = first.element_size()
    end = first.data_ptr()
    for r in rows:  # each row contiguous, starting where the previous one ended (early out)
        if r.data_ptr() != end or not r.is_contiguous():
            return None
        end += r.numel() * step
    # first and last in one storage, so is everything between them: the span reads only it
    storage = first.untyped_storage()
    if last.untyped_storage().data_ptr() != storage.data_ptr() or \
            end > storage.data_ptr() + storage.nbytes():
        return None
    n = (end - first.data_ptr()) // step
    flat = torch.empty(0, dtype=first.dtype).set_(storage, first.storage_offset(), (n,))
    # the row count said outright: with a zero-size trailing dim, -1 would be ambiguous
    return flat.view(sum(int(r.shape[0]) for r in rows), *first.shape[1:]).clone()


def join_rows(name: str, layout: Layout, rows: list[Tensor]) -> Tensor:
    """One fresh tensor in the written layout from stored rows (a copy, never a view)."""
    if layout.kind == JAGGED:
        values = _contiguous_span(rows)
        if values is None:
            values = gather(rows, layout.dtype, layout.trailing)
        return jagged_from_values(values, [r.shape[0] for r in rows])
    if not rows:
        return torch.empty((0, *layout.trailing), dtype=layout.dtype)
    if _copy_threads(len(rows) * rows[0].numel() * rows[0].element_size()) == 1:
        return torch.stack(rows)
    return gather([r.unsqueeze(0) for r in rows])  # torch.stack, in parallel


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
        check_name("partition", partition)
        try:
            keys = check_names("key", keys)
        except ValueError as exc:
            if "repeated" in str(exc):
                raise ValueError(f"put got duplicated keys in partition {partition!r}: "
                                 f"{exc}") from None
            raise
        check_tags(tags, len(keys))
        for name in columns:
            check_name("field", name)
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
        if not keys:  # a put of no keys stores nothing: no key, no layout, no partition
            return
        part = self._rows.setdefault(partition, {})
        ptags = self._tags.setdefault(partition, {})
        playouts = self._layouts.setdefault(partition, {})
        for name, (layout, rows) in staged.items():
            playouts[name] = layout
            for k, r in zip(keys, rows):
                part.setdefault(k, {})[name] = r
        own = copy_tags(list(tags)) if tags is not None else None
        for i, k in enumerate(keys):
            part.setdefault(k, {})
            entry = ptags.setdefault(k, {})
            if own is not None:
                entry.update(own[i])

    def get(self, partition: str, keys: Sequence[str], select_fields: Sequence[str] | None = None
            ) -> tuple[dict[str, Tensor], list[dict]]:
        self._check_open()
        keys, select_fields = check_get(partition, keys, select_fields)
        part = self._rows.get(partition, {})
        missing = [k for k in keys if k not in part]
        if missing:
            raise KeyError(f"keys {missing[:8]} not in partition {partition!r}")
        out: dict[str, Tensor] = {}
        for name in select_fields:
            layout = self._layouts.get(partition, {}).get(name)
            lacking = [k for k in keys if name not in part[k]]
            if layout is None or lacking:
                raise KeyError(f"field {name!r} missing for keys {lacking[:8] or list(keys)[:8]} "
                               f"in partition {partition!r}")
            rows = [part[k][name] for k in keys]
            out[name] = (ObjectColumn(rows).clone() if layout.kind == OBJECT
                         else join_rows(name, layout, rows))
        tags = copy_tags([self._tags[partition][k] for k in keys]) if keys else []
        return out, tags

    def _partition(self, partition: str) -> dict:
        try:
            return self._rows[partition]
        except KeyError:
            raise KeyError(f"partition {partition!r} does not exist; known: "
                           f"{sorted(self._rows)}") from None

    def list(self, partition: str) -> list[str]:
        self._check_open()
        check_name("partition", partition)
        return list(self._rows.get(partition, {}))  # a partition holding no keys lists []

    def fields(self, partition: str) -> list[str]:
        self._check_open()
        self._partition(partition)
        return list(self._layouts.get(partition, {}))

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> None:
        self._check_open()
        check_name("partition", partition)
        if keys is not None:
            keys = check_names("key", keys)
        if keys is None:  # the partition then holds nothing, whatever it held (nothing too)
            for d in (self._rows, self._tags, self._layouts):
                d.pop(partition, None)
            return
        part = self._rows.get(partition, {})
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
