"""Which modules run fused attention (reference_impl.trainer.fused_attention_modules): the
TRAIN-LEGACY-PARITY tolerance for a non-reproducible fused backward applies to those modules,
and only where it was measured (FUSED_ATTENTION_MEASURED); every other weight stays bitwise."""

from __future__ import annotations

import dataclasses

from rlconform.conformance.catalogue.trainer import FUSED_ATTENTION_MEASURED
from rlconform.fixtures.families import build_family
from rlconform.reference_impl.trainer import fused_attention, fused_attention_modules


def test_a_gemma3_with_an_sdpa_vision_tower_names_only_the_tower():
    family = build_family("gemma3")
    assert fused_attention_modules(family.build_model()) == set(), "tiny Gemma3 runs eager"
    mixed = dataclasses.replace(family, attention={"": "eager", "text_config": "eager",
                                                   "vision_config": "sdpa"})
    model = mixed.build_model()
    assert fused_attention(model)
    assert fused_attention_modules(model) == {"model.vision_tower"}
    assert set(FUSED_ATTENTION_MEASURED["gemma3"]) == {"model.vision_tower"}, \
        "the measured module must be the one the production model runs fused"
