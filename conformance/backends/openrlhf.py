"""OpenRLHF 0.11.2's data path as an rlconform backend: its own functions, wrapped, never
re-implemented.

OpenRLHF moves a batch as an `Experience` (openrlhf/trainer/ppo_utils/experience.py): per-token
"step" tensors `[B, T]`, per-sample "episode" tensors `[B]`, per-sample lists, an `info` dict of
per-sample values, and the media of each sample in `mm_train_inputs`, a list with one entry per
sample: the processor's dict of model-input tensors, or None for a text-only sample
(utils/vlm_utils.py `process_prompt_with_images`). rlconform's fields map onto it as follows:

| rlconform | Experience |
|---|---|
| input_ids, attention_mask, token_mask | sequences, attention_mask, action_mask (step) |
| generation_logprobs, prev_logprobs, reference_logprobs | rollout_log_probs, action_log_probs, base_action_log_probs (step) |
| input_lengths, rewards | total_length, rewards (episode) |
| media: mm_train_inputs rows (or multi_modal_inputs rows, or packed fields as `Batch.to_row_dicts`) | mm_train_inputs, the row objects as they are |
| any other field (mm_token_type_ids, token_type_ids, position_ids `[B, C, S]`, advantages `[B]`, prompt_lengths) | info[name] |

OpenRLHF's Experience has no slot for per-token modality maps or position ids: its actor rebuilds
`mm_token_type_ids` / `token_type_ids` from `sequences` at the model (models/actor.py
`Actor.forward`) and lets the model compute M-RoPE positions. Those fields travel in `info`,
OpenRLHF's per-sample dict, which every function below carries (split slices it per row,
make-batch collects it as a list of rows, concat pads and concatenates it); the adapter stacks a
list of equal-shape rows back into one tensor and raises naming the field otherwise.

| surface method | OpenRLHF 0.11.2 |
|---|---|
| batch_ops.select | `split_experience_batch` then `make_experience_batch` of the chosen items (the replay buffer's append and collate) |
| batch_ops.split | `split_experience_batch`, `make_experience_batch` per chunk |
| batch_ops.concat | `Experience.concat_experiences` (how `RemoteExperienceMaker.split_rollout_samples` joins rollout samples) |
| batch_ops.micro_batches | no seed: `balance_experiences` with n effective ranks (the dynamic-batch path, which does not shuffle); a seed: the trainer's loader, `DataLoader(items, batch_size=ceil(B/n), shuffle=True, drop_last=True, collate_fn=make_experience_batch)` as `PPOActor.ppo_train` builds it |
| batch_ops.multimodal_inputs | `utils.vlm_utils.merge_mm_train_inputs`: logprob and reference stages as `RemoteExperienceMaker.make_experience` passes them (a list of the experiences' lists), train as `ActorPPOTrainer.training_step` (the experience's list) |
| batch_ops.validate | `split_experience_batch`'s checks (every tensor and info entry has a row per sample) |
| batch_ops.truncate, pad_to | none: capabilities `truncation` and `padding` left out (NOTES says why) |

The row index each micro-batch holds is read from an adapter key in `info` (OpenRLHF's own
`Experience.index` is cleared by `split_experience_batch`).
"""

from __future__ import annotations

import math
import types

import torch

from rlconform.conformance.backend import Backend, PathStep

