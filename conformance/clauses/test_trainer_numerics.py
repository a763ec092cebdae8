"""Trainer numerics against expected values that do not come from the trainer under test.

TRAIN-LEGACY-PARITY compares a backend with itself (data plane vs in memory), so a defect in
code both paths share is invisible there. These clauses take their expected values elsewhere:
- TRAIN-SPLIT-INVARIANCE: the same step cut into other micro-batches and data-parallel shards
  (a split-dependent aggregation cannot agree with itself);
- TRAIN-LOSS-CLOSED-FORM: the stored prev (reference, generation) logprobs are the trainer's own
  shifted by chosen per-token offsets, so every ratio, KL offset and importance weight is a
  known number, and the loss and its gradient w.r.t. the logits follow by plain arithmetic here;
- TRAIN-GRAD-RECOMPUTE: the written-out objective, through plain autograd, on an independent
  copy of the model fed from the processor's output row by row, for every optimizer step;
- TRAIN-RATIO-LATER-STEPS: a later optimizer step's ratio against an independent forward of
  the weights the trainer had before that step.
Each runs at the default point and at the points of the GRPO configuration grid
(catalogue.trainer.GRID, docs/grpo-configurations.md) the backend declares; every grid case
first asserts that its input is in the regime where its option changes the answer
(`assert_regime`), and `objective` writes each point out once, row by row, in float64.

Only the trainer surface is used: `backend.trainer(settings, transport, codec)` with
`compute_logprobs`, `train` (through the reference driver step), `model` (watched with hooks:
its logits, the gradients accumulated into its parameters, and through torch's global optimizer
step hooks the gradient and weights of every optimizer step; where the trainer offers `watch`,
the watchers are built where its step runs: clauses/_watch.py) and `state_dict`. Completions run
to different lengths, one row has none, so every aggregation choice shows.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from functools import partial

import pytest
import torch
from torch import Tensor

from rlconform.conformance.catalogue.trainer import (
    CLOSED_FORM_LOSS_RTOL,
    CLOSED_FORM_POINTS,
    CLOSED_FORM_RATIOS,
    GRAD_RTOL,
    GRID,
    GRID_RATIOS,
    GSPO_ROW_RATIOS,
    IS_WEIGHTS,
    KL_OFFSETS,
    KL_PROMPT_OFFSETS,
    LATER_RATIOS,
    LATER_STEP_LOG_RATIO_TOL,
    LATER_STEP_POINTS,
    LOGIT_GRAD_RTOL,
    RATIO_CANARY_RTOL,
    RECOMPUTE_POINTS,
    SPLIT_POINTS,
    TRUNCATION_LOGPROB_TOL,
    UPDATE_RTOL,
    loss_reorder_tol,
)
from rlconform.conformance.clauses._gc import new_trainer
from rlconform.conformance.clauses._row_inputs import row_inputs
from rlconform.conformance.clauses._watch import (
    GradCapture,
    LogitCapture,
    LogitRecord,
    OptimizerStep,
    OptimizerSteps,
    watching,
)
from rlconform.conformance.clauses.test_trainer import GROUP, settings_not_declared
from rlconform.conformance.engine.items import NA_PREFIX
from rlconform.reference_impl.grpo import dataplane_step, mint_keys
from rlconform.reference_impl.loss import LossConfig
from rlconform.reference_impl.recording import RecordingTransport
from rlconform.reference_impl.trainer import mini_batch_rows

# M-RoPE with computed positions, dim-1 packed tiles, text only
FAMILIES = ("qwen2_vl", "smolvlm", "text")
# families whose row logprobs are bitwise whatever the micro-batch (CPU, eager attention):
# measured over seeds 0-5, fp32 and bf16, micro-batches of 1, 2 and 6 (also gemma3). Qwen2-VL
# runs every image of a micro-batch through one vision-tower matmul: fp32 loss-token logprobs
# then move by up to 4.8e-7 (seeds 3 and 4), so it gets the tolerance.
SPLIT_BITWISE_FAMILIES = ("smolvlm", "text")
# one per row of the 3-prompt x 2 batch: distinct, both signs in every group
ADVANTAGES = (1.0, -0.5, 0.75, -1.25, 0.5, -0.25)



# -- the stored columns of one step, chosen per token -------------------------------------
@dataclass(frozen=True)
class Design:
    """What the test stores in place of the trainer's own columns, per loss token: prev shifted
    by -ln r (so the train pass, whose logprobs equal the prev pass's bitwise, TRAIN-RATIO-ONE,
    sees ratio r), the reference shifted so that logp - reference = d, and generation logprobs
    with exp(prev - gen) = q. A column without a design is stored as the trainer wrote it."""

    ratios: dict  # (row, k) -> r
    kl: dict | None = None  # (row, k) -> d
    is_weights: dict | None = None  # (row, k) -> q


def _wobble(k: int, n: int) -> float:
    """GSPO's per-token factors: 1.1 and 1 / 1.1 in pairs, 1 for an odd last token, so a row's
    geometric mean is its chosen sequence ratio and the product of its ratios is not."""
    if k % 2 == 1:
        return 1.0 / 1.1
    return 1.1 if k + 1 < n else 1.0


def design(cfg: LossConfig, batch, point: str) -> Design:
    """The chosen numbers of `point` for `batch` (module docstring; catalogue.trainer.GRID)."""
    plen, lens = batch["prompt_lengths"].tolist(), batch["input_lengths"].tolist()
    cycle = CLOSED_FORM_RATIOS if point == "default" else \
        LATER_RATIOS if cfg.optimizer_steps > 1 else GRID_RATIOS
    ratios, kl, isw = {}, {}, {}
    seen = {True: 0, False: 0}  # GSPO: the targets go to the rows of each sign in turn
    for i in range(len(batch)):
        n = lens[i] - plen[i]
        target = None
        if cfg.ratio_level == "sequence" and n:
            pos = ADVANTAGES[i] > 0
            target = GSPO_ROW_RATIOS[(0 if pos else 1) + 2 * seen[pos]]
            seen[pos] = (seen[pos] + 1) % 3
        for k in range(n):
            ratios[i, k] = cycle[k % len(cycle)] if target is None else target * _wobble(k, n)
            kl[i, k] = KL_OFFSETS[k % len(KL_OFFSETS)]
            isw[i, k] = IS_WEIGHTS[k % len(IS_WEIGHTS)]
        for j in range(1, plen[i] + 1):  # the prompt's tokens, k = -1, -2, ...
            kl[i, -j] = KL_PROMPT_OFFSETS[(j - 1) % len(KL_PROMPT_OFFSETS)]
    return Design(ratios, kl if cfg.kl_coef else None, isw if cfg.is_cap is not None else None)


class SetColumns:
    """Stores the trainer's prev (and reference) logprobs shifted by the design, and with the
    prev put also the designed generation logprobs (a column the driver wrote at the rollout)."""

    def __init__(self, inner, batch, keys: list[str], plan: Design):
        self.inner = inner
        self.plan = plan
        self.row = {k: i for i, k in enumerate(keys)}
        self.plen = batch["prompt_lengths"].tolist()

    def _shifted(self, col, keys, by) -> Tensor:
        assert col.is_nested, "test setup: a logprob column was put as a dense column"
        values = col.values().clone()
        offsets = col.offsets().tolist()
        for j, key in enumerate(keys):
            i = self.row[key]
            for k in range(offsets[j + 1] - offsets[j]):
                v = by(i, k - self.plen[i])
                if v is not None:
                    values[offsets[j] + k] += v
        return torch.nested.nested_tensor_from_jagged(values, offsets=col.offsets())

    def put(self, partition, keys, columns, tags=None):
        plan = self.plan
        prev = columns.get("prev_logprobs")
        if prev is not None:
            prev = self._shifted(prev, keys, lambda i, k: None if (i, k) not in plan.ratios
                                 else -math.log(plan.ratios[i, k]))
            columns = {**columns, "prev_logprobs": prev}
        ref = columns.get("reference_logprobs")
        if ref is not None and plan.kl is not None:
            columns = {**columns, "reference_logprobs": self._shifted(
                ref, keys, lambda i, k: -plan.kl[i, k] if (i, k) in plan.kl else None)}
        self.inner.put(partition, keys, columns, tags)
        if prev is not None and plan.is_weights is not None:
            gen = self._shifted(prev, keys, lambda i, k: -math.log(plan.is_weights[i, k])
                                if (i, k) in plan.is_weights else None)
            self.inner.put(partition, keys, {"generation_logprobs": gen})

    def __getattr__(self, name):
        return getattr(self.inner, name)


@dataclass
class Step:
    out: object  # the driver's StepOutcome: loss, grad norm, metrics, updated state_dict
    grads: dict[str, Tensor]
    initial: dict[str, Tensor] | None  # the trainer's weights before the step (when kept)
    prev: dict[int, Tensor]  # batch row -> the prev_logprobs row stored (after any design)
    logits: list[LogitRecord]
    normalizer: int
    eager: bool  # the model runs eager attention: a row's logprobs can be batch-invariant
    columns: dict[str, dict[int, Tensor]] = field(default_factory=dict)  # stored, by row
    optimizer: list[OptimizerStep] = field(default_factory=list)


def _step(backend, transport, codec, meta_cls, settings, batch, world: int = 1,
          plan: Design | None = None, logits: bool = False, model_copy=None,
          initial: dict[str, Tensor] | None = None, optimizer: str | None = None) -> Step:
    """One driver step through the backend's trainer, watched. Keeps the initial weights
    (CPU, own dtype) unless `initial` is given, which they must then equal: one copy serves
    every split of a step, so only one trainer's worth of tensors is alive at a time. `plan`:
    the stored columns' design; `optimizer`: "grads" records the gradient of every optimizer
    step, "weights" also the weights each starts from."""
    uid = f"n{uuid.uuid4().hex[:6]}"
    keys = mint_keys(len(batch), GROUP, uid)
    rec = RecordingTransport(transport)
    inner = SetColumns(rec, batch, keys, plan) if plan is not None else rec
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
    factories = [GradCapture] + ([LogitCapture] if logits else []) + (
        [partial(OptimizerSteps, weights=optimizer == "weights")] if optimizer else [])
    with watching(trainer, factories) as records:
        out = dataplane_step(batch, trainer, inner, codec, meta_cls,
                             f"num-{uuid.uuid4().hex[:8]}", uid=uid, world=world,
                             group_size=GROUP, advantages=torch.tensor(ADVANTAGES[:len(batch)]))
    grad, *rest = records
    seen = rest.pop(0) if logits else []
    taken = rest.pop(0) if optimizer else []
    row = {k: i for i, k in enumerate(keys)}
    columns: dict[str, dict[int, Tensor]] = {}
    for name in ("prev_logprobs", "reference_logprobs", "generation_logprobs"):
        for e in rec.put_of(name):
            for k, r in zip(e.keys, e.data[name].unbind()):
                columns.setdefault(name, {})[row[k]] = r.detach().cpu()
    assert grad, "no gradient was accumulated into the parameters of trainer.model"
    impl = getattr(getattr(trainer.model, "config", None), "_attn_implementation", None)
    return Step(out, grad, kept, columns.get("prev_logprobs", {}), seen,
                int(batch["token_mask"].sum()), impl == "eager", columns, taken)


def _declared(backend, point: str) -> LossConfig:
    """The grid point's LossConfig when the backend's trainer declares it; otherwise the test is
    not applicable, its message naming the point and the backend's reason (the trainer factory's
    `loss_options(config)` gives the backend's own options for a point, or raises
    NotImplementedError saying why it has none; without it only the default point is declared)."""
    cfg = LossConfig() if point == "default" else GRID[point]
    if point == "default":
        return cfg
    options = getattr(backend.trainer, "loss_options", None)
    if options is None:
        why = "its trainer factory declares no loss_options, so only the default point"
    else:
        try:
            options(cfg)
            return cfg
        except NotImplementedError as exc:
            why = str(exc)
    pytest.skip(f"{NA_PREFIX}grid point {point} ({cfg.changes()}) is not declared by "
                f"backend {backend.name!r}: {why}")


# -- the objective, written out row by row (expected values; no trainer code) ---------------
@dataclass
class RowTerms:
    """One row of an optimizer step: its advantage and, per loss token, the policy's logprob
    (differentiable), the stored prev / reference / generation logprobs and the entropy."""

    adv: float
    logp: Tensor
    prev: Tensor
    ref: Tensor | None = None
    gen: Tensor | None = None
    entropy: Tensor | None = None


def objective(rows: list[RowTerms], cfg: LossConfig, tokens: int, n_rows: int,
              entropy_sum: float | None = None) -> tuple[Tensor, float]:
    """(the step loss in float64, its absolute mass) of `cfg`'s objective over `rows` (every
    row of the step, empty ones too: `n_rows` counts them). `entropy_sum` replaces the rows'
    entropies where the trainer's logits are not observable."""
    total = torch.zeros((), dtype=torch.float64)
    mass = 0.0
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    for row in rows:
        n = row.logp.numel()
        if n == 0:
            continue
        a = row.adv
        logr = row.logp.double() - row.prev.double()
        r = logr.mean().exp().expand(n) if cfg.ratio_level == "sequence" else logr.exp()
        term = -torch.minimum(r * a, r.clamp(lo, hi) * a)
        if cfg.dual_clip is not None and a < 0:
            term = term.clamp(max=-cfg.dual_clip * a)
        if cfg.is_cap is not None:
            term = term * (row.prev.double() - row.gen.double()).exp().clamp(max=cfg.is_cap)
        if cfg.kl_coef:
            d = row.logp.double() - row.ref.double()
            est = {"k1": d, "k2": d * d / 2, "k3": torch.exp(-d) - 1 + d}[cfg.kl_estimator]
            term = term + cfg.kl_coef * (est * r if cfg.kl_ratio_weighted else est)
        weight = {"token-mean": 1.0 / tokens, "seq-mean-token-mean": 1.0 / (n_rows * n),
                  "seq-mean-token-sum": 1.0 / n_rows,
                  "constant": 1.0 / (n_rows * (cfg.constant_normalizer or 1.0))}[
            cfg.aggregation]
        total = total + weight * term.sum()
        mass += weight * float(term.detach().abs().sum())
        if cfg.entropy_coef and entropy_sum is None:
            total = total - cfg.entropy_coef / tokens * row.entropy.double().sum()
            mass += cfg.entropy_coef / tokens * float(row.entropy.detach().abs().sum())
    if cfg.entropy_coef and entropy_sum is not None:
        total = total - cfg.entropy_coef / tokens * entropy_sum
        mass += cfg.entropy_coef / tokens * abs(entropy_sum)
    return total, mass


