"""Bit-exactness clauses: values a comparator cannot see cross the wire and the store unchanged.

NaN (quiet, negative, signalling, with payloads), +-inf, -0.0 and subnormals, in every floating
dtype, compared by dtype, shape and raw bits (`torch.equal` calls NaN unequal to itself and -0.0
equal to +0.0). Each test first checks that its input really holds such values.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from rlconform.fixtures.strategies import given_batches
from rlconform.fixtures.synthetic import RowPlan, build_batch, media_families, special_values
from rlconform.reference_impl.bitexact import bits
from rlconform.reference_impl.codec import ReferenceCodec
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.registry import FAMILIES

from ._check import assert_batch_equal, assert_columns_equal, keys_for

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MEDIA_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _special_count(t: torch.Tensor) -> int:
    """How many elements of `t` are one of the special bit patterns of its dtype."""
    if not t.is_floating_point() or t.numel() == 0:
        return 0
    sv = bits(special_values(t.dtype))
    return int(torch.isin(bits(t), sv).sum())


def _batch_specials(batch) -> set[str]:
    """Fields of `batch` that hold special values (the input check: no vacuous pass)."""
    out = set()
    for name, v in batch.fields.items():
        tensors = v.segments if isinstance(v, PackedTensor) else [v]
        if sum(_special_count(t) for t in tensors):
            out.add(name)
    return out


def _full_plan(family: str) -> list[RowPlan]:
    """Every row has every medium (no empty jagged rows), one row shares another's media."""
    vid = [1] if any(f.endswith("videos") for f in FAMILIES[family].fields) else []
    return [RowPlan(6, images=[1, 2], videos=vid), RowPlan(4, images=[2], videos=vid),
            RowPlan(5, share_media_of=0)]


# -- codec ----------------------------------------------------------------------------------------
@pytest.mark.clause("WIRE-BITEXACT")
@pytest.mark.parametrize("dtype", MEDIA_FLOATS, ids=str)
@pytest.mark.parametrize("family", media_families())
def test_special_values_roundtrip_codec(codec, family, dtype):
    batch = build_batch(family, _full_plan(family), media_dtype=dtype, specials=True)
    held = _batch_specials(batch)
    assert {"generation_logprobs", "advantages"} <= held, f"fixture lost its specials: {held}"
    assert held & set(FAMILIES[family].packed_fields()), "no media field holds specials"
    assert_batch_equal(batch, codec.decode(codec.encode(batch)), f"{family} {dtype}")


@pytest.mark.clause("WIRE-BITEXACT")
@given_batches(specials=True, turned=False)
def test_property_special_values_roundtrip_codec(codec, batch):
    assert_batch_equal(batch, codec.decode(codec.encode(batch)), "decode(encode(batch))")


# -- transport ------------------------------------------------------------------------------------
def _special_columns(n: int) -> dict[str, torch.Tensor]:
    """Per floating dtype: a dense (n, m) column and jagged columns of 1-D and (len, 2) rows, each
    row the dtype's special values rotated (no row is empty, no column is 1-D: layouts every
    transport handles, so only the values are judged)."""
    cols = {}
    for dt in FLOATS:
        sv = special_values(dt)
        m = sv.numel()
        rows = [sv.roll(i) for i in range(n)]
        name = str(dt).removeprefix("torch.")
        cols[f"{name}_dense"] = torch.stack(rows)
        cols[f"{name}_jagged"] = torch.nested.nested_tensor(
            [r[: 1 + (i * 3) % m] for i, r in enumerate(rows)], layout=torch.jagged)
        cols[f"{name}_pairs"] = torch.nested.nested_tensor(
            [torch.stack([r, r.flip(0)], 1)[: 1 + i % m] for i, r in enumerate(rows)],
            layout=torch.jagged)
    return cols


@pytest.mark.clause("DP-BITEXACT")
@pytest.mark.parametrize("n", [1, 4])
def test_special_values_roundtrip_transport(transport, n):
    cols = _special_columns(n)
    assert all(_special_count(c.values() if c.is_nested else c) for c in cols.values())
    keys, part = keys_for(n), f"p-{uuid.uuid4().hex[:8]}"
    transport.put(part, keys, cols)
    got, _ = transport.get(part, keys, select_fields=list(cols))
    assert_columns_equal(cols, got)
    order = list(range(n))[::-1]  # another order: rows gathered, not one block copied
    got, _ = transport.get(part, [keys[i] for i in order], select_fields=list(cols))
    assert_columns_equal({k: (torch.nested.nested_tensor([c.unbind()[i] for i in order],
                                                         layout=torch.jagged)
                              if c.is_nested else c[order]) for k, c in cols.items()}, got)


@pytest.mark.clause("DP-BITEXACT")
@pytest.mark.parametrize("dtype", MEDIA_FLOATS, ids=str)
@pytest.mark.parametrize("family", media_families())
def test_special_values_in_wire_columns_through_transport(transport, family, dtype):
    """A family's wire columns with specials in media, per-token and per-sample values (1-D
    per-sample columns left out: their layout is DP-LAYOUT's business)."""
    batch = build_batch(family, _full_plan(family), media_dtype=dtype, specials=True)
    wire = ReferenceCodec().encode(batch)
    cols = {k: c for k, c in wire.columns.items() if c.is_nested or c.dim() > 1}
    assert sum(_special_count(c.values()) for c in cols.values() if c.is_nested), \
        "no wire column holds specials"
    keys, part = keys_for(len(batch)), f"p-{uuid.uuid4().hex[:8]}"
    transport.put(part, keys, cols, wire.tags)
    got, _ = transport.get(part, keys, select_fields=list(cols))
    assert_columns_equal(cols, got)
