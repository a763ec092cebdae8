"""verl 0.9.1's data path as an rlconform backend: its own functions, wrapped, never re-implemented.

rlconform's fields map straight onto verl's containers: per-token fields (`position_ids`
`[B, S]` or M-RoPE `[B, 3|4, S]` included) and per-sample fields are the tensors of
`DataProto.batch`; media are verl's per-sample dicts in `non_tensor_batch["multi_modal_inputs"]`
(an object array, `{}` for a text-only row). An object column of the batch (`multi_modal_inputs`,
or OpenRLHF's `mm_train_inputs` with None rows) is that array, row objects as they are; packed
fields become those dicts through `Batch.to_row_dicts` and come back through `from_row_dicts`.

| surface | verl 0.9.1 |
|---|---|
| codec | the TransferQueue rollout write (`trainer/ppo/v1/agent_loop_tq.py`): one `AgentLoopOutput` per sample (prompt/response ids, `token_mask` as its response mask, `generation_logprobs` as its response logprobs), its `as_dict()` completed as `_agent_loop_postprocess` does (input ids, loss mask, position ids, the media dict; other fields cut at the row's length on their sequence dim), `tensordict_utils.list_of_dict_to_tensordict`; decode reads each key back with `tensordict_utils.get` and requires per-token columns jagged, as verl's readers do (`.offsets()`) |
| meta | the driver's `KVBatchMeta` (TransferQueue's class, as verl's v1 trainer holds it; a row's length is its tag's `seq_len`, as `agent_loop_tq` writes it): `select_keys` (subset, slice), `BatchData(list).concat()`; shard_for_dp is the v1 trainer's own `PPOTrainer._balance_batch` (compiled from trainer_base.py) then the split of the actor's lazy dispatch, `decorator._split_args_kwargs_data_proto` (`BatchData(meta).chunk(world)`), which hands each rank a TransferQueue `BatchMeta`; concat of those shards is verl's collect (`decorator._concat_data_proto_or_future`, `BatchData(list).concat()`) |
| batch_ops | validate: `DataProto.from_dict` + `check_consistency`; pad_to: `torch_functional.pad_sequence_to_length` on each per-token tensor; multimodal_inputs: `utils.model.extract_multi_modal_inputs` over the media dicts (every stage, as verl's FSDP, Megatron and TorchTitan engines call it); select: `DataProto.select_idxs`; concat: `DataProto.concat`; split: `DataProto` slices; micro_batches: `seqlen_balancing.prepare_dynamic_batch` (`rearrange_micro_batches`) |

Not declared (Backend.notes): transport (verl's data plane is TransferQueue, bundled already),
trainer and rollout (verl's engines and rollout need GPUs and vLLM/SGLang). verl has no batch
truncation: the backend leaves the `truncation` capability out (NOTES says why), so BATCH-TRUNCATE
is not applicable.

The meta surface runs verl's TransferQueue path for real: the session starts Ray and a
TransferQueue controller with one SimpleStorage unit (as the transferqueue-simple backend does),
and `shard_for_dp` registers the meta's keys and tags in TransferQueue under a per-process
namespace before verl's dispatch reads them back (`kv_batch_meta2batch_meta`).
"""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import Iterator, Sequence

import torch

from rlconform.conformance.backend import Backend, PathStep, package_version

MEDIA = "multi_modal_inputs"  # verl's non_tensor_batch key for per-sample media dicts
SEQ_LEN = "seq_len"  # the tag key verl's driver reads a row's length from (agent_loop_tq)
CAPABILITIES = {"dp", "bfloat16", "batch_algebra", "micro_batching", "batch_union", "padding"}
NOTES = {
    "truncation": "verl 0.9.1 has no batch truncation: torch_functional.postprocess_data "
    "truncates only input_ids and attention_mask of a tokenizer output, and the no-padding path "
    "(workers/utils/padding.py) never cuts a batch to a length",
    "transport": "verl has no key/value store of its own: its data plane is TransferQueue "
    "(bundled as transferqueue-simple / transferqueue-mooncake)",
    "trainer": "verl's FSDP/Megatron engines need GPUs and a distributed launch; not run here",
    "rollout": "verl's rollout needs vLLM or SGLang servers; not run here",
}

_TQ = "verl.trainer.ppo.v1"
_AGENT_TQ = ("AgentLoopWorkerTQ._agent_loop_postprocess (trainer/ppo/v1/agent_loop_tq.py) is an "
             "async method of a Ray actor that first runs the generation server, the reward and "
             "the teacher logprobs, and its module imports the GPU worker stack (codetiming, "
             "torchdata)")