def _completion(batch, i: int) -> range:
    plen, lens = batch["prompt_lengths"].tolist(), batch["input_lengths"].tolist()
    return range(plen[i], lens[i])


def _stored(st: Step, name: str, batch, i: int) -> Tensor | None:
    col = st.columns.get(name, {}).get(i)
    if col is None:
        return None
    span = _completion(batch, i)
    return col[span.start:span.stop].double()


def _designed_rows(st: Step, batch, plan: Design, rows) -> list[RowTerms]:
    """Each row's terms at the logprobs the design implies (the train pass's logprobs equal
    the prev pass's: stored prev + ln r)."""
    out = []
    for i in rows:
        n = len(_completion(batch, i))
        prev = _stored(st, "prev_logprobs", batch, i)
        assert prev is not None, f"no prev_logprobs were stored for row {i}"
        r = torch.tensor([plan.ratios[i, k] for k in range(n)], dtype=torch.float64)
        out.append(RowTerms(ADVANTAGES[i], prev + r.log(), prev,
                            _stored(st, "reference_logprobs", batch, i),
                            _stored(st, "generation_logprobs", batch, i)))
    return out


def assert_regime(cfg: LossConfig, point: str, batch, plan: Design) -> None:
    """The point's input lies where its option changes the answer (each clause test first)."""
    n = len(batch)
    counts = [len(_completion(batch, i)) for i in range(n)]
    ratio = {}  # (row, k) -> the ratio the clip acts on
    for i in range(n):
        if counts[i] == 0:
            continue
        rs = [plan.ratios[i, k] for k in range(counts[i])]
        geo = math.exp(sum(math.log(x) for x in rs) / len(rs))
        for k, x in enumerate(rs):
            ratio[i, k] = geo if cfg.ratio_level == "sequence" else x
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    side = {(ADVANTAGES[i] > 0, "above" if r > hi else "below" if r < lo else "inside")
            for (i, _), r in ratio.items()}
    want = {(p, s) for p in (True, False) for s in ("above", "below")}
    assert want <= side, f"test setup ({point}): ratios must lie beyond both clip bounds for " \
        f"both advantage signs: {sorted(side)}"
    assert any(s == "inside" for _, s in side), f"test setup ({point}): no ratio inside the " \
        "clip range"
    if cfg.clip_low != cfg.clip_high and cfg.ratio_level == "token":
        pos = [r for (i, _), r in ratio.items() if ADVANTAGES[i] > 0
               and 1 + min(cfg.clip_low, cfg.clip_high) < r < 1 + max(cfg.clip_low, cfg.clip_high)]
        neg = [r for (i, _), r in ratio.items() if ADVANTAGES[i] < 0
               and 1 - max(cfg.clip_low, cfg.clip_high) < r < 1 - min(cfg.clip_low, cfg.clip_high)]
        assert pos and neg, f"test setup ({point}): asymmetric bounds need a positive-" \
            "advantage ratio between the two upper bounds and a negative one between the two " \
            f"lower bounds: {pos}, {neg}"
    if cfg.dual_clip is not None:
        assert any(r > cfg.dual_clip for (i, _), r in ratio.items() if ADVANTAGES[i] < 0), \
            f"test setup ({point}): no negative-advantage ratio above the dual clip"
    if cfg.ratio_level == "sequence":
        assert any(c > 1 and abs(math.log(ratio[i, 0])) > 1e-3 for i, c in enumerate(counts)
                   if c), f"test setup ({point}): no row whose product of token ratios " \
            "differs from their geometric mean"
    if cfg.kl_coef:
        ds = [plan.kl[key] for key in ratio]
        assert all(abs(d) >= 0.1 for d in ds) and min(ds) < 0 < max(ds), \
            f"test setup ({point}): the reference must differ from the policy on every loss " \
            f"token, both ways: {ds}"
    if cfg.is_cap is not None:
        qs = [plan.is_weights[key] for key in ratio]
        assert min(qs) < cfg.is_cap < max(qs), f"test setup ({point}): importance weights " \
            f"must lie on both sides of the cap {cfg.is_cap}: {qs}"
    if cfg.aggregation != "token-mean":
        nonzero = {c for c in counts if c}
        assert 0 in counts and len(nonzero) > 1, f"test setup ({point}): rows must hold " \
            f"different numbers of loss tokens, one none: {counts}"
        if cfg.aggregation == "constant":
            assert cfg.constant_normalizer not in set(counts) | {max(counts), sum(counts)}, \
                f"test setup ({point}): the constant normaliser equals a count of the batch"


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
# cuts at other sizes; the tiny models run all seven at the default point, and the grid points
# run the five everywhere.
_PRODUCTION_SPLITS = ("one micro-batch", "micro-batches of 1", "token budget",
                      "3 ranks x micro-batches of 1", "2 ranks x token budget")
