"""Batch-operation mutants: truncation, padding, validation, stage inputs, the batch algebra and
micro-batching gone wrong."""

from __future__ import annotations

import torch

from rlconform.conformance.backends.reference import build
from rlconform.reference_impl.batch import Batch, BatchOps
from rlconform.reference_impl.objects import ObjectColumn
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.registry import FIELDS, Kind, Stage, spec

from . import keys_of_first_row, mutant


def _with(cls):
    return lambda: build(batch_ops=cls)


def _policy_media(batch, name) -> bool:
    fam = batch.family_spec
    fs = spec(name)
    return fs.kind is Kind.PACKED and fs.dtype_policy.value == "policy" and not (
        fam is not None and name in fam.keep_dtype)


def _map_segments(v: PackedTensor, fn) -> PackedTensor:
    return PackedTensor([fn(s) for s in v.segments], v.rows, v.pack_dim)


@mutant("truncate_narrows_media", "truncate_tensors narrowed every >=2-D tensor on dim 1, "
        "media included", "batch_ops")
def _narrow():
    class Ops(BatchOps):
        def truncate(self, batch, max_len):
            out = batch.truncate(max_len)
            for name, v in out.fields.items():
                if isinstance(v, PackedTensor):
                    out.fields[name] = _map_segments(
                        v, lambda s: s[:, :max_len] if s.dim() >= 2 else s)
            return out

    return _with(Ops)()


@mutant("truncate_misses_per_token_map", "truncation narrowed input_ids and the masks but not "
        "the per-token multimodal maps", "batch_ops")
def _miss_map():
    class Ops(BatchOps):
        def truncate(self, batch, max_len):
            out = batch.truncate(max_len)
            for name in ("mm_token_type_ids", "token_type_ids"):
                if name in batch:
                    out.fields[name] = batch[name]
            return out

    return _with(Ops)()


@mutant("pad_media_to_seqlen", "materialize padded every tensor's dim 1 to the token seqlen, "
        "media included", "batch_ops")
def _pad_media():
    class Ops(BatchOps):
        def pad_to(self, batch, seq_len):
            out = batch.pad_to(seq_len)
            for name, v in out.fields.items():
                if isinstance(v, PackedTensor):
                    def pad(s):
                        if s.dim() < 2 or s.shape[1] >= seq_len:
                            return s
                        extra = s.new_zeros((s.shape[0], seq_len - s.shape[1], *s.shape[2:]))
                        return torch.cat([s, extra], dim=1)

                    out.fields[name] = _map_segments(v, pad)
            return out

    return _with(Ops)()


@mutant("validator_checks_media_seqlen", "the sequence-dim validator asserted dim 1 == seqlen "
        "on every tensor, image_grid_thw included", "batch_ops")
def _strict_validator():
    class Ops(BatchOps):
        def validate(self, batch):
            batch.validate()
            s = batch.seq_len()
            for name, v in batch.fields.items():
                t = v.as_tensor() if isinstance(v, PackedTensor) else v
                if t is not None and t.dim() >= 2:
                    assert t.shape[1] == s, f"{name}: expected dim 1 == {s}, got {list(t.shape)}"

    return _with(Ops)()


@mutant("validator_accepts_misaligned", "the validator checked only input_ids: a misaligned "
        "per-token map passed", "batch_ops")
def _lax_validator():
    class Ops(BatchOps):
        def validate(self, batch):
            ids = batch["input_ids"]
            assert ids.shape[0] == batch.batch_size

    return _with(Ops)()


@mutant("train_inputs_text_only", "the train stage used a static text-only field list while the "
        "logprob stage had images", "batch_ops")
def _text_only():
    class Ops(BatchOps):
        def multimodal_inputs(self, batch, stage, dtype=None):
            if stage is Stage.TRAIN:
                return {}
            return batch.multimodal_inputs(stage, dtype)

    return _with(Ops)()


@mutant("stage_inputs_drop_per_token_map", "the reference-logprob stage built inputs without "
        "the per-token modality map", "batch_ops")
def _drop_map():
    class Ops(BatchOps):
        def multimodal_inputs(self, batch, stage, dtype=None):
            out = batch.multimodal_inputs(stage, dtype)
            if stage is Stage.REFERENCE_LOGPROB:
                out = {k: v for k, v in out.items() if spec(k).kind is not Kind.PER_TOKEN}
            return out

    return _with(Ops)()



