"""NeMo-RL (github.com/NVIDIA-NeMo/RL) as an rlconform backend: its own data-path functions.

NeMo-RL is not on the package registry; this adapter imports `nemo_rl` from whatever is
installed or on PYTHONPATH (or from `$NEMO_RL_SRC`, a checkout, which it puts on sys.path).
Nothing of NeMo-RL is copied here: every surface calls NeMo-RL's functions and hands back what
they return, converted between rlconform's and NeMo-RL's types without repair.

Surfaces (paths in the NeMo-RL tree):
- transport -> `nemo_rl/data_plane/adapters/noop.py` `NoOpDataPlaneClient` (NeMo-RL's in-memory
  `DataPlaneClient`): put -> `register_partition` (once per partition, as
  `TQPolicy.prepare_step` does) + `put_samples(keys, partition, TensorDict(columns), tags)`;
  get -> `get_samples(keys, partition, select_fields)`; clear -> `clear_samples`. The client
  API returns no tags from a read and lists no keys: tags travel on the `KVBatchMeta` receipts
  that `put_samples` returns (merged per key in put order, as its stores merge them), and
  `list` asks `get_samples(select_fields=[])` key by key for the keys this transport put.
- codec -> the rollout write and the worker read: encode = `BatchedDataDict` (media as NeMo-RL
  `PackedTensor`s) -> `get_multimodal_dict(pixel_dtype=...)` when a policy dtype is set ->
  `column_io.kv_first_write` (-> `codec.pack_jagged_fields`), whose `TensorDict` and tags are
  the wire batch; decode = `codec.materialize(TensorDict(columns))`.
- meta -> `interfaces.KVBatchMeta` (`subset`, `slice`, `concat`, `with_fields`, `stamp_tags`;
  a field drop is `dataclasses.replace(meta, fields=...)`, how `TQPolicy` narrows a meta)
  and `preshard.shard_meta_for_dp` for DP shards.
- batch_ops -> the worker's batch as NeMo-RL holds it in memory (`BatchedDataDict`, media as
  `PackedTensor`): truncate -> `BatchedDataDict.truncate_tensors(dim=1, ...)` (what its
  dynamic-shape micro-batch iterator does); pad_to -> the data plane's forward pad,
  `pack_jagged_fields` then `materialize(pad_to_seqlen=...)`; validate ->
  `nemo_rl/models/automodel/data.py` `check_sequence_dim`; multimodal_inputs -> the stage's
  fetch list (`schema.LP_SEED_FIELDS` for the logprob and reference-logprob passes,
  `schema.DP_TRAIN_FIELDS` for train, through `fields_with_optional_routed_experts` as
  `TQPolicy` does) then `get_multimodal_dict(as_tensors=True, pixel_dtype=...)`.

Type mapping: an rlconform `PackedTensor` becomes a NeMo-RL `PackedTensor` with deduplication
enabled (one physical segment per rlconform segment, logical rows by `merge_segments`, a None row
as `empty_rows_like`, joined by `concat`, which re-interns shared segments), so shared media stay
shared; pack_dim 1 (SmolVLM/Idefics3 tiles) becomes NeMo-RL's `dim_to_pack=1` with a leading
unit dim on each segment, as its processors emit them. The way back reads
`iter_logical_segments()` row by row. A row with no segment is None in both.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import os
import subprocess
import sys
import types
import uuid
from collections.abc import Sequence
from pathlib import Path

from rlconform.conformance.backend import Backend

MISSING = ("nemo-rl: cannot import nemo_rl: put a NeMo-RL checkout on PYTHONPATH "
           "(PYTHONPATH=/path/to/RL, or NEMO_RL_SRC=/path/to/RL) or pip install -e it")
# The data-plane modules need these beyond rlconform's own dependencies (column_io imports
# nemo_rl.data.llm_message_utils, which imports `datasets`).
REQUIREMENTS = ("tensordict", "datasets")
# rlconform's own column, added because kv_first_write takes the batch size from it; dropped again
# on decode
SAMPLE_MASK = "sample_mask"


class _NemoRL:
    """The NeMo-RL modules this adapter calls, imported once."""

    def __init__(self) -> None:
        src = os.environ.get("NEMO_RL_SRC")
        if src and src not in sys.path:
            sys.path.insert(0, src)
        try:
            import nemo_rl  # noqa: F401
        except ImportError as exc:
            raise ImportError(f"{MISSING} ({exc})") from exc
        try:
            from nemo_rl.data.multimodal_utils import PackedTensor
            from nemo_rl.data_plane import codec, column_io, interfaces, preshard, schema
            from nemo_rl.data_plane.adapters import noop
            from nemo_rl.distributed.batched_data_dict import BatchedDataDict
        except ImportError as exc:
            raise ImportError(f"nemo-rl: nemo_rl is importable but its data plane is not "
                              f"({exc}); it needs `pip install {' '.join(REQUIREMENTS)}`") from exc
        self.nemo_rl = nemo_rl
        self.PackedTensor = PackedTensor
        self.BatchedDataDict = BatchedDataDict
        self.codec, self.column_io, self.interfaces = codec, column_io, interfaces
        self.preshard, self.schema, self.noop = preshard, schema, noop
        self.KVBatchMeta = interfaces.KVBatchMeta
        self._validator = None
        self.validator_import = ""

    def check_sequence_dim(self):
        """`nemo_rl.models.automodel.data.check_sequence_dim`, imported on first use.

        Its module imports `nemo_rl.algorithms.loss.interfaces`, whose package `__init__` imports
        every loss function and through them the policy, generation and logger packages (mlflow,
        wandb, vLLM worker modules, and an `assert transformers < 5.12` in
        nemo_rl/models/policy/__init__.py, while rlconform needs >= 5.17). A full NeMo-RL install
        imports it normally. Otherwise the `nemo_rl.algorithms.loss` package is registered from
        its own folder without running its `__init__`, so that `interfaces.py` and
        `automodel/data.py` load unchanged from the checkout; the validator's own code is
        whatever that file holds.
        """
        if self._validator is not None:
            return self._validator
        name = "nemo_rl.models.automodel.data"
        try:
            mod = importlib.import_module(name)
            self.validator_import = "normal import"
        except (ImportError, AssertionError) as exc:
            for m in [m for m in sys.modules if m == name or m.startswith("nemo_rl.algorithms.loss")]:
                del sys.modules[m]
            pkg_dir = Path(self.nemo_rl.__file__).parent / "algorithms" / "loss"
            pkg = types.ModuleType("nemo_rl.algorithms.loss")
            pkg.__path__ = [str(pkg_dir)]
            pkg.__file__ = str(pkg_dir / "__init__.py")
            pkg.__package__ = "nemo_rl.algorithms.loss"
            sys.modules["nemo_rl.algorithms.loss"] = pkg
            try:
                mod = importlib.import_module(name)
            finally:  # nothing else in the process sees a package without its __init__
                sys.modules.pop("nemo_rl.algorithms.loss", None)
            self.validator_import = ("nemo_rl.algorithms.loss's __init__ skipped "
                                     f"({type(exc).__name__}: {str(exc)[:120]})")
        self._validator = mod.check_sequence_dim
        return self._validator


_NEMO: _NemoRL | None = None


def nemo() -> _NemoRL:
    global _NEMO
    if _NEMO is None:
        _NEMO = _NemoRL()
    return _NEMO


# -- type mapping ---------------------------------------------------------------------------
def to_nemo_packed(pt, pack_dim: int):
    """An rlconform PackedTensor as a NeMo-RL PackedTensor (deduplication enabled)."""
    NPT = nemo().PackedTensor
    dim = 1 if pack_dim == 1 else 0

    def seg(s):
        return NPT([s.unsqueeze(0) if dim == 1 else s], dim).enable_deduplication()

    segs = [seg(s) for s in pt.segments]
    template = segs[0] if segs else NPT([None], dim).enable_deduplication()
    rows = [NPT.empty_rows_like(template, 1) if r is None
            else NPT.merge_segments([segs[j] for j in r]) for r in pt.rows]
    return NPT.concat(rows)


def from_nemo_packed(npt, pack_dim: int):
    """A NeMo-RL PackedTensor as an rlconform PackedTensor; physical sharing kept."""
    from rlconform.reference_impl.packed import PackedTensor

    segments, index, rows = [], {}, []
    for i in range(len(npt)):
        got = [t for t in npt.slice([i]).iter_logical_segments() if t is not None]
        if not got:
            rows.append(None)
            continue
        row = []
        for t in got:
            if id(t) not in index:
                index[id(t)] = len(segments)
                segments.append(t.squeeze(0) if npt.dim_to_pack == 1 else t)
            row.append(index[id(t)])
        rows.append(tuple(row))
    return PackedTensor(segments, rows, pack_dim)


def to_bdd(batch, extra: dict | None = None):
    """An rlconform Batch as NeMo-RL's in-memory BatchedDataDict."""
    import numpy as np

    from rlconform.reference_impl.objects import ObjectColumn
    from rlconform.reference_impl.packed import PackedTensor

    out = {}
    for name, v in batch.fields.items():
        if isinstance(v, PackedTensor):
            out[name] = to_nemo_packed(v, v.pack_dim)
        elif isinstance(v, ObjectColumn):  # NeMo-RL's per-row object column: ndarray(object)
            out[name] = np.empty(len(v.rows), dtype=object)
            out[name][:] = list(v.rows)
        else:
            out[name] = v
    out.update(extra or {})
    return nemo().BatchedDataDict(out)


