"""Unit tests of the bit-exact comparator (reference_impl/bitexact.py)."""

from __future__ import annotations

import re

import pytest
import torch

from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.packed import PackedTensor


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