_EXP = "openrlhf.trainer.ppo_utils.experience"
# OpenRLHF's data path from the rollout's Experience to the actor's forward, as this adapter takes
# it (docs/backends.md renders it; tests/test_backends_openrlhf.py checks the entered steps)
DATA_PATH = (
    PathStep("openrlhf.trainer.ray.vllm_engine.LLMRayActor.generate", "stubbed",
             "OpenRLHF generates with vLLM engines in Ray GPU actors (no rollout surface)"),
    PathStep("openrlhf.trainer.ppo_utils.samples_generator.SamplesGenerator."
             "_process_response_into_experience", "stubbed",
             "the module imports vLLM; the adapter builds one single-sample Experience per row "
             "with the processor's media dict, the form that method returns", "batch_ops"),
    PathStep(f"{_EXP}.Experience.concat_experiences", "entered", surface="batch_ops"),
    PathStep(f"{_EXP}.split_experience_batch", "entered", surface="batch_ops"),
    PathStep(f"{_EXP}.make_experience_batch", "entered", surface="batch_ops"),
    PathStep(f"{_EXP}.balance_experiences", "entered", surface="batch_ops"),
    PathStep("openrlhf.utils.vlm_utils.merge_mm_train_inputs", "entered", surface="batch_ops"),
    PathStep("openrlhf.models.actor.Actor.forward", "stubbed",
             "imports deepspeed and flash-attn; the trainers need Ray GPU actors (no trainer "
             "surface)"),
)

MEDIA = "mm_train_inputs"  # Experience's per-sample media list
ROW = "__rlconform_row__"  # info key: the original row index (micro_batches)
STEP = {"input_ids": "sequences", "attention_mask": "attention_mask",
        "token_mask": "action_mask", "generation_logprobs": "rollout_log_probs",
        "prev_logprobs": "action_log_probs", "reference_logprobs": "base_action_log_probs"}
EPISODE = {"input_lengths": "total_length", "rewards": "rewards"}
MISSING = ("openrlhf: cannot import OpenRLHF's data path: `pip install --no-deps "
           "openrlhf==0.11.2 pylatexenc` (its full dependency list pins deepspeed and flash-attn; "
           "nox -s conformance -- --backend openrlhf installs it)")


class _OpenRLHF:
    """The OpenRLHF modules this adapter calls, imported once."""

    def __init__(self) -> None:
        try:
            import openrlhf
            from openrlhf.trainer.ppo_utils import experience
            from openrlhf.utils import vlm_utils
        except ImportError as exc:
            raise ImportError(f"{MISSING} ({exc})") from exc
        self.version = getattr(openrlhf, "__version__", None) or _dist_version()
        self._experience, self._vlm_utils = experience, vlm_utils

    # looked up on OpenRLHF's modules at each call, so the adapter calls whatever those modules
    # hold (a patched or instrumented function included: tests/_data_path.py counts them)
    Experience = property(lambda self: self._experience.Experience)
    split_experience_batch = property(lambda self: self._experience.split_experience_batch)
    make_experience_batch = property(lambda self: self._experience.make_experience_batch)
    balance_experiences = property(lambda self: self._experience.balance_experiences)
    merge_mm_train_inputs = property(lambda self: self._vlm_utils.merge_mm_train_inputs)


def _dist_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("openrlhf")
    except PackageNotFoundError:
        return "?"


_ORL: _OpenRLHF | None = None


def orl() -> _OpenRLHF:
    global _ORL
    if _ORL is None:
        _ORL = _OpenRLHF()
    return _ORL


# -- rlconform Batch <-> OpenRLHF Experience ------------------------------------------------------
def _form(batch) -> dict:
    """How `batch` holds its fields, to give OpenRLHF's results back in the same form: the field
    names, the media (an object column, or packed fields with their pack dims) and the family."""
    from rlconform.reference_impl.packed import PackedTensor
    from rlconform.reference_impl.registry import Kind

    objects = batch.names(Kind.OBJECT)
    packed = {n: v.pack_dim for n, v in batch.fields.items() if isinstance(v, PackedTensor)}
    if len(objects) > 1 or (objects and packed):
        raise ValueError(f"OpenRLHF holds a sample's media in one dict (mm_train_inputs); the "
                         f"batch has object fields {objects} and packed fields {sorted(packed)}")
    return {"fields": list(batch.fields), "object": objects[0] if objects else None,
            "packed": packed, "family": batch.family}


