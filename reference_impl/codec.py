"""The reference wire codec: `Batch` <-> `WireBatch(columns, tags)`.

Packed media travel as one jagged nested tensor per field (row i: the flattened segments of
logical row i) with the segment shapes on row i's tag, so the decoder rebuilds row boundaries from
what the encoder recorded and never from the data: rows that happen to share a shape are not
densified, `None` rows come back as `None`, not as `(0, ...)` tensors. Per-token fields travel
jagged by sequence length; per-sample fields as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .batch import Batch
from .dataplane import gather, jagged_from_values, jagged_rows, split_rows
from .packed import PackedTensor
from .registry import FAMILIES, DtypePolicy, Kind, spec

SEQ_LEN_TAG = "seq_len"
FAMILY_TAG = "family"


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
        b = batch.batch_size
        lens = batch.seq_lens.tolist()
        tags: list[dict] = [{SEQ_LEN_TAG: int(n)} for n in lens]
        if batch.family:
            for t in tags:
                t[FAMILY_TAG] = batch.family
        fam = batch.family_spec
        columns: dict[str, Tensor] = {}
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
                columns[name] = jagged([v[i, : lens[i]].reshape(-1) if v.dim() == 2
                                        else v[i, : lens[i]] for i in range(b)], v.dtype)
            else:
                columns[name] = v.detach().clone()
        return WireBatch(columns, tags)

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
        for name, col in wire.columns.items():
            fs = spec(name)
            if fs.kind is Kind.PACKED:
                fields[name] = self._decode_packed(name, col, wire.tags)
            elif fs.kind is Kind.PER_TOKEN:
                fields[name] = self._decode_per_token(name, col, lens, fs.pad_value)
            else:
                if col.is_nested:
                    raise TypeError(f"per-sample column {name!r} arrived jagged; it was dense")
                fields[name] = col.clone()
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
        if not col.is_nested:
            raise TypeError(f"packed column {name!r} arrived dense {list(col.shape)}; "
                            "it was written jagged")
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

    @staticmethod
    def _decode_per_token(name: str, col: Tensor, lens: list[int], pad_value) -> Tensor:
        if not col.is_nested:
            raise TypeError(f"per-token column {name!r} arrived dense; it was written jagged")
        rows = jagged_rows(col)
        seq = max(lens) if lens else 0
        out = torch.full((len(rows), seq), pad_value, dtype=col.dtype)
        for i, (r, n) in enumerate(zip(rows, lens)):
            if r.shape[0] != n:
                raise ValueError(f"per-token column {name!r} row {i} has {r.shape[0]} tokens, "
                                 f"its tag says seq_len {n}")
            out[i, :n] = r
        return out
