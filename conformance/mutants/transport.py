"""Transport mutants: the in-memory data plane with one field-seen defect each."""

from __future__ import annotations

import copy

import torch

from rlconform.conformance.backends.reference import build
from rlconform.reference_impl.dataplane import InMemoryDataPlane

from . import mutant


def _with(cls):
    return lambda: build(transport=cls)


@mutant("dropped_packed_on_write", "rollout write kept only dense torch.Tensor values and "
        "silently dropped jagged (packed) columns", "transport")
def _dropped():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            super().put(partition, keys, {k: v for k, v in columns.items() if not v.is_nested},
                        tags)

        def get(self, partition, keys, select_fields=None):
            if select_fields is None:
                raise TypeError("select_fields required")
            have = set(self._layouts.get(partition, {}))
            return super().get(partition, keys, [f for f in select_fields if f in have])

    return _with(T)()


@mutant("jagged_rows_truncated", "storage cut every jagged row to the length of the shortest "
        "non-empty row (a fixed-width schema)", "transport")
def _truncated():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            out = {}
            for k, v in columns.items():
                if v.is_nested:
                    rows = v.unbind()
                    n = min((r.shape[0] for r in rows if r.shape[0]), default=0)
                    v = torch.nested.nested_tensor([r[:n] for r in rows], layout=torch.jagged)
                out[k] = v
            super().put(partition, keys, out, tags)

    return _with(T)()


@mutant("bf16_stored_as_fp32", "storage upcast bfloat16 columns to float32 (2x the bytes, "
        "and the wrong dtype at the consumer)", "transport")
def _upcast():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            super().put(partition, keys, {k: v.float() if v.dtype == torch.bfloat16 else v
                                          for k, v in columns.items()}, tags)

    return _with(T)()


@mutant("scalar_rows_as_1", "the key/value schema recorded a 1-D (N,) field as (1,) rows: get "
        "returns (N, 1)", "transport")
def _scalar_rows():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            cols, tags = super().get(partition, keys, select_fields)
            return {k: v.unsqueeze(1) if not v.is_nested and v.dim() == 1 else v
                    for k, v in cols.items()}, tags

    return _with(T)()


@mutant("uniform_jagged_densified", "get guessed the layout from the data: a jagged column whose "
        "rows share a length comes back dense", "transport")
def _densified():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            cols, tags = super().get(partition, keys, select_fields)
            out = {}
            for k, v in cols.items():
                if v.is_nested and len({r.shape for r in v.unbind()}) == 1:
                    v = torch.stack(list(v.unbind()))
                out[k] = v
            return out, tags

    return _with(T)()


@mutant("dense_returned_jagged", "get returned every column as a jagged nested tensor, the "
        "storage's native layout, whatever was written", "transport")
def _all_jagged():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            cols, tags = super().get(partition, keys, select_fields)
            return {k: v if v.is_nested or v.dim() < 2 else torch.nested.nested_tensor(
                list(v.unbind()), layout=torch.jagged) for k, v in cols.items()}, tags

    return _with(T)()


@mutant("tags_in_storage_order", "get returned tags in storage order instead of the order of "
        "the keys asked for", "transport")
def _tags_order():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            cols, _ = super().get(partition, keys, select_fields)
            wanted = set(keys)
            tags = [copy.deepcopy(t) for k, t in self._tags[partition].items() if k in wanted]
            return cols, tags

    return _with(T)()


@mutant("tags_dropped_on_get", "get returned empty tags: the segment shapes needed to rebuild "
        "flattened media are lost", "transport")
def _tags_dropped():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            cols, tags = super().get(partition, keys, select_fields)
            return cols, [{} for _ in tags]

    return _with(T)()


@mutant("short_result_on_missing_key", "get skipped missing keys and returned a shorter "
        "batch", "transport")
def _short():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            part = self._rows.get(partition, {})
            return super().get(partition, [k for k in keys if k in part], select_fields)

    return _with(T)()


@mutant("empty_column_on_missing_field", "get returned an empty column for a field that was "
        "never written", "transport")