def from_bdd(data, family: str | None, pack_dims: dict[str, int] | None = None,
             drop: Sequence[str] = ()):
    """What NeMo-RL returned, as an rlconform Batch: NeMo-RL PackedTensors become rlconform
    ones; tensors are kept as they came back; anything else is an error naming the field."""
    import numpy as np
    import torch

    from rlconform.reference_impl.batch import Batch
    from rlconform.reference_impl.objects import ObjectColumn

    NPT = nemo().PackedTensor
    fields = {}
    for name, v in data.items():
        if name in drop:
            continue
        if isinstance(v, NPT):
            pd = (pack_dims or {}).get(name, 1 if v.dim_to_pack == 1 else 0)
            fields[name] = from_nemo_packed(v, pd)
        elif isinstance(v, torch.Tensor):
            fields[name] = v
        elif isinstance(v, np.ndarray) and v.dtype == object:
            if v.ndim != 1:
                raise ValueError(f"NeMo-RL returned object column {name!r} with shape "
                                 f"{tuple(v.shape)}; a per-row column is 1-D")
            fields[name] = ObjectColumn(list(v))
        else:
            raise TypeError(f"NeMo-RL returned field {name!r} as {type(v).__name__}, not a tensor, "
                            "PackedTensor or object array")
    return Batch(fields, family)