def _sample_experience(batch, i: int, media, rows: bool):
    """Sample i as the rollout makes one `Experience`
    (`SamplesGenerator._process_response_into_experience`): its tokens and per-token tensors
    `[1, len]` (cut at the sample's length on their sequence dim, unpadded), its episode
    tensors `[1]`, its media dict (or None) as the one entry of `mm_train_inputs`, and its other
    values in `info`, each `[1, ...]`."""
    from rlconform.reference_impl.registry import Kind, spec

    n = int(batch.seq_lens[i])
    kwargs: dict = {}
    info: dict = {}
    for name, v in batch.fields.items():
        if not isinstance(v, torch.Tensor):
            continue
        row = v[i:i + 1]
        if spec(name).kind is Kind.PER_TOKEN:  # a slice, so a field shorter than the row stays so
            cut = [slice(None)] * v.dim()
            cut[spec(name).seq_axis(v.dim())] = slice(0, n)
            row = row[tuple(cut)]
        if name in STEP:
            kwargs[STEP[name]] = row
        elif name in EPISODE:
            kwargs[EPISODE[name]] = row
        else:
            info[name] = row
    if rows:
        info[ROW] = torch.tensor([i])
    kwargs[MEDIA] = [media]
    kwargs["info"] = info
    return orl().Experience(**kwargs)


def to_experience(batch, rows: bool = False):
    """The `Experience` OpenRLHF makes of `batch` (see the module docstring): one `Experience`
    per sample as its rollout makes them, joined by `Experience.concat_experiences`, as
    `RemoteExperienceMaker.split_rollout_samples` joins rollout samples (padding `sequences`
    with input_ids' pad value); with `rows`, each row's index in `info[ROW]`.

    The media a sample holds are its processor dict (`process_prompt_with_images` keeps the
    processor output's media keys) or None for a text-only sample: an object column's own row
    objects (OpenRLHF's functions then show whether they share them), or the packed fields'
    per-sample dicts (`Batch.to_row_dicts`, the processor's per-sample form)."""
    from rlconform.reference_impl.registry import FIELDS

    form = _form(batch)
    n = batch.batch_size
    if form["object"]:
        media = list(batch[form["object"]].rows)
    elif form["packed"]:
        media = [r if r else None for r in batch.to_row_dicts(MEDIA)[MEDIA].rows]
    else:
        media = [None] * n  # a text-only sample's entry, as the rollout makes it
    singles = [_sample_experience(batch, i, media[i], rows) for i in range(n)]
    joined = orl().Experience.concat_experiences(
        singles, pad_token_id=int(FIELDS["input_ids"].pad_value))
    return joined, form


