"""Trainer clauses (`TRAIN-*`); the catalogue's __init__ joins them with the others.

Tolerances are named constants here, each with its source, and the tests read them from here so
no number is written twice.
"""

from __future__ import annotations

import torch

from rlconform.reference_impl.loss import LossConfig

from .clause import Clause
from .data_plane import GLOBAL_EFFECTS, GLOBAL_STATE, UNLESS_DECLARED

B3 = "BACKGROUND.md s3: "

# -- tolerances ---------------------------------------------------------------------------
# canary for TRAIN-RATIO-ONE: the store's prev_logprobs shifted by this; the ratio must follow
RATIO_CANARY_SHIFT = 0.25
RATIO_CANARY_RTOL = 1e-5  # float32 rounding of (prev + shift): ~2e-7 relative
# TRAIN-TRUNCATION-MEDIA: logprobs at kept positions, truncated + dynamic micro-batches vs one
# untruncated micro-batch (another split, so not bitwise: BACKGROUND s5/s7 measured fp32 ~5e-7,
# bf16 up to 5e-3 with SDPA at tiny widths; eager attention is usually bitwise). bf16: another
# split changes the reduction order of the bf16 logits, moving a logit by an ulp or two, and a
# bf16 ulp is 2**-4 for |logit| in [8, 16): measured at production widths on an H200 (nightly,
# 2026-12-03) up to 0.0312 (Qwen2-VL-2B) and 0.0625 (Gemma3-4B), one ulp each. Bound: two ulps
# at |logit| < 16. Dropped or misaligned media move logprobs by whole nats at those widths
# (probs_ratio 0.02-53 in docs/gpu-runs/2026-12-03-h200-production/mutant_effects.md), and
# the clause compares the media the model saw bit for bit besides.
BF16_LOGIT_ULP_AT_16 = 2.0 ** -4
TRUNCATION_LOGPROB_TOL = {torch.float32: 1e-5, torch.bfloat16: 2 * BF16_LOGIT_ULP_AT_16}

# -- trainer numerics: expected values that do not come from the trainer under test ------
# Unit roundoff u (round to nearest) of the dtype a gradient is accumulated in.
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


def loss_reorder_tol(n_tokens: int, l1: float) -> float:
    """How far a float32 loss over `n_tokens` loss tokens may move when its sums are taken in
    another order: 2 * gamma_m * l1 with m = 2 n (each token's term, plus at most one division
    and one accumulation per micro-batch), gamma_m = m u / (1 - m u), u = 2**-24, and `l1` the
    loss's absolute mass sum|l_t| / N (Higham, Accuracy and Stability of Numerical Algorithms,
    2nd ed., s4.2: recursive summation error <= gamma_(n-1) sum|x_i|). The loss is float32
    arithmetic on float32 logprobs whatever the model dtype. Measured (CPU, 3 families, 6
    splits, fp32 and bf16): <= 4.4e-8 * l1, against a bound of ~4.5e-6 * l1 for 19 tokens."""
    m = 2 * max(1, n_tokens)
    u = UNIT_ROUNDOFF[torch.float32]
    return 2 * (m * u / (1 - m * u)) * l1


