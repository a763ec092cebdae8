"""The clipped policy-gradient (GRPO) loss and its metrics, as per-token distributions.

Every metric is returned as the 1-D tensor of its per-token values over the response tokens
under the loss mask, never as a mean alone: a mean ratio of 0.998 hid a max of 2661
(BACKGROUND.md section 5). `summarize` turns such a tensor into min / max / mean / quantiles.

Definitions (BACKGROUND.md section 4), with `gen`, `prev`, `train` the per-token logprobs of the
generation engine, of the trainer's independent recompute before the update, and of the train
forward:
- probs_ratio               = exp(train - prev)              (1 exactly for one inner step)
- token_mult_prob_error     = mean(exp(|gen - prev|))         (>= 1; 1 is perfect)
- sampling_importance_ratio = mean(exp(prev - gen))           (~1 +- 0.02)
- gen_kl_error              = mean(k3(prev - gen))            k3(x) = e^x - 1 - x
- policy_kl_error           = mean(k3(gen - prev))            (~175 when prev is image-blind)
The two KL errors are the k3 estimator in the two directions: with x = log(q/p) for samples
drawn from p, k3 estimates KL(p || q). `gen_kl_error` is KL(gen || prev) over the engine's
samples; `policy_kl_error` swaps the roles, which is what blows up when `prev` is image-blind
and gives the sampled tokens too little mass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

QUANTILES = (0.0, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 1.0)


def k3(x: Tensor) -> Tensor:
    """Schulman's k3 estimator e^x - 1 - x (>= 0, unbiased for KL with x = log(q/p))."""
    return torch.expm1(x) - x


def masked(values: Tensor, mask: Tensor) -> Tensor:
    """The values under the mask, flattened row-major (a deterministic token order)."""
    return values[mask.bool()].detach().float()


def probs_ratio(logp_train: Tensor, logp_prev: Tensor) -> Tensor:
    return torch.exp(logp_train - logp_prev)


def generation_metrics(logp_gen: Tensor, logp_prev: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Per-token engine-vs-trainer agreement metrics over the masked tokens."""
    gen, prev = masked(logp_gen, mask), masked(logp_prev, mask)
    return {
        "token_mult_prob_error": torch.exp((gen - prev).abs()),
        "sampling_importance_ratio": torch.exp(prev - gen),
        "gen_kl_error": k3(prev - gen),
        "policy_kl_error": k3(gen - prev),
    }


@dataclass
class LossOutput:
    """`loss`: this micro-batch's share of the step loss (sum over tokens / global normalizer),
    differentiable; `metrics`: per-token values (1-D, masked, detached, float32)."""

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


def grpo_loss(
    logp: Tensor,
    logp_prev: Tensor,
    advantages: Tensor,
    mask: Tensor,
    normalizer: float,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    logp_reference: Tensor | None = None,
    kl_coef: float = 0.0,
    logp_gen: Tensor | None = None,
) -> LossOutput:
    """Token-level clipped surrogate, summed over masked tokens and divided by `normalizer`.

    `normalizer` is the number of loss tokens in the whole step (every micro-batch of every
    data-parallel rank), so accumulating the micro-batch losses gives the same objective
    whatever the split. `advantages` is `[B]` (one per sample, broadcast over its tokens) or
    `[B, S]` (per token).
    """
    mask_f = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv
    ratio = probs_ratio(logp, logp_prev)
    clamped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * adv, clamped * adv)
    kl = None
    if logp_reference is not None:
        kl = k3(logp_reference - logp)  # KL(policy || reference), samples from the policy
        if kl_coef:
            per_token = per_token + kl_coef * kl
    loss = (per_token * mask_f).sum() / normalizer
    metrics = {
        "probs_ratio": masked(ratio, mask),
        "probs_ratio_clamped": masked(clamped, mask),
        "clipped": masked((ratio != clamped).float(), mask),
        "loss_per_token": masked(per_token, mask),
    }
    if kl is not None:
        metrics["reference_kl"] = masked(kl, mask)
    if logp_gen is not None:
        metrics.update(generation_metrics(logp_gen, logp_prev, mask))
    return LossOutput(loss, metrics)


def summarize(values: Tensor, quantiles: tuple[float, ...] = QUANTILES) -> dict[str, float]:
    """min / max / mean / quantiles of a per-token metric (NaN for an empty tensor)."""
    v = values.detach().double().flatten()
    if v.numel() == 0:
        nan = float("nan")
        return {"count": 0, "min": nan, "max": nan, "mean": nan,
                **{f"q{q:g}": nan for q in quantiles}}
    qs = torch.quantile(v, torch.tensor(quantiles, dtype=torch.double))
    return {"count": int(v.numel()), "min": float(v.min()), "max": float(v.max()),
            "mean": float(v.mean()), **{f"q{q:g}": float(x) for q, x in zip(quantiles, qs)}}