# verl's data path from the agent loop's output to the engine's forward and optimizer step, as
# this adapter takes it (docs/backends.md renders it; tests/test_backends_verl.py patches every
# entered function and requires a call while the adapter's surfaces run)
DATA_PATH = (
    PathStep(f"{_TQ}.agent_loop_tq.AgentLoopWorkerTQ._agent_loop_postprocess", "stubbed",
             _AGENT_TQ, "codec"),
    PathStep("verl.experimental.agent_loop.agent_loop.AgentLoopOutput.as_dict", "entered",
             "run from agent_loop.py itself (AgentLoopOutput and AgentLoopMetrics compiled "
             "from that file, since importing the module pulls the rollout stack: codetiming, "
             "hydra, the tool registry), on one AgentLoopOutput per row", "codec"),
    PathStep("verl.utils.tensordict_utils.list_of_dict_to_tensordict", "entered",
             surface="codec"),
    PathStep("verl.utils.tensordict_utils.get", "entered", surface="codec"),
    PathStep("verl.protocol.DataProto.from_dict", "entered", surface="batch_ops"),
    PathStep("verl.protocol.DataProto.check_consistency", "entered", surface="batch_ops"),
    PathStep("verl.utils.torch_functional.pad_sequence_to_length", "entered",
             surface="batch_ops"),
    PathStep("verl.utils.model.extract_multi_modal_inputs", "entered", surface="batch_ops"),
    PathStep("verl.protocol.DataProto.select_idxs", "entered", surface="batch_ops"),
    PathStep("verl.protocol.DataProto.concat", "entered", surface="batch_ops"),
    PathStep("verl.protocol.DataProto.union", "entered", surface="batch_ops"),
    PathStep("verl.utils.seqlen_balancing.prepare_dynamic_batch", "entered",
             surface="batch_ops"),
    PathStep("verl.utils.seqlen_balancing.rearrange_micro_batches", "entered",
             surface="batch_ops"),
    PathStep("verl.utils.seqlen_balancing.calculate_workload", "entered", surface="meta"),
    PathStep("verl.utils.seqlen_balancing.get_seqlen_balanced_partitions", "entered",
             surface="meta"),
    PathStep("transfer_queue.KVBatchMeta.reorder", "entered", surface="meta"),
    PathStep("verl.single_controller.base.decorator._split_args_kwargs_data_proto", "entered",
             surface="meta"),
    PathStep("verl.protocol.BatchData.chunk", "entered", surface="meta"),
    PathStep("verl.single_controller.base.decorator.dispatch_nd_compute", "stubbed",
             "ray.puts each rank's part to the actor worker group's Ray actors; here each part "
             "is the rank's meta", "meta"),
    PathStep("verl.single_controller.base.decorator._concat_data_proto_or_future", "entered",
             surface="meta"),
    PathStep("verl.protocol.BatchData.concat", "entered", surface="meta"),
    PathStep(f"{_TQ}.trainer_base.PPOTrainer._balance_batch", "entered",
             "run from trainer_base.py itself (its definition compiled from that file, since "
             "importing the module pulls the GPU worker stack: codetiming, torchdata), with "
             "PPOTrainer._get_required_batch_multiple, on a trainer stand-in holding the DP "
             "world as the worker group's dispatch info", "meta"),
    PathStep(f"{_TQ}.trainer_base.PPOTrainer._get_required_batch_multiple", "entered",
             "compiled from trainer_base.py as above; actor mini-batch = the DP world, no "
             "critic", "meta"),
    PathStep("verl.utils.seqlen_balancing.log_seqlen_unbalance", "entered", surface="meta"),
    PathStep("verl.trainer.ppo.padding_utils.upsample_batch_to_divisible_size", "stubbed",
             "it reads a source sample's columns back from TransferQueue to clone it, and the "
             "meta surface registers keys and tags only: the stand-in returns the batch as it "
             "is, so a batch the DP world does not divide fails verl's equal_size partitioning",
             "meta"),
    PathStep("verl.workers.utils.padding.left_right_2_no_padding", "stubbed",
             "the legacy DataProto trainer's conversion before a worker call; the v1 "
             "TransferQueue path the codec takes writes the no-padding form directly"),
    PathStep("verl.workers.utils.padding.no_padding_2_padding", "stubbed",
             "applies to model outputs (log-probs, values) of an engine forward, which needs "
             "GPUs"),
    PathStep("verl.workers.engine_workers.ActorRolloutRefWorker.update_actor", "stubbed",
             "verl's FSDP/Megatron engines (forward, loss, optimizer step) need GPUs and a "
             "distributed launch (no trainer surface)"),
)
# What the adapter changes in verl's output before a clause judges it (representation only)
NORMALISATIONS = {
    "WIRE-ROUNDTRIP": "decode pads each jagged per-token column back to the batch's dense "
    "[B, S] form with the field's registered pad value (VerlCodec._per_token), after checking "
    "each row's length against its seq_len tag; a dense column is reported, not padded. "
    "token_mask and generation_logprobs come back from verl's response-only response_mask "
    "and rollout_log_probs (AgentLoopOutput.as_dict), placed after the row's prompt_len tag "
    "with the field's pad value on the prompt (VerlCodec._response); prompt_lengths, where "
    "the batch had it, is that tag",
    "BATCH-ALGEBRA": "a medium no row has leaves no key in verl's per-sample dicts; it comes "
    "back as a packed field of None rows (verl.py _batch): nothing verl lost is restored",
}


def _verl():
    try:
        import verl.protocol  # noqa: F401  (imports ray, tensordict, transfer_queue if present)
        from verl.utils import tensordict_utils  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "the verl backend needs `pip install --no-deps verl==0.9.1` plus `tensordict==0.10.0 "
            "TransferQueue==0.1.11 ray omegaconf numpy packaging` (nox -s conformance -- "
            f"--backend verl installs them): {exc}") from exc


