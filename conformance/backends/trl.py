"""TRL 1.16.0's `GRPOTrainer` as an rlconform trainer backend (two configurations).

The adapter feeds TRL what a TRL caller with an external engine holds and lets TRL do every step
from the engine's output to the optimizer step (DATA_PATH lists them, function by function):

| rlconform need | TRL 1.16.0 |
|---|---|
| the generation batch | `GRPOTrainer._generate_and_score_completions` on the batch's rows as TRL's dataset rows (the prompt, its images, the driver's advantage), with a `rollout_func` returning the engine's output for them: prompt ids, completion ids, the engine's per-token logprobs and `env_mask` (the loss mask over the completion). TRL pads prompts (left) and completions (right), builds its masks, `num_images`, `num_items_in_batch`, its advantages and its old / reference logprob passes, under its own conditions |
| media | the trainer surface carries each row's processor outputs, not its prompt messages and images: the dataset rows hold one `StoredImage` per image, and the family's processor, subclassed, answers TRL's processor call on them with those outputs (`_stored_media_processor`: media as the batch's model-input tensors, per-token type maps over each prompt, left padded). TRL's own prompt handling (`prepare_multimodal_messages`, `apply_chat_template`), image counting, type-map extension and pixel splitting run on them |
| advantages | TRL derives advantages from rewards inside `_generate_and_score_completions`; the surface hands the driver's advantages, so the reward function returns each row's (a dataset column) and TRL runs with `scale_rewards='none'` and the generation batch as one group of `num_generations`: TRL's advantage is the given one minus the batch's mean (equal where the driver's groups are centred, as group normalisation leaves them) |
| prev / reference logprobs | the logprob passes run `_generate_and_score_completions` on the shard and keep its `old_per_token_logps` / `ref_per_token_logps` (completion tokens only; 0 on prompt tokens), or none where TRL computes none (one iteration: no old logprobs; `beta == 0`: no reference) |
| the train step | `Trainer.train` (transformers' loop: `accelerator.prepare`, the accumulation window of `GRPOTrainer.training_step` -> `_prepare_inputs` -> `_generate_and_score_completions` / TRL's micro-batch split -> `_compute_loss`, then clipping, the optimizer step and the scheduler) over a loader yielding the step's generation batch as TRL's RepeatSampler repeats one (num_iterations x steps_per_generation). TRL recomputes its old logprobs in the step itself: a stored prev_logprobs column is not read |
| per-token probs_ratio, clamped ratio, KL, entropy, loss per token | TRL logs batch means only: `_LossLocals` reads `_compute_loss`'s own tensors at its return (`coef_1` before the `delta` clamp, `coef_2`, `per_token_kl` before ratio weighting, `entropies`, `per_token_loss`); loss and grad norm are those Trainer logs for each optimizer step |

Where rlconform's rows and TRL's contract differ, the adapter's changes are stated per clause
(`NORMALISATIONS`): an empty completion (TRL's `_generate` indexes its last token), and the
data-parallel ranks of a step, emulated in one process (each shard its rank's generation batch,
the backward scaled by 1/world, one optimizer step, TRL's generation gathers answering every
rank's values).

Configuration: `settings` map onto `GRPOConfig` (`micro_batch_size` ->
per_device_train_batch_size, `lr`, `seed`, `settings.loss` through `trl_options`; `dtype`
bfloat16 -> `bf16=True`, float32 -> `bf16=False`, since TRL's default `bf16=True` autocasts an
fp32 model to bf16); one `train` is every optimizer step of a generation batch (the point's
epochs = `num_iterations`) of `per_device_train_batch_size x steps_per_generation` rows
(`gradient_accumulation_steps = steps_per_generation`). TRL needs the generation batch to be a
multiple of the micro-batch size; where it is not, the micro-batch size is the largest divisor
of the batch's rows that is <= `micro_batch_size`. TRL's `shuffle_sequence_dict` draws from the
global RNG; the adapter seeds each train call from `seed` and the step inside a forked RNG, so
both trainer paths shuffle alike. Settings TRL has no counterpart for (`max_seq_len`,
`max_tokens_per_micro_batch`) are declared as such (`SETTINGS_UNSUPPORTED`, the trainer
factory's `settings_unsupported`) and raise ValueError naming the field if given anyway.

The policy is built from the family's config, saved with its processor, and reloaded from that
folder, because with `beta > 0` TRL reloads the reference model from `config._name_or_path`.

No rollout surface: TRL's own generation (`GRPOTrainer._generate`, transformers `generate`)
returns no per-token logprobs; only its vLLM path does, and vLLM is a separate backend. No
batch_ops surface (see `_NOTES`); `TRLBatchOps` runs TRL's micro-batch helpers on a Batch for
tests/test_backends_trl.py.
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from rlconform.conformance.backend import Backend, PathStep, package_version

_GRPO = "trl.trainer.grpo_trainer.GRPOTrainer"
_GRPO_MODULE = "trl.trainer.grpo_trainer"  # helpers by the name GRPOTrainer calls them under
# TRL's path from the engine's output to the optimizer step, as this adapter takes it
# (docs/backends.md renders it; tests/test_backends_trl.py patches every entered function and
# requires a call while the adapter's surfaces run)
DATA_PATH = (
    PathStep(f"{_GRPO}.get_train_dataloader", "stubbed",
             "TRL's loader draws prompts from a dataset (RepeatSampler, each repeated "
             "num_generations times) before generation; here the driver sampled, generated and "
             "grouped them: the stand-in yields the step's rows as one generation batch, "
             "repeated num_iterations x steps_per_generation times as RepeatSampler repeats "
             "one", "trainer"),
    PathStep("transformers.Trainer.train", "entered", surface="trainer"),
    PathStep("transformers.Trainer._inner_training_loop", "entered", surface="trainer"),
    PathStep("accelerate.Accelerator.prepare", "entered", surface="trainer"),
    PathStep("transformers.Trainer._run_epoch", "entered", surface="trainer"),
    PathStep(f"{_GRPO}.training_step", "entered", surface="trainer"),
    PathStep(f"{_GRPO}._prepare_inputs", "entered", surface="trainer"),
    PathStep(f"{_GRPO}._generate_and_score_completions", "entered", surface="trainer"),
    PathStep(f"{_GRPO_MODULE}.prepare_multimodal_messages", "entered", surface="trainer"),
    PathStep(f"{_GRPO}._generate", "entered", surface="trainer"),
    PathStep(f"{_GRPO_MODULE}.pad", "entered", surface="trainer"),
    PathStep(f"{_GRPO_MODULE}.apply_chat_template", "entered", surface="trainer"),
    PathStep("transformers.ProcessorMixin.__call__", "rebuilt",
             "the trainer surface carries each row's processor outputs (pixel tensors, grids, "
             "per-token type maps), not the prompt messages and images TRL hands the "
             "processor: the family's processor, subclassed, answers the call with those "
             "outputs, batched as the processor batches them (_stored_media_processor)",
             "trainer"),
    PathStep(f"{_GRPO}._get_per_token_logps_and_entropies", "entered", surface="trainer"),
    PathStep(f"{_GRPO}._calculate_rewards", "entered", surface="trainer"),
    PathStep(f"{_GRPO_MODULE}.split_pixel_values_by_grid", "entered", surface="trainer"),
    PathStep(f"{_GRPO_MODULE}.shuffle_sequence_dict", "entered", surface="trainer"),
    PathStep(f"{_GRPO_MODULE}.split_tensor_dict", "entered", surface="trainer"),
    PathStep(f"{_GRPO}._compute_loss", "entered", surface="trainer"),
    PathStep("transformers.Trainer.create_optimizer", "entered", surface="trainer"),
    PathStep("transformers.Trainer._clip_grad_norm", "entered", surface="trainer"),
    PathStep("accelerate.Accelerator.clip_grad_norm_", "entered", surface="trainer"),
    PathStep("torch.nn.parallel.DistributedDataParallel", "rebuilt",
             "TRL's data-parallel ranks are processes `accelerate launch` starts, the policy "
             "wrapped in DDP (gloo on CPU); none is started here: each shard trains as one "
             "rank sees it, in one process (its own generation batch through "
             "_generate_and_score_completions, its own _step / _buffered_inputs, its "
             "micro-steps in the accumulation window), each rank's backward scaled by 1/world "
             "(DDP's gradient mean) and one optimizer step over the summed gradients; TRL's "
             "gathers in _generate_and_score_completions (rewards, loss-token counts) answer "
             "every rank's values, each taken by TRL's own generation of that rank's batch "
             "before the step, and num_processes is the world (_RankAccelerator)", "trainer"),
)
_EMPTY_COMPLETION = (
    "a row with an empty completion (no loss token) reaches TRL's rollout_func as one pad "
    "token outside env_mask: GRPOTrainer._generate reads ids[-1] of every completion and "
    "raises IndexError on an empty one (docs/upstream/trl-empty-completion.py); the token "
    "is past the row's end, in no loss term, and left out of the logprob columns")
_ONE_PROCESS = (
    "the step's data-parallel ranks are emulated in one process (DATA_PATH: "
    "DistributedDataParallel): each shard is its rank's generation batch, gradients are "
    "averaged over the ranks, and TRL's gathers in _generate_and_score_completions are "
    "emulated all-gathers of every rank's values (advantages centred and loss tokens counted "
    "over the step); metrics TRL gathers in _compute_loss see the rank's own")
# What the adapter changes between rlconform's rows and TRL before a clause judges the result
NORMALISATIONS = {
    **{cid: _EMPTY_COMPLETION for cid in (
        "TRAIN-RATIO-ONE", "TRAIN-FIELD-PARITY", "TRAIN-LEGACY-PARITY", "TRAIN-INPUT-INTACT",
        "TRAIN-REFERENCE-FROZEN", "TRAIN-LOSS-CLOSED-FORM", "TRAIN-GRAD-RECOMPUTE",
        "TRAIN-RATIO-LATER-STEPS", "TRAIN-ORDER-FREE", "TRAIN-SPLIT-INVARIANCE",
        "GEN-REFIT-SYNC")},
}
for _cid in ("TRAIN-LEGACY-PARITY", "TRAIN-SPLIT-INVARIANCE", "TRAIN-ORDER-FREE",
             "TRAIN-GRAD-RECOMPUTE"):
    NORMALISATIONS[_cid] += "; " + _ONE_PROCESS

TRL_VERSION = "1.16.0"
REQUIREMENTS = (f"trl=={TRL_VERSION}",)
# the KL coefficient of the independent-passes variant when the settings ask for none: the value
# GRPOConfig.beta's help cites (DeepSeek-R1); any beta != 0 makes TRL load a reference model
INDEPENDENT_BETA = 1e-3

_NOTES = {
    "rollout": "TRL's own generation path (GRPOTrainer._generate -> transformers generate) "
               "returns no per-token logprobs; only its vLLM path does, and vLLM is its own "
               "backend. The GEN-* clauses pair TRL's trainer with the reference rollout.",
    "transport": "TRL has no data plane: GRPOTrainer keeps each generation batch in process "
                 "memory (_buffered_inputs); the trainer's passes fetch through the reference "
                 "transport.",
    "codec": "TRL has no wire format: its batches are in-memory dicts of tensors.",
    "meta": "TRL has no driver-side batch metadata: one process holds the whole batch.",
    "batch_ops": "TRL's only operation on a built batch is GRPOTrainer._prepare_inputs' split "
                 "into micro-batches (split_pixel_values_by_grid, shuffle_sequence_dict, "
                 "split_tensor_dict), which the trainer surface runs inside each step; it has "
                 "no truncation, re-padding, validator or per-stage input selection of a built "
                 "batch (prompts and completions are padded once, at generation, by "
                 "trl.trainer.utils.pad), so the batch_ops surface is left out. Its "
                 "micro-batch split is checked on its own (tests/test_backends_trl.py: rows "
                 "stay whole on image batches, D2 on Idefics3 / SmolVLM).",
}
# TrainerSettings fields GRPOConfig has no option for (the trainer factory's
# `settings_unsupported`: clauses that need them are not applicable, with this reason)
SETTINGS_UNSUPPORTED = {
    "max_seq_len": f"TRL {TRL_VERSION}'s GRPOTrainer does not truncate sequences at train time "
                   "(GRPOConfig has max_prompt_length / max_completion_length for generation "
                   "only)",
    "max_tokens_per_micro_batch": f"TRL {TRL_VERSION}'s GRPOTrainer splits a generation batch "
                                  "into micro-batches of per_device_train_batch_size rows; "
                                  "GRPOConfig has no token budget",
}


@dataclass(frozen=True)
class Variant:
    name: str
    description: str
    # make TRL compute old and reference logprobs in their own passes even where one optimizer
    # step per generation batch would let it skip them (num_iterations >= 2, beta > 0)
    independent: bool = False


VARIANTS = {
    "trl": Variant(
        "trl",
        f"TRL {TRL_VERSION} GRPOTrainer at the options each rlconform point maps to (default "
        "point: num_iterations=1, beta=0, loss_type='dapo'): with one iteration TRL computes no "
        "old logprobs (old_per_token_logps = per_token_logps.detach()) and, with beta 0, no "
        "reference logprobs"),
    "trl-independent-passes": Variant(
        "trl-independent-passes",
        f"TRL {TRL_VERSION} GRPOTrainer with num_iterations >= 2 and beta = the point's KL "
        f"coefficient (or {INDEPENDENT_BETA:g} at single-step points without one): TRL computes "
        "old and reference logprobs in their own passes (at a single-step point the surface "
        "runs the first of the two iterations each step)",
        independent=True),
}

# rlconform's aggregation -> TRL's loss_type (GRPOTrainer._compute_loss): dapo divides by the
# generation batch's loss tokens (num_items_in_batch), grpo takes each row's token mean then the
# mean over rows, luspo each row's token sum then the mean, dr_grpo the token sum over
# rows x max_completion_length; bnpo (each micro-batch's own tokens), cispo, sapo and vespo are
# other objectives, no rlconform point
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo",
              "seq-mean-token-sum": "luspo", "constant": "dr_grpo"}


def trl_options(config, variant: Variant) -> dict:
    """The GRPOConfig options of rlconform point `config` (a LossConfig) in `variant`, or
    NotImplementedError naming what TRL has no option for."""
    missing = []
    if config.kl_coef and config.kl_estimator != "k3":
        missing.append(f"KL estimator {config.kl_estimator}: GRPOTrainer._compute_loss "
                       "estimates the KL with k3 only (exp(ref - logp) - (ref - logp) - 1)")
    if config.is_cap is not None:
        missing.append("truncated importance sampling: TRL applies it only with use_vllm=True "
                       "(vllm_importance_sampling_correction in "
                       "_generate_and_score_completions); the engine logprobs a rollout_func "
                       "returns are kept (sampling_per_token_logps) but no loss reads them "
                       "without vLLM, and vLLM is not installed here")
    if config.mini_batches > 1:
        missing.append("mini-batches: TRL's optimizer steps within a generation batch "
                       "(steps_per_generation > gradient_accumulation_steps) take micro-batches "
                       "of the shuffled batch (shuffle_sequence_dict in _prepare_inputs), and "
                       "dapo divides each step by the batch's mean tokens per step "
                       "(num_items_in_batch * gradient_accumulation_steps / "
                       "steps_per_generation), not by its own")
    if config.aggregation == "constant" and not float(config.constant_normalizer).is_integer():
        missing.append("a constant normaliser that is not an integer: dr_grpo divides by "
                       "max_completion_length, an int")
    if missing:
        raise NotImplementedError(f"TRL {TRL_VERSION}: " + "; ".join(missing))
    beta = config.kl_coef
    iterations = config.epochs
    if variant.independent:
        iterations = max(iterations, 2)
        if not beta and config.epochs == 1:
            # with ref == policy at the step's only iteration, beta * k3 and its gradient are 0
            beta = INDEPENDENT_BETA
    options = dict(
        loss_type=LOSS_TYPES[config.aggregation], epsilon=config.clip_low,
        epsilon_high=config.clip_high, delta=config.dual_clip,
        importance_sampling_level=config.ratio_level, beta=beta,
        use_bias_correction_kl=config.kl_ratio_weighted, entropy_coef=config.entropy_coef,
        num_iterations=iterations,
        max_grad_norm=config.max_grad_norm if config.max_grad_norm is not None else 0.0)
    if config.aggregation == "constant":
        options["max_completion_length"] = int(config.constant_normalizer)
    return options


def _stage():
    from rlconform.reference_impl.registry import Stage

    return Stage


# ---------------------------------------------------------------------------------------------
# Images per row, as TRL counts them
# ---------------------------------------------------------------------------------------------
def _num_images(batch, family) -> list[int] | None:
    """Images per row, as TRL's `num_images` (None for a batch without any image, as TRL).

    Families that pack one segment per image give it directly; Idefics3/SmolVLM pack one
    segment of tiles per row, and their prompt holds one `<global-img>` token per image.
    """
    from rlconform.reference_impl.packed import PackedTensor

    pv = batch.fields.get("pixel_values")
    if not isinstance(pv, PackedTensor) or all(pv.is_none(i) for i in range(len(pv))):
        return None
    spec = batch.family_spec
    if spec is not None and spec.pack_dim("pixel_values") == 1:
        # a batch that did not come from the processor (synthetic rows) has no such token: a
        # row with tiles then counts as one image (its image count is not recorded anywhere)
        gid = -1 if family is None else family.tokenizer.convert_tokens_to_ids("<global-img>")
        return [0 if pv.is_none(i) else max(1, int((batch["input_ids"][i] == gid).sum()))
                for i in range(len(batch))]
    # one grid row per image (Qwen-VL), else one dim-0 entry per image (Gemma3, LLaVA, -NeXT)
    per_image = batch.fields.get("image_grid_thw", pv)
    return [0 if per_image.is_none(i) else sum(s.shape[0] for s in per_image.row_segments(i))
            for i in range(len(pv))]


# ---------------------------------------------------------------------------------------------
# What a TRL caller with its own engine holds: prompts, the engine's completions and logprobs
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoredImage:
    """The dataset's stand-in for image `index` of row `row`: the trainer surface carries the
    processor's output for each row, not its images (see `_StoredMediaProcessor`)."""

    row: int
    index: int


