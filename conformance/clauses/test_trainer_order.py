"""Order is free: a trainer's passes give each row the same outputs whatever order its meta lists
the keys in, and leave the metas they are given as they were.

The driver's meta reaches the trainer in orders other than the one the keys were put in: DP
balancing sorts rows by length, a rank's shard interleaves the batch, a filter or a shuffle
reorders it. A trainer that pairs what it fetched with the meta's keys by position, where the
fetch came back in the store's order, writes one row's logprobs under another's key, and only a
reordered meta shows it. The regime in which the per-row outputs are bitwise: one row per
micro-batch (micro_batch_size 1), so every row's forward sees the same inputs, padding included,
in every order (BACKGROUND.md s7: same micro-batch, bitwise logprobs on CPU).
"""

from __future__ import annotations

import random
import uuid

import pytest
import torch

from rlconform.conformance.clauses._gc import new_trainer
from rlconform.conformance.clauses.test_trainer import GROUP
from rlconform.reference_impl.codec import WireBatch
from rlconform.reference_impl.grpo import mint_keys, put_advantages, write_rollout
from rlconform.reference_impl.registry import Stage
from rlconform.reference_impl.trainer import OUTPUT_FIELD

from ._check import (
    assert_bit_equal,
    call_intact,
    expect_accepted,
    expect_stored,
)

FAMILIES = ("qwen2_vl", "smolvlm", "text")
# images per prompt, cycled: unequal counts and an image in every VLM row (text rows are the
# text family's), so one-row micro-batches never hold a text row of an image batch
IMAGES = (1, 2, 1)
REWARDS_SEED = 3



def _orders(meta_cls, n: int, meta) -> dict[str, list]:
    """Row orders other than the put order, each as a list of metas passed in turn."""
    rng = random.Random(REWARDS_SEED)
    shuffled = list(range(n))
    rng.shuffle(shuffled)
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    shards, _ = meta.shard_for_dp(2)
    return {
        "put order": [meta],
        "reversed": [meta.subset(list(range(n))[::-1])],
        "shuffled": [meta.subset(shuffled)],
        "interleaved": [meta.subset(odds + evens)],
        "interleaved shards": [meta.subset(odds), meta.subset(evens)],
        "DP-balanced shards": [meta_cls.concat(shards)],
    }


def _column(transport, codec, meta, keys: list[str], name: str) -> list[torch.Tensor]:
    """Each key's row of column `name` as stored, cut at the row's length."""
    cols, tags = expect_stored(
        lambda: transport.get(meta.partition, keys, select_fields=[name, "input_lengths"]),
        f"the pass did not store its {name!r} column")
    # a row stored under another key has another length than its key's tag says
    batch = expect_accepted(lambda: codec.decode(WireBatch(cols, tags)),
                            f"the stored {name!r} rows do not fit their keys' rows")
    return [batch[name][i, :n] for i, n in enumerate(batch.seq_lens.tolist())]


def _write(batch, transport, codec, meta_cls):
    part = f"order-{uuid.uuid4().hex[:8]}"
    keys = mint_keys(len(batch), GROUP)
    meta = write_rollout(batch, transport, codec, meta_cls, part, keys)
    adv = torch.linspace(-1.0, 1.0, len(batch))  # distinct per row: the loss tells rows apart
    return put_advantages(batch, adv, transport, codec, meta, part, keys), keys


@pytest.mark.clause("TRAIN-ORDER-FREE")
@pytest.mark.parametrize("family", FAMILIES)
def test_logprob_passes_give_each_row_the_same_values_in_any_order(
        backend, transport, codec, meta_cls, rollouts, family):
    batch, _, _ = rollouts.get(family, IMAGES)
    n = len(batch)
    assert len(set(batch.seq_lens.tolist())) > 1, "fixture lost its rows of unequal length"
    meta, keys = _write(batch, transport, codec, meta_cls)
    trainer = new_trainer(backend, rollouts.settings(family, micro_batch_size=1), transport, codec)
    want: dict = {}
    try:
        for what, metas in _orders(meta_cls, n, meta).items():
            for stage in (Stage.LOGPROB, Stage.REFERENCE_LOGPROB):
                for m in metas:
                    trainer.compute_logprobs(m, stage)
                got = _column(transport, codec, meta, keys, OUTPUT_FIELD[stage])
                if what == "put order":
                    want[stage] = got
                    assert any(bool(r.ne(0).any()) for r in got), \
                        f"the {stage.value} pass wrote only zeros"
                    continue
                for i, (a, b) in enumerate(zip(want[stage], got)):
                    assert_bit_equal(a, b, f"{family}: {OUTPUT_FIELD[stage]} of row {i} (key "
                                           f"{keys[i]!r}) after a pass over the meta in "
                                           f"{what} order, against the put order")
    finally:
        transport.clear(meta.partition, keys)