# -- rlconform Batch <-> verl's containers -------------------------------------------------------
_FORM = "rlconform_media_form"  # DataProto.meta_info / codec tag: how the Batch held its media


def _media_form(batch) -> dict:
    """Where the batch's media are: an object column (verl's multi_modal_inputs, OpenRLHF's
    mm_train_inputs) or packed fields (with their pack dims), plus the family."""
    from rlconform.reference_impl.packed import PackedTensor
    from rlconform.reference_impl.registry import Kind

    objects = batch.names(Kind.OBJECT)
    packed = {n: v.pack_dim for n, v in batch.fields.items() if isinstance(v, PackedTensor)}
    if len(objects) > 1 or (objects and packed):
        raise ValueError(f"verl holds a sample's media in one dict column; the batch has "
                         f"object fields {objects} and packed fields {sorted(packed)}")
    return {"object": objects[0] if objects else None, "packed": packed, "family": batch.family}


def _media_rows(batch, form: dict) -> list | None:
    """The rows of verl's `multi_modal_inputs`: the object column's own dicts (not copies: verl's
    algebra then shows whether it shares them), or the packed fields as per-sample dicts
    (`Batch.to_row_dicts`, the processor's per-sample form, `{}` for a text-only row)."""
    if form["object"]:
        return list(batch[form["object"]].rows)
    if form["packed"]:
        return list(batch.to_row_dicts(MEDIA)[MEDIA].rows)
    return None


def _batch(fields: dict, rows, form: dict):
    """A Batch from verl's tensors and media rows, in the form the source batch held them."""
    from rlconform.reference_impl.batch import Batch
    from rlconform.reference_impl.objects import ObjectColumn
    from rlconform.reference_impl.packed import PackedTensor

    family = form["family"]
    if rows is None:
        return Batch(fields, family)
    if form["object"]:
        return Batch({**fields, form["object"]: ObjectColumn.adopt(rows, MEDIA)}, family)
    out = Batch({**fields, MEDIA: ObjectColumn.adopt(rows, MEDIA)}, family).from_row_dicts(MEDIA)
    # A medium no row has leaves no key in verl's dicts; the source batch held it as a packed
    # field of None rows, and gets it back in that form (a change of representation: nothing of
    # verl's result is repaired, a row with media that verl lost stays lost)
    n = len(rows)
    missing = {name: PackedTensor.from_rows([None] * n, pack_dim=pd)
               for name, pd in form["packed"].items() if name not in out.fields}
    return out.replace(**missing) if missing else out


def to_proto(batch):
    """A `DataProto` holding `batch`: tensors in `batch`, media dicts in `non_tensor_batch`.

    The per-sample media dicts go in as the plain list a caller holds; `DataProto.from_dict`
    builds the object array itself (`np.array(val, dtype=object)`, as verl's agent loop builds
    `multi_modal_inputs` from its outputs' dicts)."""
    from verl.protocol import DataProto

    form = _media_form(batch)
    tensors = {n: v for n, v in batch.fields.items() if isinstance(v, torch.Tensor)}
    rows = _media_rows(batch, form)
    non_tensors = {} if rows is None else {MEDIA: list(rows)}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={_FORM: form})


def from_proto(proto):
    """The Batch a DataProto made by `to_proto` (and verl's operations on it) holds."""
    form = proto.meta_info[_FORM]
    fields = dict(proto.batch.items()) if proto.batch is not None else {}
    media = proto.non_tensor_batch.get(MEDIA)
    return _batch(fields, None if media is None else list(media), form)


def _media_list(proto) -> list:
    media = proto.non_tensor_batch.get(MEDIA)
    return [] if media is None else list(media)


# -- codec: the TransferQueue rollout write ------------------------------------------------------
# the fields an AgentLoopOutput carries besides the ids, and verl's response-only columns that
# bring them back; the other columns of verl's dict that rlconform has no field for
_ROLLOUT = ("token_mask", "generation_logprobs", "prompt_lengths")
_FROM_RESPONSE = {"response_mask": "token_mask", "rollout_log_probs": "generation_logprobs"}
_VERL_OWN = ("prompts", "responses", "loss_mask", "metrics", "extra_fields")


def _prompt_lengths(batch, lens: list[int]) -> list[int]:
    """Each row's prompt length: `prompt_lengths` where the batch has it, else the tokens
    before the row's first loss token (`Batch.completion_starts`), else 0."""
    if "prompt_lengths" in batch.fields:
        out = [int(p) for p in batch["prompt_lengths"].tolist()]
    elif "token_mask" in batch.fields:
        out = batch.completion_starts()
    else:
        out = [0] * len(lens)
    for i, (p, n) in enumerate(zip(out, lens)):
        if not 0 <= p <= n:
            raise ValueError(f"row {i}: 'prompt_lengths' {p} is outside its {n} tokens")
    return out


@functools.cache
def _agent_loop_classes():
    """verl's `AgentLoopOutput` and `AgentLoopMetrics`, compiled from
    experimental/agent_loop/agent_loop.py itself: importing that module pulls the rollout
    stack (codetiming, hydra, the tool registry, the dataset classes). Raises if verl moved
    them."""
    from typing import Any, Optional

    from pydantic import BaseModel, ConfigDict

    scope = _compiled("experimental/agent_loop/agent_loop.py",
                      {"AgentLoopMetrics": None, "AgentLoopOutput": None},
                      {"__name__": "verl.experimental.agent_loop.agent_loop", "Any": Any,
                       "Optional": Optional, "BaseModel": BaseModel, "ConfigDict": ConfigDict,
                       "torch": torch})
    return scope["AgentLoopOutput"], scope["AgentLoopMetrics"]


