"""The GRPO objective family (reference_impl/loss.py `LossConfig`) and its axis mutants.

Each option is checked against hand-computed values (ratios 2, 1/2, 5/4, ... and log 2
offsets, so every expected number is a closed form); the trainer's optimizer steps per batch
against their definition; and every axis mutant of conformance/mutants/trainer.py against the
grid of conformance/catalogue/trainer.py: it must change the answer at its own axis's point and
leave every point where its option is off bitwise unchanged, so only that axis can kill it.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlconform.conformance.catalogue.trainer import GRID
from rlconform.reference_impl.loss import (
    OBJECTIVE,
    LossConfig,
    StepNorm,
    grpo_loss,
)
from rlconform.reference_impl.trainer import (
    LegacyTrainer,
    TrainerSettings,
    mini_batch_rows,
)

LN2 = math.log(2.0)

pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(ratios: list[list[float]], adv: list[float]):
    """logp, prev, mask for rows of the given per-token ratios (position 0 is a prompt token),
    right padded; prev is 0 and logp = ln r."""
    width = 1 + max(len(r) for r in ratios)
    logp = torch.zeros(len(ratios), width, dtype=torch.float64)
    mask = torch.zeros(len(ratios), width)
    for i, rs in enumerate(ratios):
        for k, r in enumerate(rs):
            logp[i, 1 + k] = math.log(r)
            mask[i, 1 + k] = 1
    return logp, torch.zeros_like(logp), torch.tensor(adv, dtype=torch.float64), mask


def _per_token(out) -> list[float]:
    return [round(x, 6) for x in out.metrics["loss_per_token"].tolist()]


# -- LossConfig ------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value,message", [
    ("clip_low", 1.0, "clip_low"), ("dual_clip", 1.1, "dual_clip"),
    ("ratio_level", "row", "ratio_level"), ("kl_estimator", "k4", "kl_estimator"),
    ("aggregation", "token-sum", "aggregation"), ("is_cap", 0.0, "is_cap"),
    ("mini_batches", 0, "mini_batches"), ("epochs", 1.5, "epochs"),
    ("max_grad_norm", -1.0, "max_grad_norm"), ("constant_normalizer", 4.0,
                                               "constant_normalizer")])
def test_loss_config_names_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**{field: value})


def test_loss_config_changes_and_steps():
    assert LossConfig().changes() == {}
    c = LossConfig(clip_high=0.28, mini_batches=2, epochs=3)
    assert c.changes() == {"clip_high": 0.28, "mini_batches": 2, "epochs": 3}
    assert c.optimizer_steps == 6
    with pytest.raises(ValueError, match="StepNorm"):
        grpo_loss(*_rows([[1.0]], [1.0])[:2], torch.ones(1), torch.ones(1, 2), 1.0,
                  LossConfig(aggregation="seq-mean-token-sum"))


# -- each axis, hand-computed --------------------------------------------------------------
def test_asymmetric_clip_keeps_ratios_between_the_bounds():
    # A = +1: r = 1.25 is inside [0.8, 1.28] (loss -1.25), r = 2 clipped to 1.28;
    # A = -1: r = 0.75 and 0.5 are below 0.8, both clipped (loss 0.8); with the bounds
    # swapped ([0.72, 1.2]) the first rows would give -1.2, -1.2 and 0.75 would stay 0.75
    logp, prev, adv, mask = _rows([[1.25, 2.0], [0.75, 0.5]], [1.0, -1.0])
    out = grpo_loss(logp, prev, adv, mask, 4.0, LossConfig(clip_low=0.2, clip_high=0.28))
    assert _per_token(out) == [-1.25, -1.28, 0.8, 0.8]
    sym = grpo_loss(logp, prev, adv, mask, 4.0, LossConfig(clip_low=0.2, clip_high=0.2))
    assert _per_token(sym) == [-1.2, -1.2, 0.8, 0.8]
    assert out.metrics["clipped"].tolist() == [0.0, 1.0, 1.0, 1.0]


def test_dual_clip_caps_negative_advantages_only():
    # c = 1.8: A = -1, r = 3 -> min(max(3, 1.28), 1.8) = 1.8, no gradient; r = 1.5 -> 1.5;
    # A = +1, r = 3 -> -1.28 as without the dual clip
    logp, prev, adv, mask = _rows([[3.0, 1.5], [3.0, 1.0]], [-1.0, 1.0])
    logp.requires_grad_(True)
    cfg = LossConfig(clip_high=0.28, dual_clip=1.8)
    out = grpo_loss(logp, prev, adv, mask, 1.0, cfg)
    assert _per_token(out) == [1.8, 1.5, -1.28, -1.0]
    out.loss.backward()
    assert logp.grad[0, 1] == 0.0 and logp.grad[0, 2] == pytest.approx(1.5)


def test_sequence_ratio_is_the_geometric_mean_of_the_rows_token_ratios():
    # row 0: ratios 4 and 1 -> geometric mean 2, clipped to 1.2 for A = +1 on both tokens;
    # row 1: 2 and 1/2 -> 1, inside; the product would be 4 and 1
    logp, prev, adv, mask = _rows([[4.0, 1.0], [2.0, 0.5]], [1.0, 1.0])
    out = grpo_loss(logp, prev, adv, mask, 4.0, LossConfig(ratio_level="sequence"))
    assert [round(x, 6) for x in out.metrics["probs_ratio"].tolist()] == [2.0, 2.0, 1.0, 1.0]
    assert _per_token(out) == [-1.2, -1.2, -1.0, -1.0]


@pytest.mark.parametrize("estimator,value,slope", [
    ("k1", LN2, 1.0), ("k2", LN2 * LN2 / 2, LN2), ("k3", 0.5 - 1 + LN2, 1 - 0.5)])
def test_kl_estimators_at_log_two(estimator, value, slope):
    # logp - ref = ln 2 on the one loss token, ratio 1, A = 0: the loss is beta * estimate and
    # its slope in logp beta * d(estimate)/d(logp)
    logp = torch.tensor([[0.0, LN2]], dtype=torch.float64, requires_grad=True)
    prev = logp.detach().clone()
    mask = torch.tensor([[0.0, 1.0]])
    cfg = LossConfig(kl_coef=0.5, kl_estimator=estimator)
    out = grpo_loss(logp, prev, torch.zeros(1, dtype=torch.float64), mask, 1.0, cfg,
                    logp_reference=torch.zeros(1, 2, dtype=torch.float64))
    assert out.metrics["reference_kl"].item() == pytest.approx(value)
    assert out.loss.item() == pytest.approx(0.5 * value)
    out.loss.backward()
    assert logp.grad[0, 1].item() == pytest.approx(0.5 * slope)


def test_ratio_weighted_kl_differentiates_the_ratio_too():
    # d = ln 2, ratio r = 2 (prev = 0): term = r k3(d); d/dlogp = r k3'(d) + r k3(d)
    logp = torch.tensor([[0.0, LN2]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0.0, 1.0]])
    cfg = LossConfig(kl_coef=1.0, kl_ratio_weighted=True, clip_high=10.0)
    out = grpo_loss(logp, torch.zeros(1, 2, dtype=torch.float64),
                    torch.zeros(1, dtype=torch.float64), mask, 1.0, cfg,
                    logp_reference=torch.zeros(1, 2, dtype=torch.float64))
    k3 = 0.5 - 1 + LN2
    assert out.loss.item() == pytest.approx(2 * k3)
    out.loss.backward()
    assert logp.grad[0, 1].item() == pytest.approx(2 * 0.5 + 2 * k3)


def test_aggregations_weigh_rows_of_unequal_length():
    # ratio 1 everywhere: each token's loss is -A. Rows: 2 tokens (A=1), none (A=3), 1 (A=-2)
    logp, prev, adv, mask = _rows([[1.0, 1.0], [], [1.0]], [1.0, 3.0, -2.0])
    norm = StepNorm(tokens=3.0, rows=3.0)

    def loss(**kw):
        return grpo_loss(logp, prev, adv, mask, norm, LossConfig(**kw)).loss.item()

    assert loss() == pytest.approx((-1 - 1 + 2) / 3)  # token-mean
    assert loss(aggregation="seq-mean-token-mean") == pytest.approx((-1 + 0 + 2) / 3)
    assert loss(aggregation="seq-mean-token-sum") == pytest.approx((-2 + 0 + 2) / 3)
    assert loss(aggregation="constant", constant_normalizer=4.0) == \
        pytest.approx((-2 + 2) / (3 * 4))
    logp2, prev2, adv2, mask2 = _rows([[1.0, 1.0], [1.0]], [1.0, 1.0])
    assert grpo_loss(logp2, prev2, adv2, mask2, StepNorm(3.0, 2.0),
                     LossConfig(aggregation="constant", constant_normalizer=4.0)
                     ).loss.item() == pytest.approx(-3 / (2 * 4))


def test_truncated_importance_weight_is_capped_and_constant():
    # exp(prev - gen) = 3 (capped at 2) and 1/2; A = +1, ratio 1: losses -2 and -0.5
    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    gen = torch.tensor([[0.0, -math.log(3.0), LN2]], dtype=torch.float64)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    out = grpo_loss(logp, logp.detach().clone(), torch.ones(1, dtype=torch.float64), mask, 1.0,
                    LossConfig(is_cap=2.0), logp_gen=gen)
    assert out.metrics["is_weight"].tolist() == pytest.approx([2.0, 0.5])
    assert _per_token(out) == [-2.0, -0.5]
    out.loss.backward()  # the weight is a constant: d/dlogp = -A r w
    assert logp.grad[0, 1:].tolist() == pytest.approx([-2.0, -0.5])


def test_entropy_bonus_is_the_token_mean_over_the_step():
    logp, prev, adv, mask = _rows([[1.0, 1.0], [1.0]], [0.0, 0.0])
    entropy = torch.tensor([[9.0, 1.0, 2.0], [9.0, 3.0, 9.0]], dtype=torch.float64)
    out = grpo_loss(logp, prev, adv, mask, StepNorm(6.0, 2.0), LossConfig(entropy_coef=0.1),
                    entropy=entropy)
    assert out.loss.item() == pytest.approx(-0.1 * (1 + 2 + 3) / 6)
    assert out.metrics["entropy"].tolist() == [1.0, 2.0, 3.0]


def test_mini_batches_are_consecutive_parts():
    assert mini_batch_rows(5, 2) == [[0, 1], [2, 3, 4]]
    assert mini_batch_rows(6, 3) == [[0, 1], [2, 3], [4, 5]]
    assert mini_batch_rows(1, 2) == [[], [0]]


# -- several optimizer steps ------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_batch():
    from rlconform.fixtures.families import build_family
    from rlconform.fixtures.images import completion_caps, make_prompts
    from rlconform.reference_impl.rollout import HFRollout

    prompts, images, _ = make_prompts(3, [0], seed=0)
    prompts = [p for p in prompts for _ in range(2)]
    images = [i for i in images for _ in range(2)]
    engine = HFRollout(build_family("text"), TrainerSettings("text"))
    return engine.generate(prompts, images, completion_caps(6, 6, 0), seed=0)


def _legacy(batch, cfg: LossConfig, core_cls=None, **kw):
    from rlconform.reference_impl.grpo import legacy_step

    cls = LegacyTrainer if core_cls is None else \
        type("MutantLegacy", (LegacyTrainer,), {"core_cls": core_cls})
    trainer = cls(TrainerSettings("text", loss=cfg, **kw))
    adv = torch.tensor([1.0, -0.5, 0.75, -1.25, 0.5, -0.25])
    return legacy_step(batch, trainer, advantages=adv)


@pytest.mark.parametrize("cfg,steps", [(LossConfig(epochs=2), [[0, 1, 2, 3, 4, 5]] * 2),
                                       (LossConfig(mini_batches=2), [[0, 1, 2], [3, 4, 5]])])
def test_each_optimizer_step_uses_the_behaviour_policy_as_old(text_batch, cfg, steps):
    out = _legacy(text_batch, cfg)
    results = out.extra["optimizer_steps"]
    counts = text_batch["token_mask"].sum(dim=1).tolist()
    assert [r.extra["normalizer"] for r in results] == \
        [float(sum(counts[i] for i in rows)) for rows in steps]
    assert bool((results[0].metrics["probs_ratio"] == 1.0).all())
    later = results[1].metrics["probs_ratio"]
    assert later.numel() == sum(counts[i] for i in steps[1])
    assert float((later - 1).abs().max()) > 1e-3, "the first step did not move the policy"
    assert out.loss == results[0].loss and out.grad_norm == results[0].grad_norm


def test_gradient_clipping_scales_the_step(text_batch):
    free = _legacy(text_batch, LossConfig())
    clipped = _legacy(text_batch, LossConfig(max_grad_norm=free.grad_norm / 4))
    assert clipped.grad_norm == free.grad_norm  # the norm before clipping is reported
    assert clipped.loss == free.loss


# -- every axis mutant changes its own axis's point only ------------------------------------
def _axis_inputs():
    """A micro-batch in every regime at once: ratios beyond both bounds and in the
    asymmetric bands for both signs, a negative-advantage ratio above the dual clip, sequence
    means away from 1, a reference off the policy both ways (on the prompt too), weights on
    both sides of the cap, rows of 6, 0, 4, 1, 3 and 5 tokens."""
    from rlconform.conformance.catalogue.trainer import (
        GRID_RATIOS,
        IS_WEIGHTS,
        KL_OFFSETS,
        KL_PROMPT_OFFSETS,
    )

    lens = [6, 0, 4, 1, 3, 5]
    width = 1 + max(lens)
    g = torch.Generator().manual_seed(0)
    prev = -torch.rand(len(lens), width, generator=g, dtype=torch.float64) * 3
    logp, ref, gen = prev.clone(), prev.clone(), prev.clone()
    mask = torch.zeros(len(lens), width)
    ref[:, 0] -= KL_PROMPT_OFFSETS[0]  # position 0: the prompt, off the policy as in the clauses
    for i, n in enumerate(lens):
        for k in range(n):
            logp[i, 1 + k] += math.log(GRID_RATIOS[(k + i) % 6])
            ref[i, 1 + k] = logp[i, 1 + k] - KL_OFFSETS[k % 6]
            gen[i, 1 + k] = prev[i, 1 + k] - math.log(IS_WEIGHTS[k % 6])
            mask[i, 1 + k] = 1
    entropy = torch.rand(len(lens), width, generator=g, dtype=torch.float64) * 4
    adv = torch.tensor([1.0, -0.5, 0.75, -1.25, 0.5, -0.25], dtype=torch.float64)
    return logp, prev, adv, mask, ref, gen, entropy


def _objective_of(mutant: str):
    from rlconform.conformance.mutants import get_mutant

    backend = get_mutant(mutant).backend()
    return backend.trainer(TrainerSettings("text")).core.objective


# mutant -> (the option it lives in, off at the default; the grid point of its axis)
OBJECTIVE_MUTANTS = {
    "clip_bounds_swapped": (lambda c: c.clip_low != c.clip_high, "clip-higher"),
    "dual_clip_on_positive_advantages": (lambda c: c.dual_clip is not None, "dual-clip"),
    "sequence_ratio_product": (lambda c: c.ratio_level == "sequence", "gspo"),
    "kl_estimator_ignored": (lambda c: c.kl_coef and c.kl_estimator != "k3", "kl-k1"),
    "kl_k3_reversed": (lambda c: c.kl_coef and c.kl_estimator == "k3", "kl-k3"),
    "kl_ratio_weight_detached": (lambda c: c.kl_coef and c.kl_ratio_weighted,
                                 "kl-k3-ratio-weighted"),
    "constant_normalizer_from_padded_width": (lambda c: c.aggregation == "constant",
                                              "constant-normalizer"),
    "is_cap_on_policy_ratio": (lambda c: c.is_cap is not None, "truncated-is"),
    "entropy_unmasked": (lambda c: c.entropy_coef > 0, "entropy-bonus"),
    "kl_unmasked": (lambda c: c.kl_coef > 0, "kl-k2"),
}


@pytest.fixture(scope="module")
def objectives():
    return {m: _objective_of(m) for m in OBJECTIVE_MUTANTS}


@pytest.mark.parametrize("mutant", sorted(OBJECTIVE_MUTANTS))
def test_objective_mutant_changes_only_its_axis(objectives, mutant):
    on, point = OBJECTIVE_MUTANTS[mutant]
    assert on(GRID[point])
    logp, prev, adv, mask, ref, gen, entropy = _axis_inputs()
    norm = StepNorm(float(mask.sum()), float(mask.shape[0]))

    def both(cfg):
        out = []
        for objective in (OBJECTIVE, objectives[mutant]):
            x = logp.clone().requires_grad_(True)
            r = grpo_loss(x, prev, adv, mask, norm, cfg, ref, gen, entropy, objective)
            r.loss.backward()
            out.append((r.loss.detach(), x.grad))
        return out

    for name, cfg in [("default", LossConfig()), *GRID.items()]:
        (want, want_grad), (got, got_grad) = both(cfg)
        same = torch.equal(want, got) and torch.equal(want_grad, got_grad)
        if not on(cfg):
            assert same, f"{mutant} changes point {name}, which is off its axis"
        else:  # every point of its axis sees it, not only the one named for it
            assert not same, f"{mutant} does not change point {name} of its axis ({point})"


# core-level mutants, through the in-memory trainer: (option on, the point of its axis)
CORE_MUTANTS = {
    "seq_mean_excludes_empty_rows": (lambda c: c.aggregation != "token-mean",
                                     "seq-mean-token-mean"),
    "seq_mean_per_micro_batch": (lambda c: c.aggregation != "token-mean",
                                 "seq-mean-token-sum"),
    "grad_clip_not_applied": (lambda c: c.max_grad_norm is not None, "grad-clip"),
    "grad_clip_per_micro_batch": (lambda c: c.max_grad_norm is not None, "grad-clip"),
    "old_logprobs_refreshed_per_step": (lambda c: c.optimizer_steps > 1, "epochs-2"),
    "mini_batch_normalized_by_whole_batch": (lambda c: c.mini_batches > 1, "mini-batches-2"),
}


def _core_of(mutant: str):
    from rlconform.conformance.mutants import get_mutant

    backend = get_mutant(mutant).backend()
    return type(backend.trainer(TrainerSettings("text")).core)


def _same(a, b) -> bool:
    return a.loss == b.loss and a.grad_norm == b.grad_norm and all(
        torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)


@pytest.mark.parametrize("mutant", sorted(CORE_MUTANTS))
def test_core_mutant_changes_only_its_axis(text_batch, mutant):
    on, point = CORE_MUTANTS[mutant]
    core = _core_of(mutant)
    # micro-batches of 4 over 6 rows: unequal micro-batches, as a split would make them
    # every point of its axis (not only the one named for it), and some off it
    points = [("default", LossConfig())] + [(p, c) for p, c in GRID.items() if on(c)] + [
        (p, c) for p, c in GRID.items() if not on(c) and p in (
            "clip-higher", "kl-k3", "seq-mean-token-mean", "grad-clip", "epochs-2")]
    for name, cfg in points:
        if name == "grad-clip":  # below this batch's gradient norm at micro-batches of 4
            cfg = dataclasses.replace(cfg, max_grad_norm=1e-3)
        want = _legacy(text_batch, cfg, micro_batch_size=4)
        got = _legacy(text_batch, cfg, core, micro_batch_size=4)
        if not on(cfg):
            assert _same(want, got), f"{mutant} changes point {name}, which is off its axis"
        else:
            assert not _same(want, got), f"{mutant} does not change point {name} of its axis " \
                                         f"({point})"


@pytest.mark.parametrize("mutant", sorted({**OBJECTIVE_MUTANTS, **CORE_MUTANTS}))
def test_every_axis_holds_two_grid_points(mutant):
    """A mutant that lives on one grid point is killed by one case: a second point of its axis
    (another value, or the option under another aggregation) shows the kill is not an accident
    of that point's numbers."""
    on, _ = {**OBJECTIVE_MUTANTS, **CORE_MUTANTS}[mutant]
    points = [p for p, c in GRID.items() if on(c)]
    assert len(points) >= 2, f"{mutant}'s axis holds one grid point: {points}"


def test_every_axis_mutant_dies_at_two_grid_points(tmp_path):
    """The kill matrix, every test of each claimed clause (no stop at the first kill): each axis
    mutant fails cases of at least two grid points of its axis by assertion."""
    import re

    from rlconform.conformance.engine.kill_matrix import kill_matrix

    mutants = {**OBJECTIVE_MUTANTS, **CORE_MUTANTS}
    matrix = kill_matrix(tmp_path, jobs=2, only=sorted(mutants), every_test=True)
    thin = {}
    for row in matrix["mutants"]:
        on, _ = mutants[row["name"]]
        points = {m.group(1) for t, v in row["failed_tests"].items() if v["kind"] == "assertion"
                  for m in [re.search(r"\[[a-z0-9_]+-([a-z0-9-]+)\]$", t)] if m}
        assert all(on(GRID[p]) for p in points), (row["name"], points)
        if len(points) < 2:
            thin[row["name"]] = sorted(points)
    assert not thin, f"axis mutants killed at fewer than two grid points: {thin}"