def _empty_field():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            have = set(self._layouts.get(partition, {}))
            cols, tags = super().get(partition, keys, [f for f in select_fields if f in have])
            for f in select_fields:
                cols.setdefault(f, torch.zeros(len(keys)))
            return cols, tags

    return _with(T)()


@mutant("default_select_all", "get without select_fields returned every stored field (the "
        "default list that let a stage silently fetch the wrong set)", "transport")
def _select_all():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            if select_fields is None:
                select_fields = list(self._layouts.get(partition, {}))
            return super().get(partition, keys, select_fields)

    return _with(T)()


@mutant("put_overwrites_row", "a later put under existing keys replaced the stored row (and "
        "its tags) instead of merging", "transport")
def _overwrite():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            for k in keys:
                self._rows.get(partition, {}).pop(k, None)
                self._tags.get(partition, {}).pop(k, None)
            super().put(partition, keys, columns, tags)

    return _with(T)()


@mutant("clear_removes_partition", "clear(partition, keys) removed the whole partition",
        "transport")
def _clear_all():
    class T(InMemoryDataPlane):
        def clear(self, partition, keys=None):
            super().clear(partition, None)

    return _with(T)()


@mutant("partitions_shared", "the partition argument was ignored: every partition is one "
        "namespace", "transport")
def _shared():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            super().put("all", keys, columns, tags)

        def get(self, partition, keys, select_fields=None):
            return super().get("all", keys, select_fields)

        def list(self, partition):
            return super().list("all")

        def clear(self, partition, keys=None):
            super().clear("all", keys)

    return _with(T)()


def _rebind(part: dict, keys, columns: dict) -> None:
    """Make the stored rows views of `columns`: the store now aliases those tensors."""
    for name, col in columns.items():
        if not isinstance(col, torch.Tensor):  # object columns: DP-OBJECT's own aliasing case
            continue
        if col.is_nested:
            off = col.offsets().tolist()
            rows = [col.values()[a:b] for a, b in zip(off[:-1], off[1:])]
        else:
            rows = list(col.unbind(0))
        for k, r in zip(keys, rows):
            part[k][name] = r


@mutant("aliasing_put", "put stored the caller's tensors without a copy", "transport")
def _alias_put():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            super().put(partition, keys, columns, tags)
            if keys:  # a put of no keys stores nothing to alias
                _rebind(self._rows[partition], keys, columns)

    return _with(T)()


@mutant("aliasing_get", "get handed out the stored rows themselves: mutating a result changes "
        "the store", "transport")
def _alias_get():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            cols, tags = super().get(partition, keys, select_fields)
            _rebind(self._rows[partition], keys, cols)
            return cols, tags

    return _with(T)()


# -- object columns (capability object_columns) ------------------------------------------------
def _object_layout(self, partition: str, name: str) -> bool:
    layout = self._layouts.get(partition, {}).get(name)
    return layout is not None and layout.kind == "object"


@mutant("transport_object_rows_aliased", "object columns were stored and returned by reference: "
        "a caller that pops a key from a row, or fills a tensor in it, changes the store",
        "transport")
def _object_aliased():
    from rlconform.reference_impl.objects import ObjectColumn

    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            super().put(partition, keys, columns, tags)
            for name, col in columns.items():
                if isinstance(col, ObjectColumn):
                    for k, row in zip(keys, col.rows):
                        self._rows[partition][k][name] = row

        def get(self, partition, keys, select_fields=None):
            out, tags = super().get(partition, keys, select_fields)
            for name in select_fields or []:
                if _object_layout(self, partition, name):
                    col = ObjectColumn([])
                    col.rows = [self._rows[partition][k][name] for k in keys]
                    out[name] = col
            return out, tags

    return _with(T)()


@mutant("transport_object_none_as_empty", "the store had no None value: text-only None rows of "
        "an object column came back as {}", "transport")
def _object_none():
    from rlconform.reference_impl.objects import ObjectColumn

    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            out, tags = super().get(partition, keys, select_fields)
            for name, col in out.items():
                if isinstance(col, ObjectColumn):
                    out[name] = ObjectColumn([{} if r is None else r for r in col])
            return out, tags

    return _with(T)()


