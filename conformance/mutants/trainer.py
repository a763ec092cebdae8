"""Trainer mutants: the reference trainer with one field-seen defect each, on the data plane.

Each field defect lives in the data-plane path; the in-memory (legacy) trainer of such a mutant
is the reference one, as in the field, where the legacy path was the yardstick that exposed them.
The numerics defects at the end live in the algorithm both paths share (`GRPOCore`), so both
paths carry them and only an expected value from outside the trainer shows them.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rlconform.conformance.backends.reference_trainer_rollout import loss_options
from rlconform.conformance.mutants import mutant
from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.loss import Objective, StepNorm, k3
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.registry import Kind, Stage, spec
from rlconform.reference_impl.trainer import (
    DataPlaneTrainer,
    GRPOCore,
    LegacyTrainer,
    micro_batch_rows,
)


def _backend(dataplane_cls: type):
    from rlconform.conformance.backends.reference import build

    def make_trainer(settings, transport=None, codec=None, model=None):
        if transport is None:
            return LegacyTrainer(settings, model)
        if codec is None:
            from rlconform.reference_impl.codec import ReferenceCodec

            codec = ReferenceCodec()
        return dataplane_cls(settings, transport, codec, model)

    make_trainer.loss_options = loss_options  # the reference's: every point of the family
    return build(trainer=make_trainer)


def _shared_backend(core_cls: type, axis=None):
    """A defect in the algorithm both paths share: the legacy trainer carries it too. `axis`
    (LossConfig -> bool): the configuration axis the defect lives in; the mutant then declares
    only the grid points on that axis (the others cannot show it: tests/test_grpo_configs.py),
    so a kill matrix runs its axis's cases and not the whole grid."""

    class _Legacy(LegacyTrainer):
        pass

    class _DataPlane(DataPlaneTrainer):
        pass

    _Legacy.core_cls = _DataPlane.core_cls = core_cls

    def make_trainer(settings, transport=None, codec=None, model=None):
        if transport is None:
            return _Legacy(settings, model)
        if codec is None:
            from rlconform.reference_impl.codec import ReferenceCodec

            codec = ReferenceCodec()
        return _DataPlane(settings, transport, codec, model)

    from rlconform.conformance.backends.reference import build

    make_trainer.loss_options = loss_options if axis is None else _on_axis(axis)
    return build(trainer=make_trainer)


def _on_axis(axis):
    def options(config):
        if not axis(config):
            raise NotImplementedError("this mutant's defect lives on another configuration "
                                      "axis: the point cannot show it")
        return loss_options(config)

    return options


# -- forced on-policy ratio ---------------------------------------------------------------
class _DetachCore(GRPOCore):
    def old_logprobs(self, mb, logp):
        return logp.detach()  # the defect: ratio == 1 by construction


class _ForcedRatio(DataPlaneTrainer):
    core_cls = _DetachCore

    def compute_logprobs(self, meta, stage):
        if stage is Stage.LOGPROB:
            return meta  # "one inner step is on-policy": the recompute is skipped
        return super().compute_logprobs(meta, stage)


class _ForcedRatioAfterRecompute(DataPlaneTrainer):
    core_cls = _DetachCore


@mutant("forced_ratio", "on-policy shortcut: prev logprobs never recomputed, the train pass "
        "sets old_logp = logp.detach(), so probs_ratio == 1 by construction", "trainer")
def forced_ratio():
    return _backend(_ForcedRatio)


@mutant("forced_ratio_after_recompute", "the prev-logprob pass runs and writes its column, but "
        "the train pass ignores it and sets old_logp = logp.detach()", "trainer")
def forced_ratio_after_recompute():
    return _backend(_ForcedRatioAfterRecompute)


# -- static fetch lists -------------------------------------------------------------------
def _blind(stage: Stage, drop):
    class _Blind(DataPlaneTrainer):
        def stage_fields(self, meta, s):
            fields = super().stage_fields(meta, s)
            return [f for f in fields if not drop(f)] if s is stage else fields

    return _Blind


def _multimodal(name: str) -> bool:
    return spec(name).multimodal


def _per_token_map(name: str) -> bool:
    return spec(name).multimodal and spec(name).kind is Kind.PER_TOKEN


