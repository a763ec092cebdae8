"""verl 0.9.1's data path as an rlconform backend: its own functions, wrapped, never re-implemented.

rlconform's fields map straight onto verl's containers: per-token and per-sample fields are the
tensors of `DataProto.batch` (a TensorDict), media are verl's per-sample dicts in
`non_tensor_batch["multi_modal_inputs"]` (an object array, `{}` for a text-only row).

| surface | verl 0.9.1 |
|---|---|
| codec | the TransferQueue rollout write (`trainer/ppo/v1/agent_loop_tq.py`): one dict per sample (per-token fields cut at the row's length, the media dict), `tensordict_utils.list_of_dict_to_tensordict`; decode reads each key back with `tensordict_utils.get` |
| meta | the driver's `KVBatchMeta` (TransferQueue's class, as verl's v1 trainer holds it; a row's length is its tag's `seq_len`, as `agent_loop_tq` writes it): `select_keys` (subset, slice), `BatchData(list).concat()`; shard_for_dp is `_balance_batch` (`seqlen_balancing.calculate_workload`, `get_seqlen_balanced_partitions(equal_size=True)`, `KVBatchMeta.reorder`) then verl's dispatch `BatchData(meta).chunk(world)`, which hands each rank a TransferQueue `BatchMeta`; concat of those shards is verl's collect (`BatchData(list).concat()`) |
| batch_ops | `DataProto.from_dict` + `check_consistency` (validate), `torch_functional.pad_sequence_to_length` on each per-token tensor (pad), `utils.model.extract_multi_modal_inputs` over the media dicts (every stage's inputs, as verl's FSDP, Megatron and TorchTitan engines call it) |

Not declared: transport (verl has none of its own; it uses TransferQueue, a bundled backend
already), trainer and rollout (verl's engines and rollout need GPUs and vLLM/SGLang). verl has
no batch truncation: `truncate` raises (BATCH-TRUNCATE is waived as unsupported).

The meta surface runs verl's TransferQueue path for real: the session starts Ray and a
TransferQueue controller with one SimpleStorage unit (as the transferqueue-simple backend does),
and `shard_for_dp` registers the meta's keys and tags in TransferQueue under a per-process
namespace before verl's dispatch reads them back (`kv_batch_meta2batch_meta`).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Sequence

import torch

from rlconform.conformance.backend import Backend

MEDIA = "multi_modal_inputs"  # verl's non_tensor_batch key for per-sample media dicts
SEQ_LEN = "seq_len"  # the tag key verl's driver reads a row's length from (agent_loop_tq)
_SHAPES = "__rlconform_media__"  # codec tag: the packed fields a row dict came from, per segment
CAPABILITIES = {"dp", "bfloat16", "cpu", "media_dedup", "dim1_packing"}
NOTES = {
    "transport": "verl has no key/value store of its own: its data plane is TransferQueue "
    "(bundled as transferqueue-simple / transferqueue-mooncake)",
    "trainer": "verl's FSDP/Megatron engines need GPUs and a distributed launch; not run here",
    "rollout": "verl's rollout needs vLLM or SGLang servers; not run here",
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
def _kind(name: str):
    from rlconform.reference_impl.registry import spec

    return spec(name).kind


def _media_rows(batch) -> tuple[list[dict], list[dict]]:
    """Per-sample media dicts as verl holds them (row i: each packed field's row, its segments
    concatenated on dim 0 as a processor emits one sample; `{}` for a text-only row), and per
    row the segment shapes each dict value came from (for the codec's tags)."""
    from rlconform.reference_impl.packed import PackedTensor

    packed = {n: v for n, v in batch.fields.items() if isinstance(v, PackedTensor)}
    rows, shapes = [], []
    for i in range(batch.batch_size):
        row, shp = {}, {}
        for name, v in packed.items():
            segs = v.row_segments(i)
            shp[name] = None if segs is None else [list(s.shape) for s in segs]
            if segs is not None:  # one tensor as a processor emits it, else a list per image
                same = len({tuple(t.shape[1:]) for t in segs}) == 1
                row[name] = (segs[0] if len(segs) == 1 else torch.cat(segs, dim=0) if same
                             else list(segs))
        rows.append(row)
        shapes.append({"pack_dims": {n: v.pack_dim for n, v in packed.items()}, "shapes": shp})
    return rows, shapes


def _packed_from_rows(rows: Sequence[dict], records: Sequence[dict]) -> dict:
    """Packed fields back from media dicts, split by the segment shapes recorded at encode."""
    from rlconform.reference_impl.packed import PackedTensor

    if not records:
        return {}
    out = {}
    for name, pack_dim in records[0]["pack_dims"].items():
        per_row = []
        for i, (row, rec) in enumerate(zip(rows, records)):
            shapes = rec["shapes"].get(name)
            if shapes is None:
                if row is not None and name in row:
                    raise ValueError(f"media dict of row {i} holds {name!r} but the row had none")
                per_row.append(None)
                continue
            if row is None or name not in row:
                raise ValueError(f"media dict of row {i} lost {name!r} (it had {len(shapes)} "
                                 "segments)")
            value = row[name]
            if isinstance(value, list):
                if [list(t.shape) for t in value] != shapes:
                    raise ValueError(f"media dict of row {i}: {name!r} segment shapes "
                                     f"{[list(t.shape) for t in value]}, they were {shapes}")
                per_row.append(list(value))
                continue
            sizes = [s[0] for s in shapes]
            if sum(sizes) != value.shape[0] or any(list(value.shape[1:]) != s[1:]
                                                   for s in shapes):
                raise ValueError(f"media dict of row {i}: {name!r} has shape "
                                 f"{list(value.shape)}, its segments were {shapes}")
            per_row.append(list(value.split(sizes, dim=0)))
        out[name] = PackedTensor.from_rows(per_row, pack_dim=pack_dim)
    return out


def to_proto(batch):
    """A `DataProto` holding `batch`: tensors in `batch`, media dicts in `non_tensor_batch`."""
    import numpy as np
    from verl.protocol import DataProto

    from rlconform.reference_impl.packed import PackedTensor

    tensors = {n: v for n, v in batch.fields.items() if not isinstance(v, PackedTensor)}
    non_tensors = {}
    if len(tensors) != len(batch.fields):
        rows, _ = _media_rows(batch)
        media = np.empty(len(rows), dtype=object)  # not np.array(rows): that may build 2-D
        media[:] = rows
        non_tensors[MEDIA] = media
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors,
                               meta_info={"family": batch.family})