@dataclass
class EngineRows:
    """A generation batch as an external engine returns it to TRL's `rollout_func`: per row the
    prompt ids, the completion ids it sampled, its logprob of each, and which completion tokens
    are the policy's (TRL's `env_mask`: 0 on tokens the model did not generate)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    env_mask: list[list[int]]
    logprobs: list[list[float]] | None
    starts: list[int]  # each row's first completion position in the batch's layout
    lengths: list[int]  # each row's own completion tokens (0 for an empty completion)

    def __len__(self) -> int:
        return len(self.prompt_ids)


def engine_rows(batch, pad_id: int) -> EngineRows:
    """The batch's rows split where the engine's completion starts (the first loss token of
    `token_mask`; a row without one has an empty completion). An empty completion goes to TRL
    as one pad token outside `env_mask` (NORMALISATIONS: `GRPOTrainer._generate` reads
    `ids[-1]` of every completion and raises IndexError on an empty one)."""
    if "token_mask" not in batch.fields:
        raise ValueError("TRL's generation batch needs each row's prompt / completion split: "
                         "the batch has no token_mask (1 on the completion tokens the loss takes)")
    ids, mask, lens = batch["input_ids"], batch["token_mask"], batch.seq_lens
    gen = batch.fields.get("generation_logprobs")
    out = EngineRows([], [], [], None if gen is None else [], [], [])
    for i in range(len(batch)):
        n = int(lens[i])
        loss = mask[i, :n].nonzero()
        start = int(loss[0]) if len(loss) else n
        completion, env = ids[i, start:n].tolist(), mask[i, start:n].long().tolist()
        logp = None if gen is None else gen[i, start:n].float().tolist()
        out.starts.append(start)
        out.lengths.append(len(completion))
        if not completion:
            completion, env, logp = [pad_id], [0], None if logp is None else [0.0]
        out.prompt_ids.append(ids[i, :start].tolist())
        out.completion_ids.append(completion)
        out.env_mask.append(env)
        if out.logprobs is not None:
            out.logprobs.append(logp)
    return out


def to_columns(values, rows: EngineRows, seq_len: int):
    """TRL's per-completion-token values `[B, C]` back to the batch's `[B, S]` layout (0 on
    prompt tokens, which TRL does not score, and on pads)."""
    import torch

    out = torch.zeros(len(rows), seq_len, dtype=torch.float32)
    for i, (start, n) in enumerate(zip(rows.starts, rows.lengths)):
        out[i, start:start + n] = values[i, :n].detach().float().cpu()
    return out


# Only for the processor stand-in: the fixture processors have no chat template, and
# `_generate_and_score_completions` renders the prompts before its processor call (whose text
# the stand-in does not read: the rows' ids come from the engine)
_GENERIC_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% elif "
    "c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}")


def _stored_media_processor(processor, core):
    """The family's processor, with its call on images answered from the generation batch's
    stored processor outputs (a subclass, so TRL still sees the processor it was given)."""
    base = type(processor)

    class StoredMedia(base):
        def __call__(self, images=None, text=None, **kwargs):
            if images is None:
                return base.__call__(self, images=images, text=text, **kwargs)
            return core.stored_media(images)

    StoredMedia.__name__ = f"StoredMedia{base.__name__}"
    stand_in = copy.copy(processor)
    stand_in.__class__ = StoredMedia
    if not getattr(stand_in, "chat_template", None):
        stand_in.chat_template = _GENERIC_CHAT_TEMPLATE
    return stand_in


def micro_batch_size(rows: int, wanted: int) -> int:
    """The largest divisor of `rows` that is <= `wanted` (TRL's generation batch is always
    per_device_train_batch_size x steps_per_generation rows)."""
    if wanted <= 0:
        raise ValueError(f"micro_batch_size must be positive, got {wanted}")
    return max(d for d in range(1, min(wanted, max(rows, 1)) + 1) if rows % d == 0)


def trl_micro_batches(gen: dict[str, Any], chunks: int, seed: int | None) -> list[dict]:
    """The micro-batches `GRPOTrainer._prepare_inputs` makes of a generation batch: TRL's
    split_pixel_values_by_grid -> shuffle_sequence_dict -> split_tensor_dict ->
    unsplit_pixel_values_by_grid. `seed` None: no shuffle (TRL always shuffles; the batch_ops
    surface exposes the unshuffled split too)."""
    import torch
    from trl.trainer.utils import (
        shuffle_sequence_dict,
        split_pixel_values_by_grid,
        split_tensor_dict,
        unsplit_pixel_values_by_grid,
    )

    gen = split_pixel_values_by_grid(gen)
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            gen = shuffle_sequence_dict(gen)
    return [unsplit_pixel_values_by_grid(b) for b in split_tensor_dict(gen, chunks)]


# ---------------------------------------------------------------------------------------------
# The trainer core: one GRPOTrainer, fed as a TRL caller with an external engine feeds it
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_global_rng():
    """GRPOTrainer's constructor calls set_seed (torch, numpy, random): keep the caller's."""
    import numpy as np
    import torch

    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py)
    np.random.set_state(npy)


def advantage(prompts, completions, advantage, **kwargs):
    """The reward function: each row's `advantage` column. With scale_rewards='none' and the
    generation batch as one group, TRL's advantage is this value minus the batch's mean. The
    rows of a logprob pass carry none (the driver puts advantages for the train pass): 0."""
    return [0.0 if a is None else a for a in advantage]


@dataclass
class _Rank:
    """One data-parallel rank's generation batch and the per-process state TRL keeps of it."""

    batch: Any
    rows: EngineRows
    inputs: list[dict]
    micro_batch_size: int
    micro_steps: int
    step: int = 0  # GRPOTrainer._step
    buffered: Any = None  # GRPOTrainer._buffered_inputs