# -- concurrency: one instance used from several threads (DP-CONCURRENT) -------------------------
# Each defect is invisible to a single thread; each widens its own race window with
# `time.sleep(0)` (a GIL release where a real store would do I/O), so the clause kills it reliably.
@mutant("partition_index_lost_update", "puts published the partition index and each partition's "
        "key dict by copy-on-write without a lock: two workers putting at once, one's keys "
        "(or partition) are lost", "transport")
def _lost_update():
    import time

    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            rows, ptags = dict(self._rows), dict(self._tags)  # read ...
            rows[partition] = dict(rows.get(partition, {}))
            ptags[partition] = dict(ptags.get(partition, {}))
            time.sleep(0)
            self._rows, self._tags = rows, ptags  # ... modify-write: a stale copy wins
            super().put(partition, keys, columns, tags)

    return _with(T)()


@mutant("tags_staged_on_instance", "put staged the tags on the transport object between storing "
        "the columns and committing the tags: a concurrent put's tags land on these keys",
        "transport")
def _staged_tags():
    import time

    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            self._pending_tags = None if tags is None else list(tags)
            super().put(partition, keys, columns, None)
            time.sleep(0)
            for k, t in zip(keys, self._pending_tags or []):
                self._tags[partition][k].update(copy.deepcopy(t))

    return _with(T)()


@mutant("shared_get_buffer", "get assembled dense columns in one staging buffer per transport "
        "(reused across calls) and copied out of it: concurrent gets hand each other's rows "
        "out", "transport")
def _shared_buffer():
    import time

    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            cols, tags = super().get(partition, keys, select_fields)
            staging = self.__dict__.setdefault("_staging", {})
            out = {}
            for name, col in cols.items():
                if not isinstance(col, torch.Tensor) or col.is_nested:  # dense columns only
                    out[name] = col
                    continue
                slot = (col.dtype, tuple(col.shape[1:]))
                buf = staging.get(slot)
                if buf is None or buf.shape[0] < col.shape[0]:
                    buf = staging[slot] = torch.empty((max(64, col.shape[0]), *slot[1]),
                                                      dtype=col.dtype)
                buf[: col.shape[0]].copy_(col)
                time.sleep(0)
                out[name] = buf[: col.shape[0]].clone()
            return out, tags

    return _with(T)()


# -- values a comparator cannot see (DP-BITEXACT) ------------------------------------------------
@mutant("subnormals_flushed_in_store", "the store's float32 copy kernel ran with flush-to-zero "
        "(denormals-are-zero set by another library): subnormal logprobs and pixel values "
        "arrive as zeros", "transport")
def _flush_subnormals():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            def flush(v):
                if not isinstance(v, torch.Tensor) or v.dtype != torch.float32:
                    return v
                tiny = torch.finfo(v.dtype).smallest_normal
                return _map_values(v, lambda x: torch.where(  # a signed zero, as DAZ gives
                    x.abs() < tiny, torch.copysign(torch.zeros_like(x), x), x))

            super().put(partition, keys, {k: flush(v) for k, v in columns.items()}, tags)

    return _with(T)()


@mutant("bf16_kept_as_fp32_in_store", "the store kept bfloat16 columns as float32 (its "
        "serialiser has no bfloat16) and cast them back on get: dtype and ordinary values "
        "survive, NaN payloads do not", "transport")
def _bf16_via_fp32():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            self.__dict__.setdefault("_was_bf16", set()).update(
                (partition, k) for k, v in columns.items()
                if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16)
            was = self.__dict__["_was_bf16"]
            super().put(partition, keys, {k: _map_values(v, lambda x: x.float())
                                          if (partition, k) in was else v
                                          for k, v in columns.items()}, tags)

        def get(self, partition, keys, select_fields=None):
            cols, tags = super().get(partition, keys, select_fields)
            was = self.__dict__.get("_was_bf16", set())
            return {k: _map_values(v, lambda x: x.to(torch.bfloat16))
                    if (partition, k) in was else v for k, v in cols.items()}, tags

    return _with(T)()


def _map_values(col, fn):
    """`fn` applied to a column's values, jagged or dense, keeping the row boundaries."""
    if col.is_nested:
        return torch.nested.nested_tensor_from_jagged(fn(col.values()), offsets=col.offsets())
    return fn(col)