# Per-parameter gradients and the grad norm of one step cut two ways (or recomputed): relative
# L2 difference. fp32: the reductions over tokens and rows run in another order (gamma_n as
# above, per element); measured <= 1.5e-7 on CPU (recompute: 6.7e-8), tolerance ~70x that.
# bf16: .grad accumulates in bfloat16 (u = 2**-8 = 3.9e-3, one rounding per micro-batch or
# rank), and rows with advantages of both signs cancel, so each rounding is relative to partial
# sums larger than the result; another split also runs other GEMM shapes in every layer of the
# bf16 backward. Measured at tiny width <= 3.9e-3 (recompute: 3.5e-3). At production width on an
# H200 (nightly, 2026-12-03): a recompute with the step's own split 2.2e-3 (Qwen2.5-1.5B), and
# every other split against one micro-batch 0.019-0.028 (SmolVLM-2B), 0.027-0.033 (Qwen2-VL-2B),
# 0.0345 (Qwen2.5-1.5B); worst tensor 0.039, in the first decoder layer (the end of the
# backward). Tolerance 16u = 2**-4 (1.8x the largest). The defects the clauses exist for move
# the gradient by >= 0.67 (relative L2).
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 16 * UNIT_ROUNDOFF[torch.bfloat16]}
# The weight update (W_after - W_before) of one step cut two ways: relative L2 difference.
# AdamW's first step moves each weight by lr * g / (|g| + eps), about +-lr whatever |g|, so
# the update follows the sign of each gradient entry: entries within the reorder noise of 0
# may flip (2 lr each), and bf16 rounds W + update at its 2**-8 relative spacing. Measured
# (CPU) <= 2.5e-5 fp32, <= 3.7e-2 bf16; tolerance ~40x and ~7x; the aggregation defects move
# the update by >= 1.0. (Adam hides a gradient scale: the grad check covers that.)
UPDATE_RTOL = {torch.float32: 1e-3, torch.bfloat16: 0.25}
# TRAIN-LOSS-CLOSED-FORM: the ratio chosen for the k-th completion token of each row (k mod 6):
# above and below the clip range (clip 0.2) and inside it, none on a bound, so with advantages
# of both signs every branch of the clipped surrogate is taken.
CLOSED_FORM_RATIOS = (2.0, 0.5, 1.1, 0.9, 1.5, 0.7)
# TRAIN-LEGACY-PARITY where the model runs fused attention (SDPA/flash) on CUDA: the updated
# weights of each top-level module, |W_dp - W_legacy| / |W_legacy - W_0| (relative L2).
# Production Gemma3-4B's SigLIP tower runs SDPA (eager needs > 135 GiB at 4096 patches an
# image), and its backward is not reproducible even in PyTorch's strict deterministic mode: on
# an H200 (nightly, 2026-12-03, two runs, the second with the backward in strict mode) the two
# paths gave bitwise-equal loss, per-token metrics and grad norm, and tower weights that differ
# in 365-369 of its tensors, about 2% of its entries, 0.011-0.013 of the tower's update.
# Tolerance 2**-4 (~5x). A step that drops or swaps images leaves the tower without its
# gradient or with another one: O(1) of its update. Loss, metrics and grad norm stay bitwise.
FUSED_ATTENTION_UPDATE_RTOL = 2.0 ** -4
# Where that tolerance was measured (family -> top-level modules): it applies there and only
# there. Every other module, fused or not, must update bitwise; a module that runs fused
# attention elsewhere needs its own measurement before it gets a tolerance.
FUSED_ATTENTION_MEASURED = {"gemma3": ("model.vision_tower",)}
# Step loss vs the closed form (and vs the autograd recompute), relative to the loss's absolute
# mass: the stored prev is float32 (logp - ln r), rounded at |logp| <~ ln V + 1 ~ 6 (u * 6 ~
# 4e-7 relative per token's ratio), plus the reorder bound; measured <= 3.3e-8 (recompute:
# 2.0e-8), fp32 and bf16 alike (the loss is float32 arithmetic).
CLOSED_FORM_LOSS_RTOL = 1e-5
# Gradient w.r.t. the logits vs (1/N) coef (onehot - softmax), L1 relative per position: the
# gradient is formed in float32 (fp32: a few ulps), and for a bf16 model cast once to bfloat16
# on its way back through the logits' .float() (2**-9 relative per element); measured
# <= 2.0e-7 fp32, <= 2.2e-3 bf16. A missing softmax term is an L1 error ~0.5.
LOGIT_GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -6}

