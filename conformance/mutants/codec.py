"""Codec mutants: the reference wire codec with one field-seen defect each."""

from __future__ import annotations

import copy

import torch

from rlconform.conformance.backends.reference import build
from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.codec import ReferenceCodec, WireBatch, jagged
from rlconform.reference_impl.dataplane import jagged_from_values
from rlconform.reference_impl.objects import ObjectColumn
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.registry import FIELDS, Kind

from . import keys_of_first_row, mutant


def _with(cls):
    return lambda: build(codec=lambda pixel_dtype=None: cls(pixel_dtype))


@mutant("densify_uniform_rows", "the decoder densified nested rows that happened to share a "
        "shape: row boundaries lost whenever every sample has one image", "codec")
def _densify():
    class C(ReferenceCodec):
        def decode(self, wire):
            out = super().decode(wire)
            for name, v in list(out.fields.items()):
                if isinstance(v, PackedTensor) and all(r is not None for r in v.rows) \
                        and len({tuple(s.shape) for s in v.segments}) == 1 \
                        and all(len(r) == 1 for r in v.rows):
                    out.fields[name] = torch.cat([v.row(i) for i in range(len(v))])
            return out

    return _with(C)()


@mutant("encode_physical_segments", "the encoder walked physical segments instead of logical "
        "rows under media de-duplication", "codec")
def _physical():
    class C(ReferenceCodec):
        @staticmethod
        def _encode_packed(name, v, cast, tags):
            col = ReferenceCodec._encode_packed(name, v, cast, tags)
            if not v.is_deduplicated():
                return col
            # row i <- the i-th physical segment: shared rows get someone else's image
            rows = [v.segments[i].reshape(-1) if i < len(v.segments) else
                    torch.empty(0, dtype=col.dtype) for i in range(len(v))]
            for i, t in enumerate(tags):
                t[name]["shapes"] = (None if i >= len(v.segments)
                                     else [list(v.segments[i].shape)])
            return jagged(rows, col.dtype)

    return _with(C)()


@mutant("empty_rows_as_zero_length", "empty media rows decoded as (0, ...) tensors instead of "
        "None", "codec")
def _zero_rows():
    class C(ReferenceCodec):
        def _decode_packed(self, name, col, tags):
            pt = super()._decode_packed(name, col, tags)
            rows = []
            for i in range(len(pt)):
                segs = pt.row_segments(i)
                if segs is None:
                    tail = [int(d) for d in (pt.segments[0].shape[1:] if pt.segments else [])]
                    segs = [torch.zeros((0, *tail), dtype=col.dtype)]
                rows.append(segs)
            return PackedTensor.from_rows(rows, pt.pack_dim)

    return _with(C)()


@mutant("fp32_pixels", "the rollout write dropped the pixel dtype cast: pixel_values crossed "
        "the wire fp32 instead of bf16", "codec")
def _fp32():
    class C(ReferenceCodec):
        def __init__(self, pixel_dtype=None):
            super().__init__(None)

    return _with(C)()


@mutant("casts_integer_geometry", "the dtype cast hit every packed field, grids and sizes "
        "included", "codec")
def _cast_geometry():
    class C(ReferenceCodec):
        def encode(self, batch):
            wire = super().encode(batch)
            if self.pixel_dtype is not None:
                for name, col in wire.columns.items():
                    if FIELDS[name].kind is Kind.PACKED and col.dtype in (torch.int64,
                                                                         torch.int32):
                        wire.columns[name] = col.to(self.pixel_dtype)
            return wire

    return _with(C)()


@mutant("casts_kept_fp32_media", "the cast ignored a family's fp32-on-purpose media "
        "(Nemotron-Omni dynamic-resolution pixel_values)", "codec")
def _cast_kept():
    class C(ReferenceCodec):
        def encode(self, batch):
            wire = super().encode(batch)
            fam = batch.family_spec
            if self.pixel_dtype is not None and fam is not None:
                for name in fam.keep_dtype & set(wire.columns):
                    if wire.columns[name].dtype.is_floating_point:
                        wire.columns[name] = wire.columns[name].to(self.pixel_dtype)
            return wire

    return _with(C)()


