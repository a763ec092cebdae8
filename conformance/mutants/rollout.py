"""Rollout mutants: the reference HF rollout with one field-seen defect each."""

from __future__ import annotations

import zlib

import torch

from rlconform.conformance.mutants import mutant
from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.rollout import HFRollout


def _backend(rollout_cls: type):
    from rlconform.conformance.backends.reference import build

    def make_rollout(family, settings, model=None):
        return rollout_cls(family, settings, model)

    return build(rollout=make_rollout)


class _DropsPacked(HFRollout):
    def assemble(self, rows):
        batch = super().assemble(rows)
        kept = {k: v for k, v in batch.fields.items() if isinstance(v, torch.Tensor)}
        return Batch(kept, batch.family, dict(batch.extra))  # the defect: jagged media lost


@mutant("dropped_packed_on_rollout_write", "the rollout write kept only torch.Tensor values, "
        "silently dropping jagged packed fields: prev_logprobs image-blind, "
        "token_mult_prob_error ~176, probs_ratio still 1", "rollout")
def dropped_packed_on_rollout_write():
    return _backend(_DropsPacked)


class _ProcessedLogprobs(HFRollout):
    def token_logprobs(self, logits, tokens):
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
        keep[self.allowed] = True
        processed = logits.masked_fill(~keep, float("-inf"))  # the defect: renormalised
        return torch.log_softmax(processed, dim=-1).gather(-1, tokens[:, None])[:, 0]


@mutant("perturbed_generation_logprobs", "generation logprobs taken from the processed "
        "(restricted, renormalised) sampling distribution instead of the model's: every "
        "generation logprob is biased upwards", "rollout")
def perturbed_generation_logprobs():
    return _backend(_ProcessedLogprobs)


class _Unrestricted(HFRollout):
    def logits_processors(self):
        from transformers import LogitsProcessorList

        return LogitsProcessorList()  # the defect: special tokens may be sampled


@mutant("unrestricted_sampling", "sampling not restricted to ordinary tokens: a random policy "
        "samples image placeholders and control tokens, and the recompute breaks", "rollout")
def unrestricted_sampling():
    return _backend(_Unrestricted)


class _ContentSeeded(HFRollout):
    def sample(self, feats, max_new_tokens, seed):
        # the defect: the sampler's seed is the request's content, not its row
        key = zlib.crc32(b"".join(v.cpu().numpy().tobytes() for _, v in sorted(feats.items())))
        return super().sample(feats, max_new_tokens, key)


@mutant("group_members_share_one_sample", "each request's sampler seeded from a hash of its "
        "content (a cache key) instead of its row: the identical requests of a group get one "
        "completion, and the group's advantages are zero", "rollout")
def group_members_share_one_sample():
    return _backend(_ContentSeeded)


class _RefitNotApplied(HFRollout):
    def refit(self, state_dict):
        pass  # the defect: the engine keeps sampling with the weights it started with


@mutant("refit_not_applied", "the engine's refit never reached the weights it samples with "
        "(loaded into a copy, or KV of the old weights kept): every step after the first "
        "samples from the initial policy", "rollout")
def refit_not_applied():
    return _backend(_RefitNotApplied)