# the grid runs on one family per clause at tiny width (the objective's formulas do not depend on
# media: the default point runs the VLM families) and on a text and a VLM family at production
GRID_FAMILIES = ("text",)
PRODUCTION_GRID_FAMILIES = ("text", "qwen2_vl")


def _grid(points) -> list:
    """(family, point) cases: the default point on every numerics family is its own test."""
    from rlconform.fixtures.sizes import PRODUCTION, model_size

    families = PRODUCTION_GRID_FAMILIES if model_size() == PRODUCTION else GRID_FAMILIES
    return [pytest.param(f, p, id=f"{f}-{p}") for p in points for f in families]


def _splits(n: int, longest: int, all_splits: bool = True) -> dict[str, tuple[int, dict]]:
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
    if model_size() == PRODUCTION or not all_splits:
        splits = {k: v for k, v in splits.items() if k in _PRODUCTION_SPLITS}
    return splits


def _mass_at_ratio_one(cfg: LossConfig, counts: list[int], vocab: int) -> float:
    """The loss's absolute mass where every ratio is 1 (each token's loss is -A): the scale of
    its rounding, known without the trainer; an entropy bonus adds at most coef ln V."""
    tokens, rows = sum(counts), len(counts)
    weight = {"token-mean": lambda c: 1.0 / tokens,
              "seq-mean-token-mean": lambda c: 1.0 / (rows * max(c, 1)),
              "seq-mean-token-sum": lambda c: 1.0 / rows,
              "constant": lambda c: 1.0 / (rows * (cfg.constant_normalizer or 1.0))}[
        cfg.aggregation]
    return sum(abs(a) * c * weight(c) for a, c in zip(ADVANTAGES, counts)) + \
        cfg.entropy_coef * math.log(vocab)


