"""TRL 1.16.0's `GRPOTrainer` as an rlconform trainer backend (two configurations).

The adapter feeds TRL what a TRL caller with an external engine holds and lets TRL do every step
from the engine's output to the optimizer step (DATA_PATH lists them, function by function):

| rlconform need | TRL 1.16.0 |
|---|---|
| the generation batch | `GRPOTrainer._generate_and_score_completions` on the batch's rows as TRL's dataset rows (the prompt, its images, the driver's advantage), with a `rollout_func` returning the engine's output for them: prompt ids, completion ids, the engine's per-token logprobs and `env_mask` (the loss mask over the completion). TRL pads prompts (left) and completions (right), builds its masks, `num_images`, `num_items_in_batch`, its advantages and its old / reference logprob passes, under its own conditions |
| media | each row's prompt text and images as the dataset held them (the `raw_prompt` column, reference_impl/prompts.py: the trainer factory declares `reads_prompts`) become TRL's conversational dataset rows (`{"prompt": [{"role": "user", "content": text}], "images": [PIL images]}`); TRL's own prompt handling (`prepare_multimodal_messages`, `apply_chat_template` with the family's chat template), its processor call (the family's processor reloaded from the policy's folder with `padding_side="left"`, as `GRPOTrainer.__init__` loads one), image counting, type-map extension and pixel splitting make the model's media inputs. The processor's outputs the batch carries are not read |
| advantages | TRL derives advantages from rewards inside `_generate_and_score_completions`; the surface hands the driver's advantages, so the reward function returns each row's (a dataset column) and TRL runs with `scale_rewards='none'` and the generation batch as one group of `num_generations`: TRL's advantage is the given one minus the batch's mean (equal where the driver's groups are centred, as group normalisation leaves them) |
| prev / reference logprobs | the logprob passes run `_generate_and_score_completions` on the shard and keep its `old_per_token_logps` / `ref_per_token_logps` (completion tokens only; 0 on prompt tokens), or none where TRL computes none (one iteration: no old logprobs; `beta == 0`: no reference) |
| the train step | `Trainer.train` (transformers' loop: `accelerator.prepare`, the accumulation window of `GRPOTrainer.training_step` -> `_prepare_inputs` -> `_generate_and_score_completions` / TRL's micro-batch split -> `_compute_loss`, then clipping, the optimizer step and the scheduler) over a loader yielding the step's generation batch as TRL's RepeatSampler repeats one (num_iterations x steps_per_generation). TRL recomputes its old logprobs in the step itself: a stored prev_logprobs column is not read |
| per-token probs_ratio, clamped ratio, KL, entropy, loss per token | TRL logs batch means only: `_LossLocals` reads `_compute_loss`'s own tensors at its return (`coef_1` before the `delta` clamp, `coef_2`, `per_token_kl` before ratio weighting, `entropies`, `per_token_loss`); loss and grad norm are those Trainer logs for each optimizer step |
| data-parallel ranks (a train call of several shards) | real TRL ranks: one process per shard (`_run_ranks`, forked from the rank launcher of reference_impl/ranks.py), each with torch.distributed's env rendezvous on loopback, so the Accelerator GRPOTrainer builds is accelerate's multi-process CPU state (gloo): `Trainer.train` -> `accelerator.prepare` wraps the policy in DistributedDataParallel and TRL's gathers in `_generate_and_score_completions` (rewards, loss-token counts) are all-gathers. Each rank builds its trainer as this one (settings, variant, the saved initial policy, which is also TRL's reference), loads the driver's current weights, optimizer state and step counter, is seeded as accelerate seeds a rank (`set_seed(seed, device_specific=True)` with the call's seed) and runs the one-process path on its shard (`TRLCore.rank_step`); the driver takes Trainer's logs (the same on every rank), every rank's per-token metrics (rank order) and loads rank 0's updated weights and optimizer state |

Where rlconform's rows and TRL's contract differ, the adapter's changes are stated per clause
(`NORMALISATIONS`): an empty completion (TRL's `_generate` indexes its last token).

What TRL cannot take is refused, not repaired: data-parallel shards of unequal sizes (an empty
one too) raise ValueError naming the sizes, since each TRL rank holds
per_device_train_batch_size x steps_per_generation rows and `_generate_and_score_completions`
keeps rank r's rows of the all-gathered rewards at `r * len(prompts)`; several shards on a
non-CPU device raise too (the rank processes run on the CPU, gloo). A rank that raises, dies or
stays silent past `RLCONFORM_TRL_RANK_TIMEOUT_S` (900 s) fails the call with its traceback or
exit, every rank process reaped first. Hooks a caller puts on `trainer.model` or its
optimizer see a multi-rank step only through the weights and optimizer state loaded
afterwards; the trainer's `watch(factories)` (conformance/clauses/_watch.py) builds a caller's
watchers in every rank process instead, on its unwrapped policy, and hands back one record per
watcher: the gradient read once DDP's all-reduce has finished (`_reading_after_backward`), the
optimizer steps of rank 0 (every rank's checked equal), every rank's forwards in rank order.

Configuration: `settings` map onto `GRPOConfig` (`micro_batch_size` ->
per_device_train_batch_size, `lr`, `seed`, `settings.loss` through `trl_options`; `dtype`
bfloat16 -> `bf16=True`, float32 -> `bf16=False`, since TRL's default `bf16=True` autocasts an
fp32 model to bf16); one `train` is every optimizer step of a generation batch (the point's
epochs = `num_iterations`) of `per_device_train_batch_size x steps_per_generation` rows
(`gradient_accumulation_steps = steps_per_generation`). TRL needs the generation batch to be a
multiple of the micro-batch size; where it is not, the micro-batch size is the largest divisor
of the batch's rows that is <= `micro_batch_size`. TRL's `shuffle_sequence_dict` draws from the
global RNG; the adapter seeds each train call from `seed` and the step inside a forked RNG, so
both trainer paths shuffle alike (a rank process: accelerate's `set_seed` of that seed plus its
process index, as GRPOTrainer seeds a rank; rank 0 draws as one process does). Settings TRL has no counterpart for (`max_seq_len`,
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
import pickle
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
    PathStep("transformers.ProcessorMixin.__call__", "entered",
             "on each row's prompt text and images (the raw_prompt column)", "trainer"),
    PathStep(f"{_GRPO}._get_per_token_logps_and_entropies", "entered", surface="trainer"),
    PathStep(f"{_GRPO}._calculate_rewards", "entered", surface="trainer"),
    PathStep(f"{_GRPO_MODULE}.split_pixel_values_by_grid", "entered", surface="trainer"),
    PathStep(f"{_GRPO_MODULE}.shuffle_sequence_dict", "entered", surface="trainer"),
    PathStep(f"{_GRPO_MODULE}.split_tensor_dict", "entered", surface="trainer"),
    PathStep(f"{_GRPO}._compute_loss", "entered", surface="trainer"),
    PathStep("transformers.Trainer.create_optimizer", "entered", surface="trainer"),
    PathStep("transformers.Trainer._clip_grad_norm", "entered", surface="trainer"),
    PathStep("accelerate.Accelerator.clip_grad_norm_", "entered", surface="trainer"),
    PathStep("torch.nn.parallel.DistributedDataParallel", "entered",
             "real ranks over gloo on the CPU: a train call of several shards starts one "
             "process per shard, each a TRL rank of accelerate's multi-process CPU state "
             "(Accelerator.prepare wraps its policy in DDP; TRL's gathers are all-gathers)",
             "trainer"),
)
_EMPTY_COMPLETION = (
    "a row with an empty completion (no loss token) reaches TRL's rollout_func as one pad "
    "token outside env_mask: GRPOTrainer._generate reads ids[-1] of every completion and "
    "raises IndexError on an empty one (docs/upstream/trl-empty-completion.py); the token "
    "is past the row's end, in no loss term, and left out of the logprob columns")
# What the adapter changes between rlconform's rows and TRL before a clause judges the result
NORMALISATIONS = {
    **{cid: _EMPTY_COMPLETION for cid in (
        "TRAIN-RATIO-ONE", "TRAIN-FIELD-PARITY", "TRAIN-LEGACY-PARITY", "TRAIN-INPUT-INTACT",
        "TRAIN-REFERENCE-FROZEN", "TRAIN-LOSS-CLOSED-FORM", "TRAIN-GRAD-RECOMPUTE",
        "TRAIN-RATIO-LATER-STEPS", "TRAIN-ORDER-FREE", "TRAIN-SPLIT-INVARIANCE",
        "GEN-REFIT-SYNC")},
}

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


def _has_media(batch) -> bool:
    """Whether any row holds media, in packed fields or per-row dicts."""
    from rlconform.reference_impl.packed import PackedTensor

    packed = batch.packed_form()
    return any(isinstance(v, PackedTensor) and not all(v.is_none(i) for i in range(len(v)))
               for v in packed.fields.values())


# ---------------------------------------------------------------------------------------------
# What a TRL caller with its own engine holds: prompts, the engine's completions and logprobs
# ---------------------------------------------------------------------------------------------
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
    try:
        starts = batch.completion_starts()
    except ValueError as exc:
        raise ValueError("TRL's generation batch needs each row's prompt / completion split: "
                         f"{exc}") from exc
    ids, mask, lens = batch["input_ids"], batch["token_mask"], batch.seq_lens
    gen = batch.fields.get("generation_logprobs")
    out = EngineRows([], [], [], None if gen is None else [], [], [])
    for i, start in enumerate(starts):
        n = int(lens[i])
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


class TRLCore:
    """A `GRPOTrainer` around a tiny fixture family, run as a TRL caller with an external
    engine runs it (see the module docstring)."""

    def __init__(self, settings, variant: Variant, model=None, saved: tuple | None = None):
        """`saved`: another TRLCore's `saved` (its policy class and the folder it saved its
        initial policy and processor in); a rank process builds its trainer from it, so its
        policy and TRL's reference model (reloaded from `config._name_or_path`) are the
        driver's own."""
        import torch

        for name, why in SETTINGS_UNSUPPORTED.items():
            if getattr(settings, name, None) is not None:
                raise ValueError(f"TrainerSettings.{name} = {getattr(settings, name)!r} has no "
                                 f"TRL counterpart: {why}")
        from datasets import Dataset
        from transformers import PrinterCallback
        from trl import GRPOConfig, GRPOTrainer

        from rlconform.fixtures.families import build_family, load_processor

        self.settings = settings
        self.variant = variant
        self.device = torch.device(settings.device)
        self.family = build_family(settings.family)
        self._dir = tempfile.TemporaryDirectory(prefix="rlconform-trl-")
        path = self._dir.name
        if saved is None:
            if model is None:
                model = self.family.build_model(seed=settings.seed, dtype=settings.dtype)
            self.family.save(path, model.cpu())
            policy = type(model).from_pretrained(path, attn_implementation="eager",
                                                 dtype=settings.dtype)
        else:
            policy_class, saved = saved
            policy = policy_class.from_pretrained(saved, attn_implementation="eager",
                                                  dtype=settings.dtype)
        self.saved = (type(policy), path if saved is None else saved)
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
        # the processor a TRL user loads from the checkpoint's folder, left padded as
        # GRPOTrainer.__init__ loads one when given none (AutoProcessor.from_pretrained(...,
        # padding_side="left")): its call's per-token type maps line up with left-padded prompts
        processing = load_processor(self.saved[1])
        tokenizer = getattr(processing, "tokenizer", processing)
        tokenizer.padding_side = "left"
        self.pad_id = self.family.tokenizer.pad_token_id
        self._serving: EngineRows | None = None
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
        self._watch: dict | None = None  # the open `watch`: its factories and what it saw

    # -- models ---------------------------------------------------------------------------
    @property
    def model(self):
        return self.trainer.model

    @property
    def reference_model(self):
        return self.trainer.ref_model

    def state_dict(self):
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    @contextlib.contextmanager
    def watch(self, factories):
        """The trainer surface's `watch` (conformance/clauses/_watch.py): the watchers are
        built on this process's model for the block, as a caller builds them on
        `trainer.model`, so a one-shard train call is watched where it runs; a train call of
        several shards also builds them in every rank process, and the block's records are
        then the ranks', joined (`_joined`). A block holds at most one such call: the ranks'
        records join per call, not across calls."""
        factories = list(factories)
        local = [f(self.model) for f in factories]
        self._watch = {"factories": factories, "ranked": [], "local_calls": 0}
        records: list = []
        try:
            yield records
        finally:
            seen, self._watch = self._watch, None
            own = [w.remove() for w in local]
        records.extend(_watched(own, seen))

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
        """The rows of TRL's dataset for this batch: each row's prompt text and images as the
        dataset held them (`raw_prompt`; conversational, as TRL's VLM examples build them) and
        the advantage the driver gave it. A media-free batch without `raw_prompt` hands its
        prompt ids decoded: TRL then calls no processor, and the text reaches only the
        rollout_func and reward function here, which do not read it."""
        from rlconform.reference_impl.prompts import FIELD, prompt_rows

        adv = batch.fields.get("advantages")
        if FIELD in batch.fields:
            held = prompt_rows(batch[FIELD])
        elif not _has_media(batch):
            decode = self.family.tokenizer.decode
            held = [(decode(ids, skip_special_tokens=True), []) for ids in rows.prompt_ids]
        else:
            raise ValueError(f"TRL renders each prompt and runs its processor on the row's "
                             f"images: a batch with images needs each row's prompt text and "
                             f"images (the {FIELD!r} column, reference_impl/prompts.py), and "
                             f"this one has none")
        out = []
        for i, (text, images) in enumerate(held):
            row: dict[str, Any] = {"prompt": text,
                                   "advantage": None if adv is None else float(adv[i])}
            if self.family.processor is not None:
                row["prompt"] = [{"role": "user", "content": text}]
                row["images"] = images
            elif images:
                raise ValueError(f"{FIELD} row {i} has {len(images)} images for the "
                                 f"{self.family.name!r} family, which takes none")
            out.append(row)
        return out

    @contextlib.contextmanager
    def serving(self, rows: EngineRows):
        """The engine's output (`_rollout`) while TRL runs on its generation batch."""
        self._serving = rows
        try:
            yield
        finally:
            self._serving = None

    def _rollout(self, prompts, trainer) -> dict:
        """TRL's `rollout_func`: the engine's completions of the generation batch's prompts."""
        if self._serving is None:
            raise RuntimeError("rollout_func called outside a pass")
        rows = self._serving
        if len(prompts) != len(rows):
            raise ValueError(f"rollout_func got {len(prompts)} prompts for a generation batch "
                             f"of {len(rows)} rows")
        return {"prompt_ids": rows.prompt_ids, "completion_ids": rows.completion_ids,
                "logprobs": rows.logprobs, "env_mask": rows.env_mask}

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
        with self.serving(rows):
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
        num_iterations) through `Trainer.train`. One shard: in this process. Several: each
        shard is the generation batch of a real data-parallel rank of TRL, a process of its
        own (`_train_in_ranks`); this trainer then holds rank 0's updated policy and optimizer
        state (every rank holds the same after DDP's all-reduce)."""
        if not shards:
            raise ValueError("train needs at least one shard")
        if len(shards) == 1:
            if self._watch is not None:
                self._watch["local_calls"] += 1
            with _seeded(self.step_seed()):
                reports = [self.rank_step(shards[0], world=1)]
        else:
            reports = self._train_in_ranks(list(shards))
        return self._results(reports)

    def rank_step(self, shard, world: int) -> dict:
        """One rank's part of a train call, as a TRL rank runs it: its generation batch (the
        shard) yielded by the loader stand-in as RepeatSampler repeats one (num_iterations x
        steps_per_generation), TRL's own rollout_func serving it, and
        `Trainer.train` taking every step. In a rank process (`world` > 1) TRL's accelerator
        is the real multi-process one: `accelerator.prepare` wraps the policy in
        DistributedDataParallel and every gather in `_generate_and_score_completions` is an
        all-gather over the ranks.

        Returns what the driver reads: Trainer's logs of each optimizer step (its loss, the
        mean over ranks, and grad norm), the per-token metrics of each `_compute_loss` call
        (`metrics` of the frames `_LossLocals` sees, in call order) and the
        `num_items_in_batch` of each call (TRL's loss-token count of the step, summed over the
        ranks by its gather)."""
        stage = _stage().TRAIN
        batch, rows, inputs = self._generation(_without_none(shard), stage)
        if not len(batch):
            raise ValueError("train needs at least one row")
        epochs = self.settings.loss.epochs
        m = micro_batch_size(len(batch), self.settings.micro_batch_size)
        n = len(batch) // m  # micro-steps of one optimizer step
        t, a = self.trainer, self.args
        # the generation batch's sizes, written into TRL's args as a TRL user configures them:
        # generation_batch_size counts every rank's rows, and the step's rows over every rank
        # are one group of num_generations (the driver grouped and scored them)
        a.per_device_train_batch_size = m
        a.steps_per_generation = a.gradient_accumulation_steps = n
        a.generation_batch_size = a.num_generations = t.num_generations = len(batch) * world
        a.max_steps = epochs
        # TRL's per-process state of a generation batch: its micro-step counter and buffer
        t._step, t._buffered_inputs = 0, None
        loader = [inputs] * (epochs * n)
        t.get_train_dataloader = lambda: loader
        del self.logs[:]
        seen = _LossLocals()
        try:
            with self.serving(rows), seen:
                t.train()
        finally:
            t.__dict__.pop("get_train_dataloader", None)
        logged = [entry for entry in self.logs if "grad_norm" in entry]
        if len(logged) != epochs or len(seen.calls) != epochs * n:
            raise RuntimeError(f"TRL ran {len(logged)} optimizer steps and {len(seen.calls)} "
                               f"loss computations for {epochs} x {n}")
        return {"logs": logged,
                "metrics": [{k: v.detach().cpu() for k, v in self.metrics(f).items()}
                            for f in seen.calls],
                "items": [float(f["inputs"]["num_items_in_batch"]) for f in seen.calls]}

    def _results(self, reports: list[dict]) -> Any:
        """The StepResult of each optimizer step from the ranks' reports (rank order): loss
        and grad norm as Trainer logs them (the same on every rank), the per-token metrics of
        every rank's micro-steps of the step, rank after rank, and TRL's loss-token count."""
        from rlconform.reference_impl.trainer import StepResult

        epochs = self.settings.loss.epochs
        results = []
        for k, entry in enumerate(reports[0]["logs"]):
            metrics: dict = {}
            for rep in reports:
                window = len(rep["metrics"]) // epochs
                for frame in rep["metrics"][k * window:(k + 1) * window]:
                    for name, v in frame.items():
                        metrics.setdefault(name, []).append(v)
            window = len(reports[0]["items"]) // epochs
            self.steps += 1
            results.append(StepResult(
                float(entry["loss"]), {name: torch_cat(v) for name, v in metrics.items()},
                float(entry["grad_norm"]),
                {"normalizer": reports[0]["items"][k * window], "step": self.steps}))
        first = results[0]
        if len(results) > 1:
            first.extra["optimizer_steps"] = results
        return first

    def _train_in_ranks(self, shards: list) -> list[dict]:
        """`len(shards)` real data-parallel ranks of TRL, one process each (see
        `_rank_process`): rank r trains on shards[r] from this trainer's weights, optimizer
        state and step counter; this trainer then loads rank 0's updated weights and optimizer
        state. Returns the ranks' reports, rank order.

        TRL's ranks each hold per_device_train_batch_size x steps_per_generation rows of the
        generation batch (GRPOConfig's generation_batch_size is that times num_processes):
        `_generate_and_score_completions` all-gathers every rank's rewards and keeps its own
        rows as `advantages[process_index * len(prompts):...]`, and accelerate's gather over
        gloo takes one shape from every rank, so shards of unequal sizes (an empty one too) are
        no TRL configuration. They are refused (ValueError naming the sizes), never padded.
        """
        import torch

        sizes = [len(s) for s in shards]
        if len(set(sizes)) > 1 or not sizes[0]:
            raise ValueError(
                f"TRL {TRL_VERSION} cannot train data-parallel shards of {sizes} rows: each "
                "rank of GRPOTrainer holds per_device_train_batch_size x steps_per_generation "
                "rows (GRPOConfig.generation_batch_size is that times num_processes); "
                "_generate_and_score_completions all-gathers the ranks' rewards (accelerate's "
                "gather needs one shape on every rank) and keeps rank r's rows as "
                "advantages[r * len(prompts):(r + 1) * len(prompts)]")
        if self.device.type != "cpu":
            raise ValueError(
                f"the TRL adapter's rank processes run on the CPU (gloo); the device is "
                f"{self.device}: {len(shards)} data-parallel shards need one process per GPU, "
                "which this adapter does not launch")
        job = {"settings": self.settings, "variant": self.variant, "saved": self.saved,
               "state": self.state_dict(), "optimizer": self.optimizer.state_dict(),
               "steps": self.steps, "threads": max(1, torch.get_num_threads() // len(shards)),
               "observers": list(_OBSERVERS),
               "watch": [] if self._watch is None else self._watch["factories"]}
        reports = _run_ranks(job, shards)
        self.model.load_state_dict(reports[0]["state"])
        self.optimizer.load_state_dict(reports[0]["optimizer"])
        if self._watch is not None:
            self._watch["ranked"].append(_joined([r["watched"] for r in reports]))
        self.last_ranks = [{k: v for k, v in r.items()
                            if k not in ("state", "optimizer", "watched")} for r in reports]
        for seen in _OBSERVED:
            seen.append([r["observed"] for r in reports])
        return reports

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
# Data-parallel ranks: one process each, TRL's own multi-process path (gloo on the CPU)
# ---------------------------------------------------------------------------------------------
# what the fork server imports once besides the reference ranks' preload, so a TRL rank starts
# in well under a second instead of importing transformers, accelerate and TRL (~5 s of CPU)
_RANK_PRELOAD = ("datasets", "accelerate", "trl.trainer.grpo_trainer",
                 "rlconform.conformance.backends.trl")
RANK_TIMEOUT_ENV = "RLCONFORM_TRL_RANK_TIMEOUT_S"
_RANK_TIMEOUT_S = 900.0  # a train call of every rank, start to report
_OBSERVERS: list = []  # context-manager factories each rank process enters (observed_in_ranks)
_OBSERVED: list[list] = []


@contextlib.contextmanager
def observed_in_ranks(*factories):
    """While the block runs, every rank process of a multi-rank train call enters each
    `factory()` (a picklable callable returning a context manager: a module-level function, or
    functools.partial of one) around building its trainer and its step, and reports what each
    one's `__enter__` returned, after the block. Yields a list that gains, per train call, one
    entry per rank (rank order): the list of those values. The adapter's tests count the
    DATA_PATH functions each rank process enters this way (tests/_data_path.counting_calls)."""
    seen: list = []
    _OBSERVERS.extend(factories)
    _OBSERVED.append(seen)
    try:
        yield seen
    finally:
        del _OBSERVERS[len(_OBSERVERS) - len(factories):]
        _OBSERVED.remove(seen)


def _rank_context():
    """The multiprocessing context the ranks start from: the rank launcher of
    reference_impl/ranks.py (a fork server that has imported torch, transformers' models and,
    added here, TRL: each rank is forked from it, started in ~0.2 s; or fresh interpreters
    under RLCONFORM_RANK_START=exec)."""
    from rlconform.reference_impl.ranks import process_context

    return process_context(_RANK_PRELOAD)


def _log_tail(log: str, n: int = 20) -> str:
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()[-n:]
    except OSError:
        return ""
    return "\n".join(lines)


def _run_ranks(job: dict, shards: list) -> list[dict]:
    """Start one process per shard (`_rank_process`), hand rank r `job` and shards[r], and
    return the ranks' reports (rank order). Any rank that raises, dies or stays silent past the
    timeout (RLCONFORM_TRL_RANK_TIMEOUT_S, default 900 s) fails the call with a RuntimeError
    naming it (its traceback or exit, its log's tail); every rank process is reaped before
    this returns or raises (terminated, then killed, by its own handle)."""
    import os
    import time
    from multiprocessing.connection import wait

    from rlconform.conformance.backends._procs import free_port

    ctx = _rank_context()
    world = len(shards)
    timeout = float(os.environ.get(RANK_TIMEOUT_ENV, _RANK_TIMEOUT_S))
    port = free_port()
    procs, conns, logs = [], [], []
    replies: dict[int, dict] = {}

    def failed(r: int, how: str) -> RuntimeError:
        tail = _log_tail(logs[r])
        return RuntimeError(f"TRL data-parallel rank {r} of {world} (pid {procs[r].pid}) "
                            f"{how}" + (f"\n--- its log's tail ---\n{tail}" if tail else ""))

    try:
        for r in range(world):
            fd, log = tempfile.mkstemp(prefix=f"rlconform-trl-rank{r}-", suffix=".log")
            os.close(fd)
            logs.append(log)
            here, there = ctx.Pipe()
            p = ctx.Process(target=_rank_process, args=(there, r, world, port, log),
                            name=f"rlconform-trl-rank{r}", daemon=True)
            p.start()
            there.close()
            procs.append(p)
            conns.append(here)
        for r, conn in enumerate(conns):
            try:
                conn.send_bytes(pickle.dumps({**job, "shard": shards[r]},
                                             protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:
                procs[r].join(5)
                raise failed(r, f"ended ({procs[r].exitcode}) before taking its job") from None
        deadline = time.monotonic() + timeout
        while len(replies) < world:
            pending = {conns[r]: r for r in range(world) if r not in replies}
            for conn in wait(list(pending), timeout=0.5):
                r = pending[conn]
                try:
                    kind, body = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    procs[r].join(5)
                    raise failed(r, f"ended ({procs[r].exitcode}) without a report") from None
                if kind == "error":
                    raise failed(r, f"raised:\n{body}")
                replies[r] = body
            if time.monotonic() > deadline:
                silent = min(r for r in range(world) if r not in replies)
                raise failed(silent, f"did not report within {timeout:g}s "
                                     f"({RANK_TIMEOUT_ENV})")
        return [replies[r] for r in range(world)]
    finally:
        done = len(replies) == world
        for p in procs:
            p.join(30 if done else 0)  # a rank that reported exits by itself
            if p.exitcode is None:
                p.terminate()
                p.join(5)
            if p.exitcode is None:
                p.kill()
                p.join(5)
        for conn in conns:
            conn.close()
        for log in logs:
            with contextlib.suppress(OSError):
                os.unlink(log)


def _rank_process(conn, rank: int, world: int, port: int, log: str) -> None:
    """A data-parallel rank of TRL (started by `_run_ranks`): torch.distributed's env
    rendezvous (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR / MASTER_PORT on loopback), so the
    Accelerator GRPOTrainer builds is accelerate's multi-process CPU state (gloo); output to
    its log; SIGKILL with its parent. Receives its job, replies ("ok", report) or
    ("error", traceback)."""
    import os
    import traceback

    from rlconform.reference_impl.ranks import die_with_parent

    out = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    die_with_parent()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        reply = ("ok", _rank_job(rank, world, pickle.loads(conn.recv_bytes())))
        data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:  # noqa: BLE001 - every failure goes to the driver, named
        data = pickle.dumps(("error", traceback.format_exc()))
    try:
        conn.send_bytes(data)
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()


def _rank_job(rank: int, world: int, job: dict) -> dict:
    """Rank `rank`'s train call: a TRLCore built as the driver's (its settings, variant and
    saved initial policy), at the driver's weights, optimizer state and step counter, seeded
    as accelerate seeds a rank (`set_seed(seed, device_specific=True)`: the call's seed plus
    the process index, so rank 0 draws as the driver's own process does), then the single-rank
    path (`TRLCore.rank_step`) on its shard. Rank 0 also returns its updated weights and
    optimizer state (DDP leaves every rank with the same)."""
    import os

    import torch
    import torch.distributed as dist
    from accelerate.utils import set_seed

    torch.set_num_threads(job["threads"])
    try:
        with contextlib.ExitStack() as stack:
            observed = [stack.enter_context(f()) for f in job["observers"]]
            core = TRLCore(job["settings"], job["variant"], saved=job["saved"])
            core.model.load_state_dict(job["state"])
            core.optimizer.load_state_dict(job["optimizer"])
            core.steps = job["steps"]
            set_seed(core.step_seed(), device_specific=True)
            watchers = [f(core.model) for f in job["watch"]]  # the unwrapped policy
            try:
                with _reading_after_backward(core.trainer.accelerator, watchers):
                    report = core.rank_step(job["shard"], world)
            finally:
                watched = [(getattr(w, "across_ranks", "same"), w.remove()) for w in watchers]
        t = core.trainer
        report.update(rank=rank, pid=os.getpid(), observed=observed, watched=watched,
                      num_processes=t.accelerator.num_processes,
                      process_index=t.accelerator.process_index,
                      wrapped=type(t.model_wrapped).__module__ + "."
                      + type(t.model_wrapped).__qualname__)
        if rank == 0:
            report["state"] = core.state_dict()
            report["optimizer"] = core.optimizer.state_dict()
        return report
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _reading_after_backward(accelerator, watchers):
    """A rank's watchers that read gradients (`after_backward`) read them again each time
    `accelerator.backward` returns. DDP's reducer all-reduces a synchronising backward's
    gradients in a callback the autograd engine runs at that backward's end, after the
    parameters' accumulate hooks fired (those saw the rank's own gradient), and `backward`
    returns only once it has finished: read there, a parameter's gradient is the reduced one,
    before Trainer clips it. That is exact; the optimizer pre-step hook would see the clipped
    gradient, and dividing a float32 gradient by the clip coefficient does not give back the
    unclipped one bitwise. (A backward under no_sync leaves the rank's own accumulation: the
    step's last backward synchronises and is read last.)"""
    readers = [w.after_backward for w in watchers if hasattr(w, "after_backward")]
    own = accelerator.backward

    def backward(loss, **kwargs):
        out = own(loss, **kwargs)
        for read in readers:
            read()
        return out

    accelerator.backward = backward
    try:
        yield
    finally:
        del accelerator.backward  # the class's method again


def _joined(watched: list[list[tuple[str, Any]]]) -> list:
    """One record per watcher from every rank's (rank order) of one train call, as each
    watcher declares (`across_ranks`): "same" records (the reduced gradient, the optimizer
    steps) must agree bitwise on every rank, and rank 0's is handed on; "rows" records (per
    forward) are the ranks' lists, rank after rank: the order of the shards' rows in the
    step's batch."""
    out = []
    for i, per_rank in enumerate(zip(*watched)):
        rules = {rule for rule, _ in per_rank}
        records = [record for _, record in per_rank]
        if rules == {"rows"}:
            out.append([x for record in records for x in record])
            continue
        if rules != {"same"}:
            raise ValueError(f"watcher {i} declares across_ranks {sorted(rules)}: 'same' or "
                             "'rows'")
        for r, record in enumerate(records[1:], 1):
            where = _differs(records[0], record)
            if where is not None:
                raise RuntimeError(f"watcher {i}: rank {r}'s record differs from rank 0's at "
                                   f"{where} (every data-parallel rank must hold the same)")
        out.append(records[0])
    return out


def _differs(a, b, at: str = "the record") -> str | None:
    """Where two records differ, or None: tensors bitwise (dtype, shape, values), dicts,
    sequences and dataclasses member by member, anything else by ==."""
    import dataclasses

    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
            and a.dtype == b.dtype and torch.equal(a, b)
        return None if same else at
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{at} (keys)"
        return next((d for k in a if (d := _differs(a[k], b[k], f"{at}[{k!r}]"))), None)
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return f"{at} (length {len(a)} vs {len(b)})"
        return next((d for k, (x, y) in enumerate(zip(a, b))
                     if (d := _differs(x, y, f"{at}[{k}]"))), None)
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return _differs(vars(a), vars(b), at)
    return None if a == b else at


def _watched(own: list, seen: dict) -> list:
    """A `watch` block's records: this process's watchers' where no train call of several
    shards ran in the block, else that call's joined rank records (its driver's watchers saw
    only the weights it loaded back)."""
    ranked, local = seen["ranked"], seen["local_calls"]
    if not ranked:
        return own
    if len(ranked) > 1 or local:
        raise RuntimeError(f"a watch block held {len(ranked) + local} train calls, "
                           f"{len(ranked)} of them in rank processes: the ranks' records join "
                           "per call, so a block may hold one such call and no other")
    return ranked[0]


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

    def watch(self, factories):
        return self.core.watch(factories)


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
        from rlconform.reference_impl.prompts import FIELD as PROMPT_FIELD
        from rlconform.reference_impl.registry import stage_fields

        wanted = stage_fields(stage)  # the reference's rule, object fields' wire columns too
        # and each row's prompt and images, which TRL renders and processes itself
        wanted = (*wanted, PROMPT_FIELD)
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
    trainer.reads_prompts = True  # TRL renders and processes each row's prompt itself

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
