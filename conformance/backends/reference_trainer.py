"""Factories of the reference `trainer` and `rollout` surfaces.

The trainer surface contract: `trainer(settings, transport=None, codec=None)` returns the
data-plane trainer when a transport is given (every pass from a meta, through that transport
and codec) and the in-memory (legacy) trainer otherwise; both expose `model` (the policy
`nn.Module`, so the suite can watch its inputs), `compute_logprobs`, `train` and `state_dict`.
The rollout surface: `rollout(family, settings)` with `generate(prompts, images,
max_new_tokens, seed) -> Batch` (`max_new_tokens` an int or one cap per prompt, 0 allowed) and
`refit(state_dict)`. The numerics clauses (test_trainer_numerics.py) also watch the trainer's
`model` with hooks: the logits of its train forwards and the gradients accumulated into its
parameters before the optimizer step.
"""

from __future__ import annotations


def make_trainer(settings, transport=None, codec=None, model=None):
    from rlconform.reference_impl.trainer import DataPlaneTrainer, LegacyTrainer

    if transport is None:
        return LegacyTrainer(settings, model)
    if codec is None:
        from rlconform.reference_impl.codec import ReferenceCodec

        codec = ReferenceCodec()
    return DataPlaneTrainer(settings, transport, codec, model)


def make_rollout(family, settings, model=None):
    from rlconform.reference_impl.rollout import HFRollout

    return HFRollout(family, settings, model)