# -- the GRPO configuration grid (docs/grpo-configurations.md) -----------------------------
# Points of the objective family the numerics clauses run beside the default point, each
# changing one thing (so a failure names its axis), at values real runs use. The clause tests
# put each point's input in the regime where its option changes the answer and assert that
# first: ratios on both sides of both (asymmetric) bounds for both advantage signs, a
# reference that differs from the policy, importance weights on both sides of the cap, rows
# with different numbers of loss tokens (one none), a second optimizer step where the ratio
# is not 1, a gradient norm above the clip.
GRID: dict[str, LossConfig] = {
    # DAPO's clip-higher (Yu et al. 2025): epsilon 0.2 low, 0.28 high
    "clip-higher": LossConfig(clip_low=0.2, clip_high=0.28),
    # dual clip (Ye et al. 2020; TRL `delta` from INTELLECT-2, verl `clip_ratio_c`), > 1 + eps
    "dual-clip": LossConfig(clip_low=0.2, clip_high=0.28, dual_clip=1.8),
    "dual-clip-seq-mean": LossConfig(clip_low=0.2, clip_high=0.28, dual_clip=1.8,
                                     aggregation="seq-mean-token-mean"),
    # GSPO (Zheng et al. 2025) with its paper's clip range 3e-4 / 4e-4
    "gspo": LossConfig(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4),
    # ... and as its paper writes the objective, a mean over the group's sequences
    "gspo-seq-mean": LossConfig(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4,
                                aggregation="seq-mean-token-mean"),
    # KL(policy || reference) in the loss, each estimator (Schulman 2020; verl kl_loss_type)
    "kl-k1": LossConfig(kl_coef=0.1, kl_estimator="k1"),
    "kl-k2": LossConfig(kl_coef=0.1, kl_estimator="k2"),
    "kl-k3": LossConfig(kl_coef=0.1, kl_estimator="k3"),
    # k3 times the ratio (DeepSeek-V3.2; TRL's default `use_bias_correction_kl=True`), at
    # coefficient 0.45: the ratio weight's own gradient is coef * k3(d) * grad(ratio), at 0.1
    # about 2.6% of the step's gradient, under bf16's relative tolerance (2**-4) at production
    # width (docs/gpu-runs/2026-12-05-h100: a detached weight passed there), at 0.45 about 11%.
    # A token's whole logit gradient is ratio * (coef * d - A): 0.45 keeps |coef * d - A| >=
    # 0.05 over KL_OFFSETS x ADVANTAGES (1.0 cancels it exactly at d = A = 1)
    "kl-k3-ratio-weighted": LossConfig(kl_coef=0.45, kl_estimator="k3", kl_ratio_weighted=True),
    "kl-k3-ratio-weighted-seq-mean": LossConfig(kl_coef=0.45, kl_estimator="k3",
                                                kl_ratio_weighted=True,
                                                aggregation="seq-mean-token-mean"),
    # aggregations: GRPO's sequence mean of token means (TRL `grpo`), sequence mean of token
    # sums (TRL `luspo`), Dr. GRPO's constant normaliser (TRL `dr_grpo`, L = 8 > any completion)
    "seq-mean-token-mean": LossConfig(aggregation="seq-mean-token-mean"),
    "seq-mean-token-sum": LossConfig(aggregation="seq-mean-token-sum"),
    "constant-normalizer": LossConfig(aggregation="constant", constant_normalizer=8.0),
    # ... at twice that (TRL's max_completion_length of a longer run): the normaliser is the
    # configured constant whatever its value, not a width that happens to equal it
    "constant-normalizer-16": LossConfig(aggregation="constant", constant_normalizer=16.0),
    # truncated importance sampling on exp(prev - gen) (NeMo-RL, verl, TRL's vLLM correction)
    "truncated-is": LossConfig(is_cap=2.0),
    # TRL's entropy bonus
    "entropy-bonus": LossConfig(entropy_coef=0.01),
    # the options above composed with GRPO's sequence mean of token means (each composes with
    # any aggregation): every option's mutant must die at two points of its axis, not at one
    "truncated-is-seq-mean": LossConfig(is_cap=2.0, aggregation="seq-mean-token-mean"),
    "entropy-bonus-seq-mean": LossConfig(entropy_coef=0.01, aggregation="seq-mean-token-mean"),
    # gradient-norm clipping below the step's norm, under the default aggregation and under
    # GRPO's sequence mean of token means (clipping composes with any loss; a clip mutant must
    # die at both points, not at one)
    "grad-clip": LossConfig(max_grad_norm=0.05),
    "grad-clip-seq-mean": LossConfig(max_grad_norm=0.05, aggregation="seq-mean-token-mean"),
    # several optimizer steps per generation batch (PPO epochs: TRL num_iterations; and
    # mini-batches: verl ppo_mini_batch_size), where the second step's ratio is not 1
    "epochs-2": LossConfig(epochs=2),
    "mini-batches-2": LossConfig(mini_batches=2),
    # ... with an entropy bonus (verl's entropy_coeff under ppo_mini_batch_size)
    "mini-batches-2-entropy-bonus": LossConfig(mini_batches=2, entropy_coef=0.01),
}
# which points each clause runs (every one where its option can change what the clause sees)
CLOSED_FORM_POINTS = tuple(p for p, c in GRID.items()
                           if c.optimizer_steps == 1 and c.max_grad_norm is None)
