"""Trainer clauses: one real GRPO step of a tiny VLM, through the backend's trainer.

Batches come from the *reference* rollout (built once per module), so these clauses measure
the trainer alone; GEN-* clauses (test_generation.py) pair the backend's rollout with it.
Rewards are synthetic and distinct within each group: a random tiny policy rarely earns a
reward, and equal rewards make every advantage 0 and every gradient check vacuous. Completions
run to different lengths (per-row caps from the seed, 0 included, and a sampled EOS), so rows
carry different numbers of loss tokens and a loss aggregated the wrong way shows.
"""

from __future__ import annotations

import collections
import uuid

import pytest
import torch

from rlconform.conformance.catalogue.trainer import (
    FUSED_ATTENTION_MEASURED,
    FUSED_ATTENTION_UPDATE_RTOL,
    RATIO_CANARY_RTOL,
    RATIO_CANARY_SHIFT,
    TRUNCATION_LOGPROB_TOL,
)
from rlconform.conformance.clauses._check import expect_accepted
from rlconform.conformance.clauses._gc import new_trainer
from rlconform.conformance.clauses._prompts import for_trainer, reads_prompts
from rlconform.conformance.engine.items import NA_PREFIX
from rlconform.reference_impl.grpo import dataplane_step, legacy_step
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.recording import (
    RecordingTransport,
    media_mismatches,
    record_forwards,
)
from rlconform.reference_impl.registry import FIELDS
from rlconform.reference_impl.trainer import TrainerSettings, fused_attention_modules

# every clause runs on these (M-RoPE, a dim-1 packed family, image attention, text only) ...
FAMILIES = ("qwen2_vl", "smolvlm", "gemma3", "text")
VLM_FAMILIES = tuple(f for f in FAMILIES if f != "text")
# ... the cheap ones on every fixture family (named here: importing the fixtures at collection
# would load transformers for every run of the suite)
ALL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "smolvlm", "idefics3", "llava",
                "llava_next", "text")
GROUP = 2
MAX_NEW_TOKENS = 6
# images per prompt, cycled; the text family takes none
MIXED = (1, 0, 2)


def _images(family: str, pattern) -> tuple[int, ...]:
    return (0,) if family == "text" else tuple(pattern)


def _partition() -> str:
    return f"train-{uuid.uuid4().hex[:8]}"


def _rewards(n: int) -> torch.Tensor:
    """Deterministic, distinct within every group of two."""
    return torch.tensor([((7 * i) % 5) / 4 for i in range(n)], dtype=torch.float32)


class Rollouts:
    """Reference-rollout batches, cached per (family, pattern, groups, group size)."""

    _shared: dict = {}

    @classmethod
    def shared(cls, device: str, dtype: torch.dtype, seed: int,
               make_trainer=None) -> Rollouts:
        """One cache per process for every trainer clause module: the batches are handed over
        as the driver hands them to trainers of `make_trainer` (clauses/_prompts.py decides,
        so one cache serves every factory that decides alike)."""
        key = (device, dtype, seed, reads_prompts(make_trainer))
        if key not in cls._shared:
            cls._shared[key] = cls(device, dtype, seed, make_trainer)
        return cls._shared[key]

    def __init__(self, device: str, dtype: torch.dtype, seed: int, make_trainer=None):
        self.device, self.dtype, self.seed = device, dtype, seed
        self.make_trainer = make_trainer
        self._engines: dict = {}
        self._batches: dict = {}

    def settings(self, family: str, **kw) -> TrainerSettings:
        return TrainerSettings(family, dtype=self.dtype, device=self.device, seed=self.seed,
                               **kw)

    def get(self, family: str, pattern=MIXED, n_prompts: int = 3, group: int = GROUP):
        from rlconform.fixtures.families import build_family
        from rlconform.fixtures.images import completion_caps, make_prompts
        from rlconform.reference_impl.rollout import HFRollout

        key = (family, tuple(pattern), n_prompts, group)
        if key not in self._batches:
            fam = build_family(family)
            if family not in self._engines:
                # one engine at a time: at production widths each holds billions of weights
                self._engines = {family: HFRollout(fam, self.settings(family))}
            prompts, images, _ = make_prompts(n_prompts, list(_images(family, pattern)),
                                              seed=self.seed)
            prompts = [p for p in prompts for _ in range(group)]
            images = [i for i in images for _ in range(group)]
            caps = completion_caps(len(prompts), MAX_NEW_TOKENS, self.seed)
            engine = self._engines[family]
            engine.model.to(self.device)
            batch = engine.generate(prompts, images, caps, seed=self.seed)
            if self.device != "cpu":
                # parked in host memory between generations: on a GPU the cached engine's
                # weights would sit beside the trainers the tests build (Gemma3-4B: 8.6 GB of
                # a worker's 88 GB peak, which left its neighbour out of memory on an H200)
                engine.model.to("cpu")
            batch = for_trainer(self.make_trainer, batch, prompts, images)
            self._batches[key] = (batch, prompts, images)
        return self._batches[key]



