"""The field registry: the one source of truth for what every batch field is.

Every stage that moves or consumes a batch (codec, truncation, padding, the sequence-dim
validator, the logprob / reference-logprob / train fetches) asks this registry what a field is,
instead of guessing from a tensor's rank. The field defects of BACKGROUND.md section 3 (static
text-only fetch lists, narrowing every >= 2-D tensor on dim 1, padding media to seqlen) all came
from code that guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class Kind(str, Enum):
    PACKED = "packed"  # jagged per sample, never sequence-aligned (dim 0 = patches/images/tiles)
    PER_TOKEN = "per_token"  # sequence-aligned `[B, S]`, padded and truncated like input_ids
    PER_SAMPLE = "per_sample"  # dense `[B, ...]`, one value (or fixed-shape block) per sample
    OBJECT = "object"  # per-sample Python values (a dict of tensors, `{}` or None): ObjectColumn


class DtypePolicy(str, Enum):
    POLICY = "policy"  # floating media cast to the policy dtype once, at rollout write
    KEEP = "keep"  # never cast (integer geometry, masks, timings, fp32-on-purpose media)


class Stage(str, Enum):
    LOGPROB = "logprob"
    REFERENCE_LOGPROB = "reference_logprob"
    TRAIN = "train"


ALL_STAGES = frozenset(Stage)


@dataclass(frozen=True)
class FieldSpec:
    name: str
    kind: Kind
    multimodal: bool = False
    dtype_policy: DtypePolicy = DtypePolicy.KEEP
    dtypes: tuple[torch.dtype, ...] = ()  # allowed dtypes; empty: any
    coupled: tuple[str, ...] = ()  # fields that must travel with this one
    stages: frozenset[Stage] = ALL_STAGES
    pack_dim: int = 0
    pad_value: float = 0
    # PER_TOKEN: the sequence-aligned dim (1 = `[B, S, ...]`; -1 = last, e.g. `[B, C, S]`)
    seq_dim: int = 1
    # PACKED: the packed field whose per-segment product (t*h*w) gives this field's dim-0 rows
    # per segment, so a per-sample tensor splits back into segments (Qwen-VL pixel_values)
    grid: str | None = None
    # OBJECT: a media-free row is `{}` (verl) when True, None (OpenRLHF) when False
    empty_as_dict: bool = False

    def seq_axis(self, ndim: int) -> int:
        """The sequence dim of a PER_TOKEN tensor of rank `ndim` (>= 2), as a positive index."""
        axis = self.seq_dim + ndim if self.seq_dim < 0 else self.seq_dim
        if ndim < 2 or not 1 <= axis < ndim:
            raise ValueError(f"per-token field {self.name!r} needs a sequence dim "
                             f"(seq_dim {self.seq_dim}) after the batch dim; got rank {ndim}")
        return axis


_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_INT = (torch.int64, torch.int32)
_MASK = (torch.int64, torch.int32, torch.bool)


def _packed(name, *, policy=DtypePolicy.KEEP, dtypes=_INT, coupled=(), pack_dim=0, grid=None):
    return FieldSpec(name, Kind.PACKED, True, policy, dtypes, coupled, ALL_STAGES, pack_dim,
                     grid=grid)


_TRAIN = frozenset({Stage.TRAIN})
_NONE: frozenset[Stage] = frozenset()

FIELDS: dict[str, FieldSpec] = {
    f.name: f
    for f in [
        # sequence fields shared by every family
        FieldSpec("input_ids", Kind.PER_TOKEN, dtypes=_INT),
        FieldSpec("attention_mask", Kind.PER_TOKEN, dtypes=_MASK),
        FieldSpec("token_mask", Kind.PER_TOKEN, dtypes=_MASK, stages=_TRAIN),
        FieldSpec("generation_logprobs", Kind.PER_TOKEN, dtypes=(torch.float32,), stages=_TRAIN),
        FieldSpec("prev_logprobs", Kind.PER_TOKEN, dtypes=(torch.float32,), stages=_TRAIN),
        FieldSpec("reference_logprobs", Kind.PER_TOKEN, dtypes=(torch.float32,), stages=_TRAIN),
        FieldSpec("input_lengths", Kind.PER_SAMPLE, dtypes=_INT),
        FieldSpec("prompt_lengths", Kind.PER_SAMPLE, dtypes=_INT, stages=_NONE),
        FieldSpec("rewards", Kind.PER_SAMPLE, dtypes=(torch.float32,), stages=_NONE),
        FieldSpec("advantages", Kind.PER_SAMPLE, dtypes=(torch.float32,), stages=_TRAIN),
        # computed once (M-RoPE: the model's get_rope_index) and shipped: `[B, S]` for text,
        # `[B, 3, S]` for M-RoPE, `[B, 4, S]` in verl's Qwen-VL layout (text row + 3 M-RoPE rows)
        FieldSpec("position_ids", Kind.PER_TOKEN, dtypes=(torch.int64,), seq_dim=-1),
        # per-token multimodal maps: drive M-RoPE (Qwen-VL) and image attention (Gemma3)
        FieldSpec("mm_token_type_ids", Kind.PER_TOKEN, multimodal=True, dtypes=_INT),
        FieldSpec("token_type_ids", Kind.PER_TOKEN, multimodal=True, dtypes=_INT),
        # images
        _packed(
            "pixel_values",
            policy=DtypePolicy.POLICY,
            dtypes=_FLOAT,
            coupled=("image_grid_thw", "image_sizes", "imgs_sizes", "num_frames",
                     "pixel_attention_mask", "images_seqlens"),
            grid="image_grid_thw",
        ),
        _packed("image_grid_thw", coupled=("pixel_values",)),
        # verl: h*w per image frame, which it keeps next to the media in multi_modal_inputs
        _packed("images_seqlens", coupled=("pixel_values",)),
        _packed("image_sizes", coupled=("pixel_values",)),
        _packed("imgs_sizes", coupled=("pixel_values",)),
        _packed("num_frames", coupled=("pixel_values",)),
        _packed("pixel_attention_mask", dtypes=_MASK, coupled=("pixel_values",), pack_dim=1),
        # video
        _packed(
            "pixel_values_videos",
            policy=DtypePolicy.POLICY,
            dtypes=_FLOAT,
            coupled=("video_grid_thw", "second_per_grid_ts"),
            grid="video_grid_thw",
        ),
        _packed("video_grid_thw", coupled=("pixel_values_videos",)),
        _packed("second_per_grid_ts", dtypes=(torch.float32,), coupled=("pixel_values_videos",)),
        # audio
        _packed(
            "input_features",
            policy=DtypePolicy.POLICY,
            dtypes=_FLOAT,
            coupled=("feature_attention_mask",),
        ),
        _packed("feature_attention_mask", dtypes=_MASK, coupled=("input_features",)),
        # per-sample media as per-row dicts of packed fields (reference_impl.objects.ObjectColumn)
        # verl: DataProto.non_tensor_batch["multi_modal_inputs"], `{}` for a text-only row
        FieldSpec("multi_modal_inputs", Kind.OBJECT, multimodal=True, empty_as_dict=True),
        # OpenRLHF: Experience.mm_train_inputs, None for a text-only row
        FieldSpec("mm_train_inputs", Kind.OBJECT, multimodal=True),
        # each row's prompt text and images as the dataset held them (reference_impl.prompts),
        # for trainers that render and process prompts themselves: no stage fetches it by rule
        FieldSpec("raw_prompt", Kind.OBJECT, stages=_NONE),
    ]
}


@dataclass(frozen=True)
class FamilySpec:
    """The multimodal fields a model family's processor emits, and how they are packed."""

    name: str
    fields: tuple[str, ...]
    pack_dims: dict[str, int] = field(default_factory=dict)  # overrides FieldSpec.pack_dim
    keep_dtype: frozenset[str] = frozenset()  # media this family keeps in its own dtype
    # the trailing shape of one segment of each packed field, as the real processor emits it
    segment_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # fields whose per-image segments gain a leading image dim, so that padding the patch dim
    # and concatenating on dim 0 builds `[n_images, max_patches, ...]` (LLaVA-NeXT)
    image_blocks: frozenset[str] = frozenset()

    def pack_dim(self, name: str) -> int:
        return self.pack_dims.get(name, FIELDS[name].pack_dim)

    def segments(self, name: str, per_sample: list) -> list:
        """Per-sample segment lists as a processor splits them -> this family's segments."""
        if name not in self.image_blocks:
            return per_sample
        return [None if r is None else [s.unsqueeze(0) for s in r] for r in per_sample]

    def packed_fields(self) -> tuple[str, ...]:
        return tuple(f for f in self.fields if FIELDS[f].kind is Kind.PACKED)

    def per_token_fields(self) -> tuple[str, ...]:
        return tuple(f for f in self.fields if FIELDS[f].kind is Kind.PER_TOKEN)


