"""The GRPO objective family and its metrics, as per-token distributions.

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

The objective is a point of the family `LossConfig` names; docs/grpo-configurations.md defines
every field once, with the paper or framework function it comes from. `Objective` computes it
in parts (ratio, surrogate, KL, importance weight, aggregation weights, entropy), so that a
mutant (conformance/mutants/trainer.py) replaces exactly one part.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

QUANTILES = (0.0, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 1.0)

RATIO_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant")


@dataclass(frozen=True)
class LossConfig:
    """One point of the GRPO objective family (docs/grpo-configurations.md, one section per
    field). The defaults are the point every trainer clause ran at before the family existed:
    symmetric clip 0.2, no KL, token-mean, one optimizer step, no correction, no clipping.

    - `clip_low`, `clip_high`: the ratio is clipped to [1 - clip_low, 1 + clip_high] (DAPO's
      clip-higher when clip_high > clip_low);
    - `dual_clip`: c > 1 + clip_high: for a negative advantage the token loss is at most c |A|
      (dual-clip PPO; TRL `delta`, verl `clip_ratio_c`);
    - `ratio_level`: "token", or "sequence" (GSPO: exp of the mean log-ratio over the row's
      loss tokens, i.e. the geometric mean of its token ratios, for every token of the row);
    - `kl_coef`, `kl_estimator`: beta * KL(policy || reference) added per token, estimated by
      k1 = d, k2 = d^2 / 2 or k3 = e^-d - 1 + d with d = logp - logp_reference;
      `kl_ratio_weighted`: the estimate multiplied by the (differentiable) ratio (DeepSeek-V3.2;
      TRL `use_bias_correction_kl`);
    - `aggregation`: how token losses become the step loss (weights per token of row i, with N
      the step's loss tokens, B its rows, n_i row i's loss tokens): token-mean 1/N,
      seq-mean-token-mean 1/(B n_i), seq-mean-token-sum 1/B, constant 1/(B L) with
      L = `constant_normalizer` (Dr. GRPO). Rows without loss tokens count in B;
    - `is_cap`: truncated importance sampling: the policy loss of each token multiplied by
      min(exp(prev - gen), cap), a constant (no gradient);
    - `entropy_coef`: minus coef times the mean entropy over the step's loss tokens (whatever
      the aggregation; TRL `entropy_coef`);
    - `mini_batches`, `epochs`: optimizer steps per generation batch: each data-parallel shard
      is cut into `mini_batches` consecutive parts (part k holds rows [k n / M, (k+1) n / M)),
      and the parts are stepped on in order, `epochs` times; the old logprobs stay those of the
      prev pass (the behaviour policy) for every step;
    - `max_grad_norm`: the gradient is scaled by min(1, max / (norm + 1e-6)) before each
      optimizer step (torch.nn.utils.clip_grad_norm_).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    ratio_level: str = "token"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_ratio_weighted: bool = False
    aggregation: str = "token-mean"
    constant_normalizer: float | None = None
    is_cap: float | None = None
    entropy_coef: float = 0.0
    mini_batches: int = 1
    epochs: int = 1
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"LossConfig.{name} = {getattr(self, name)!r}: {why}")

        if not 0.0 <= self.clip_low < 1.0:
            bad("clip_low", "must be in [0, 1) (the lower bound 1 - clip_low must stay > 0)")
        if not self.clip_high >= 0.0:
            bad("clip_high", "must be >= 0")
        if self.dual_clip is not None and not self.dual_clip > 1.0 + self.clip_high:
            bad("dual_clip", f"must exceed 1 + clip_high = {1.0 + self.clip_high:g} (below it "
                "the bound would cut into the clip range itself)")
        if self.ratio_level not in RATIO_LEVELS:
            bad("ratio_level", f"must be one of {RATIO_LEVELS}")
        if not self.kl_coef >= 0.0:
            bad("kl_coef", "must be >= 0")
        if self.kl_estimator not in KL_ESTIMATORS:
            bad("kl_estimator", f"must be one of {KL_ESTIMATORS}")
        if self.aggregation not in AGGREGATIONS:
            bad("aggregation", f"must be one of {AGGREGATIONS}")
        if (self.aggregation == "constant") != (self.constant_normalizer is not None):
            bad("constant_normalizer", "is required by aggregation 'constant' and only there")
        if self.constant_normalizer is not None and not self.constant_normalizer > 0:
            bad("constant_normalizer", "must be > 0")
        if self.is_cap is not None and not self.is_cap > 0:
            bad("is_cap", "must be > 0")
        if not self.entropy_coef >= 0.0:
            bad("entropy_coef", "must be >= 0")
        for name in ("mini_batches", "epochs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, "must be an int >= 1")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            bad("max_grad_norm", "must be > 0")

    @property
    def optimizer_steps(self) -> int:
        return self.mini_batches * self.epochs

    def changes(self) -> dict:
        """The fields that differ from the default point."""
        base = LossConfig()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(base, f.name)}


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


