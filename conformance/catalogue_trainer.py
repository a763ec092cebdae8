"""Trainer (`TRAIN-*`) and rollout-vs-trainer (`GEN-*`) clauses; catalogue.py joins them.

Tolerances are named constants here, each with its source, and the tests read them from here so
no number is written twice.
"""

from __future__ import annotations

import torch

from .clause import Clause

B3 = "BACKGROUND.md s3: "

# -- tolerances ---------------------------------------------------------------------------
# token_mult_prob_error (mean over loss tokens) between the engine's generation logprobs and the
# trainer's prev logprobs. fp32: KV-cache decode vs full forward differs by ~5e-7 per token
# (BACKGROUND s7); measured on CPU and on an H200, fp32 and bf16, every family: mean <= 1 + 1.2e-7,
# per-token max <= 1 + 9.6e-7. 1e-4 is a ~1000x margin that still fails the mildest defect seen
# (an image-blind prev pass on these tiny random models: 1.024). bf16: the strict field gate
# (BACKGROUND s4: healthy bf16 engines 1.01-1.05); it does NOT catch that image-blind prev pass
# on tiny random models (their logits barely depend on the images), which is why the exact
# field clauses (TRAIN-FIELD-PARITY, GEN-ROLLOUT-FIELDS) exist beside it.
GEN_TMPE_TOL = {torch.float32: 1.0 + 1e-4, torch.bfloat16: 1.05}
# sampling_importance_ratio mean must lie in 1 +- this (BACKGROUND s4: ~1 +- 0.02)
GEN_SIR_TOL = 0.02
# canary for TRAIN-RATIO-ONE: the store's prev_logprobs shifted by this; the ratio must follow
RATIO_CANARY_SHIFT = 0.25
RATIO_CANARY_RTOL = 1e-5  # float32 rounding of (prev + shift): ~2e-7 relative
# TRAIN-TRUNCATION-MEDIA: logprobs at kept positions, truncated + dynamic micro-batches vs one
# untruncated micro-batch (another split, so not bitwise: BACKGROUND s5/s7 measured fp32 ~5e-7,
# bf16 up to 5e-3 with SDPA; eager attention is usually bitwise)
TRUNCATION_LOGPROB_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

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
        regime=_BITWISE + "; both paths use the shards of meta.shard_for_dp(world).",
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
        f"{TRUNCATION_LOGPROB_TOL[torch.bfloat16]:g} (bf16) (BACKGROUND s5/s7 batch variance).",
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
        "GEN-LOGPROB-AGREEMENT",
        "The trainer's prev logprobs MUST agree with the rollout's generation logprobs: "
        "token_mult_prob_error within the dtype's tolerance and sampling_importance_ratio "
        "within 1 +- 0.02.",
        "rollout",
        B3 + "rollout write silently dropped the jagged packed fields: prev_logprobs "
        "image-blind, token_mult_prob_error ~176, sampling_importance_ratio ~0.982, "
        "policy_kl_error ~175, probs_ratio still 1",
        ("dropped_packed_on_rollout_write", "perturbed_generation_logprobs",
         "image_blind_logprob_fetch"),
        regime="not bitwise (KV-cache decode vs full forward): token_mult_prob_error mean <= "
        f"{GEN_TMPE_TOL[torch.float32]:.4f} fp32 (measured mean <= 1 + 1.2e-7, per-token max <= "
        "1 + 9.6e-7, CPU and H200), <= "
        f"{GEN_TMPE_TOL[torch.bfloat16]:g} bf16 (BACKGROUND s4 strict gate); "
        f"sampling_importance_ratio mean in 1 +- {GEN_SIR_TOL:g} (BACKGROUND s4).",
    ),
    Clause(
        "GEN-ROLLOUT-FIELDS",
        "The rollout's batch MUST carry every field the processor emitted, each sample's media "
        "equal to the processor's output for it (floating media cast once to the policy dtype, "
        "integer geometry never cast) and per-token maps zero over the completion.",
        "rollout",
        B3 + "rollout write kept only torch.Tensor values, silently dropping jagged packed "
        "fields; rollout write dropped the pixel dtype cast (pixel_values fp32 instead of bf16)",
        ("dropped_packed_on_rollout_write",),
        regime="exact (field names, dtypes, shapes and values), in every dtype: it does not "
        "depend on how strongly a tiny random model attends to its images.",
    ),
    Clause(
        "GEN-ORDINARY-TOKENS",
        "The rollout MUST sample only ordinary tokens and give generation_logprobs exactly on "
        "the completion tokens (token_mask), zero on prompt and padding.",
        "rollout",
        "BACKGROUND.md s7: a random tiny model samples special tokens, including the image "
        "placeholder, which then breaks the recompute",
        ("unrestricted_sampling",),
        regime="exact (token ids and masks).",
    ),
    Clause(
        "GEN-REFIT-SYNC",
        "After each step's refit of the engine from the trainer's weights, the next step's "
        "generation logprobs MUST agree with the trainer's prev logprobs within the "
        "GEN-LOGPROB-AGREEMENT tolerance, step 1 included.",
        "trainer",
        B3 + "the data-plane trainer refit the generation engine at step 1 although weights "
        "were in sync: token_mult_prob_error ~40 at step 1, settling by step 3",
        ("refit_engine_at_step1",),
        regime="as GEN-LOGPROB-AGREEMENT, at every one of 3 steps (lr 1e-2 moves the policy "
        "far beyond the tolerance in one step, so a stale engine cannot pass). The trainer may "
        "score tokens another way than the engine: TRL 1.16.0's chunked LM head vs the HF "
        "rollout's log-softmax, fp32, measured token_mult_prob_error mean 1 + 2.0e-7, per-token "
        "max 1 + 4.8e-7 (TRL's logprobs vs the reference forward: max |diff| 9.5e-7).",
    ),
]
