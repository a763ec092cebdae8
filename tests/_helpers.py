"""Batches, tensors and settings that the tests of the reference core share, and the
noxfile as a module."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings

from rlconform.fixtures.synthetic import RowPlan, build_batch, default_plan, media_families
from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.codec import ReferenceCodec, WireBatch
from rlconform.reference_impl.dataplane import InMemoryDataPlane
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.registry import (
    spec,
)

PROPS = settings(max_examples=25, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ALL_FAMILIES = [*media_families(), "text"]
CODEC = ReferenceCodec()


def f32(*shape, start: float = 0.0) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float32) + start + 1).reshape(shape)


def packed_fields(batch: Batch) -> dict[str, PackedTensor]:
    return {n: v for n, v in batch.fields.items() if isinstance(v, PackedTensor)}


def seq(name: str, v: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Positions start..start+length of a per-token field, on its registered sequence dim."""
    return v.narrow(spec(name).seq_axis(v.dim()), start, length)


def qwen() -> Batch:
    return build_batch("qwen2_vl", default_plan("qwen2_vl"), seed=3)


def through_transport(wire: WireBatch) -> WireBatch:
    dp = InMemoryDataPlane()
    keys = [f"s{i}" for i in range(len(wire))]
    dp.put("rollout", keys, wire.columns, wire.tags)
    cols, tags = dp.get("rollout", keys, list(wire.columns))
    return WireBatch(cols, tags)


def ragged(n: int) -> list[RowPlan]:
    return [RowPlan(1 + (3 * i) % 9, images=[1 + i % 4] * (i % 3), videos=[1 + i % 2] * (i % 2))
            for i in range(n)]


@functools.cache
def load_noxfile():
    """The repository's noxfile as a module, loaded once per process: nox registers its
    sessions on import, and a second registration is an error in coming nox releases."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "noxfile.py"
    spec = importlib.util.spec_from_file_location("rlconform_noxfile", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