_QWEN_IMG = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
_QWEN_VID = ("pixel_values_videos", "video_grid_thw")

FAMILIES: dict[str, FamilySpec] = {
    f.name: f
    for f in [
        FamilySpec("text", ()),
        FamilySpec(
            "qwen2_vl",
            _QWEN_IMG + _QWEN_VID,
            segment_shapes={"pixel_values": (1176,), "pixel_values_videos": (1176,),
                            "image_grid_thw": (3,), "video_grid_thw": (3,)},
        ),
        FamilySpec(
            "qwen2_5_vl",
            _QWEN_IMG + _QWEN_VID + ("second_per_grid_ts",),
            segment_shapes={"pixel_values": (1176,), "pixel_values_videos": (1176,),
                            "image_grid_thw": (3,), "video_grid_thw": (3,),
                            "second_per_grid_ts": ()},
        ),
        FamilySpec(
            "qwen3_vl",
            _QWEN_IMG + _QWEN_VID,
            segment_shapes={"pixel_values": (1536,), "pixel_values_videos": (1536,),
                            "image_grid_thw": (3,), "video_grid_thw": (3,)},
        ),
        FamilySpec(
            "gemma3",
            ("pixel_values", "token_type_ids"),
            segment_shapes={"pixel_values": (3, 896, 896)},
        ),
        FamilySpec(
            "idefics3",
            ("pixel_values", "pixel_attention_mask"),
            pack_dims={"pixel_values": 1, "pixel_attention_mask": 1},
            segment_shapes={"pixel_values": (3, 364, 364), "pixel_attention_mask": (364, 364)},
        ),
        FamilySpec(
            "smolvlm",
            ("pixel_values", "pixel_attention_mask"),
            pack_dims={"pixel_values": 1, "pixel_attention_mask": 1},
            segment_shapes={"pixel_values": (3, 512, 512), "pixel_attention_mask": (512, 512)},
        ),
        FamilySpec("llava", ("pixel_values",), segment_shapes={"pixel_values": (3, 336, 336)}),
        FamilySpec(
            "llava_next",
            ("pixel_values", "image_sizes"),
            # one segment [1, patches, 3, H, W] per image; patches differ across images, so the
            # model input [n_images, max_patches, 3, H, W] is padded on dim 1 only in as_tensor()
            segment_shapes={"pixel_values": (None, 3, 336, 336), "image_sizes": (2,)},
            image_blocks=frozenset({"pixel_values"}),
        ),
        FamilySpec(
            "nemotron_omni",
            ("pixel_values", "imgs_sizes", "num_frames"),
            keep_dtype=frozenset({"pixel_values"}),
            # dynamic resolution: H and W differ per image (None marks a varying dim)
            segment_shapes={"pixel_values": (3, None, None), "imgs_sizes": (2,),
                            "num_frames": ()},
        ),
        FamilySpec(
            "audio",
            ("input_features", "feature_attention_mask"),
            segment_shapes={"input_features": (128, None), "feature_attention_mask": (None,)},
        ),
    ]
}


def spec(name: str) -> FieldSpec:
    """The registered spec of `name`; an unregistered field is an error, never dropped."""
    try:
        return FIELDS[name]
    except KeyError:
        raise KeyError(
            f"field {name!r} is not registered in rlconform.reference_impl.registry.FIELDS; "
            "register it (kind, dtype policy, stages) so no stage drops or mangles it"
        ) from None


def register_field(field_spec: FieldSpec) -> None:
    """Add a field (a backend's own column). Re-registering a different spec is an error."""
    old = FIELDS.get(field_spec.name)
    if old is not None and old != field_spec:
        raise ValueError(f"field {field_spec.name!r} is already registered as {old}")
    FIELDS[field_spec.name] = field_spec


def multimodal_fields(stage: Stage | None = None) -> tuple[str, ...]:
    return tuple(
        n for n, f in FIELDS.items() if f.multimodal and (stage is None or stage in f.stages)
    )


def stage_fields(stage: Stage) -> tuple[str, ...]:
    """Every registered field a stage consumes (what its fetch must ask for, when present)."""
    return tuple(n for n, f in FIELDS.items() if stage in f.stages)