def _agent_loop_output(batch, i: int, p: int, n: int):
    """Row i as the agent loop's output holds it: prompt and response ids, the response's loss
    mask (all ones without `token_mask`) and its engine logprobs (where the batch has them)."""
    output, metrics = _agent_loop_classes()
    ids = batch["input_ids"][i]
    tm, gl = batch.fields.get("token_mask"), batch.fields.get("generation_logprobs")
    extra = {} if gl is None else {"response_logprobs": gl[i, p:n].tolist()}
    return output(prompt_ids=ids[:p].tolist(), response_ids=ids[p:n].tolist(),
                  response_mask=[1] * (n - p) if tm is None else tm[i, p:n].tolist(),
                  metrics=metrics(), **extra)


class VerlCodec:
    """encode: one dict per sample as verl's TransferQueue agent loop builds it, then
    `list_of_dict_to_tensordict`; decode: `tensordict_utils.get` per key.

    A per-token field travels cut at the row's length on its sequence dim (`input_ids[i, :n]`,
    `position_ids[i, :, :n]`, as `agent_loop_tq` writes them); `token_mask` and
    `generation_logprobs` travel as the response's `response_mask` and `rollout_log_probs`
    that `AgentLoopOutput.as_dict` makes; the media dict of a row travels as the row's value of
    `multi_modal_inputs` (a NonTensorStack). Tags carry each row's `prompt_len`,
    `response_len` and `seq_len` (verl's), the family and how the batch held its media. verl
    has no pixel dtype policy on its rollout write: `pixel_dtype` is accepted and ignored.
    """

    name = "verl"

    def __init__(self, pixel_dtype: torch.dtype | None = None):
        _verl()
        self.pixel_dtype = pixel_dtype  # verl's write path stores the processor's dtype

    def encode(self, batch):
        """verl builds each sample's dict inline in `AgentLoopWorkerTQ._agent_loop_postprocess`
        (trainer/ppo/v1/agent_loop_tq.py), an async method of a Ray actor that first runs the
        generation server, the reward and the teacher logprobs. Each row enters as what that
        method holds, an `AgentLoopOutput` (prompt ids, response ids, response mask, response
        logprobs), and its dict is the method's: `AgentLoopOutput.as_dict()`, then `input_ids`
        = prompts + responses, `loss_mask` = `response_mask`, the row's `position_ids` and
        media dict, and its tags (`prompt_len`, `response_len`, `seq_len`); the list goes to
        verl's `list_of_dict_to_tensordict`.

        A row's prompt is `prompt_lengths` where the batch has it, else the tokens before its
        first loss token (`token_mask`; no loss token: all prompt; no `token_mask`: no
        prompt). The batch's other fields ride in the same dict, as the trainer's later puts
        add columns to the same keys (per-token ones cut at the row's length on their
        sequence dim)."""
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        from rlconform.reference_impl.codec import FAMILY_TAG, SEQ_LEN_TAG, WireBatch
        from rlconform.reference_impl.registry import Kind, spec

        if batch.batch_size == 0:
            raise ValueError(f"cannot encode an empty batch (fields {sorted(batch.fields)})")
        if "input_ids" not in batch.fields:
            raise KeyError(f"verl's rollout write needs 'input_ids' (an AgentLoopOutput's "
                           f"prompt_ids and response_ids); the batch has {sorted(batch.fields)}")
        batch.validate()
        lens = batch.seq_lens.tolist()
        form = {**_media_form(batch), "rollout": sorted(set(_ROLLOUT) & set(batch.fields))}
        media = _media_rows(batch, form)
        samples, tags = [], []
        for i, (n, p) in enumerate(zip(lens, _prompt_lengths(batch, lens))):
            sample = _agent_loop_output(batch, i, p, n).as_dict()
            # what _agent_loop_postprocess does with it
            sample["input_ids"] = torch.cat([sample["prompts"], sample["responses"]], dim=0)
            sample["loss_mask"] = sample["response_mask"]
            for name, v in batch.fields.items():
                kind = spec(name).kind
                if name in _ROLLOUT or name == "input_ids":
                    continue
                if kind is Kind.PER_TOKEN:
                    sample[name] = v[i].narrow(spec(name).seq_axis(v.dim()) - 1, 0, n)
                elif kind is Kind.PER_SAMPLE:
                    sample[name] = v[i]
            if media is not None:
                sample[MEDIA] = media[i]
            samples.append(sample)
            prompt_len, response_len = sample["prompts"].size(0), sample["responses"].size(0)
            tag = {"prompt_len": prompt_len, "response_len": response_len,
                   SEQ_LEN_TAG: prompt_len + response_len, _FORM: form}
            if batch.family:
                tag[FAMILY_TAG] = batch.family
            tags.append(tag)
        td = list_of_dict_to_tensordict(samples)
        return WireBatch({k: td.get(k) for k in td.keys()}, tags)

    def decode(self, wire):
        from tensordict import TensorDict
        from verl.utils import tensordict_utils as tu

        from rlconform.reference_impl.codec import SEQ_LEN_TAG
        from rlconform.reference_impl.registry import FAMILIES, Kind, spec

        b = len(wire.tags)
        if b == 0:
            raise ValueError(f"cannot decode an empty wire batch (columns {sorted(wire.columns)})")
        for name, col in wire.columns.items():
            if len(col) != b:
                raise ValueError(f"wire column {name!r} has {len(col)} rows but there are {b} tags")
        for i, t in enumerate(wire.tags):
            for key in (SEQ_LEN_TAG, "prompt_len", _FORM):
                if key not in t:
                    raise KeyError(f"row {i}'s tag lacks {key!r}: tags must travel 1:1 with rows")
        forms = [t[_FORM] for t in wire.tags]
        if any(f != forms[0] for f in forms):
            raise ValueError("wire tags disagree on the batch's media form or family")
        form = forms[0]
        if form["family"] is not None and form["family"] not in FAMILIES:
            raise KeyError(f"wire tags name unknown family {form['family']!r}")
        lens = [int(t[SEQ_LEN_TAG]) for t in wire.tags]
        prompt_lens = [int(t["prompt_len"]) for t in wire.tags]  # verl's own tag
        rollout = form["rollout"]
        td = TensorDict(dict(wire.columns), batch_size=[b])
        fields, media = {}, None
        for key in td.keys():
            value = tu.get(td, key)
            if key == MEDIA:
                media = value
                continue
            if key in _VERL_OWN:
                continue
            if key in _FROM_RESPONSE:
                name = _FROM_RESPONSE[key]
                if name in rollout:
                    fields[name] = self._response(key, name, value, prompt_lens, lens)
                continue
            fs = spec(key)
            if fs.kind is Kind.PER_TOKEN:
                fields[key] = self._per_token(key, value, lens, fs)
            else:
                if value.is_nested:
                    raise TypeError(f"per-sample column {key!r} came back jagged")
                fields[key] = value.clone()
        if "prompt_lengths" in rollout:
            fields["prompt_lengths"] = torch.tensor(prompt_lens, dtype=torch.int64)
        lost = [name for name in rollout if name not in fields]
        if lost:
            raise KeyError(f"verl's rows lack the columns "
                           f"{[k for k, v in _FROM_RESPONSE.items() if v in lost]} that "
                           f"{lost} come back from")
        got = fields["input_lengths"].tolist() if "input_lengths" in fields else None
        if got != lens:
            raise ValueError(f"tags' seq_len {lens} disagree with 'input_lengths' {got}")
        if (media is None) != (form["object"] is None and not form["packed"]):
            raise KeyError(f"the wire batch {'lacks' if media is None else 'has'} the "
                           f"{MEDIA!r} column its tags say it {'has' if media is None else 'lacks'}")
        batch = _batch(fields, media, form)
        batch.validate()
        return batch

    @staticmethod
    def _response(key, name, value, prompt_lens, lens):
        """rlconform's dense `name` from verl's response-only column `key`: row i at offsets
        prompt_len..seq_len, the field's pad value elsewhere (its prompt holds no loss token
        and no engine logprob)."""
        from rlconform.reference_impl.registry import spec

        rows = _jagged_rows(key, value)
        out = torch.full((len(rows), max(lens)), spec(name).pad_value, dtype=rows[0].dtype)
        for i, (r, p, n) in enumerate(zip(rows, prompt_lens, lens)):
            if r.dim() != 1 or r.shape[0] != n - p:
                raise ValueError(f"column {key!r} row {i} has shape {list(r.shape)}, its tags say "
                                 f"{n - p} response tokens (seq_len {n}, prompt_len {p})")
            out[i, p:n] = r
        return out

    @staticmethod
    def _per_token(key, value, lens, fs):
        rows = _jagged_rows(key, value)
        out = None
        for i, (r, n) in enumerate(zip(rows, lens)):
            axis = fs.seq_axis(r.dim() + 1) - 1
            if r.shape[axis] != n:
                raise ValueError(f"per-token column {key!r} row {i} has {r.shape[axis]} tokens, "
                                 f"its tag says seq_len {n}")
            if out is None:
                shape = list(r.shape)
                shape[axis] = max(lens)
                out = torch.full((len(rows), *shape), fs.pad_value, dtype=r.dtype)
            out[i].narrow(axis, 0, n).copy_(r)
        return out