def _pack_dims(batch) -> dict[str, int]:
    from rlconform.reference_impl.packed import PackedTensor

    return {n: v.pack_dim for n, v in batch.fields.items() if isinstance(v, PackedTensor)}


def _td(columns: dict, n: int):
    from tensordict import TensorDict

    return TensorDict(dict(columns), batch_size=[n])


# -- transport ------------------------------------------------------------------------------
class NemoRLTransport:
    """rlconform's transport over NeMo-RL's NoOpDataPlaneClient (see the module docstring)."""

    def __init__(self) -> None:
        self._nr = nemo()
        self._client = self._nr.noop.NoOpDataPlaneClient()
        self._registered: set[str] = set()
        self._put_keys: dict[str, dict[str, None]] = {}  # keys put, in order (for list)
        self._receipts: dict[str, list] = {}  # KVBatchMeta receipts per partition

    def put(self, partition: str, keys: Sequence[str], columns: dict,
            tags: Sequence[dict] | None = None) -> None:
        keys = list(keys)
        if partition not in self._registered:
            self._client.register_partition(partition, fields=list(columns),
                                            num_samples=len(keys), consumer_tasks=[])
            self._registered.add(partition)
        receipt = self._client.put_samples(
            keys, partition, fields=_td(columns, len(keys)) if columns else None,
            tags=None if tags is None else list(tags))
        self._receipts.setdefault(partition, []).append(receipt)
        self._put_keys.setdefault(partition, {}).update(dict.fromkeys(keys))

    def get(self, partition: str, keys: Sequence[str], select_fields: Sequence[str] | None = None
            ) -> tuple[dict, list[dict]]:
        keys = list(keys)
        td = self._client.get_samples(keys, partition,
                                      None if select_fields is None else list(select_fields))
        columns = {name: td[name] for name in td.keys()}
        merged: dict[str, dict] = {}
        for receipt in self._receipts.get(partition, []):
            for i, k in enumerate(receipt.sample_ids):
                entry = merged.setdefault(k, {})
                if receipt.tags is not None:
                    entry.update(receipt.tags[i])
        return columns, [copy.deepcopy(merged.get(k, {})) for k in keys]

    def list(self, partition: str) -> list[str]:
        if partition not in self._registered:
            raise KeyError(f"partition {partition!r} does not exist")
        present = []
        for k in self._put_keys.get(partition, {}):
            try:
                self._client.get_samples([k], partition, [])
            except KeyError as exc:
                if exc.args and exc.args[0] == partition:  # the partition itself is gone
                    raise KeyError(f"partition {partition!r} does not exist") from None
                continue
            present.append(k)
        return present

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> None:
        self._client.clear_samples(None if keys is None else list(keys), partition)
        if keys is None:
            self._registered.discard(partition)
            self._put_keys.pop(partition, None)
            self._receipts.pop(partition, None)
        else:
            for k in keys:
                self._put_keys.get(partition, {}).pop(k, None)

    def close(self) -> None:
        self._client.close()


