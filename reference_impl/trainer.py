"""The reference GRPO trainer: one algorithm (`GRPOCore`), two ways to feed it.

- `LegacyTrainer`: the batch lives in driver memory;
- `DataPlaneTrainer`: the driver holds a `BatchMeta`; every stage fetches exactly the fields it
  consumes through the transport (the multimodal ones chosen by the field registry, never by a
  static list), decodes them with the codec and writes its output back as a new column.

Both feed the same `GRPOCore` with the same micro-batches (members, order and padding are a pure
function of the sequence lengths and the settings), so for the same batch they are bitwise
identical: loss, per-token metrics, grad norm and updated weights (BACKGROUND.md section 7:
same micro-batch => bitwise logprobs on CPU). `prev_logprobs` always come from an independent
forward pass (`logprobs(..., Stage.LOGPROB)`), never from `logp.detach()` inside the train
pass, so probs_ratio == 1 is earned (BACKGROUND.md section 5).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .batch import Batch
from .codec import WireBatch, column_field
from .loss import OBJECTIVE, LossConfig, LossOutput, StepNorm, grpo_loss
from .registry import FAMILIES, Stage, stage_fields
from .rollout import registry_family

OUTPUT_FIELD = {Stage.LOGPROB: "prev_logprobs", Stage.REFERENCE_LOGPROB: "reference_logprobs"}


@dataclass
class TrainerSettings:
    """`family` is a fixtures.families name. `max_tokens_per_micro_batch` switches to dynamic
    micro-batching (consecutive rows while rows x longest <= budget); `max_seq_len` truncates
    per-token fields before every forward (packed media are never touched). `loss` is the point
    of the GRPO objective family (clipping, KL, aggregation, importance correction, entropy
    bonus, optimizer steps per batch, gradient clipping: reference_impl/loss.py)."""

    family: str
    micro_batch_size: int = 2
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    lr: float = 1e-2
    max_tokens_per_micro_batch: int | None = None
    max_seq_len: int | None = None
    loss: LossConfig = LossConfig()

    def __post_init__(self) -> None:
        if not isinstance(self.loss, LossConfig):
            raise TypeError(f"TrainerSettings.loss must be a LossConfig, got "
                            f"{type(self.loss).__name__}")


@dataclass
class StepResult:
    """`metrics`: per-token values over the loss tokens of the step (1-D, float32), in the
    order rank -> micro-batch -> row -> token. The clauses read `probs_ratio`,
    `probs_ratio_clamped`, `clipped`, `loss_per_token` (each token's term of the loss before
    aggregation), `reference_kl` (with a reference), `entropy` (with an entropy bonus) and, when
    the batch holds generation logprobs, `token_mult_prob_error` and the other generation
    metrics (`loss.generation_metrics`); a clause that needs one the trainer does not report
    fails naming it. When the batch takes several optimizer steps
    (`LossConfig.mini_batches` / `epochs`), `loss`, `metrics` and `grad_norm` are those of the
    first, and `extra["optimizer_steps"]` holds one StepResult per optimizer step, in order."""

    loss: float
    metrics: dict[str, Tensor]
    grad_norm: float
    extra: dict = field(default_factory=dict)


def micro_batch_rows(seq_lens: Sequence[int], settings: TrainerSettings) -> list[list[int]]:
    """Row indices of each micro-batch: a function of the lengths only, so every stage and both
    paths split a shard the same way (the regime in which ratio == 1 is bitwise)."""
    lens = [min(int(n), settings.max_seq_len) if settings.max_seq_len else int(n)
            for n in seq_lens]
    budget = settings.max_tokens_per_micro_batch
    if budget is None:
        m = settings.micro_batch_size
        if m <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {m}")
        return [list(range(i, min(i + m, len(lens)))) for i in range(0, len(lens), m)]
    out: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(lens):
        if cur and (len(cur) + 1) * max(longest, n) > budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


def mini_batch_rows(n: int, mini_batches: int) -> list[list[int]]:
    """Row positions of each mini-batch (one optimizer step each) of a shard of `n` rows:
    `mini_batches` consecutive parts, part k holding rows [k n / M, (k + 1) n / M) (a part may
    be empty when n < M; the step then runs on the other ranks' rows)."""
    m = mini_batches
    return [list(range(k * n // m, (k + 1) * n // m)) for k in range(m)]


def _deterministic_cuda() -> None:
    """Bitwise parity on CUDA needs deterministic kernels (embedding and conv backward)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def fused_attention(model: torch.nn.Module) -> bool:
    """Whether any part of `model` runs a fused attention kernel (SDPA, flash) rather than
    eager attention (production Gemma3's vision tower: `Family.attention`)."""
    impls = {getattr(m.config, "_attn_implementation", None)
             for m in model.modules() if hasattr(m, "config")}
    return bool(impls - {None, "eager"})


def fused_attention_modules(model: torch.nn.Module) -> set[str]:
    """The top-level modules (`model.vision_tower`: the first two parts of a weight's name)
    holding an attention layer that runs a fused kernel, read from each attention layer's own
    config: where a model mixes eager and fused attention, only these modules have a
    non-reproducible backward."""
    out = set()
    for name, m in model.named_modules():
        impl = getattr(getattr(m, "config", None), "_attn_implementation", None)
        if type(m).__name__.endswith("Attention") and impl not in (None, "eager"):
            out.add(".".join(name.split(".")[:2]))
    return out


@contextlib.contextmanager
def strict_determinism():
    """PyTorch's strict deterministic mode for the duration (warn_only=False). Fused
    attention's backward picks its deterministic kernel only there: with warn_only=True,
    PyTorch's `_flash_attention_backward` / `_efficient_attention_backward`
    (aten/src/ATen/native/transformers/cuda/attention_backward.cu) warn and accumulate dQ
    with atomics. Scoped to the backward of models with fused attention: strict mode raises on
    any op without a deterministic kernel, and the eager models are bitwise without it.
    Measured (nightly, 2026-12-03, H200): it raised nothing, yet the data-plane and legacy
    steps still update Gemma3-4B's SDPA SigLIP tower differently (0.011-0.013 of its update),
    with or without it; TRAIN-LEGACY-PARITY states that regime."""
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    enabled = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


class GRPOCore:
    """Model, frozen reference copy, optimizer, and the forward / loss of one GRPO step."""

    objective = OBJECTIVE  # the objective's parts (a mutant replaces one)

    def __init__(self, settings: TrainerSettings, model: torch.nn.Module | None = None):
        self.settings = settings
        self.device = torch.device(settings.device)
        if self.device.type == "cuda":
            _deterministic_cuda()
        self.registry_name = registry_family(settings.family)
        # Qwen-VL computes 3-D M-RoPE positions from mm_token_type_ids and the grids; every
        # other family gets explicit 1-D positions (right padding: arange is exact)
        self.model_positions = "mm_token_type_ids" in FAMILIES[self.registry_name].fields
        if model is None:
            from rlconform.fixtures.families import build_family

            model = build_family(settings.family).build_model(
                seed=settings.seed, dtype=settings.dtype, device=self.device)
        self.model = model.to(self.device)
        self.model.eval()  # dropout 0 either way; eval keeps every pass on one code path
        self.reference_model = self._frozen_copy(self.model)
        self._strict_backward = self.device.type == "cuda" and fused_attention(self.model)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=settings.lr,
            weight_decay=0.0)
        self.steps = 0
        self.batch_step = 0  # the optimizer step's index within its generation batch

    @staticmethod
    def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
        """A copy of the initial weights, frozen by construction: it is in no optimizer and
        only ever runs under no_grad. Its parameters keep the policy's `requires_grad`: on CUDA
        some kernels are picked by that flag (Gemma3 fp32 logprobs moved by 9.5e-7 on an H200),
        and the step-0 identity reference == prev must be bitwise."""
        ref = copy.deepcopy(model)
        ref.eval()
        return ref

    # -- inputs -------------------------------------------------------------------------
    def prepare(self, batch: Batch) -> Batch:
        """Sequence truncation (registry-driven: per-token fields only)."""
        n = self.settings.max_seq_len
        return batch.truncate(n) if n is not None and batch.seq_len() > n else batch

    def micro_batches(self, batch: Batch) -> list[tuple[list[int], Batch]]:
        out = []
        for rows in micro_batch_rows(batch.seq_lens.tolist(), self.settings):
            mb = self.select_micro_batch(batch, rows)
            out.append((rows, mb.truncate(int(mb.seq_lens.max()))))  # trim to its own longest
        return out

    def select_micro_batch(self, batch: Batch, rows: list[int]) -> Batch:
        return batch.select(rows)

    def model_inputs(self, mb: Batch, stage: Stage) -> dict[str, Tensor]:
        dev = self.device
        ids = mb["input_ids"]
        inputs: dict[str, Tensor] = {"input_ids": ids.to(dev),
                                     "attention_mask": mb["attention_mask"].to(dev)}
        for name, v in mb.multimodal_inputs(stage, self.settings.dtype).items():
            inputs[name] = v.to(dev)
        if not self.model_positions:
            b, s = ids.shape
            inputs["position_ids"] = torch.arange(s, device=dev)[None].expand(b, s)
        return inputs

    def token_logprobs(self, model: torch.nn.Module, mb: Batch, stage: Stage) -> Tensor:
        """`[B, S]` float32 logprob of each token given its prefix (0 at position 0 and pads)."""
        inputs = self.model_inputs(mb, stage)
        logits = model(**inputs, use_cache=False).logits
        return self._gather_logprobs(logits, inputs)

    @staticmethod
    def _gather_logprobs(logits: Tensor, inputs: dict[str, Tensor]) -> Tensor:
        ids = inputs["input_ids"]
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        logp = torch.nn.functional.pad(logp, (1, 0))
        return logp * inputs["attention_mask"].to(logp.dtype)

    def token_logprobs_and_entropy(self, model: torch.nn.Module, mb: Batch,
                                   stage: Stage) -> tuple[Tensor, Tensor]:
        """`token_logprobs` and, aligned with it, the entropy of the policy's distribution at
        the position predicting each token (`[B, S]` float32, 0 at position 0 and pads)."""
        inputs = self.model_inputs(mb, stage)
        logits = model(**inputs, use_cache=False).logits
        z = logits[:, :-1].float()
        logp_all = torch.log_softmax(z, dim=-1)
        entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
        entropy = torch.nn.functional.pad(entropy, (1, 0))
        entropy = entropy * inputs["attention_mask"].to(entropy.dtype)
        return self._gather_logprobs(logits, inputs), entropy

    # -- passes -------------------------------------------------------------------------
    def policy_for(self, stage: Stage) -> torch.nn.Module:
        return self.reference_model if stage is Stage.REFERENCE_LOGPROB else self.model

    @torch.no_grad()
    def logprobs(self, batch: Batch, stage: Stage) -> Tensor:
        """An independent forward over `batch`, per micro-batch: `[B, S]` float32 on the CPU."""
        model = self.policy_for(stage)
        out = torch.zeros(batch.batch_size, batch.seq_len(), dtype=torch.float32)
        for rows, mb in self.micro_batches(self.prepare(batch)):
            lp = self.token_logprobs(model, mb, stage).cpu()
            out[rows, : lp.shape[1]] = lp
        return out

    def old_logprobs(self, mb: Batch, logp: Tensor) -> Tensor:
        """The behaviour policy's logprobs: the column the independent LOGPROB pass wrote."""
        return mb["prev_logprobs"].to(logp.device)

    def train(self, shards: Sequence[Batch]) -> StepResult:
        """Every optimizer step of one generation batch (`LossConfig.mini_batches` x `epochs`;
        one by default) over every micro-batch of every data-parallel shard.

        Gradients accumulate over micro-batches and shards (an in-process all-reduce); each
        micro-batch's loss carries the aggregation weights of its optimizer step's totals
        (loss tokens, rows), so the objective does not depend on the split.
        """
        cfg = self.settings.loss
        shards = [self.prepare(b) for b in shards]
        parts = [mini_batch_rows(len(b), cfg.mini_batches) for b in shards]
        results = []
        for _ in range(cfg.epochs):
            for k in range(cfg.mini_batches):
                step = [b.select(p[k]) if len(p[k]) < len(b) else b
                        for b, p in zip(shards, parts) if p[k]]
                self.batch_step = len(results)  # this step's place in the generation batch
                results.append(self.optimizer_step(step))
        first = results[0]
        if len(results) > 1:
            first.extra["optimizer_steps"] = results
        return first

    def optimizer_step(self, shards: Sequence[Batch]) -> StepResult:
        """One optimizer step over every micro-batch of `shards` (this rank's part of it)."""
        cfg = self.settings.loss
        norm = StepNorm(self.loss_normalizer(shards), self.row_normalizer(shards))
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        metrics: dict[str, list[Tensor]] = {}
        for shard in shards:
            for _, mb in self.micro_batches(shard):
                if cfg.entropy_coef:
                    logp, entropy = self.token_logprobs_and_entropy(self.model, mb, Stage.TRAIN)
                else:
                    logp, entropy = self.token_logprobs(self.model, mb, Stage.TRAIN), None
                out = self.micro_batch_loss(mb, logp, norm, entropy)
                with strict_determinism() if self._strict_backward else \
                        contextlib.nullcontext():
                    out.loss.backward()
                total += out.loss.detach().double().cpu()
                for k, v in out.metrics.items():
                    metrics.setdefault(k, []).append(v.cpu())
        self.reduce_gradients()
        grad_norm = self.clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return StepResult(float(total), {k: torch.cat(v) for k, v in metrics.items()},
                          float(grad_norm), {"normalizer": norm.tokens, "rows": norm.rows,
                                             "step": self.steps})

    def clip_gradients(self) -> Tensor:
        """Scale the gradient to `max_grad_norm` where it is longer; returns its norm before."""
        cfg = self.settings.loss
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return torch.zeros(())
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def loss_normalizer(self, shards: Sequence[Batch]) -> float:
        """The loss-token count of the optimizer step (every micro-batch of every shard, summed
        over the data-parallel rank processes too): the token-mean is over the step, whatever
        the split or the sharding."""
        from .ranks import dp_sum

        return max(1.0, float(dp_sum(sum(int(b["token_mask"].sum()) for b in shards))))

    def row_normalizer(self, shards: Sequence[Batch]) -> float:
        """The row count of the optimizer step (rows without loss tokens too), summed over the
        data-parallel ranks: the sequence-mean aggregations divide by it."""
        if self.settings.loss.aggregation == "token-mean":
            return float("nan")  # unused: no collective for it
        from .ranks import dp_sum

        return max(1.0, float(dp_sum(sum(b.batch_size for b in shards))))

    def micro_batch_loss(self, mb: Batch, logp: Tensor, normalizer: float | StepNorm,
                         entropy: Tensor | None = None) -> LossOutput:
        """One micro-batch's share of the step loss (`normalizer`: the step's StepNorm, or its
        token count where the aggregation needs nothing else)."""
        s, dev = self.settings, logp.device
        ref = mb.fields.get("reference_logprobs")
        gen = mb.fields.get("generation_logprobs")
        return grpo_loss(
            logp, self.old_logprobs(mb, logp), mb["advantages"].to(dev),
            mb["token_mask"].to(dev), normalizer, s.loss,
            None if ref is None else ref.to(dev), None if gen is None else gen.to(dev),
            entropy, self.objective)

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    # -- data parallelism across processes (reference_impl/ranks.py) ---------------------
    def reduce_gradients(self) -> None:
        """Sum the gradients over the data-parallel ranks (nothing to do in one process)."""
        from .ranks import dp_reduce_gradients

        dp_reduce_gradients(self.model)


class _Trainer:
    """What both paths share: one GRPOCore (the algorithm), its models and weights."""

    core_cls = GRPOCore

    def __init__(self, settings: TrainerSettings, model: torch.nn.Module | None = None):
        self.settings = settings
        self.core = self.core_cls(settings, model)

    @property
    def model(self) -> torch.nn.Module:
        return self.core.model

    @property
    def reference_model(self) -> torch.nn.Module:
        return self.core.reference_model

    def state_dict(self) -> dict[str, Tensor]:
        return self.core.state_dict()


class LegacyTrainer(_Trainer):
    """The in-memory path: the driver hands whole `Batch`es to the trainer."""

    def compute_logprobs(self, batch: Batch, stage: Stage) -> Tensor:
        return self.core.logprobs(batch, stage)

    def train(self, batch: Batch | Sequence[Batch]) -> StepResult:
        """`batch`, or one batch per data-parallel rank (one optimizer step over all)."""
        return self.core.train([batch] if isinstance(batch, Batch) else list(batch))


class DataPlaneTrainer(_Trainer):
    """The data-plane path: every pass starts from a meta and fetches through the transport."""

    def __init__(self, settings: TrainerSettings, transport, codec,
                 model: torch.nn.Module | None = None):
        super().__init__(settings, model)
        self.transport = transport
        self.codec = codec

    def stage_fields(self, meta, stage: Stage) -> list[str]:
        """What `stage` fetches: every registered field it consumes that the meta holds (and the
        `<field>.<key>` wire columns of an object field it consumes)."""
        wanted = stage_fields(stage)
        return [f for f in wanted if f in meta.fields] + [
            c for c in meta.fields if column_field(c) != c and column_field(c) in wanted]

    def fetch(self, meta, stage: Stage) -> Batch:
        cols, tags = self.transport.get(meta.partition, meta.keys,
                                        select_fields=self.stage_fields(meta, stage))
        return self.codec.decode(WireBatch(cols, tags))

    def compute_logprobs(self, meta, stage: Stage):
        """Fetch, forward per micro-batch, put the output as a new column; returns the meta."""
        name = OUTPUT_FIELD[stage]
        batch = self.fetch(meta, stage)
        self.put_column(meta, batch, name, self.core.logprobs(batch, stage))
        return meta.with_fields(name)

    def put_column(self, meta, batch: Batch, name: str, values: Tensor) -> None:
        wire = self.codec.encode(Batch({"input_lengths": batch["input_lengths"], name: values}))
        self.transport.put(meta.partition, meta.keys, {name: wire.columns[name]})

    def train(self, meta) -> StepResult:
        """`meta`, or one meta per data-parallel rank (one optimizer step over all)."""
        metas = list(meta) if isinstance(meta, (list, tuple)) else [meta]
        return self.core.train([self.fetch(m, Stage.TRAIN) for m in metas])