# -- sequence dims: per-token fields whose sequence dim is not dim 1 (position_ids [B, C, S]) ---
@mutant("truncate_position_ids_on_dim1", "truncation narrowed dim 1 of every per-token field: "
        "M-RoPE position_ids [B, 3, S] kept all S positions (or lost channels)", "batch_ops")
def _truncate_dim1():
    class Ops(BatchOps):
        def truncate(self, batch, max_len):
            out = batch.truncate(max_len)
            for name in batch.names(Kind.PER_TOKEN):
                out.fields[name] = batch[name][:, :max_len]
            return out

    return _with(Ops)()


@mutant("pad_position_ids_on_dim1", "padding grew dim 1 of every per-token field: position_ids "
        "[B, 3, S] gained channels instead of positions", "batch_ops")
def _pad_dim1():
    class Ops(BatchOps):
        def pad_to(self, batch, seq_len):
            out = batch.pad_to(seq_len)
            for name in batch.names(Kind.PER_TOKEN):
                v = batch[name]
                if v.shape[1] < seq_len:
                    pad = v.new_zeros((v.shape[0], seq_len - v.shape[1], *v.shape[2:]))
                    out.fields[name] = torch.cat([v, pad], dim=1)
            return out

    return _with(Ops)()


@mutant("validator_checks_dim1", "the sequence-dim validator took dim 1 as the sequence of every "
        "per-token field: a valid [B, 3, S] position_ids was rejected", "batch_ops")
def _validator_dim1():
    class Ops(BatchOps):
        def validate(self, batch):
            batch.validate()
            for name in batch.names(Kind.PER_TOKEN):
                v = batch[name]
                if v.shape[1] != batch["input_ids"].shape[1]:
                    raise ValueError(f"per-token field {name!r} has dim 1 {v.shape[1]}")

    return _with(Ops)()


@mutant("validator_skips_multi_dim_per_token", "the validator checked only [B, S] per-token "
        "fields: a [B, 3, S - 1] position_ids passed", "batch_ops")
def _validator_2d_only():
    class Ops(BatchOps):
        def validate(self, batch):
            batch.without(*[n for n in batch.names(Kind.PER_TOKEN)
                            if batch[n].dim() > 2]).validate()

    return _with(Ops)()


# -- model inputs from per-row dict columns ----------------------------------------------------
@mutant("object_inputs_ignored", "stage inputs came from packed fields only: media held in a "
        "per-row dict column (verl multi_modal_inputs) never reached the model", "batch_ops")
def _object_ignored():
    class Ops(BatchOps):
        def multimodal_inputs(self, batch, stage, dtype=None):
            return batch.without(*batch.names(Kind.OBJECT)).multimodal_inputs(stage, dtype)

    return _with(Ops)()


@mutant("object_inputs_concat_rows", "stage inputs concatenated the dict rows' tensors on dim 0, "
        "skipping {} / None rows (extract_multi_modal_inputs style): rows of pack-dim-1 media "
        "lose their alignment with the batch", "batch_ops")
def _object_concat():
    class Ops(BatchOps):
        def multimodal_inputs(self, batch, stage, dtype=None):
            objects = batch.names(Kind.OBJECT)
            out = batch.without(*objects).multimodal_inputs(stage, dtype)
            for name in objects:
                merged: dict = {}
                for row in batch[name]:
                    for k, v in (row or {}).items():
                        merged.setdefault(k, []).extend(v if isinstance(v, list) else [v])
                for k, vs in merged.items():
                    t = torch.cat(vs) if len({tuple(v.shape[1:]) for v in vs}) == 1 \
                        else PackedTensor.from_rows([vs]).as_tensor()
                    if dtype is not None and spec(k).dtype_policy.value == "policy" and \
                            t.is_floating_point() and k not in (batch.family_spec.keep_dtype
                                                                if batch.family_spec else ()):
                        t = t.to(dtype)
                    out[k] = t
            return out

    return _with(Ops)()


# -- batch algebra ------------------------------------------------------------------------------
def _packed_map(batch: Batch, fn) -> Batch:
    out = Batch(dict(batch.fields), batch.family, dict(batch.extra))
    for name, v in batch.fields.items():
        if isinstance(v, PackedTensor):
            out.fields[name] = fn(name, v)
    return out


@mutant("concat_renumbers_media", "concat kept each part's segment indices: rows of the later "
        "parts point at the first part's images", "batch_ops")
def _concat_renumber():
    class Ops(BatchOps):
        def concat(self, batches):
            out = Batch.concat(batches)

            def stale(name, v):
                parts = [b[name] for b in batches]
                return PackedTensor([s for p in parts for s in p.segments],
                                    [r for p in parts for r in p.rows], v.pack_dim)

            return _packed_map(out, stale)

    return _with(Ops)()