# -- codec ----------------------------------------------------------------------------------
class NemoRLCodec:
    """encode: NeMo-RL's rollout write (kv_first_write); decode: its worker read (materialize)."""

    name = "nemo-rl"

    def __init__(self, pixel_dtype=None):
        self._nr = nemo()
        self.pixel_dtype = pixel_dtype

    def encode(self, batch):
        import torch

        from rlconform.reference_impl.codec import WireBatch

        nr = self._nr
        n = batch.batch_size
        bdd = to_bdd(batch, {SAMPLE_MASK: torch.ones(n, dtype=torch.float32)})
        if self.pixel_dtype is not None:  # NeMo-RL's policy-dtype cast of pixel media
            bdd.update(bdd.get_multimodal_dict(as_tensors=False, pixel_dtype=self.pixel_dtype))
        capture = _WireCapture(nr)
        partition = f"rlc-{uuid.uuid4().hex[:8]}"
        capture.register_partition(partition, fields=[], num_samples=n, consumer_tasks=[])
        meta = nr.column_io.kv_first_write(
            bdd, sample_ids=[f"s{i}" for i in range(n)], dp_client=capture,
            partition_id=partition, task_name=partition)
        columns = {name: capture.fields[name] for name in capture.fields.keys()}
        tags = meta.tags if meta.tags is not None else [{} for _ in range(n)]
        return WireBatch(columns, [dict(t) for t in tags])

    def decode(self, wire):
        data = self._nr.codec.materialize(_td(wire.columns, len(wire.tags)), layout="padded")
        return from_bdd(data, None, drop=(SAMPLE_MASK,))