RECOMPUTE_POINTS = tuple(GRID)
SPLIT_POINTS = ("seq-mean-token-mean", "seq-mean-token-sum", "constant-normalizer",
                "entropy-bonus")
LATER_STEP_POINTS = tuple(p for p, c in GRID.items() if c.optimizer_steps > 1)
# the ratio chosen for the k-th completion token of each row at the grid's token-level points
# (k mod 6): beyond both bounds of [0.72, 1.28], in the asymmetric bands (1.2, 1.28) and
# (0.72, 0.8) that only clip-higher leaves unclipped, and inside
GRID_RATIOS = (2.0, 0.5, 1.25, 0.75, 1.1, 0.9)
# the same at the points with several optimizer steps: beyond both bounds, and at 1 (three in
# six), so that after the first update moves every logprob a little, tokens still lie inside
# the clip range and beyond it on both sides
LATER_RATIOS = (2.0, 1.0, 0.5, 1.0, 3.0, 1.0)
# logp - reference per completion token (k mod 6) at the KL points: both signs, none zero
KL_OFFSETS = (0.5, -0.4, 0.2, -0.7, 1.0, -0.3)
# the same on prompt tokens (j-th before the completion, j mod 4): a reference equal to the
# policy there gives a KL taken over the prompt value and gradient 0 (k2, k3), so a term that
# leaves the loss mask would go unseen
KL_PROMPT_OFFSETS = (0.6, -0.5, 0.3, -0.8)
# exp(prev - gen) per completion token (k mod 6) at the truncated-IS point: both sides of 2
IS_WEIGHTS = (3.0, 0.5, 1.5, 4.0, 0.8, 2.5)
# GSPO: the sequence ratio (geometric mean) each row gets, taken in turn by the rows of each
# advantage sign: positive rows 1.5, 0.6, 1.0001, negative rows 1.6, 0.5, 1.0001 (above, below,
# inside the 3e-4 / 4e-4 range); every token's own ratio is that times 1.1 or 1 / 1.1 in pairs,
# so the product of a row's token ratios is not its geometric mean
GSPO_ROW_RATIOS = (1.5, 1.6, 0.6, 0.5, 1.0001, 1.0001)
# TRAIN-RATIO-LATER-STEPS: the later step's ratio against exp(logp_now - prev), logp_now from
# an independent row-by-row forward of the trainer's weights before that step (other kernels
# than the trainer's batched forward: TRUNCATION_LOGPROB_TOL's regime), in log space
LATER_STEP_LOG_RATIO_TOL = TRUNCATION_LOGPROB_TOL

_BITWISE = ("bitwise: same weights, and every pass splits a shard into the same micro-batches "
            "(members, order, padding are a function of the sequence lengths and settings), "
            "eager attention; CPU and CUDA, fp32 and bf16")

