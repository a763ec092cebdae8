"""Meta mutants: BatchMeta with one defect in its tag or sharding algebra."""

from __future__ import annotations

import copy

from rlconform.conformance.backends.reference import build
from rlconform.reference_impl.meta import BatchMeta

from . import mutant


def _with(cls):
    return lambda: build(meta=lambda: cls)


@mutant("dp_shard_drops_tags", "metadata sharding for data parallelism dropped per-row tags",
        "meta")
def _shard_tags():
    class M(BatchMeta):
        def shard_for_dp(self, world):
            shards, inverse = super().shard_for_dp(world)
            for s in shards:
                s.tags = [{} for _ in s.keys]
            return shards, inverse

    return _with(M)()


@mutant("dp_shard_duplicates_key", "sharding rounded up: the last row also went to the first "
        "rank (trained twice)", "meta")
def _shard_dup():
    class M(BatchMeta):
        def shard_for_dp(self, world):
            shards, inverse = super().shard_for_dp(world)
            if world > 1 and len(self) > world and self.keys[-1] not in shards[0].keys:
                extra = self.subset([len(self) - 1])
                shards[0] = BatchMeta.concat([shards[0], extra])
                shards[0].extra = {**shards[0].extra}
            return shards, inverse

    return _with(M)()


@mutant("dp_shard_bad_inverse", "the inverse permutation was the forward one (restored order "
        "is scrambled)", "meta")
def _shard_inverse():
    class M(BatchMeta):
        def shard_for_dp(self, world):
            shards, inverse = super().shard_for_dp(world)
            forward = [0] * len(inverse)
            for i, pos in enumerate(inverse):
                forward[pos] = i
            return shards, forward

    return _with(M)()


@mutant("meta_subset_drops_tags", "subset carried keys but not their tags", "meta")
def _subset_tags():
    class M(BatchMeta):
        def subset(self, indices):
            out = super().subset(indices)
            out.tags = [{} for _ in out.keys]
            return out

    return _with(M)()


@mutant("meta_concat_misaligns_tags", "concat joined the tags in the wrong order", "meta")
def _concat_tags():
    class M(BatchMeta):
        @staticmethod
        def concat(metas):
            out = BatchMeta.concat(list(metas))
            tags = [t for m in reversed(list(metas)) for t in m.tags]
            return M(out.partition, out.keys, out.fields, out.seq_lens, tags, out.extra)

    return _with(M)()


@mutant("meta_shares_tag_dicts", "subset and slice shared tag dicts with the parent meta",
        "meta")
def _shared_tags():
    class M(BatchMeta):
        def _new(self, idx, **kw):
            out = super()._new(idx, **kw)
            out.tags = [self.tags[i] for i in idx]
            return out

    return _with(M)()


@mutant("meta_drops_none_tag_values", "subset compacted each row's tag, dropping None-valued "
        "entries: a text-only row's object-column tag vanished", "meta")
def _drop_none_tags():
    class M(BatchMeta):
        def _new(self, idx, **kw):
            out = super()._new(idx, **kw)
            out.tags = [{k: v for k, v in t.items() if v is not None} for t in out.tags]
            return out

    return _with(M)()


# -- inputs never modified (META-INPUT-INTACT) ---------------------------------------------------
@mutant("meta_concat_updates_first_extra", "concat merged every meta's extras into the first "
        "meta's own extra dict (extra = metas[0].extra; extra.update(...)) and returned a copy",
        "meta")
def _concat_extra():
    class M(BatchMeta):
        @staticmethod
        def concat(metas):
            metas = list(metas)
            out = BatchMeta.concat(metas)
            merged = metas[0].extra
            for m in metas[1:]:
                merged.update(m.extra)
            return M(out.partition, out.keys, out.fields, out.seq_lens, out.tags,
                     copy.deepcopy(merged))

    return _with(M)()


@mutant("dp_shard_stamps_caller_tags", "DP sharding recorded each row's rank in the caller's tag "
        "dicts (and in the shards'): the driver's meta now carries this step's assignment",
        "meta")
def _stamp_caller():
    class M(BatchMeta):
        def shard_for_dp(self, world):
            shards, inverse = super().shard_for_dp(world)
            index = {k: i for i, k in enumerate(self.keys)}
            for rank, s in enumerate(shards):
                for k, t in zip(s.keys, s.tags):
                    t["dp_rank"] = rank
                    self.tags[index[k]]["dp_rank"] = rank
            return shards, inverse

    return _with(M)()


# -- no aliasing (META-NO-ALIAS) -----------------------------------------------------------------
@mutant("meta_concat_shares_tags", "concat joined the parts' tag lists without copying them: the "
        "joined meta's tag dicts are the parts' own", "meta")
def _concat_shares():
    class M(BatchMeta):
        @staticmethod
        def concat(metas):
            metas = list(metas)
            out = BatchMeta.concat(metas)
            return M(out.partition, out.keys, out.fields, out.seq_lens,
                     [t for m in metas for t in m.tags], out.extra)

    return _with(M)()


@mutant("dp_shard_copies_tags_shallowly", "DP shards copied each tag dict one level deep "
        "(dict(tag)): the nested shapes and object-column entries are the driver's own",
        "meta")
def _shallow_shards():
    class M(BatchMeta):
        def shard_for_dp(self, world):
            shards, inverse = super().shard_for_dp(world)
            index = {k: i for i, k in enumerate(self.keys)}
            for s in shards:
                s.tags = [dict(self.tags[index[k]]) for k in s.keys]
            return shards, inverse

    return _with(M)()


# -- merges by value (META-MERGE-BY-VALUE) -------------------------------------------------------
@mutant("meta_concat_compares_by_identity", "concat checked that the metas share a partition "
        "with `is`: a meta whose partition name came back from another process is refused",
        "meta")
def _concat_identity():
    class M(BatchMeta):
        @staticmethod
        def concat(metas):
            metas = list(metas)
            for m in metas[1:]:
                if m.partition is not metas[0].partition:
                    raise ValueError(f"cannot concat metas of partitions {metas[0].partition!r} "
                                     f"and {m.partition!r}")
            return BatchMeta.concat(metas)

    return _with(M)()


@mutant("dp_shards_share_fields", "shard_for_dp gave every rank's meta one fields list: a rank "
        "that records a field it added in place records it for every rank", "meta")
def _shards_share_fields():
    class M(BatchMeta):
        def shard_for_dp(self, world):
            shards, inverse = super().shard_for_dp(world)
            for s in shards[1:]:
                s.fields = shards[0].fields
            return shards, inverse

    return _with(M)()
