"""Factories of the reference `trainer` and `rollout` surfaces.

The trainer surface contract: `trainer(settings, transport=None, codec=None)` returns the
data-plane trainer when a transport is given (every pass from a meta, through that transport
and codec) and the in-memory (legacy) trainer otherwise; both expose `model` (the policy
`nn.Module`, so the suite can watch its inputs), `compute_logprobs`, `train` and `state_dict`.
With `ranks=RankLaunch(...)` (and a transport of capability `multiprocess`) it returns the
driver's `RankGroup` instead: the passes then run in rank processes (the rank contract is
reference_impl/ranks.py's docstring).
The rollout surface: `rollout(family, settings)` with `generate(prompts, images,
max_new_tokens, seed) -> Batch` (`max_new_tokens` an int or one cap per prompt, 0 allowed) and
`refit(state_dict)`. The numerics clauses (test_trainer_numerics.py) also watch the trainer's
`model` with hooks: the logits of its train forwards, the gradients accumulated into its
parameters and, through torch's global optimizer step hooks, the gradient and weights of every
optimizer step.

The point of the GRPO objective family a trainer runs is `settings.loss`
(reference_impl.loss.LossConfig). A trainer factory declares the points it implements with an
attribute `loss_options(config) -> dict`: the backend's own options for that point (what a
user of the framework would set), or `NotImplementedError` saying why the framework has none.
A factory without it declares the default point only. The numerics clauses run every grid
point a backend declares and report the others as not applicable, naming the reason. The
reference implements every point. Likewise `settings_unsupported: dict[str, str]` names the
TrainerSettings fields the framework has no counterpart for (field -> why): the clauses that
need one are not applicable there (TRAIN-TRUNCATION-MEDIA), or leave out the cuts that need it
and judge the others (TRAIN-SPLIT-INVARIANCE's token-budget splits).
"""

from __future__ import annotations


def trainer_factory(dataplane_cls: type | None = None, group_cls: type | None = None):
    """The trainer surface over these classes (default: the reference's DataPlaneTrainer and
    RankGroup); a mutant swaps one of them."""

    def make_trainer(settings, transport=None, codec=None, model=None, ranks=None):
        from rlconform.reference_impl.trainer import DataPlaneTrainer, LegacyTrainer

        if ranks is not None:  # data-parallel ranks as processes: reference_impl/ranks.py
            from rlconform.reference_impl.ranks import RankGroup

            if transport is None:
                raise TypeError("ranks= needs a transport: every rank opens it by its address")
            return (group_cls or RankGroup)(ranks, settings, transport, codec)
        if transport is None:
            return LegacyTrainer(settings, model)
        if codec is None:
            from rlconform.reference_impl.codec import ReferenceCodec

            codec = ReferenceCodec()
        return (dataplane_cls or DataPlaneTrainer)(settings, transport, codec, model)

    make_trainer.loss_options = loss_options
    return make_trainer


def loss_options(config) -> dict:
    """The reference implements every point of the family: its options are the LossConfig."""
    return {"loss": config.changes()}


make_trainer = trainer_factory()


def make_rollout(family, settings, model=None):
    from rlconform.reference_impl.rollout import HFRollout

    return HFRollout(family, settings, model)
