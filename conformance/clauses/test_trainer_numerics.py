"""Trainer numerics against expected values that do not come from the trainer under test.

TRAIN-LEGACY-PARITY compares a backend with itself (data plane vs in memory), so a defect in
code both paths share is invisible there. These clauses take their expected values elsewhere:
- TRAIN-SPLIT-INVARIANCE: the same step cut into other micro-batches and data-parallel shards
  (a split-dependent aggregation cannot agree with itself);
- TRAIN-LOSS-CLOSED-FORM: the stored prev logprobs are the trainer's own shifted by chosen
  per-token offsets, so every ratio is a known number (both clip bounds crossed, both advantage
  signs), and the loss and its gradient w.r.t. the logits follow by plain arithmetic here;
- TRAIN-GRAD-RECOMPUTE: the written-out token-mean clipped loss, through plain autograd, on an
  independent copy of the initial model fed from the processor's output row by row.

Only the trainer surface is used: `backend.trainer(settings, transport, codec)` with
`compute_logprobs`, `train` (through the reference driver step), `model` (watched with hooks:
its logits and the gradients accumulated into its parameters) and `state_dict`. Completions
run to different lengths, one row has none, so every aggregation choice shows.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

import pytest
import torch
from torch import Tensor

from rlconform.conformance.catalogue_trainer import (
    CLOSED_FORM_LOSS_RTOL,
    CLOSED_FORM_RATIOS,
    GRAD_RTOL,
    LOGIT_GRAD_RTOL,
    RATIO_CANARY_RTOL,
    TRUNCATION_LOGPROB_TOL,
    UPDATE_RTOL,
    loss_reorder_tol,
)
from rlconform.conformance.clauses._memory import new_trainer
from rlconform.conformance.clauses.test_trainer import GROUP, Rollouts
from rlconform.reference_impl.grpo import dataplane_step, mint_keys
from rlconform.reference_impl.recording import RecordingTransport

# M-RoPE with computed positions, dim-1 packed tiles, text only
FAMILIES = ("qwen2_vl", "smolvlm", "text")
# families whose row logprobs are bitwise whatever the micro-batch (CPU, eager attention):
# measured over seeds 0-5, fp32 and bf16, micro-batches of 1, 2 and 6 (also gemma3). Qwen2-VL
# runs every image of a micro-batch through one vision-tower matmul: fp32 loss-token logprobs
# then move by up to 4.8e-7 (seeds 3 and 4), so it gets the tolerance.
SPLIT_BITWISE_FAMILIES = ("smolvlm", "text")
# one per row of the 3-prompt x 2 batch: distinct, both signs in every group
ADVANTAGES = (1.0, -0.5, 0.75, -1.25, 0.5, -0.25)
CLIP = 0.2  # TrainerSettings' default clip_low == clip_high


@pytest.fixture(scope="module")
def rollouts(device, dtype, seed):
    """As in test_trainer.py: one intra-op thread on CPU."""
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    yield Rollouts.shared(device, dtype, seed)
    torch.set_num_threads(threads)


# -- observing the trainer ----------------------------------------------------------------
class GradCapture:
    """The gradient accumulated into each parameter of `model` by the last backward of the
    step (post-accumulate hooks), i.e. before clipping and the optimizer step."""

    def __init__(self, model: torch.nn.Module):
        self._last: dict[str, Tensor] = {}
        self._hooks = [p.register_post_accumulate_grad_hook(
            lambda p, n=n: self._last.__setitem__(n, p.grad.detach().clone()))
            for n, p in model.named_parameters() if p.requires_grad]

    def remove(self) -> dict[str, Tensor]:
        """The gradients, where they were and in their own dtype (compared tensor by tensor
        there: at production widths a float64 pass over them on the CPU takes seconds)."""
        for h in self._hooks:
            h.remove()
        return dict(self._last)


@dataclass
class LogitRecord:
    input_ids: Tensor
    attention_mask: Tensor
    logits: Tensor  # [B, K, V] as the model returned them (K <= S: the last K positions)
    grad: list = field(default_factory=list)  # dL/dlogits, filled by the backward


class LogitCapture:
    """Every forward of `model` that builds a graph: its inputs, logits and dL/dlogits."""

    def __init__(self, model: torch.nn.Module):
        self.records: list[LogitRecord] = []

        def hook(module, args, kwargs, output):
            logits = getattr(output, "logits", None)
            if logits is None or not logits.requires_grad:
                return
            ids = kwargs.get("input_ids", args[0] if args else None)
            mask = kwargs.get("attention_mask")
            mask = torch.ones_like(ids) if mask is None else mask
            rec = LogitRecord(ids.detach().cpu(), mask.detach().cpu(),
                              logits.detach().double().cpu())
            logits.register_hook(lambda g: rec.grad.append(g.detach().double().cpu()))
            self.records.append(rec)

        self._hook = model.register_forward_hook(hook, with_kwargs=True)

    def remove(self) -> None:
        self._hook.remove()


def _ratio(k: int) -> float:
    """The ratio chosen for the k-th completion token of any row."""
    return CLOSED_FORM_RATIOS[k % len(CLOSED_FORM_RATIOS)]


class ShiftPrev:
    """Stores the trainer's prev_logprobs shifted by -ln(r) on every completion token, so the
    train pass (whose logprobs equal the unshifted ones bitwise: TRAIN-RATIO-ONE) sees ratio r.
    """

    def __init__(self, inner, batch, keys: list[str]):
        self.inner = inner
        self.row = {k: i for i, k in enumerate(keys)}
        self.plen = batch["prompt_lengths"].tolist()
        self.len = batch["input_lengths"].tolist()

    def put(self, partition, keys, columns, tags=None):
        col = columns.get("prev_logprobs")
        if col is not None:
            assert col.is_nested, "test setup: prev_logprobs was put as a dense column"
            shift = torch.zeros_like(col.values())
            offsets = col.offsets().tolist()
            for j, key in enumerate(keys):
                i = self.row[key]
                for k in range(self.len[i] - self.plen[i]):
                    shift[offsets[j] + self.plen[i] + k] = -math.log(_ratio(k))
            columns = {**columns, "prev_logprobs": torch.nested.nested_tensor_from_jagged(
                col.values() + shift, offsets=col.offsets())}
        self.inner.put(partition, keys, columns, tags)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@dataclass
class Step:
    out: object  # the driver's StepOutcome: loss, grad norm, metrics, updated state_dict
    grads: dict[str, Tensor]
    initial: dict[str, Tensor] | None  # the trainer's weights before the step (when kept)
    prev: dict[int, Tensor]  # batch row -> the prev_logprobs row the trainer put
    logits: list[LogitRecord]
    normalizer: int
    eager: bool  # the model runs eager attention: a row's logprobs can be batch-invariant


def _step(backend, transport, codec, meta_cls, settings, batch, world: int = 1,
          shift: bool = False, logits: bool = False, model_copy=None,
          initial: dict[str, Tensor] | None = None) -> Step:
    """One driver step through the backend's trainer, watched. Keeps the initial weights
    (CPU, own dtype) unless `initial` is given, which they must then equal: one copy serves
    every split of a step, so only one trainer's worth of tensors is alive at a time."""
    uid = f"n{uuid.uuid4().hex[:6]}"
    keys = mint_keys(len(batch), GROUP, uid)
    rec = RecordingTransport(transport)
    inner = ShiftPrev(rec, batch, keys) if shift else rec
    trainer = new_trainer(backend, settings, inner, codec)
    start = trainer.state_dict()
    if initial is not None:
        differ = [k for k in initial if k not in start or not torch.equal(start[k].cpu(),
                                                                          initial[k])]
        assert not differ, f"the trainer starts from other weights than the first split's: " \
            f"{differ[:3]}"
        kept = None
    else:
        kept = {k: v.detach().to("cpu", copy=True) for k, v in start.items()}
    if model_copy is not None:
        model_copy.load_state_dict(start)
    del start
    grads = GradCapture(trainer.model)
    cap = LogitCapture(trainer.model) if logits else None
    try:
        out = dataplane_step(batch, trainer, inner, codec, meta_cls,
                             f"num-{uuid.uuid4().hex[:8]}", uid=uid, world=world,
                             group_size=GROUP, advantages=torch.tensor(ADVANTAGES[:len(batch)]))
    finally:
        grad = grads.remove()
        if cap is not None:
            cap.remove()
    row = {k: i for i, k in enumerate(keys)}
    prev = {}
    for e in rec.put_of("prev_logprobs"):
        for k, r in zip(e.keys, e.data["prev_logprobs"].unbind()):
            prev[row[k]] = r.detach().cpu()
    assert grad, "no gradient was accumulated into the parameters of trainer.model"
    impl = getattr(getattr(trainer.model, "config", None), "_attn_implementation", None)
    return Step(out, grad, kept, prev, cap.records if cap else [],
                int(batch["token_mask"].sum()), impl == "eager")