def settings_not_declared(backend, *names: str) -> dict[str, str]:
    """Of the TrainerSettings fields `names`, those the backend's trainer declares it has no
    counterpart for (the trainer factory's `settings_unsupported`: field -> why)."""
    declared = getattr(backend.trainer, "settings_unsupported", None) or {}
    return {n: declared[n] for n in names if n in declared}


def _step(backend, transport, codec, meta_cls, settings, batch, **kw):
    """A data-plane step on a recording transport, with the trainer's forwards logged."""
    rec = RecordingTransport(transport, on_put=kw.pop("on_put", None))
    trainer = new_trainer(backend, settings, rec, codec)
    hooks = [record_forwards(trainer.model, rec.events, "policy")]
    ref = getattr(trainer, "reference_model", None)
    if ref is not None and ref is not trainer.model:
        hooks.append(record_forwards(ref, rec.events, "reference"))
    try:
        if "advantages" not in kw:
            kw.setdefault("rewards", _rewards(len(batch)))
            kw.setdefault("group_size", GROUP)
        out = dataplane_step(batch, trainer, rec, codec, meta_cls, _partition(), **kw)
    finally:
        for h in hooks:
            h.remove()
    return out, rec, trainer


def _record_ratio(record_metric, out) -> torch.Tensor:
    ratio = out.metrics["probs_ratio"]
    record_metric("probs_ratio", ratio)
    record_metric("probs_ratio_clamped", out.metrics["probs_ratio_clamped"])
    record_metric("probs_ratio_min", float(ratio.min()))
    record_metric("probs_ratio_max", float(ratio.max()))
    record_metric("probs_ratio_mean", float(ratio.mean()))
    record_metric("grad_norm", out.grad_norm)
    return ratio


def _assert_ratio_one(ratio: torch.Tensor, n_tokens: int) -> None:
    assert ratio.numel() == n_tokens, \
        f"probs_ratio has {ratio.numel()} values for {n_tokens} loss tokens"
    assert bool((ratio == 1.0).all()), (
        f"probs_ratio must be exactly 1.0 with one inner step: min {ratio.min().item():.9g}, "
        f"max {ratio.max().item():.9g}, mean {ratio.mean().item():.9g}, "
        f"{int((ratio != 1.0).sum())}/{ratio.numel()} tokens differ")


def _multimodal(fields) -> set[str]:
    return {f for f in fields if f in FIELDS and FIELDS[f].multimodal}


def _train_fetch(rec: RecordingTransport):
    """The train fetch: the last get of the step (after the reference put)."""
    gets = rec.of("get")
    assert gets, "the trainer fetched nothing through the transport"
    return gets[-1]


# -- TRAIN-RATIO-ONE ----------------------------------------------------------------------
@pytest.mark.clause("TRAIN-RATIO-ONE")
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_ratio_one_from_independent_recompute(backend, transport, codec, meta_cls,
                                              record_metric, rollouts, family):
    batch, _, _ = rollouts.get(family)
    out, rec, _ = _step(backend, transport, codec, meta_cls, rollouts.settings(family), batch)
    ratio = _record_ratio(record_metric, out)

    fetch = rec.fetch_before("prev_logprobs")
    assert fetch and fetch[0] is not None, \
        "no prev_logprobs column was put after a fetch: the prev-logprob pass did not run " \
        "through the transport"
    put = rec.put_of("prev_logprobs")[0]
    keys = set(out.extra["keys"])
    assert set(fetch[0].keys) == set(put.keys) == keys, \
        "the prev-logprob pass fetched or wrote other keys than the step's"
    assert "input_ids" in fetch[0].fields, "the prev-logprob fetch did not ask for input_ids"
    assert rec.forwards_between(fetch[0], put), \
        "no forward of the policy ran between the prev-logprob fetch and its put"
    assert "prev_logprobs" in _train_fetch(rec).fields, \
        "the train pass did not read prev_logprobs back from the store"
    _assert_ratio_one(ratio, int(batch["token_mask"].sum()))


