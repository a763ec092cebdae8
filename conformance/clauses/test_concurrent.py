"""Concurrency clauses: one transport instance used from several threads at once.

Every other transport clause makes one call at a time; real data planes serve many rollout
workers and ranks at once. Workers start together (a barrier), each puts its own keys in rounds
and reads back what it wrote while the others put, under a short interpreter switch interval so
threads interleave inside calls; afterwards every worker's keys, values and tags must be there
exactly, and nothing else.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rlconform.reference_impl.codec import jagged

from ._check import assert_columns_equal

WORKERS, ROUNDS, PER_PUT = 4, 5, 3


@contextlib.contextmanager
def _interleaved(interval: float = 1e-5) -> Iterator[None]:
    """Switch threads often (the default is every 5 ms), so calls overlap inside themselves."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _columns(w: int, r: int, n: int) -> dict[str, torch.Tensor]:
    """Columns whose every value names its worker, round and row. Dense (n, 2) and (n, 3) and
    non-empty jagged rows: layouts every transport handles, so only concurrency is judged."""
    ids = torch.arange(n) + (w * 1000 + r * 10)
    return {
        "rewards": torch.stack([ids.float(), -ids.float()], 1),
        "image_grid_thw": torch.stack([ids, ids + 1, ids + 2], 1),
        "pixel_values": jagged([torch.full((1 + (w + r + i) % 4,), float(ids[i]))
                                for i in range(n)], torch.float32),
    }


def _tags(w: int, r: int, n: int) -> list[dict]:
    return [{"worker": w, "round": r, "row": i,
             "pixel_values": {"shapes": [[1 + (w + r + i) % 4]], "pack_dim": 0}}
            for i in range(n)]


def _pick(cols: dict[str, torch.Tensor], idx: list[int]) -> dict[str, torch.Tensor]:
    return {n: torch.nested.nested_tensor([c.unbind()[i] for i in idx], layout=torch.jagged)
            if c.is_nested else c[idx] for n, c in cols.items()}


def _worker(transport, part: str, w: int, start: threading.Barrier) -> list:
    written = []
    start.wait(timeout=120)
    for r in range(ROUNDS):
        keys = [f"w{w}-r{r}-k{i}" for i in range(PER_PUT)]
        cols, tags = _columns(w, r, PER_PUT), _tags(w, r, PER_PUT)
        transport.put(part, keys, cols, tags)
        written.append((keys, cols, tags))
        # read back an earlier put, rows in another order, while the other workers put
        keys0, cols0, tags0 = written[r // 2]
        order = [2, 0] if r % 2 else [1, 2, 0]
        try:
            got, got_tags = transport.get(part, [keys0[i] for i in order],
                                          select_fields=list(cols0))
        except KeyError as exc:
            raise AssertionError(f"worker {w} round {r}: its round {r // 2} keys were lost by "
                                 f"concurrent puts: {exc}") from None
        try:
            assert_columns_equal(_pick(cols0, order), got)
        except AssertionError as exc:
            raise AssertionError(f"worker {w} round {r}, reading its round {r // 2} back while "
                                 f"others put: {exc}") from None
        assert got_tags == [tags0[i] for i in order], \
            f"worker {w} round {r}: tags {got_tags} are not its own {[tags0[i] for i in order]}"
    return written


def _run_workers(transport, partition_of) -> list[list]:
    start = threading.Barrier(WORKERS)
    with _interleaved(), ThreadPoolExecutor(WORKERS) as pool:
        futures = [pool.submit(_worker, transport, partition_of(w), w, start)
                   for w in range(WORKERS)]
        return [f.result() for f in futures]


def _check_all(transport, part: str, written: list, w: int) -> list[str]:
    keys = [k for ks, _c, _t in written for k in ks]
    cols = {n: torch.cat([c[n] for _k, c, _t in written]) if not written[0][1][n].is_nested
            else torch.nested.nested_tensor([r for _k, c, _t in written for r in c[n].unbind()],
                                            layout=torch.jagged)
            for n in written[0][1]}
    tags = [t for _k, _c, ts in written for t in ts]
    try:
        got, got_tags = transport.get(part, keys, select_fields=list(cols))
    except KeyError as exc:
        raise AssertionError(f"worker {w}'s keys were lost by concurrent puts: {exc}") from None
    try:
        assert_columns_equal(cols, got)
    except AssertionError as exc:
        raise AssertionError(f"after the workers joined, worker {w}'s rows: {exc}") from None
    assert got_tags == tags, f"after the workers joined, worker {w}'s tags are not its own"
    return keys


@pytest.mark.clause("DP-CONCURRENT")
@pytest.mark.parametrize("layout", ["different_partitions", "different_keys_one_partition"])
def test_concurrent_puts_and_gets(transport, layout):
    base = f"p-{uuid.uuid4().hex[:8]}"
    one = layout == "different_keys_one_partition"
    partition_of = (lambda w: base) if one else (lambda w: f"{base}-w{w}")
    written = _run_workers(transport, partition_of)
    every = []
    for w, rounds in enumerate(written):
        every += _check_all(transport, partition_of(w), rounds, w)
        if not one:
            listed = sorted(transport.list(partition_of(w)))
            assert listed == sorted(_check_all(transport, partition_of(w), rounds, w)), \
                f"partition of worker {w} lists {listed}"
    if one:
        listed = sorted(transport.list(base))
        lost, extra = sorted(set(every) - set(listed)), sorted(set(listed) - set(every))
        assert not lost and not extra, f"list lost keys {lost[:6]} and has extra {extra[:6]}"