def _sq(t: Tensor) -> float:
    return float(t.double().pow(2).sum())


def _diff(a: Tensor, b: Tensor) -> Tensor:
    """a - b in float64, on a's device (b follows it)."""
    return a.double() - b.to(a.device).double()


def _rel_l2(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    """||got - want|| / ||want|| over every tensor (float64, one tensor at a time)."""
    num = math.sqrt(sum(_sq(_diff(want[k], got[k])) for k in want))
    den = math.sqrt(sum(_sq(want[k]) for k in want))
    return num / den if den else (0.0 if num == 0 else math.inf)


def _update_rel_l2(after: dict[str, Tensor], base_after: dict[str, Tensor],
                   initial: dict[str, Tensor], device) -> float:
    """Relative L2 difference of two updates (W_after - W_initial) from the same weights."""
    num = math.sqrt(sum(_sq(_diff(after[k].to(device), base_after[k])) for k in initial))
    den = math.sqrt(sum(_sq(_diff(base_after[k].to(device), initial[k])) for k in initial))
    return num / den if den else (0.0 if num == 0 else math.inf)


def _grad_problems(got: dict[str, Tensor], want: dict[str, Tensor], tol: float) -> list[str]:
    """Per-parameter gradients: the same parameters, and within `tol` (relative L2) over all
    of them and in every tensor (a tensor's floor: its share of the whole gradient's norm)."""
    bad = []
    if set(got) != set(want):
        return [f"gradients for other parameters: missing {sorted(set(want) - set(got))[:4]}, "
                f"extra {sorted(set(got) - set(want))[:4]}"]
    total = _rel_l2(got, want)
    if not total <= tol:
        bad.append(f"gradient relative L2 difference {total:.3g} > {tol:g}")
    norm = math.sqrt(sum(_sq(w) for w in want.values()))
    floor = norm / math.sqrt(len(want))
    worst = sorted((math.sqrt(_sq(_diff(w, got[k]))) / max(math.sqrt(_sq(w)), floor), k)
                   for k, w in want.items())[::-1]
    if worst and not worst[0][0] <= tol:
        bad.append("per-parameter gradients differ: " + ", ".join(
            f"{k} {d:.3g}" for d, k in worst[:3] if d > tol))
    return bad


# -- TRAIN-SPLIT-INVARIANCE ---------------------------------------------------------------
# At production width each split is a full step of a 1.5-4B model, with two workers sharing
# one GPU (nightly, 2026-12-03 on an H200: 7 splits took 67-115 s per family, the longest tests
# of the run). There the clause runs the splits its defects need: micro-batches of unequal token
# counts (per-micro-batch normalisation, the advantage axis), a token budget (dynamic batching),
# and ranks, evenly and unevenly sharded (the data-parallel divisor). The other two repeat those
# cuts at other sizes; the tiny models run all seven.
_PRODUCTION_SPLITS = ("one micro-batch", "micro-batches of 1", "token budget",
                      "3 ranks x micro-batches of 1", "2 ranks x token budget")


def _splits(n: int, longest: int) -> dict[str, tuple[int, dict]]:
    """name -> (world, settings): every split of one step; the first is the baseline."""
    from rlconform.fixtures.sizes import PRODUCTION, model_size

    budget = {"max_tokens_per_micro_batch": 2 * longest}  # one to three rows per micro-batch
    splits = {
        "one micro-batch": (1, {"micro_batch_size": n}),
        "micro-batches of 1": (1, {"micro_batch_size": 1}),
        "micro-batches of 2": (1, {"micro_batch_size": 2}),
        "token budget": (1, budget),
        "2 ranks x micro-batches of 2": (2, {"micro_batch_size": 2}),
        "3 ranks x micro-batches of 1": (3, {"micro_batch_size": 1}),
        "2 ranks x token budget": (2, budget),
    }
    if model_size() == PRODUCTION:
        splits = {k: v for k, v in splits.items() if k in _PRODUCTION_SPLITS}
    return splits


@pytest.mark.clause("TRAIN-SPLIT-INVARIANCE")
@pytest.mark.parametrize("family", FAMILIES)
def test_step_is_invariant_to_micro_batches_and_shards(backend, transport, codec, meta_cls,
                                                       device, dtype, record_metric,
                                                       rollouts, family):
    batch, _, _ = rollouts.get(family)
    n, counts = len(batch), batch["token_mask"].sum(dim=1).tolist()
    assert len(set(counts)) > 2 and 0 in counts, \
        f"test setup: rows must differ in loss tokens, one with none: {counts}"
    splits = _splits(n, int(batch.seq_lens.max()))
    (base_name, (world, kw)), *others = splits.items()
    base = _step(backend, transport, codec, meta_cls, rollouts.settings(family, **kw), batch,
                 world=world)
    assert base.out.grad_norm > 0, "test setup: zero gradient makes the comparison vacuous"
    # at ratio 1 each token's loss is -A: the loss's absolute mass is known without the trainer
    l1 = sum(abs(a) * c for a, c in zip(ADVANTAGES, counts)) / base.normalizer
    loss_tol = loss_reorder_tol(base.normalizer, l1)
    bitwise = base.eager and device == "cpu" and family in SPLIT_BITWISE_FAMILIES
    lp_tol = 0.0 if bitwise else TRUNCATION_LOGPROB_TOL[dtype]
    # a row's logprobs on its loss tokens (the prompt's are consumed by nothing: Qwen2-VL's
    # differ at a few image positions of two-image rows when the micro-batch changes)
    loss_pos = [batch["token_mask"][i, :int(batch.seq_lens[i])].nonzero().flatten()
                for i in range(n)]
    failures, seen = [], {}
    for name, (world, kw) in [(base_name, (1, None))] + others:  # one at a time, then dropped
        r = base if kw is None else _step(backend, transport, codec, meta_cls,
                                          rollouts.settings(family, **kw), batch, world=world,
                                          initial=base.initial)
        ratio = r.out.metrics["probs_ratio"]
        if not (ratio.numel() == base.normalizer and bool((ratio == 1.0).all())):
            failures.append(f"{name}: probs_ratio is not 1.0 on every one of "
                            f"{base.normalizer} loss tokens (the step's own prev and train "
                            "passes share its micro-batches: bitwise)")
        if r is base:
            continue
        dl = abs(r.out.loss - base.out.loss)
        dg = abs(r.out.grad_norm - base.out.grad_norm) / base.out.grad_norm
        grad = _rel_l2(r.grads, base.grads)
        du = _update_rel_l2(r.out.state_dict, base.out.state_dict, base.initial, device)
        lp = max(float((r.prev[i] - base.prev[i])[loss_pos[i]].abs().max())
                 if loss_pos[i].numel() else 0.0 for i in range(n)) \
            if len(r.prev) == len(base.prev) == n else math.inf
        for k, v in (("split_loss_diff_over_l1", dl / l1), ("split_grad_norm_rel_diff", dg),
                     ("split_grad_rel_l2", grad), ("split_update_rel_l2", du),
                     ("split_logprob_max_abs_diff", lp)):
            seen.setdefault(k, []).append(v)
        bad = []
        if not dl <= loss_tol:
            bad.append(f"loss {r.out.loss!r} vs {base.out.loss!r} (|diff| {dl:.3g} > "
                       f"{loss_tol:.3g})")
        if not dg <= GRAD_RTOL[dtype]:
            bad.append(f"grad norm {r.out.grad_norm:.9g} vs {base.out.grad_norm:.9g} "
                       f"(relative {dg:.3g} > {GRAD_RTOL[dtype]:g})")
        bad += _grad_problems(r.grads, base.grads, GRAD_RTOL[dtype])
        if not du <= UPDATE_RTOL[dtype]:
            bad.append(f"weight update relative L2 difference {du:.3g} > "
                       f"{UPDATE_RTOL[dtype]:g}")
        if not lp <= lp_tol:
            bad.append(f"prev logprobs of a loss token moved by {lp:.3g} with its "
                       f"micro-batch (> {lp_tol:g}{', bitwise regime' if bitwise else ''})")
        if bad:
            failures.append(f"{name} vs {base_name}: " + "; ".join(bad))
        del r
    for k, v in seen.items():  # one value per split
        record_metric(k, v)
    assert not failures, "the step depends on how it is cut (token counts per row " \
        f"{counts}):\n  " + "\n  ".join(failures)


# -- TRAIN-LOSS-CLOSED-FORM ---------------------------------------------------------------
def _clip(r: float) -> float:
    return min(max(r, 1.0 - CLIP), 1.0 + CLIP)


def _token_loss(r: float, a: float) -> float:
    """-min(r A, clip(r) A): the clipped surrogate of one token."""
    return -min(r * a, _clip(r) * a)


def _token_coef(r: float, a: float) -> float:
    """d(token loss)/d(logp) = -A r where the unclipped term is the minimum, else 0."""
    if _clip(r) == r or r * a < _clip(r) * a:
        return -a * r
    return 0.0


def _expected_terms(batch) -> tuple[list[tuple[int, int, float, float]], set]:
    """(row, k, r, A) per loss token, and the (sign of A, side of the clip range) covered."""
    plen, lens = batch["prompt_lengths"].tolist(), batch["input_lengths"].tolist()
    terms, cover = [], set()
    for i in range(len(batch)):
        for k in range(lens[i] - plen[i]):
            r, a = _ratio(k), ADVANTAGES[i]
            terms.append((i, k, r, a))
            if _clip(r) != r:
                cover.add((a > 0, r > 1))
    return terms, cover


@pytest.mark.clause("TRAIN-LOSS-CLOSED-FORM")
@pytest.mark.parametrize("family", ("qwen2_vl", "text"))
def test_loss_and_logit_gradient_match_the_closed_form(backend, transport, codec, meta_cls,
                                                       dtype, record_metric, rollouts,
                                                       family):
    batch, _, _ = rollouts.get(family)
    terms, cover = _expected_terms(batch)
    assert cover == {(True, True), (True, False), (False, True), (False, False)}, \
        f"test setup: ratios must cross both clip bounds for both advantage signs: {cover}"
    n = len(terms)
    want_loss = sum(_token_loss(r, a) for _, _, r, a in terms) / n
    l1 = sum(abs(_token_loss(r, a)) for _, _, r, a in terms) / n
    st = _step(backend, transport, codec, meta_cls, rollouts.settings(family), batch,
               shift=True, logits=True)
    got_ratio = st.out.metrics["probs_ratio"].double()
    want_ratio = torch.tensor(sorted(r for _, _, r, _ in terms), dtype=torch.float64)
    assert got_ratio.numel() == n, f"probs_ratio has {got_ratio.numel()} values for {n} tokens"
    assert torch.allclose(got_ratio.sort().values, want_ratio, rtol=RATIO_CANARY_RTOL, atol=0), \
        "probs_ratio does not follow the stored prev logprobs (test setup for the closed form)"
    record_metric("closed_form_loss_diff_over_l1", abs(st.out.loss - want_loss) / l1)
    tol = CLOSED_FORM_LOSS_RTOL * l1
    assert abs(st.out.loss - want_loss) <= tol, (
        f"step loss {st.out.loss:.9g}, closed form {want_loss:.9g} (token-mean of "
        f"-min(rA, clip(r)A) over {n} loss tokens; |diff| {abs(st.out.loss - want_loss):.3g} "
        f"> {tol:.3g}); sequence-mean would give "
        f"{_seq_mean(terms, len(batch)):.9g}")

    # dL/dlogits: (1/N) * coef(r, A) * (onehot(y) - softmax(z)) at the position predicting a
    # loss token, exactly 0 everywhere else (prompt, padding, clipped tokens)
    coef = {(i, k): _token_coef(r, a) / n for i, k, r, a in terms}
    plen = batch["prompt_lengths"].tolist()
    assert st.logits, "no forward of trainer.model built a graph in the train pass"
    worst, errors, nonzero = 0.0, [], []
    seen = set()
    for f, rec in enumerate(st.logits):
        assert len(rec.grad) == 1, f"train forward {f}: its logits got {len(rec.grad)} gradients"
        g, z = rec.grad[0], rec.logits
        s, kept = rec.input_ids.shape[1], z.shape[1]
        rows = _match_exact(rec.input_ids, rec.attention_mask, batch)
        for r, (i, left) in enumerate(rows):
            for q in range(kept):
                p = s - kept + q  # the input position whose logits these are ...
                k = p - left + 1 - plen[i]  # ... predicting the row's k-th completion token
                c = coef.get((i, k), 0.0)
                if (i, k) in coef:
                    seen.add((i, k))
                if c == 0.0:
                    if bool((g[r, q] != 0).any()):
                        nonzero.append(f"row {i} position {p}")
                    continue
                want = -c * torch.softmax(z[r, q], dim=-1)
                want[int(rec.input_ids[r, p + 1])] += c
                err = float((g[r, q] - want).abs().sum() / want.abs().sum())
                worst = max(worst, err)
                if err > LOGIT_GRAD_RTOL[dtype]:
                    errors.append(f"row {i} token {p + 1}: L1 error {err:.3g}, vocabulary "
                                  f"sum {float(g[r, q].sum()):.3g} (closed form 0)")
    record_metric("closed_form_logit_grad_l1_rel", worst)
    missing = sorted(set(coef) - seen)
    assert not missing, f"no train forward scored loss tokens {missing[:6]}"
    assert not nonzero, "gradient w.r.t. logits where the loss has none (prompt, padding or " \
        "a clipped token): " + ", ".join(nonzero[:6])
    assert not errors, "gradient w.r.t. the logits differs from (1/N) coef (onehot - " \
        f"softmax) (> {LOGIT_GRAD_RTOL[dtype]:g}): " + "; ".join(errors[:4])


def _match_exact(ids: Tensor, mask: Tensor, batch) -> list[tuple[int, int]]:
    """For each forward row, (the batch row with exactly its tokens, the left padding before
    them): right- or left-padded forwards alike; exactly one batch row must match."""
    lens = batch["input_lengths"].tolist()
    out = []
    for r in range(ids.shape[0]):
        at = mask[r].nonzero().flatten()
        n, left = int(at.numel()), int(at[0]) if at.numel() else 0
        assert n and int(at[-1]) - left + 1 == n, f"forward row {r}: its tokens are not " \
            "one contiguous run under the attention mask"
        tokens = ids[r, left:left + n].to(torch.long)
        hits = [j for j, k in enumerate(lens) if k == n
                and torch.equal(batch["input_ids"][j, :n], tokens)]
        assert len(hits) == 1, f"forward row {r} ({n} tokens) matches batch rows {hits}"
        out.append((hits[0], left))
    return out


def _seq_mean(terms, rows: int) -> float:
    per_row: dict[int, list[float]] = {}
    for i, _, r, a in terms:
        per_row.setdefault(i, []).append(_token_loss(r, a))
    return sum(sum(v) / len(v) for v in per_row.values()) / rows


# -- TRAIN-GRAD-RECOMPUTE -----------------------------------------------------------------
def _row_inputs(fam, prompt, images, completion: Tensor, dtype, device) -> dict[str, Tensor]:
    """One row as the processor gives it, the completion appended (per-token maps zero over
    it), floating media in the policy dtype: no batch, no padding, no trainer code."""
    feats = fam.process([prompt], [list(images)])
    t = completion.numel()
    out = {}
    for k, v in feats.items():
        if k == "input_ids":
            v = torch.cat([v, completion[None].to(v.dtype)], dim=1)
        elif k == "attention_mask":
            v = torch.ones(1, v.shape[1] + t, dtype=v.dtype)
        elif v.dim() == 2 and v.shape[:2] == feats["input_ids"].shape:  # per-token map
            v = torch.cat([v, torch.zeros(1, t, dtype=v.dtype)], dim=1)
        elif v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.to(device)
    return out


@pytest.mark.clause("TRAIN-GRAD-RECOMPUTE")
@pytest.mark.parametrize("family", ("qwen2_vl", "text"))
def test_step_gradient_equals_an_independent_recompute(backend, transport, codec, meta_cls,
                                                       device, dtype, record_metric,
                                                       rollouts, family):
    from rlconform.fixtures.families import build_family

    batch, prompts, images = rollouts.get(family)
    fam = build_family(family)
    settings = rollouts.settings(family)
    model = fam.build_model(seed=settings.seed, dtype=dtype, device=device)
    st = _step(backend, transport, codec, meta_cls, settings, batch, world=2, shift=True,
               model_copy=model)
    model.train(False)
    model.zero_grad(set_to_none=True)
    terms, _ = _expected_terms(batch)
    n = len(terms)
    plen, lens = batch["prompt_lengths"].tolist(), batch["input_lengths"].tolist()
    total = torch.zeros((), dtype=torch.float64)
    for i in range(len(batch)):
        k = lens[i] - plen[i]
        if k == 0:
            continue
        completion = batch["input_ids"][i, plen[i]:lens[i]]
        inputs = _row_inputs(fam, prompts[i], images[i], completion, dtype, device)
        logits = model(**inputs, use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits[plen[i] - 1:lens[i] - 1], dim=-1)
        logp = logp.gather(-1, inputs["input_ids"][0, plen[i]:lens[i], None]).squeeze(-1)
        shift = torch.tensor([-math.log(_ratio(j)) for j in range(k)], device=logp.device)
        ratio = torch.exp(logp - (logp.detach() + shift))
        a = ADVANTAGES[i]
        loss = -torch.minimum(ratio * a, ratio.clamp(1 - CLIP, 1 + CLIP) * a).sum() / n
        loss.backward()
        total += loss.detach().double().cpu()
    want = {name: p.grad.detach() if p.grad is not None else torch.zeros_like(p)
            for name, p in model.named_parameters() if p.requires_grad}
    got = {k: st.grads.get(k, torch.zeros_like(w)) for k, w in want.items()}
    missing = sorted(set(want) - set(st.grads))
    want_norm = math.sqrt(sum(_sq(w) for w in want.values()))
    l1 = sum(abs(_token_loss(r, a)) for _, _, r, a in terms) / n
    dl = abs(st.out.loss - float(total))
    dn = abs(st.out.grad_norm - want_norm) / want_norm
    record_metric("recompute_loss_diff_over_l1", dl / l1)
    record_metric("recompute_grad_norm_rel_diff", dn)
    record_metric("recompute_grad_rel_l2", _rel_l2(got, want))
    bad = []
    if missing and any(bool((want[k] != 0).any()) for k in missing):
        bad.append(f"no gradient reached {missing[:4]}")
    if not dl <= CLOSED_FORM_LOSS_RTOL * l1:
        bad.append(f"loss {st.out.loss:.9g} vs recompute {float(total):.9g}")
    if not dn <= GRAD_RTOL[dtype]:
        bad.append(f"grad norm {st.out.grad_norm:.9g} vs recompute {want_norm:.9g} "
                   f"(relative {dn:.3g} > {GRAD_RTOL[dtype]:g})")
    bad += _grad_problems(got, want, GRAD_RTOL[dtype])
    assert not bad, "the step differs from an autograd recompute of the token-mean clipped " \
        "loss on an independent copy of the initial model (2 ranks):\n  " + "\n  ".join(bad)