def _split_invariance(backend, transport, codec, meta_cls, device, dtype, record_metric,
                      rollouts, family, point):
    cfg = _declared(backend, point)
    batch, _, _ = rollouts.get(family)
    n, counts = len(batch), batch["token_mask"].sum(dim=1).tolist()
    assert len(set(counts)) > 2 and 0 in counts, \
        f"test setup: rows must differ in loss tokens, one with none: {counts}"
    lacking = settings_not_declared(backend, "micro_batch_size", "max_tokens_per_micro_batch")
    splits = _splits(n, int(batch.seq_lens.max()),
                     all_splits=point == "default" or bool(lacking))
    left_out = [name for name, (_, kw) in splits.items() if set(kw) & set(lacking)]
    splits = {k: v for k, v in splits.items() if k not in left_out}
    record_metric("splits_not_declared", len(left_out))
    if len(splits) < 2:
        pytest.skip(NA_PREFIX + "the trainer declares no counterpart for the settings of "
                    f"every split: {lacking}")
    (base_name, (world, kw)), *others = splits.items()
    base = _step(backend, transport, codec, meta_cls,
                 rollouts.settings(family, loss=cfg, **kw), batch, world=world)
    assert base.out.grad_norm > 0, "test setup: zero gradient makes the comparison vacuous"
    from rlconform.fixtures.families import build_family

    l1 = _mass_at_ratio_one(cfg, counts, len(build_family(family).tokenizer))
    if cfg.entropy_coef:
        bonus = cfg.entropy_coef * float(base.out.metrics["entropy"].double().mean())
        assert bonus > 1e3 * loss_reorder_tol(base.normalizer, l1), \
            f"test setup ({point}): the entropy bonus {bonus:.3g} is within the rounding"
    loss_tol = loss_reorder_tol(base.normalizer, l1)
    bitwise = base.eager and device == "cpu" and family in SPLIT_BITWISE_FAMILIES
    lp_tol = 0.0 if bitwise else TRUNCATION_LOGPROB_TOL[dtype]
    # a row's logprobs on its loss tokens (the prompt's are consumed by nothing: Qwen2-VL's
    # differ at a few image positions of two-image rows when the micro-batch changes)
    loss_pos = [batch["token_mask"][i, :int(batch.seq_lens[i])].nonzero().flatten()
                for i in range(n)]
    failures, seen, moved, unput = [], {}, [], []
    for name, (world, kw) in [(base_name, (1, None))] + others:  # one at a time, then dropped
        r = base if kw is None else _step(backend, transport, codec, meta_cls,
                                          rollouts.settings(family, loss=cfg, **kw), batch,
                                          world=world, initial=base.initial)
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
        if len(r.prev) == len(base.prev) == n:
            lp = max(float((r.prev[i] - base.prev[i])[loss_pos[i]].abs().max())
                     if loss_pos[i].numel() else 0.0 for i in range(n))
            seen.setdefault("split_logprob_max_abs_diff", []).append(lp)
            if not lp <= lp_tol:
                moved.append(f"{name}: by {lp:.3g} (> {lp_tol:g}"
                             f"{', bitwise regime' if bitwise else ''})")
        else:
            unput.append(f"{name} ({len(r.prev)} and {len(base.prev)} of {n} rows)")
        for k, v in (("split_loss_diff_over_l1", dl / l1), ("split_grad_norm_rel_diff", dg),
                     ("split_grad_rel_l2", grad), ("split_update_rel_l2", du)):
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
        if bad:
            failures.append(f"{name} vs {base_name}: " + "; ".join(bad))
        del r
    for k, v in seen.items():  # one value per split
        record_metric(k, v)
    assert not failures, f"the step ({point}) depends on how it is cut (token counts per row " \
        f"{counts}; splits the trainer declares no settings for, left out: " \
        f"{left_out or 'none'}):\n  " + "\n  ".join(failures)
    # the prev pass: judged after the step itself, so a backend without one is told apart
    assert not unput, "no prev_logprobs column was put for every row (the prev-logprob pass " \
        "did not run): " + "; ".join(unput)
    assert not moved, "a row's prev logprobs on its loss tokens moved with its micro-batch: " + \
        "; ".join(moved)


@pytest.mark.clause("TRAIN-SPLIT-INVARIANCE")
@pytest.mark.parametrize("family", FAMILIES)
def test_step_is_invariant_to_micro_batches_and_shards(backend, transport, codec, meta_cls,
                                                       device, dtype, record_metric,
                                                       rollouts, family):
    _split_invariance(backend, transport, codec, meta_cls, device, dtype, record_metric,
                      rollouts, family, "default")


@pytest.mark.clause("TRAIN-SPLIT-INVARIANCE")
@pytest.mark.parametrize("family,point", _grid(SPLIT_POINTS))
def test_split_invariance_across_configs(backend, transport, codec, meta_cls, device, dtype,
                                         record_metric, rollouts, family, point):
    _split_invariance(backend, transport, codec, meta_cls, device, dtype, record_metric,
                      rollouts, family, point)


