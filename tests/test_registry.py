"""Unit tests of the field registry (reference_impl/registry.py): field specs, families, stages and
the registration of new fields."""

from __future__ import annotations

import pytest
import torch

from rlconform.reference_impl import registry
from rlconform.reference_impl.registry import (
    FAMILIES,
    DtypePolicy,
    FieldSpec,
    Kind,
    Stage,
    multimodal_fields,
    register_field,
    spec,
    stage_fields,
)


class TestRegistry:
    @pytest.mark.parametrize("family", sorted(FAMILIES))
    def test_every_family_field_is_registered(self, family):
        fam = FAMILIES[family]
        for name in fam.fields:
            assert name in registry.FIELDS, f"{family}: {name} not registered"
            assert spec(name).name == name
        assert set(fam.pack_dims) <= set(fam.fields)
        assert all(d in (0, 1) for d in fam.pack_dims.values())
        assert set(fam.keep_dtype) <= set(fam.fields)
        assert set(fam.segment_shapes) <= set(fam.packed_fields())
        # every packed field says what one segment looks like
        assert set(fam.packed_fields()) == set(fam.segment_shapes)

    def test_spec_unknown_field_names_it(self):
        with pytest.raises(KeyError, match="'no_such_field' is not registered"):
            spec("no_such_field")

    def test_coupled_fields_exist_are_packed_and_symmetric(self):
        couplings = 0
        for name, fs in registry.FIELDS.items():
            for other in fs.coupled:
                couplings += 1
                assert other in registry.FIELDS, f"{name} couples unregistered {other}"
                assert spec(other).kind is Kind.PACKED and fs.kind is Kind.PACKED
                assert name in spec(other).coupled, f"{name} -> {other} is one-way"
        assert couplings >= 10

    def test_policy_media_allow_only_floating_dtypes(self):
        policy = [fs for fs in registry.FIELDS.values() if fs.dtype_policy is DtypePolicy.POLICY]
        assert {fs.name for fs in policy} >= {"pixel_values", "pixel_values_videos"}
        for fs in policy:
            assert fs.dtypes and all(d.is_floating_point for d in fs.dtypes)
            assert torch.bfloat16 in fs.dtypes

    @pytest.mark.parametrize("stage", list(Stage))
    def test_every_stage_fetches_every_media_field(self, stage):
        # the train fetch that used a static text-only field list (BACKGROUND.md section 3)
        packed = {n for n, f in registry.FIELDS.items() if f.kind is Kind.PACKED}
        assert packed <= set(stage_fields(stage))
        assert packed <= set(multimodal_fields(stage))
        assert {"mm_token_type_ids", "token_type_ids"} <= set(multimodal_fields(stage))
        assert "input_ids" not in multimodal_fields(stage)

    def test_stage_fields_follow_stages(self):
        assert "prev_logprobs" in stage_fields(Stage.TRAIN)
        assert "prev_logprobs" not in stage_fields(Stage.LOGPROB)
        assert "rewards" not in stage_fields(Stage.TRAIN)

    def test_register_field(self, monkeypatch):
        monkeypatch.setattr(registry, "FIELDS", dict(registry.FIELDS))
        new = FieldSpec("backend_col", Kind.PER_SAMPLE, dtypes=(torch.float32,))
        register_field(new)
        assert spec("backend_col") is new
        register_field(FieldSpec("backend_col", Kind.PER_SAMPLE, dtypes=(torch.float32,)))
        with pytest.raises(ValueError, match="'backend_col' is already registered"):
            register_field(FieldSpec("backend_col", Kind.PER_TOKEN))
        with pytest.raises(ValueError, match="'pixel_values' is already registered"):
            register_field(FieldSpec("pixel_values", Kind.PER_SAMPLE))
        assert spec("pixel_values").kind is Kind.PACKED


