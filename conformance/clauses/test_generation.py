"""Rollout-vs-trainer (GEN-*) clauses: the backend's rollout feeding the backend's trainer.

A backend without a trainer surface is paired with the reference trainer. Rewards are
synthetic and distinct within each group (see test_trainer.py for why).
"""

from __future__ import annotations

import math
import uuid

import pytest
import torch

from rlconform.conformance.catalogue.generation import (
    GEN_INDEPENDENT_ALPHA,
    GEN_INDEPENDENT_SLACK,
    GEN_SIR_TOL,
    GEN_TMPE_TOL,
)
from rlconform.conformance.clauses._prompts import for_trainer
from rlconform.conformance.clauses._row_inputs import row_inputs
from rlconform.reference_impl.grpo import dataplane_step
from rlconform.reference_impl.trainer import TrainerSettings

FAMILIES = ("qwen2_vl", "smolvlm", "gemma3", "text")
ALL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "smolvlm", "idefics3", "llava",
                "llava_next", "text")  # as in test_trainer.py
GROUP = 2
MAX_NEW_TOKENS = 6
MIXED = (1, 0, 2)
REFIT_STEPS = 3


def _partition() -> str:
    return f"gen-{uuid.uuid4().hex[:8]}"


def _caps(n: int, seed: int) -> list[int]:
    """Per-row completion caps (0 included): rows with different numbers of loss tokens."""
    from rlconform.fixtures.images import completion_caps

    return completion_caps(n, MAX_NEW_TOKENS, seed)


def _rewards(n: int) -> torch.Tensor:
    return torch.tensor([((7 * i) % 5) / 4 for i in range(n)], dtype=torch.float32)


@pytest.fixture(scope="module")
def cpu_threads(device):
    """One intra-op thread on CPU (see test_trainer.py: ~10x faster on a busy runner)."""
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def setup(backend, device, dtype, seed, cpu_threads):
    """(settings, engine, trainer factory, prompts, images) for a family: `n_prompts` groups
    of `group` identical requests (same prompt, same image objects), a group's rows adjacent."""
    from rlconform.conformance.backends.reference import backend as reference
    from rlconform.fixtures.families import build_family
    from rlconform.fixtures.images import make_prompts

    make_trainer = backend.trainer if backend.provides("trainer") else reference.trainer
    make_rollout = backend.rollout if backend.provides("rollout") else reference.rollout

    def build(family: str, n_prompts: int = 3, seed_offset: int = 0, group: int = GROUP):
        settings = TrainerSettings(family, dtype=dtype, device=device, seed=seed)
        engine = make_rollout(build_family(family), settings)
        pattern = [0] if family == "text" else list(MIXED)
        prompts, images, _ = make_prompts(n_prompts, pattern, seed=seed + seed_offset)
        prompts = [p for p in prompts for _ in range(group)]
        images = [i for i in images for _ in range(group)]
        return settings, engine, make_trainer, prompts, images

    return build


def _agreement(out, dtype, record_metric, step=None) -> list[str]:
    """Record the engine-vs-trainer metrics; the violations of the clause's tolerances."""
    m = out.metrics
    for name in ("token_mult_prob_error", "sampling_importance_ratio", "gen_kl_error",
                 "policy_kl_error"):
        assert name in m, f"the trainer reported no {name!r} metric"
        record_metric(name, m[name], step=step)
    record_metric("probs_ratio", m["probs_ratio"], step=step)
    tmpe = float(m["token_mult_prob_error"].mean())
    sir = float(m["sampling_importance_ratio"].mean())
    bad = []
    tol = GEN_TMPE_TOL[dtype]
    if not tmpe <= tol:
        bad.append(f"token_mult_prob_error {tmpe:.6g} > {tol:g} (max per token "
                   f"{float(m['token_mult_prob_error'].max()):.4g})")
    if not abs(sir - 1.0) <= GEN_SIR_TOL:
        bad.append(f"sampling_importance_ratio {sir:.6g} outside 1 +- {GEN_SIR_TOL:g}")
    return bad


