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