@dataclass(frozen=True)
class StepNorm:
    """What the step's loss is normalised by, summed over every micro-batch and data-parallel
    rank of one optimizer step: its loss tokens and its rows (rows without loss tokens too)."""

    tokens: float
    rows: float


@dataclass
class LossOutput:
    """`loss`: this micro-batch's share of the step loss (differentiable); `metrics`: per-token
    values (1-D, masked, detached, float32)."""

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


class Objective:
    """The family's objective, part by part (each method one field of `LossConfig`)."""

    def ratio(self, logp: Tensor, prev: Tensor, mask: Tensor, cfg: LossConfig) -> Tensor:
        """The importance ratio the clip acts on, `[B, S]` (sequence level: the row's value on
        each of its tokens)."""
        if cfg.ratio_level == "token":
            return torch.exp(logp - prev)
        n = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        return torch.exp(((logp - prev) * mask).sum(dim=1, keepdim=True) / n).expand_as(logp)

    def clipped(self, ratio: Tensor, cfg: LossConfig) -> Tensor:
        return ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)

    def surrogate(self, ratio: Tensor, adv: Tensor, cfg: LossConfig) -> Tensor:
        """-min(r A, clip(r) A) per token; with a dual clip c, at most c |A| where A < 0."""
        loss = -torch.minimum(ratio * adv, self.clipped(ratio, cfg) * adv)
        if cfg.dual_clip is not None:
            loss = torch.where(adv < 0, torch.minimum(loss, -cfg.dual_clip * adv), loss)
        return loss

    def kl(self, logp: Tensor, ref: Tensor, cfg: LossConfig) -> Tensor:
        d = logp - ref
        if cfg.kl_estimator == "k1":
            return d
        if cfg.kl_estimator == "k2":
            return 0.5 * d * d
        return k3(-d)

    def kl_term(self, kl: Tensor, ratio: Tensor, cfg: LossConfig) -> Tensor:
        """What the KL coefficient multiplies: the estimate, or the estimate times the ratio."""
        return kl * ratio if cfg.kl_ratio_weighted else kl

    def is_weight(self, prev: Tensor, gen: Tensor, cfg: LossConfig) -> Tensor:
        return torch.exp(prev - gen).clamp(max=cfg.is_cap).detach()

    def weights(self, mask: Tensor, norm: StepNorm, cfg: LossConfig) -> Tensor:
        """Each row's aggregation weight, `[B, 1]`."""
        rows = mask.shape[0]
        if cfg.aggregation == "token-mean":
            return mask.new_full((rows, 1), 1.0 / norm.tokens)
        if cfg.aggregation == "seq-mean-token-mean":
            return 1.0 / (norm.rows * mask.sum(dim=1, keepdim=True).clamp(min=1.0))
        if cfg.aggregation == "seq-mean-token-sum":
            return mask.new_full((rows, 1), 1.0 / norm.rows)
        return mask.new_full((rows, 1), 1.0 / (norm.rows * cfg.constant_normalizer))

    def entropy_weight(self, norm: StepNorm, cfg: LossConfig) -> float:
        return cfg.entropy_coef / norm.tokens

    def entropy_sum(self, entropy: Tensor, mask: Tensor) -> Tensor:
        """The micro-batch's entropies over its loss tokens, summed."""
        return (entropy * mask).sum()

    def loss(self, logp: Tensor, prev: Tensor, advantages: Tensor, mask: Tensor,
             norm: StepNorm, cfg: LossConfig, ref: Tensor | None = None,
             gen: Tensor | None = None, entropy: Tensor | None = None) -> LossOutput:
        mask_f = mask.to(logp.dtype)
        adv = advantages.to(logp.dtype)
        adv = adv[:, None] if adv.dim() == 1 else adv
        ratio = self.ratio(logp, prev, mask_f, cfg)
        clamped = self.clipped(ratio, cfg)
        per_token = self.surrogate(ratio, adv, cfg)
        metrics = {}
        if cfg.is_cap is not None:
            if gen is None:
                raise ValueError("LossConfig.is_cap is set but the batch has no "
                                 "generation_logprobs to weight by")
            w = self.is_weight(prev, gen, cfg)
            per_token = per_token * w
            metrics["is_weight"] = masked(w, mask)
        kl = None
        if ref is not None:
            kl = self.kl(logp, ref, cfg)
            if cfg.kl_coef:
                per_token = per_token + cfg.kl_coef * self.kl_term(kl, ratio, cfg)
        elif cfg.kl_coef:
            raise ValueError("LossConfig.kl_coef is set but the batch has no "
                             "reference_logprobs")
        loss = (per_token * mask_f * self.weights(mask_f, norm, cfg)).sum()
        if cfg.entropy_coef:
            if entropy is None:
                raise ValueError("LossConfig.entropy_coef is set but no entropies were given")
            loss = loss - self.entropy_weight(norm, cfg) * self.entropy_sum(entropy, mask_f)
            metrics["entropy"] = masked(entropy, mask)
        metrics.update({
            "probs_ratio": masked(ratio, mask),
            "probs_ratio_clamped": masked(clamped, mask),
            "clipped": masked((ratio != clamped).float(), mask),
            "loss_per_token": masked(per_token, mask),
        })
        if kl is not None:
            metrics["reference_kl"] = masked(kl, mask)
        return LossOutput(loss, metrics)