@mutant("image_blind_train_fetch", "the train fetch used a static text-only field list while "
        "the logprob fetch had images (probs_ratio_max 216-2661, min 0.0, mean ~0.998)",
        "trainer")
def image_blind_train_fetch():
    return _backend(_blind(Stage.TRAIN, _multimodal))


@mutant("image_blind_logprob_fetch", "the prev-logprob fetch used a static text-only field "
        "list: prev_logprobs image-blind while generation and training saw the images",
        "trainer")
def image_blind_logprob_fetch():
    return _backend(_blind(Stage.LOGPROB, _multimodal))


@mutant("per_token_map_missing_in_train", "the train fetch dropped the per-token multimodal "
        "map (mm_token_type_ids / token_type_ids): Qwen-VL raises, Gemma3 loses image "
        "attention", "trainer")
def per_token_map_missing_in_train():
    return _backend(_blind(Stage.TRAIN, _per_token_map))


# -- reference policy ---------------------------------------------------------------------
class _StaleReferenceCore(GRPOCore):
    def train(self, shards):
        out = super().train(shards)
        self.reference_model.load_state_dict(self.model.state_dict())  # the defect
        return out


class _StaleReference(DataPlaneTrainer):
    core_cls = _StaleReferenceCore


@mutant("stale_reference_weights", "the reference policy was re-synced from the policy after "
        "each step instead of staying frozen at the initial weights: the KL anchor drifts",
        "trainer")
def stale_reference_weights():
    return _backend(_StaleReference)


# -- engine refit -------------------------------------------------------------------------
class _RefitAtStep1(DataPlaneTrainer):
    def state_dict(self):
        if self.core.steps == 1:  # the defect: step 1's refit pushes the initial checkpoint
            return {k: v.detach().to("cpu", copy=True)
                    for k, v in self.core.reference_model.state_dict().items()}
        return super().state_dict()


@mutant("refit_engine_at_step1", "the data-plane trainer refit the generation engine at step 1 "
        "from its initial checkpoint although the engine was in sync: token_mult_prob_error "
        "~40 at step 1, settling later", "trainer")
def refit_engine_at_step1():
    return _backend(_RefitAtStep1)


# -- truncation and dynamic micro-batching ------------------------------------------------
class _NarrowCore(GRPOCore):
    def prepare(self, batch: Batch) -> Batch:
        n = self.settings.max_seq_len
        out = super().prepare(batch)
        if n is None or batch.seq_len() <= n:
            return out
        fields = {}
        for name, v in out.fields.items():  # the defect: every >= 2-D tensor cut on dim 1
            if isinstance(v, PackedTensor):
                v = PackedTensor([s.narrow(1, 0, n) if s.dim() >= 2 else s for s in v.segments],
                                 v.rows, v.pack_dim)
            fields[name] = v
        return Batch(fields, out.family, dict(out.extra))


class _NarrowTruncation(DataPlaneTrainer):
    core_cls = _NarrowCore


@mutant("truncation_narrows_media", "truncate_tensors narrowed every >= 2-D tensor on dim 1: "
        "pixel_values silently cut, or narrow(): length > size", "trainer")
def truncation_narrows_media():
    return _backend(_NarrowTruncation)


class _SortedCore(GRPOCore):
    def select_micro_batch(self, batch: Batch, rows):
        if self.settings.max_tokens_per_micro_batch is None:
            return super().select_micro_batch(batch, rows)
        lens = batch.seq_lens.tolist()
        order = sorted(rows, key=lambda i: -lens[i])  # pack longest first ...
        sel = batch.select(order)
        packed = batch.select(rows)  # ... but the media keep the unsorted order (the defect)
        return sel.replace(**{n: v for n, v in packed.fields.items()
                              if isinstance(v, PackedTensor)})


class _SortedMicroBatches(DataPlaneTrainer):
    core_cls = _SortedCore


@mutant("dynamic_batching_misaligns_media", "dynamic micro-batching sorted rows by length and "
        "permuted the tensors but not the jagged media: images land on the wrong samples",
        "trainer")
def dynamic_batching_misaligns_media():
    return _backend(_SortedMicroBatches)