@mutant("unknown_field_dropped", "encoding silently dropped fields it did not know", "codec")
def _drop_unknown():
    class C(ReferenceCodec):
        def encode(self, batch):
            known = {k: v for k, v in batch.fields.items() if k in FIELDS}
            return super().encode(Batch(known, batch.family, dict(batch.extra)))

    return _with(C)()


@mutant("decode_trusts_tags", "the decoder paired tags with rows positionally and patched "
        "what disagreed instead of rejecting misaligned tags", "codec")
def _trusting():
    class C(ReferenceCodec):
        def decode(self, wire):
            cols = dict(wire.columns)
            b = int(next(iter(cols.values())).size(0))
            tags = [copy.deepcopy(t) for t in (list(wire.tags) + [wire.tags[-1]] * b)[:b]]
            for i, t in enumerate(tags):
                for name, col in cols.items():
                    kind = FIELDS[name].kind
                    if kind is Kind.PER_TOKEN:
                        t["seq_len"] = int(col.unbind()[i].shape[0])
                    elif kind is Kind.PACKED:
                        n = col.unbind()[i].numel()
                        meta = t.get(name) or {"shapes": None, "pack_dim": 0}
                        shapes = meta["shapes"] or []
                        if sum(torch.Size(sh).numel() for sh in shapes) != n:
                            meta = {"shapes": [[n]] if n else None, "pack_dim": meta["pack_dim"]}
                        t[name] = meta
            cols["input_lengths"] = torch.tensor([t["seq_len"] for t in tags])
            return super().decode(WireBatch(cols, tags))

    return _with(C)()


# -- per-row dict columns and multi-dim per-token fields ----------------------------------------
def _rewrite_objects(batch: Batch, fn) -> Batch:
    for name in batch.names(Kind.OBJECT):
        batch.fields[name] = ObjectColumn([fn(r) for r in batch[name]])
    return batch


@mutant("codec_object_none_as_empty", "the wire form had no None row: OpenRLHF's text-only None "
        "rows decoded as verl-style {}", "codec")
def _object_none():
    class C(ReferenceCodec):
        def decode(self, wire):
            return _rewrite_objects(super().decode(wire), lambda r: {} if r is None else r)

    return _with(C)()


@mutant("codec_object_missing_key_as_empty", "a row lacking a key decoded it as a zero-length "
        "tensor (the (0, ...) media of a text-only row, in dict form)", "codec")
def _object_missing_key():
    class C(ReferenceCodec):
        def decode(self, wire):
            out = super().decode(wire)
            for name in out.names(Kind.OBJECT):
                keys = out[name].keys()
                first = {k: next(r[k] for r in out[name] if r and k in r) for k in keys}

                def fill(r, first=first):
                    if r is None:
                        return None
                    empty = {k: (v[:0] if not isinstance(v, list) else [])
                             for k, v in first.items() if k not in r}
                    return {**r, **empty}

                out.fields[name] = ObjectColumn([fill(r) for r in out[name]])
            return out

    return _with(C)()


@mutant("codec_object_lists_concatenated", "per-image list values were concatenated into one "
        "tensor on the wire (shape-ragged images padded away or merged)", "codec")
def _object_lists():
    class C(ReferenceCodec):
        def decode(self, wire):
            def merge(r):
                if r is None:
                    return None
                out = {}
                for k, v in r.items():
                    if isinstance(v, list) and v:
                        v = PackedTensor.from_rows([v]).as_tensor()
                    out[k] = v
                return out

            return _rewrite_objects(super().decode(wire), merge)

    return _with(C)()


@mutant("codec_cuts_per_token_dim1", "per-token fields were cut at each row's length on dim 1: "
        "M-RoPE position_ids [B, 3, S] lost positions or channels", "codec")