# -- GEN-LOGPROB-AGREEMENT ----------------------------------------------------------------
@pytest.mark.clause("GEN-LOGPROB-AGREEMENT")
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_generation_logprobs_agree_with_prev_logprobs(transport, codec, meta_cls, dtype,
                                                      record_metric, setup, family):
    settings, engine, make_trainer, prompts, images = setup(family)
    batch = engine.generate(prompts, images, _caps(len(prompts), 0), seed=0)
    batch = for_trainer(make_trainer, batch, prompts, images)
    trainer = make_trainer(settings, transport, codec)
    out = dataplane_step(batch, trainer, transport, codec, meta_cls, _partition(),
                         rewards=_rewards(len(batch)), group_size=GROUP)
    n = int(batch["token_mask"].sum())
    assert out.metrics["token_mult_prob_error"].numel() == n, \
        "the agreement metrics do not cover every loss token"
    bad = _agreement(out, dtype, record_metric)
    assert not bad, "engine and trainer disagree: " + "; ".join(bad)


# -- GEN-ROLLOUT-FIELDS -------------------------------------------------------------------
@pytest.mark.clause("GEN-ROLLOUT-FIELDS")
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_rollout_batch_carries_the_processor_output(dtype, setup, family):
    from rlconform.fixtures.families import build_family
    from rlconform.reference_impl.packed import PackedTensor
    from rlconform.reference_impl.registry import FAMILIES, FIELDS, DtypePolicy

    _, engine, _, prompts, images = setup(family)
    batch = engine.generate(prompts, images, _caps(len(prompts), 2), seed=2)
    fam = build_family(family)
    lens, plens = batch["input_lengths"], batch["prompt_lengths"]
    for i, (p, imgs) in enumerate(zip(prompts, images)):
        feats = fam.process([p], [imgs])
        n, k = int(plens[i]), int(lens[i])
        assert n == feats["input_ids"].shape[1] and \
            torch.equal(batch["input_ids"][i, :n], feats["input_ids"][0]), \
            f"row {i}: the prompt tokens differ from the processor's"
        missing = sorted(set(feats) - set(batch.fields))
        assert not missing, f"row {i}: the rollout batch lacks processor fields {missing}"
        media = fam.per_sample_media(feats, [len(imgs)])
        for name, t in feats.items():
            if name in ("input_ids", "attention_mask") or name in media:
                continue
            got = batch[name]
            assert torch.equal(got[i, :n], t[0]) and bool((got[i, n:k] == 0).all()), \
                f"row {i}: per-token map {name!r} is not the processor's, zero over the " \
                "completion"
        for name, per_row in media.items():
            got = batch[name]
            assert isinstance(got, PackedTensor), \
                f"{name!r} is a {type(got).__name__}, not a PackedTensor"
            want = FAMILIES[batch.family].segments(name, per_row)[0]
            segs = got.row_segments(i)
            assert (want is None) == (segs is None), \
                f"row {i}: {name!r} is {'None' if segs is None else 'present'}, the processor " \
                f"gave {'None' if want is None else 'media'}"
            if want is None:
                continue
            cast = FIELDS[name].dtype_policy is DtypePolicy.POLICY and want[0].is_floating_point()
            want = [w.to(dtype) if cast else w for w in want]
            assert [list(s.shape) for s in segs] == [list(w.shape) for w in want], \
                f"row {i}: {name!r} segment shapes differ from the processor's"
            for s, w in zip(segs, want):
                assert s.dtype == w.dtype, f"row {i}: {name!r} is {s.dtype}, expected {w.dtype}"
                assert torch.equal(s, w), f"row {i}: {name!r} values differ from the processor's"


# -- GEN-ORDINARY-TOKENS ------------------------------------------------------------------
LONG_CAP = 48  # the explicit long case: every row may run to 48 tokens
SPECIAL_SEEN_P = 0.98  # ... so an unrestricted sampler shows a special token this surely


@pytest.mark.clause("GEN-ORDINARY-TOKENS")
@pytest.mark.parametrize("family,length", [(f, "varied") for f in FAMILIES]
                         + [("text", "long")])
