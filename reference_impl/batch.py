"""`Batch`: the in-memory form of a rollout batch, and its registry-driven operations.

Every operation asks the registry what a field is. Packed media are never narrowed, padded to a
sequence length or checked against one; per-token fields move in step with `input_ids`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .bitexact import tensor_difference
from .objects import ObjectColumn
from .packed import PackedTensor
from .registry import FAMILIES, FIELDS, DtypePolicy, FamilySpec, Kind, Stage, spec

Value = Tensor | PackedTensor | ObjectColumn


@dataclass
class Batch:
    """Fields by name: per-token `[B, S]` right-padded (the sequence dim is the field's registered
    `seq_dim`: `position_ids` may be `[B, C, S]`), per-sample `[B, ...]`, packed media
    (`PackedTensor`) and per-row object columns (`ObjectColumn`, e.g. verl's multi_modal_inputs).

    `input_lengths` (`[B]`, int64) holds each row's valid tokens and is required.
    `family` names the FamilySpec (pack dims, dtype exceptions) when media are present.
    """

    fields: dict[str, Value]
    family: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "input_lengths" not in self.fields:
            raise KeyError("batch field 'input_lengths' is required (valid tokens per row)")
        for name in self.fields:
            spec(name)  # an unregistered field is an error here, not a silent drop later

    # -- basic views --------------------------------------------------------------------
    def __getitem__(self, name: str) -> Value:
        try:
            return self.fields[name]
        except KeyError:
            raise KeyError(f"batch has no field {name!r}; it has {sorted(self.fields)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.fields

    @property
    def seq_lens(self) -> Tensor:
        return self.fields["input_lengths"]

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    def __len__(self) -> int:
        return self.batch_size

    @property
    def family_spec(self) -> FamilySpec | None:
        return FAMILIES.get(self.family) if self.family else None

    def names(self, kind: Kind) -> list[str]:
        return [n for n in self.fields if spec(n).kind is kind]

    def media_objects(self) -> list[str]:
        """The object fields that hold media as per-row dicts (not `raw_prompt`, the one object
        field that is not media: reference_impl/prompts.py)."""
        return [n for n in self.names(Kind.OBJECT) if spec(n).multimodal]

    def completion_starts(self) -> list[int]:
        """Where each row's completion starts: its first loss token (`token_mask`), or its
        length where it has none (the prompt is everything before)."""
        if "token_mask" not in self.fields:
            raise ValueError("the batch has no 'token_mask' (1 on the completion tokens the "
                             "loss takes): its rows' prompt / completion split is unknown")
        mask, out = self.fields["token_mask"], []
        for i, n in enumerate(self.seq_lens.tolist()):
            hits = mask[i, :n].nonzero()
            out.append(int(hits[0, 0]) if len(hits) else int(n))
        return out

    def seq_len(self) -> int:
        per_token = self.names(Kind.PER_TOKEN)
        if not per_token:
            return 0
        v = self.fields[per_token[0]]
        return int(v.shape[spec(per_token[0]).seq_axis(v.dim())])

    def replace(self, **updates: Value) -> Batch:
        new = dict(self.fields)
        new.update(updates)
        return Batch(new, self.family, dict(self.extra))

    def without(self, *names: str) -> Batch:
        return Batch({k: v for k, v in self.fields.items() if k not in names}, self.family,
                     dict(self.extra))

    # -- selection ----------------------------------------------------------------------
    def select(self, indices: Sequence[int] | Tensor) -> Batch:
        idx = torch.as_tensor(list(indices) if not isinstance(indices, Tensor) else indices,
                              dtype=torch.long)
        bad = [int(i) for i in idx if not 0 <= int(i) < self.batch_size]
        if bad:
            raise IndexError(f"row indices {bad} out of range for a batch of {self.batch_size} "
                             f"rows (fields {sorted(self.fields)})")
        out: dict[str, Value] = {}
        for name, v in self.fields.items():
            out[name] = v.select(idx) if isinstance(v, (PackedTensor, ObjectColumn)) \
                else v.index_select(0, idx.to(v.device))
        return Batch(out, self.family, dict(self.extra))

    def slice(self, start: int, stop: int) -> Batch:
        return self.select(range(*slice(start, stop).indices(self.batch_size)))

    def shard(self, micro_batch_size: int) -> list[Batch]:
        """Consecutive micro-batches of `micro_batch_size` rows (the last may be shorter)."""
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        return [self.slice(i, i + micro_batch_size)
                for i in range(0, self.batch_size, micro_batch_size)]

    def split(self, sizes: Sequence[int]) -> list[Batch]:
        """Consecutive chunks with `sizes` rows each (zero allowed; they must sum to B)."""
        sizes = [int(n) for n in sizes]
        if any(n < 0 for n in sizes) or sum(sizes) != self.batch_size:
            raise ValueError(f"split sizes {sizes} must be >= 0 and sum to the batch size "
                             f"{self.batch_size}")
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        return [self.slice(a, a + n) for a, n in zip(starts, sizes)]

    def micro_batches(self, n: int, shuffle_seed: int | None = None
                      ) -> list[tuple[list[int], Batch]]:
        """`n` micro-batches (sizes differ by at most one, larger first), each with the original
        row indices it holds; rows are permuted first (whole rows: media, object rows and
        per-token fields move together) when `shuffle_seed` is given."""
        b = self.batch_size
        if not 1 <= n <= max(b, 1):
            raise ValueError(f"micro-batch count n={n} must be in 1..{b} (the batch size)")
        if shuffle_seed is None:
            order = list(range(b))
        else:
            gen = torch.Generator().manual_seed(int(shuffle_seed))
            order = torch.randperm(b, generator=gen).tolist()
        sizes = [b // n + (1 if k < b % n else 0) for k in range(n)]
        out, start = [], 0
        for size in sizes:
            idx = order[start:start + size]
            out.append((idx, self.select(idx)))
            start += size
        return out

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        if not batches:
            raise ValueError("concat needs at least one batch")
        names = set(batches[0].fields)
        for b in batches[1:]:
            if set(b.fields) != names:
                raise KeyError(
                    f"cannot concat batches with fields {sorted(names)} and {sorted(b.fields)}"
                )
        families = sorted({str(b.family) for b in batches})
        if len(families) > 1:
            raise ValueError(f"cannot concat batches of families {families}")
        seq = max(b.seq_len() for b in batches)
        batches = [b.pad_to(seq) if b.seq_len() != seq else b for b in batches]
        out: dict[str, Value] = {}
        for name in batches[0].fields:
            vals = [b.fields[name] for b in batches]
            kinds = {type(v) for v in vals}
            if len(kinds) > 1:
                raise TypeError(f"cannot concat field {name!r} held as "
                                f"{sorted(k.__name__ for k in kinds)}")
            if isinstance(vals[0], PackedTensor):
                out[name] = PackedTensor.concat(vals)
            elif isinstance(vals[0], ObjectColumn):
                out[name] = ObjectColumn.concat(vals)
            else:
                out[name] = torch.cat(vals, dim=0)
        return Batch(out, batches[0].family, dict(batches[0].extra))

    def union(self, other: Batch) -> Batch:
        """The fields of two batches over the same rows (verl's DataProto.union): fields only
        one holds are joined; a field both hold must be equal by value (dtype, shape, bits, row
        boundaries, dict rows), never by identity, else ValueError naming it. The result owns
        its containers (row dicts, row lists); tensors are shared."""
        if not isinstance(other, Batch):
            raise TypeError(f"union needs a Batch, got {type(other).__name__}")
        if self.batch_size != other.batch_size:
            raise ValueError(f"union of batches of {self.batch_size} and {other.batch_size} rows")
        if str(self.family) != str(other.family):
            raise ValueError(f"union of batches of families {self.family!r} and {other.family!r}")
        every = list(range(self.batch_size))
        fields: dict[str, Value] = {}
        for source in (self, other):
            for name, v in source.fields.items():
                if name in fields:
                    why = self.first_difference(other, [name])
                    if why:
                        raise ValueError(f"union: field {name!r} differs between the batches: "
                                         f"{why}")
                    continue
                fields[name] = v.select(every) if isinstance(v, (PackedTensor, ObjectColumn)) \
                    else v
        return Batch(fields, self.family, {**self.extra, **other.extra})

    # -- sequence operations ------------------------------------------------------------
    def truncate(self, max_len: int) -> Batch:
        """Narrow per-token fields to `max_len` tokens; packed media stay untouched."""
        if max_len < 0:
            raise ValueError(f"max_len must be >= 0, got {max_len}")
        out: dict[str, Value] = {}
        for name, v in self.fields.items():
            fs = spec(name)
            if fs.kind is Kind.PER_TOKEN:
                axis = fs.seq_axis(v.dim())
                out[name] = v.narrow(axis, 0, min(max_len, v.shape[axis]))
            elif name == "input_lengths":
                out[name] = v.clamp(max=max_len)
            else:
                out[name] = v
        return Batch(out, self.family, dict(self.extra))

    def pad_to(self, seq_len: int) -> Batch:
        """Right-pad per-token fields to `seq_len` with the registry's pad value."""
        out: dict[str, Value] = {}
        for name, v in self.fields.items():
            fs = spec(name)
            axis = fs.seq_axis(v.dim()) if fs.kind is Kind.PER_TOKEN else 0
            if fs.kind is Kind.PER_TOKEN and v.shape[axis] < seq_len:
                shape = list(v.shape)
                shape[axis] = seq_len - v.shape[axis]
                out[name] = torch.cat([v, v.new_full(shape, fs.pad_value)], dim=axis)
            else:
                out[name] = v
        return Batch(out, self.family, dict(self.extra))

    def validate(self) -> None:
        """The sequence-dim validator: rows agree, per-token fields share one S >= max length.

        Packed fields are exempt from the sequence check: their dim 1 is patches or images.
        """
        b = self.batch_size
        lens = self.seq_lens
        if lens.dim() != 1:
            raise ValueError(f"field 'input_lengths' must be 1-D [B], got {list(lens.shape)}")
        seq, media = None, self.media_objects()
        for name, v in self.fields.items():
            fs = spec(name)
            want = _HOLDER[fs.kind]
            if not isinstance(v, want):
                kind = fs.kind.value.replace("_", "-")
                article = "an" if want.__name__[0] in "AEIOU" else "a"
                raise TypeError(f"{kind} field {name!r} must be {article} {want.__name__}, got "
                                f"{type(v).__name__}")
            if fs.dtypes and v.dtype is not None and v.dtype not in fs.dtypes:
                raise TypeError(
                    f"field {name!r} has dtype {v.dtype}; allowed: {[str(d) for d in fs.dtypes]}"
                )
            rows = len(v) if isinstance(v, (PackedTensor, ObjectColumn)) else int(v.shape[0])
            if rows != b:
                raise ValueError(f"field {name!r} has {rows} rows, expected {b} (batch size)")
            if name in media:
                self._check_object(name, v)
            if fs.kind is Kind.PER_TOKEN:
                if v.dim() < 2:
                    raise ValueError(f"per-token field {name!r} must be [B, S], got "
                                     f"{list(v.shape)}")
                axis = fs.seq_axis(v.dim())
                if seq is None:
                    seq = int(v.shape[axis])
                if int(v.shape[axis]) != seq:
                    raise ValueError(
                        f"per-token field {name!r} has sequence dim {v.shape[axis]} (dim {axis} "
                        f"of {list(v.shape)}), expected {seq} like the other per-token fields"
                    )
        if seq is not None and b and int(lens.max()) > seq:
            raise ValueError(f"field 'input_lengths' has max {int(lens.max())} > sequence dim {seq}")
        self._check_coupled()

    def _check_object(self, name: str, col: ObjectColumn) -> None:
        """Keys of a per-row dict are registered packed fields with allowed dtypes, and never
        also held as a packed field of the batch (which copy would the model get?)."""
        for i, row in enumerate(col.rows):
            for key, value in (row or {}).items():
                if key not in FIELDS:
                    raise KeyError(f"object field {name!r} row {i} has key {key!r}, which is not "
                                   "registered in rlconform.reference_impl.registry.FIELDS")
                fs = FIELDS[key]
                if fs.kind is not Kind.PACKED:
                    raise ValueError(f"object field {name!r} row {i} has key {key!r}, a "
                                     f"{fs.kind.value} field; per-row dicts hold packed media")
                if key in self.fields:
                    raise ValueError(f"field {key!r} is both a batch field and a key of object "
                                     f"field {name!r} (row {i})")
                for t in value if isinstance(value, list) else [value]:
                    if fs.dtypes and t.dtype not in fs.dtypes:
                        raise TypeError(f"object field {name!r} row {i} key {key!r} has dtype "
                                        f"{t.dtype}; allowed: {[str(d) for d in fs.dtypes]}")

    def _check_coupled(self) -> None:
        packed = {n: v for n, v in self.fields.items() if isinstance(v, PackedTensor)}
        for name, v in packed.items():
            for other in spec(name).coupled:
                w = packed.get(other)
                if w is None:
                    continue
                for i in range(len(v)):
                    if v.is_none(i) != w.is_none(i):
                        raise ValueError(
                            f"row {i}: field {name!r} is "
                            f"{'None' if v.is_none(i) else 'present'} but coupled field "
                            f"{other!r} is {'None' if w.is_none(i) else 'present'}"
                        )

    # -- per-row dict form --------------------------------------------------------------
    def to_row_dicts(self, into: str = "multi_modal_inputs") -> Batch:
        """Move every packed field into object field `into`: row i becomes a dict of the row's
        media as the processor emits them for that one sample (Qwen-VL `pixel_values`
        `[patches, 1176]`, `image_grid_thw` `[n_images, 3]`; pack_dim 1 media `[1, tiles, ...]`).
        A row whose segments that form cannot give back exactly is a list of its segments.
        A media-free row is `{}` or None as the field's registry entry says. Per-token maps
        (`mm_token_type_ids`, `position_ids`) stay batch fields."""
        fs = spec(into)
        if fs.kind is not Kind.OBJECT:
            raise ValueError(f"to_row_dicts(into={into!r}): {into!r} is a {fs.kind.value} field, "
                             "not an object field")
        if into in self.fields:
            raise ValueError(f"batch already has object field {into!r}")
        packed = {n: v for n, v in self.fields.items() if isinstance(v, PackedTensor)}
        rows: list = []
        for i in range(self.batch_size):
            row: dict = {}
            for name, v in packed.items():
                segs = v.row_segments(i)
                if segs is not None:
                    grid = _grid_of(name, packed, i)
                    row[name] = _row_value(name, segs, v.pack_dim, grid)
            rows.append(row if row else ({} if fs.empty_as_dict else None))
        fields = {k: v for k, v in self.fields.items() if k not in packed}
        fields[into] = ObjectColumn(rows)
        return Batch(fields, self.family, dict(self.extra))

    def from_row_dicts(self, name: str = "multi_modal_inputs") -> Batch:
        """The inverse of `to_row_dicts`: each key of object field `name` becomes a packed field
        (None where a row is None, `{}` or lacks the key), split into segments per image by the
        key's grid (`image_grid_thw` for Qwen-VL `pixel_values`), by dim-0 entry otherwise, or
        one segment per list element. A packed field with no media in any row is not recreated
        (it carries nothing: model inputs are the same)."""
        col = self[name]
        if not isinstance(col, ObjectColumn):
            raise TypeError(f"field {name!r} is a {type(col).__name__}, not an ObjectColumn")
        fam = self.family_spec
        keys = col.keys()
        for key in keys:
            if key in self.fields:
                raise ValueError(f"key {key!r} of object field {name!r} is also a batch field")
            if spec(key).kind is not Kind.PACKED:
                raise ValueError(f"key {key!r} of object field {name!r} is a "
                                 f"{spec(key).kind.value} field; per-row dicts hold packed media")
        per_key: dict[str, list] = {k: [] for k in keys}
        for i, row in enumerate(col.rows):
            for key in keys:
                if row is None or key not in row:
                    per_key[key].append(None)
                    continue
                pack_dim = fam.pack_dim(key) if fam else FIELDS[key].pack_dim
                grid_key = FIELDS[key].grid
                grid = row.get(grid_key) if grid_key else None
                if isinstance(grid, list):
                    grid = torch.cat(grid) if grid else None
                per_key[key].append(_split_value(f"{name!r} row {i} key {key!r}", row[key],
                                                 pack_dim, grid))
        fields = {k: v for k, v in self.fields.items() if k != name}
        for key, rows in per_key.items():
            pack_dim = fam.pack_dim(key) if fam else FIELDS[key].pack_dim
            fields[key] = PackedTensor.from_rows(rows, pack_dim=pack_dim)
        return Batch(fields, self.family, dict(self.extra))

    def packed_form(self) -> Batch:
        """Every media object field converted back to packed fields (`from_row_dicts`)."""
        out = self
        for name in self.media_objects():
            out = out.from_row_dicts(name)
        return out

    # -- model inputs -------------------------------------------------------------------
    def multimodal_inputs(self, stage: Stage, dtype: torch.dtype | None = None
                          ) -> dict[str, Tensor]:
        """Exactly the registered multimodal fields present that `stage` consumes.

        Packed fields become model-input tensors here (padding to the batch max only here); a
        field with no media in any row is left out, as the legacy path passes None. Media held
        in a per-row dict column give exactly the tensors they give as packed fields.
        """
        src = self
        for name in self.names(Kind.OBJECT):
            src = src.from_row_dicts(name) if stage in spec(name).stages else src.without(name)
        fam = src.family_spec
        out: dict[str, Tensor] = {}
        for name, v in src.fields.items():
            fs = spec(name)
            if not fs.multimodal or stage not in fs.stages:
                continue
            t = v.as_tensor() if isinstance(v, PackedTensor) else v
            if t is None:
                continue
            keep = fam is not None and name in fam.keep_dtype
            if dtype is not None and fs.dtype_policy is DtypePolicy.POLICY and not keep \
                    and t.is_floating_point():
                t = t.to(dtype)
            out[name] = t
        return out

    def multimodal_field_names(self, stage: Stage | None = None) -> list[str]:
        return [n for n in self.fields if spec(n).multimodal
                and (stage is None or stage in spec(n).stages)]

    # -- comparison ---------------------------------------------------------------------
    def first_difference(self, other: Batch, names: Iterable[str] | None = None) -> str | None:
        """Why `other` differs (missing field, type, dtype, shape, bits, rows), or None."""
        given = names is not None
        names = list(self.fields) if names is None else list(names)
        missing = [n for n in names if n not in other.fields]
        if missing:
            return f"fields {missing} missing"
        extra = [] if given else sorted(set(other.fields) - set(self.fields))
        if extra:
            return f"unexpected fields {extra}"
        for n in names:
            a, b = self.fields[n], other.fields[n]
            if type(a) is not type(b) and (isinstance(a, (PackedTensor, ObjectColumn))
                                           or isinstance(b, (PackedTensor, ObjectColumn))):
                return f"field {n!r}: {type(b).__name__}, expected {type(a).__name__}"
            if isinstance(a, (PackedTensor, ObjectColumn)):
                why = a.first_difference(b)
                if why:
                    return f"field {n!r}: {why}"
                continue
            why = tensor_difference(a, b)
            if why:
                return f"field {n!r}: {why}"
        return None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Batch):
            return NotImplemented
        return self.first_difference(other) is None and set(self.fields) == set(other.fields)

    __hash__ = None  # type: ignore[assignment]

    def media_nbytes(self) -> int:
        return sum(v.nbytes() for v in self.fields.values()
                   if isinstance(v, (PackedTensor, ObjectColumn)))


def _grid_of(name: str, packed: dict[str, PackedTensor], i: int) -> Tensor | None:
    """Row i's grid (`[n, 3]`) for a field split by one, when the batch holds that grid."""
    grid_key = FIELDS[name].grid
    g = packed.get(grid_key) if grid_key else None
    segs = g.row_segments(i) if g is not None else None
    return torch.cat(segs) if segs else None


def _split_value(where: str, value, pack_dim: int, grid: Tensor | None) -> list[Tensor]:
    """A per-row dict value -> the row's segments (the rule `_row_value` is checked against)."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if pack_dim == 1:
        if value.dim() < 2 or value.shape[0] != 1:
            raise ValueError(f"{where}: a pack_dim 1 value is [1, tiles, ...], got "
                             f"{list(value.shape)}")
        return [value[0]]
    if value.dim() == 0:
        raise ValueError(f"{where}: a 0-d value has no image dim; expected [n, ...]")
    if grid is not None:
        sizes = [int(n) for n in grid.reshape(-1, grid.shape[-1]).prod(-1).tolist()]
        if sum(sizes) != value.shape[0]:
            raise ValueError(f"{where}: grid {grid.tolist()} gives {sum(sizes)} rows, the value "
                             f"has {value.shape[0]} (shape {list(value.shape)})")
        return list(value.split(sizes))
    return [value[k:k + 1] for k in range(value.shape[0])]


def _row_value(name: str, segs: list[Tensor], pack_dim: int, grid: Tensor | None):
    """Row value in the processor's per-sample form when `_split_value` gives `segs` back
    exactly (shapes; the values are the same bytes), else the list of segments."""
    if segs and len({tuple(s.shape[1:]) for s in segs}) == 1 and segs[0].dim() >= 1:
        t = segs[0] if len(segs) == 1 else torch.cat(segs)
        if pack_dim == 1:
            t = t.unsqueeze(0)
        try:
            back = _split_value(name, t, pack_dim, grid)
        except ValueError:
            back = None
        if back is not None and [b.shape for b in back] == [s.shape for s in segs]:
            return t
    return list(segs)


_HOLDER = {Kind.PACKED: PackedTensor, Kind.OBJECT: ObjectColumn, Kind.PER_TOKEN: Tensor,
           Kind.PER_SAMPLE: Tensor}


class BatchOps:
    """The `batch_ops` surface of the reference: the operations above, as one object.

    A backend with its own truncation, padding or validation provides an object with these
    four methods; the BATCH clauses exercise it. The batch algebra (`select`, `concat`, `split`:
    capability `batch_algebra`), `micro_batches` (capability `micro_batching`) and `union`
    (capability `batch_union`) are optional.
    """

    name = "reference"

    def truncate(self, batch: Batch, max_len: int) -> Batch:
        return batch.truncate(max_len)

    def pad_to(self, batch: Batch, seq_len: int) -> Batch:
        return batch.pad_to(seq_len)

    def validate(self, batch: Batch) -> None:
        batch.validate()

    def multimodal_inputs(self, batch: Batch, stage: Stage, dtype: torch.dtype | None = None
                          ) -> dict[str, Tensor]:
        return batch.multimodal_inputs(stage, dtype)

    # batch_algebra
    def select(self, batch: Batch, indices: Sequence[int]) -> Batch:
        return batch.select(indices)

    def concat(self, batches: Sequence[Batch]) -> Batch:
        return Batch.concat(batches)

    def split(self, batch: Batch, sizes: Sequence[int]) -> list[Batch]:
        return batch.split(sizes)

    # micro_batching
    def micro_batches(self, batch: Batch, n: int, shuffle_seed: int | None = None
                      ) -> list[tuple[list[int], Batch]]:
        return batch.micro_batches(n, shuffle_seed)

    # batch_union
    def union(self, a: Batch, b: Batch) -> Batch:
        return a.union(b)
