"""Rank mutants: the reference with one data-parallel defect each, for the RANK-* clauses.

In-rank defects live in the trainer the ranks build (the trainer surface, `core_cls` /
data-plane trainer); `rank_meta_keys_only` lives in the meta surface's pickling; the two
`dead_rank_*` in the driver's launcher (`RankGroup`). They are registered with the surface
`transport`, because that is where the RANK-* clauses live (capability `multiprocess`).

`RLCONFORM_RANK_MUTANT_TRANSPORT=<backend>` (e.g. `ray-objectstore`) puts every mutant here on
that backend's transport and session instead of the reference store, so the kill matrix can be
run over a real transport: `RLCONFORM_RANK_MUTANT_TRANSPORT=transferqueue-simple rlconform
mutants --only rank_grad_mean ... -k test_ranks`. Rank processes inherit the variable, so they
compose the same backend.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import wait

import torch

from rlconform.conformance.mutants import mutant
from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.meta import BatchMeta
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.ranks import (
    RankFailed,
    RankGroup,
    _recv,
    dp_max,
    dp_reduce_gradients,
)
from rlconform.reference_impl.registry import Stage
from rlconform.reference_impl.trainer import DataPlaneTrainer, GRPOCore

TRANSPORT_ENV = "RLCONFORM_RANK_MUTANT_TRANSPORT"
SURFACE = "transport"


def _backend(core_cls: type = GRPOCore, dataplane_cls: type = DataPlaneTrainer,
             group_cls: type = RankGroup, meta_cls: type | None = None):
    from rlconform.conformance.backends.reference import build

    class _DP(dataplane_cls):
        pass

    _DP.core_cls = core_cls

    from rlconform.conformance.backends.reference_trainer_rollout import trainer_factory

    parts: dict = {"trainer": trainer_factory(_DP, group_cls)}
    if meta_cls is not None:
        parts["meta"] = lambda: meta_cls
    real = os.environ.get(TRANSPORT_ENV)
    if real:
        from rlconform.conformance.backend import load_backend

        other = load_backend(real)
        parts.update(transport=other.transport, session=other.session,
                     capabilities=other.capabilities,
                     description=f"the reference with a rank defect, on {real}'s transport")
    return build(**parts)


# -- the gradient all-reduce ------------------------------------------------------------------
class _MeanCore(GRPOCore):
    def reduce_gradients(self):
        dp_reduce_gradients(self.model, average=True)  # the defect: DDP's average


@mutant("rank_grad_mean", "the gradient all-reduce averaged over ranks (DDP's default) although "
        "the loss was already divided by the step's token count: every update scaled by "
        "1/world", SURFACE)
def rank_grad_mean():
    return _backend(_MeanCore)


class _NoReduceCore(GRPOCore):
    def reduce_gradients(self):
        pass  # the defect: each rank steps on its own shard's gradient


@mutant("rank_no_allreduce", "no gradient all-reduce: each rank stepped on its own shard's "
        "gradient and the replicas drifted apart", SURFACE)
def rank_no_allreduce():
    return _backend(_NoReduceCore)


class _LocalNormCore(GRPOCore):
    def loss_normalizer(self, shards):
        # the defect: this rank's own token count ...
        return max(1.0, float(sum(int(b["token_mask"].sum()) for b in shards)))

    def reduce_gradients(self):
        dp_reduce_gradients(self.model, average=True)  # ... then the ranks' mean


@mutant("rank_local_normalizer", "each rank divided its loss by its own token count and the "
        "gradients were averaged: right only when every rank holds as many loss tokens, so "
        "with uneven shards the smaller shard's tokens weigh more", SURFACE)
def rank_local_normalizer():
    return _backend(_LocalNormCore)


# -- uneven shards ------------------------------------------------------------------------------
class _DuplicatePad(DataPlaneTrainer):
    def train(self, meta):
        metas = list(meta) if isinstance(meta, (list, tuple)) else [meta]
        n = sum(len(m) for m in metas)
        target = dp_max(n)  # every rank asks: "assume equal shard sizes"
        batches = [self.fetch(m, Stage.TRAIN) for m in metas]
        if 0 < n < target:  # the defect: the short shard repeats its last sample, counted
            last = batches[-1]
            k = len(last)
            batches[-1] = last.select(list(range(k)) + [k - 1] * (target - n))
        return self.core.train(batches)


@mutant("rank_pads_shard_with_duplicate", "ranks assumed equal shard sizes: the smaller shard "
        "was padded with a copy of its last sample, which counted in the loss and the token "
        "count", SURFACE)
def rank_pads_shard_with_duplicate():
    return _backend(dataplane_cls=_DuplicatePad)


# -- what a rank fetches --------------------------------------------------------------------------
class _FullBatch(DataPlaneTrainer):
    def _everything(self, meta):
        keys = list(self.transport.list(meta.partition))
        _cols, tags = self.transport.get(meta.partition, keys, select_fields=["input_lengths"])
        return BatchMeta(meta.partition, keys, list(meta.fields),
                         [int(t["seq_len"]) for t in tags], tags, dict(meta.extra))

    def compute_logprobs(self, meta, stage):
        return super().compute_logprobs(self._everything(meta), stage)

    def train(self, meta):
        metas = list(meta) if isinstance(meta, (list, tuple)) else [meta]
        return super().train([self._everything(m) for m in metas if len(m)])


@mutant("rank_refetches_full_batch", "a rank listed the partition and fetched, scored and "
        "trained on every key of the step instead of its shard (each sample counted world "
        "times)", SURFACE)
def rank_refetches_full_batch():
    return _backend(dataplane_cls=_FullBatch)


class KeysOnlyMeta(BatchMeta):
    """Pickles keys, fields, lengths and extras, but not the per-row tags (the defect)."""

    def _new(self, idx, **kw):
        m = super()._new(idx, **kw)
        return KeysOnlyMeta(m.partition, m.keys, m.fields, m.seq_lens, m.tags, m.extra)

    def __reduce__(self):
        return (KeysOnlyMeta, (self.partition, self.keys, self.fields, self.seq_lens,
                               [{} for _ in self.keys], self.extra))


@mutant("rank_meta_keys_only", "the shard meta sent to a rank pickled only keys, fields and "
        "lengths (a slim wire form): the per-row tags were lost in transit", SURFACE)
def rank_meta_keys_only():
    return _backend(meta_cls=KeysOnlyMeta)


# -- media padding ------------------------------------------------------------------------------
def _pad_rows(v: PackedTensor) -> PackedTensor:
    rows = [v.row(i) for i in range(len(v))]
    present = [r for r in rows if r is not None]
    if not present:
        return v
    longest = max(r.shape[0] for r in present)
    return PackedTensor.from_rows(
        [None if r is None else torch.cat([r, r.new_zeros((longest - r.shape[0], *r.shape[1:]))])
         for r in rows], pack_dim=v.pack_dim)


class _ShardMaxCore(GRPOCore):
    def prepare(self, batch: Batch) -> Batch:
        out = super().prepare(batch)
        # the defect: tiles padded to this rank's shard-wide max, not the micro-batch's
        fields = {n: _pad_rows(v) if isinstance(v, PackedTensor) and v.pack_dim == 1 else v
                  for n, v in out.fields.items()}
        return Batch(fields, out.family, dict(out.extra))


@mutant("rank_pads_media_to_shard_max", "each rank padded its dim-1 media (tiles) to the "
        "longest row of its whole shard: the same sample's input shape depends on the rank "
        "and the sharding", SURFACE)
def rank_pads_media_to_shard_max():
    return _backend(_ShardMaxCore)


# -- the launcher, when a rank dies -------------------------------------------------------------
class _BlameFirstError(RankGroup):
    def _collect(self, what, timeout_s):
        # the defect: wait on the ranks in order and report the first error seen, never
        # checking which rank died (a survivor's collective error blames a healthy rank)
        deadline = time.monotonic() + timeout_s
        replies = []
        for r, conn in enumerate(self._conns):
            while True:
                if not wait([conn], timeout=max(0.0, deadline - time.monotonic())):
                    self._stop_ranks()
                    self._dead = True
                    raise RankFailed(f"{what}: no answer from rank {r} within {timeout_s:g}s")
                try:
                    msg = _recv(conn)
                except (EOFError, OSError):
                    self._stop_ranks()
                    self._dead = True
                    raise RankFailed(f"{what}: lost the connection to rank {r}") from None
                if msg[0] == "stage":
                    continue
                if msg[0] == "error":
                    self._stop_ranks()
                    self._dead = True
                    raise RankFailed(f"{what} failed: rank {r} raised in {msg[1]}: "
                                     f"{msg[2].strip().splitlines()[-1]}")
                replies.append(msg[1])
                break
        return replies


@mutant("dead_rank_blamed_on_survivor", "the driver waited on the ranks in order and reported "
        "the first error it read: a survivor's 'connection closed by peer' from the collective, "
        "not the rank that was killed", SURFACE)
def dead_rank_blamed_on_survivor():
    return _backend(group_cls=_BlameFirstError)


class _LeaveSurvivors(RankGroup):
    def _stop_ranks(self):
        if not self._closed:
            return  # the defect: a failed step raises but leaves the other ranks running
        super()._stop_ranks()


@mutant("dead_rank_leaves_survivors", "a failed step raised a clear error but left the "
        "surviving ranks running (orphans holding their memory until someone kills them)",
        SURFACE)
def dead_rank_leaves_survivors():
    return _backend(group_cls=_LeaveSurvivors)
