"""Batch-operation mutants: truncation, padding, validation and stage inputs gone wrong."""

from __future__ import annotations

import torch

from rlconform.conformance.backends.reference import build
from rlconform.reference_impl.batch import BatchOps
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.registry import Kind, Stage, spec

from . import mutant


def _with(cls):
    return lambda: build(batch_ops=cls)


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