# -- shape independent of size (DP-SHAPE-TAGS) ---------------------------------------------------
def _shape_lists(tag, visit, path=()):
    """Replace every list of shapes (lists of ints) inside a tag by `visit(path, shapes)`."""
    if isinstance(tag, dict):
        for k, v in tag.items():
            if isinstance(v, list) and v and all(isinstance(s, list) and all(
                    isinstance(d, int) for d in s) for s in v):
                tag[k] = visit((*path, k), v)
            else:
                _shape_lists(v, visit, (*path, k))


@mutant("tag_shapes_interned_by_size", "the metadata store interned the shape lists in tags by "
        "their element counts per partition (to save controller memory): a row whose media have "
        "as many values as an earlier row's gets that row's shapes", "transport")
def _interned_shapes():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            if tags is not None:
                seen = self.__dict__.setdefault("_interned", {}).setdefault(partition, {})
                tags = copy.deepcopy(list(tags))
                for t in tags:
                    def intern(path, shapes):
                        size = (path, tuple(int(torch.Size(s).numel()) for s in shapes))
                        return copy.deepcopy(seen.setdefault(size, shapes))

                    _shape_lists(t, intern)
            super().put(partition, keys, columns, tags)

    return _with(T)()


# -- untrusted input: names, tags, layouts, empty calls, order, arguments ------------------------
def _rows_in(col, idx: list[int]):
    """Rows `idx` of a column, in that order (dense or jagged; object columns as they are)."""
    if not isinstance(col, torch.Tensor):
        return col
    if col.is_nested:
        rows = col.unbind()
        return torch.nested.nested_tensor([rows[i] for i in idx], layout=torch.jagged)
    return col[idx]


class _Renamed(InMemoryDataPlane):
    """The reference storing every partition and key under `self.rename(name)`."""

    def rename(self, name):
        return name

    def put(self, partition, keys, columns, tags=None):
        super().put(self.rename(partition), [self.rename(k) for k in keys], columns, tags)

    def get(self, partition, keys, select_fields=None):
        return super().get(self.rename(partition), [self.rename(k) for k in keys],
                           select_fields)

    def list(self, partition):
        return super().list(self.rename(partition))

    def clear(self, partition, keys=None):
        super().clear(self.rename(partition),
                      None if keys is None else [self.rename(k) for k in keys])


@mutant("names_trimmed", "the store trimmed leading and trailing whitespace off names (a "
        "cleanup of user input): ' lead' lists as 'lead', and 'p' and 'p ' are one partition",
        "transport")
def _names_trimmed():
    class T(_Renamed):
        def rename(self, name):
            return name.strip() if isinstance(name, str) and name.strip() else name

    return _with(T)()


@mutant("long_names_truncated", "the store cut names to 250 characters (a filesystem-style "
        "limit): a long key lists as its first 250 characters", "transport")
def _long_truncated():
    class T(_Renamed):
        def rename(self, name):
            return name[:250] if isinstance(name, str) else name

    return _with(T)()


@mutant("refused_names_accepted", "the store accepted any name, the empty string, NUL, a lone "
        "surrogate, non-str and over-long ones included (stored under its repr)", "transport")
def _names_accepted():
    from rlconform.reference_impl.dataplane import check_name

    class T(_Renamed):
        def rename(self, name):
            try:
                return check_name("name", name)
            except (TypeError, ValueError):
                return "\x01" + repr(name)[:200]

    return _with(T)()


@mutant("names_joined_with_separator", "the store kept one flat key space, `<partition>:<key>`: "
        "partition 'p:a' key 'b' and partition 'p' key 'a:b' are one record", "transport")
def _joined():
    ALL = "all"

    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            super().put(ALL, [f"{partition}:{k}" for k in keys], columns, tags)

        def get(self, partition, keys, select_fields=None):
            if not any(k.startswith(f"{partition}:") for k in self._all()):
                raise KeyError(f"partition {partition!r} does not exist")
            return super().get(ALL, [f"{partition}:{k}" for k in keys], select_fields)

        def _all(self):
            return list(self._rows.get(ALL, {}))

        def list(self, partition):
            found = [k[len(partition) + 1:] for k in self._all() if k.startswith(f"{partition}:")]
            if not found:
                raise KeyError(f"partition {partition!r} does not exist")
            return found

        def clear(self, partition, keys=None):
            if keys is None:
                keys = [k[len(partition) + 1:] for k in self._all()
                        if k.startswith(f"{partition}:")]
            super().clear(ALL, [f"{partition}:{k}" for k in keys])

    return _with(T)()