def _multiset(values: torch.Tensor) -> torch.Tensor:
    """The per-token values of a metric as a multiset: their bits, sorted. A trainer may walk
    rows in its own order (TRL shuffles its micro-batches), so which row a value belongs to is
    not recorded; equal per-row outputs in every order give equal multisets."""
    flat = values.detach().float().contiguous().reshape(-1)
    return flat.view(torch.int32).sort().values


# per-token metrics of a train pass that depend on each row's own inputs (StepResult's contract)
ORDER_METRICS = ("loss_per_token", "token_mult_prob_error")


@pytest.mark.clause("TRAIN-ORDER-FREE")
@pytest.mark.parametrize("family", FAMILIES[:2])
def test_train_pass_gives_each_row_the_same_loss_in_any_order(
        backend, transport, codec, meta_cls, rollouts, family):
    batch, _, _ = rollouts.get(family, IMAGES)
    n = len(batch)
    settings = rollouts.settings(family, micro_batch_size=1)
    per_order = {}
    for what in ("put order", "reversed", "DP-balanced shards"):
        meta, keys = _write(batch, transport, codec, meta_cls)
        metas = _orders(meta_cls, n, meta)[what]
        trainer = new_trainer(backend, settings, transport, codec)
        try:
            ready = [trainer.compute_logprobs(trainer.compute_logprobs(m, Stage.LOGPROB),
                                              Stage.REFERENCE_LOGPROB) for m in metas]
            result = trainer.train(ready)
        finally:
            transport.clear(meta.partition, keys)
        missing = [n for n in ORDER_METRICS if n not in result.metrics]
        assert not missing, (f"{family}: the train pass reports no per-token {missing} "
                             f"(StepResult.metrics holds {sorted(result.metrics)}); the clause "
                             "compares them across key orders")
        per_order[what] = {name: result.metrics[name] for name in ORDER_METRICS}
    want = per_order.pop("put order")
    assert bool(want["loss_per_token"].ne(0).any()), \
        "the put-order train pass gave a zero loss on every token"
    for what, got in per_order.items():
        for name, values in want.items():
            assert_bit_equal(_multiset(values), _multiset(got[name]),
                             f"{family}: the per-token {name} of a train pass over {what} "
                             "(as a multiset), against put order")


@pytest.mark.clause("TRAIN-INPUT-INTACT")
@pytest.mark.parametrize("world", [1, 4])
def test_passes_leave_the_metas_they_are_given_intact(backend, transport, codec, meta_cls,
                                                     rollouts, world):
    """A step as the driver runs it, over DP shards (4 ranks for 6 rows: uneven): every argument
    of a logprob, reference or train pass (each meta, the list of metas) is unchanged
    afterwards."""
    family = "qwen2_vl"
    batch, _, _ = rollouts.get(family, IMAGES)
    meta, keys = _write(batch, transport, codec, meta_cls)
    trainer = new_trainer(backend, rollouts.settings(family), transport, codec)
    try:
        shards = [s for s in meta.shard_for_dp(world)[0] if len(s)]
        assert world == 1 or len({len(s) for s in shards}) > 1, \
            f"test setup: shards of {[len(s) for s in shards]} rows are not uneven"
        ready = []
        for k, shard in enumerate(shards):
            for stage in (Stage.LOGPROB, Stage.REFERENCE_LOGPROB):
                shard = call_intact(f"the {stage.value} pass over shard {k}",
                                    trainer.compute_logprobs, shard, stage)
            ready.append(shard)
        call_intact(f"the train pass over {len(ready)} shards", trainer.train, ready)
    finally:
        transport.clear(meta.partition, keys)