def _tensor(name: str, value):
    """An Experience value as one tensor: a list of per-row tensors (make_experience_batch's
    form for info entries) is stacked when every row has one shape."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
        shapes = {tuple(v.shape) for v in value}
        if len(shapes) != 1:
            raise TypeError(f"OpenRLHF returned field {name!r} as {len(value)} rows of differing "
                            f"shapes {sorted(shapes)}")
        return torch.stack(value)
    raise TypeError(f"OpenRLHF returned field {name!r} as {type(value).__name__} "
                    f"({'empty' if isinstance(value, list) and not value else 'not tensors'})")


def _slot(name: str) -> str:
    """Where rlconform field `name` lives in an Experience."""
    return STEP.get(name) or EPISODE.get(name) or f"info[{name!r}]"


def from_experience(exp, form: dict):
    """The Batch an Experience made by `to_experience` (and OpenRLHF's functions on it) holds,
    in the form the source batch held it. A field OpenRLHF dropped is missing from it; a field
    whose row count differs from `sequences`' (OpenRLHF's batch size) is an error naming both."""
    from rlconform.reference_impl.batch import Batch
    from rlconform.reference_impl.objects import ObjectColumn
    from rlconform.reference_impl.packed import PackedTensor

    fields: dict = {}
    info = exp.info or {}
    for name in form["fields"]:
        if name == form["object"] or name in form["packed"]:
            continue
        if name in STEP:
            value = getattr(exp, STEP[name])
        elif name in EPISODE:
            value = getattr(exp, EPISODE[name])
        else:
            value = info.get(name)
        if value is not None:
            fields[name] = _tensor(name, value)
    media = exp.mm_train_inputs
    if not isinstance(media, list):
        raise TypeError(f"OpenRLHF returned mm_train_inputs as {type(media).__name__}, not a list")
    n = len(exp.sequences) if exp.sequences is not None else len(media)
    for name, v in fields.items():
        if len(v) != n:
            shown = f": {v.tolist()}" if v.dim() == 1 and len(v) <= 32 else ""
            raise ValueError(f"OpenRLHF returned {_slot(name)} (rlconform {name!r}) with {len(v)} "
                             f"rows for {n} sequences{shown}")
    if len(media) != n:
        raise ValueError(f"OpenRLHF returned {len(media)} mm_train_inputs rows for {n} sequences")
    family = form["family"]
    if form["object"]:
        return Batch({**fields, form["object"]: ObjectColumn.adopt(media, MEDIA)}, family)
    if not form["packed"]:
        extra = [i for i, r in enumerate(media) if r is not None]
        if extra:
            raise ValueError(f"OpenRLHF returned media on rows {extra[:8]} of a media-free batch")
        return Batch(fields, family)
    out = Batch({**fields, MEDIA: ObjectColumn.adopt(media, MEDIA)}, family).from_row_dicts(MEDIA)
    missing = {name: PackedTensor.from_rows([None] * n, pack_dim=pd)  # no media in any row:
               for name, pd in form["packed"].items() if name not in out.fields}  # not rebuilt
    return out.replace(**missing) if missing else out


def _rows_of(exp) -> list[int]:
    """The original row indices an Experience holds (info[ROW], collected as tensors)."""
    v = exp.info.get(ROW)
    if v is None:
        raise KeyError(f"OpenRLHF dropped info[{ROW!r}]")
    return [int(x) for x in (v if isinstance(v, list) else v.reshape(-1))]


def _strip_rows(exp) -> None:
    exp.info.pop(ROW, None)


# -- batch_ops ------------------------------------------------------------------------------------
class OpenRLHFBatchOps:
    """batch_ops on OpenRLHF's Experience (see the module docstring)."""

    name = "openrlhf"

    def __init__(self) -> None:
        self._o = orl()

    def validate(self, batch) -> None:
        """OpenRLHF's only batch check: `split_experience_batch` raises when a tensor or an info
        entry does not have a row per sample."""
        exp, _ = to_experience(batch)
        self._o.split_experience_batch(exp)

    def multimodal_inputs(self, batch, stage, dtype: torch.dtype | None = None) -> dict:
        """`merge_mm_train_inputs`, called as each stage calls it: the logprob and reference
        passes get `[experience.mm_train_inputs, ...]` (RemoteExperienceMaker.make_experience ->
        PolicyModelActor / ReferenceModelActor.forward), train gets `experience.mm_train_inputs`
        (ActorPPOTrainer.training_step). OpenRLHF never casts media on this path (the model
        does): `dtype` is accepted and not applied."""
        exp, _ = to_experience(batch)
        train = getattr(stage, "value", stage) == "train"
        arg = exp.mm_train_inputs if train else [exp.mm_train_inputs]
        return self._o.merge_mm_train_inputs(arg, "cpu")

    # batch_algebra
    def select(self, batch, indices):
        exp, form = to_experience(batch)
        items = self._o.split_experience_batch(exp)
        picked = [items[int(i)] for i in indices]
        return from_experience(self._o.make_experience_batch(picked), form)

    def split(self, batch, sizes):
        sizes = [int(n) for n in sizes]
        if any(n < 0 for n in sizes) or sum(sizes) != len(batch):
            raise ValueError(f"split sizes {sizes} must be >= 0 and sum to {len(batch)}")
        exp, form = to_experience(batch)
        items = self._o.split_experience_batch(exp)
        out, start = [], 0
        for n in sizes:
            out.append(from_experience(self._o.make_experience_batch(items[start:start + n]),
                                       form))
            start += n
        return out

    def concat(self, batches):
        """`Experience.concat_experiences`, padding `sequences` with input_ids' pad value."""
        from rlconform.reference_impl.registry import FIELDS

        pairs = [to_experience(b) for b in batches]
        joined = self._o.Experience.concat_experiences(
            [e for e, _ in pairs], pad_token_id=int(FIELDS["input_ids"].pad_value))
        return from_experience(joined, pairs[0][1])

    # micro_batching
    def micro_batches(self, batch, n: int, shuffle_seed: int | None = None):
        b = len(batch)
        if not 1 <= n <= max(b, 1):
            raise ValueError(f"micro-batch count n={n} must be in 1..{b}")
        exp, form = to_experience(batch, rows=True)
        if shuffle_seed is None:
            args = types.SimpleNamespace(
                actor=types.SimpleNamespace(num_nodes=1, num_gpus_per_node=n),
                ds=types.SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1))
            parts = self._o.balance_experiences([exp], args)
        else:
            from torch.utils.data import DataLoader

            items = self._o.split_experience_batch(exp)
            loader = DataLoader(items, batch_size=math.ceil(b / n), shuffle=True,
                                drop_last=True, collate_fn=self._o.make_experience_batch,
                                generator=torch.Generator().manual_seed(int(shuffle_seed)))
            parts = list(loader)
        out = []
        for part in parts:
            idx = _rows_of(part)
            _strip_rows(part)
            out.append((idx, from_experience(part, form)))
        return out