def _media_list(proto) -> list:
    media = proto.non_tensor_batch.get(MEDIA)
    return [] if media is None else list(media)


# -- codec: the TransferQueue rollout write ------------------------------------------------------
class VerlCodec:
    """encode: one dict per sample as verl's TransferQueue agent loop builds it, then
    `list_of_dict_to_tensordict`; decode: `tensordict_utils.get` per key.

    A per-token field travels cut at the row's length (`input_ids[i, :len_i]`); the media dict of
    a row travels as the row's value of `multi_modal_inputs` (a NonTensorStack). Tags carry each
    row's `seq_len`, the family and the segment shapes the media dict values were built from.
    verl has no pixel dtype policy on its rollout write: `pixel_dtype` is accepted and ignored.
    """

    name = "verl"

    def __init__(self, pixel_dtype: torch.dtype | None = None):
        _verl()
        self.pixel_dtype = pixel_dtype  # verl's write path stores the processor's dtype

    def encode(self, batch):
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        from rlconform.reference_impl.codec import FAMILY_TAG, SEQ_LEN_TAG, WireBatch
        from rlconform.reference_impl.registry import Kind

        if batch.batch_size == 0:
            raise ValueError(f"cannot encode an empty batch (fields {sorted(batch.fields)})")
        batch.validate()
        lens = batch.seq_lens.tolist()
        media, records = _media_rows(batch)
        samples = []
        for i, n in enumerate(lens):
            sample = {}
            for name, v in batch.fields.items():
                kind = _kind(name)
                if kind is Kind.PER_TOKEN:
                    sample[name] = v[i, :n]
                elif kind is not Kind.PACKED:
                    sample[name] = v[i]
            if len(records[i]["shapes"]):
                sample[MEDIA] = media[i]
            samples.append(sample)
        td = list_of_dict_to_tensordict(samples)
        tags = []
        for i, n in enumerate(lens):
            tag = {SEQ_LEN_TAG: int(n)}
            if batch.family:
                tag[FAMILY_TAG] = batch.family
            if len(records[i]["shapes"]):
                tag[_SHAPES] = records[i]
            tags.append(tag)
        return WireBatch({k: td.get(k) for k in td.keys()}, tags)

    def decode(self, wire):
        from tensordict import TensorDict
        from verl.utils import tensordict_utils as tu

        from rlconform.reference_impl.batch import Batch
        from rlconform.reference_impl.codec import FAMILY_TAG, SEQ_LEN_TAG
        from rlconform.reference_impl.registry import FAMILIES, Kind, spec

        b = len(wire.tags)
        if b == 0:
            raise ValueError(f"cannot decode an empty wire batch (columns {sorted(wire.columns)})")
        for name, col in wire.columns.items():
            if len(col) != b:
                raise ValueError(f"wire column {name!r} has {len(col)} rows but there are {b} tags")
        td = TensorDict(dict(wire.columns), batch_size=[b])
        families = {t.get(FAMILY_TAG) for t in wire.tags}
        if len(families) > 1:
            raise ValueError(f"wire tags mix families {sorted(map(str, families))}")
        family = families.pop()
        if family is not None and family not in FAMILIES:
            raise KeyError(f"wire tag 'family' names unknown family {family!r}")
        lens = []
        for i, t in enumerate(wire.tags):
            if SEQ_LEN_TAG not in t:
                raise KeyError(f"row {i}'s tag lacks {SEQ_LEN_TAG!r}")
            lens.append(int(t[SEQ_LEN_TAG]))
        fields = {}
        for key in td.keys():
            value = tu.get(td, key)
            if key == MEDIA:
                records = [t.get(_SHAPES) for t in wire.tags]
                if any(r is None for r in records):
                    raise KeyError(f"a row's tag lacks {_SHAPES!r}: tags must travel 1:1 with rows")
                fields.update(_packed_from_rows(value, records))
                continue
            fs = spec(key)
            if fs.kind is Kind.PER_TOKEN:
                if not value.is_nested:  # what verl's readers need: they call .offsets()
                    raise TypeError(
                        f"per-token column {key!r} came back dense {list(value.shape)}, not "
                        "jagged: verl's readers of the no-padding layout (rearrange_micro_batches, "
                        "the engines' prepare_model_inputs, response_from_nested) call .offsets()")
                rows = value.unbind(0)
                seq = max(lens)
                out = None
                for i, (r, n) in enumerate(zip(rows, lens)):
                    if r.shape[0] != n:
                        raise ValueError(f"per-token column {key!r} row {i} has {r.shape[0]} "
                                         f"tokens, its tag says seq_len {n}")
                    if out is None:
                        out = torch.full((b, seq, *r.shape[1:]), fs.pad_value, dtype=r.dtype)
                    out[i, :n] = r
                fields[key] = out
            else:
                if value.is_nested:
                    raise TypeError(f"per-sample column {key!r} came back jagged")
                fields[key] = value.clone()
        got = fields["input_lengths"].tolist() if "input_lengths" in fields else None
        if got != lens:
            raise ValueError(f"tags' seq_len {lens} disagree with 'input_lengths' {got}")
        batch = Batch(fields, family)
        batch.validate()
        return batch


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
        if all(m._rank is not None for m in metas):  # rank shards: verl's collect
            return VerlBatchMeta._wrap(BatchData([m._rank for m in metas]).concat())
        return VerlBatchMeta._wrap(BatchData([m._kv for m in metas]).concat())

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
        """verl's `_balance_batch` then its dispatch: balanced partitions of the workloads
        (`get_seqlen_balanced_partitions(equal_size=True)`), `KVBatchMeta.reorder`, then
        `BatchData(meta).chunk(world)`; each shard is the `BatchMeta` one rank receives."""
        import transfer_queue as tq
        from transfer_queue import KVBatchMeta
        from verl.protocol import BatchData
        from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

        if world <= 0:
            raise ValueError(f"world size must be positive, got {world}")
        kv = self._kv
        workloads = calculate_workload(torch.tensor(self.seq_lens, dtype=torch.int64))
        partitions = get_seqlen_balanced_partitions(workloads.tolist(), k_partitions=world,
                                                    equal_size=True)
        order = [i for p in partitions for i in p]
        pid = f"{_NAMESPACE}/{kv.partition_id}"
        # the rollout write registered every key and tag in TransferQueue before the driver
        # balanced the batch; do the same (a fresh registration, so no earlier tag lingers)
        tq.kv_clear(keys=list(kv.keys), partition_id=pid)
        tq.kv_batch_put(keys=list(kv.keys), partition_id=pid, fields=None, tags=kv.tags)
        balanced = KVBatchMeta(keys=list(kv.keys), tags=kv.tags, partition_id=pid,
                               fields=kv.fields, extra_info=kv.extra_info)
        balanced.reorder(order)
        client = tq.get_client()
        shards = []
        for rank_meta in BatchData(balanced).chunk(chunks=world):
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