# -- TRAIN-LOSS-CLOSED-FORM ---------------------------------------------------------------
def _closed_form(backend, transport, codec, meta_cls, dtype, record_metric, rollouts, family,
                 point):
    cfg = _declared(backend, point)
    batch, _, _ = rollouts.get(family)
    plan = design(cfg, batch, point)
    assert_regime(cfg, point, batch, plan)
    st = _step(backend, transport, codec, meta_cls, rollouts.settings(family, loss=cfg), batch,
               plan=plan, logits=True)
    n = len(batch)
    tokens = int(batch["token_mask"].sum())
    ratios = {}
    for (i, _k), r in plan.ratios.items():
        ratios.setdefault(i, []).append(r)
    want_ratio = torch.tensor(sorted(
        x for rs in ratios.values() for x in ([math.exp(sum(map(math.log, rs)) / len(rs))]
                                              * len(rs) if cfg.ratio_level == "sequence"
                                              else rs)), dtype=torch.float64)
    got_ratio = st.out.metrics["probs_ratio"].double()
    assert got_ratio.numel() == tokens, \
        f"probs_ratio has {got_ratio.numel()} values for {tokens} tokens"
    assert torch.allclose(got_ratio.sort().values, want_ratio, rtol=RATIO_CANARY_RTOL, atol=0), \
        "probs_ratio does not follow the stored prev logprobs (test setup for the closed form)"

    # the loss, from the stored columns alone (the train pass's logprobs are prev + ln r)
    rows = _designed_rows(st, batch, plan, range(n))
    entropy_sum = None
    if cfg.entropy_coef:
        entropy_sum = float(st.out.metrics["entropy"].double().sum()) if not st.logits \
            else None
    if cfg.entropy_coef and st.logits:
        for i, row in enumerate(rows):  # the entropies of the trainer's own logits
            row.entropy = torch.tensor([float(_entropy(*_logit_at(st, batch, i, k)))
                                        for k in range(row.logp.numel())], dtype=torch.float64)
    want_loss, mass = objective(rows, cfg, tokens, n, entropy_sum)
    if cfg.entropy_coef:
        bonus = cfg.entropy_coef * (entropy_sum if entropy_sum is not None else
                                    sum(float(r.entropy.sum()) for r in rows)) / tokens
        assert bonus > 100 * CLOSED_FORM_LOSS_RTOL * mass, \
            f"test setup ({point}): the entropy bonus {bonus:.3g} is within the tolerance"
    diff = abs(st.out.loss - float(want_loss))
    record_metric("closed_form_loss_diff_over_l1", diff / mass)
    tol = CLOSED_FORM_LOSS_RTOL * mass
    assert diff <= tol, (
        f"step loss {st.out.loss:.9g}, closed form {float(want_loss):.9g} ({point}: "
        f"{cfg.changes() or 'the default point'} over {tokens} loss tokens; |diff| {diff:.3g} "
        f"> {tol:.3g})")

    # dL/dlogits: the float64 autograd of the same objective on the captured logits, exactly 0
    # wherever that is exactly 0 (prompt, padding, clipped tokens without another term)
    assert st.logits, "no forward of trainer.model built a graph in the train pass: it " \
        "returned no logits to watch"
    for f, rec in enumerate(st.logits):
        assert len(rec.grad) == 1, f"train forward {f}: its logits got {len(rec.grad)} gradients"
    where = _token_positions(st, batch)
    missing = sorted(set(plan.ratios) - set(where))
    assert not missing, f"no train forward scored loss tokens {missing[:6]}"
    # one leaf per forward holding only the logits that predict loss tokens
    slots: dict[int, list] = {}
    for (i, k), (f, r, q, _) in where.items():
        slots.setdefault(f, []).append((r, q, i, k))
    leaves, index = {}, {}
    for f, items in slots.items():
        rq = torch.tensor([(r, q) for r, q, _, _ in items])
        leaves[f] = st.logits[f].logits[rq[:, 0], rq[:, 1]].clone().requires_grad_(True)
        for j, (_, _, i, k) in enumerate(items):
            index[i, k] = (f, j)
    z_rows = []
    for i, row in enumerate(rows):
        logp, ent = [], []
        for k in range(row.logp.numel()):
            f, j = index[i, k]
            lz = torch.log_softmax(leaves[f][j], dim=-1)
            logp.append(lz[where[i, k][3]])
            ent.append(-(lz.exp() * lz).sum())
        z_rows.append(RowTerms(row.adv, torch.stack(logp) if logp else row.logp.detach()[:0],
                               row.prev, row.ref, row.gen,
                               torch.stack(ent) if ent else None))
    z_loss, _ = objective(z_rows, cfg, tokens, n)
    z_loss.backward()
    worst, errors, nonzero = 0.0, [], []
    for f, rec in enumerate(st.logits):
        g = rec.grad[0]
        scored = torch.zeros(g.shape[:2], dtype=torch.bool)
        for r, q, _i, _k in slots.get(f, []):
            scored[r, q] = True
        stray = ((g != 0).any(dim=-1) & ~scored).nonzero().tolist()
        nonzero += [f"forward {f} row {r} position {q}" for r, q in stray]
        for j, (r, q, i, k) in enumerate(slots.get(f, [])):
            w = leaves[f].grad[j]
            if not bool((w != 0).any()):
                if bool((g[r, q] != 0).any()):
                    nonzero.append(f"forward {f} row {r} position {q} (row {i} token {k})")
                continue
            err = float((g[r, q] - w).abs().sum() / w.abs().sum())
            worst = max(worst, err)
            if err > LOGIT_GRAD_RTOL[dtype]:
                errors.append(f"row {i} token {k}: L1 error {err:.3g}, vocabulary sum "
                              f"{float(g[r, q].sum()):.3g} (closed form {float(w.sum()):.3g})")
    record_metric("closed_form_logit_grad_l1_rel", worst)
    assert not nonzero, f"gradient w.r.t. logits where the loss ({point}) has none (prompt, " \
        "padding or a clipped token): " + ", ".join(nonzero[:6])
    assert not errors, f"gradient w.r.t. the logits differs from the closed form ({point}) " \
        f"(> {LOGIT_GRAD_RTOL[dtype]:g}): " + "; ".join(errors[:4])


def _token_positions(st: Step, batch) -> dict:
    """(row, k) -> (forward, row in it, kept position, token id) of the logits predicting the
    row's k-th completion token."""
    plen = batch["prompt_lengths"].tolist()
    out = {}
    for f, rec in enumerate(st.logits):
        s, kept = rec.input_ids.shape[1], rec.logits.shape[1]
        for r, (i, left) in enumerate(_match_exact(rec.input_ids, rec.attention_mask, batch)):
            for q in range(kept):
                p = s - kept + q  # the input position whose logits these are ...
                k = p - left + 1 - plen[i]  # ... predicting the row's k-th completion token
                if 0 <= k < len(_completion(batch, i)):
                    out[i, k] = (f, r, q, int(rec.input_ids[r, p + 1]))
    return out


def _logit_at(st: Step, batch, i: int, k: int) -> tuple[Tensor]:
    f, r, q, _ = _token_positions(st, batch)[i, k]
    return (st.logits[f].logits[r, q],)


def _entropy(z: Tensor) -> Tensor:
    lz = torch.log_softmax(z.double(), dim=-1)
    return -(lz.exp() * lz).sum()


@pytest.mark.clause("TRAIN-LOSS-CLOSED-FORM")
@pytest.mark.parametrize("family", ("qwen2_vl", "text"))
def test_loss_and_logit_gradient_match_the_closed_form(backend, transport, codec, meta_cls,
                                                       dtype, record_metric, rollouts,
                                                       family):
    _closed_form(backend, transport, codec, meta_cls, dtype, record_metric, rollouts, family,
                 "default")