class TRLCore:
    """A `GRPOTrainer` around a tiny fixture family, run as a TRL caller with an external
    engine runs it (see the module docstring)."""

    def __init__(self, settings, variant: Variant, model=None):
        import torch

        for name, why in SETTINGS_UNSUPPORTED.items():
            if getattr(settings, name, None) is not None:
                raise ValueError(f"TrainerSettings.{name} = {getattr(settings, name)!r} has no "
                                 f"TRL counterpart: {why}")
        from datasets import Dataset
        from transformers import PrinterCallback
        from trl import GRPOConfig, GRPOTrainer

        from rlconform.fixtures.families import build_family

        self.settings = settings
        self.variant = variant
        self.device = torch.device(settings.device)
        self.family = build_family(settings.family)
        self._dir = tempfile.TemporaryDirectory(prefix="rlconform-trl-")
        path = self._dir.name
        if model is None:
            model = self.family.build_model(seed=settings.seed, dtype=settings.dtype)
        self.family.save(path, model.cpu())
        policy = type(model).from_pretrained(path, attn_implementation="eager",
                                             dtype=settings.dtype)
        m = settings.micro_batch_size
        if m <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {m}")
        self.options = trl_options(settings.loss, variant)
        self.args = GRPOConfig(
            output_dir=f"{path}/out", report_to="none", save_strategy="no",
            logging_strategy="steps", logging_steps=1, disable_tqdm=True,
            use_cpu=self.device.type == "cpu", bf16=settings.dtype == torch.bfloat16,
            seed=settings.seed, learning_rate=settings.lr, weight_decay=0.0,
            lr_scheduler_type="constant", scale_rewards="none", max_steps=1, **self.options,
            # placeholders valid for any micro-batch size (the generation batch must hold
            # whole groups of num_generations); each pass sets the numbers of its batch
            per_device_train_batch_size=m, steps_per_generation=2,
            gradient_accumulation_steps=2, num_generations=2)
        processing = self.family.processor or self.family.tokenizer
        if self.family.processor is not None:
            processing = _stored_media_processor(processing, self)
        self.pad_id = self.family.tokenizer.pad_token_id
        self._serving: tuple | None = None
        with _quiet_global_rng():
            self.trainer = GRPOTrainer(
                model=policy, reward_funcs=advantage, args=self.args,
                train_dataset=Dataset.from_dict({"prompt": ["rlconform"] * 2}),
                processing_class=processing, rollout_func=self._rollout)
        t = self.trainer
        t.remove_callback(PrinterCallback)
        self.logs: list[dict] = []
        t.add_callback(_LogsTo(self.logs))
        t.model.to(self.device)
        if t.ref_model is not None:
            t.ref_model.to(self.device)
        t.create_optimizer()
        self.optimizer = t.optimizer
        self.steps = 0

    # -- models ---------------------------------------------------------------------------
    @property
    def model(self):
        return self.trainer.model

    @property
    def reference_model(self):
        return self.trainer.ref_model

    def state_dict(self):
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    # -- the generation batch, as TRL receives it -------------------------------------------
    def _configure(self, rows: int) -> tuple[int, int]:
        """Micro-batch size and count of a generation batch of `rows`, written into TRL's
        args the way a TRL user would configure them; the batch is one group of
        num_generations (the driver grouped and scored it)."""
        m = micro_batch_size(rows, self.settings.micro_batch_size)
        n = max(1, rows // m)
        a = self.args
        a.per_device_train_batch_size, a.steps_per_generation = m, n
        a.gradient_accumulation_steps, a.generation_batch_size = n, rows
        a.num_generations = self.trainer.num_generations = rows
        a.max_steps = self.settings.loss.epochs
        return m, n

    @staticmethod
    def generation_batch(batch):
        """The shard cut to its own longest row (TRL pads a generation batch to its longest)."""
        longest = int(batch.seq_lens.max()) if len(batch) else 0
        return batch.truncate(longest) if batch.seq_len() > longest else batch

    def _dataset_rows(self, batch, rows: EngineRows) -> list[dict]:
        """The rows of TRL's dataset for this batch: the prompt (its ids decoded: the surface
        keeps no prompt text), its images (conversational, as TRL's VLM examples build them)
        and the advantage the driver gave it."""
        decode = self.family.tokenizer.decode
        adv = batch.fields.get("advantages")
        counts = _num_images(batch, self.family) if self.family.processor is not None else None
        out = []
        for i, ids in enumerate(rows.prompt_ids):
            text = decode(ids, skip_special_tokens=True)
            row: dict[str, Any] = {"prompt": text,
                                   "advantage": None if adv is None else float(adv[i])}
            if self.family.processor is not None:
                row["prompt"] = [{"role": "user", "content": text}]
                row["images"] = [StoredImage(i, k) for k in range(counts[i] if counts else 0)]
            out.append(row)
        return out

    @contextlib.contextmanager
    def serving(self, batch, rows: EngineRows, stage):
        """The engine's output (`_rollout`) and the processor outputs (`stored_media`) of
        `batch` while TRL runs on it."""
        self._serving = (batch, rows, stage)
        try:
            yield
        finally:
            self._serving = None

    def _rollout(self, prompts, trainer) -> dict:
        """TRL's `rollout_func`: the engine's completions of the generation batch's prompts."""
        if self._serving is None:
            raise RuntimeError("rollout_func called outside a pass")
        _, rows, _ = self._serving
        if len(prompts) != len(rows):
            raise ValueError(f"rollout_func got {len(prompts)} prompts for a generation batch "
                             f"of {len(rows)} rows")
        return {"prompt_ids": rows.prompt_ids, "completion_ids": rows.completion_ids,
                "logprobs": rows.logprobs, "env_mask": rows.env_mask}

    def stored_media(self, images):
        """The processor's outputs of the generation batch, for `images` (the StoredImage
        lists of its rows, in row order): media as the processor batches them (the batch's
        model-input tensors), per-token type maps over each prompt, left padded as TRL pads
        the prompts."""
        import torch
        from transformers import BatchFeature

        batch, rows, stage = self._serving
        wanted = [[StoredImage(i, k) for k in range(len(x or []))] for i, x in enumerate(images)]
        if len(images) != len(rows) or [list(x or []) for x in images] != wanted:
            raise ValueError("the processor was called with other images than the generation "
                             f"batch's rows hold: {images!r}")
        out = dict(batch.multimodal_inputs(stage))
        width = max(len(p) for p in rows.prompt_ids)
        for name in ("token_type_ids", "mm_token_type_ids"):
            if name in out:
                full = out[name]
                maps = torch.zeros(len(rows), width, dtype=full.dtype)
                for i, start in enumerate(rows.starts):
                    maps[i, width - start:] = full[i, :start]
                out[name] = maps
        return BatchFeature(out)

    def _generation(self, batch, stage, inputs: list[dict] | None = None):
        batch = self.generation_batch(batch)
        rows = engine_rows(batch, self.pad_id)
        return batch, rows, inputs or self._dataset_rows(batch, rows)

    # -- TRL's passes ---------------------------------------------------------------------
    def logprobs(self, batch, stage):
        """`[B, S]` float32 logprobs (0 on prompt tokens and pads) of the old-logprob or
        reference pass of TRL's `_generate_and_score_completions` on the batch, or None when
        TRL runs no such pass in this configuration."""
        gen, rows, inputs = self._generation(batch, stage)
        self._configure(len(gen))
        t = self.trainer
        t.model.train()  # the mode TRL's train step calls it in
        with self.serving(gen, rows, stage):
            out = t._generate_and_score_completions(inputs)
        key = "ref_per_token_logps" if stage is _stage().REFERENCE_LOGPROB \
            else "old_per_token_logps"
        if key not in out:
            return None
        return to_columns(out[key], rows, batch.seq_len())

    def step_seed(self) -> int:
        return self.settings.seed * 1_000_003 + self.steps

    def train(self, shards):
        """Every optimizer step of one generation batch (the point's epochs: TRL's
        num_iterations) through `Trainer.train`, each data-parallel shard as one rank sees it
        (see DATA_PATH on data parallelism)."""
        from rlconform.reference_impl.trainer import StepResult

        world = len(shards)
        stage = _stage().TRAIN
        ranks = []
        for shard in shards:
            if not len(shard):
                continue  # an empty rank adds no gradient; DDP still divides by the world
            batch, rows, inputs = self._generation(_without_none(shard), stage)
            m = micro_batch_size(len(batch), self.settings.micro_batch_size)
            ranks.append(_Rank(batch, rows, inputs, m, len(batch) // m))
        if not ranks:
            raise ValueError("train needs at least one row")
        epochs = self.settings.loss.epochs
        window = sum(r.micro_steps for r in ranks)  # micro-steps of one optimizer step
        t = self.trainer
        a = self.args
        total = sum(len(r.batch) for r in ranks)
        peers = self._gathered_values(ranks, world, stage) if world > 1 else None
        a.gradient_accumulation_steps, a.max_steps = window, epochs
        # the loader yields, per optimizer step, each rank's generation batch once per micro-step
        # it serves (rank order); each rank's batch repeats as RepeatSampler repeats one
        # (num_iterations x steps_per_generation)
        loader = [r.inputs for _ in range(epochs) for r in ranks for _ in range(r.micro_steps)]
        slots = [r for _ in range(epochs) for r in ranks for _ in range(r.micro_steps)]
        step = type(t).training_step.__get__(t)

        def rank_step(model, inputs, num_items_in_batch):
            """One micro-step of the rank whose generation batch `inputs` is: TRL's per-process
            state of a generation batch (its micro-step counter and buffer, its batch and
            accumulation sizes) swapped in around GRPOTrainer.training_step."""
            r = slots.pop(0)
            self._rank_config(r, total)
            t._step, t._buffered_inputs = r.step, r.buffered
            window_steps = t.current_gradient_accumulation_steps
            t.current_gradient_accumulation_steps = r.micro_steps
            try:
                with self.serving(r.batch, r.rows, stage), \
                        _as_rank(t, world, None if peers is None else peers[ranks.index(r)]):
                    return step(model, inputs, num_items_in_batch)
            finally:
                r.step, r.buffered = t._step, t._buffered_inputs
                t.current_gradient_accumulation_steps = window_steps
                a.gradient_accumulation_steps = window

        t.get_train_dataloader = lambda: loader
        t.training_step = rank_step
        del self.logs[:]
        seen = _LossLocals()
        try:
            with _seeded(self.step_seed()), _ddp_mean(t.model, world), seen:
                t.train()
        finally:
            for name in ("get_train_dataloader", "training_step"):
                t.__dict__.pop(name, None)
        logged = [entry for entry in self.logs if "grad_norm" in entry]
        if len(logged) != epochs or len(seen.calls) != epochs * window:
            raise RuntimeError(f"TRL ran {len(logged)} optimizer steps and {len(seen.calls)} "
                               f"loss computations for {epochs} x {window}")
        results = []
        for k, entry in enumerate(logged):
            metrics: dict = {}
            calls = seen.calls[k * window:(k + 1) * window]
            for frame in calls:
                for name, v in self.metrics(frame).items():
                    metrics.setdefault(name, []).append(v.cpu())
            # each rank's token count (its first micro-batch's num_items_in_batch)
            items, at = 0.0, 0
            for r in ranks:
                items += float(calls[at]["inputs"]["num_items_in_batch"])
                at += r.micro_steps
            self.steps += 1
            # Trainer logs the mean of the ranks' losses (nested_gather(tr_loss).mean()); here
            # the window summed every rank's
            results.append(StepResult(
                float(entry["loss"]) / world,
                {name: torch_cat(v) for name, v in metrics.items()},
                float(entry["grad_norm"]), {"normalizer": items, "step": self.steps}))
        first = results[0]
        if len(results) > 1:
            first.extra["optimizer_steps"] = results
        return first

    def _rank_config(self, rank: _Rank, total: int) -> None:
        """A rank's generation batch sizes, written into TRL's args the way a TRL user would
        configure them; the step's rows over every rank are one group of num_generations (the
        driver grouped and scored them)."""
        a = self.args
        a.per_device_train_batch_size = rank.micro_batch_size
        a.steps_per_generation = a.gradient_accumulation_steps = rank.micro_steps
        a.generation_batch_size = len(rank.batch)
        a.num_generations = self.trainer.num_generations = total

    def _gathered_values(self, ranks, world: int, stage) -> list[list]:
        """What each rank hands each `accelerator.gather` of `_generate_and_score_completions`
        (in call order): TRL's own generation of every rank's batch, run once before the step
        with each gather answering the rank's own value. The step's generation then gathers
        them as an all-gather would (`_as_rank`). Everything it gathers (rewards, truncation
        flags, loss-token counts, their metrics) comes from the rows, not from the weights."""
        t = self.trainer
        out = []
        for r in ranks:
            self._rank_config(r, len(r.batch))  # a gather of one rank: its rows one group
            t.model.train()
            with self.serving(r.batch, r.rows, stage), _as_rank(t, world, None) as local:
                t._generate_and_score_completions(r.inputs)
            out.append(local.sent_last)
        return [[[v for q, v in enumerate(sent) if q != i] for sent in zip(*out)]
                for i in range(len(ranks))]

    def metrics(self, frame: dict) -> dict:
        """TRL's own per-token values of one `_compute_loss` call, over its loss tokens: the
        importance ratio coef_1 (token or sequence level, before `delta`), the clamped coef_2,
        the k3 KL estimate (before ratio weighting), the entropies, the per-token loss and,
        with engine logprobs, the engine-vs-trainer metrics."""
        from rlconform.reference_impl.loss import generation_metrics, masked

        t = self.trainer
        mask, logp = frame["mask"], frame["per_token_logps"]
        ratio = frame["first"]["coef_1"].expand_as(logp)
        out = {"probs_ratio": masked(ratio, mask),
               "loss_per_token": masked(frame["per_token_loss"].expand_as(logp), mask)}
        if "coef_2" in frame:
            clamped = frame["coef_2"].expand_as(logp)
            out["probs_ratio_clamped"] = masked(clamped, mask)
            out["clipped"] = masked((ratio != clamped).float(), mask)
        if t.beta != 0.0:
            out["reference_kl"] = masked(frame["first"]["per_token_kl"], mask)
        if t.entropy_coef:
            out["entropy"] = masked(frame["entropies"], mask)
        gen = frame["inputs"].get("sampling_per_token_logps")
        if gen is not None:
            out.update(generation_metrics(gen, frame["old_per_token_logps"].detach(), mask))
        return out


def torch_cat(values):
    import torch

    return torch.cat(values)


class _LogsTo:
    """A TrainerCallback keeping what Trainer logs (its loss and grad_norm of each optimizer
    step, TRL's metrics)."""

    def __init__(self, into: list):
        self.into = into

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda args, state, control, **kwargs: None
        raise AttributeError(name)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.into.append(dict(logs or {}))


class _LossLocals:
    """Observes `GRPOTrainer._compute_loss`: the locals of each call at its return (TRL logs
    only batch means of its per-token values), plus `first`, the first value each of
    `coef_1` and `per_token_kl` took (TRL rebinds them: the `delta` clamp, the ratio-weighted
    KL). A trace function on that one code object; every other frame runs untraced."""

    FIRST = ("coef_1", "per_token_kl")

    def __init__(self):
        self.calls: list[dict] = []

    def __enter__(self):
        import inspect

        from trl.trainer.grpo_trainer import GRPOTrainer

        code = inspect.unwrap(GRPOTrainer._compute_loss).__code__  # under any wrapper
        first: dict = {}

        def local(frame, event, arg):
            if event == "line":
                for name in self.FIRST:
                    if name not in first and name in frame.f_locals:
                        first[name] = frame.f_locals[name]
            elif event == "return":
                self.calls.append({**frame.f_locals, "first": dict(first)})
                first.clear()
            return local

        def tracer(frame, event, arg):
            if frame.f_code is code:
                first.clear()
                return local
            return None

        self._previous = sys.gettrace()
        sys.settrace(tracer)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._previous)
        return False


class _RankAccelerator:
    """The trainer's Accelerator as one emulated data-parallel rank sees it: `num_processes` is
    the world, and inside `_generate_and_score_completions` (`generation`) each `gather` is an
    all-gather of this rank's value with the other ranks' values of the same call (`others[k]`
    for the k-th call: a list, one per other rank), this rank's first, so TRL's
    `process_index * len(prompts)` slice (process_index 0) takes its own rows whatever the
    ranks' sizes; TRL reduces what it gathers there over the whole step (sums, the mean of one
    group), where the order of the ranks does not matter. `others` None: each gather there
    answers the rank's own value and records it (`sent`). Outside the generation (the metrics
    `_compute_loss` logs, which the adapter does not read) a gather answers the rank's own."""

    def __init__(self, accelerator, world: int, others: list | None):
        self._accelerator, self._world, self._others = accelerator, world, others
        self.sent: list | None = None

    @property
    def num_processes(self) -> int:
        return self._world

    @contextlib.contextmanager
    def generation(self):
        self.sent = []
        try:
            yield
        finally:
            self.sent_last, self.sent = self.sent, None

    def gather(self, tensor):
        import torch

        if self.sent is None:
            return self._accelerator.gather(tensor)
        k = len(self.sent)
        self.sent.append(tensor.detach().clone())
        if self._others is None:
            return tensor
        if k >= len(self._others):
            raise RuntimeError(f"gather call {k} of an emulated rank has no counterpart on the "
                               "other ranks (their generation gathered fewer values)")
        peers = [p.to(tensor.device) for p in self._others[k]]
        if tensor.dim() == 0:
            return torch.stack([tensor, *peers])
        return torch.cat([tensor, *peers])

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


@contextlib.contextmanager
def _as_rank(trainer, world: int, others: list | None):
    """`trainer.accelerator` and GRPOTrainer's `gather` as one of `world` emulated ranks
    (`_RankAccelerator`, its all-gathers inside `_generate_and_score_completions`) while the
    block runs; world 1: the trainer's own."""
    if world == 1:
        yield None
        return
    import trl.trainer.grpo_trainer as grpo

    own, own_gather = trainer.accelerator, grpo.gather
    view = _RankAccelerator(own, world, others)
    generate = type(trainer)._generate_and_score_completions.__get__(trainer)

    def generation(inputs):
        with view.generation():
            return generate(inputs)

    # GRPOTrainer gathers through its accelerator and accelerate.utils.gather (the rewards)
    trainer.accelerator, grpo.gather = view, view.gather
    trainer._generate_and_score_completions = generation
    try:
        yield view
    finally:
        trainer.accelerator, grpo.gather = own, own_gather
        trainer.__dict__.pop("_generate_and_score_completions", None)


@contextlib.contextmanager
def _ddp_mean(model, world: int):
    """DDP's gradient all-reduce (the mean over `world` ranks), emulated in one process: each
    emulated rank's backward contributes 1/world of its gradient."""
    if world == 1:
        yield
        return
    hooks = [p.register_hook(lambda g: g / world) for p in model.parameters()
             if p.requires_grad]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def _seeded(seed: int):
    """TRL's shuffle_sequence_dict draws from the global torch RNG: seed it for the train call,
    inside a forked RNG (both trainer paths then shuffle alike)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _without_none(batch):
    """A pass TRL did not run left None in the in-memory batch: drop it."""
    empty = [k for k, v in batch.fields.items() if v is None]
    return batch.without(*empty) if empty else batch


# ---------------------------------------------------------------------------------------------
# The batch_ops surface: TRL's micro-batching
# ---------------------------------------------------------------------------------------------
# the packed media keys GRPOTrainer keeps in its generation batch (_generate_and_score_completions'
# output dict) that rlconform's fixtures emit; any other packed field has no place there
_TRL_MEDIA = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes")
_ROWS, _SHAPES = "__rlconform_rows", "__rlconform_shapes:"
_NO_OP = ("TRL {v} has no {what} of its own to wrap (GRPOTrainer pads prompts and completions "
          "with trl.trainer.utils.pad at generation and never {does} a built batch)")


class TRLBatchOps:
    """`micro_batches` through TRL's own helpers, for tests/test_backends_trl.py (not a declared
    surface: TRL's split runs inside the trainer surface's step, see `_NOTES["batch_ops"]`).

    The batch becomes TRL's generation-batch dict: tensors as they are, object columns as
    per-row lists (TRL moves any per-row list with its row), image media as the model-input
    tensors TRL holds (`pixel_values`, `image_grid_thw`, `pixel_attention_mask`, `image_sizes`)
    plus `num_images`. TRL's split_pixel_values_by_grid -> shuffle_sequence_dict (seeded) ->
    split_tensor_dict -> unsplit_pixel_values_by_grid make the micro-batches; two observer keys
    ride along as per-row values (each row's index and its media segment shapes), so each
    micro-batch is turned back into a Batch by the exact inverse of `as_tensor()`: if TRL moved
    media rows without their sample, the rebuilt rows hold other samples' media.
    The other batch_ops methods have no TRL counterpart and raise.
    """

    name = "trl"

    def truncate(self, batch, max_len):
        raise NotImplementedError(_NO_OP.format(v=TRL_VERSION, what="sequence truncation",
                                                does="truncates"))

    def pad_to(self, batch, seq_len):
        raise NotImplementedError(_NO_OP.format(v=TRL_VERSION, what="re-padding of a batch",
                                                does="re-pads"))

    def validate(self, batch):
        raise NotImplementedError(_NO_OP.format(v=TRL_VERSION, what="batch validator",
                                                does="validates"))

    def multimodal_inputs(self, batch, stage, dtype=None):
        raise NotImplementedError(
            f"TRL {TRL_VERSION} has no per-stage input selection: every pass of GRPOTrainer "
            "gets the same forward kwargs")

    def micro_batches(self, batch, n: int, shuffle_seed: int | None = None):
        import torch

        b = len(batch)
        if not 1 <= n <= max(b, 1):
            raise ValueError(f"micro-batch count n={n} must be in 1..{b} (the batch size)")
        if b % n:
            raise ValueError(
                f"TRL splits a generation batch only into equal micro-batches: GRPOConfig "
                f"requires the generation batch ({b} rows) to be a multiple of "
                f"per_device_train_batch_size, so {n} micro-batches are not a TRL "
                f"configuration (split_tensor_dict would silently drop the last {b % n} rows)")
        gen = _to_trl(batch)
        gen[_ROWS] = torch.arange(b)
        chunks = trl_micro_batches(gen, n, shuffle_seed)
        return [([int(i) for i in c[_ROWS]], _from_trl(c, batch)) for c in chunks]


def _to_trl(batch) -> dict:
    from torch import Tensor

    from rlconform.reference_impl.objects import ObjectColumn
    from rlconform.reference_impl.packed import PackedTensor

    out: dict = {}
    for name, v in batch.fields.items():
        if isinstance(v, Tensor):
            out[name] = v
        elif isinstance(v, ObjectColumn):
            out[name] = [None if r is None else dict(r) for r in v.rows]
        elif isinstance(v, PackedTensor):
            empty = all(v.is_none(i) for i in range(len(v)))
            if name not in _TRL_MEDIA and not empty:  # (a field with no media has no tensor)
                raise NotImplementedError(
                    f"TRL {TRL_VERSION}'s GRPO generation batch has no key for packed field "
                    f"{name!r}: GRPOTrainer carries only {', '.join(_TRL_MEDIA)} (and "
                    "spatial_shapes, image_position_ids, token type ids) between its passes")
            t = v.as_tensor()
            if t is not None:
                out[name] = t
            out[_SHAPES + name] = [v.segment_shapes(i) for i in range(len(v))]
        else:
            raise TypeError(f"field {name!r} is a {type(v).__name__}")
    try:
        from rlconform.fixtures.families import build_family

        family = build_family(batch.family)
    except (KeyError, TypeError):
        family = None  # a registry family without a fixture: no tokenizer to count images by
    n = _num_images(batch, family)
    if n is not None and "pixel_values" in out:
        out["num_images"] = n
    return out


def _from_trl(chunk: dict, like):
    """A TRL micro-batch back to a Batch: media rows cut from the model-input tensors by the
    shapes that travelled with each row (the inverse of PackedTensor.as_tensor)."""
    from rlconform.reference_impl.batch import Batch
    from rlconform.reference_impl.objects import ObjectColumn
    from rlconform.reference_impl.packed import PackedTensor

    fields = {}
    for name, v in like.fields.items():
        if isinstance(v, PackedTensor):
            fields[name] = _rebuild(chunk.get(name), chunk[_SHAPES + name], v.pack_dim)
        elif isinstance(v, ObjectColumn):
            fields[name] = ObjectColumn(list(chunk[name]))
        else:
            fields[name] = chunk[name]
    return Batch(fields, like.family, dict(like.extra))


def _rebuild(t, shapes_per_row: list, pack_dim: int):
    from rlconform.reference_impl.packed import PackedTensor

    def crop(x, shape):
        return x[tuple(slice(0, d) for d in shape)]

    rows, cursor = [], 0
    for i, shapes in enumerate(shapes_per_row):
        if shapes is None:
            rows.append(None)
            continue
        if pack_dim == 0:
            segs = []
            for shape in shapes:
                segs.append(crop(t[cursor:cursor + shape[0]], shape))
                cursor += shape[0]
        else:
            row, start, segs = t[i], 0, []
            for shape in shapes:
                segs.append(crop(row[start:start + shape[0]], shape))
                start += shape[0]
        rows.append(segs)
    return PackedTensor.from_rows(rows, pack_dim=pack_dim)


# ---------------------------------------------------------------------------------------------
# The trainer surface
# ---------------------------------------------------------------------------------------------
_OUTPUT = {"logprob": "prev_logprobs", "reference_logprob": "reference_logprobs"}


class _TRLTrainer:
    def __init__(self, settings, variant: Variant, model=None):
        self.settings = settings
        self.core = TRLCore(settings, variant, model)

    @property
    def model(self):
        return self.core.model

    @property
    def reference_model(self):
        return self.core.reference_model

    @property
    def trl_trainer(self):
        return self.core.trainer

    def state_dict(self):
        return self.core.state_dict()


class TRLLegacyTrainer(_TRLTrainer):
    """In memory: `compute_logprobs(batch, stage) -> Tensor | None`, `train(batch | list)`."""

    def compute_logprobs(self, batch, stage):
        return self.core.logprobs(batch, stage)

    def train(self, batch):
        return self.core.train(list(batch) if isinstance(batch, (list, tuple)) else [batch])


class TRLDataPlaneTrainer(_TRLTrainer):
    """Every pass from a meta: fetch the fields the stage consumes (the field registry decides,
    as for the reference), decode, run TRL's pass, put its output as a new column."""

    def __init__(self, settings, variant: Variant, transport, codec, model=None):
        super().__init__(settings, variant, model)
        self.transport = transport
        self.codec = codec

    def fetch(self, meta, stage):
        """The fields the stage consumes (the field registry decides, as for the reference),
        and for a logprob pass the loss mask too: TRL's `_generate_and_score_completions`,
        which runs its logprob passes, takes each row as prompt and completion."""
        from rlconform.reference_impl.codec import WireBatch, column_field
        from rlconform.reference_impl.registry import stage_fields

        wanted = stage_fields(stage)  # the reference's rule, object fields' wire columns too
        if stage is not _stage().TRAIN:
            wanted = (*wanted, "token_mask")
        fields = [f for f in wanted if f in meta.fields] + [
            c for c in meta.fields if column_field(c) != c and column_field(c) in wanted]
        cols, tags = self.transport.get(meta.partition, meta.keys, select_fields=fields)
        return self.codec.decode(WireBatch(cols, tags))

    def compute_logprobs(self, meta, stage):
        from rlconform.reference_impl.batch import Batch

        name = _OUTPUT[stage.value]
        batch = self.fetch(meta, stage)
        values = self.core.logprobs(batch, stage)
        if values is None:
            return meta  # TRL ran no such pass in this configuration
        wire = self.codec.encode(Batch({"input_lengths": batch["input_lengths"], name: values}))
        self.transport.put(meta.partition, meta.keys, {name: wire.columns[name]})
        return meta.with_fields(name)

    def train(self, meta):
        metas = list(meta) if isinstance(meta, (list, tuple)) else [meta]
        return self.core.train([self.fetch(m, _stage().TRAIN) for m in metas])


def make_trainer(variant: str, settings, transport=None, codec=None, model=None):
    v = VARIANTS[variant]
    if transport is None:
        return TRLLegacyTrainer(settings, v, model)
    if codec is None:
        from rlconform.reference_impl.codec import ReferenceCodec

        codec = ReferenceCodec()
    return TRLDataPlaneTrainer(settings, v, transport, codec, model)


def _backend(variant: str) -> Backend:
    def trainer(settings, transport=None, codec=None, model=None):
        return make_trainer(variant, settings, transport, codec, model)

    def loss_options(config) -> dict:
        """The GRPOConfig options of an rlconform point (NotImplementedError: none)."""
        return trl_options(config, VARIANTS[variant])

    trainer.loss_options = loss_options
    trainer.settings_unsupported = dict(SETTINGS_UNSUPPORTED)

    return Backend(
        name=variant,
        description=VARIANTS[variant].description,
        trainer=trainer,
        notes=dict(_NOTES),
        version=package_version("trl", "TRL"),
        data_path=DATA_PATH,
        normalisations=dict(NORMALISATIONS),
    )


def backend() -> Backend:
    return _backend("trl")


def independent_backend() -> Backend:
    return _backend("trl-independent-passes")