@pytest.mark.clause("TRAIN-RATIO-ONE")
@pytest.mark.parametrize("family", ("qwen2_vl", "text"))
def test_ratio_follows_the_stored_prev_logprobs(backend, transport, codec, meta_cls,
                                                record_metric, rollouts, family):
    """Canary: shift the stored prev_logprobs; an earned ratio moves, a forced one stays 1."""
    batch, _, _ = rollouts.get(family)

    def shift(name, col):
        if name != "prev_logprobs":
            return col
        return torch.nested.nested_tensor_from_jagged(col.values() + RATIO_CANARY_SHIFT,
                                                      offsets=col.offsets())

    out, _, _ = _step(backend, transport, codec, meta_cls, rollouts.settings(family), batch,
                      on_put=shift)
    ratio = out.metrics["probs_ratio"]
    record_metric("probs_ratio_canary", ratio)
    want = torch.full_like(ratio, float(torch.exp(torch.tensor(-RATIO_CANARY_SHIFT))))
    assert ratio.numel() == int(batch["token_mask"].sum())
    assert torch.allclose(ratio, want, rtol=RATIO_CANARY_RTOL, atol=0), (
        f"with the stored prev_logprobs shifted by +{RATIO_CANARY_SHIFT}, probs_ratio must be "
        f"exp(-{RATIO_CANARY_SHIFT}) = {want[0].item():.6f}; got min {ratio.min().item():.6f}, "
        f"max {ratio.max().item():.6f}: the train pass does not use the prev-logprob column")


# -- TRAIN-FIELD-PARITY -------------------------------------------------------------------
@pytest.mark.clause("TRAIN-FIELD-PARITY")
@pytest.mark.parametrize("family,pattern", [(f, MIXED) for f in ALL_FAMILIES]
                         + [("qwen2_vl", (0,)), ("gemma3", (1,))])
def test_stage_fetches_ask_for_the_processor_fields(backend, transport, codec, meta_cls,
                                                    record_metric, rollouts, family, pattern):
    """Mixed batches, a media-free VLM batch (None media rows) and an all-image one."""
    from rlconform.fixtures.families import build_family

    batch, prompts, images = rollouts.get(family, pattern, 3 if pattern == MIXED else 2)
    emitted = set(build_family(family).process(prompts, images)) - {"input_ids",
                                                                    "attention_mask"}
    written = _multimodal(batch.fields)
    assert emitted <= written, f"test setup: the reference rollout dropped {emitted - written}"
    # a media-free batch of a VLM family still carries its packed fields, every row None
    emitted |= written
    out, rec, _ = _step(backend, transport, codec, meta_cls, rollouts.settings(family), batch)
    ratio = _record_ratio(record_metric, out)  # the fingerprint, recorded before any assert
    stages = {
        "logprob": rec.fetch_before("prev_logprobs"),
        "reference_logprob": rec.fetch_before("reference_logprobs"),
    }
    seen = {}
    for stage, fetches in stages.items():
        assert fetches and fetches[0] is not None, f"no {stage} fetch was recorded"
        seen[stage] = _multimodal(fetches[0].fields) | (set(fetches[0].fields) & emitted)
    train = _train_fetch(rec)
    seen["train"] = _multimodal(train.fields) | (set(train.fields) & emitted)
    for stage, got in seen.items():
        assert got == emitted, (
            f"the {stage} fetch asked for multimodal fields {sorted(got)}; the processor "
            f"emitted and the rollout wrote {sorted(emitted)} (missing "
            f"{sorted(emitted - got)}, extra {sorted(got - emitted)})")
    _assert_ratio_one(ratio, int(batch["token_mask"].sum()))


# -- TRAIN-LEGACY-PARITY ------------------------------------------------------------------
_CASES = {  # name -> (images per prompt, prompts, world)
    "image": ((1,), 2, 1),
    "mixed": (MIXED, 3, 1),
    "media_free": ((0,), 2, 1),
    "dp_media_free_shard": ((1, 0), 2, 2),
}
_PARITY = [(f, c) for f in VLM_FAMILIES for c in _CASES] + [("text", "text"),
                                                             ("text", "text_dp")]


