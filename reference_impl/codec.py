"""The reference wire codec: `Batch` <-> `WireBatch(columns, tags)`.

Packed media travel as one jagged nested tensor per field (row i: the flattened segments of
logical row i) with the segment shapes on row i's tag, so the decoder rebuilds row boundaries from
what the encoder recorded and never from the data: rows that happen to share a shape are not
densified, `None` rows come back as `None`, not as `(0, ...)` tensors. Per-token fields travel
jagged by sequence length (row i is `(len_i, *other dims)`, cut on the field's registered
sequence dim); per-sample fields as they are. An object column (per-row dicts of media) travels
flattened: a dense int8 column `<field>` (1: a dict row, 0: a None row) that selects the field,
one jagged column `<field>.<key>` per dict key, and each row's keys, shapes and list-ness on its
tag (`None` for a None row, `{}` for an empty dict), so it decodes exactly.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .batch import Batch
from .dataplane import (
    column_layout,
    gather,
    is_nested,
    jagged_from_values,
    jagged_parts,
    jagged_rows,
    split_rows,
)
from .objects import ObjectColumn
from .packed import PackedTensor
from .registry import FAMILIES, FIELDS, DtypePolicy, Kind, spec

SEQ_LEN_TAG = "seq_len"
FAMILY_TAG = "family"
OBJECT_SEP = "."  # wire column of key `k` of object field `f`: "f.k"


def column_field(column: str) -> str:
    """The registered field a wire column belongs to (`multi_modal_inputs.pixel_values` ->
    `multi_modal_inputs`); other columns are their field."""
    head, sep, _ = column.partition(OBJECT_SEP)
    if sep and head in FIELDS and FIELDS[head].kind is Kind.OBJECT:
        return head
    return column


@dataclass
class WireBatch:
    """Columns (dense or jagged, `B` rows each) and one tag dict per row."""

    columns: dict[str, Tensor]
    tags: list[dict] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tags)


def jagged(rows: list[Tensor], dtype: torch.dtype) -> Tensor:
    """A jagged nested tensor from 1-D rows (zero-length rows allowed), one copy of the data."""
    values = gather(rows, dtype).to(dtype)  # one copy, over the machine's cores
    return jagged_from_values(values, [r.shape[0] for r in rows])


class _TokenIndex:
    """(row, position) of every valid token, rows in order: row i's positions 0..lens[i]-1.
    Indexing `[B, S, ...]` with it gathers exactly what concatenating each row's first lens[i]
    positions gives (and index_put_ scatters it back), in one op instead of one per row.

    The index is a pure function of the lengths, and one GRPO step builds it for the same
    lengths again and again (a shard's three fetches decode, its two logprob columns encode,
    ~11 builds of ~35 us for 2-3 distinct length lists), so `of` keeps the last few in a small
    cache. The index tensors are only ever read (indexing, index_put_'s indices), never written,
    and `at` keeps each device's copy beside the CPU one instead of replacing it, so a cached
    index shared by threads or devices is never changed in place."""

    __slots__ = ("rows", "positions", "batch", "need", "_on")

    CACHE_ENTRIES = 4
    CACHE_MAX_TOKENS = 1 << 18  # 4 MiB of int64 indices per entry at most
    _cache: OrderedDict = OrderedDict()
    _cache_lock = threading.Lock()

    def __init__(self, rows: Tensor, positions: Tensor, batch: int, need: int):
        self.rows, self.positions, self.batch, self.need = rows, positions, batch, need
        self._on = {rows.device: (rows, positions)}

    @classmethod
    def of(cls, lens: list[int]) -> _TokenIndex | None:
        if not lens or any(type(n) is not int or n < 0 for n in lens):
            return None  # the per-row path raises what it raises
        key = tuple(lens)
        with cls._cache_lock:
            hit = cls._cache.get(key)
            if hit is not None:
                cls._cache.move_to_end(key)
                return hit
        n = torch.tensor(lens, dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(lens)), n)
        starts = torch.cumsum(n, 0) - n
        positions = torch.arange(int(rows.shape[0])) - starts[rows]
        index = cls(rows, positions, len(lens), max(lens))
        if int(rows.shape[0]) <= cls.CACHE_MAX_TOKENS:
            with cls._cache_lock:
                cls._cache[key] = index
                while len(cls._cache) > cls.CACHE_ENTRIES:
                    cls._cache.popitem(last=False)
        return index

    def at(self, device: torch.device) -> tuple[Tensor, Tensor]:
        pair = self._on.get(device)
        if pair is None:
            pair = self._on[device] = (self.rows.to(device), self.positions.to(device))
        return pair

    def fits(self, v: Tensor, axis: int) -> bool:
        """`v` is `[B, ...]` with B rows and a sequence dim (`axis` in a row) that holds
        every row's tokens."""
        return (v.dim() >= 2 and int(v.shape[0]) == self.batch
                and int(v.shape[axis + 1]) >= self.need)


class ReferenceCodec:
    """Stateless; `pixel_dtype` (when set) casts POLICY media once, at encode."""

    name = "reference"

    def __init__(self, pixel_dtype: torch.dtype | None = None):
        self.pixel_dtype = pixel_dtype

    # -- encode -------------------------------------------------------------------------
    def encode(self, batch: Batch) -> WireBatch:
        if batch.batch_size == 0:
            raise ValueError(f"cannot encode an empty batch (0 rows) with fields "
                             f"{sorted(batch.fields)}; a rank with no rows fetches nothing")
        batch.validate()
        lens = batch.seq_lens.tolist()
        tags: list[dict] = [{SEQ_LEN_TAG: int(n)} for n in lens]
        if batch.family:
            for t in tags:
                t[FAMILY_TAG] = batch.family
        fam = batch.family_spec
        columns: dict[str, Tensor] = {}
        index = None  # token positions of every row, built once for all per-token fields
        for name, v in batch.fields.items():
            fs = spec(name)
            if fs.kind is Kind.PACKED:
                if not isinstance(v, PackedTensor):
                    raise TypeError(f"packed field {name!r} must be a PackedTensor, got "
                                    f"{type(v).__name__}")
                keep = fam is not None and name in fam.keep_dtype
                cast = (self.pixel_dtype if fs.dtype_policy is DtypePolicy.POLICY and not keep
                        else None)
                columns[name] = self._encode_packed(name, v, cast, tags)
            elif fs.kind is Kind.PER_TOKEN:
                if index is None:
                    index = _TokenIndex.of(lens)
                columns[name] = self._encode_per_token(name, v, lens, index)
            elif fs.kind is Kind.OBJECT:
                if not isinstance(v, ObjectColumn):
                    raise TypeError(f"object field {name!r} must be an ObjectColumn, got "
                                    f"{type(v).__name__}")
                columns[name] = torch.tensor([r is not None for r in v.rows], dtype=torch.int8)
                columns.update(self._encode_object(name, v, tags, fam))
            else:
                columns[name] = v.detach().clone()
        return WireBatch(columns, tags)

    @staticmethod
    def _encode_per_token(name: str, v: Tensor, lens: list[int],
                          index: _TokenIndex | None = None) -> Tensor:
        """Row i: the first `lens[i]` positions of the sequence dim, moved first."""
        axis = spec(name).seq_axis(v.dim()) - 1  # in a row (batch dim gone)
        if index is not None and index.fits(v, axis):
            # one gather for all rows (what the per-row loop below concatenates), a copy
            values = v.movedim(axis + 1, 1)[index.at(v.device)]
            return jagged_from_values(values, lens)
        rows = [v[i].narrow(axis, 0, n).movedim(axis, 0) for i, n in enumerate(lens)]
        values = (torch.cat(rows) if rows else
                  v.new_empty((0, *[d for k, d in enumerate(v.shape[1:]) if k != axis])))
        return jagged_from_values(values, lens)

    def _encode_object(self, name: str, v: ObjectColumn, tags: list[dict], fam
                       ) -> dict[str, Tensor]:
        """One jagged column per key (row i: key's tensors of row i, flattened; empty where
        row i lacks the key) and row i's tag `{key: {"shape": s} | {"list": [s, ...]}}`."""
        keys = v.keys()
        flat: dict[str, list[Tensor]] = {k: [] for k in keys}
        lengths: dict[str, list[int]] = {k: [] for k in keys}
        for i, row in enumerate(v.rows):
            if row is None:
                tags[i][name] = None
            else:
                tag = {}
                for key, value in row.items():
                    ts = value if isinstance(value, (list, tuple)) else [value]
                    tag[key] = ({"list": [list(t.shape) for t in ts]}
                                if isinstance(value, (list, tuple)) else {"shape": list(value.shape)})
                tags[i][name] = tag
            for key in keys:
                value = (row or {}).get(key)
                ts = [] if value is None else value if isinstance(value, (list, tuple)) \
                    else [value]
                flat[key].extend(t.reshape(-1) for t in ts)
                lengths[key].append(sum(t.numel() for t in ts))
        columns = {}
        for key in keys:
            dtypes = sorted({str(t.dtype) for t in flat[key]})
            if len(dtypes) > 1:
                raise TypeError(f"object field {name!r} key {key!r} mixes dtypes {dtypes} across "
                                "rows; one wire column holds one dtype")
            fs = FIELDS.get(key)
            dtype = flat[key][0].dtype if flat[key] else (
                fs.dtypes[0] if fs is not None and fs.dtypes else torch.float32)
            keep = fam is not None and key in fam.keep_dtype
            if self.pixel_dtype is not None and fs is not None and not keep and \
                    fs.dtype_policy is DtypePolicy.POLICY and dtype.is_floating_point:
                dtype = self.pixel_dtype
            values = gather(flat[key], dtype).to(dtype)  # one copy, over the machine's cores
            columns[f"{name}{OBJECT_SEP}{key}"] = jagged_from_values(values, lengths[key])
        return columns

    @staticmethod
    def _encode_packed(name, v: PackedTensor, cast, tags: list[dict]) -> Tensor:
        dtypes = spec(name).dtypes
        dtype = v.dtype
        if dtype is None:  # a media-free column: no segment tells the dtype
            dtype = cast or (dtypes[0] if dtypes else torch.float32)
        elif cast is not None and dtype.is_floating_point:
            dtype = cast
        flat: list[Tensor] = []
        lengths: list[int] = []
        # walk logical rows, never physical segments: de-duplicated rows each carry their media
        for i in range(len(v)):
            segs = v.row_segments(i) or []
            tags[i][name] = {"shapes": None if v.is_none(i) else [list(s.shape) for s in segs],
                             "pack_dim": v.pack_dim}
            flat.extend(s.reshape(-1) for s in segs)
            lengths.append(sum(s.numel() for s in segs))
        # one copy: every row's segments gathered into the values, over the machine's cores
        values = gather(flat, dtype).to(dtype)
        return jagged_from_values(values, lengths)

    # -- decode -------------------------------------------------------------------------
    def decode(self, wire: WireBatch) -> Batch:
        b = len(wire.tags)
        if b == 0:
            raise ValueError(f"cannot decode an empty wire batch: no tags for columns "
                             f"{sorted(wire.columns)}")
        for name, col in wire.columns.items():
            rows = int(col.size(0))
            if rows != b:
                raise ValueError(f"wire column {name!r} has {rows} rows but there are {b} tags")
        families = {t.get(FAMILY_TAG) for t in wire.tags}
        if len(families) > 1:
            raise ValueError(f"wire tags mix families {sorted(map(str, families))}")
        family = families.pop()
        if family is not None and family not in FAMILIES:
            raise KeyError(f"wire tag 'family' names unknown family {family!r}")
        lens = [self._tag(t, SEQ_LEN_TAG, i) for i, t in enumerate(wire.tags)]
        fields: dict = {}
        index = None  # token positions of every row, built once for all per-token fields
        objects: dict[str, dict[str, Tensor]] = {}
        for name, col in wire.columns.items():
            owner = column_field(name)
            if owner != name:
                objects.setdefault(owner, {})[name[len(owner) + 1:]] = col
                continue
            fs = spec(name)
            if fs.kind is Kind.OBJECT:
                objects.setdefault(name, {})
                continue
            if fs.kind is Kind.PACKED:
                fields[name] = self._decode_packed(name, col, wire.tags)
            elif fs.kind is Kind.PER_TOKEN:
                if index is None:
                    index = _TokenIndex.of(lens)
                fields[name] = self._decode_per_token(name, col, lens, fs.pad_value, index)
            else:
                if is_nested(col):
                    raise TypeError(f"per-sample column {name!r} arrived jagged; it was dense")
                fields[name] = col.clone()
        for name, cols in objects.items():  # an object field is fetched by its own column
            if name not in wire.columns:
                raise KeyError(f"wire columns {sorted(f'{name}{OBJECT_SEP}{k}' for k in cols)} "
                               f"came without object field {name!r}'s own column; fetch both")
            fields[name] = self._decode_object(name, cols, wire.tags, wire.columns[name])
        if "input_lengths" not in fields:
            raise KeyError("wire batch lacks the 'input_lengths' column")
        got = fields["input_lengths"].tolist()
        if got != lens:
            raise ValueError(f"tags' seq_len {lens} disagree with 'input_lengths' {got}")
        batch = Batch(fields, family)
        batch.validate()  # dtypes, row counts, coupled fields: a bad column is named here
        return batch

    @staticmethod
    def _tag(tag: dict, key: str, i: int):
        try:
            return tag[key]
        except KeyError:
            raise KeyError(f"row {i}'s tag lacks {key!r}; tags must travel 1:1 with rows") \
                from None

    def _decode_packed(self, name: str, col: Tensor, tags: list[dict]) -> PackedTensor:
        if not is_nested(col):
            raise TypeError(f"packed column {name!r} arrived dense {list(col.shape)}; "
                            "it was written jagged")
        fast = self._decode_packed_flat(name, col, tags)
        if fast is not None:
            return fast
        # one copy of the whole column (the batch must not alias the wire); segments are views
        _, rows = split_rows(name, col, len(tags))
        per_row: list = []
        pack_dim = spec(name).pack_dim
        for i, (flat, tag) in enumerate(zip(rows, tags)):
            meta = self._tag(tag, name, i)
            pack_dim = meta["pack_dim"]
            shapes = meta["shapes"]
            if shapes is None:
                if flat.numel():
                    raise ValueError(f"field {name!r} row {i}: tag says None but the row has "
                                     f"{flat.numel()} values")
                per_row.append(None)
                continue
            sizes = [int(torch.Size(s).numel()) for s in shapes]
            if sum(sizes) != flat.numel():
                raise ValueError(f"field {name!r} row {i}: tag shapes {shapes} need {sum(sizes)} "
                                 f"values, the row has {flat.numel()}")
            per_row.append([p.reshape(s) for p, s in zip(flat.split(sizes), shapes)])
        return PackedTensor.from_rows(per_row, pack_dim=pack_dim)

    def _decode_packed_flat(self, name: str, col: Tensor, tags: list[dict]
                            ) -> PackedTensor | None:
        """`_decode_packed` for the column the encoder writes (1-D values, rows tiling them):
        the same checks and errors row by row on the tags, then one copy of the values and one
        split into every row's segments (no per-row views). None: not that form."""
        column_layout(name, col)
        values, offsets, lengths = jagged_parts(col)
        if lengths is not None or values.dim() != 1 or offsets.dim() != 1 or \
                int(offsets.shape[0]) != len(tags) + 1:
            return None
        starts = offsets.tolist()
        if starts[0] != 0 or starts[-1] != values.shape[0] or \
                any(b < a for a, b in zip(starts, starts[1:])):
            return None
        pack_dim = spec(name).pack_dim
        sizes: list[int] = []
        shapes_all: list = []
        counts: list[int | None] = []  # segments per row, None for a None row
        for i, tag in enumerate(tags):
            meta = self._tag(tag, name, i)
            pack_dim = meta["pack_dim"]
            shapes = meta["shapes"]
            n = starts[i + 1] - starts[i]
            if shapes is None:
                if n:
                    raise ValueError(f"field {name!r} row {i}: tag says None but the row has "
                                     f"{n} values")
                counts.append(None)
                continue
            row_sizes = [int(torch.Size(s).numel()) for s in shapes]
            if sum(row_sizes) != n:
                raise ValueError(f"field {name!r} row {i}: tag shapes {shapes} need "
                                 f"{sum(row_sizes)} values, the row has {n}")
            sizes.extend(row_sizes)
            shapes_all.extend(shapes)
            counts.append(len(shapes))
        # one copy of the whole column (the batch must not alias the wire); segments are views
        segs = values.detach().clone().split(sizes) if sizes else ()
        segments = [p.reshape(s) for p, s in zip(segs, shapes_all)]
        per_row: list = []
        at = 0
        for c in counts:
            if c is None:
                per_row.append(None)
            else:
                per_row.append(segments[at:at + c])
                at += c
        return PackedTensor.from_rows(per_row, pack_dim=pack_dim)

    def _decode_object(self, name: str, cols: dict[str, Tensor], tags: list[dict],
                       present: Tensor) -> ObjectColumn:
        if present.is_nested or present.dim() != 1:
            raise TypeError(f"object field {name!r}'s own column must be dense (B,), got "
                            f"{'jagged' if present.is_nested else list(present.shape)}")
        for key, col in cols.items():
            if not is_nested(col):
                raise TypeError(f"object column '{name}{OBJECT_SEP}{key}' arrived dense "
                                f"{list(col.shape)}; it was written jagged")
        # one copy of each column (the batch must not alias the wire); tensors are views of it
        unbound = {key: split_rows(f"{name}{OBJECT_SEP}{key}", col, len(tags))[1]
                   for key, col in cols.items()}
        rows: list = []
        for i, tag in enumerate(tags):
            meta = self._tag(tag, name, i)
            if meta is not None and not isinstance(meta, dict):
                raise ValueError(f"row {i}'s tag for object field {name!r} is a "
                                 f"{type(meta).__name__}; expected a dict or None")
            if bool(present[i]) != (meta is not None):
                raise ValueError(f"object field {name!r} row {i}: its column says "
                                 f"{'a dict' if present[i] else 'None'}, its tag "
                                 f"{'None' if meta is None else 'a dict'}")
            unknown = sorted(set(meta or {}) - set(unbound))
            if unknown:
                raise KeyError(f"row {i}'s tag names keys {unknown} of object field {name!r} "
                               f"that have no wire column '{name}{OBJECT_SEP}<key>'")
            for key, parts in unbound.items():
                if key not in (meta or {}) and parts[i].numel():
                    raise ValueError(f"object column '{name}{OBJECT_SEP}{key}' row {i} has "
                                     f"{parts[i].numel()} values but row {i}'s tag has no "
                                     f"key {key!r}")
            if meta is None:
                rows.append(None)
                continue
            row = {}
            for key, entry in meta.items():
                where = f"object field {name!r} row {i} key {key!r}"
                is_list = "list" in entry
                shapes = entry["list"] if is_list else [entry.get("shape")]
                if any(s is None for s in shapes):
                    raise KeyError(f"{where}: tag lacks 'shape' or 'list'")
                flat = unbound[key][i]
                sizes = [int(torch.Size(s).numel()) for s in shapes]
                if sum(sizes) != flat.numel():
                    raise ValueError(f"{where}: tag shapes {shapes} need {sum(sizes)} values, the "
                                     f"row has {flat.numel()}")
                ts = [p.reshape(s) for p, s in zip(flat.split(sizes), shapes)]
                row[key] = ts if is_list else ts[0]
            rows.append(row)
        return ObjectColumn(rows)

    @staticmethod
    def _decode_per_token(name: str, col: Tensor, lens: list[int], pad_value,
                          index: _TokenIndex | None = None) -> Tensor:
        """Rows `(len_i, *other)` back to `[B, ..., S, ...]` with S on the registered seq dim."""
        if not is_nested(col):
            raise TypeError(f"per-token column {name!r} arrived dense; it was written jagged")
        seq = max(lens) if lens else 0
        values, offsets, lengths = jagged_parts(col)
        other = list(values.shape[1:])
        axis = spec(name).seq_axis(2 + len(other)) - 1
        shape = other[:axis] + [seq] + other[axis:]
        out = torch.full((len(lens), *shape), pad_value, dtype=values.dtype)
        if index is not None and lengths is None and len(lens) + 1 == offsets.shape[0]:
            starts = offsets.tolist()
            if starts[0] == 0 and starts[-1] == values.shape[0]:
                got = [b - a for a, b in zip(starts, starts[1:])]
                bad = next((i for i, (g, n) in enumerate(zip(got, lens)) if g != n), None)
                if bad is not None:
                    raise ValueError(f"per-token column {name!r} row {bad} has {got[bad]} "
                                     f"tokens, its tag says seq_len {lens[bad]}")
                # every row's tokens in one scatter into the padded output (a copy)
                out.movedim(axis + 1, 1).index_put_(index.at(out.device), values)
                return out
        rows = jagged_rows(col)
        for i, (r, n) in enumerate(zip(rows, lens)):
            if r.shape[0] != n:
                raise ValueError(f"per-token column {name!r} row {i} has {r.shape[0]} tokens, "
                                 f"its tag says seq_len {n}")
            out[i].narrow(axis, 0, n).copy_(r.movedim(0, axis))
        return out
