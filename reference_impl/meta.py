"""`BatchMeta`: what the driver holds instead of the bulk columns.

Keys are minted once per sample; the meta carries keys, field names, sequence lengths and the
per-row tags (segment shapes of flattened media) that every consumer needs to rebuild the batch.
Every operation keeps tags 1:1 with keys: a DP shard that dropped them left ranks unable to
rebuild flattened media (BACKGROUND.md section 3).
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from .dataplane import copy_tags


@dataclass
class BatchMeta:
    partition: str
    keys: list[str]
    fields: list[str]
    seq_lens: list[int]
    tags: list[dict]
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.keys)
        if len(set(self.keys)) != n:
            dup = sorted({k for k in self.keys if self.keys.count(k) > 1})
            raise ValueError(f"meta keys must be unique; duplicated: {dup}")
        if len(self.seq_lens) != n:
            raise ValueError(f"meta has {n} keys but {len(self.seq_lens)} seq_lens")
        if len(self.tags) != n:
            raise ValueError(f"meta has {n} keys but {len(self.tags)} tags; tags are 1:1 with keys")
        self.keys = list(self.keys)
        self.fields = list(dict.fromkeys(self.fields))
        self.seq_lens = [int(s) for s in self.seq_lens]

    def __len__(self) -> int:
        return len(self.keys)

    def _new(self, idx: Sequence[int], **kw) -> BatchMeta:
        # type(self): a backend's subclass survives every operation (subset of a subset, ...)
        return type(self)(
            kw.get("partition", self.partition),
            [self.keys[i] for i in idx],
            list(kw.get("fields", self.fields)),
            [self.seq_lens[i] for i in idx],
            copy_tags([self.tags[i] for i in idx]),  # deep, per row, pickle-fast
            copy.deepcopy(self.extra),
        )

    def subset(self, indices: Sequence[int]) -> BatchMeta:
        n = len(self.keys)
        for i in indices:
            if not 0 <= i < n:
                raise IndexError(f"meta index {i} out of range for {n} keys")
        return self._new(list(indices))

    def slice(self, start: int, stop: int) -> BatchMeta:
        return self._new(range(*slice(start, stop).indices(len(self.keys))))

    @staticmethod
    def concat(metas: Sequence[BatchMeta]) -> BatchMeta:
        if not metas:
            raise ValueError("concat needs at least one meta")
        first = metas[0]
        for m in metas[1:]:
            if m.partition != first.partition:
                raise ValueError(f"cannot concat metas of partitions {first.partition!r} and "
                                 f"{m.partition!r}")
            if set(m.fields) != set(first.fields):
                raise ValueError(f"cannot concat metas with fields {first.fields} and {m.fields}")
        extra: dict = {}
        for m in metas:
            extra.update(copy.deepcopy(m.extra))
        return type(first)(
            first.partition,
            [k for m in metas for k in m.keys],
            list(first.fields),
            [s for m in metas for s in m.seq_lens],
            copy_tags([t for m in metas for t in m.tags]),
            extra,
        )

    def drop(self, *names: str) -> BatchMeta:
        missing = [n for n in names if n not in self.fields]
        if missing:
            raise KeyError(f"meta has no fields {missing} to drop; it has {self.fields}")
        return self._new(range(len(self)), fields=[f for f in self.fields if f not in names])

    def with_fields(self, *names: str) -> BatchMeta:
        return self._new(range(len(self)), fields=self.fields + list(names))

    def stamp_tags(self, tags: Sequence[dict] | dict) -> BatchMeta:
        """Merge `tags` (one dict for every row, or one per row) into each row's tag."""
        per_row = [tags] * len(self) if isinstance(tags, dict) else list(tags)
        if len(per_row) != len(self):
            raise ValueError(f"stamp_tags got {len(per_row)} tags for {len(self)} keys")
        out = self._new(range(len(self)))
        for t, new in zip(out.tags, per_row):
            t.update(copy.deepcopy(new))
        return out

    def shard_for_dp(self, world: int) -> tuple[list[BatchMeta], list[int]]:
        """Length-balanced, disjoint, covering shards, and the inverse permutation.

        Rows go longest first to the rank with the fewest tokens among ranks that still have
        room (sizes differ by at most one). `inverse[i]` is the position of original row i in the
        concatenation of the shards, so `concat(shards).subset(inverse)` restores the order.
        """
        if world <= 0:
            raise ValueError(f"world size must be positive, got {world}")
        n = len(self)
        cap = [n // world + (1 if r < n % world else 0) for r in range(world)]
        heap = [(0, r) for r in range(world)]
        members: list[list[int]] = [[] for _ in range(world)]
        order = sorted(range(n), key=lambda i: (-self.seq_lens[i], i))
        for i in order:
            parked = []
            while True:
                tokens, r = heapq.heappop(heap)
                if len(members[r]) < cap[r]:
                    break
                parked.append((tokens, r))
            members[r].append(i)
            heapq.heappush(heap, (tokens + self.seq_lens[i], r))
            for p in parked:
                heapq.heappush(heap, p)
        for m in members:
            m.sort()  # keep the original order inside a shard
        shards = [self._new(m) for m in members]
        for rank, s in enumerate(shards):
            s.extra = {**s.extra, "dp_rank": rank, "dp_world": world}
        flat = [i for m in members for i in m]
        inverse = [0] * n
        for pos, i in enumerate(flat):
            inverse[i] = pos
        return shards, inverse