def _jagged_rows(key, value) -> tuple:
    """The rows of a per-token column verl stored: it must be jagged, what verl's readers need
    (they call .offsets())."""
    if not value.is_nested:
        raise TypeError(
            f"per-token column {key!r} came back dense {list(value.shape)}, not jagged: "
            "verl's readers of the no-padding layout (rearrange_micro_batches, the engines' "
            "prepare_model_inputs, response_from_nested) call .offsets()")
    return value.unbind(0)


# -- meta: the driver's KVBatchMeta and verl's dispatch/collect ------------------------------------
_NAMESPACE = f"rlc-verl-{uuid.uuid4().hex[:8]}"


class VerlBatchMeta:
    """rlconform's BatchMeta surface over the `KVBatchMeta` verl's v1 trainer holds.

    A row's sequence length is its tag's `seq_len` (verl's `_balance_batch` reads it there);
    tags given with a `seq_len` must agree with `seq_lens`. A meta made by `shard_for_dp` is what
    verl's dispatch hands one rank (a TransferQueue `BatchMeta`, read here through its global
    indexes and custom meta); `concat` of such shards is verl's collect.
    """

    def __init__(self, partition: str, keys: Sequence[str], fields: Sequence[str],
                 seq_lens: Sequence[int], tags: Sequence[dict], extra: dict | None = None):
        _verl()
        from transfer_queue import KVBatchMeta

        keys, seq_lens, tags = list(keys), [int(s) for s in seq_lens], list(tags)
        if len(seq_lens) != len(keys):
            raise ValueError(f"meta has {len(keys)} keys but {len(seq_lens)} seq_lens")
        if len(tags) != len(keys):
            raise ValueError(f"meta has {len(keys)} keys but {len(tags)} tags")
        stamped = []
        for i, (tag, n) in enumerate(zip(tags, seq_lens)):
            if SEQ_LEN in tag and tag[SEQ_LEN] != n:
                raise ValueError(f"row {i} (key {keys[i]!r}): tag seq_len {tag[SEQ_LEN]} != "
                                 f"seq_lens[{i}] {n}")
            stamped.append({**tag, SEQ_LEN: n})
        self._set(KVBatchMeta(keys=keys, tags=stamped, partition_id=partition,
                              fields=list(dict.fromkeys(fields)), extra_info=dict(extra or {})))

    def _set(self, kv, rank=None):
        self._kv = kv
        self._rank = rank  # the TransferQueue BatchMeta verl's dispatch gave a rank
        return self

    @classmethod
    def _wrap(cls, kv, rank=None) -> VerlBatchMeta:
        return cls.__new__(cls)._set(kv, rank)

    # -- views --------------------------------------------------------------------------
    @property
    def partition(self) -> str:
        return self._kv.partition_id

    @property
    def keys(self) -> list[str]:
        return list(self._kv.keys)

    @property
    def fields(self) -> list[str]:
        return list(self._kv.fields or [])

    @property
    def seq_lens(self) -> list[int]:
        return [t.get(SEQ_LEN) for t in self._kv.tags]

    @property
    def tags(self) -> list[dict]:
        return self._kv.tags

    @property
    def extra(self) -> dict:
        return self._kv.extra_info if self._kv.extra_info is not None else {}

    def __len__(self) -> int:
        return len(self._kv)

    # -- the algebra --------------------------------------------------------------------
    def _select(self, keys: list[str]) -> VerlBatchMeta:
        return self._wrap(self._kv.select_keys(keys))

    def subset(self, indices: Sequence[int]) -> VerlBatchMeta:
        n = len(self)
        bad = [i for i in indices if not 0 <= i < n]
        if bad:
            raise IndexError(f"meta indices {bad} out of range for {n} keys")
        return self._select([self._kv.keys[i] for i in indices])

    def slice(self, start: int, stop: int) -> VerlBatchMeta:
        return self._select(self._kv.keys[start:stop])

    @staticmethod
    def concat(metas: Sequence[VerlBatchMeta]) -> VerlBatchMeta:
        from verl.protocol import BatchData

        if not metas:
            raise ValueError("concat needs at least one meta")
        cls = type(metas[0])
        if all(m._rank is not None for m in metas):  # rank shards: verl's collect
            from verl.single_controller.base.decorator import _concat_data_proto_or_future

            return cls._wrap(_concat_data_proto_or_future([m._rank for m in metas]))
        return cls._wrap(BatchData([m._kv for m in metas]).concat())

    def _rebuild(self, fields=None, tags=None) -> VerlBatchMeta:
        from transfer_queue import KVBatchMeta

        kv = self._kv
        return self._wrap(KVBatchMeta(keys=list(kv.keys), tags=kv.tags if tags is None else tags,
                                      partition_id=kv.partition_id,
                                      fields=self.fields if fields is None else fields,
                                      extra_info=kv.extra_info))

    def drop(self, *names: str) -> VerlBatchMeta:
        missing = [n for n in names if n not in self.fields]
        if missing:
            raise KeyError(f"meta has no fields {missing} to drop; it has {self.fields}")
        return self._rebuild(fields=[f for f in self.fields if f not in names])

    def with_fields(self, *names: str) -> VerlBatchMeta:
        return self._rebuild(fields=list(dict.fromkeys(self.fields + list(names))))

    def stamp_tags(self, tags: Sequence[dict] | dict) -> VerlBatchMeta:
        per_row = [tags] * len(self) if isinstance(tags, dict) else list(tags)
        if len(per_row) != len(self):
            raise ValueError(f"stamp_tags got {len(per_row)} tags for {len(self)} keys")
        return self._rebuild(tags=[{**t, **new} for t, new in zip(self._kv.tags, per_row)])

    def shard_for_dp(self, world: int) -> tuple[list[VerlBatchMeta], list[int]]:
        """verl's v1 trainer `PPOTrainer._balance_batch` (run from its file, `_trainer_method`),
        then the split of its dispatch, `_split_args_kwargs_data_proto`; each shard is the
        `BatchMeta` one rank receives. The inverse permutation is read from the balanced keys."""
        import transfer_queue as tq
        from transfer_queue import KVBatchMeta

        if world <= 0:
            raise ValueError(f"world size must be positive, got {world}")
        kv = self._kv
        pid = f"{_NAMESPACE}/{kv.partition_id}"
        # the rollout write registered every key and tag in TransferQueue before the driver
        # balanced the batch; do the same (a fresh registration, so no earlier tag lingers)
        tq.kv_clear(keys=list(kv.keys), partition_id=pid)
        tq.kv_batch_put(keys=list(kv.keys), partition_id=pid, fields=None, tags=kv.tags)
        driver = KVBatchMeta(keys=list(kv.keys), tags=kv.tags, partition_id=pid,
                             fields=kv.fields, extra_info=kv.extra_info)
        balanced = _balance_batch(driver, world)
        position = {k: i for i, k in enumerate(kv.keys)}
        order = [position[k] for k in balanced.keys]
        from verl.single_controller.base.decorator import _split_args_kwargs_data_proto

        client = tq.get_client()
        shards = []
        # the actor's lazy nd dispatch (dispatch_lazy_compute_data_proto ->
        # dispatch_nd_compute_dataproto) splits the meta with this, then ray.puts each part
        (rank_metas,), _ = _split_args_kwargs_data_proto(world, balanced)
        for rank_meta in rank_metas:
            keys = client.kv_retrieve_keys(global_indexes=list(rank_meta.global_indexes),
                                           partition_id=pid)
            view = KVBatchMeta(keys=keys, tags=rank_meta.get_all_custom_meta(),
                               partition_id=kv.partition_id, fields=list(rank_meta.field_names),
                               extra_info=rank_meta.extra_info)
            shards.append(self._wrap(view, rank=rank_meta))
        inverse = [0] * len(order)
        for pos, i in enumerate(order):
            inverse[i] = pos
        return shards, inverse


