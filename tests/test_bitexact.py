"""Unit tests of the bit-exact comparator (reference_impl/bitexact.py)."""

from __future__ import annotations

import re

import pytest
import torch

from rlconform.fixtures.values import OUTSIDE_REGISTRY, REGISTRY_DTYPES
from rlconform.reference_impl import bitexact
from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.ranks import _digest


# -- bit-exact comparison ------------------------------------------------------------------------
def _from_bits(values: list[int], dtype=torch.float32) -> torch.Tensor:
    width = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return torch.tensor(values, dtype=torch.int64).to(width[dtype]).view(dtype)


class TestBitExact:
    @pytest.mark.parametrize("want, got, message", [
        (lambda: torch.tensor([1.0, -0.0]), lambda: torch.tensor([1.0, 0.0]),
         r"^1 value differs at the bit level, first at index 1: -0.0 came back \+0.0$"),
        (lambda: _from_bits([0x7FC00001]), lambda: _from_bits([0x7FC00000]),
         r"nan\(0x7fc00001\) came back nan\(0x7fc00000\) \(the NaN payload changed\)"),
        (lambda: torch.tensor([1e-40, 1.0]), lambda: torch.tensor([0.0, 1.0]),
         r"first at index 0: subnormal 9.99994610111476e-41 came back \+0.0 \(flushed to zero\)"),
        (lambda: torch.tensor([[1.0, 2.0], [3.0, 4.0]]), lambda: torch.tensor([[1.0, 2.0],
                                                                              [3.0, 5.0]]),
         r"first at index \(1, 1\): expected 4.0 \(0x40800000\), got 5.0 \(0x40a00000\)$"),
        (lambda: torch.ones(2), lambda: torch.ones(2, dtype=torch.float64),
         r"^dtype torch.float64, expected torch.float32$"),
        (lambda: torch.ones(2, 3), lambda: torch.ones(3, 2), r"^shape \[3, 2\], expected \[2, 3\]$"),
    ], ids=["neg-zero", "nan-payload", "subnormal", "value", "dtype", "shape"])
    def test_messages_say_what_differs(self, want, got, message):
        from rlconform.reference_impl.bitexact import tensor_difference

        why = tensor_difference(want(), got())
        assert why is not None and re.search(message, why), why

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    def test_nan_equals_itself_and_every_payload_counts(self, dtype):
        from rlconform.fixtures.synthetic import special_values
        from rlconform.reference_impl.bitexact import tensor_difference

        v = special_values(dtype)
        assert tensor_difference(v, v.clone()) is None, "a NaN that came back as NaN differs"
        assert not torch.equal(v, v.clone()), "torch.equal would have called this a difference"
        for i in range(v.numel()):
            for j in range(v.numel()):
                if i != j:
                    assert tensor_difference(v[i:i + 1], v[j:j + 1]) is not None, (i, j)

    def test_packed_and_batch_comparisons_are_bit_exact(self):
        a = torch.tensor([[0.0, 1.0]])
        b = torch.tensor([[-0.0, 1.0]])
        why = PackedTensor.from_rows([a]).first_difference(PackedTensor.from_rows([b]))
        assert why and "+0.0 came back -0.0" in why, why
        nan = _from_bits([0x7FC00001, 0x7FC00001])
        batch = Batch({"input_lengths": torch.tensor([1, 1]), "advantages": nan})
        assert batch.first_difference(batch.replace(advantages=nan.clone())) is None
        why = batch.first_difference(batch.replace(advantages=_from_bits([0x7FC00001,
                                                                          0x7FC00000])))
        assert why and why.startswith("field 'advantages': 1 value differs"), why


# -- every bytes view goes through one helper ------------------------------------------------------
_EVERY_DTYPE = sorted({*REGISTRY_DTYPES, *OUTSIDE_REGISTRY, torch.complex128, torch.bool}, key=str)


def _one_element_views(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One-element tensors whose stride is not 1: `.contiguous()`, `.reshape(-1)` and `.clone()`
    keep such a stride, and a view as another width refuses it."""
    base = torch.arange(12).reshape(3, 4).to(dtype)
    return {"every other row": base[:, 0][::2][1:], "column": base[1:2, 2],
            "transposed": base.t()[3:, 1:2], "expanded": base[2, 3].expand(1)}


@pytest.mark.parametrize("dtype", _EVERY_DTYPE, ids=str)
def test_every_bytes_view_takes_one_element_strided_views(dtype):
    """Found by the nightly on the served store; the same `flatten then view` stood in `bits`,
    `describe` and the rank workers' weight digest."""
    for name, view in _one_element_views(dtype).items():
        assert view.numel() == 1, name
        dense = view.clone(memory_format=torch.contiguous_format)
        assert bitexact.as_bytes(view) == dense.view(torch.uint8).numpy().tobytes(), name
        assert bitexact.bits(view).equal(bitexact.bits(dense)), name
        assert bitexact.describe(view, 0) == bitexact.describe(dense, 0), name
        assert bitexact.tensor_difference(dense, view) is None, name
        assert _digest({"w": view}) == _digest({"w": dense}), name
    column = _one_element_views(dtype)["column"]  # 6, or True
    assert _digest({"w": torch.zeros_like(column)}) != _digest({"w": column})