@mutant("partition_list_by_prefix", "list and clear of a partition matched every partition "
        "whose name starts with it (a prefix scan, SCAN MATCH 'p*'): list('p') shows 'pp''s "
        "keys and clear('p') removes them", "transport")
def _prefix_scan():
    class T(InMemoryDataPlane):
        def _matching(self, partition):
            return [p for p in self._rows if p.startswith(partition)]

        def list(self, partition):
            parts = self._matching(partition)
            if not parts:
                raise KeyError(f"partition {partition!r} does not exist")
            return [k for p in parts for k in self._rows[p]]

        def clear(self, partition, keys=None):
            if keys is not None:
                return super().clear(partition, keys)
            for p in self._matching(partition) or [partition]:
                super().clear(p)

    return _with(T)()


@mutant("partition_names_case_folded", "partition names were compared case-insensitively (a "
        "store on a case-insensitive collation or filesystem): 'P' and 'p' are one partition",
        "transport")
def _case_folded():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            super().put(_fold(partition), keys, columns, tags)

        def get(self, partition, keys, select_fields=None):
            return super().get(_fold(partition), keys, select_fields)

        def list(self, partition):
            return super().list(_fold(partition))

        def clear(self, partition, keys=None):
            super().clear(_fold(partition), keys)

    return _with(T)()


def _fold(name):
    return name.casefold() if isinstance(name, str) and name else name


def _map_tag(v, fn):
    """`fn` applied to every float inside a tag, containers rebuilt as they were."""
    if isinstance(v, float):
        return fn(v)
    if isinstance(v, dict):
        return {k: _map_tag(x, fn) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_map_tag(x, fn) for x in v)
    return v


@mutant("tags_through_json", "tags were stored as JSON: tuples come back as lists and int dict "
        "keys as str", "transport")
def _tags_json():
    import json

    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            from rlconform.reference_impl.dataplane import check_tags

            check_tags(tags, len(list(keys)))
            super().put(partition, keys, columns,
                        None if tags is None else json.loads(json.dumps(list(tags))))

    return _with(T)()


@mutant("tag_floats_as_float32", "the metadata store kept tag floats as float32: 0.1 comes back "
        "0.10000000149011612", "transport")
def _tag_float32():
    import math
    import struct

    def f32(x: float) -> float:
        try:
            return struct.unpack("f", struct.pack("f", x))[0]
        except OverflowError:
            return math.copysign(math.inf, x)

    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            super().put(partition, keys, columns,
                        None if tags is None else [_map_tag(t, f32) for t in tags])

    return _with(T)()


@mutant("refused_tags_accepted", "put stored any tag value by deep copy (a set, bytes, a "
        "tensor, an object, a float key): a store without pickle cannot carry them", "transport")
def _tags_accepted():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            keys = list(keys)
            super().put(partition, keys, columns, None)
            if tags is not None and keys:
                for k, t in zip(keys, tags):
                    self._tags[partition][k].update(copy.deepcopy(t))

    return _with(T)()


@mutant("layout_replaced_on_reput", "a put of a stored field in another layout replaced the "
        "recorded layout (layouts kept per put, never compared): the rows written earlier come "
        "back in the new layout", "transport")
def _layout_replaced():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            for name in columns:
                self._layouts.get(partition, {}).pop(name, None)
            super().put(partition, keys, columns, tags)

    return _with(T)()


@mutant("partial_put_on_layout_conflict", "put wrote field by field and checked each field's "
        "layout as it went: a conflict in the second field left the first one stored",
        "transport")
def _partial_put():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            if not columns:
                return super().put(partition, keys, columns, tags)
            for i, (name, col) in enumerate(columns.items()):
                super().put(partition, keys, {name: col}, tags if i == 0 else None)

    return _with(T)()