def _compiled(relpath: str, wanted: dict, namespace: dict, lazy_annotations: bool = False) -> dict:
    """Definitions of verl's file `relpath` (under the installed package), compiled from the
    file itself and run in `namespace` (the names they read): `wanted` maps each top-level
    class to None, or to the name of the one method of it to take (undecorated). For modules
    that do not import without verl's GPU or rollout stack."""
    import __future__

    import ast
    from pathlib import Path

    import verl

    path = Path(verl.__file__).parent / relpath
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    body = []
    for cls_name, method in wanted.items():
        cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name),
                   None)
        node = cls if method is None or cls is None else next(
            (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method), None)
        if node is None:
            raise ImportError(f"verl {verl.__version__}: {path} has no "
                              f"{cls_name}{'' if method is None else '.' + method}")
        if method is not None:
            node.decorator_list = []
        body.append(node)
    scope = dict(namespace)
    # annotations as the caller asks, never this module's `from __future__ import annotations`
    # by inheritance: pydantic models need theirs evaluated (it cannot resolve strings in a
    # module that is not imported); methods need theirs unevaluated (they name classes of
    # the module's imports, which are not in `namespace`)
    flags = __future__.annotations.compiler_flag if lazy_annotations else 0
    code = compile(ast.Module(body=body, type_ignores=[]), str(path), "exec", flags=flags,
                   dont_inherit=True)
    exec(code, scope)  # noqa: S102 - verl's own source, from its installed file
    return scope


