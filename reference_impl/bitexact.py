"""Bit-exact tensor comparison: the one comparator every clause and `first_difference` uses.

`torch.equal` compares values: NaN never equals NaN (so a NaN that came back as NaN is reported
as a difference, and a test must special-case it) and -0.0 equals +0.0 (so a store that lost the
sign of zero passes). Data planes and codecs move bytes: what comes back must be the bytes that
went in. `tensor_difference` compares dtype, shape and the raw bits (a same-width integer view),
and says what differs in words: "3 values differ at the bit level, first at index 5: expected
nan(0x7fc00001), got nan(0x7fc00000)" or "-0.0 came back +0.0".
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flat(t: Tensor) -> Tensor:
    """`t` on the CPU, flattened, with the contiguous format's strides, so that it can be viewed
    as another dtype or as bytes.

    A one-element view with a stride (a row of `x[::2]`) counts as contiguous: `.contiguous()`,
    `.reshape(-1)` and a plain `.clone()` keep its stride, and a view as another width then
    fails. Every bytes view in the reference goes through here."""
    out = t.detach().cpu().reshape(-1)
    if out.numel() and out.stride(0) != 1:
        out = out.clone(memory_format=torch.contiguous_format)
    return out


def as_bytes(t: Tensor) -> bytes:
    """The raw bytes of `t`, flattened in row-major order."""
    out = flat(t)
    return out.view(torch.uint8).numpy().tobytes() if out.numel() else b""


def bits(t: Tensor) -> Tensor:
    """The raw bits of `t`, flattened: one same-width integer per element (bytes for odd widths)."""
    f = flat(t)
    width = f.element_size()
    if width in _SAME_WIDTH:
        return f.view(_SAME_WIDTH[width])
    return f.view(torch.uint8).reshape(-1, width)  # e.g. complex128: compare byte rows


def _hex(b: Tensor, width: int) -> str:
    mask = (1 << (8 * width)) - 1
    if b.dim() == 0:
        return f"0x{int(b.item()) & mask:0{2 * width}x}"
    return "0x" + "".join(f"{int(x):02x}" for x in reversed(b.tolist()))


def describe(t: Tensor, i: int) -> str:
    """Element `i` of `t` (flattened) in words that show what a value comparison hides."""
    f = flat(t)
    width = f.element_size()
    raw = _hex(bits(f)[i], width)
    if not f.is_floating_point():
        if f.is_complex():
            return f"{complex(f[i].item())} ({raw})"
        return f"{f[i].item()}"
    v = float(f[i].item())
    if math.isnan(v):
        return f"nan({raw})"
    if math.isinf(v):
        return "+inf" if v > 0 else "-inf"
    if v == 0.0:
        return "-0.0" if math.copysign(1.0, v) < 0 else "+0.0"
    if abs(v) < torch.finfo(f.dtype).smallest_normal:
        return f"{v!r} (subnormal {raw})"
    return f"{v!r} ({raw})"


def _index(shape: torch.Size, i: int) -> str:
    if len(shape) <= 1:
        return str(i)
    idx = []
    for d in reversed(shape):
        idx.append(i % d)
        i //= d
    return "(" + ", ".join(str(x) for x in reversed(idx)) + ")"


def tensor_difference(want: Tensor, got: Tensor) -> str | None:
    """Why `got` is not bit for bit `want` (dtype, shape, raw bits), or None when identical.

    The message names the first differing element in the words a value comparison hides:
    "-0.0 came back +0.0", "nan(0x7fc00001) came back nan(0x7fc00000)", a flushed subnormal.
    """
    if not isinstance(got, Tensor):
        return f"a {type(got).__name__}, not a tensor"
    if want.dtype != got.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if want.shape != got.shape:
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    a, b = bits(want), bits(got)
    if torch.equal(a, b):  # integers: equal values are equal bits (the common case, fast)
        return None
    diff = a != b
    if diff.dim() > 1:
        diff = diff.any(dim=1)
    n = int(diff.sum())
    if n == 0:
        return None
    first = int(diff.nonzero()[0, 0])
    was, now = describe(want, first), describe(got, first)
    where = f"first at index {_index(want.shape, first)}"
    if was in ("-0.0", "+0.0") and now in ("-0.0", "+0.0"):
        what = f"{was} came back {now}"
    elif was.startswith("nan(") and now.startswith("nan("):
        what = f"{was} came back {now} (the NaN payload changed)"
    elif "subnormal" in was and now in ("-0.0", "+0.0"):
        what = f"subnormal {was.split(' ')[0]} came back {now} (flushed to zero)"
    else:
        what = f"expected {was}, got {now}"
    plural = "value differs" if n == 1 else "values differ"
    return f"{n} {plural} at the bit level, {where}: {what}"


def bit_equal(want: Tensor, got: Tensor) -> bool:
    return tensor_difference(want, got) is None