# -- loss aggregation and gradient numerics: defects in the algorithm both paths share, so
# TRAIN-LEGACY-PARITY cannot see them; only an expected value from elsewhere shows them ----
class _MicroBatchMeanCore(GRPOCore):
    def loss_normalizer(self, shards):
        self._n_micro = sum(len(micro_batch_rows(b.seq_lens.tolist(), self.settings))
                            for b in shards)
        return super().loss_normalizer(shards)

    def micro_batch_loss(self, mb, logp, normalizer, entropy=None):
        # the defect: each micro-batch's mean over its own tokens, averaged over micro-batches
        own = max(1.0, float(mb["token_mask"].sum()))
        return super().micro_batch_loss(mb, logp, own * self._n_micro, entropy)


@mutant("loss_mean_per_micro_batch", "gradient accumulation normalised each micro-batch's loss "
        "by its own token count and averaged over micro-batches (the transformers gradient-"
        "accumulation bug, fixed in 4.46): right only when every micro-batch holds the same "
        "number of loss tokens", "trainer")
def loss_mean_per_micro_batch():
    return _shared_backend(_MicroBatchMeanCore)


class _SequenceMeanCore(GRPOCore):
    def loss_normalizer(self, shards):
        super().loss_normalizer(shards)
        return float(sum(b.batch_size for b in shards))  # the defect: rows, not tokens

    def micro_batch_loss(self, mb, logp, normalizer, entropy=None):
        # each row's mean over its own tokens (a row with none counts as one), then the mean
        # over the step's rows: the weighted mask leaves the per-token metrics as they are
        mask = mb["token_mask"].to(logp.dtype)
        weighted = mask / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        return super().micro_batch_loss(mb.replace(token_mask=weighted), logp, normalizer,
                                        entropy)


@mutant("sequence_mean_loss", "the loss was aggregated as a sequence-mean (mean over each "
        "row's tokens, then over rows) instead of the token-mean over the step: short "
        "completions weigh as much as long ones; invariant to every split", "trainer")
def sequence_mean_loss():
    return _shared_backend(_SequenceMeanCore)


class _DPDivisorCore(GRPOCore):
    def train(self, shards):
        world = len(shards)  # the defect: ranks average gradients of a loss already divided
        hooks = [p.register_hook(lambda g: g / world)  # by the step's (global) token count
                 for p in self.model.parameters() if p.requires_grad]
        try:
            return super().train(shards)
        finally:
            for h in hooks:
                h.remove()


@mutant("dp_grad_wrong_divisor", "data-parallel ranks averaged their gradients (divided by the "
        "world size) although each rank's loss was already normalised by the global token "
        "count: gradients 1/world too small (Adam hides most of it, clipping and SGD do not)",
        "trainer")
def dp_grad_wrong_divisor():
    return _shared_backend(_DPDivisorCore)


class _ClipUpperObjective(Objective):
    def clipped(self, ratio, cfg):
        return ratio.clamp(max=1.0 + cfg.clip_high)  # the defect: the lower bound dropped


class _ClipUpperCore(GRPOCore):
    objective = _ClipUpperObjective()


@mutant("clip_upper_only", "the ratio was clipped as min(ratio, 1 + eps) only: for negative "
        "advantages a ratio below 1 - eps keeps its gradient; invisible while the ratio is 1",
        "trainer")
def clip_upper_only():
    return _shared_backend(_ClipUpperCore)


class _WrongAxisCore(GRPOCore):
    def micro_batch_loss(self, mb, logp, normalizer, entropy=None):
        b, s = logp.shape  # the defect: [B] expanded on a new leading axis, then reshaped
        adv = mb["advantages"].to(logp.device).expand(s, b).reshape(b, s)
        return super().micro_batch_loss(mb.replace(advantages=adv), logp, normalizer, entropy)


@mutant("advantage_wrong_axis", "per-sample advantages broadcast to per-token on the wrong "
        "axis (expand(S, B).reshape(B, S)): tokens get other samples' advantages; right only "
        "for a micro-batch of one row", "trainer")
def advantage_wrong_axis():
    return _shared_backend(_WrongAxisCore)