@mutant("get_of_no_keys_returns_nothing", "get of no keys returned no columns ('nothing to "
        "fetch')", "transport")
def _empty_get_nothing():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            if not keys:
                self._partition(partition)
                return {}, []
            return super().get(partition, keys, select_fields)

    return _with(T)()


@mutant("empty_get_loses_layout", "get of no keys returned torch.empty(0) for every field, "
        "whatever its layout and dtype", "transport")
def _empty_get_layout():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            cols, tags = super().get(partition, keys, select_fields)
            if not keys:
                cols = {name: torch.empty(0) for name in cols}
            return cols, tags

    return _with(T)()


@mutant("clear_of_no_keys_clears_partition", "clear tested its key list for truth (`if not "
        "keys`), so clear(p, []) cleared the whole partition", "transport")
def _clear_empty():
    class T(InMemoryDataPlane):
        def clear(self, partition, keys=None):
            super().clear(partition, keys or None)

    return _with(T)()


@mutant("contiguous_span_checked_at_ends", "get copied the stored block in one piece when the "
        "first and last keys asked sat at its ends, without checking the keys between: a "
        "shuffled middle comes back in storage order", "transport")
def _span_at_ends():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            cols, tags = super().get(partition, keys, select_fields)
            order = {k: i for i, k in enumerate(self._rows.get(partition, {}))}
            pos = [order[k] for k in keys]
            if len(pos) > 2 and pos[-1] - pos[0] == len(pos) - 1 and \
                    sorted(pos) == list(range(pos[0], pos[-1] + 1)):
                stored = sorted(range(len(pos)), key=pos.__getitem__)
                cols = {n: _rows_in(c, stored) for n, c in cols.items()}
            return cols, tags

    return _with(T)()


@mutant("rows_grouped_by_put", "get gathered rows block by block (one block per put) and "
        "concatenated the blocks in put order: keys of a later put asked first come back last",
        "transport")
def _grouped():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            super().put(partition, keys, columns, tags)
            block = self.__dict__.setdefault("_block", {})
            n = len(block)
            for k in keys:
                block[partition, k] = n

        def get(self, partition, keys, select_fields=None):
            cols, tags = super().get(partition, keys, select_fields)
            block = self.__dict__.get("_block", {})
            grouped = sorted(range(len(keys)), key=lambda i: block.get((partition, keys[i]), 0))
            return {n: _rows_in(c, grouped) for n, c in cols.items()}, tags

    return _with(T)()


@mutant("put_sorts_caller_keys", "put sorted the caller's key list in place (to keep its "
        "index sorted)", "transport")
def _sorts_keys():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            super().put(partition, keys, columns, tags)
            if isinstance(keys, list):
                keys.sort()

    return _with(T)()


@mutant("get_sorts_select_fields", "get sorted the caller's select_fields in place (a canonical "
        "field order for its cache key)", "transport")
def _sorts_fields():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            if isinstance(select_fields, list):
                select_fields.sort()
            return super().get(partition, keys, select_fields)

    return _with(T)()


@mutant("put_stamps_caller_tags", "put wrote its layout record into the caller's tag dicts "
        "(and stripped it again on get)", "transport")
def _stamps_tags():
    LAYOUT = "__layout__"

    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            if tags is not None:
                for t in tags:
                    t[LAYOUT] = sorted(columns)
            super().put(partition, keys, columns, tags)

        def get(self, partition, keys, select_fields=None):
            cols, tags = super().get(partition, keys, select_fields)
            for t in tags:
                t.pop(LAYOUT, None)
            return cols, tags

    return _with(T)()


def _served_with_client(client_cls):
    """The reference's served store with another client class for the reopened side."""
    from rlconform.conformance.backend import CAPABILITIES
    from rlconform.reference_impl.served import ServedDataPlane

    def factory(address=None):
        return ServedDataPlane() if address is None else client_cls(address)

    return build(transport=factory, capabilities=frozenset(CAPABILITIES) - {"cuda"})


@mutant("peer_tags_via_json", "the client of a reopened store sent and received tags as JSON: "
        "another process's tuples come back as lists and int keys as str", "transport")
