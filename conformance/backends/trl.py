"""TRL 1.16.0's `GRPOTrainer` as an rlconform trainer backend (two configurations).

The passes run TRL's own code. What the adapter builds itself, and why no TRL function does it:

| rlconform need | TRL 1.16.0 (`trl.trainer`) |
|---|---|
| the GRPO options of a point | `trl_options`: each rlconform LossConfig field to its `GRPOConfig` option (table in docs/grpo-configurations.md); a point TRL has no option for raises NotImplementedError with the reason, and the clauses report it not applicable |
| the generation batch (prompt / completion ids and masks, media, `num_images`, advantages, old / reference / engine logprobs, `num_items_in_batch`) | built by the adapter (`trl_inputs`): TRL builds it only inside `_generate_and_score_completions`, from raw prompts and images, completions it generates itself (or a `rollout_func` returns), and advantages from its own reward functions; the trainer surface receives processed rows that another engine generated and another driver scored, and no TRL function accepts those |
| prev / reference logprobs | `GRPOTrainer._get_per_token_logps_and_entropies(model or ref_model, ..., batch_size=per_device_train_batch_size)` under `torch.no_grad()` and `disable_gradient_checkpointing`, exactly as `_generate_and_score_completions` calls it (the data plane splits that function's two passes out); a pass runs only when TRL's own condition says so (`runs_pass`, the same condition: old logprobs when `gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0` or vLLM IS correction; reference when `beta != 0`), else it returns `None` (in memory) or the meta unchanged (data plane) |
| the train step | `GRPOTrainer.training_step` per micro-batch (HF `Trainer.training_step`: `_prepare_inputs`, whose split_pixel_values_by_grid / shuffle_sequence_dict / split_tensor_dict / unsplit build and buffer the micro-batches and reuse them over `num_iterations`; `compute_loss` -> `_compute_loss`; `accelerator.backward`), with the adapter's generation batch standing in for `_generate_and_score_completions`' result (`_Watch`); then, as `Trainer._inner_training_loop` does at the end of an accumulation window (no public function), `accelerator.clip_grad_norm_` and the optimizer of `Trainer.create_optimizer` |
| per-token probs_ratio, clamped ratio, KL, entropy | TRL logs batch means only: `_Watch` wraps `_get_per_token_logps_and_entropies` to keep the per-token logprobs and entropies `_compute_loss` used, and reads back its `coef_1` (token or sequence level), `coef_2` and KL estimate from them and the micro-batch's old / reference logprobs; the loss itself is TRL's |

TRL's batch layout is `prompt_ids | completion_ids` with `logits_to_keep = completion length`.
rlconform's batches are right padded, prompt lengths differ per row, and the logprob fetch does
not carry them, so the adapter gives TRL the whole sequence after the first token as the
"completion" (`logits_to_keep = S - 1`, `completion_mask` = attention) and the loss tokens as
TRL's `tool_mask` (the completion tokens `_compute_loss` masks in: `completion_mask *
tool_mask`). The engine's logprobs travel as TRL's `sampling_per_token_logps` (read by the loss
only with vLLM). A generation batch is the shard padded to its own longest row (TRL pads a
generation batch to its longest); micro-batches keep that width.

Data-parallel shards run in one process, one emulated rank each: its own buffer and micro-step
counter of `_prepare_inputs` (`_buffered_inputs`, `_step`), `num_items_in_batch` divided by the
world size (a rank's dapo normaliser is the global count over `num_processes`, which is 1 here)
and each rank's backward scaled by 1 / world (DDP's gradient mean).

Configuration: `settings` map onto `GRPOConfig` (`micro_batch_size` ->
per_device_train_batch_size, `lr`, `seed`, `settings.loss` through `trl_options`; `dtype`
bfloat16 -> `bf16=True`, float32 -> `bf16=False`, since TRL's default `bf16=True` autocasts an
fp32 model to bf16); one `train` is every optimizer step of a generation batch (the point's
epochs = `num_iterations`) of `per_device_train_batch_size x steps_per_generation` rows
(`gradient_accumulation_steps = steps_per_generation`). TRL needs the generation batch to be a
multiple of the micro-batch size; where it is not, the micro-batch size is the largest divisor
of the shard's rows that is <= `micro_batch_size`. TRL's `shuffle_sequence_dict` draws from the
global RNG; the adapter seeds it per (step, shard) from `seed` inside a forked RNG, so both
trainer paths shuffle alike. Settings TRL has no counterpart for (`max_seq_len`,
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
import math
import random
import tempfile
from dataclasses import dataclass
from typing import Any

from rlconform.conformance.backend import Backend, PathStep, package_version

_GRPO = "trl.trainer.grpo_trainer.GRPOTrainer"
# TRL's path from the generation batch to the optimizer step, as this adapter takes it (read
# from the code below; docs/backends.md renders it)
DATA_PATH = (
    PathStep(f"{_GRPO}._generate_and_score_completions", "rebuilt",
             "the adapter builds the generation batch itself (trl_inputs) and `_Watch` replaces "
             "this method: TRL builds the batch only from raw prompts it generates for", "trainer"),
    PathStep(f"{_GRPO}._get_per_token_logps_and_entropies", "entered", surface="trainer"),
    PathStep(f"{_GRPO}.training_step", "entered", surface="trainer"),
    PathStep(f"{_GRPO}._prepare_inputs", "entered", surface="trainer"),
    PathStep("trl.trainer.utils.split_tensor_dict", "entered", surface="trainer"),
    PathStep("trl.trainer.utils.shuffle_sequence_dict", "entered", surface="trainer"),
    PathStep("trl.trainer.utils.split_pixel_values_by_grid", "entered", surface="trainer"),
    PathStep(f"{_GRPO}._compute_loss", "entered", surface="trainer"),
    PathStep("transformers.Trainer.create_optimizer", "entered", surface="trainer"),
    PathStep("accelerate.Accelerator.clip_grad_norm_", "entered", surface="trainer"),
    PathStep("transformers.Trainer._inner_training_loop", "rebuilt",
             "the adapter calls clip_grad_norm_ and the optimizer step at the end of an "
             "accumulation window itself, as this loop does (no public function)", "trainer"),
    PathStep("accelerate.Accelerator.prepare", "rebuilt",
             "data-parallel ranks are emulated in one process (a buffer and step counter per "
             "rank, the backward scaled by 1/world), not run as accelerate ranks", "trainer"),
)

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
        missing.append("truncated importance sampling: TRL applies it only to vLLM generations "
                       "(use_vllm=True with vllm_importance_sampling_correction, "
                       "_generate_and_score_completions); its generation path without vLLM "
                       "has no engine logprobs to correct by, and vLLM is not installed here")
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
# TRL's generation batch <-> rlconform batches
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


def trl_inputs(batch, stage, dtype, family) -> dict[str, Any]:
    """TRL's generation-batch dict for `batch` (see the module docstring for the layout)."""
    ids, attn = batch["input_ids"], batch["attention_mask"]
    out: dict[str, Any] = {"prompt_ids": ids[:, :1], "prompt_mask": attn[:, :1],
                           "completion_ids": ids[:, 1:], "completion_mask": attn[:, 1:]}
    out.update(batch.multimodal_inputs(stage, dtype))
    n = _num_images(batch, family)
    if n is not None:
        out["num_images"] = n
    if stage is _stage().TRAIN:
        out["tool_mask"] = batch["token_mask"][:, 1:].to(attn.dtype)
        out["advantages"] = batch["advantages"].float()
        for name, key in (("prev_logprobs", "old_per_token_logps"),
                          ("reference_logprobs", "ref_per_token_logps"),
                          ("generation_logprobs", "sampling_per_token_logps")):
            if name in batch.fields:
                out[key] = batch[name][:, 1:].float()
    return out