def _module_of(key: str) -> str:
    """The top-level module a weight belongs to (`model.vision_tower`, ...)."""
    return ".".join(key.split(".")[:2])


def _differing_weights(dp, legacy) -> list[str]:
    """The state-dict keys whose updated weights are not bitwise equal."""
    return [k for k in legacy.state_dict if not torch.equal(dp.state_dict[k],
                                                            legacy.state_dict[k])]


def _weight_diff_summary(diff: list[str], dp, legacy, initial) -> str:
    """Where the updated weights differ and by how much, relative to the step's own update:
    tells a defect that moves whole tensors from reduction-order noise in a few entries."""
    parts = collections.Counter(_module_of(k) for k in diff)
    gap = sum(float((dp.state_dict[k].float() - legacy.state_dict[k].float()).norm()) ** 2
              for k in diff) ** 0.5
    entries = sum(int((dp.state_dict[k] != legacy.state_dict[k]).sum()) for k in diff)
    total = sum(v.numel() for v in legacy.state_dict.values())
    where = ", ".join(f"{h}: {n}" for h, n in sorted(parts.items()))
    msg = (f"updated weights differ in {len(diff)} tensors ({where}), {entries} of {total} "
           f"entries, e.g. {diff[:3]}")
    if initial is not None:
        step = sum(float((legacy.state_dict[k].float() - initial[k].float()).norm()) ** 2
                   for k in diff) ** 0.5
        msg += f"; |dp - legacy| / |legacy update| over those tensors = {gap / max(step, 1e-30):.3g}"
    return msg


def _module_update_gaps(dp, legacy, initial, diff: list[str]) -> dict[str, float]:
    """Per top-level module with weights in `diff` (`_differing_weights`): |W_dp - W_legacy|
    over |W_legacy - W_0| (relative L2, float32 per tensor)."""
    differ = set(diff)
    heads = {_module_of(k) for k in differ}
    gap = dict.fromkeys(heads, 0.0)
    step = dict.fromkeys(heads, 0.0)
    for k, w in legacy.state_dict.items():
        head = _module_of(k)
        if head not in heads:
            continue
        b = w.float()
        if k in differ:
            gap[head] += float(torch.linalg.vector_norm(dp.state_dict[k].float() - b)) ** 2
        step[head] += float(torch.linalg.vector_norm(b - initial[k].to(b.device).float())) ** 2
    return {h: (gap[h] / step[h]) ** 0.5 if step[h] > 0 else float("inf") for h in heads}


def _assert_same_step(dp, legacy, diff: list[str], initial=None,
                      gaps: dict[str, float] | None = None, weight_rtol: float = 0.0) -> None:
    """Bitwise equal steps, `diff` being `_differing_weights(dp, legacy)`; given `gaps` (fused
    attention on CUDA: `_module_update_gaps`) the updated weights of each top-level module
    only within `weight_rtol` of its own update."""
    assert dp.shards == legacy.shards, f"DP shards differ: {dp.shards} vs {legacy.shards}"
    assert dp.loss == legacy.loss, f"loss {dp.loss!r} (data plane) != {legacy.loss!r} (legacy)"
    assert dp.grad_norm == legacy.grad_norm, \
        f"grad norm {dp.grad_norm!r} (data plane) != {legacy.grad_norm!r} (legacy)"
    assert set(dp.metrics) == set(legacy.metrics), \
        f"metrics {sorted(dp.metrics)} vs {sorted(legacy.metrics)}"
    for k in dp.metrics:
        a, b = dp.metrics[k], legacy.metrics[k]
        assert a.shape == b.shape and torch.equal(a, b), \
            f"metric {k!r} differs: max |diff| " \
            f"{(a - b).abs().max().item() if a.shape == b.shape else 'shape'}"
    if gaps is None:
        assert not diff, _weight_diff_summary(diff, dp, legacy, initial)
        return
    exact = sorted(k for k in diff if _module_of(k) not in gaps)
    assert not exact, "weights outside the measured fused-attention modules " \
        f"{sorted(gaps)} differ: " + _weight_diff_summary(exact, dp, legacy, initial)
    worst = {h: g for h, g in gaps.items() if not g <= weight_rtol}
    assert not worst, "updated weights differ beyond the fused-attention tolerance " \
        f"{weight_rtol:g} of each module's update: " + \
        ", ".join(f"{h} {g:.3g}" for h, g in sorted(worst.items())) + "; " + \
        _weight_diff_summary(diff, dp, legacy, initial)