# -- the backend ----------------------------------------------------------------------------------
NOTES = {
    "transport": "OpenRLHF has no key/value store: experiences travel as Python objects through "
                 "Ray's object store (ray.put of Experience lists in RayActorGroup."
                 "async_run_method_batch)",
    "codec": "OpenRLHF has no wire form of its own: Ray pickles the Experience objects; media "
             "cross it as the processor's fp32 tensors (no policy-dtype cast on the way)",
    "meta": "OpenRLHF's driver holds the Experience batches themselves, no key/tag metadata; its "
            "DP balancing (balance_experiences) moves whole rows and is wrapped as "
            "batch_ops.micro_batches",
    "trainer": "OpenRLHF's actor (models/actor.py) imports deepspeed and flash-attn and its "
               "trainers need Ray GPU actors; not run here",
    "rollout": "OpenRLHF generates with vLLM engines (trainer/ray/vllm_engine.py); not run here",
    "truncation": "OpenRLHF 0.11.2 has no batch truncation: the rollout cuts each response to "
                  "max_len once, as it becomes an Experience (SamplesGenerator."
                  "_process_response_into_experience, which imports vLLM); no function narrows "
                  "a batch",
    "padding": "OpenRLHF 0.11.2 pads only to the longest row of the tensors it joins "
               "(utils.zero_pad_sequences inside make_experience_batch / concat_experiences); no "
               "function pads a batch to a given length",
    "batch_union": "Experience has no union of two batches over the same samples: "
                   "make_experience assigns each computed field (action_log_probs, values, ...) "
                   "onto the rollout's own Experience objects",
}


def backend() -> Backend:
    """The `openrlhf` backend; raises ImportError saying what to install when OpenRLHF is absent."""
    o = orl()
    return Backend(
        name="openrlhf",
        description=f"OpenRLHF {o.version}: Experience split / make_experience_batch / "
                    "concat_experiences / balance_experiences as batch algebra and micro-batches, "
                    "merge_mm_train_inputs as stage inputs",
        batch_ops=OpenRLHFBatchOps,
        capabilities=frozenset({"bfloat16", "batch_algebra", "micro_batching"}),
        notes=dict(NOTES),
        version=f"OpenRLHF {o.version}",
        data_path=DATA_PATH,
    )