TRAINER_CLAUSES: list[Clause] = [
    Clause(
        "TRAIN-RATIO-ONE",
        "With one inner optimisation step, probs_ratio MUST be exactly 1.0 on every loss token "
        "(min == max == 1.0), with prev_logprobs computed by an independent forward over "
        "inputs fetched through the transport and read back from the store by the train pass.",
        "trainer",
        "BACKGROUND.md s5: forcing old_logp = logp.detach() makes the ratio 1 by construction; "
        "s3 healthy values: min == max == 1.0 exactly on 20/20 steps; " + B3 + "a train fetch "
        "blind to the images gave probs_ratio_max 216-2661 and min 0.0",
        ("forced_ratio", "forced_ratio_after_recompute", "image_blind_train_fetch",
         "image_blind_logprob_fetch"),
        regime=_BITWISE + ". The prev pass must fetch (recorded at the transport) and run a "
        "forward before it puts prev_logprobs; canary: with the stored prev_logprobs shifted "
        f"by +{RATIO_CANARY_SHIFT}, probs_ratio must equal exp(-{RATIO_CANARY_SHIFT}) within "
        f"rtol {RATIO_CANARY_RTOL:g} (float32 rounding of prev + shift).",
    ),
    Clause(
        "TRAIN-FIELD-PARITY",
        "The logprob, reference-logprob and train fetches MUST ask for the same multimodal "
        "fields, exactly those the processor emitted (none for a text-only family).",
        "trainer",
        B3 + "train fetch used a static text-only field list while the logprob fetch had "
        "images: probs_ratio_max 216-2661, probs_ratio_min 0.0, clamped ratio pinned at the "
        "clip bounds, mean ~0.998",
        ("image_blind_train_fetch", "image_blind_logprob_fetch",
         "per_token_map_missing_in_train"),
        regime="exact set equality of field names per stage; the step's probs_ratio is "
        "recorded (min, max, mean, quantiles) and must be 1.0 bitwise as in TRAIN-RATIO-ONE.",
    ),
    Clause(
        "TRAIN-LEGACY-PARITY",
        "The data-plane step and the in-memory (legacy) step MUST give bitwise-equal loss, "
        "per-token metrics, grad norm and updated weights for text-only, image, mixed and "
        "media-free batches, and with data parallelism where one shard is media-free.",
        "trainer",
        "BACKGROUND.md s1: both paths must give the same numbers; " + B3 + "empty media rows "
        "decoded as (0, ...) tensors: an image-free shard gave pixel_values (0, ...) where "
        "legacy gave None",
        ("image_blind_train_fetch", "image_blind_logprob_fetch",
         "per_token_map_missing_in_train", "refit_engine_at_step1"),
        regime=_BITWISE + "; both paths use the shards of meta.shard_for_dp(world). Where "
        "the model runs fused attention (SDPA, flash) on CUDA, its backward is not "
        "reproducible (production Gemma3-4B's SigLIP tower on an H200): loss, metrics and "
        "grad norm stay bitwise, and the updated weights of each top-level module agree within "
        f"{FUSED_ATTENTION_UPDATE_RTOL:g} of that module's update (relative L2; measured "
        "0.011-0.013).",
    ),
    Clause(
        "TRAIN-TRUNCATION-MEDIA",
        "Sequence truncation and dynamic micro-batching MUST leave every sample's media intact "
        "inside a real step: the model sees, row by row, the media the rollout wrote, and the "
        "logprobs at kept positions agree with an untruncated single-micro-batch run.",
        "trainer",
        B3 + "truncate_tensors narrowed every >=2-D tensor on dim 1: wire-form pixel_values "
        "silently cut, or narrow(): length > size",
        ("truncation_narrows_media", "dynamic_batching_misaligns_media"),
        regime="media seen by the model: bitwise equal to the rollout's rows; probs_ratio "
        "1.0 bitwise (same split in both passes); logprobs vs the untruncated single "
        "micro-batch run (another split, not bitwise): max |diff| <= "
        f"{TRUNCATION_LOGPROB_TOL[torch.float32]:g} (fp32), "
        f"{TRUNCATION_LOGPROB_TOL[torch.bfloat16]:g} (bf16: two ulps of a bf16 logit below 16; "
        "measured one ulp at production widths) (BACKGROUND s5/s7 batch variance).",
    ),
    Clause(
        "TRAIN-REFERENCE-FROZEN",
        "The reference-logprob pass MUST use a frozen copy of the initial weights: at step 0 "
        "reference_logprobs equal prev_logprobs, and after an update they still equal the "
        "initial policy's logprobs.",
        "trainer",
        "a reference policy that follows the policy makes the KL penalty and reference_kl "
        "vanish silently (the KL anchor drifts); no field report, a GRPO invariant",
        ("stale_reference_weights",),
        regime=_BITWISE + "; reference_kl == 0 exactly at step 0.",
    ),
    Clause(
        "TRAIN-SPLIT-INVARIANCE",
        "One step's loss, grad norm, per-parameter gradients and weight update MUST NOT "
        "depend on how the step is cut: one micro-batch, micro-batches of 1 and 2, a token "
        "budget, 2 and 3 data-parallel ranks, on a batch whose rows hold different numbers of "
        "loss tokens (one none); and a row's prev logprobs MUST NOT depend on its micro-batch. "
        "The same holds at every grid point whose normaliser a split could change (the "
        "sequence-mean and constant-normaliser aggregations, the entropy bonus).",
        "trainer",
        "a loss normalised per micro-batch (the transformers gradient-accumulation bug, fixed "
        "in 4.46: right only when every micro-batch has the same token count), gradients "
        "averaged over ranks with the wrong divisor and per-token advantages broadcast on "
        "the wrong axis live in code both trainer paths share: TRAIN-LEGACY-PARITY cannot "
        "see them",
        ("loss_mean_per_micro_batch", "dp_grad_wrong_divisor", "advantage_wrong_axis",
         "dynamic_batching_misaligns_media", "seq_mean_per_micro_batch",
         "constant_normalizer_from_padded_width"),
        regime="not bitwise in general: the loss and gradient sums run in another order per "
        "split. Loss: |diff| <= 2 gamma_2N sum|l_t| / N (float32 reordering bound, Higham "
        "s4.2; N loss tokens; measured <= 4.4e-8 sum|l_t| / N). Grad norm and per-parameter "
        f"gradients (relative L2, overall and per tensor): <= {GRAD_RTOL[torch.float32]:g} "
        f"fp32 (measured 1.5e-7), <= {GRAD_RTOL[torch.bfloat16]:.3g} bf16 (16 u_bf16: .grad "
        "accumulates in bf16 per micro-batch and rank; measured 3.9e-3 tiny, up to 0.0345 at "
        "production width). Weight update (relative L2): <= "
        f"{UPDATE_RTOL[torch.float32]:g} fp32, <= {UPDATE_RTOL[torch.bfloat16]:g} bf16 "
        "(AdamW's first step is ~lr * sign(g); measured 2.5e-5, 3.7e-2). Bitwise: "
        "probs_ratio == 1.0 on every loss token of every split (a step's prev and train "
        "passes share its micro-batches), and a row's loss-token prev logprobs across splits "
        "for smolvlm and text on CPU with eager attention (the model's config says so; "
        "measured bitwise over seeds 0-5, fp32 and bf16, gemma3 too). Qwen2-VL (and "
        "Qwen3-VL) run every image of a micro-batch through one vision-tower matmul: its "
        "fp32 logprobs move by up to 4.8e-7, so it and every CUDA run (kernels picked per "
        "shape) get TRAIN-TRUNCATION-MEDIA's logprob tolerance. At production width the "
        "clause runs 5 of its 7 splits (one micro-batch, micro-batches of 1, a token budget, "
        "3 ranks x micro-batches of 1, 2 ranks x a token budget): every kind of cut its "
        "mutants need, without the two repeats at other sizes; the grid points run those 5 "
        "everywhere, on the text family (the normalisers do not depend on media). Points with "
        "several optimizer steps are left out: a later step starts from the first step's "
        "update, which agrees across splits only within the update tolerance "
        "(TRAIN-RATIO-LATER-STEPS and TRAIN-GRAD-RECOMPUTE check them from the trainer's own "
        "weights instead).",
    ),
    Clause(
        "TRAIN-LOSS-CLOSED-FORM",
        "With the stored prev logprobs set to the trainer's own shifted by -ln r per loss "
        "token (r cycling over 2, 0.5, 1.1, 0.9, 1.5, 0.7; advantages of both signs), the "
        "step loss MUST be the token-mean over the step of -min(r A, clip(r, 1 - 0.2, "
        "1 + 0.2) A), and the gradient w.r.t. the logits at the position predicting each "
        "loss token MUST be (1/N) dl/dlogp (onehot(y) - softmax(z)), and exactly 0 at every "
        "other position (prompt, padding, clipped tokens): both computed by plain arithmetic "
        "in the test. At every single-step grid point (clip-higher, dual clip, GSPO, KL with "
        "k1 / k2 / k3 and ratio-weighted k3 against a reference that differs from the policy, "
        "the three other aggregations, truncated importance sampling, entropy bonus) the step "
        "loss and the logit gradient MUST be those of the point's written-out objective, "
        "evaluated in float64 on the trainer's own logits and the stored columns.",
        "trainer",
        "sequence-mean instead of token-mean aggregation and a clip applied as "
        "min(ratio, 1 + eps) only are invariant to every split and invisible at ratio 1; a "
        "token-logprob gather that detaches its log-normaliser gives the right values "
        "(ratio 1) and a gradient without the -softmax term",
        ("sequence_mean_loss", "clip_upper_only", "logprob_detached_normalizer",
         "loss_mean_per_micro_batch", "advantage_wrong_axis", "forced_ratio_after_recompute",
         "clip_bounds_swapped", "dual_clip_on_positive_advantages", "sequence_ratio_product",
         "kl_estimator_ignored", "kl_k3_reversed", "kl_ratio_weight_detached",
         "seq_mean_excludes_empty_rows", "constant_normalizer_from_padded_width",
         "is_cap_on_policy_ratio", "entropy_unmasked", "kl_unmasked"),
        regime="not bitwise: the ratio comes from a float32 prev (logp - ln r). Loss: "
        f"|diff| <= {CLOSED_FORM_LOSS_RTOL:g} sum|l_t| / N (float32 rounding of prev at "
        "|logp| ~ 6 is ~4e-7 per token; measured <= 3.3e-8). probs_ratio: the chosen r within "
        f"rtol {RATIO_CANARY_RTOL:g}. Logit gradient, L1 relative per position: <= "
        f"{LOGIT_GRAD_RTOL[torch.float32]:g} fp32, <= {LOGIT_GRAD_RTOL[torch.bfloat16]:g} "
        "bf16 (formed in float32, cast once to bf16 for a bf16 model; measured 2.0e-7, "
        "2.2e-3); exactly 0 (bitwise) where the loss has no gradient. Assumes "
        "TRAIN-RATIO-ONE (train logprobs equal the prev pass's bitwise). Grid points: the "
        "stored prev (and reference, generation) columns are the trainer's own prev shifted "
        "per token, so every ratio, KL offset and importance weight is a chosen number; each "
        "point's test first asserts its regime (the ratios on both sides of both bounds for "
        "both advantage signs and in the asymmetric bands, a negative-advantage ratio above the "
        "dual clip, sequence ratios on both sides and inside, reference != policy on every "
        "token, weights on both sides of the cap, rows of unequal token counts with one empty, "
        "an entropy term larger than the tolerance); loss and logit gradient are then the "
        "float64 autograd of the written-out objective on the captured logits, with the same "
        "tolerances. A point the backend does not declare (trainer factory `loss_options`) is "
        "not applicable, its message naming the point and the backend's reason.",
    ),
    Clause(
        "TRAIN-GRAD-RECOMPUTE",
        "The step's loss, grad norm and per-parameter gradients (2 data-parallel ranks, "
        "ratios as in TRAIN-LOSS-CLOSED-FORM) MUST equal plain autograd of the written-out "
        "token-mean clipped loss on an independent copy of the initial model, fed row by row "
        "from the processor's output with the completion appended (no batching, no padding, "
        "no trainer code). At every grid point the same holds for the point's objective, and "
        "for every optimizer step of the batch (epochs, mini-batches): step k's loss, grad "
        "norm and the gradient the optimizer applies (after gradient-norm clipping) MUST equal "
        "the recompute on the trainer's own weights before step k.",
        "trainer",
        "every defect between the logprobs and the optimizer (aggregation, clipping, "
        "advantage broadcast, gather gradient, gradient reduction over ranks) shared by "
        "both trainer paths; gradients averaged over ranks with the wrong divisor are hidden "
        "from the weights by Adam's scale invariance",
        ("dp_grad_wrong_divisor", "sequence_mean_loss", "clip_upper_only",
         "logprob_detached_normalizer", "loss_mean_per_micro_batch", "advantage_wrong_axis",
         "clip_bounds_swapped", "dual_clip_on_positive_advantages", "sequence_ratio_product",
         "kl_estimator_ignored", "kl_k3_reversed", "kl_ratio_weight_detached",
         "seq_mean_excludes_empty_rows", "constant_normalizer_from_padded_width",
         "is_cap_on_policy_ratio", "entropy_unmasked", "kl_unmasked", "grad_clip_not_applied",
         "grad_clip_per_micro_batch",
         "old_logprobs_refreshed_per_step", "mini_batch_normalized_by_whole_batch"),
        regime="not bitwise (per-row forwards vs the trainer's micro-batches, other reduction "
        f"orders). Loss: |diff| <= {CLOSED_FORM_LOSS_RTOL:g} sum|l_t| / N (measured 2.0e-8); "
        "grad norm and per-parameter gradients (relative L2, overall and per tensor): as "
        "TRAIN-SPLIT-INVARIANCE (measured 6.7e-8 fp32, 3.5e-3 bf16). The gradient the "
        "optimizer applies is read by a torch optimizer step pre-hook; with gradient clipping "
        "it must be the recompute's times min(1, max / (norm + 1e-6)), and the test first "
        "asserts the norm exceeds the bound. Grid points with several optimizer steps run one "
        "rank (a mini-batch is each rank's own consecutive part: its members depend on the "
        "sharding) and assert that a later step's ratio is not 1.",
    ),
    Clause(
        "TRAIN-RATIO-LATER-STEPS",
        "When a generation batch takes several optimizer steps (PPO epochs, mini-batches), the "
        "first step's probs_ratio MUST be exactly 1.0 (TRAIN-RATIO-ONE), and on every later "
        "step each loss token's probs_ratio MUST be exp(logp_now - prev), logp_now the policy "
        "after the earlier steps and prev the stored prev_logprobs (the behaviour policy, "
        "never refreshed between steps); the step loss MUST be the clipped objective at those "
        "ratios, clipped exactly where the formula says.",
        "trainer",
        "a trainer that re-runs the old-logprob pass before each mini-batch or epoch is "
        "on-policy at every step (ratio 1, the clip never acts), and one that reuses the first "
        "step's forward trains every epoch on stale logprobs: both pass every single-step "
        "clause",
        ("old_logprobs_refreshed_per_step",),
        regime="step 1: the ratio the stored prev implies (its train logprobs are the prev "
        "pass's, TRAIN-RATIO-ONE; the stored prev is shifted per token as in "
        f"TRAIN-LOSS-CLOSED-FORM, rtol {RATIO_CANARY_RTOL:g}). Later steps: logp_now from an "
        "independent row-by-row "
        "forward of the trainer's own weights before that step (a torch optimizer step "
        "pre-hook snapshots them), so the clip is live on both sides; log-ratio within "
        f"{LATER_STEP_LOG_RATIO_TOL[torch.float32]:g} fp32, "
        f"{LATER_STEP_LOG_RATIO_TOL[torch.bfloat16]:g} bf16 (TRAIN-TRUNCATION-MEDIA's "
        "batch-variance bound); the test first asserts that the later step's ratios are not 1 "
        "(the update moved the policy beyond that tolerance) and that tokens lie inside and "
        "outside the clip range for both advantage signs. Step loss vs the written-out "
        f"objective at the independent ratios: |diff| <= {CLOSED_FORM_LOSS_RTOL:g} of its "
        "absolute mass plus the ratio tolerance's effect on it. Runs the grid points with "
        "several optimizer steps that the backend declares.",
    ),
]