def test_rollout_samples_ordinary_tokens_only(setup, family, length):
    """`varied`: per-row caps, one empty row. `long`: the family with the fewest special
    tokens, with enough sampled tokens that a sampler not restricted to ordinary tokens draws
    one with probability >= SPECIAL_SEEN_P on a near-uniform random policy (a kill that does
    not hinge on the luck of a few short completions)."""
    import math

    from rlconform.fixtures.families import build_family

    _, engine, _, prompts, images = setup(family)
    fam = build_family(family)
    allowed = set(fam.ordinary_token_ids().tolist())
    eos = set(fam.eos_token_ids)
    if length == "long":
        caps = [LONG_CAP] * len(prompts)
    else:
        caps = _caps(len(prompts), 1)
        assert 0 in caps and MAX_NEW_TOKENS in caps, "test setup: caps without an empty row"
    batch = engine.generate(prompts, images, caps, seed=1)
    ids, mask = batch["input_ids"], batch["token_mask"].bool()
    if length == "long":
        vocab = len(fam.tokenizer.get_vocab())
        special = vocab - len(allowed) - len(eos)
        need = math.ceil(math.log(1 - SPECIAL_SEEN_P) / math.log(1 - special / vocab))
        assert int(mask.sum()) >= need, f"test setup: {int(mask.sum())} sampled tokens, " \
            f"{need} needed to see one of {special} special ids of {vocab}"
    lens, plens = batch["input_lengths"], batch["prompt_lengths"]
    gen = batch["generation_logprobs"]
    assert len(batch) == len(prompts), f"{len(batch)} rows for {len(prompts)} prompts"
    for i in range(len(batch)):
        want = torch.zeros_like(mask[i])
        want[int(plens[i]):int(lens[i])] = True
        assert torch.equal(mask[i], want), f"row {i}: token_mask is not exactly the completion"
        sampled = ids[i][mask[i]].tolist()
        assert len(sampled) <= caps[i], \
            f"row {i}: {len(sampled)} completion tokens for a cap of {caps[i]}"
        # EOS is an allowed stop: only as the last token of a completion
        special = sorted(set(sampled[:-1]) - allowed) + \
            sorted(set(sampled[-1:]) - allowed - eos)
        assert not special, f"row {i}: sampled non-ordinary token ids {special}"
        assert bool((gen[i][~mask[i]] == 0).all()), \
            f"row {i}: generation_logprobs non-zero outside the completion"
        on = gen[i][mask[i]]
        assert bool(torch.isfinite(on).all() and (on < 0).all()), \
            f"row {i}: generation_logprobs on the completion must be finite and < 0"


# -- GEN-GROUP-INDEPENDENT ----------------------------------------------------------------
INDEPENDENT_GROUP = 4  # members of each group of identical requests
INDEPENDENT_SEED = 3


def _sampling_logq(model, fam, allowed, prompt, imgs, completion, settings) -> torch.Tensor:
    """float64 log-probability of each completion token under the sampling distribution the
    rollout contract fixes (temperature 1, no top-k/top-p, ordinary tokens and EOS only), from
    the reference model's own forward of the row, raised by GEN_INDEPENDENT_SLACK and capped at
    0. A token outside that set (GEN-ORDINARY-TOKENS's business) counts as certain: log 0."""
    inputs = row_inputs(fam, prompt, imgs, completion, settings.dtype, settings.device)
    p, t = inputs["input_ids"].shape[1] - completion.numel(), completion.numel()
    logits = model(**inputs, use_cache=False).logits[0, p - 1:p - 1 + t].double()
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    keep[allowed.to(logits.device)] = True
    logq = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    logq = logq.gather(-1, completion.to(logits.device)[:, None])[:, 0].cpu()
    logq = logq + math.log(GEN_INDEPENDENT_SLACK)
    return torch.where(keep.cpu()[completion], logq.clamp(max=0.0), torch.zeros_like(logq))


def _repeats(comps: list[list[int]], logq: list[torch.Tensor]
             ) -> list[tuple[float, int, int, list[int]]]:
    """(log bound, anchor a, prefix length k, the members repeating it) for every member a of
    one group and every k up to its completion's length. Given a's completion, every other
    member independently repeats its first k tokens with probability pi = prod_{t<k} q(a_t),
    so how many do is Binomial(G - 1, pi) and P(at least m) <= C(G - 1, m) pi^m."""
    out = []
    for a, ca in enumerate(comps):
        cum = torch.cumsum(logq[a], 0).tolist()
        for k in range(1, len(ca) + 1):
            same = [j for j, cj in enumerate(comps) if j != a and cj[:k] == ca[:k]]
            m = len(same)
            bound = math.log(math.comb(len(comps) - 1, m)) + m * cum[k - 1] if m else 0.0
            out.append((bound, a, k, same))
    return out