@pytest.mark.clause("TRAIN-LEGACY-PARITY")
@pytest.mark.parametrize("family,case", _PARITY)
def test_data_plane_step_equals_legacy_step(backend, transport, codec, meta_cls,
                                            record_metric, rollouts, family, case):
    if family == "text":
        pattern, n, world = (0,), 2, 2 if case == "text_dp" else 1
    else:
        pattern, n, world = _CASES[case]
    kw: dict = {"world": world}
    if case == "dp_media_free_shard":
        # one image prompt, one text prompt, no groups: exactly one of the two shards is
        # media-free whichever way shard_for_dp balances them
        batch, _, _ = rollouts.get(family, pattern, n, group=2)
        batch = batch.select([0, 2, 3])  # one image row and two text rows
        kw["advantages"] = torch.tensor([1.0, -0.5, 0.25])
    else:
        batch, _, _ = rollouts.get(family, pattern, n)
    settings = rollouts.settings(family)
    # only the outcome is kept: the data-plane trainer is freed before the legacy one is built
    dp = _step(backend, transport, codec, meta_cls, settings, batch, **dict(kw))[0]
    if "advantages" not in kw:
        kw.update(rewards=_rewards(len(batch)), group_size=GROUP)
    legacy_trainer = new_trainer(backend, settings)
    initial = legacy_trainer.state_dict()
    legacy = legacy_step(batch, legacy_trainer, meta_cls=meta_cls, **kw)
    record_metric("grad_norm", dp.grad_norm)
    record_metric("probs_ratio", dp.metrics["probs_ratio"])
    # fused attention's backward on CUDA is not reproducible (FUSED_ATTENTION_UPDATE_RTOL), in
    # the modules where that was measured (FUSED_ATTENTION_MEASURED): they get the tolerance,
    # every other weight must be bitwise
    fused = set()
    if torch.device(settings.device).type == "cuda":
        fused = fused_attention_modules(getattr(legacy_trainer, "model", torch.nn.Module())) \
            & set(FUSED_ATTENTION_MEASURED.get(family, ()))
    diff = _differing_weights(dp, legacy)  # once: a full pass over the weights (8.6 GB, Gemma3)
    gaps = {h: g for h, g in _module_update_gaps(dp, legacy, initial, diff).items()
            if h in fused} if fused else None
    if gaps is not None:
        record_metric("legacy_update_rel_diff", max(gaps.values(), default=0.0))
    if case == "dp_media_free_shard":
        media = next(v for v in batch.fields.values() if isinstance(v, PackedTensor))
        free = [s for s in dp.shards if all(media.is_none(i) for i in s)]
        assert free, f"test setup: no media-free shard in {dp.shards}"
    assert legacy.grad_norm > 0, "test setup: zero gradient makes the comparison vacuous"
    assert any(not torch.equal(initial[k], legacy.state_dict[k]) for k in initial), \
        "test setup: the step changed no weight"
    _assert_same_step(dp, legacy, diff, initial, gaps, FUSED_ATTENTION_UPDATE_RTOL)


# -- TRAIN-TRUNCATION-MEDIA ---------------------------------------------------------------
def _prev_rows(rec: RecordingTransport) -> list[torch.Tensor]:
    rows: list[torch.Tensor] = []
    for e in rec.put_of("prev_logprobs"):
        rows += list(e.data["prev_logprobs"].unbind())
    return rows


