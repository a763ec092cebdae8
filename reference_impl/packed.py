"""`PackedTensor`: a jagged multimodal field, one logical row per sample.

Media fields are never sequence-aligned: a sample has zero or more images, each a segment whose
dim 0 counts patches, images or tiles. A `PackedTensor` keeps the physical segments once and maps
each logical row to a tuple of segment indices (or `None` for a text-only sample), so several
rows may share a segment (media de-duplication). Padding to a common shape happens only in
`as_tensor()`, which builds the model-input tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .bitexact import tensor_difference

Row = tuple[int, ...] | None


class PackedTensor:
    """Logical rows over shared physical segments.

    pack_dim 0: the model input is every present row's segments concatenated on dim 0
    (Qwen-VL flattened patches `[sum(t*h*w), C*T*P*P]`, Gemma3 images `[n_images, 3, H, W]`).
    pack_dim 1: the model input stacks rows, padding each row's dim 0 to the batch max, so the
    jagged dimension is dim 1 (Idefics3/SmolVLM tiles `[B, tiles, 3, H, W]`).
    """

    __slots__ = ("segments", "rows", "pack_dim")

    def __init__(self, segments: Sequence[Tensor], rows: Sequence[Row], pack_dim: int = 0):
        if pack_dim not in (0, 1):
            raise ValueError(f"pack_dim must be 0 or 1, got {pack_dim}")
        self.segments = list(segments)
        self.rows = [None if r is None else tuple(int(i) for i in r) for r in rows]
        self.pack_dim = pack_dim
        self._check()

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[Tensor] | Tensor | None], pack_dim: int = 0):
        """Build from per-row lists of segments (a bare tensor is one segment, `None` no media)."""
        segments: list[Tensor] = []
        index: list[Row] = []
        for row in rows:
            if row is None:
                index.append(None)
                continue
            segs = [row] if isinstance(row, Tensor) else list(row)
            index.append(tuple(range(len(segments), len(segments) + len(segs))))
            segments.extend(segs)
        return cls(segments, index, pack_dim)

    def _check(self) -> None:
        dtypes = {s.dtype for s in self.segments}
        if len(dtypes) > 1:
            raise TypeError(f"PackedTensor segments mix dtypes {sorted(map(str, dtypes))}")
        ndims = {s.dim() for s in self.segments}
        if len(ndims) > 1 or 0 in ndims:
            raise ValueError(
                f"PackedTensor segments need one rank >= 1, got ranks {sorted(ndims)}"
            )
        n = len(self.segments)
        for i, row in enumerate(self.rows):
            if row is not None and any(not 0 <= j < n for j in row):
                raise IndexError(f"row {i} names segment indices {row} outside 0..{n - 1}")

    # -- views ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    @property
    def dtype(self) -> torch.dtype | None:
        return self.segments[0].dtype if self.segments else None

    @property
    def device(self) -> torch.device | None:
        return self.segments[0].device if self.segments else None

    def is_none(self, i: int) -> bool:
        return self.rows[i] is None

    def row_segments(self, i: int) -> list[Tensor] | None:
        row = self.rows[i]
        return None if row is None else [self.segments[j] for j in row]

    def row(self, i: int) -> Tensor | None:
        """Row i's segments concatenated on dim 0, or `None`; raises on differing trailing dims."""
        segs = self.row_segments(i)
        if segs is None:
            return None
        if not segs:
            raise ValueError(f"row {i} has an empty segment list; use None for no media")
        return torch.cat(segs, dim=0) if len(segs) > 1 else segs[0]

    def segment_shapes(self, i: int) -> list[list[int]] | None:
        segs = self.row_segments(i)
        return None if segs is None else [list(s.shape) for s in segs]

    def is_deduplicated(self) -> bool:
        used = [j for r in self.rows if r is not None for j in r]
        return len(used) != len(set(used))

    def nbytes(self) -> int:
        """Bytes of the logical rows (shared segments counted once per row that uses them)."""
        return sum(
            self.segments[j].numel() * self.segments[j].element_size()
            for r in self.rows
            if r is not None
            for j in r
        )

    # -- batch operations ---------------------------------------------------------------
    def select(self, indices: Sequence[int] | Tensor) -> PackedTensor:
        """Rows `indices` in that order; segments stay shared, not copied."""
        if isinstance(indices, Tensor):
            indices = indices.tolist()
        n = len(self.rows)
        for i in indices:
            if not 0 <= i < n:
                raise IndexError(f"row index {i} out of range for {n} rows")
        return self._compact([self.rows[i] for i in indices])

    def slice(self, start: int, stop: int) -> PackedTensor:
        return self.select(range(*slice(start, stop).indices(len(self.rows))))

    def _compact(self, rows: list[Row]) -> PackedTensor:
        remap: dict[int, int] = {}
        segments: list[Tensor] = []
        new_rows: list[Row] = []
        for r in rows:
            if r is None:
                new_rows.append(None)
                continue
            out = []
            for j in r:
                if j not in remap:
                    remap[j] = len(segments)
                    segments.append(self.segments[j])
                out.append(remap[j])
            new_rows.append(tuple(out))
        return PackedTensor(segments, new_rows, self.pack_dim)

    @staticmethod
    def concat(parts: Sequence[PackedTensor]) -> PackedTensor:
        if not parts:
            raise ValueError("concat needs at least one PackedTensor")
        pack_dims = {p.pack_dim for p in parts}
        if len(pack_dims) > 1:
            raise ValueError(f"cannot concat PackedTensors with pack_dims {sorted(pack_dims)}")
        segments: list[Tensor] = []
        rows: list[Row] = []
        for p in parts:
            off = len(segments)
            segments.extend(p.segments)
            rows.extend(None if r is None else tuple(j + off for j in r) for r in p.rows)
        return PackedTensor(segments, rows, parts[0].pack_dim)

    def to_dtype(self, dtype: torch.dtype) -> PackedTensor:
        """Cast floating segments; integer geometry (grids, sizes) is never cast."""
        segs = [s.to(dtype) if s.is_floating_point() else s for s in self.segments]
        return PackedTensor(segs, self.rows, self.pack_dim)

    def to(self, device: torch.device | str) -> PackedTensor:
        return PackedTensor([s.to(device) for s in self.segments], self.rows, self.pack_dim)

    def clone(self) -> PackedTensor:
        return PackedTensor([s.clone() for s in self.segments], self.rows, self.pack_dim)

    def pad_to_max_shape(self) -> PackedTensor:
        """Zero-pad every segment's trailing dims to the max over segments (dim 0 kept)."""
        if not self.segments:
            return self
        trailing = [list(s.shape[1:]) for s in self.segments]
        target = [max(d) for d in zip(*trailing)]
        segs = []
        for s in self.segments:
            pad: list[int] = []
            for have, want in zip(reversed(s.shape[1:]), reversed(target)):
                pad += [0, want - have]
            segs.append(torch.nn.functional.pad(s, pad) if any(pad) else s)
        return PackedTensor(segs, self.rows, self.pack_dim)

    def as_tensor(self) -> Tensor | None:
        """The model-input tensor; `None` when no row has media (legacy gives None too)."""
        present = [i for i, r in enumerate(self.rows) if r is not None]
        if not present:
            return None
        src = self
        if len({tuple(s.shape[1:]) for s in self.segments}) > 1:
            src = self.pad_to_max_shape()
        if self.pack_dim == 0:
            return torch.cat([src.row(i) for i in present], dim=0)
        rows = [src.row(i) for i in range(len(self.rows))]
        ref = next(r for r in rows if r is not None)
        longest = max(r.shape[0] for r in rows if r is not None)
        out = ref.new_zeros((len(rows), longest, *ref.shape[1:]))
        for i, r in enumerate(rows):
            if r is not None:
                out[i, : r.shape[0]] = r
        return out

    # -- comparison ---------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedTensor):
            return NotImplemented
        return self.first_difference(other) is None

    __hash__ = None  # type: ignore[assignment]

    def first_difference(self, other: PackedTensor) -> str | None:
        """Why `other` differs logically (None-ness, segment shapes, dtype, bits), or None."""
        if len(self) != len(other):
            return f"{len(other)} rows, expected {len(self)}"
        if self.pack_dim != other.pack_dim:
            return f"pack_dim {other.pack_dim}, expected {self.pack_dim}"
        if self.segments and other.segments and self.dtype != other.dtype:
            return f"dtype {other.dtype}, expected {self.dtype}"
        for i in range(len(self)):
            a, b = self.row_segments(i), other.row_segments(i)
            if (a is None) != (b is None):
                return f"row {i} is {'None' if b is None else 'present'}, expected the opposite"
            if a is None:
                continue
            if [list(s.shape) for s in a] != [list(s.shape) for s in b]:
                return (
                    f"row {i} segment shapes {[list(s.shape) for s in b]}, "
                    f"expected {[list(s.shape) for s in a]}"
                )
            for k, (x, y) in enumerate(zip(a, b)):
                why = tensor_difference(x, y)
                if why:
                    return f"row {i} segment {k}: {why}"
        return None

    def __repr__(self) -> str:
        shapes = [self.segment_shapes(i) for i in range(min(len(self), 4))]
        more = ", ..." if len(self) > 4 else ""
        return (
            f"PackedTensor(rows={len(self)}, segments={len(self.segments)}, dtype={self.dtype}, "
            f"pack_dim={self.pack_dim}, shapes={shapes}{more})"
        )