# -- order-free passes and intact pass inputs: kinds of check that hold whatever the step -------
# (after the GEN-* clauses in the catalogue's order)
PASS_CLAUSES: list[Clause] = [
    Clause(
        "TRAIN-ORDER-FREE",
        "The logprob, reference-logprob and train passes MUST give every row the same outputs "
        "(the logprob column stored under its key; the train pass's per-token loss and "
        "token_mult_prob_error, as multisets since a trainer may walk rows in its own order) "
        "whatever order the meta lists the keys in: the put order, "
        "reversed, shuffled, interleaved, as interleaved shards passed in turn, or as the DP "
        "shards concatenated.",
        "trainer",
        "DP balancing, rank shards and filters hand the trainer keys in another order than "
        "they were put; a trainer that pairs what it fetched with the meta's keys by position, "
        "where the store answered in its own order, writes one row's logprobs under another's "
        "key, and every clause that passes metas in put order passes",
        ("trainer_fetches_in_put_order", "advantages_fetched_in_put_order"),
        regime="bitwise per row with one row per micro-batch (micro_batch_size 1): every row's "
        "forward sees the same inputs and padding in every order (BACKGROUND.md s7).",
    ),
    Clause(
        "TRAIN-INPUT-INTACT",
        "Every argument of a logprob, reference-logprob or train pass (each meta, DP shards "
        "of uneven size included, and the list of metas) MUST be unchanged afterwards: keys, "
        "fields, seq_lens, tags and extra.",
        "trainer",
        "the driver keeps the shard metas it dispatched (to collect, to retry, to clear the "
        "step's keys); a pass that extends, trims or reorders them in place changes what the "
        "driver holds with no error",
        ("trainer_train_consumes_caller_fields", "train_consumes_meta_list"),
    ),
    Clause(
        "TRAIN-NO-GLOBAL-EFFECTS",
        "The data-plane trainer's logprob, reference-logprob and train passes and state_dict, "
        "and the in-memory trainer's passes, MUST leave " + GLOBAL_STATE + " as they were"
        + UNLESS_DECLARED,
        "trainer",
        GLOBAL_EFFECTS + "; a step that turns grad mode off for its metrics and never back "
        "leaves the driver's next autograd work (a value head, a reward model) without "
        "gradients",
        ("train_leaves_grad_disabled", "train_leaves_anomaly_detection_on"),
    ),
]