def _per_token_dim1():
    class C(ReferenceCodec):
        @staticmethod
        def _encode_per_token(name, v, lens, index=None):
            if v.dim() == 2:
                return ReferenceCodec._encode_per_token(name, v, lens, index)
            rows = [v[i, :n] for i, n in enumerate(lens)]  # dim 1: channels, not positions
            return jagged_from_values(torch.cat(rows), [r.shape[0] for r in rows])

    return _with(C)()


# -- values a comparator cannot see (WIRE-BITEXACT) ----------------------------------------------
def _map_floating_columns(wire, fn):
    for name, col in wire.columns.items():
        if isinstance(col, torch.Tensor) and col.is_floating_point():
            wire.columns[name] = (torch.nested.nested_tensor_from_jagged(
                fn(col.values()), offsets=col.offsets()) if col.is_nested else fn(col))
    return wire


@mutant("nan_canonicalised", "the encoder sanitised floating columns, rewriting every NaN as "
        "the canonical NaN: payloads and signs of NaNs are lost", "codec")
def _canonical_nan():
    class C(ReferenceCodec):
        def encode(self, batch):
            return _map_floating_columns(super().encode(batch),
                                         lambda v: v.masked_fill(v.isnan(), float("nan")))

    return _with(C)()


@mutant("negative_zero_lost", "the encoder normalised floating columns as x * 1.0 + 0.0 "
        "(a no-op scale and shift): -0.0 arrives as +0.0", "codec")
def _plus_zero():
    class C(ReferenceCodec):
        def encode(self, batch):
            return _map_floating_columns(super().encode(batch), lambda v: v * 1.0 + 0.0)

    return _with(C)()


# -- shape independent of size (WIRE-SHAPE-TAGS) -------------------------------------------------
@mutant("image_shapes_normalised_to_landscape", "the decoder rebuilt image segments in "
        "landscape orientation (the last two dims sorted): a portrait image or a tall tile "
        "comes back reshaped to the wrong shape", "codec")
def _landscape():
    class C(ReferenceCodec):
        def _decode_packed(self, name, col, tags):
            pt = super()._decode_packed(name, col, tags)
            if not name.startswith("pixel_"):
                return pt
            return PackedTensor([s.reshape(*s.shape[:-2], *sorted(s.shape[-2:]))
                                 if s.dim() >= 3 else s for s in pt.segments],
                                pt.rows, pt.pack_dim)

    return _with(C)()


@mutant("segment_shape_cache_by_size", "the decoder memoised its reshape plan per field by "
        "element count: a segment with as many values as one decoded before in the batch "
        "takes that one's shape", "codec")
def _shape_cache():
    class C(ReferenceCodec):
        def _decode_packed(self, name, col, tags):
            plans: dict[int, list[int]] = {}
            tags = copy.deepcopy(list(tags))
            for t in tags:
                meta = t.get(name)
                if meta and meta.get("shapes"):
                    meta["shapes"] = [plans.setdefault(int(torch.Size(s).numel()), s)
                                      for s in meta["shapes"]]
            return super()._decode_packed(name, col, tags)

    return _with(C)()


# -- inputs never modified (WIRE-INPUT-INTACT) ---------------------------------------------------
@mutant("encode_casts_caller_media", "the rollout write cast the caller's pixel segments to the "
        "policy dtype in place (assigned back into the batch's media) before encoding them",
        "codec")
def _cast_caller():
    class C(ReferenceCodec):
        def encode(self, batch):
            fam = batch.family_spec
            if self.pixel_dtype is not None:
                for name, v in batch.fields.items():
                    keep = fam is not None and name in fam.keep_dtype
                    if isinstance(v, PackedTensor) and not keep and \
                            FIELDS[name].dtype_policy.value == "policy":
                        v.segments[:] = [s.to(self.pixel_dtype) if s.is_floating_point() else s
                                         for s in v.segments]
            return super().encode(batch)

    return _with(C)()


@mutant("decode_consumes_tags", "the decoder took each field's entry out of the wire tags "
        "(dict.pop) as it rebuilt the rows: the fetched wire batch cannot be decoded again",
        "codec")