@pytest.mark.clause("TRAIN-LOSS-CLOSED-FORM")
@pytest.mark.parametrize("family,point", _grid(CLOSED_FORM_POINTS))
def test_closed_form_across_configs(backend, transport, codec, meta_cls, dtype,
                                    record_metric, rollouts, family, point):
    _closed_form(backend, transport, codec, meta_cls, dtype, record_metric, rollouts, family,
                 point)


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


# -- TRAIN-GRAD-RECOMPUTE and TRAIN-RATIO-LATER-STEPS -----------------------------------------
def _recomputed_rows(model, fam, batch, prompts, images, st: Step, rows, dtype, device,
                     entropy: bool) -> list[RowTerms]:
    """Each of `rows` through `model` on its own (differentiable logprobs and entropies of
    its completion tokens) beside the step's stored columns."""
    plen, lens = batch["prompt_lengths"].tolist(), batch["input_lengths"].tolist()
    out = []

    def on(t: Tensor | None) -> Tensor | None:  # the stored columns beside the copy's logprobs
        return None if t is None else t.to(device)

    for i in rows:
        k = lens[i] - plen[i]
        prev = on(_stored(st, "prev_logprobs", batch, i))
        assert prev is not None, f"no prev_logprobs were stored for row {i}"
        if k == 0:
            out.append(RowTerms(ADVANTAGES[i], prev[:0], prev))
            continue
        completion = batch["input_ids"][i, plen[i]:lens[i]]
        inputs = row_inputs(fam, prompts[i], images[i], completion, dtype, device)
        logits = model(**inputs, use_cache=False).logits[0].float()
        lz = torch.log_softmax(logits[plen[i] - 1:lens[i] - 1], dim=-1)
        logp = lz.gather(-1, inputs["input_ids"][0, plen[i]:lens[i], None]).squeeze(-1)
        out.append(RowTerms(ADVANTAGES[i], logp, prev,
                            on(_stored(st, "reference_logprobs", batch, i)),
                            on(_stored(st, "generation_logprobs", batch, i)),
                            -(lz.exp() * lz).sum(-1) if entropy else None))
    return out


def _moved(terms: list[RowTerms], rows, plan: Design) -> float:
    """How far the policy moved from the prev pass on these rows' loss tokens (max |logp_now -
    (stored prev + ln r)|): a later step's ratio differs from the first step's by exp of it."""
    return max((float((t.logp.detach().double() - t.prev - torch.tensor(
        [math.log(plan.ratios[i, k]) for k in range(t.logp.numel())],
        dtype=torch.float64, device=t.logp.device)).abs().max())
        for i, t in zip(rows, terms) if t.logp.numel()), default=0.0)


def _relative_to(terms: list[RowTerms], rows, plan: Design, base: dict) -> list[RowTerms]:
    """`terms` with the design applied to the independent copy's own logprobs at the initial
    weights (`base`: row -> its loss tokens' logprobs there) instead of the trainer's stored
    columns: prev = base - ln r, reference = base - d, generation = prev - ln q. The trainer's
    train logprobs equal its prev pass's bitwise (TRAIN-RATIO-ONE), so what it sees is exactly
    the design; taken from the stored columns, the recompute's ratios would also carry the
    row-by-row forward's disagreement with the batched one (bf16: up to 0.06 nats at production
    widths), enough to move a ratio across a clip bound or out of GSPO's 4e-4 range."""
    out = []
    for i, t in zip(rows, terms):
        n = t.logp.numel()
        ks = range(n)
        f64 = {"dtype": torch.float64, "device": base[i].device}  # the copy's device (CUDA)
        prev = base[i][:n] - torch.tensor([math.log(plan.ratios[i, k]) for k in ks], **f64)
        ref = None if plan.kl is None else base[i][:n] - torch.tensor(
            [plan.kl[i, k] for k in ks], **f64)
        gen = None if plan.is_weights is None else prev - torch.tensor(
            [math.log(plan.is_weights[i, k]) for k in ks], **f64)
        out.append(RowTerms(t.adv, t.logp, prev, ref, gen, t.entropy))
    return out


def _optimizer_steps(st: Step, cfg: LossConfig) -> list:
    """The driver-visible result of each optimizer step (StepResult-like), in order."""
    steps = st.out.extra.get("optimizer_steps")
    if cfg.optimizer_steps == 1:
        return [st.out]
    assert steps is not None and len(steps) == cfg.optimizer_steps, \
        f"the trainer reported {0 if steps is None else len(steps)} optimizer steps for a " \
        f"batch that takes {cfg.optimizer_steps} (extra['optimizer_steps'])"
    return steps


def _step_rows(cfg: LossConfig, n: int) -> list[list[int]]:
    """The batch rows of each optimizer step (one rank: the point's mini-batches, in order)."""
    return [r for _ in range(cfg.epochs) for r in mini_batch_rows(n, cfg.mini_batches)]