class _DetachedNormalizerCore(GRPOCore):
    def token_logprobs(self, model, mb, stage):
        inputs = self.model_inputs(mb, stage)
        logits = model(**inputs, use_cache=False).logits[:, :-1].float()
        ids = inputs["input_ids"]
        # the defect (a memory-saving rewrite shared by every pass): the log-normaliser is
        # detached, so the values are right and the gradient misses the -softmax term
        logp = logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - \
            torch.logsumexp(logits, dim=-1).detach()
        logp = torch.nn.functional.pad(logp, (1, 0))
        return logp * inputs["attention_mask"].to(logp.dtype)


@mutant("logprob_detached_normalizer", "the token-logprob gather shared by every pass computed "
        "logits[y] - logsumexp(logits).detach(): logprobs (and probs_ratio == 1) are right, the "
        "gradient w.r.t. the logits lacks the -softmax term", "trainer")
def logprob_detached_normalizer():
    return _shared_backend(_DetachedNormalizerCore)


# -- the GRPO configuration axes: each defect lives in one option of the objective family
# (reference_impl.loss.LossConfig), so the default point cannot see it and only the grid points
# of that axis can (tests/test_grpo_configs.py checks that no other point does) ------------
def _objective_backend(objective_cls: type, axis):
    """The reference whose objective has one part replaced (both trainer paths share it)."""

    class _Core(GRPOCore):
        objective = objective_cls()

    return _shared_backend(_Core, axis)


def _aggregation(config) -> bool:
    return config.aggregation != "token-mean"


class _SwappedBounds(Objective):
    def clipped(self, ratio, cfg):
        return ratio.clamp(1.0 - cfg.clip_high, 1.0 + cfg.clip_low)  # the defect


@mutant("clip_bounds_swapped", "asymmetric clipping with the two epsilons swapped: the ratio "
        "clipped to [1 - clip_high, 1 + clip_low], so clip-higher lowers the upper bound "
        "instead of raising it; identical at a symmetric clip", "trainer")
def clip_bounds_swapped():
    return _objective_backend(_SwappedBounds, lambda c: c.clip_low != c.clip_high)


class _DualClipBothSigns(Objective):
    def surrogate(self, ratio, adv, cfg):
        loss = -torch.minimum(ratio * adv, self.clipped(ratio, cfg) * adv)
        if cfg.dual_clip is not None:  # the defect: no `advantage < 0` condition
            loss = torch.minimum(loss, -cfg.dual_clip * adv)
        return loss


@mutant("dual_clip_on_positive_advantages", "the dual-clip bound min(loss, -c A) applied to "
        "every token, not only to negative advantages: each positive-advantage token's loss "
        "becomes -c A, a constant without gradient", "trainer")
def dual_clip_on_positive_advantages():
    return _objective_backend(_DualClipBothSigns, lambda c: c.dual_clip is not None)


class _SequenceProduct(Objective):
    def ratio(self, logp, prev, mask, cfg):
        if cfg.ratio_level == "token":
            return super().ratio(logp, prev, mask, cfg)
        # the defect: the product of the token ratios, not their geometric mean
        return torch.exp(((logp - prev) * mask).sum(dim=1, keepdim=True)).expand_as(logp)


@mutant("sequence_ratio_product", "the GSPO sequence ratio taken as the product of the row's "
        "token ratios (exp of the summed log-ratio) instead of their geometric mean: long rows "
        "clip at once", "trainer")
def sequence_ratio_product():
    return _objective_backend(_SequenceProduct, lambda c: c.ratio_level == "sequence")


class _AlwaysK3(Objective):
    def kl(self, logp, ref, cfg):
        return super().kl(logp, ref, dataclasses.replace(cfg, kl_estimator="k3"))  # the defect


@mutant("kl_estimator_ignored", "the configured KL estimator ignored: k3 whatever k1 or k2 was "
        "asked for (one KL function shared by every configuration)", "trainer")
def kl_estimator_ignored():
    return _objective_backend(_AlwaysK3, lambda c: c.kl_coef > 0)


class _ReversedK3(Objective):
    def kl(self, logp, ref, cfg):
        if cfg.kl_estimator != "k3":
            return super().kl(logp, ref, cfg)
        return k3(logp - ref)  # the defect: x = log(pi / pi_ref) instead of log(pi_ref / pi)