def _trainer_method(name: str, namespace: dict):
    """`PPOTrainer.<name>` of verl's v1 trainer, compiled from trainer/ppo/v1/trainer_base.py
    itself with the names it reads given in `namespace`: importing that module pulls the GPU
    worker stack (codetiming, torchdata, the engine workers). Raises if verl moved it."""
    return _compiled("trainer/ppo/v1/trainer_base.py", {"PPOTrainer": name}, namespace,
                     lazy_annotations=True)[name]


def _balance_batch(meta, world: int):
    """verl's `PPOTrainer._balance_batch(batch, metrics)` on the driver's KVBatchMeta, as the v1
    trainer calls it, on a stand-in trainer: the actor worker group's dispatch info names
    `world` DP ranks; `_get_required_batch_multiple` (verl's) sees an actor mini-batch of
    `world` rows and no critic. `upsample_batch_to_divisible_size` is stubbed: it clones a
    sample's columns from TransferQueue, and the meta surface holds keys and tags only."""
    import math
    import types

    from omegaconf import OmegaConf
    from verl.utils import seqlen_balancing as sb

    def upsample_stand_in(batch, batch_multiple, eos_token_id):
        return batch

    names = {"math": math, "torch": torch, "calculate_workload": sb.calculate_workload,
             "get_seqlen_balanced_partitions": sb.get_seqlen_balanced_partitions,
             "log_seqlen_unbalance": sb.log_seqlen_unbalance,
             "upsample_batch_to_divisible_size": upsample_stand_in}
    trainer = types.SimpleNamespace(
        actor_rollout_wg=types.SimpleNamespace(_dispatch_info={"actor": list(range(world))}),
        tokenizer=types.SimpleNamespace(eos_token_id=0), use_critic=False, global_steps=1,
        config=OmegaConf.create({"trainer": {"critic_warmup": 0}, "actor_rollout_ref": {
            "actor": {"ppo_mini_batch_size": world}, "rollout": {"n": 1}}}))
    multiple = _trainer_method("_get_required_batch_multiple", names)
    trainer._get_required_batch_multiple = types.MethodType(multiple, trainer)
    return _trainer_method("_balance_batch", names)(trainer, meta, {})