@pytest.mark.clause("GEN-GROUP-INDEPENDENT")
@pytest.mark.parametrize("family", ("qwen2_vl", "smolvlm", "text"))
def test_group_members_are_sampled_independently(record_metric, setup, family):
    """Groups of INDEPENDENT_GROUP identical requests (image families: groups of 1, 0 and 2
    images) in one call; each member's completion scored by the reference model. The chance
    that an engine sampling its members independently fails this test is below
    GEN_INDEPENDENT_ALPHA (a Bonferroni split over every (member, prefix length) check), at
    any width and whatever the policy: the bound is exact for the distribution the model
    gives, so a peaked production policy only costs power, which the test checks it has."""
    from rlconform.fixtures.families import build_family

    settings, engine, _, prompts, images = setup(family, n_prompts=len(MIXED),
                                                 group=INDEPENDENT_GROUP)
    batch = engine.generate(prompts, images, MAX_NEW_TOKENS, seed=INDEPENDENT_SEED)
    assert len(batch) == len(prompts), f"{len(batch)} rows for {len(prompts)} requests"
    fam = build_family(family)
    allowed = torch.cat([fam.ordinary_token_ids(),
                         torch.tensor(fam.eos_token_ids, dtype=torch.long)]).unique()
    model = fam.build_model(seed=settings.seed, dtype=settings.dtype, device=settings.device)
    plens, lens = batch["prompt_lengths"].tolist(), batch["input_lengths"].tolist()
    groups = []
    with torch.no_grad():
        for g in range(0, len(prompts), INDEPENDENT_GROUP):
            rows = range(g, g + INDEPENDENT_GROUP)
            comps = [batch["input_ids"][i, plens[i]:lens[i]] for i in rows]
            assert all(c.numel() for c in comps), \
                f"rows {list(rows)}: an empty completion for a cap of {MAX_NEW_TOKENS}"
            logq = [_sampling_logq(model, fam, allowed, prompts[i], images[i], c, settings)
                    for i, c in zip(rows, comps)]
            groups.append((g, [c.tolist() for c in comps], logq))
    del model
    checks = sum(len(c) for _, comps, _ in groups for c in comps)
    threshold = math.log(GEN_INDEPENDENT_ALPHA / checks)
    # a group whose every member repeated one completion must fall below the threshold
    collapse = [min((INDEPENDENT_GROUP - 1) * float(q.sum()) for q in logq)
                for _, _, logq in groups]
    record_metric("collapsed_group_log10_bound", max(collapse) / math.log(10))
    assert max(collapse) < threshold, \
        f"test setup: a fully collapsed group would have probability bound " \
        f"10^{max(collapse) / math.log(10):.3g}, not below the threshold " \
        f"10^{threshold / math.log(10):.3g}: the policy is too peaked for {MAX_NEW_TOKENS} tokens"
    found, least = {}, 0.0  # group -> its least bound below the threshold
    for g, comps, logq in groups:
        for bound, a, k, same in _repeats(comps, logq):
            least = min(least, bound)
            if bound < threshold and bound < found.get(g, (0.0,))[0]:
                found[g] = (bound, a, k, same, comps[a][:k])
    record_metric("agreement_log10_bound", least / math.log(10))
    bad = [f"rows {[g + j for j in same]} repeat row {g + a}'s first {k} tokens {ids}: "
           f"probability <= 10^{bound / math.log(10):.3g} for independent draws"
           for g, (bound, a, k, same, ids) in sorted(found.items())]
    assert not bad, "members of a group of identical requests were not sampled " \
        f"independently (false-alarm rate {GEN_INDEPENDENT_ALPHA:g} over {checks} checks): " + \
        "; ".join(bad)


# -- GEN-REFIT-SYNC -----------------------------------------------------------------------
@pytest.mark.clause("GEN-REFIT-SYNC")
@pytest.mark.parametrize("family", ("qwen2_vl", "text"))
def test_engine_stays_in_sync_across_refits(transport, codec, meta_cls, dtype, record_metric,
                                            setup, family):
    settings, engine, make_trainer, prompts, images = setup(family, n_prompts=2)
    trainer = make_trainer(settings, transport, codec)
    failures = []
    for step in range(REFIT_STEPS):
        batch = engine.generate(prompts, images, _caps(len(prompts), step), seed=step)
        batch = for_trainer(make_trainer, batch, prompts, images)
        out = dataplane_step(batch, trainer, transport, codec, meta_cls, _partition(),
                             rewards=_rewards(len(batch)), group_size=GROUP)
        failures += [f"step {step}: {b}" for b in _agreement(out, dtype, record_metric, step)]
        engine.refit(trainer.state_dict())
    assert not failures, "engine out of sync with the trainer after a refit: " + \
        "; ".join(failures)
