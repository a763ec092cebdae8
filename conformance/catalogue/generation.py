"""Rollout-vs-trainer clauses (`GEN-*`): the engine's generation against the trainer's passes;
the catalogue's __init__ joins them with the others.

Tolerances are named constants here, each with its source, and the tests read them from here so
no number is written twice.
"""

from __future__ import annotations

import torch

from .clause import Clause
from .data_plane import GLOBAL_EFFECTS, GLOBAL_STATE, UNLESS_DECLARED

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
# GEN-GROUP-INDEPENDENT: the chance that one test case (one family) fails an engine whose group
# members are independent, split evenly (Bonferroni) over the case's (member, prefix) checks
GEN_INDEPENDENT_ALPHA = 1e-6
# each completion token's probability is taken at this multiple of the reference forward's
# (capped at 1), a margin for the engine's numerics: healthy bf16 engines sit within a factor
# 1.05 of the trainer on average (BACKGROUND s4), fp32 within 1 + 1e-6 per token (above); a
# larger chance of agreement only raises the bar, so the margin can only hide a defect, not
# invent one
GEN_INDEPENDENT_SLACK = 2.0

GENERATION_CLAUSES: list[Clause] = [
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
        "The rollout MUST sample only ordinary tokens (an end-of-turn token only as a "
        "completion's last token), stop within each row's cap (0: an empty completion) and "
        "give generation_logprobs exactly on the completion tokens (token_mask), zero on "
        "prompt and padding.",
        "rollout",
        "BACKGROUND.md s7: a random tiny model samples special tokens, including the image "
        "placeholder, which then breaks the recompute",
        ("unrestricted_sampling",),
        regime="exact (token ids and masks).",
    ),
    Clause(
        "GEN-GROUP-INDEPENDENT",
        "In one generate call, the members of a group of identical requests (same prompt, "
        "same images, same cap) MUST be sampled independently: no more members repeat "
        "another's first k tokens than independent draws from the model's sampling "
        "distribution allow.",
        "rollout",
        "a collapsed group (an engine that seeds each request from its content or from the "
        "call seed instead of its row, or serves one request's completion to its duplicates) "
        "gives every member one completion and one reward: the group's advantages are zero "
        "and it teaches nothing, silently; with the suite's synthetic, distinct rewards no "
        "other clause sees it",
        ("group_members_share_one_sample",),
        regime=f"statistical, false-alarm rate < {GEN_INDEPENDENT_ALPHA:g} per test case: "
        "given member a's completion, each other member repeats its first k tokens with "
        "probability pi = prod q(a_t | prompt, a_<t) (q: the reference model's forward, "
        "temperature 1 over ordinary tokens and EOS, each factor taken at "
        f"{GEN_INDEPENDENT_SLACK:g}x and capped at 1), so the count is Binomial(G - 1, pi) and "
        "P(count >= m) <= C(G - 1, m) pi^m; a case fails when that bound is below "
        f"{GEN_INDEPENDENT_ALPHA:g} / (its number of (a, k) checks). Exact under "
        "independence at any width: nothing assumes a near-uniform policy, and the test "
        "checks that a fully collapsed group would fall below the bound.",
    ),
    Clause(
        "GEN-REFIT-SYNC",
        "After each step's refit of the engine from the trainer's weights, the next step's "
        "generation logprobs MUST agree with the trainer's prev logprobs within the "
        "GEN-LOGPROB-AGREEMENT tolerance, step 1 included.",
        "trainer",
        B3 + "the data-plane trainer refit the generation engine at step 1 although weights "
        "were in sync: token_mult_prob_error ~40 at step 1, settling by step 3; an engine "
        "whose refit never reaches the weights it samples with (or keeps KV computed with the "
        "old ones) stays on the old policy",
        ("refit_engine_at_step1", "refit_not_applied"),
        regime="as GEN-LOGPROB-AGREEMENT, at every one of 3 steps (lr 1e-2 moves the policy "
        "far beyond the tolerance in one step, so a stale engine cannot pass). The trainer may "
        "score tokens another way than the engine: TRL 1.16.0's chunked LM head vs the HF "
        "rollout's log-softmax, fp32, measured token_mult_prob_error mean 1 + 2.0e-7, per-token "
        "max 1 + 4.8e-7 (TRL's logprobs vs the reference forward: max |diff| 9.5e-7).",
        also=("rollout",),
    ),
    Clause(
        "GEN-NO-GLOBAL-EFFECTS",
        "generate (a group of identical requests, a request without media, a cap of 0) and "
        "refit MUST leave " + GLOBAL_STATE + " as they were" + UNLESS_DECLARED,
        "rollout",
        GLOBAL_EFFECTS + "; an engine that seeds the global RNGs with its request seed "
        "(transformers.set_seed) makes the trainer's and the driver's later draws repeat "
        "from step to step",
        ("generate_seeds_global_rngs",),
    ),
]
