"""The batch a driver hands a trainer: the rollout's output, plus each row's prompt as the
dataset held it where the trainer reads it.

A trainer factory that renders and processes prompts itself declares `reads_prompts = True`
(backend.py, the trainer surface); its batches then carry the `raw_prompt` column
(reference_impl/prompts.py) beside the rollout's fields, as a driver keeps what it sampled from
the dataset next to what the engine generated. Other trainers get the rollout's output alone.
"""

from __future__ import annotations

from rlconform.reference_impl.prompts import with_prompts


def reads_prompts(make_trainer) -> bool:
    return bool(getattr(make_trainer, "reads_prompts", False))


def for_trainer(make_trainer, batch, prompts, images):
    """`batch` as the driver hands it to trainers of `make_trainer` (rows: `prompts[i]` and
    `images[i]`)."""
    return with_prompts(batch, prompts, images) if reads_prompts(make_trainer) else batch