@mutant("kl_k3_reversed", "the k3 estimator with its log-ratio reversed (e^d - 1 - d with d = "
        "logp - ref): it estimates KL(ref || policy) from the policy's samples, biased, and "
        "pushes the other way", "trainer")
def kl_k3_reversed():
    return _objective_backend(_ReversedK3, lambda c: c.kl_coef > 0)


class _DetachedKLWeight(Objective):
    def kl_term(self, kl, ratio, cfg):
        return kl * ratio.detach() if cfg.kl_ratio_weighted else kl  # the defect


@mutant("kl_ratio_weight_detached", "the ratio weighting the KL term (DeepSeek-V3.2's unbiased "
        "estimator, TRL use_bias_correction_kl) detached: the value is right, the gradient "
        "misses the estimate times the ratio's own gradient", "trainer")
def kl_ratio_weight_detached():
    return _objective_backend(_DetachedKLWeight, lambda c: c.kl_coef > 0)


class _NonEmptyRowsCore(GRPOCore):
    def row_normalizer(self, shards):
        if self.settings.loss.aggregation == "token-mean":
            return super().row_normalizer(shards)
        from rlconform.reference_impl.ranks import dp_sum

        # the defect: only rows with loss tokens count
        return max(1.0, float(dp_sum(sum(int((b["token_mask"].sum(dim=1) > 0).sum())
                                         for b in shards))))


@mutant("seq_mean_excludes_empty_rows", "the sequence-mean and constant aggregations divided by "
        "the rows that have loss tokens, not by every row of the step (verl 0.9.1 agg_loss's "
        "convention, not the declared point's): every other row weighs B / (B - empty) too "
        "much", "trainer")
def seq_mean_excludes_empty_rows():
    return _shared_backend(_NonEmptyRowsCore, _aggregation)


class _PaddedWidth(Objective):
    def weights(self, mask, norm, cfg):
        if cfg.aggregation != "constant":
            return super().weights(mask, norm, cfg)
        # the defect: the micro-batch's padded width instead of the configured constant
        return mask.new_full((mask.shape[0], 1), 1.0 / (norm.rows * mask.shape[1]))


@mutant("constant_normalizer_from_padded_width", "Dr. GRPO's constant normaliser taken as the "
        "micro-batch's padded length (verl's seq-mean-token-sum-norm default, "
        "loss_mask.shape[-1]) instead of the configured constant: the weight of a token "
        "depends on its neighbours' lengths and on the split", "trainer")
def constant_normalizer_from_padded_width():
    return _objective_backend(_PaddedWidth, _aggregation)


class _MicroBatchRowsCore(GRPOCore):
    def optimizer_step(self, shards):
        self._n_micro = sum(len(micro_batch_rows(b.seq_lens.tolist(), self.settings))
                            for b in shards)
        return super().optimizer_step(shards)

    def micro_batch_loss(self, mb, logp, normalizer, entropy=None):
        if isinstance(normalizer, StepNorm) and self.settings.loss.aggregation != "token-mean":
            # the defect: each micro-batch's own rows, averaged over the micro-batches
            normalizer = StepNorm(normalizer.tokens, float(mb.batch_size * self._n_micro))
        return super().micro_batch_loss(mb, logp, normalizer, entropy)


@mutant("seq_mean_per_micro_batch", "the sequence-mean aggregations averaged within each "
        "micro-batch and then over micro-batches: right only when every micro-batch (and "
        "rank) holds as many rows", "trainer")
def seq_mean_per_micro_batch():
    return _shared_backend(_MicroBatchRowsCore, _aggregation)


class _CapOnRatio(Objective):
    def ratio(self, logp, prev, mask, cfg):
        r = super().ratio(logp, prev, mask, cfg)
        return r if cfg.is_cap is None else r.clamp(max=cfg.is_cap)  # the defect: cap here ...

    def is_weight(self, prev, gen, cfg):
        return torch.exp(prev - gen).detach()  # ... and the importance weight left uncapped


@mutant("is_cap_on_policy_ratio", "the truncated importance-sampling cap applied to the "
        "policy's ratio exp(logp - prev) instead of the engine-mismatch weight exp(prev - gen), "
        "which then weighs its token uncapped", "trainer")
def is_cap_on_policy_ratio():
    return _objective_backend(_CapOnRatio, lambda c: c.is_cap is not None)