def _WireCapture(nr):
    """NeMo-RL's NoOp client that also keeps the TensorDict and tags put_samples received."""

    class WireCapture(nr.noop.NoOpDataPlaneClient):
        fields = None
        tags = None

        def put_samples(self, sample_ids, partition_id, fields=None, tags=None):
            self.fields, self.tags = fields, tags
            return super().put_samples(sample_ids, partition_id, fields=fields, tags=tags)

    return WireCapture()


# -- meta -----------------------------------------------------------------------------------
class NemoRLMeta:
    """rlconform's meta surface over NeMo-RL's KVBatchMeta (see the module docstring)."""

    def __init__(self, partition, keys, fields, seq_lens, tags, extra=None):
        self._m = nemo().KVBatchMeta(
            partition_id=partition, task_name=None, sample_ids=list(keys), fields=list(fields),
            sequence_lengths=list(seq_lens), extra_info=dict(extra or {}), tags=tags)

    @classmethod
    def _wrap(cls, m) -> NemoRLMeta:
        out = cls.__new__(cls)
        out._m = m
        return out

    # the views BatchMeta has
    partition = property(lambda self: self._m.partition_id)
    keys = property(lambda self: self._m.sample_ids)
    fields = property(lambda self: self._m.fields)
    seq_lens = property(lambda self: self._m.sequence_lengths)
    tags = property(lambda self: self._m.tags)
    extra = property(lambda self: self._m.extra_info)

    @property
    def kv_meta(self):
        """The NeMo-RL KVBatchMeta itself."""
        return self._m

    def __len__(self) -> int:
        return self._m.size

    def subset(self, indices):
        return self._wrap(self._m.subset(list(indices)))

    def slice(self, start: int, stop: int):
        return self._wrap(self._m.slice(start, stop))

    @classmethod
    def concat(cls, metas):
        metas = list(metas)
        return type(metas[0])._wrap(metas[0]._m.concat(*[m._m for m in metas[1:]]))

    def drop(self, *names: str):
        return self._wrap(dataclasses.replace(
            self._m, fields=[f for f in (self._m.fields or []) if f not in names]))

    def with_fields(self, *names: str):
        return self._wrap(self._m.with_fields(list(names)))

    def stamp_tags(self, tags):
        """KVBatchMeta.stamp_tags takes columns ({name: per-row values}) and stamps in place:
        per-row dicts become columns, and the stamp goes on `with_fields([])`'s copy."""
        n = len(self)
        rows = [tags] * n if isinstance(tags, dict) else list(tags)
        if len(rows) != n:
            raise ValueError(f"stamp_tags got {len(rows)} tags for {n} keys")
        names = list(dict.fromkeys(k for r in rows for k in r))
        lacking = [i for i, r in enumerate(rows) if set(r) != set(names)]
        if lacking:
            raise ValueError(f"KVBatchMeta.stamp_tags stamps whole columns; rows {lacking[:8]} "
                             f"lack some of {names}")
        out = self._m.with_fields([])
        out.stamp_tags({k: [r[k] for r in rows] for k in names})
        return self._wrap(out)

    def shard_for_dp(self, world: int):
        shards, unsorted = nemo().preshard.shard_meta_for_dp(self._m, dp_world=world)
        inverse = list(unsorted) if unsorted is not None else list(range(len(self)))
        return [self._wrap(s) for s in shards], inverse