OBJECTIVE = Objective()


def grpo_loss(
    logp: Tensor,
    logp_prev: Tensor,
    advantages: Tensor,
    mask: Tensor,
    normalizer: float | StepNorm,
    config: LossConfig | None = None,
    logp_reference: Tensor | None = None,
    logp_gen: Tensor | None = None,
    entropy: Tensor | None = None,
    objective: Objective = OBJECTIVE,
) -> LossOutput:
    """The objective `config` names for one micro-batch: its token losses times their
    aggregation weights, summed (so accumulating the micro-batches of a step gives the step
    loss whatever the split).

    `normalizer` counts the whole optimizer step (every micro-batch of every data-parallel
    rank): a `StepNorm`, or just its loss-token count for the token-mean aggregations.
    `advantages` is `[B]` (one per sample, broadcast over its tokens) or `[B, S]` (per token).
    `entropy` (`[B, S]`, the policy's entropy at the position predicting each token) is needed
    with an entropy bonus only.
    """
    cfg = config or LossConfig()
    if not isinstance(normalizer, StepNorm):
        if cfg.aggregation != "token-mean":
            raise ValueError(f"aggregation {cfg.aggregation!r} needs the step's row count: "
                             "give a StepNorm(tokens, rows) as normalizer")
        normalizer = StepNorm(float(normalizer), float("nan"))
    out = objective.loss(logp, logp_prev, advantages, mask, normalizer, cfg, logp_reference,
                         logp_gen, entropy)
    if logp_gen is not None:
        out.metrics.update(generation_metrics(logp_gen, logp_prev, mask))
    return out


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