class _EntropyEverywhere(Objective):
    def entropy_sum(self, entropy, mask):
        return entropy.sum()  # the defect: every attended position, the prompt's too


@mutant("entropy_unmasked", "the entropy bonus summed over every attended position (prompt "
        "included) instead of the loss tokens", "trainer")
def entropy_unmasked():
    return _objective_backend(_EntropyEverywhere, lambda c: c.entropy_coef > 0)


class _KLEverywhere(Objective):
    def loss(self, logp, prev, advantages, mask, norm, cfg, ref=None, gen=None, entropy=None):
        out = super().loss(logp, prev, advantages, mask, norm, cfg, ref, gen, entropy)
        if ref is None or not cfg.kl_coef:
            return out
        mask_f = mask.to(logp.dtype)
        # the defect: the KL penalty taken under the attention (every position up to the last
        # loss token, the prompt's too) rather than the loss mask
        attended = mask_f.flip(1).cummax(1).values.flip(1)
        extra = cfg.kl_coef * self.kl(logp, ref, cfg) * (attended - mask_f)
        return dataclasses.replace(
            out, loss=out.loss + (extra * self.weights(mask_f, norm, cfg)).sum())


@mutant("kl_unmasked", "the KL penalty taken over every attended position (prompt included) "
        "instead of the loss tokens", "trainer")
def kl_unmasked():
    return _objective_backend(_KLEverywhere, lambda c: c.kl_coef > 0)


class _NoClipCore(GRPOCore):
    def clip_gradients(self):
        params = [p for p in self.model.parameters() if p.grad is not None]
        # the defect: the norm is computed and reported, the gradient is never scaled
        return torch.nn.utils.clip_grad_norm_(params, math.inf) if params else torch.zeros(())


@mutant("grad_clip_not_applied", "gradient-norm clipping computed and logged but not applied: "
        "the optimizer steps on the unclipped gradient", "trainer")
def grad_clip_not_applied():
    return _shared_backend(_NoClipCore, lambda c: c.max_grad_norm is not None)


class _ClipPerMicroBatchCore(GRPOCore):
    def micro_batch_loss(self, *args, **kwargs):
        # the defect: clipping inside the accumulation loop, the gradient gathered so far
        # scaled before each micro-batch adds its own, instead of once per optimizer step
        self.clip_gradients()
        return super().micro_batch_loss(*args, **kwargs)


@mutant("grad_clip_per_micro_batch", "gradient-norm clipping applied inside the accumulation "
        "loop (to the gradient gathered so far, before each micro-batch) instead of once to the "
        "optimizer step's whole gradient", "trainer")
def grad_clip_per_micro_batch():
    return _shared_backend(_ClipPerMicroBatchCore, lambda c: c.max_grad_norm is not None)


class _RefreshedOldCore(GRPOCore):
    def old_logprobs(self, mb, logp):
        if self.batch_step == 0:
            return super().old_logprobs(mb, logp)
        return logp.detach()  # the defect: the prev pass re-run before each later step


@mutant("old_logprobs_refreshed_per_step", "the old logprobs recomputed from the current policy "
        "before every optimizer step of a batch (epochs, mini-batches): each step is on-policy, "
        "the ratio stays 1 and the clip never acts", "trainer")
def old_logprobs_refreshed_per_step():
    return _shared_backend(_RefreshedOldCore, lambda c: c.optimizer_steps > 1)


class _WholeBatchNormCore(GRPOCore):
    def train(self, shards):
        self._batch_tokens = sum(int(b["token_mask"].sum()) for b in shards)
        return super().train(shards)

    def loss_normalizer(self, shards):
        n = super().loss_normalizer(shards)
        # the defect: each mini-batch's loss divided by the whole generation batch's tokens
        return max(1.0, float(self._batch_tokens)) if self.settings.loss.mini_batches > 1 else n


@mutant("mini_batch_normalized_by_whole_batch", "each mini-batch's token-mean divided by the "
        "token count of the whole generation batch instead of its own: every optimizer step's "
        "loss and gradient shrunk by its share of the tokens", "trainer")
def mini_batch_normalized_by_whole_batch():
    return _shared_backend(_WholeBatchNormCore, lambda c: c.optimizer_steps > 1)