@pytest.mark.clause("TRAIN-TRUNCATION-MEDIA")
@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_truncation_and_dynamic_micro_batches_keep_media(backend, transport, codec, meta_cls,
                                                         dtype, record_metric, rollouts,
                                                         family):
    lacking = settings_not_declared(backend, "max_seq_len", "max_tokens_per_micro_batch")
    if lacking:
        pytest.skip(NA_PREFIX + "the trainer declares no counterpart for " + "; ".join(
            f"{k} ({why})" for k, why in lacking.items()))
    batch, _, _ = rollouts.get(family, MIXED, 3, group=2)
    lens = batch["input_lengths"].tolist()
    # distinct prompts side by side, shortest first, so a micro-batch mixes samples whose
    # media differ and any reordering inside it shows
    order = [sorted(t, key=lambda i: lens[i]) for t in ([0, 2, 4], [1, 3, 5])]
    batch = batch.select(order[0] + order[1])
    n = len(batch)
    advantages = torch.linspace(-1.0, 1.0, n)
    cut = max(lens) - 2  # the longest completions lose their tail
    assert cut > int(batch["prompt_lengths"].max()), "test setup: truncation cuts a prompt"
    truncated = rollouts.settings(family, max_seq_len=cut, max_tokens_per_micro_batch=3 * cut)
    # keep the records, not the trainers: one trainer alive at a time (production widths)
    out, rec = expect_accepted(
        lambda: _step(backend, transport, codec, meta_cls, truncated, batch,
                      advantages=advantages)[:2],
        f"a step truncating {family} rows to {cut} tokens (prompts {lens}) failed")
    whole = rollouts.settings(family, micro_batch_size=n)
    rec_whole = _step(backend, transport, codec, meta_cls, whole, batch,
                      advantages=advantages)[1]

    ratio = _record_ratio(record_metric, out)
    problems = media_mismatches(rec.events, batch)
    forwards = rec.of("forward")
    assert forwards, "no forward of the trainer's model was observed"
    assert not problems, "media seen by the model differ from the rollout's:\n  " + \
        "\n  ".join(problems[:6])
    kept = batch["input_lengths"].clamp(max=cut)
    _assert_ratio_one(ratio, int(batch["token_mask"][:, :cut].sum()))
    a, b = _prev_rows(rec), _prev_rows(rec_whole)
    assert len(a) == len(b) == n, \
        f"prev_logprobs were put for {len(a)} and {len(b)} rows of {n}: the prev-logprob pass " \
        "did not write its column"
    diff = torch.cat([(x[1:k] - y[1:k]).abs() for x, y, k in zip(a, b, kept.tolist())])
    record_metric("truncation_logprob_abs_diff", diff)
    tol = TRUNCATION_LOGPROB_TOL[dtype]
    assert float(diff.max()) <= tol, (
        f"logprobs at kept positions differ from the untruncated single-micro-batch run by "
        f"up to {float(diff.max()):.3g} (> {tol:g})")


# -- TRAIN-REFERENCE-FROZEN ---------------------------------------------------------------
@pytest.mark.clause("TRAIN-REFERENCE-FROZEN")
@pytest.mark.parametrize("family", FAMILIES)
def test_reference_pass_uses_frozen_initial_weights(backend, transport, codec, meta_cls,
                                                    record_metric, rollouts, family):
    batch, _, _ = rollouts.get(family)
    rec = RecordingTransport(transport)
    trainer = new_trainer(backend, rollouts.settings(family), rec, codec)
    columns = []
    for step in range(2):
        out = dataplane_step(batch, trainer, rec, codec, meta_cls, _partition(),
                             rewards=_rewards(len(batch)), group_size=GROUP)
        for col in ("prev_logprobs", "reference_logprobs"):
            assert len(rec.put_of(col)) == step + 1, f"step {step}: no {col} column was put"
        prev = [r for e in rec.put_of("prev_logprobs")[-1:] for r in
                e.data["prev_logprobs"].unbind()]
        ref = [r for e in rec.put_of("reference_logprobs")[-1:] for r in
               e.data["reference_logprobs"].unbind()]
        columns.append((prev, ref))
        if "reference_kl" in out.metrics:
            record_metric("reference_kl", out.metrics["reference_kl"], step=step)
            if step == 0:
                assert bool((out.metrics["reference_kl"] == 0).all()), \
                    "reference_kl must be exactly 0 at step 0"
    (prev0, ref0), (prev1, ref1) = columns
    assert all(torch.equal(p, r) for p, r in zip(prev0, ref0)), \
        "at step 0 the reference logprobs must equal the prev logprobs (same initial weights)"
    assert any(not torch.equal(p, q) for p, q in zip(prev0, prev1)), \
        "test setup: the update did not change the policy's logprobs"
    drift = max(float((r1 - r0).abs().max()) for r0, r1 in zip(ref0, ref1))
    record_metric("reference_drift_after_update", drift)
    assert drift == 0.0, (
        f"after an update the reference logprobs moved by up to {drift:.3g}: the reference "
        "policy is not the frozen initial weights")

