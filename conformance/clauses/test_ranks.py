"""Data-parallel rank clauses: a GRPO step whose ranks are processes of their own.

The backend's trainer factory is asked for a rank group (`ranks=RankLaunch(...)`, the rank
contract of reference_impl/ranks.py; the reference's where the backend has no trainer); each
rank reopens the test's transport by its address and fetches its own shard. The group is started
once per module and world (a rank process imports torch and transformers: seconds) and rebound
to every test's transport with fresh weights; each (family, case, world) step runs once and the
clause tests read it. Baselines run in this process: world 1 (`grpo.dataplane_step`), and the
in-process ranks of the same shards (`dataplane_step(world=W)`).
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch

from rlconform.conformance.catalogue.ranks import (
    RANK_CLEANUP_S,
    RANK_FAILURE_BOUND_S,
    RANK_GRAD_NORM_RTOL,
    RANK_LOSS_ATOL,
    RANK_UPDATE_RTOL,
)
from rlconform.fixtures.sizes import PRODUCTION, SIZE_ENV, TINY, model_size
from rlconform.reference_impl.codec import WireBatch
from rlconform.reference_impl.grpo import dataplane_step
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.ranks import STAGES, RankLaunch, dataplane_step_ranks
from rlconform.reference_impl.recording import (
    Event,
    RecordingTransport,
    match_rows,
    media_mismatches,
)
from rlconform.reference_impl.served import unpack_columns
from rlconform.reference_impl.trainer import TrainerSettings

from ._check import assert_batch_equal
from ._prompts import for_trainer

FAMILIES = ("qwen2_vl", "smolvlm")  # M-RoPE with dim-0 patches; dim-1 tiles
# one rollout per family: images per prompt (2, 1, 0, 0), two samples per prompt ->
# rows 0-1: two images, 2-3: one image, 4-7: none (group members share their prompt's media)
PATTERN, PROMPTS, GROUP, MAX_NEW_TOKENS = (2, 1, 0, 0), 4, 2, 6
CASES = {  # name -> (rows of the rollout, micro_batch_size)
    "single": ([2], 1),  # world 2: one rank holds one image sample, the other nothing
    "pair": ([2, 4], 1),  # one image sample and one text sample, one per rank
    "uneven": ([0, 1, 2, 3, 4], 1),  # shards 3/2, both ranks mix 2- and 1-image samples
    "media_free": ([0, 4, 5, 6, 7], 8),  # shards 3/2, one shard media-free; 1 micro-batch each
}
ADVANTAGES = (1.0, -0.5, 0.25, 0.7, -1.0)
# world 4 needs 4 rank processes: only where there are cores for them (RLCONFORM_RANK_WORLDS
# overrides, e.g. "2,4")
WORLDS = tuple(int(w) for w in os.environ.get(
    "RLCONFORM_RANK_WORLDS", "2,4" if (os.cpu_count() or 1) >= 4 else "2").split(","))
RUNS = ([("qwen2_vl", c, 2) for c in CASES] + [("smolvlm", c, 2) for c in ("pair", "uneven")]
        + [("qwen2_vl", c, w) for w in WORLDS if w > 2 for c in ("pair", "uneven",
                                                                "media_free")])
STEP_TIMEOUT_S = 300.0


def _regime(case: str, world: int) -> str:
    """Which bitwise identity the catalogue promises for this run (RANK-DP-PARITY regime)."""
    rows, mbs = CASES[case]
    if world == 2 and mbs == 1 and len(rows) <= 2:
        return "world1"  # (i): one sample per rank, one-sample micro-batches
    if world == 2 and mbs >= len(rows):
        return "inprocess"  # (ii): one micro-batch per rank
    return "tolerance"


class Run:
    def __init__(self, batch, settings, mp, w1, w1_puts, w0, inprocess):
        self.batch, self.settings = batch, settings
        self.mp, self.w1, self.w1_puts, self.w0, self.inprocess = mp, w1, w1_puts, w0, \
            inprocess
        self.reports = mp.extra["ranks"].ranks


class RankRuns:
    """Rollouts, rank groups (one per world) and finished runs, for one module."""

    def __init__(self, backend, spec: str, device: str, dtype: torch.dtype, seed: int):
        from rlconform.conformance.backends.reference import backend as reference

        self.spec, self.device, self.dtype, self.seed = spec, device, dtype, seed
        self.trainer = backend.trainer if backend.provides("trainer") else reference.trainer
        self.batches: dict = {}
        self.groups: dict = {}
        self.runs: dict = {}

    def settings(self, family: str, **kw) -> TrainerSettings:
        return TrainerSettings(family, dtype=self.dtype, device=self.device, seed=self.seed,
                               **kw)

    def batch(self, family: str):
        if family not in self.batches:
            from rlconform.fixtures.families import build_family
            from rlconform.fixtures.images import make_prompts
            from rlconform.reference_impl.rollout import HFRollout

            prompts, images, _ = make_prompts(PROMPTS, list(PATTERN), seed=self.seed)
            prompts = [p for p in prompts for _ in range(GROUP)]
            images = [i for i in images for _ in range(GROUP)]
            engine = HFRollout(build_family(family), self.settings(family))
            batch = engine.generate(prompts, images, MAX_NEW_TOKENS, seed=self.seed)
            self.batches[family] = for_trainer(self.trainer, batch, prompts, images)
        return self.batches[family]

    def group(self, world: int, settings, transport, codec):
        g = self.groups.get(world)
        if g is not None and g.alive:
            g.bind(settings, transport, codec)
            return g
        launch = RankLaunch(world, backend=self.spec, device=self.device, probe=True,
                            timeout_s=STEP_TIMEOUT_S)
        g = self.trainer(settings, transport, codec, ranks=launch)
        self.groups[world] = g
        return g

    def drop(self, world: int) -> None:
        g = self.groups.pop(world, None)
        if g is not None:
            g.close()

    def close(self) -> None:
        for w in list(self.groups):
            self.drop(w)

    def run(self, family: str, case: str, world: int, transport, codec, meta_cls) -> Run:
        key = (family, case, world)
        if key not in self.runs:
            try:
                self.runs[key] = self._run(family, case, world, transport, codec, meta_cls)
            except Exception as exc:  # every clause test of this run reports the same failure
                self.runs[key] = exc
                if world in self.groups and not self.groups[world].alive:
                    self.drop(world)
        out = self.runs[key]
        if isinstance(out, Exception):
            raise out
        return out

    def _run(self, family, case, world, transport, codec, meta_cls) -> Run:
        rows, mbs = CASES[case]
        batch = self.batch(family).select(rows)
        adv = torch.tensor(ADVANTAGES[:len(rows)])
        settings = self.settings(family, micro_batch_size=mbs)
        group = self.group(world, settings, transport, codec)
        mp = dataplane_step_ranks(batch, group, transport, codec, meta_cls, _partition(),
                                  advantages=adv, timeout_s=STEP_TIMEOUT_S)
        rec = RecordingTransport(transport)
        trainer = self.trainer(settings, rec, codec)
        w0 = trainer.state_dict()
        w1 = dataplane_step(batch, trainer, rec, codec, meta_cls, _partition(), advantages=adv)
        inprocess = None
        if _regime(case, world) == "inprocess":
            inprocess = dataplane_step(batch, self.trainer(settings, transport, codec),
                                       transport, codec, meta_cls, _partition(),
                                       advantages=adv, world=world)
        return Run(batch, settings, mp, w1, rec.events, w0, inprocess)


def _partition() -> str:
    return f"ranks-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def rank_runs(backend, request, device, dtype, seed):
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # as test_trainer.py: hidden-64 models gain nothing from more
    size = os.environ.get(SIZE_ENV)
    if _ranks_share_a_gpu(device):
        # at production width every rank holds a whole model: two on one GPU do not fit, so
        # the ranks (they inherit the environment) and their rollouts run the tiny size there
        # (the RANK clauses judge what crosses processes, not the model's width)
        os.environ[SIZE_ENV] = TINY
    runs = RankRuns(backend, request.config.getoption("--backend"), device, dtype, seed)
    try:
        yield runs
    finally:
        runs.close()
        torch.set_num_threads(threads)
        if size is None:
            os.environ.pop(SIZE_ENV, None)
        else:
            os.environ[SIZE_ENV] = size


def _ranks_share_a_gpu(device: str) -> bool:
    """Production width on CUDA with fewer GPUs than the largest world (ranks share one)."""
    return device.startswith("cuda") and model_size() == PRODUCTION and \
        torch.cuda.device_count() < max(WORLDS)


# -- helpers ----------------------------------------------------------------------------------
def _rows_of_column(events_or_puts, column: str) -> dict[str, torch.Tensor]:
    """key -> row of `column` from recorded puts (driver Events or rank put records)."""
    out: dict[str, torch.Tensor] = {}
    for e in events_or_puts:
        if isinstance(e, Event):
            if e.kind != "put" or column not in e.fields:
                continue
            keys, col = e.keys, e.data[column]
        else:
            if column not in e["fields"]:
                continue
            keys, col = e["keys"], unpack_columns(e["columns"])[column]
        for k, row in zip(keys, col.unbind()):
            out[k] = row
    return out


def _same_multiset(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(torch.sort(a.flatten()).values,
                                              torch.sort(b.flatten()).values)


def _update_rdiff(got: dict, want: dict, w0: dict) -> float:
    num = sum(float(((got[k].double() - want[k].double()) ** 2).sum()) for k in want)
    den = sum(float(((want[k].double() - w0[k].double()) ** 2).sum()) for k in want)
    return (num / den) ** 0.5 if den else float("inf")


def _weights_diff(a: dict, b: dict) -> list[str]:
    return [k for k in b if not torch.equal(a[k], b[k])]


def _assert_ranks_agree(reports) -> None:
    digests = [r.weights_digest for r in reports]
    assert len(set(digests)) == 1, (
        f"the ranks ended the step with different weights (digests "
        f"{[d[:10] for d in digests]}): the gradients were not reduced across ranks")
    norms = [r.grad_norm for r in reports]
    assert len(set(norms)) == 1, f"the ranks computed different grad norms {norms}"


def _assert_bitwise(mp, want, what: str) -> None:
    assert mp.loss == want.loss, f"loss {mp.loss!r} (ranks) != {want.loss!r} ({what})"
    assert mp.grad_norm == want.grad_norm, \
        f"grad norm {mp.grad_norm!r} (ranks) != {want.grad_norm!r} ({what})"
    for k in want.metrics:
        assert k in mp.metrics, f"metric {k!r} missing from the ranks' step"
        assert _same_multiset(mp.metrics[k], want.metrics[k]), \
            f"per-token metric {k!r} differs from {what}"
    diff = _weights_diff(mp.state_dict, want.state_dict)
    assert not diff, f"updated weights differ from {what} in {len(diff)} tensors, e.g. " \
                     f"{diff[:3]}"


# -- RANK-DP-PARITY ------------------------------------------------------------------------------
@pytest.mark.clause("RANK-DP-PARITY")
@pytest.mark.parametrize("family,case,world", RUNS)
def test_ranks_step_equals_world_1(rank_runs, transport, codec, meta_cls, dtype, record_metric,
                                   family, case, world):
    run = rank_runs.run(family, case, world, transport, codec, meta_cls)
    mp, w1 = run.mp, run.w1
    record_metric("step_seconds_ranks", mp.extra["seconds"])
    record_metric("grad_norm", mp.grad_norm)
    assert w1.grad_norm > 0 and _weights_diff(w1.state_dict, run.w0), \
        "test setup: world 1's step did not move the weights: the comparison would be vacuous"
    assert len(mp.shards) == world, f"{len(mp.shards)} shards for world {world}"
    _assert_ranks_agree(run.reports)
    regime = _regime(case, world)
    if regime == "world1":
        _assert_bitwise(mp, w1, "world 1")
        return
    if CASES[case][1] == 1:  # one-sample micro-batches: every logprob is bitwise at any world
        for col in ("prev_logprobs", "reference_logprobs"):
            want = _rows_of_column(run.w1_puts, col)
            got = _rows_of_column([p for r in run.reports for p in r.puts], col)
            assert set(got) == set(want), f"{col} was written for keys {sorted(got)}, " \
                                          f"expected {sorted(want)}"
            bad = [k for k in want if not torch.equal(got[k], want[k])]
            assert not bad, f"{col} of {bad} differ from world 1's (same one-sample " \
                            "micro-batch: must be bitwise)"
        for k in w1.metrics:
            assert _same_multiset(mp.metrics[k], w1.metrics[k]), \
                f"per-token metric {k!r} differs from world 1 (one-sample micro-batches)"
    if regime == "inprocess":
        assert mp.shards == run.inprocess.shards
        _assert_bitwise(mp, run.inprocess, "the in-process ranks of the same shards")
    dl = abs(mp.loss - w1.loss)
    dg = abs(mp.grad_norm - w1.grad_norm) / w1.grad_norm
    du = _update_rdiff(mp.state_dict, w1.state_dict, run.w0)
    record_metric("loss_abs_diff_vs_world1", dl)
    record_metric("grad_norm_rel_diff_vs_world1", dg)
    record_metric("update_rel_diff_vs_world1", du)
    assert dl <= RANK_LOSS_ATOL, f"loss {mp.loss!r} vs world 1 {w1.loss!r}: |diff| {dl:.3g} " \
                                 f"> {RANK_LOSS_ATOL:g}"
    assert dg <= RANK_GRAD_NORM_RTOL[dtype], \
        f"grad norm {mp.grad_norm!r} vs world 1 {w1.grad_norm!r}: relative diff {dg:.3g} > " \
        f"{RANK_GRAD_NORM_RTOL[dtype]:g}"
    assert du <= RANK_UPDATE_RTOL[dtype], \
        f"updated weights vs world 1: relative update diff {du:.3g} > " \
        f"{RANK_UPDATE_RTOL[dtype]:g}"


# -- RANK-SHARD-RECEIPT --------------------------------------------------------------------------
def _media_free(batch, rows) -> bool:
    packed = [v for v in batch.fields.values() if isinstance(v, PackedTensor)]
    return bool(packed) and all(v.is_none(i) for v in packed for i in rows)


@pytest.mark.clause("RANK-SHARD-RECEIPT")
@pytest.mark.parametrize("family,case,world", RUNS)
def test_every_rank_receives_exactly_its_shard(rank_runs, transport, codec, meta_cls, family,
                                               case, world):
    run = rank_runs.run(family, case, world, transport, codec, meta_cls)
    shards, rows = run.mp.extra["shard_metas"], run.mp.shards
    if case == "media_free":
        assert any(_media_free(run.batch, r) for r in rows if r), \
            f"test setup: no media-free shard in {rows}"
    if case in ("uneven", "media_free"):
        assert len({len(r) for r in rows}) > 1, f"test setup: shards {rows} are not uneven"
    for r, (rep, shard, idx) in enumerate(zip(run.reports, shards, rows)):
        got = rep.received
        assert got is not None, f"rank {r} reported no receipt (probe)"
        for name in ("partition", "keys", "fields", "seq_lens", "tags", "extra"):
            want = getattr(shard, name)
            assert got[name] == want, (
                f"rank {r} received its shard meta with {name} {got[name]!r}; the driver "
                f"minted {want!r}")
        if not idx:
            assert not rep.fetches and not rep.puts, \
                f"rank {r} has an empty shard but fetched or wrote {rep.fetches or rep.puts}"
            continue
        row_of = {k: i for i, k in enumerate(run.mp.extra["keys"])}
        for stage in STAGES:
            fetches = [f for f in rep.fetches if f["stage"] == stage]
            assert fetches, f"rank {r} fetched nothing in the {stage} pass"
            for f in fetches:  # any order, but exactly the shard's keys, each once
                assert sorted(f["keys"]) == sorted(shard.keys) and \
                    len(set(f["keys"])) == len(f["keys"]), (
                        f"rank {r} fetched keys {f['keys']} in the {stage} pass; its shard is "
                        f"{list(shard.keys)}")
                want_batch = run.batch.select([row_of[k] for k in f["keys"]])
                # a decoded batch is padded to its own longest row (canonical padding)
                want_batch = want_batch.truncate(int(want_batch.seq_lens.max()))
                got_batch = codec.decode(WireBatch(unpack_columns(f["columns"]), f["tags"]))
                names = [n for n in got_batch.fields if n in want_batch.fields]
                assert_batch_equal(_only(want_batch, names), _only(got_batch, names),
                                   f"rank {r}, {stage} fetch")
        for col, stage in (("prev_logprobs", "logprob"),
                           ("reference_logprobs", "reference_logprob")):
            puts = [p for p in rep.puts if col in p["fields"]]
            assert puts, f"rank {r} wrote no {col}"
            written = [k for p in puts for k in p["keys"]]
            assert sorted(written) == sorted(shard.keys), (
                f"rank {r} wrote {col} for keys {written}; its shard is {list(shard.keys)}")
            assert all(p["stage"] == stage for p in puts), f"{col} written outside its pass"


def _only(batch, names):
    from rlconform.reference_impl.batch import Batch

    return Batch({n: batch.fields[n] for n in names}, batch.family, dict(batch.extra))


# -- RANK-INPUT-SHAPES ---------------------------------------------------------------------------
def _shapes(inputs: dict, batch) -> dict:
    return {n: tuple(v.shape) for n, v in inputs.items()
            if n in batch.fields and isinstance(batch.fields[n], PackedTensor)}


@pytest.mark.clause("RANK-INPUT-SHAPES")
@pytest.mark.parametrize("family,case,world", RUNS)
def test_every_rank_feeds_the_micro_batch_own_media(rank_runs, transport, codec, meta_cls,
                                                     record_metric, family, case, world):
    run = rank_runs.run(family, case, world, transport, codec, meta_cls)
    batch = run.batch
    seen = 0
    for r, (rep, idx) in enumerate(zip(run.reports, run.mp.shards)):
        if not idx:
            continue
        assert rep.forwards, f"rank {r} reported no forward (probe)"
        events = [Event("forward", f"{f['stage']}/{f['model']}", (), tuple(f["inputs"]),
                        f["inputs"]) for f in rep.forwards]
        problems = media_mismatches(events, batch)
        assert not problems, f"rank {r}: media fed to the model are not the micro-batch's " \
                             "own rows:\n  " + "\n  ".join(problems[:6])
        per_stage: dict[str, list] = {s: [] for s in STAGES}
        for f in rep.forwards:
            x = f["inputs"]
            mb = tuple(match_rows(x["input_ids"], x["attention_mask"], batch["input_ids"],
                                  batch["input_lengths"]))
            assert set(mb) <= set(idx), f"rank {r} fed rows {mb} outside its shard {idx}"
            per_stage[f["stage"]].append((mb, sorted(_shapes(x, batch).items())))
            seen += 1
        first = sorted(per_stage[STAGES[0]])
        for s in STAGES[1:]:
            assert sorted(per_stage[s]) == first, (
                f"rank {r}: the {s} pass built micro-batches / media shapes "
                f"{sorted(per_stage[s])}, the {STAGES[0]} pass {first}")
    record_metric("forwards_checked", seen)
    assert seen, "no forward was observed on any rank"


# -- RANK-FAILURE (last in the module: it spends the world-2 group) --------------------------
@pytest.mark.clause("RANK-FAILURE")
def test_a_rank_killed_mid_step_fails_it_fast_and_leaves_no_process(
        rank_runs, transport, codec, meta_cls, record_metric):
    from rlconform.conformance.backends import _procs

    rows, _ = CASES["pair"]
    batch = rank_runs.batch("qwen2_vl").select(rows)
    group = rank_runs.group(2, rank_runs.settings("qwen2_vl", micro_batch_size=1), transport,
                            codec)
    watched = set(group.pids)
    for pid in group.pids:
        watched |= _procs.descendants(pid)
    victim = group.pids[1]
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception) as err:  # noqa: B017 - any error, judged by its message
            dataplane_step_ranks(batch, group, transport, codec, meta_cls, _partition(),
                                 advantages=torch.tensor(ADVANTAGES[:2]), kill=(1, "train"),
                                 timeout_s=RANK_FAILURE_BOUND_S + 15)
        took = time.monotonic() - t0
        record_metric("rank_failure_seconds", took)
        msg = str(err.value)
        assert took <= RANK_FAILURE_BOUND_S, \
            f"the step failed {took:.1f}s after rank 1 died (bound {RANK_FAILURE_BOUND_S:g}s)"
        for needle, what in (("rank 1", "the rank"), (str(victim), "its pid"),
                             ("SIGKILL", "how it died"), ("train", "the pass")):
            assert needle in msg, f"the error does not name {what} ({needle!r}): {msg[:600]}"
        t1 = time.monotonic()
        left = _procs.wait_gone(watched, RANK_CLEANUP_S)
        record_metric("rank_cleanup_seconds", time.monotonic() - t1)
        assert not left, f"processes of the failed group still running: {sorted(left)}"
    finally:
        rank_runs.drop(2)
        _procs.kill_pids(_procs.wait_gone(watched, 0.1))