# -- batch operations ------------------------------------------------------------------------------
class VerlBatchOps:
    """batch_ops on verl's DataProto: validate, pad, per-stage model inputs."""

    name = "verl"

    def __init__(self):
        _verl()

    def truncate(self, batch, max_len: int):
        raise NotImplementedError(
            "verl 0.9.1 has no batch truncation: torch_functional.postprocess_data truncates only "
            "input_ids and attention_mask of a tokenizer output, and the no-padding path "
            "(workers/utils/padding.py) never cuts a batch to a length")

    def pad_to(self, batch, seq_len: int):
        """`pad_sequence_to_length` (right) on every per-token tensor of the DataProto; media
        stay in non_tensor_batch, where verl keeps them."""
        from verl.utils.torch_functional import pad_sequence_to_length

        from rlconform.reference_impl.registry import FIELDS, Kind

        proto = to_proto(batch)
        out = dict(batch.fields)
        for name in batch.names(Kind.PER_TOKEN):
            out[name] = pad_sequence_to_length(proto.batch[name], max_seq_len=seq_len,
                                               pad_token_id=FIELDS[name].pad_value, left_pad=False)
        return batch.replace(**out)

    def validate(self, batch) -> None:
        """verl's own checks: `DataProto.from_dict` (every tensor has the batch's dim 0) and
        `check_consistency` (non-tensor columns have a row per sample)."""
        to_proto(batch).check_consistency()

    def multimodal_inputs(self, batch, stage, dtype: torch.dtype | None = None) -> dict:
        """verl's engines build every stage's media inputs alike:
        `extract_multi_modal_inputs(micro_batch.get("multi_modal_inputs", []))`."""
        from verl.utils.model import extract_multi_modal_inputs

        return extract_multi_modal_inputs(_media_list(to_proto(batch)))


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
    "(list_of_dict_to_tensordict), KVBatchMeta dispatch/collect, seqlen balancing, "
    "extract_multi_modal_inputs",
    codec=_codec,
    meta=_meta,
    batch_ops=VerlBatchOps,
    capabilities=frozenset(CAPABILITIES),
    session=verl_session,
    notes=NOTES,
)
