"""The driver side of one synchronous GRPO step, on the data plane and in memory.

`dataplane_step` follows BACKGROUND.md section 1: the rollout write (codec.encode +
transport.put under keys `<uid>_g<i>` minted once), the driver holds only the meta, computes
group-normalized advantages and puts them as a column, each data-parallel shard
(`meta.shard_for_dp`) computes prev and reference logprobs, one optimizer step trains on all
shards, and the step ends by clearing its keys. `legacy_step` does the same with the batch in
driver memory and the same shards, so the two are comparable bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .batch import Batch
from .meta import BatchMeta
from .registry import Stage
from .trainer import StepResult

ADV_EPS = 1e-6


@dataclass
class StepOutcome:
    loss: float
    metrics: dict[str, Tensor]
    grad_norm: float
    state_dict: dict[str, Tensor]
    advantages: Tensor
    shards: list[list[int]]  # batch row indices per data-parallel rank
    extra: dict = field(default_factory=dict)

    @classmethod
    def of(cls, result: StepResult, trainer, advantages: Tensor, shards, **extra):
        return cls(result.loss, result.metrics, result.grad_norm, trainer.state_dict(),
                   advantages, shards, {**result.extra, **extra})


def group_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """(r - group mean) / (group std + eps) over consecutive groups of `group_size` rows."""
    r = rewards.detach().to(torch.float32).flatten()
    if group_size <= 0 or r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size}")
    g = r.view(-1, group_size)
    std = g.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(g[:, :1])
    return ((g - g.mean(dim=1, keepdim=True)) / (std + ADV_EPS)).flatten()


def mint_keys(n: int, group_size: int = 1, uid: str = "uid") -> list[str]:
    """Per-sample keys `<uid>_g<i>`: one uid per prompt group, i the sample in its group."""
    return [f"{uid}{i // group_size}_g{i % group_size}" for i in range(n)]


def _advantages(batch: Batch, rewards, advantages, group_size: int) -> Tensor:
    if advantages is not None:
        return torch.as_tensor(advantages, dtype=torch.float32).flatten().clone()
    if rewards is None:
        if "rewards" not in batch:
            raise ValueError("give rewards or advantages (or a batch with a 'rewards' field)")
        rewards = batch["rewards"]
    return group_advantages(torch.as_tensor(rewards), group_size)


def dp_rows(seq_lens: Sequence[int], world: int, meta_cls=BatchMeta) -> list[list[int]]:
    """Row indices of each data-parallel shard, exactly as `meta.shard_for_dp` assigns them."""
    n = len(seq_lens)
    probe = meta_cls("rows", [str(i) for i in range(n)], [], list(seq_lens), [{} for _ in
                                                                              range(n)])
    shards, _ = probe.shard_for_dp(world)
    return [[int(k) for k in s.keys] for s in shards]


def write_rollout(batch: Batch, transport, codec, meta_cls, partition: str,
                  keys: Sequence[str]):
    """The rollout write: encode, put every column with its tags, hand the driver a meta."""
    wire = codec.encode(batch)
    transport.put(partition, list(keys), wire.columns, wire.tags)
    return meta_cls(partition, list(keys), list(wire.columns), batch.seq_lens.tolist(),
                    wire.tags)


def put_advantages(batch: Batch, adv: Tensor, transport, codec, meta, partition: str,
                   keys: list[str]):
    """The driver's write after the rollout: the advantages column under the step's keys;
    returns the meta that lists it."""
    col = codec.encode(Batch({"input_lengths": batch.seq_lens, "advantages": adv}))
    transport.put(partition, keys, {"advantages": col.columns["advantages"]})
    return meta.with_fields("advantages")


def shard_rows(keys: list[str], shards) -> list[list[int]]:
    """Each shard's rows as positions in the step's batch."""
    index = {k: i for i, k in enumerate(keys)}
    return [[index[k] for k in s.keys] for s in shards]


def dataplane_step(batch: Batch, trainer, transport, codec, meta_cls=BatchMeta,
                   partition: str = "step0", *, rewards=None, advantages=None,
                   group_size: int = 1, world: int = 1, uid: str = "uid",
                   clear: bool = True) -> StepOutcome:
    keys = mint_keys(batch.batch_size, group_size, uid)
    meta = write_rollout(batch, transport, codec, meta_cls, partition, keys)
    adv = _advantages(batch, rewards, advantages, group_size)
    try:
        meta = put_advantages(batch, adv, transport, codec, meta, partition, keys)
        shards, _ = meta.shard_for_dp(world)
        ready = []
        for shard in shards:
            if not len(shard):
                continue
            shard = trainer.compute_logprobs(shard, Stage.LOGPROB)
            shard = trainer.compute_logprobs(shard, Stage.REFERENCE_LOGPROB)
            ready.append(shard)
        result = trainer.train(ready)
    finally:
        if clear:
            transport.clear(partition, keys)
    return StepOutcome.of(result, trainer, adv, shard_rows(keys, shards), keys=keys)


def legacy_step(batch: Batch, trainer, *, rewards=None, advantages=None, group_size: int = 1,
                world: int = 1, meta_cls=BatchMeta) -> StepOutcome:
    adv = _advantages(batch, rewards, advantages, group_size)
    batch = batch.replace(advantages=adv)
    rows = dp_rows(batch.seq_lens.tolist(), world, meta_cls)
    ready = []
    for r in rows:
        if not r:
            continue
        shard = batch.select(r)
        prev = trainer.compute_logprobs(shard, Stage.LOGPROB)
        ref = trainer.compute_logprobs(shard, Stage.REFERENCE_LOGPROB)
        ready.append(shard.replace(prev_logprobs=prev, reference_logprobs=ref))
    return StepOutcome.of(trainer.train(ready), trainer, adv, rows)