def _consume_tags():
    class C(ReferenceCodec):
        def decode(self, wire):
            out = super().decode(wire)
            for tag in wire.tags:
                for name in list(tag):
                    if name in wire.columns:
                        tag.pop(name)
            return out

    return _with(C)()


# -- the wire is what the policy says (WIRE-DTYPE on the encoded columns) -----------------------
@mutant("fp32_on_wire_cast_after_decode", "the rollout write kept pixels fp32 on the wire (2x "
        "the bytes of the largest column) and the reader cast them to the policy dtype after "
        "decoding: every decoded dtype is right", "codec")
def _cast_late():
    class C(ReferenceCodec):
        def encode(self, batch):
            return ReferenceCodec(None).encode(batch)

        def decode(self, wire):
            out = super().decode(wire)
            fam, dtype = out.family_spec, self.pixel_dtype
            if dtype is None:
                return out

            def policy(name):
                return FIELDS[name].dtype_policy.value == "policy" and not (
                    fam is not None and name in fam.keep_dtype)

            def cast(name, t):
                return t.to(dtype) if policy(name) and t.is_floating_point() else t

            for name, v in list(out.fields.items()):
                if isinstance(v, PackedTensor) and policy(name):
                    out.fields[name] = v.to_dtype(dtype)
                elif isinstance(v, ObjectColumn):
                    out.fields[name] = ObjectColumn([None if r is None else {
                        k: [cast(k, t) for t in x] if isinstance(x, list) else cast(k, x)
                        for k, x in r.items()} for r in v])
            return out

    return _with(C)()


# -- every regime, through serialisation (WIRE-REGIMES) ------------------------------------------
@mutant("codec_state_not_on_wire", "the decoder took each packed field's packing dim from what "
        "this codec instance last encoded (a layout cache), not from the wire: a codec in another "
        "process (a rank) rebuilds Idefics3/SmolVLM tiles and LLaVA-NeXT patches packed on dim 0",
        "codec")
def _state_on_instance():
    class C(ReferenceCodec):
        def encode(self, batch):
            wire = super().encode(batch)
            self._layout = {n: v.pack_dim for n, v in batch.fields.items()
                            if isinstance(v, PackedTensor)}
            for t in wire.tags:
                for name in self._layout:
                    t[name] = {k: v for k, v in t[name].items() if k != "pack_dim"}
            return wire

        def _decode_packed(self, name, col, tags):
            layout = getattr(self, "_layout", {})
            tags = [{**t, name: {**t[name], "pack_dim": layout.get(name, FIELDS[name].pack_dim)}}
                    if isinstance(t.get(name), dict) else t for t in tags]
            return super()._decode_packed(name, col, tags)

    return _with(C)()


# -- heterogeneous rows (WIRE-HETERO-ROWS) -------------------------------------------------------
@mutant("codec_object_keys_of_first_dict_row", "the wire schema of a per-row dict column came "
        "from its first non-empty row: keys that first appear in a later row were dropped",
        "codec")
def _first_row_schema():
    class C(ReferenceCodec):
        def encode(self, batch):
            fields = dict(batch.fields)
            for name in batch.names(Kind.OBJECT):
                fields[name] = keys_of_first_row(batch[name])
            return super().encode(Batch(fields, batch.family, dict(batch.extra)))

    return _with(C)()


@mutant("codec_media_assigned_by_count", "the decoder inferred which row owns which image from "
        "the counts: with as many images as rows it gave each row one image in order, so rows "
        "holding 2, 0, 1 images came back holding 1, 1, 1 (each other's images)", "codec")
def _assigned_by_count():
    class C(ReferenceCodec):
        def decode(self, wire):
            out = super().decode(wire)
            for name, v in list(out.fields.items()):
                if isinstance(v, PackedTensor) and len(v.segments) == len(v.rows) \
                        and not v.is_deduplicated():
                    out.fields[name] = PackedTensor(v.segments, [(i,) for i in range(len(v))],
                                                    v.pack_dim)
            return out

    return _with(C)()
