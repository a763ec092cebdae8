"""Every layout regime on purpose, and every conversion through serialisation.

Defects hide in regimes that random lengths reach only by coincidence: rows of truly one length
(where a fast path stacks them), one row, one token per row, zero-length rows (which a
token-budget batcher skips), media nowhere; and each with multi-channel per-token fields
(M-RoPE position_ids `[B, C, S]`, whose sequence dim is the last). These tests build each regime
by construction (synthetic.regime_plan) for every family, and move each form a backend converts
between (padded batch, jagged wire batch, chunks and micro-batches) through a serialisation
round trip (torch.save / torch.load, what crossing to another process does) before converting
back, so nothing may live outside what is serialised: a fresh codec decodes the wire.
"""

from __future__ import annotations

import io

import pytest
import torch

from rlconform.fixtures.strategies import Recipe
from rlconform.fixtures.synthetic import (
    LAYOUTS,
    MEDIA_FORMS,
    POSITION_CHANNELS,
    layout_of,
    media_families,
)
from rlconform.reference_impl.batch import Batch

from ._check import assert_batch_equal, assert_rows, batch_rows, expect_accepted, offered

MEDIA = media_families()


def _cases() -> list[Recipe]:
    """Every family in every layout (media present in some rows, then nowhere), media forms
    cycled, position ids `[B, C, S]` for the M-RoPE families (`[B, S]` or none elsewhere)."""
    out = []
    for f, family in enumerate(MEDIA):
        for k, layout in enumerate(LAYOUTS):
            i = f * len(LAYOUTS) + k
            pos = (POSITION_CHANNELS[family] if k % 2 else 3) if family in POSITION_CHANNELS \
                else (None, 0)[k % 2]
            for media in ("ragged", "media_free"):
                out.append(Recipe(family, layout, media, 4, MEDIA_FORMS[i % len(MEDIA_FORMS)],
                                  pos, seed=i))
    return out


CASES = _cases()


def _id(r: Recipe) -> str:
    pos = "" if r.position_ids is None else f"-pos{r.position_ids}"
    return f"{r.family}-{r.layout}-{r.media}-{r.form}{pos}"


def _serialised(obj):
    """`obj` after torch.save / torch.load: what another process receives."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _check_regime(batch: Batch, recipe: Recipe) -> None:
    """The anti-vacuity check: the built batch is in the regime the case names."""
    assert layout_of(batch) == recipe.layout, \
        f"fixture is in layout {layout_of(batch)}, not {recipe.layout}"
    if recipe.position_ids:
        shape = list(batch["position_ids"].shape)
        assert shape[1] == recipe.position_ids, f"fixture lost its [B, C, S] position_ids: {shape}"


# -- codec -------------------------------------------------------------------------------------
@pytest.mark.clause("WIRE-REGIMES")
@pytest.mark.parametrize("recipe", CASES, ids=_id)
def test_wire_roundtrips_in_every_regime_through_serialisation(codec, codec_factory, recipe):
    batch = recipe.build()
    _check_regime(batch, recipe)
    wire = codec.encode(batch)
    out = codec_factory().decode(_serialised(wire))  # another process: a codec of its own
    assert_batch_equal(batch, out, f"{_id(recipe)}: decode(load(save(encode(batch))))")


# -- batch operations --------------------------------------------------------------------------
def _uneven(b: int) -> int:
    return next((n for n in range(2, b + 1) if b % n), b)


@pytest.mark.clause("BATCH-REGIMES")
@pytest.mark.parametrize("recipe", CASES, ids=_id)
def test_batch_forms_convert_in_every_regime_through_serialisation(backend, batch_ops, recipe):
    """Padded -> longer padded -> truncated back; whole -> chunks -> concatenated back; whole ->
    micro-batches -> concatenated in recorded order: each intermediate form serialised."""
    batch = recipe.build()
    _check_regime(batch, recipe)
    rows = batch_rows(batch)
    b, s = len(batch), batch.seq_len()
    if offered(backend, "pad_to"):
        padded = _serialised(expect_accepted(lambda: batch_ops.pad_to(batch, s + 3),
                                             f"{_id(recipe)}: pad_to({s + 3})"))
        assert_rows(rows, padded, f"{_id(recipe)}: pad_to({s + 3}) after serialisation")
        if offered(backend, "truncate"):
            back = expect_accepted(lambda: batch_ops.truncate(padded, s),
                                   f"{_id(recipe)}: truncate(pad_to(batch), {s})")
            assert_rows(rows, back, f"{_id(recipe)}: truncate(pad_to(batch), {s})")
    if "batch_algebra" in backend.capabilities:
        sizes = [b // 2, b - b // 2] if b > 1 else [1]
        parts = [_serialised(p) for p in expect_accepted(lambda: batch_ops.split(batch, sizes),
                                                         f"{_id(recipe)}: split({sizes})")]
        assert [len(p) for p in parts] == sizes, \
            f"{_id(recipe)}: split({sizes}) gave chunks of {[len(p) for p in parts]} rows"
        assert_rows(rows, batch_ops.concat(parts),
                    f"{_id(recipe)}: concat(load(save(split(batch, {sizes}))))")
    if "micro_batching" in backend.capabilities:
        for n, seed in sorted({(1, None), (b, 7), (_uneven(b), None), (_uneven(b), 7)},
                              key=str):
            made = expect_accepted(lambda m=n, s=seed: batch_ops.micro_batches(batch, m, s),
                                   f"{_id(recipe)}: micro_batches({n} of {b} rows, seed {seed})")
            mbs = [(list(idx), _serialised(mb)) for idx, mb in made]
            held = sorted(i for idx, _ in mbs for i in idx)
            assert held == list(range(b)), \
                f"{_id(recipe)}: micro_batches({n}, seed {seed}) hold rows {held} of {b}"
            for idx, mb in mbs:
                assert_rows([rows[i] for i in idx], mb,
                            f"{_id(recipe)}: micro-batch of rows {idx} (seed {seed}) after "
                            "serialisation")
