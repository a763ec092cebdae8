"""`Batch`: the in-memory form of a rollout batch, and its registry-driven operations.

Every operation asks the registry what a field is. Packed media are never narrowed, padded to a
sequence length or checked against one; per-token fields move in step with `input_ids`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .bitexact import tensor_difference
from .packed import PackedTensor
from .registry import FAMILIES, DtypePolicy, FamilySpec, Kind, Stage, spec

Value = Tensor | PackedTensor


@dataclass
class Batch:
    """Fields by name: per-token `[B, S]` right-padded, per-sample `[B, ...]`, packed media.

    `input_lengths` (`[B]`, int64) holds each row's valid tokens and is required.
    `family` names the FamilySpec (pack dims, dtype exceptions) when media are present.
    """

    fields: dict[str, Value]
    family: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "input_lengths" not in self.fields:
            raise KeyError("batch field 'input_lengths' is required (valid tokens per row)")
        for name in self.fields:
            spec(name)  # an unregistered field is an error here, not a silent drop later

    # -- basic views --------------------------------------------------------------------
    def __getitem__(self, name: str) -> Value:
        try:
            return self.fields[name]
        except KeyError:
            raise KeyError(f"batch has no field {name!r}; it has {sorted(self.fields)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.fields

    @property
    def seq_lens(self) -> Tensor:
        return self.fields["input_lengths"]

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    def __len__(self) -> int:
        return self.batch_size

    @property
    def family_spec(self) -> FamilySpec | None:
        return FAMILIES.get(self.family) if self.family else None

    def names(self, kind: Kind) -> list[str]:
        return [n for n in self.fields if spec(n).kind is kind]

    def seq_len(self) -> int:
        per_token = self.names(Kind.PER_TOKEN)
        return int(self.fields[per_token[0]].shape[1]) if per_token else 0

    def replace(self, **updates: Value) -> Batch:
        new = dict(self.fields)
        new.update(updates)
        return Batch(new, self.family, dict(self.extra))

    def without(self, *names: str) -> Batch:
        return Batch({k: v for k, v in self.fields.items() if k not in names}, self.family,
                     dict(self.extra))

    # -- selection ----------------------------------------------------------------------
    def select(self, indices: Sequence[int] | Tensor) -> Batch:
        idx = torch.as_tensor(list(indices) if not isinstance(indices, Tensor) else indices,
                              dtype=torch.long)
        bad = [int(i) for i in idx if not 0 <= int(i) < self.batch_size]
        if bad:
            raise IndexError(f"row indices {bad} out of range for a batch of {self.batch_size} "
                             f"rows (fields {sorted(self.fields)})")
        out: dict[str, Value] = {}
        for name, v in self.fields.items():
            out[name] = v.select(idx) if isinstance(v, PackedTensor) else v.index_select(
                0, idx.to(v.device))
        return Batch(out, self.family, dict(self.extra))

    def slice(self, start: int, stop: int) -> Batch:
        return self.select(range(*slice(start, stop).indices(self.batch_size)))

    def shard(self, micro_batch_size: int) -> list[Batch]:
        """Consecutive micro-batches of `micro_batch_size` rows (the last may be shorter)."""
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        return [self.slice(i, i + micro_batch_size)
                for i in range(0, self.batch_size, micro_batch_size)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        if not batches:
            raise ValueError("concat needs at least one batch")
        names = set(batches[0].fields)
        for b in batches[1:]:
            if set(b.fields) != names:
                raise KeyError(
                    f"cannot concat batches with fields {sorted(names)} and {sorted(b.fields)}"
                )
        seq = max(b.seq_len() for b in batches)
        batches = [b.pad_to(seq) if b.seq_len() != seq else b for b in batches]
        out: dict[str, Value] = {}
        for name in batches[0].fields:
            vals = [b.fields[name] for b in batches]
            out[name] = (PackedTensor.concat(vals) if isinstance(vals[0], PackedTensor)
                         else torch.cat(vals, dim=0))
        return Batch(out, batches[0].family, dict(batches[0].extra))

    # -- sequence operations ------------------------------------------------------------
    def truncate(self, max_len: int) -> Batch:
        """Narrow per-token fields to `max_len` tokens; packed media stay untouched."""
        if max_len < 0:
            raise ValueError(f"max_len must be >= 0, got {max_len}")
        out: dict[str, Value] = {}
        for name, v in self.fields.items():
            kind = spec(name).kind
            if kind is Kind.PER_TOKEN:
                out[name] = v[:, :max_len]
            elif name == "input_lengths":
                out[name] = v.clamp(max=max_len)
            else:
                out[name] = v
        return Batch(out, self.family, dict(self.extra))

    def pad_to(self, seq_len: int) -> Batch:
        """Right-pad per-token fields to `seq_len` with the registry's pad value."""
        out: dict[str, Value] = {}
        for name, v in self.fields.items():
            fs = spec(name)
            if fs.kind is Kind.PER_TOKEN and v.shape[1] < seq_len:
                pad = v.new_full((v.shape[0], seq_len - v.shape[1], *v.shape[2:]), fs.pad_value)
                out[name] = torch.cat([v, pad], dim=1)
            else:
                out[name] = v
        return Batch(out, self.family, dict(self.extra))

    def validate(self) -> None:
        """The sequence-dim validator: rows agree, per-token fields share one S >= max length.

        Packed fields are exempt from the sequence check: their dim 1 is patches or images.
        """
        b = self.batch_size
        lens = self.seq_lens
        if lens.dim() != 1:
            raise ValueError(f"field 'input_lengths' must be 1-D [B], got {list(lens.shape)}")
        seq = None
        for name, v in self.fields.items():
            fs = spec(name)
            if fs.dtypes and v.dtype is not None and v.dtype not in fs.dtypes:
                raise TypeError(
                    f"field {name!r} has dtype {v.dtype}; allowed: {[str(d) for d in fs.dtypes]}"
                )
            rows = len(v) if isinstance(v, PackedTensor) else int(v.shape[0])
            if rows != b:
                raise ValueError(f"field {name!r} has {rows} rows, expected {b} (batch size)")
            if fs.kind is Kind.PER_TOKEN:
                if v.dim() < 2:
                    raise ValueError(f"per-token field {name!r} must be [B, S], got "
                                     f"{list(v.shape)}")
                if seq is None:
                    seq = int(v.shape[1])
                if int(v.shape[1]) != seq:
                    raise ValueError(
                        f"per-token field {name!r} has sequence dim {v.shape[1]}, "
                        f"expected {seq} like the other per-token fields"
                    )
        if seq is not None and b and int(lens.max()) > seq:
            raise ValueError(f"field 'input_lengths' has max {int(lens.max())} > sequence dim {seq}")
        self._check_coupled()

    def _check_coupled(self) -> None:
        packed = {n: v for n, v in self.fields.items() if isinstance(v, PackedTensor)}
        for name, v in packed.items():
            for other in spec(name).coupled:
                w = packed.get(other)
                if w is None:
                    continue
                for i in range(len(v)):
                    if v.is_none(i) != w.is_none(i):
                        raise ValueError(
                            f"row {i}: field {name!r} is "
                            f"{'None' if v.is_none(i) else 'present'} but coupled field "
                            f"{other!r} is {'None' if w.is_none(i) else 'present'}"
                        )

    # -- model inputs -------------------------------------------------------------------
    def multimodal_inputs(self, stage: Stage, dtype: torch.dtype | None = None
                          ) -> dict[str, Tensor]:
        """Exactly the registered multimodal fields present that `stage` consumes.

        Packed fields become model-input tensors here (padding to the batch max only here); a
        field with no media in any row is left out, as the legacy path passes None.
        """
        fam = self.family_spec
        out: dict[str, Tensor] = {}
        for name, v in self.fields.items():
            fs = spec(name)
            if not fs.multimodal or stage not in fs.stages:
                continue
            t = v.as_tensor() if isinstance(v, PackedTensor) else v
            if t is None:
                continue
            keep = fam is not None and name in fam.keep_dtype
            if dtype is not None and fs.dtype_policy is DtypePolicy.POLICY and not keep \
                    and t.is_floating_point():
                t = t.to(dtype)
            out[name] = t
        return out

    def multimodal_field_names(self, stage: Stage | None = None) -> list[str]:
        return [n for n in self.fields if spec(n).multimodal
                and (stage is None or stage in spec(n).stages)]

    # -- comparison ---------------------------------------------------------------------
    def first_difference(self, other: Batch, names: Iterable[str] | None = None) -> str | None:
        """Why `other` differs (missing field, dtype, shape, bits, rows), or None."""
        names = list(self.fields) if names is None else list(names)
        missing = [n for n in names if n not in other.fields]
        if missing:
            return f"fields {missing} missing"
        extra = sorted(set(other.fields) - set(self.fields)) if names is None else []
        if extra:
            return f"unexpected fields {extra}"
        for n in names:
            a, b = self.fields[n], other.fields[n]
            if isinstance(a, PackedTensor) or isinstance(b, PackedTensor):
                if not (isinstance(a, PackedTensor) and isinstance(b, PackedTensor)):
                    return f"field {n!r}: {type(b).__name__}, expected {type(a).__name__}"
                why = a.first_difference(b)
                if why:
                    return f"field {n!r}: {why}"
                continue
            why = tensor_difference(a, b)
            if why:
                return f"field {n!r}: {why}"
        return None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Batch):
            return NotImplemented
        return self.first_difference(other) is None and set(self.fields) == set(other.fields)

    __hash__ = None  # type: ignore[assignment]

    def media_nbytes(self) -> int:
        return sum(v.nbytes() for v in self.fields.values() if isinstance(v, PackedTensor))


class BatchOps:
    """The `batch_ops` surface of the reference: the operations above, as one object.

    A backend with its own truncation, padding or validation provides an object with these
    four methods; the BATCH clauses exercise it.
    """

    name = "reference"

    def truncate(self, batch: Batch, max_len: int) -> Batch:
        return batch.truncate(max_len)

    def pad_to(self, batch: Batch, seq_len: int) -> Batch:
        return batch.pad_to(seq_len)

    def validate(self, batch: Batch) -> None:
        batch.validate()

    def multimodal_inputs(self, batch: Batch, stage: Stage, dtype: torch.dtype | None = None
                          ) -> dict[str, Tensor]:
        return batch.multimodal_inputs(stage, dtype)
