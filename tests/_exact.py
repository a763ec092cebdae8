"""Helpers the suite's own tests share: jagged tensors and exact tensor equality."""

from __future__ import annotations

import torch


def nt(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def same(want: torch.Tensor, got: torch.Tensor) -> bool:
    """Exact equality including layout, dtype, shape and row boundaries."""
    if want.is_nested != got.is_nested or want.dtype != got.dtype:
        return False
    if want.is_nested:
        a, b = want.unbind(), got.unbind()
        return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y)
                                        for x, y in zip(a, b))
    return want.shape == got.shape and torch.equal(want, got)