_FORWARD_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes",
                 "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


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
# The trainer core: one GRPOTrainer, its passes
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


class TRLCore:
    """A `GRPOTrainer` around a tiny fixture family, with rlconform's three passes."""

    def __init__(self, settings, variant: Variant, model=None):
        import torch

        for name, why in SETTINGS_UNSUPPORTED.items():
            if getattr(settings, name, None) is not None:
                raise ValueError(f"TrainerSettings.{name} = {getattr(settings, name)!r} has no "
                                 f"TRL counterpart: {why}")
        from datasets import Dataset
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
            logging_strategy="no", disable_tqdm=True, use_cpu=self.device.type == "cpu",
            bf16=settings.dtype == torch.bfloat16, seed=settings.seed,
            learning_rate=settings.lr, weight_decay=0.0, lr_scheduler_type="constant",
            **self.options,
            # placeholders valid for any micro-batch size (the generation batch must hold
            # whole groups of num_generations); each pass sets the numbers of its batch
            per_device_train_batch_size=m, steps_per_generation=2,
            gradient_accumulation_steps=2, num_generations=2)
        processing = self.family.processor or self.family.tokenizer
        with _quiet_global_rng():
            self.trainer = GRPOTrainer(
                model=policy, reward_funcs=_no_reward, args=self.args,
                train_dataset=Dataset.from_dict({"prompt": ["rlconform"] * 2}),
                processing_class=processing)
        t = self.trainer
        t.model.to(self.device)
        if t.ref_model is not None:
            t.ref_model.to(self.device)
        if self.args.gradient_checkpointing:  # as Trainer._inner_training_loop does
            t.model.gradient_checkpointing_enable(self.args.gradient_checkpointing_kwargs)
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

    # -- TRL's numbers for a batch ----------------------------------------------------------
    def _configure(self, rows: int) -> tuple[int, int]:
        """Micro-batch size and count of a generation batch of `rows`, written into TRL's
        args and the trainer's accumulation state the way a TRL user would configure them."""
        m = micro_batch_size(rows, self.settings.micro_batch_size)
        n = max(1, rows // m)
        self.args.per_device_train_batch_size = m
        self.args.steps_per_generation = n
        self.args.gradient_accumulation_steps = n
        self.trainer.current_gradient_accumulation_steps = n
        return m, n

    def runs_pass(self, stage, rows: int) -> bool:
        """Whether TRL runs this pass (`_generate_and_score_completions`'s conditions)."""
        t, a = self.trainer, self.args
        if stage is _stage().REFERENCE_LOGPROB:
            return t.beta != 0.0
        self._configure(rows)
        return (a.gradient_accumulation_steps % (a.steps_per_generation * t.num_iterations) != 0
                or (t.use_vllm and t.vllm_importance_sampling_correction))

    @staticmethod
    def generation_batch(batch):
        """The shard as TRL pads a generation batch: to its own longest row."""
        longest = int(batch.seq_lens.max()) if len(batch) else 0
        return batch.truncate(longest) if batch.seq_len() > longest else batch

    def logprobs(self, batch, stage):
        """`[B, S]` float32 logprobs (0 at position 0 and at pads) from TRL's function, or None
        when TRL does not run this pass in this configuration."""
        import torch
        from trl.models.utils import disable_gradient_checkpointing

        if not self.runs_pass(stage, len(batch)):
            return None
        gen = self.generation_batch(batch)
        m, _ = self._configure(len(gen))
        inputs = trl_inputs(gen, stage, self.settings.dtype, self.family)
        t = self.trainer
        model = t.ref_model if stage is _stage().REFERENCE_LOGPROB else t.model
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        kw = {k: v.to(self.device) for k, v in inputs.items() if k in _FORWARD_KEYS}
        t.model.train()  # HF's training_step puts the policy in train mode before TRL's passes
        with torch.no_grad(), disable_gradient_checkpointing(
                t.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = t._get_per_token_logps_and_entropies(
                model, ids.to(self.device), attn.to(self.device), ids.shape[1] - 1,
                batch_size=m, num_images=inputs.get("num_images"), **kw)
        out = torch.zeros(len(batch), batch.seq_len(), dtype=torch.float32)
        out[:, 1:ids.shape[1]] = logps.float().cpu()
        return out

    def step_seed(self, shard_index: int) -> int:
        return (self.settings.seed * 1_000_003 + self.steps) * 1_009 + shard_index

    def train(self, shards):
        """Every optimizer step of one generation batch (the point's epochs: TRL's
        num_iterations) over every shard, through TRL's own step (see the module docstring)."""
        import torch

        from rlconform.reference_impl.trainer import StepResult

        t = self.trainer
        shards = [self.generation_batch(_without_none(b)) for b in shards]
        world = len(shards)
        stage = _stage().TRAIN
        gens = [trl_inputs(b, stage, self.settings.dtype, self.family) for b in shards]
        # TRL: num_items_in_batch = gather(loss_mask.sum()).sum() over every rank, and dapo
        # divides each rank's loss by it / num_processes; here num_processes is 1, so each
        # emulated rank gets the share a real rank divides by
        items = sum((g["completion_mask"] * g["tool_mask"]).sum() for g in gens)
        for r, gen in enumerate(gens):
            # TRL's generation batch holds old / reference logprobs only where TRL computes them
            if not self.runs_pass(_stage().LOGPROB, len(shards[r])):
                gen.pop("old_per_token_logps", None)
            if not self.runs_pass(_stage().REFERENCE_LOGPROB, len(shards[r])):
                gen.pop("ref_per_token_logps", None)
            gen["num_items_in_batch"] = torch.as_tensor(items) / world
        t.model.train()
        buffers: list = [None] * world
        results = []
        for iteration in range(self.settings.loss.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            total, metrics = 0.0, {}
            for r, gen in enumerate(gens):
                _, n = self._configure(len(shards[r]))
                # the per-process state of a generation batch that _prepare_inputs keeps (its
                # buffer of micro-batches and the micro-step counter), one per emulated rank:
                # iteration 0 splits and shuffles the batch, later ones reuse the buffer
                t._buffered_inputs, t._step = buffers[r], iteration * n
                with _Watch(t) as seen, _ddp_mean(t.model, world):
                    for micro in range(n):
                        with _seeded(self.step_seed(r)) if micro == 0 and iteration == 0 \
                                else contextlib.nullcontext():
                            loss = t.training_step(t.model, gen, None)
                        total += float(loss) / world
                buffers[r] = t._buffered_inputs
                for mb, logp, entropy in seen.calls:
                    for k, v in self.metrics(mb, logp, entropy).items():
                        metrics.setdefault(k, []).append(v.cpu())
            cfg = self.settings.loss
            params = [p for p in t.model.parameters() if p.grad is not None]
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
            # as Trainer._inner_training_loop does at the end of an accumulation window
            grad_norm = t.accelerator.clip_grad_norm_(params, max_norm) if params \
                else torch.zeros(())
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.steps += 1
            results.append(StepResult(total, {k: torch.cat(v) for k, v in metrics.items()},
                                      float(grad_norm), {"normalizer": float(items),
                                                         "step": self.steps}))
        first = results[0]
        if len(results) > 1:
            first.extra["optimizer_steps"] = results
        return first

    def metrics(self, mb: dict, logp, entropy):
        """What `_compute_loss` computed from TRL's own per-token logprobs, read back per token
        over the loss tokens (TRL logs only batch means): its importance ratio coef_1 (token or
        sequence level, before `delta`), the clamped coef_2, the KL estimate, the entropies."""
        import torch

        from rlconform.reference_impl.loss import generation_metrics, masked

        t = self.trainer
        mask = mb["completion_mask"] * mb["tool_mask"]
        old = mb.get("old_per_token_logps")
        old = logp.detach() if old is None else old
        log_ratio = logp - old
        if t.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
        coef_1 = torch.exp(log_ratio).expand_as(logp)
        coef_2 = torch.clamp(coef_1, 1 - t.epsilon_low, 1 + t.epsilon_high)
        out = {"probs_ratio": masked(coef_1, mask), "probs_ratio_clamped": masked(coef_2, mask),
               "clipped": masked((coef_1 != coef_2).float(), mask)}
        if t.beta != 0.0:
            ref = mb["ref_per_token_logps"]
            out["reference_kl"] = masked(torch.exp(ref - logp) - (ref - logp) - 1, mask)
        if entropy is not None and t.entropy_coef:
            out["entropy"] = masked(entropy, mask)
        gen = mb.get("sampling_per_token_logps")
        if gen is not None:
            out.update(generation_metrics(gen, old.detach(), mask))
        return out


class _Watch:
    """Stands in for `_generate_and_score_completions` and watches `compute_loss`.

    The generation batch reaches TRL's `_prepare_inputs` already generated and scored: no TRL
    function takes a batch that another engine generated and another driver scored (TRL builds
    it only inside `_generate_and_score_completions`, from raw prompts and images, its own or a
    `rollout_func`'s completions and its own rewards), so the stand-in returns the adapter's
    batch as that function's result; everything after it is TRL's own code. `calls` keeps, per
    micro-batch, what `compute_loss` received and the per-token logprobs and entropies its
    `_get_per_token_logps_and_entropies` returned."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.calls: list[tuple] = []

    def __enter__(self):
        t = self.trainer
        logps = type(t)._get_per_token_logps_and_entropies.__get__(t)
        compute_loss = type(t).compute_loss.__get__(t)
        current: dict = {}

        def scored(*args, **kwargs):
            out = logps(*args, **kwargs)
            current["logps"] = out
            return out

        def loss(model, inputs, *args, **kwargs):
            current.clear()
            value = compute_loss(model, inputs, *args, **kwargs)
            logp, entropy, _ = current["logps"]
            self.calls.append((inputs, logp.detach(), None if entropy is None
                               else entropy.detach()))
            return value

        t._generate_and_score_completions = lambda generation_batch: generation_batch
        t._get_per_token_logps_and_entropies = scored
        t.compute_loss = loss
        return self

    def __exit__(self, *exc):
        for name in ("_generate_and_score_completions", "_get_per_token_logps_and_entropies",
                     "compute_loss"):
            self.trainer.__dict__.pop(name, None)
        return False


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
    """TRL's shuffle_sequence_dict draws from the global torch RNG: seed it for the call that
    shuffles, inside a forked RNG (both trainer paths then shuffle alike)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _no_reward(prompts=None, completions=None, **kwargs):
    """GRPOTrainer needs a reward function; rlconform's steps bring their own advantages."""
    return [0.0] * len(completions or prompts or [])


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
        from rlconform.reference_impl.codec import WireBatch, column_field
        from rlconform.reference_impl.registry import stage_fields

        wanted = stage_fields(stage)  # the reference's rule, object fields' wire columns too
        fields = [f for f in wanted if f in meta.fields] + [
            c for c in meta.fields if column_field(c) != c and column_field(c) in wanted]
        cols, tags = self.transport.get(meta.partition, meta.keys, select_fields=fields)
        return self.codec.decode(WireBatch(cols, tags))

    def compute_logprobs(self, meta, stage):
        if not self.core.runs_pass(stage, len(meta.keys)):
            return meta  # TRL does not run this pass in this configuration
        from rlconform.reference_impl.batch import Batch

        name = _OUTPUT[stage.value]
        batch = self.fetch(meta, stage)
        values = self.core.logprobs(batch, stage)
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
    )


def backend() -> Backend:
    return _backend("trl")


def independent_backend() -> Backend:
    return _backend("trl-independent-passes")