@mutant("split_pixels_by_row_count", "split cut the flat pixel_values into chunks by row count "
        "instead of by each row's grid: right only when every row has the same patches",
        "batch_ops")
def _split_by_rows():
    class Ops(BatchOps):
        def split(self, batch, sizes):
            parts = batch.split(sizes)
            b = len(batch)
            starts = [sum(sizes[:k]) for k in range(len(sizes))]
            for name, v in batch.fields.items():
                if not isinstance(v, PackedTensor) or v.pack_dim != 0 or FIELDS[name].grid is None:
                    continue
                flat = v.as_tensor()
                if flat is None:
                    continue
                total = flat.shape[0]
                for k, (a, n) in enumerate(zip(starts, sizes)):
                    cut = flat[total * a // b: total * (a + n) // b]
                    part = parts[k][name]
                    rows, pos = [], 0
                    for i in range(len(part)):
                        segs = part.row_segments(i)
                        if segs is None:
                            rows.append(None)
                            continue
                        new = []
                        for s in segs:
                            piece = cut[pos:pos + s.shape[0]]
                            pos += s.shape[0]
                            if piece.shape[0] < s.shape[0]:
                                piece = torch.cat([piece, s.new_zeros((s.shape[0] - piece.shape[0],
                                                                       *s.shape[1:]))])
                            new.append(piece)
                        rows.append(new)
                    parts[k].fields[name] = PackedTensor.from_rows(rows, part.pack_dim)
            return parts

    return _with(Ops)()


@mutant("select_shares_dict_rows", "select handed out the source's per-row dicts: a stage that "
        "pops a key (verl pops mm_token_type_ids) changes every batch holding the row",
        "batch_ops")
def _shared_rows():
    class Ops(BatchOps):
        def select(self, batch, indices):
            out = batch.select(indices)
            for name in batch.names(Kind.OBJECT):
                col = ObjectColumn([])
                col.rows = [batch[name].rows[int(i)] for i in indices]
                out.fields[name] = col
            return out

    return _with(Ops)()


@mutant("concat_object_none_as_empty", "concat normalised text-only rows to {}: OpenRLHF's None "
        "rows came back as verl-style empty dicts", "batch_ops")
def _none_as_empty():
    class Ops(BatchOps):
        def concat(self, batches):
            out = Batch.concat(batches)
            for name in out.names(Kind.OBJECT):
                out.fields[name] = ObjectColumn([{} if r is None else r for r in out[name]])
            return out

    return _with(Ops)()


# -- micro-batches -------------------------------------------------------------------------------
@mutant("micro_batch_drops_remainder", "micro-batches of B // n rows each (split_tensor_dict): "
        "the B % n last rows never trained", "batch_ops")
def _drop_remainder():
    class Ops(BatchOps):
        def micro_batches(self, batch, n, shuffle_seed=None):
            order = [i for idx, _ in batch.micro_batches(1, shuffle_seed) for i in idx]
            size = len(batch) // n
            return [(order[k * size:(k + 1) * size], batch.select(order[k * size:(k + 1) * size]))
                    for k in range(n)]

    return _with(Ops)()


@mutant("shuffle_leaves_media_in_place", "the shuffle permuted the tensors but not the media: "
        "each micro-batch got its rows' tokens with the unshuffled rows' images", "batch_ops")
def _media_in_place():
    class Ops(BatchOps):
        def micro_batches(self, batch, n, shuffle_seed=None):
            out = batch.micro_batches(n, shuffle_seed)
            start = 0
            for idx, mb in out:
                plain = batch.slice(start, start + len(idx))
                start += len(idx)
                for name, v in plain.fields.items():
                    if isinstance(v, (PackedTensor, ObjectColumn)):
                        mb.fields[name] = v
            return out

    return _with(Ops)()


@mutant("micro_batch_ignores_seed", "shuffle_seed was accepted and ignored: every epoch saw "
        "the same micro-batches in the same order", "batch_ops")
def _ignores_seed():
    class Ops(BatchOps):
        def micro_batches(self, batch, n, shuffle_seed=None):
            return batch.micro_batches(n, None)

    return _with(Ops)()


# -- inputs never modified (BATCH-INPUT-INTACT) --------------------------------------------------
@mutant("stage_inputs_cast_caller_media", "the stage cast the caller's pixel media to the "
        "stage dtype in place (assigned back into the batch's segments and per-row dicts) "
        "before building inputs",
        "batch_ops")
def _stage_cast_in_place():
    class Ops(BatchOps):
        def multimodal_inputs(self, batch, stage, dtype=None):
            if dtype is not None:
                for name, v in batch.fields.items():
                    if isinstance(v, PackedTensor) and _policy_media(batch, name):
                        v.segments[:] = [s.to(dtype) if s.is_floating_point() else s
                                         for s in v.segments]
                    elif isinstance(v, ObjectColumn):  # the same, in the per-row dicts
                        for row in v.rows:
                            for key, x in (row or {}).items():
                                if _policy_media(batch, key):
                                    row[key] = [t.to(dtype) for t in x] if isinstance(x, list) \
                                        else x.to(dtype)
            return batch.multimodal_inputs(stage, dtype)

    return _with(Ops)()


@mutant("micro_batches_annotate_caller", "micro-batching recorded its plan in the caller's "
        "batch (extra['micro_batch_rows'], as DataProto.meta_info is updated in place)",
        "batch_ops")
def _annotate_caller():
    class Ops(BatchOps):
        def micro_batches(self, batch, n, shuffle_seed=None):
            out = batch.micro_batches(n, shuffle_seed)
            batch.extra["micro_batch_rows"] = [list(idx) for idx, _ in out]
            return out

    return _with(Ops)()


# -- every layout regime (BATCH-REGIMES) ---------------------------------------------------------
@mutant("micro_batch_drops_empty_rows", "micro-batches were packed by token count and rows "
        "without tokens were never placed: zero-length rows vanish", "batch_ops")
def _drop_empty():
    class Ops(BatchOps):
        def micro_batches(self, batch, n, shuffle_seed=None):
            out = []
            for idx, _ in batch.micro_batches(n, shuffle_seed):
                idx = [i for i in idx if int(batch.seq_lens[i]) > 0]
                out.append((idx, batch.select(idx)))
            return out

    return _with(Ops)()


# -- heterogeneous rows (BATCH-HETERO-ROWS) ------------------------------------------------------
@mutant("select_keys_of_first_row", "select rebuilt per-row dicts through a columnar form whose "
        "keys came from the first non-empty selected row: keys first appearing later vanished",
        "batch_ops")
def _select_schema():
    class Ops(BatchOps):
        def select(self, batch, indices):
            out = batch.select(indices)
            for name in out.names(Kind.OBJECT):
                out.fields[name] = keys_of_first_row(out[name])
            return out

    return _with(Ops)()


@mutant("micro_batch_media_by_count", "micro-batches took media from the flat image list, one "
        "image per row whenever the image count equalled the row count (a processor's rule for "
        "flat image lists)", "batch_ops")
def _media_by_count():
    class Ops(BatchOps):
        def micro_batches(self, batch, n, shuffle_seed=None):
            out = batch.micro_batches(n, shuffle_seed)
            packed = {k: v for k, v in batch.fields.items()
                      if isinstance(v, PackedTensor) and v.pack_dim == 0}
            per_image = {k: [s for i in range(len(v)) for s in (v.row_segments(i) or [])]
                         for k, v in packed.items()}
            if not per_image or any(len(s) != len(batch) for s in per_image.values()):
                return out
            for idx, mb in out:
                for k, segs in per_image.items():
                    mb.fields[k] = PackedTensor.from_rows([[segs[i]] for i in idx],
                                                          packed[k].pack_dim)
            return out

    return _with(Ops)()


# -- model inputs against the processor (BATCH-MODEL-INPUTS) -------------------------------------
@mutant("stage_inputs_normalised_twice", "the stage applied the image processor's normalisation "
        "((x - 0.5) / 0.5) to pixel values the processor had already normalised", "batch_ops")
def _normalised_twice():
    class Ops(BatchOps):
        def multimodal_inputs(self, batch, stage, dtype=None):
            out = batch.multimodal_inputs(stage, dtype)
            return {k: (v - 0.5) / 0.5 if _policy_media(batch, k) and v.is_floating_point()
                    else v for k, v in out.items()}

    return _with(Ops)()


@mutant("stage_inputs_images_reversed_in_row", "the stage gathered each sample's images from a "
        "mapping that gave them back last first: a several-image row's images reach the model "
        "in reverse order", "batch_ops")
def _images_reversed():
    class Ops(BatchOps):
        def multimodal_inputs(self, batch, stage, dtype=None):
            packed = batch.packed_form()
            fields = dict(packed.fields)
            for name, v in packed.fields.items():
                if isinstance(v, PackedTensor) and v.pack_dim == 0:
                    fields[name] = PackedTensor.from_rows(
                        [None if r is None else v.row_segments(i)[::-1]
                         for i, r in enumerate(v.rows)], v.pack_dim)
            return Batch(fields, batch.family).multimodal_inputs(stage, dtype)

    return _with(Ops)()


@mutant("stage_inputs_image_major_on_equal_counts", "where every row holds the same number "
        "(2 or more) of images, the stage stacked them as one [rows, images] block and read it "
        "image-major: rows get each other's images, with every count and shape still right",
        "batch_ops")
def _image_major():
    def regroup(v: PackedTensor) -> PackedTensor:
        segs = [v.row_segments(i) or [] for i in range(len(v.rows))]
        counts = {len(s) for s in segs}
        k = counts.pop() if len(counts) == 1 else 0
        if len(segs) < 2 or k < 2:
            return v
        flat = [segs[i][j] for j in range(k) for i in range(len(segs))]
        return PackedTensor.from_rows([flat[i * k:(i + 1) * k] for i in range(len(segs))],
                                      v.pack_dim)

    class Ops(BatchOps):
        def multimodal_inputs(self, batch, stage, dtype=None):
            packed = batch.packed_form()
            fields = {name: regroup(v) if isinstance(v, PackedTensor) and v.pack_dim == 0 else v
                      for name, v in packed.fields.items()}
            return Batch(fields, batch.family).multimodal_inputs(stage, dtype)

    return _with(Ops)()


# -- no aliasing (BATCH-NO-ALIAS) ----------------------------------------------------------------
@mutant("select_shares_list_values", "select copied each dict row one level deep (dict(row)): "
        "its per-image list values are the source row's lists", "batch_ops")
def _shallow_rows():
    class Ops(BatchOps):
        def select(self, batch, indices):
            out = batch.select(indices)
            for name in batch.names(Kind.OBJECT):
                col = ObjectColumn([])
                col.rows = [None if batch[name].rows[int(i)] is None
                            else dict(batch[name].rows[int(i)]) for i in indices]
                out.fields[name] = col
            return out

    return _with(Ops)()


@mutant("select_of_every_row_returns_source", "select returned its input batch when the indices "
        "were every row in order (nothing to move)", "batch_ops")
def _identity_select():
    class Ops(BatchOps):
        def select(self, batch, indices):
            if [int(i) for i in indices] == list(range(len(batch))):
                return batch
            return batch.select(indices)

    return _with(Ops)()


@mutant("split_chunks_share_extra", "split gave every chunk one extra dict: a stage that notes "
        "something on one micro-batch (its step, its rank) notes it on every sibling", "batch_ops")
def _chunks_share_extra():
    class Ops(BatchOps):
        def split(self, batch, sizes):
            parts = batch.split(sizes)
            for p in parts[1:]:
                p.extra = parts[0].extra
            return parts

    return _with(Ops)()


@mutant("concat_consumes_caller_list", "concat popped its parts off the caller's list as it "
        "merged them (to free each part early): the caller's list came back empty",
        "batch_ops")
def _concat_consumes():
    class Ops(BatchOps):
        def concat(self, batches):
            parts = []
            while isinstance(batches, list) and batches:
                parts.append(batches.pop(0))
            return Batch.concat(parts or batches)

    return _with(Ops)()


# -- merges by value (BATCH-MERGE-BY-VALUE, BATCH-UNION) -----------------------------------------
@mutant("concat_checks_family_by_identity", "concat checked that the batches are of one family "
        "with `is`: a chunk whose family name came back from another process is refused",
        "batch_ops")
def _concat_family_identity():
    class Ops(BatchOps):
        def concat(self, batches):
            for b in batches[1:]:
                if b.family is not batches[0].family:
                    raise ValueError(f"cannot concat batches of families {batches[0].family!r} "
                                     f"and {b.family!r}")
            return Batch.concat(batches)

    return _with(Ops)()


@mutant("union_compares_by_identity", "union accepted an overlapping field only when both "
        "batches hold the same object (verl union_numpy_dict's dict == relies on the identity "
        "shortcut)", "batch_ops")
def _union_identity():
    class Ops(BatchOps):
        def union(self, a, b):
            for name in set(a.fields) & set(b.fields):
                if a.fields[name] is not b.fields[name]:
                    raise ValueError(f"union: {name!r} in the two batches are not the same object")
            return a.union(b)

    return _with(Ops)()