# -- batch operations ------------------------------------------------------------------------------
class VerlBatchOps:
    """batch_ops on verl's DataProto: validate, pad, per-stage model inputs, the batch algebra
    and dynamic micro-batching."""

    name = "verl"

    def __init__(self):
        _verl()

    def pad_to(self, batch, seq_len: int):
        """`torch_functional.pad_sequence_to_length` (right, last dim: the sequence dim of every
        registered per-token field) on each per-token tensor of the DataProto."""
        from verl.utils.torch_functional import pad_sequence_to_length

        from rlconform.reference_impl.registry import FIELDS, Kind

        proto = to_proto(batch)
        for name in batch.names(Kind.PER_TOKEN):
            proto.batch[name] = pad_sequence_to_length(proto.batch[name], max_seq_len=seq_len,
                                                       pad_token_id=FIELDS[name].pad_value,
                                                       left_pad=False)
        return from_proto(proto)

    def validate(self, batch) -> None:
        """verl's own checks: `DataProto.from_dict` (every tensor has the batch's dim 0) and
        `check_consistency` (non-tensor columns have a row per sample)."""
        to_proto(batch).check_consistency()

    def multimodal_inputs(self, batch, stage, dtype: torch.dtype | None = None) -> dict:
        """verl's engines build every stage's media inputs alike, in the model's dtype only
        inside the model: `extract_multi_modal_inputs(micro_batch.get("multi_modal_inputs",
        []))`."""
        from verl.utils.model import extract_multi_modal_inputs

        return extract_multi_modal_inputs(_media_list(to_proto(batch)))

    # batch_algebra
    def select(self, batch, indices):
        return from_proto(to_proto(batch).select_idxs(list(indices)))

    def concat(self, batches):
        from verl.protocol import DataProto

        return from_proto(DataProto.concat([to_proto(b) for b in batches]))

    def split(self, batch, sizes):
        """Consecutive `DataProto` slices (`DataProto.split(n)` is the equal-size case)."""
        sizes = [int(n) for n in sizes]
        if any(n < 0 for n in sizes) or sum(sizes) != len(batch):
            raise ValueError(f"split sizes {sizes} must be >= 0 and sum to {len(batch)}")
        proto, out, start = to_proto(batch), [], 0
        for n in sizes:
            out.append(from_proto(proto[start:start + n]))
            start += n
        return out

    # batch_union
    def union(self, a, b):
        """`DataProto.union`: the tensors of both (`union_tensor_dict`: an overlapping key must
        be `torch.equal`), the non-tensor columns of both (`union_numpy_dict`: overlapping
        columns compared by `_deep_equal`) and both meta_info dicts; called as verl's trainer
        calls it (`batch = batch.union(other)`)."""
        return from_proto(to_proto(a).union(to_proto(b)))

    # micro_batching
    def micro_batches(self, batch, n: int, shuffle_seed: int | None = None):
        """verl's dynamic micro-batching, `seqlen_balancing.prepare_dynamic_batch` (its
        `rearrange_micro_batches` with `min_num_micro_batch=n` and a token budget that needs no
        more): n micro-batches balanced by workload, each with the rows it holds. It has no
        shuffle (verl shuffles mini-batches in `make_iterator`): `shuffle_seed` is ignored."""
        from verl.utils.seqlen_balancing import prepare_dynamic_batch

        if not 1 <= n <= max(len(batch), 1):
            raise ValueError(f"micro-batch count n={n} must be in 1..{len(batch)}")
        budget = max(int(batch.seq_lens.sum()), int(batch.seq_lens.max()), 1)
        micro, index = prepare_dynamic_batch(to_proto(batch), max_token_len=budget,
                                             min_num_micro_batch=n)
        return [(list(idx), from_proto(mb)) for idx, mb in zip(index, micro)]


# -- the backend ---------------------------------------------------------------------------------
@contextlib.contextmanager
def verl_session() -> Iterator[None]:
    """Ray + a TransferQueue controller with one SimpleStorage unit (verl's TransferQueue path);
    verl's own `tq.init()` calls then attach to it."""
    _verl()
    from rlconform.conformance.backends.transferqueue import simple_session

    with simple_session():
        yield


def _codec(pixel_dtype=None):
    return VerlCodec(pixel_dtype)


def _meta():
    _verl()
    return VerlBatchMeta


backend = Backend(
    name="verl",
    description="verl 0.9.1's data path: DataProto, the TransferQueue rollout write "
    "(AgentLoopOutput.as_dict, list_of_dict_to_tensordict), KVBatchMeta dispatch/collect, "
    "seqlen balancing, extract_multi_modal_inputs",
    codec=_codec,
    meta=_meta,
    batch_ops=VerlBatchOps,
    capabilities=frozenset(CAPABILITIES),
    session=verl_session,
    notes=NOTES,
    version=package_version("verl"),
    data_path=DATA_PATH,
    normalisations=NORMALISATIONS,
)