# -- batch_ops ------------------------------------------------------------------------------
class NemoRLBatchOps:
    """rlconform's batch_ops over NeMo-RL's BatchedDataDict (see the module docstring)."""

    name = "nemo-rl"

    def __init__(self) -> None:
        self._nr = nemo()

    def truncate(self, batch, max_len: int):
        data = to_bdd(batch)
        data.truncate_tensors(dim=1, truncated_len=max_len)
        return from_bdd(data, batch.family, _pack_dims(batch))

    def pad_to(self, batch, seq_len: int):
        from rlconform.reference_impl.registry import FIELDS, Kind

        nr = self._nr
        data = to_bdd(batch)
        wire = nr.codec.pack_jagged_fields(dict(data), lengths=batch.seq_lens,
                                           token_aligned_fields=nr.column_io.TOKEN_ALIGNED_FIELDS)
        pads = {n: FIELDS[n].pad_value for n in batch.fields
                if n in FIELDS and FIELDS[n].kind is Kind.PER_TOKEN}
        out = nr.codec.materialize(wire, layout="padded", pad_value_dict=pads,
                                   pad_to_seqlen=seq_len)
        return from_bdd(out, batch.family, _pack_dims(batch))

    def validate(self, batch) -> None:
        self._nr.check_sequence_dim()(to_bdd(batch))

    def stage_fields(self, stage) -> list[str]:
        """The fields the stage's worker fetches (TQPolicy._logprob_dispatch / train_from_meta)."""
        s = self._nr.schema
        seed = s.DP_TRAIN_FIELDS if getattr(stage, "value", stage) == "train" else s.LP_SEED_FIELDS
        return s.fields_with_optional_routed_experts(seed, enabled=False)

    def multimodal_inputs(self, batch, stage, dtype=None) -> dict:
        data = to_bdd(batch)
        fetched = self._nr.BatchedDataDict({k: data[k] for k in self.stage_fields(stage)
                                            if k in data})
        got = fetched.get_multimodal_dict(as_tensors=True, pixel_dtype=dtype)
        return {k: v for k, v in got.items() if v is not None}  # None: no media (legacy)


# -- the backend ------------------------------------------------------------------------------
def _version() -> str:
    nr = nemo()
    root = Path(nr.nemo_rl.__file__).resolve().parent.parent
    commit = ""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=7", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    ver = getattr(nr.nemo_rl, "__version__", "?")
    return f"NeMo-RL {ver}" + (f" at commit {commit}" if commit else "")


NOTES = {
    "trainer": "not wrapped: NeMo-RL's trainers (TQPolicy, DTensor/Megatron policy workers) "
               "need Ray worker groups and GPUs; its per-stage fetch lists are wrapped as "
               "batch_ops.multimodal_inputs instead",
    "rollout": "not wrapped: NeMo-RL generates with vLLM/SGLang engines (GPU); its rollout "
               "write (column_io.kv_first_write) is the codec's encode",
    "object_columns": "NoOpDataPlaneClient.put_samples rejects non-tensor leaves ('No pickle on "
                      "the bus'); only the TransferQueue adapter passes NonTensorStack leaves",
    "batch_algebra": "not wrapped yet: BatchedDataDict.select_indices / from_batches / slice "
                     "are NeMo-RL's select / concat / split (a later adapter version)",
    "micro_batching": "BatchedDataDict.make_microbatch_iterator takes a micro-batch size that "
                      "must divide the batch (an assert), not a count of near-equal parts, and "
                      "does not shuffle; the dynamic-shape and packing iterators need the "
                      "policy's token budgets",
    "multiprocess": "NoOpDataPlaneClient is a dict inside one process: rank processes cannot "
                    "reopen it by an address; NeMo-RL's TransferQueue client is not wrapped",
}


def backend() -> Backend:
    """The `nemo-rl` backend; raises ImportError saying what is missing when nemo_rl is not
    importable (`rlconform backends` and `--backend nemo-rl` print it)."""
    nr = nemo()
    nr.check_sequence_dim()  # import it now, so the description says how
    return Backend(
        name="nemo-rl",
        description=f"{_version()}: NoOpDataPlaneClient transport, kv_first_write/materialize "
                    "codec, KVBatchMeta + shard_meta_for_dp meta, BatchedDataDict/PackedTensor "
                    "batch ops with check_sequence_dim and the policy's per-stage fetch lists "
                    f"(check_sequence_dim: {nr.validator_import})",
        transport=NemoRLTransport,
        codec=NemoRLCodec,
        meta=lambda: NemoRLMeta,
        batch_ops=NemoRLBatchOps,
        capabilities=frozenset({"partitions", "bfloat16", "dp"}),
        notes=dict(NOTES),
        version=_version(),
    )