def _clip_coef(norm: float, cfg: LossConfig) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, max / (norm + 1e-6))."""
    return 1.0 if cfg.max_grad_norm is None else min(1.0, cfg.max_grad_norm / (norm + 1e-6))


def _recompute(backend, transport, codec, meta_cls, device, dtype, record_metric, rollouts,
               family, point):
    from rlconform.fixtures.families import build_family

    cfg = _declared(backend, point)
    batch, prompts, images = rollouts.get(family)
    plan = design(cfg, batch, point)
    assert_regime(cfg, point, batch, plan)
    fam = build_family(family)
    settings = rollouts.settings(family, loss=cfg)
    model = fam.build_model(seed=settings.seed, dtype=dtype, device=device)
    world = 1 if cfg.mini_batches > 1 else 2  # mini-batch members depend on the sharding
    st = _step(backend, transport, codec, meta_cls, settings, batch, world=world, plan=plan,
               model_copy=model, optimizer="weights" if cfg.optimizer_steps > 1 else "grads")
    model.train(False)
    results = _optimizer_steps(st, cfg)
    assert len(st.optimizer) == cfg.optimizer_steps, \
        f"{len(st.optimizer)} optimizer steps were taken on trainer.model's parameters for " \
        f"a batch that takes {cfg.optimizer_steps}"
    bad, shift, seen = [], 0.0, {}
    base: dict[int, Tensor] = {}  # row -> the copy's own logprobs at the initial weights
    if cfg.optimizer_steps > 1:
        with torch.no_grad():
            start = _recomputed_rows(model, fam, batch, prompts, images, st, range(len(batch)),
                                     dtype, device, False)
        base = {i: t.logp.double() for i, t in enumerate(start)}
    for s, rows in enumerate(_step_rows(cfg, len(batch))):
        if s:  # from the trainer's own weights before this step
            model.load_state_dict(st.optimizer[s].weights)
        model.zero_grad(set_to_none=True)
        terms = _recomputed_rows(model, fam, batch, prompts, images, st, rows, dtype, device,
                                 bool(cfg.entropy_coef))
        for i, t in zip(rows, terms):
            base.setdefault(i, t.logp.detach().double())
        if s:
            shift = max(shift, max((float((t.logp.detach().double() - base[i]).abs().max())
                                    for i, t in zip(rows, terms) if t.logp.numel()),
                                   default=0.0))
        terms = _relative_to(terms, rows, plan, base)
        tokens = sum(t.logp.numel() for t in terms)
        loss, mass = objective(terms, cfg, tokens, len(rows))
        loss.backward()
        want = {name: p.grad.detach() if p.grad is not None else torch.zeros_like(p)
                for name, p in model.named_parameters() if p.requires_grad}
        want_norm = math.sqrt(sum(_sq(w) for w in want.values()))
        if cfg.max_grad_norm is not None:
            assert want_norm > cfg.max_grad_norm, f"test setup ({point}): the gradient norm " \
                f"{want_norm:.3g} does not exceed max_grad_norm {cfg.max_grad_norm}"
        coef = _clip_coef(want_norm, cfg)
        applied = {k: w * coef for k, w in want.items()}
        got = {k: st.optimizer[s].grads.get(k, torch.zeros_like(w.cpu())) for k, w in
               applied.items()}
        missing = sorted(set(want) - set(st.optimizer[s].grads))
        res = results[s]
        dl = abs(res.loss - float(loss))
        dn = abs(res.grad_norm - want_norm) / want_norm
        tag = f"step {s + 1}" if cfg.optimizer_steps > 1 else "the step"
        for k, v in (("recompute_loss_diff_over_l1", dl / mass),
                     ("recompute_grad_norm_rel_diff", dn),
                     ("recompute_grad_rel_l2", _rel_l2(got, applied))):
            seen.setdefault(k, []).append(v)
        if missing and any(bool((want[k] != 0).any()) for k in missing):
            bad.append(f"{tag}: no gradient reached {missing[:4]}")
        bound = CLOSED_FORM_LOSS_RTOL * mass
        if s:
            # after the first step the loss depends on the train pass's own logprobs, which
            # the recompute takes from a row-by-row forward (other kernels than the trainer's
            # batched one: TRAIN-RATIO-LATER-STEPS' tolerance per log ratio, times how fast the
            # surrogate moves with it; measured at production width in bf16 on an H200: step
            # 2's loss 4.38497537 vs 4.38521441 for Qwen2-VL-2B at epochs-2)
            slope = sum(abs(t.adv) * float((t.logp.detach().double() - t.prev).exp().sum())
                        for t in terms) / max(tokens, 1)
            bound += 2 * LATER_STEP_LOG_RATIO_TOL[dtype] * slope
        if not dl <= bound:
            bad.append(f"{tag}: loss {res.loss:.9g} vs recompute {float(loss):.9g} "
                       f"(|diff| {dl:.3g} > {bound:.3g})")
        if not dn <= GRAD_RTOL[dtype]:
            bad.append(f"{tag}: grad norm {res.grad_norm:.9g} vs recompute {want_norm:.9g} "
                       f"(relative {dn:.3g} > {GRAD_RTOL[dtype]:g})")
        bad += [f"{tag} (the gradient the optimizer applied"
                f"{', clipped' if coef < 1 else ''}): {b}"
                for b in _grad_problems(got, applied, GRAD_RTOL[dtype])]
    for k, v in seen.items():  # a scalar, or one value per optimizer step
        record_metric(k, v[0] if len(v) == 1 else v)
    if cfg.optimizer_steps > 1:
        assert shift > MOVED_OVER_TOL * LATER_STEP_LOG_RATIO_TOL[dtype], f"test setup ({point}): the " \
            f"first step moved no logprob by more than {shift:.3g}: a later step's ratio is 1"
    assert not bad, f"the step ({point}: {cfg.changes() or 'the default point'}) differs " \
        f"from an autograd recompute of its objective on an independent copy of the model " \
        f"({world} rank{'s' if world > 1 else ''}):\n  " + "\n  ".join(bad)


@pytest.mark.clause("TRAIN-GRAD-RECOMPUTE")
@pytest.mark.parametrize("family", ("qwen2_vl", "text"))
def test_step_gradient_equals_an_independent_recompute(backend, transport, codec, meta_cls,
                                                       device, dtype, record_metric,
                                                       rollouts, family):
    _recompute(backend, transport, codec, meta_cls, device, dtype, record_metric, rollouts,
               family, "default")


@pytest.mark.clause("TRAIN-GRAD-RECOMPUTE")
@pytest.mark.parametrize("family,point", _grid(RECOMPUTE_POINTS))
def test_recompute_across_configs(backend, transport, codec, meta_cls, device, dtype,
                                  record_metric, rollouts, family, point):
    _recompute(backend, transport, codec, meta_cls, device, dtype, record_metric, rollouts,
               family, point)


@pytest.mark.clause("TRAIN-RATIO-LATER-STEPS")
@pytest.mark.parametrize("family,point", _grid(LATER_STEP_POINTS))
def test_later_steps_ratio_is_the_policy_change(backend, transport, codec, meta_cls, device,
                                                dtype, record_metric, rollouts, family, point):
    from rlconform.fixtures.families import build_family

    cfg = _declared(backend, point)
    batch, prompts, images = rollouts.get(family)
    plan = design(cfg, batch, point)
    assert_regime(cfg, point, batch, plan)
    fam = build_family(family)
    model = fam.build_model(seed=rollouts.settings(family).seed, dtype=dtype, device=device)
    tol = LATER_STEP_LOG_RATIO_TOL[dtype]
    st, later = _later_step_regime(backend, transport, codec, meta_cls, device, dtype,
                                       record_metric, rollouts, family, point, cfg, batch,
                                       prompts, images, plan, fam, model)
    results = _optimizer_steps(st, cfg)
    assert len(st.optimizer) == cfg.optimizer_steps, \
        f"{len(st.optimizer)} optimizer steps were taken on trainer.model's parameters for " \
        f"a batch that takes {cfg.optimizer_steps}"
    for s, rows in enumerate(_step_rows(cfg, len(batch))):
        got = results[s].metrics["probs_ratio"].double()
        if s == 0:  # TRAIN-RATIO-ONE's regime: the train pass's logprobs are the prev pass's
            want = torch.tensor(sorted(plan.ratios[i, k] for i in rows
                                       for k in range(len(_completion(batch, i)))),
                                dtype=torch.float64)
            assert got.numel() == want.numel() and torch.allclose(
                got.sort().values, want, rtol=RATIO_CANARY_RTOL, atol=0), \
                "step 1: probs_ratio does not follow the stored prev logprobs (the first " \
                "step's train logprobs must be the prev pass's, TRAIN-RATIO-ONE)"
            continue
        terms, want_log = later[s]
        record_metric(f"later_step_{s + 1}_logprob_change_max", _moved(terms, rows, plan))
        assert got.numel() == want_log.numel(), f"step {s + 1}: probs_ratio has " \
            f"{got.numel()} values for the step's {want_log.numel()} loss tokens"
        err = (got.log().sort().values - want_log.sort().values).abs()
        record_metric(f"later_step_{s + 1}_log_ratio_abs_diff", err)
        assert float(err.max()) <= tol, (
            f"step {s + 1}: probs_ratio is not exp(logp_now - prev) (max |log diff| "
            f"{float(err.max()):.3g} > {tol:g}, logp_now an independent forward of the "
            f"trainer's weights before the step; got min {float(got.min()):.6g} max "
            f"{float(got.max()):.6g}, want min {float(want_log.min().exp()):.6g} max "
            f"{float(want_log.max().exp()):.6g}): old logprobs refreshed or stale between steps")
        tokens = sum(t.logp.numel() for t in terms)
        loss, mass = objective(terms, cfg, tokens, len(rows))
        slope = sum(abs(t.adv) * float(x.exp().sum()) for t, x in
                    zip(terms, _split_rows(want_log, terms))) / max(tokens, 1)
        bound = CLOSED_FORM_LOSS_RTOL * mass + 2 * tol * slope
        diff = abs(results[s].loss - float(loss))
        assert diff <= bound, f"step {s + 1}: loss {results[s].loss:.9g}, the clipped " \
            f"objective at the independent ratios {float(loss):.9g} (|diff| {diff:.3g} > " \
            f"{bound:.3g})"


def _later_step_regime(backend, transport, codec, meta_cls, device, dtype, record_metric,
                       rollouts, family, point, cfg, batch, prompts, images, plan, fam, model):
    """The step, at a learning rate at which its later steps are in the clause's regime: the
    policy moved past the log-ratio tolerance, and ratios lie inside the clip range and beyond
    it on both sides. How far one optimizer step moves the logprobs depends on the model's
    width (one AdamW step at 1e-3 moves a tiny model's by ~0.25 nats and a 2B model's past
    every clip bound), so the rate is measured, not fixed: from LATER_STEP_LR, each try scales
    it by LATER_STEP_TARGET_CHANGE over the largest change it produced (an independent forward
    of the weights before and after, row by row; a first AdamW step moves each weight by about
    the rate, so the change is about proportional to it). Every try is recorded in the report
    (`later_step_lr` per try, `later_step_change` beside it); the regime assertions then judge
    the last one. Returns the step and each later step's (terms, wanted log ratios)."""
    tol = LATER_STEP_LOG_RATIO_TOL[dtype]
    lo, hi = math.log(1.0 - cfg.clip_low), math.log(1.0 + cfg.clip_high)
    step_rows = _step_rows(cfg, len(batch))
    lr, base, tries = LATER_STEP_LR, None, []
    for attempt in range(LATER_STEP_TRIES):
        settings = rollouts.settings(family, loss=cfg, lr=lr)
        st = _step(backend, transport, codec, meta_cls, settings, batch, plan=plan,
                   model_copy=model, optimizer="weights")
        model.train(False)
        if base is None:  # the copy holds the initial weights now
            with torch.no_grad():
                base = {i: t.logp.double() for i, t in enumerate(_recomputed_rows(
                    model, fam, batch, prompts, images, st, range(len(batch)), dtype, device,
                    False))}
        assert len(st.optimizer) == cfg.optimizer_steps, \
            f"{len(st.optimizer)} optimizer steps were taken on trainer.model's parameters " \
            f"for a batch that takes {cfg.optimizer_steps}"
        later, change, missing = {}, 0.0, []
        for s, rows in enumerate(step_rows):
            if not s:
                continue
            model.load_state_dict(st.optimizer[s].weights)
            with torch.no_grad():
                terms = _recomputed_rows(model, fam, batch, prompts, images, st, rows, dtype,
                                         device, bool(cfg.entropy_coef))
            change = max([change] + [float((t.logp.double() - base[i]).abs().max())
                                     for i, t in zip(rows, terms) if t.logp.numel()])
            want_log = []
            for t in terms:
                x = t.logp.double() - t.prev
                if cfg.ratio_level == "sequence" and x.numel():
                    x = x.mean().expand(x.numel())
                want_log.append(x)
            want_log = torch.cat(want_log).cpu()  # beside the step's metrics
            later[s] = (terms, want_log)
            sides = {(t.adv > 0, "above" if x > hi else "below" if x < lo else "inside")
                     for t, row in zip(terms, _split_rows(want_log, terms))
                     for x in row.tolist()}
            moved = _moved(terms, rows, plan)
            if moved <= MOVED_OVER_TOL * tol:
                missing.append(f"step {s + 1}: no loss token's logprob moved by more than "
                               f"{moved:.3g} (a ratio left at the first step's value passes)")
            if not ({(True, "above"), (False, "below")} <= sides and
                    any(x == "inside" for _, x in sides)):
                missing.append(f"step {s + 1}: the clip is not live on both sides of the range "
                               f"with ratios inside it: {sorted(sides)}")
        record_metric("later_step_lr", [lr], step=attempt)  # one value per try: a series
        record_metric("later_step_change", [change], step=attempt)
        tries.append(f"lr {lr:.3g}: largest change {change:.3g} nats"
                     + (f" ({'; '.join(missing)})" if missing else ""))
        if not missing:
            return st, later
        lr *= min(LATER_STEP_MAX_SCALE, LATER_STEP_TARGET_CHANGE / max(change, 1e-12))
    raise AssertionError(f"test setup ({point}): no learning rate tried put the later steps in "
                         f"the clause's regime: " + "; ".join(tries))


# the first rate tried (one AdamW step moves a tiny model's logprobs by tenths of a nat there),
# and how the next is chosen: scaled so that the largest change becomes LATER_STEP_TARGET_CHANGE
# nats (above the bf16 log-ratio tolerance times MOVED_OVER_TOL, 0.19; a change well under ln 1.2
# for most tokens keeps the designed ratio-1 tokens inside the clip range), at most
# LATER_STEP_MAX_SCALE times larger per try (a bf16 weight ignores a step under half its ulp)
LATER_STEP_LR = 1e-3
LATER_STEP_TARGET_CHANGE = 0.5
LATER_STEP_MAX_SCALE = 10.0
LATER_STEP_TRIES = 4
# a later step's regime: the first update moved some loss token's logprob by this many times the
# log-ratio tolerance, so a ratio left at the first step's value is off by more than the
# tolerance (bf16 at tiny width: moved 0.24 nats against 0.125; the row-by-row forward agrees
# with the trainer's to 5e-8 there)
MOVED_OVER_TOL = 1.5


def _split_rows(flat: Tensor, terms: list[RowTerms]) -> list[Tensor]:
    return list(torch.split(flat, [t.logp.numel() for t in terms]))