def _peer_json():
    import json

    from rlconform.reference_impl.served import StoreClient

    class C(StoreClient):
        def put(self, partition, keys, columns, tags=None):
            super().put(partition, keys, columns,
                        None if tags is None else json.loads(json.dumps(list(tags))))

        def get(self, partition, keys, select_fields=None):
            cols, tags = super().get(partition, keys, select_fields)
            return cols, json.loads(json.dumps(tags))

    return _served_with_client(C)


@mutant("address_opens_fresh_store", "reopening by address opened a new, empty store in the "
        "other process instead of the one at the address", "transport")
def _fresh_store():
    from rlconform.reference_impl.served import ServedDataPlane

    return _served_with_client(lambda address: ServedDataPlane())


@mutant("clear_keeps_tags", "clear of a partition dropped its rows and layouts but kept its "
        "tags: the next put of the same keys merges the stale tags", "transport")
def _clear_tags():
    class T(InMemoryDataPlane):
        def clear(self, partition, keys=None):
            if keys is not None:
                return super().clear(partition, keys)
            kept = self._tags.get(partition)
            super().clear(partition)
            if kept is not None:
                self._tags[partition] = kept

    return _with(T)()


@mutant("clear_keeps_layouts", "clear of a partition dropped its rows and tags but kept the "
        "recorded layouts: the next put in another layout is refused", "transport")
def _clear_layouts():
    class T(InMemoryDataPlane):
        def clear(self, partition, keys=None):
            if keys is not None:
                return super().clear(partition, keys)
            kept = self._layouts.get(partition)
            super().clear(partition)
            if kept is not None:
                self._layouts[partition] = kept

    return _with(T)()


@mutant("tags_shallow_copied_on_put", "put kept a shallow copy of each tag (dict(t)): the "
        "caller's nested shape lists are the store's", "transport")
def _tags_shallow():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            keys = list(keys)
            super().put(partition, keys, columns, None if tags is None else [{} for _ in keys])
            if tags is not None and keys:
                for k, t in zip(keys, tags):
                    self._tags[partition][k].update(dict(t))

    return _with(T)()


@mutant("tags_shared_on_get", "get returned the stored tag dicts themselves: a caller that "
        "edits a fetched tag edits the store", "transport")
def _tags_shared():
    class T(InMemoryDataPlane):
        def get(self, partition, keys, select_fields=None):
            cols, _ = super().get(partition, keys, select_fields)
            return cols, [self._tags[partition][k] for k in keys]

    return _with(T)()


# -- names the store keeps for itself; clear of path-like names (DP-NAMES, DP-CLEAN-SLATE) -------
_OWN_NAMES = ("__keys__", "__tags__", "__layout__")


@mutant("bookkeeping_names_reserved", "the store kept its own index under names like "
        "'__keys__' in the partitions' namespace and refused them as partition names ('reserved "
        "name'): a caller's partition with such a name cannot be written", "transport")
def _own_names():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            if partition in _OWN_NAMES:
                raise ValueError(f"partition name {partition!r} is reserved by the store")
            return super().put(partition, keys, columns, tags)

    return _with(T)()


@mutant("clear_of_path_like_partition_missed", "clear of a whole partition deleted it by a "
        "path (a filesystem-style store): a name with '/' in it named another path and nothing "
        "was removed, so the suite's clean-up left those partitions behind", "transport")
def _path_clear():
    class T(InMemoryDataPlane):
        def clear(self, partition, keys=None):
            if keys is None and isinstance(partition, str) and "/" in partition:
                return None
            return super().clear(partition, keys)

    return _with(T)()


# -- every argument (DP-ARGS-INTACT) -------------------------------------------------------------
@mutant("put_freezes_caller_object_lists", "put stored a copy of each object row, then froze the "
        "caller's per-image lists into tuples in place (hashable for its dedup cache): the "
        "rollout's rows changed type under it", "transport")
def _freeze_object_lists():
    from rlconform.reference_impl.objects import ObjectColumn

    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            super().put(partition, keys, columns, tags)
            for col in columns.values():
                if isinstance(col, ObjectColumn):
                    for row in col.rows:
                        for k, v in (row or {}).items():
                            if isinstance(v, list):
                                row[k] = tuple(v)

    return _with(T)()
