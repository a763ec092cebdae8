"""NeMo-RL (github.com/NVIDIA-NeMo/RL) as an rlconform backend: its own data path, version by version.

NeMo-RL is not on the package registry; this adapter imports `nemo_rl` from whatever is
installed or on PYTHONPATH, or from `$NEMO_RL_SRC` (a checkout or a `git archive` export, which
it puts on sys.path). Nothing of NeMo-RL is copied here.

What a NeMo-RL caller holds, and where it enters: the rollout produces one message log per
sample (`{"token_ids": ..., <per-token maps>, <media key>: PackedTensor(<the processor's tensor
for that sample>)}`, as `data/multimodal_utils.py` `extract_multimodal_model_inputs` wraps a
processor's output); everything after that is NeMo-RL's code:
- the flatten, `data/llm_message_utils.py` `batched_message_log_to_flat_message` (which builds
  the batch's `PackedTensor`s by `PackedTensor.flattened_concat` and `empty_rows_like`);
- the rollout write of `experience/sync_rollout_actor.py` `SyncRolloutActor.rollout_to_tq`:
  `flat.get_multimodal_dict(as_tensors=False, ...)` and the version's media step (below), then
  `data_plane/column_io.py` `kv_first_write` (-> `codec.pack_jagged_fields`, `put_samples`);
  the columns the workers and the driver add later go through `column_io.write_columns`;
- the worker read: `column_io.read_columns` (`get_samples` -> `codec.materialize`, padded to the
  meta's `GLOBAL_FORWARD_PAD_SEQLEN`), then `BatchedDataDict.get_multimodal_dict(as_tensors=True)`
  as the policy workers build their model inputs;
- the policy's stage fetch lists (`models/policy/tq_policy.py` `TQPolicy._logprob_dispatch`,
  `train_from_meta`): `schema.LP_SEED_FIELDS` / `DP_TRAIN_FIELDS` through
  `schema.fields_with_optional_routed_experts`, plus `_present_multimodal_fields(meta)` where the
  version has it.

`rollout_to_tq` itself cannot be called: it is a Ray actor method that first runs generation and
the environments (vLLM, reward workers) and only then assembles its bulk batch inline. The
adapter therefore reads which media step that method takes from its source (`ast`, never by
commit) and takes exactly that step, with NeMo-RL's own functions:
- "wire encoder" (the head of PR #2957): every multimodal value of
  `get_multimodal_dict(as_tensors=False, pixel_dtype=<policy dtype>)` goes through
  `multimodal_utils.encode_multimodal_for_wire` (`PackedTensor.to_nested_wire`: a jagged column
  plus a `<key>__lengths` companion); the worker read rebuilds `PackedTensor`s in
  `get_multimodal_dict` (`PackedTensor.from_nested_wire`).
- "tensor filter" (main at 7ea279a): only values of `get_multimodal_dict(as_tensors=False)` that
  are `torch.Tensor`s are written (`PackedTensor` media are not).
The stage fetch lists are found the same way: `_present_multimodal_fields` is run from
`tq_policy.py` itself (its definition and the registries it reads, compiled from that file), since
importing that module pulls the GPU policy stack (vLLM worker, pynvml, Ray actors).

Surfaces:
- transport -> `data_plane/adapters/noop.py` `NoOpDataPlaneClient` (`register_partition` once per
  partition as `TQPolicy.prepare_step` does, `put_samples`, `get_samples`, `clear_samples`); its
  API returns no tags from a read and lists no keys, so get's tags are those of the `KVBatchMeta`
  receipts `put_samples` returned and `list` asks `get_samples(select_fields=[])` key by key.
- codec -> encode: the rollout write above into a NoOp client that keeps what each `put_samples`
  received (the wire); decode: the worker read of those columns (`materialize`, then
  `get_multimodal_dict(as_tensors=False)` for the media).
- meta -> `interfaces.KVBatchMeta` (`subset`, `slice`, `concat`, `with_fields`, `stamp_tags`;
  a field drop is `dataclasses.replace(meta, fields=...)`, how `TQPolicy` narrows a meta) and
  `preshard.shard_meta_for_dp`.
- batch_ops -> the worker's batch as the data plane delivers it (rollout write, then
  `read_columns` of every written field): truncate -> `BatchedDataDict.truncate_tensors(dim=1)`;
  pad_to -> `read_columns` with the meta stamped `GLOBAL_FORWARD_PAD_SEQLEN` (the forward pad,
  `materialize(pad_to_seqlen=...)`); validate -> `models/automodel/data.py` `check_sequence_dim`;
  multimodal_inputs -> the stage's fetch list, `read_columns`, `get_multimodal_dict(as_tensors=True)`.

Type mapping on the way back: a NeMo-RL `PackedTensor` becomes an rlconform one row by row
(`iter_logical_segments()`, a leading unit dim dropped for `dim_to_pack=1`), a None row None.
"""

from __future__ import annotations

import ast
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

from rlconform.conformance.backend import Backend, PathStep

# NeMo-RL's data path from the rollout's message logs to the policy worker's model inputs, as
# this adapter takes it (docs/backends.md renders it; tests/test_backends_nemo_rl.py checks that
# every entered step is called)
_NR = "nemo_rl"
DATA_PATH = (
    PathStep(f"{_NR}.experience.sync_rollout_actor.SyncRolloutActor.rollout_to_tq", "stubbed",
             "a Ray actor method that first runs generation and the environments (vLLM, reward "
             "workers); the adapter reads its media step from the method's source (ast) and "
             "takes that step with NeMo-RL's functions", "codec"),
    PathStep(f"{_NR}.data.llm_message_utils.batched_message_log_to_flat_message", "entered",
             surface="codec"),
    PathStep(f"{_NR}.distributed.batched_data_dict.BatchedDataDict.get_multimodal_dict",
             "entered", surface="codec"),
    PathStep(f"{_NR}.data_plane.column_io.kv_first_write", "entered", surface="codec"),
    PathStep(f"{_NR}.data_plane.column_io.read_columns", "entered", surface="batch_ops"),
    PathStep(f"{_NR}.data_plane.adapters.noop.NoOpDataPlaneClient.put_samples", "entered",
             surface="transport"),
    PathStep(f"{_NR}.data_plane.adapters.noop.NoOpDataPlaneClient.get_samples", "entered",
             surface="transport"),
    PathStep(f"{_NR}.data_plane.preshard.shard_meta_for_dp", "entered", surface="meta"),
    PathStep(f"{_NR}.distributed.batched_data_dict.BatchedDataDict.truncate_tensors",
             "entered", surface="batch_ops"),
    PathStep(f"{_NR}.models.policy.tq_policy.TQPolicy._present_multimodal_fields", "stubbed",
             "tq_policy imports the GPU policy stack (vLLM worker, pynvml, Ray actors): its "
             "definition and the registries it reads are compiled from that file and run",
             "batch_ops"),
    PathStep(f"{_NR}.data_plane.codec.materialize", "entered", surface="batch_ops"),
    PathStep(f"{_NR}.models.automodel.data.check_sequence_dim", "entered", surface="batch_ops"),
    PathStep(f"{_NR}.models.policy.tq_policy.TQPolicy.train_from_meta", "stubbed",
             "the policy workers' forward and optimizer step need GPUs and a distributed launch "
             "(no trainer surface)"),
)

MISSING = ("nemo-rl: cannot import nemo_rl: put a NeMo-RL checkout on PYTHONPATH "
           "(PYTHONPATH=/path/to/RL, or NEMO_RL_SRC=/path/to/RL) or pip install -e it")
# What NeMo-RL's data path imports beyond rlconform's own dependencies (torch, transformers,
# numpy, pillow), measured by tracing the imports of the modules below: data_plane needs
# tensordict, data/llm_message_utils imports `datasets`, data/multimodal_utils imports `requests`.
REQUIREMENTS = ("tensordict", "datasets", "requests")
# the distribution that provides an importable top-level name, where the two differ
_DIST = {"PIL": "pillow", "yaml": "pyyaml"}
# rlconform's own column, added because kv_first_write takes the batch size from it (the rollout
# actor writes the loss multiplier there); dropped again on decode when the batch had none
SAMPLE_MASK = "sample_mask"
# the data-path files the adapter reads or imports, relative to the checkout root
_FILES = ("nemo_rl/__init__.py", "nemo_rl/data_plane/column_io.py",
          "nemo_rl/data/llm_message_utils.py", "nemo_rl/experience/sync_rollout_actor.py",
          "nemo_rl/models/policy/tq_policy.py")
# the rollout actor's media steps (see the module docstring)
WIRE_ENCODER = "wire encoder"
TENSOR_FILTER = "tensor filter"
# rlconform's per-token fields that sit in a NeMo-RL message log (under NeMo-RL's key), as the
# rollout's message logs hold them; every other non-media field is written by write_columns
_MESSAGE_KEYS = {"input_ids": "token_ids", "token_mask": "token_loss_mask",
                 "generation_logprobs": "generation_logprobs",
                 "mm_token_type_ids": "mm_token_type_ids", "token_type_ids": "token_type_ids"}


def _check_src(src: str) -> Path:
    """NEMO_RL_SRC must name a NeMo-RL tree: say which path and what is missing under it."""
    root = Path(src).expanduser()
    if not root.is_dir():
        raise ImportError(f"nemo-rl: NEMO_RL_SRC={src!r} is not a directory; point it at a NeMo-RL "
                          "checkout or export (the folder holding nemo_rl/)")
    missing = [f for f in _FILES if not (root / f).is_file()]
    if missing:
        raise ImportError(f"nemo-rl: NEMO_RL_SRC={src!r} ({root.resolve()}) is not a NeMo-RL tree "
                          f"with a data plane: missing {', '.join(missing)}")
    return root.resolve()


def _install_hint(exc: ImportError) -> str:
    name = (getattr(exc, "name", None) or "").split(".")[0]
    if not name or name == "nemo_rl":
        return f"{exc}"
    return (f"it imports {name!r}, which is not installed: pip install {_DIST.get(name, name)} "
            f"(the data path needs {' '.join(REQUIREMENTS)} beyond rlconform's own packages)")


def _calls_in(tree: ast.AST, function: str) -> list[ast.Call]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return [c for c in ast.walk(node) if isinstance(c, ast.Call)]
    return []


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


class _NemoRL:
    """The NeMo-RL modules this adapter calls and the path this version takes, found once."""

    def __init__(self) -> None:
        src = os.environ.get("NEMO_RL_SRC")
        self.src = _check_src(src) if src else None
        if self.src is not None and str(self.src) not in sys.path:
            sys.path.insert(0, str(self.src))
        try:
            import nemo_rl
        except ImportError as exc:
            raise ImportError(f"{MISSING} ({exc})") from exc
        self.root = Path(nemo_rl.__file__).resolve().parent.parent
        if self.src is not None and self.root != self.src:
            raise ImportError(f"nemo-rl: NEMO_RL_SRC={src!r} but nemo_rl was imported from "
                              f"{self.root} (installed, or earlier on sys.path)")
        try:
            from nemo_rl.data import llm_message_utils, multimodal_utils
            from nemo_rl.data_plane import codec, column_io, interfaces, preshard, schema
            from nemo_rl.data_plane.adapters import noop
            from nemo_rl.distributed.batched_data_dict import BatchedDataDict
        except ImportError as exc:
            raise ImportError(f"nemo-rl: nemo_rl ({self.root}) is importable but its data path "
                              f"is not: {_install_hint(exc)}") from exc
        self.nemo_rl = nemo_rl
        self.PackedTensor = multimodal_utils.PackedTensor
        self.multimodal_utils = multimodal_utils
        self.flatten = llm_message_utils.batched_message_log_to_flat_message
        self.BatchedDataDict = BatchedDataDict
        self.codec, self.column_io, self.interfaces = codec, column_io, interfaces
        self.preshard, self.schema, self.noop = preshard, schema, noop
        self.KVBatchMeta = interfaces.KVBatchMeta
        self.media_step, self.rollout_pixel_dtype = self._rollout_media_step()
        self.present_multimodal_fields = self._policy_fetch_extension()
        self._validator = None
        self.validator_import = ""

    # -- which path this version takes (read from its source, never from a commit) ----------
    def _source(self, rel: str) -> tuple[Path, ast.Module]:
        path = self.root / rel
        if not path.is_file():
            raise ImportError(f"nemo-rl: {path} is missing; the adapter follows the rollout "
                              "write and the policy's fetch lists from there")
        return path, ast.parse(path.read_text(), str(path))

    def _rollout_media_step(self) -> tuple[str, bool]:
        """How `SyncRolloutActor.rollout_to_tq` puts the flat batch's media into its bulk
        batch: through `encode_multimodal_for_wire` (and with a `pixel_dtype`), or by keeping
        the tensors of `get_multimodal_dict(as_tensors=False)`."""
        path, tree = self._source("nemo_rl/experience/sync_rollout_actor.py")
        calls = _calls_in(tree, "rollout_to_tq")
        if not calls:
            raise ImportError(f"nemo-rl: {path} has no rollout_to_tq; this NeMo-RL's rollout "
                              "write is not the one the adapter knows")
        names = {_call_name(c) for c in calls}
        media = [c for c in calls if _call_name(c) == "get_multimodal_dict"]
        if not media:
            raise ImportError(f"nemo-rl: {path} rollout_to_tq calls no get_multimodal_dict")
        dtype = any(k.arg == "pixel_dtype" for c in media for k in c.keywords)
        if "encode_multimodal_for_wire" in names:
            if not hasattr(self.multimodal_utils, "encode_multimodal_for_wire"):
                raise ImportError("nemo-rl: rollout_to_tq calls encode_multimodal_for_wire, which "
                                  "nemo_rl.data.multimodal_utils does not define")
            return WIRE_ENCODER, dtype
        return TENSOR_FILTER, dtype

    def _policy_fetch_extension(self):
        """`tq_policy._present_multimodal_fields` when this version's policy has it (and its
        stage dispatch calls it), compiled from tq_policy.py with the registries it reads; else
        None (the fetch lists are the static schema lists)."""
        path, tree = self._source("nemo_rl/models/policy/tq_policy.py")
        name = "_present_multimodal_fields"
        users = [f for f in ("_logprob_dispatch", "train_from_meta")
                 if any(_call_name(c) == name for c in _calls_in(tree, f))]
        if not users:
            return None
        body = []
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    ("nemo_rl.data.", "nemo_rl.data_plane")):
                body.append(node)  # the light registries the definitions read
            elif isinstance(node, ast.FunctionDef) and node.name == name:
                body.append(node)
            elif isinstance(node, ast.Assign) and any(
                    getattr(t, "id", "").startswith("_WIRE_") for t in node.targets):
                body.append(node)
        ns: dict = {"__name__": "nemo_rl.models.policy.tq_policy"}
        exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)  # noqa: S102
        fn = ns.get(name)
        if fn is None:
            raise ImportError(f"nemo-rl: {path} calls {name} in {users} but does not define it")
        return fn

    @property
    def path_label(self) -> str:
        fetch = ("static fetch lists + _present_multimodal_fields"
                 if self.present_multimodal_fields else "static fetch lists")
        dtype = ", pixel_dtype at the write" if self.rollout_pixel_dtype else ""
        return f"rollout media step: {self.media_step}{dtype}; {fetch}"

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
            except ImportError as again:
                raise ImportError(f"nemo-rl: {name} does not import: {_install_hint(again)}"
                                  ) from again
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


# -- NeMo-RL's values back as rlconform's ---------------------------------------------------------
def from_nemo_packed(npt, pack_dim: int):
    """A NeMo-RL PackedTensor as an rlconform PackedTensor, row by row; physical sharing kept."""
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


# -- the rollout write and the worker read -----------------------------------------------------
def _processor_value(segs: list, pack_dim: int):
    """A sample's media of one field as a processor emits them for that sample: its images'
    tensors joined on the packing dim (Qwen-VL `pixel_values [patches, 1176]`, grids
    `[n_images, 3]`, SmolVLM tiles `[1, tiles, 3, H, W]`), or one tensor per image where their
    trailing dims differ (images of several sizes)."""
    import torch

    one = (lambda t: t.unsqueeze(0)) if pack_dim == 1 else (lambda t: t)
    if len({tuple(s.shape[1:]) for s in segs}) > 1:
        return [one(s) for s in segs]
    return one(segs[0] if len(segs) == 1 else torch.cat(segs))


def _message_logs(batch) -> list[list[dict]]:
    """The message log each sample's rollout holds: one message with its tokens, its per-token
    maps and, per media field with media in that sample, `PackedTensor(<the processor's value
    for this sample>, dim_to_pack=...)`, as `extract_multimodal_model_inputs` wraps a processor
    output. A field without media in a sample is absent from its message, as in a text-only
    sample's; no registry of rlconform's decides what enters (an unregistered field enters
    like any other, and NeMo-RL's code decides what happens to it)."""
    import torch

    from rlconform.reference_impl.packed import PackedTensor as RPT

    NPT = nemo().PackedTensor
    lens = batch.seq_lens.tolist()
    packed = {n: v for n, v in batch.fields.items() if isinstance(v, RPT)}
    values = [{name: _processor_value(v.row_segments(i), v.pack_dim)
               for name, v in packed.items() if not v.is_none(i)} for i in range(len(lens))]
    # NeMo-RL sets pad_to_max_shape per processor and key, for every sample alike
    # (multimodal_utils.get_pad_to_max_shape: the placeholder-style processors' pixel_values,
    # whose tiles differ in size); without it its as_tensor and to_nested_wire reject values
    # whose trailing dims differ. The adapter sets it for exactly the fields whose values do.
    trailing: dict[str, set] = {}
    for row in values:
        for name, value in row.items():
            for t in value if isinstance(value, list) else [value]:
                trailing.setdefault(name, set()).add(tuple(t.shape[1:]))
    padded = {name for name, shapes in trailing.items() if len(shapes) > 1}
    logs = []
    for i, n in enumerate(lens):
        msg: dict = {"role": "user", "content": ""}
        for name, key in _MESSAGE_KEYS.items():
            v = batch.fields.get(name)
            if isinstance(v, torch.Tensor) and v.dim() == 2:
                msg[key] = v[i, :n]
        for name, value in values[i].items():
            msg[name] = NPT(value, dim_to_pack=packed[name].pack_dim,
                            pad_to_max_shape=name in padded)
        logs.append([msg])
    return logs


class _Recorder:
    """NeMo-RL's NoOp client, keeping every TensorDict `put_samples` received (the wire)."""

    def __new__(cls):
        nr = nemo()

        class Recorder(nr.noop.NoOpDataPlaneClient):
            def __init__(self):
                super().__init__()
                self.puts: list = []

            def put_samples(self, sample_ids, partition_id, fields=None, tags=None):
                self.puts.append((list(sample_ids), fields, tags))
                return super().put_samples(sample_ids, partition_id, fields=fields, tags=tags)

        return Recorder()


def rollout_write(batch, client, partition: str, pixel_dtype=None):
    """NeMo-RL's rollout write of `batch` into `client`; returns the `KVBatchMeta` of the write.

    The flatten is NeMo-RL's (`batched_message_log_to_flat_message` of the samples' message logs).
    The bulk batch is assembled as `SyncRolloutActor.rollout_to_tq` assembles it inline: the
    text columns, then this version's media step over `flat.get_multimodal_dict(as_tensors=False)`
    (see the module docstring), then any per-row object column as `np.asarray(v, dtype=object)`;
    `kv_first_write` puts it. The text columns are the batch's own tensors (rollout_to_tq takes
    them from the same flatten, which would turn a caller's int64 lengths into int32), and the
    columns NeMo-RL's workers and driver add after the rollout (logprobs, advantages, attention
    masks, position ids) go through `column_io.write_columns`, as they do there.
    """
    import numpy as np
    import torch

    from rlconform.reference_impl.packed import PackedTensor as RPT
    from rlconform.reference_impl.registry import Kind, spec

    nr = nemo()
    n = batch.batch_size
    if n == 0:
        raise ValueError(f"cannot write an empty batch (fields {sorted(batch.fields)})")
    flat, _lengths = nr.flatten(_message_logs(batch))
    bulk = nr.BatchedDataDict({
        name: batch[name] for name in ("input_ids", "input_lengths", "generation_logprobs",
                                       "token_mask") if name in batch.fields})
    bulk[SAMPLE_MASK] = batch[SAMPLE_MASK] if SAMPLE_MASK in batch.fields \
        else torch.ones(n, dtype=torch.float32)
    if nr.media_step == WIRE_ENCODER:
        kw = {"pixel_dtype": pixel_dtype} if nr.rollout_pixel_dtype else {}
        for k, v in flat.get_multimodal_dict(as_tensors=False, **kw).items():
            for wk, wv in nr.multimodal_utils.encode_multimodal_for_wire(k, v):
                bulk[wk] = wv
    else:
        kw = {"pixel_dtype": pixel_dtype} if nr.rollout_pixel_dtype else {}
        for k, v in flat.get_multimodal_dict(as_tensors=False, **kw).items():
            if isinstance(v, torch.Tensor):
                bulk[k] = v
    later = {}
    for name, v in batch.fields.items():
        if name in bulk or isinstance(v, RPT):
            continue
        if spec(name).kind is Kind.OBJECT:  # rollout_to_tq's pass-through of non-tensor fields
            bulk[name] = np.asarray(list(v.rows), dtype=object)
        elif name not in _MESSAGE_KEYS:
            later[name] = v
    meta = nr.column_io.kv_first_write(bulk, sample_ids=[f"s{i}" for i in range(n)],
                                       dp_client=client, partition_id=partition,
                                       task_name=partition)
    if later:
        nr.column_io.write_columns(client, meta, later)
        meta = dataclasses.replace(meta, fields=list(meta.fields or []) + list(later))
    return meta


def worker_read(client, meta, fields: Sequence[str], pad_to_seqlen: int = 0):
    """`column_io.read_columns` as a policy worker reads its batch (padded layout)."""
    nr = nemo()
    if pad_to_seqlen:
        meta = dataclasses.replace(meta, extra_info={
            **(meta.extra_info or {}), nr.schema.GLOBAL_FORWARD_PAD_SEQLEN: int(pad_to_seqlen)})
    return nr.column_io.read_columns(client, meta, list(fields))


def _media_back(data, batch_like=None):
    """The worker batch `data` with its media as NeMo-RL's `get_multimodal_dict(as_tensors=False)`
    gives them (PackedTensors; on the wire-encoder path rebuilt from the jagged column and its
    `__lengths` companion, which is dropped), as an rlconform Batch."""
    nr = nemo()
    media = data.get_multimodal_dict(as_tensors=False)
    suffix = getattr(nr.PackedTensor, "LENGTHS_SUFFIX", None)
    out = {k: v for k, v in data.items() if not (suffix and k.endswith(suffix))}
    out.update(media)
    family = batch_like.family if batch_like is not None else None
    pack_dims = _pack_dims(batch_like) if batch_like is not None else None
    drop = () if batch_like is not None and SAMPLE_MASK in batch_like.fields else (SAMPLE_MASK,)
    return from_bdd(out, family, pack_dims, drop=drop)


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
        import torch

        for name, col in columns.items():
            # put_samples takes a TensorDict, and building one is this adapter's step: the
            # TensorDict constructor would turn a list into a float tensor (densified, cast)
            # before NeMo-RL saw it, so a column that is not a tensor is refused here
            if not isinstance(col, torch.Tensor):
                raise TypeError(f"column {name!r} is a {type(col).__name__}; put_samples takes "
                                "a TensorDict of tensors")
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
        # NeMo-RL's client has no list: this one is the adapter's own (it probes the keys it put
        # with get_samples), so it refuses the names the contract refuses itself
        from rlconform.reference_impl.dataplane import check_name

        check_name("partition", partition)
        if partition not in self._registered:
            return []  # a partition holding no keys lists [] (the transport contract)
        present = []
        for k in self._put_keys.get(partition, {}):
            if not isinstance(k, str):
                # a key the contract refuses (bytes, an int) that put_samples accepted: that put
                # is the finding (a waiver names it); this list returns names, as the contract's
                continue
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
def _fresh_client():
    client = _Recorder()
    partition = f"rlc-{uuid.uuid4().hex[:8]}"
    client.register_partition(partition, fields=[], num_samples=0, consumer_tasks=[])
    return client, partition


class NemoRLCodec:
    """encode: NeMo-RL's rollout write (`rollout_write`); decode: its worker read of the wire
    (`materialize`, `get_multimodal_dict`). The wire is what `put_samples` received; its tags are
    the rollout write's (none: rollout_to_tq passes no tags)."""

    name = "nemo-rl"

    def __init__(self, pixel_dtype=None):
        self._nr = nemo()
        self.pixel_dtype = pixel_dtype

    def encode(self, batch):
        from rlconform.reference_impl.codec import WireBatch

        client, partition = _fresh_client()
        meta = rollout_write(batch, client, partition, self.pixel_dtype)
        columns: dict = {}
        for _keys, fields, _tags in client.puts:
            if fields is not None:
                columns.update({name: fields[name] for name in fields.keys()})
        tags = meta.tags if meta.tags is not None else [{} for _ in range(len(batch))]
        return WireBatch(columns, [dict(t) for t in tags])

    def decode(self, wire):
        data = self._nr.codec.materialize(_td(wire.columns, len(wire.tags)), layout="padded")
        return _media_back(data)


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
    """rlconform's batch_ops on the worker's batch as NeMo-RL's data plane delivers it."""

    name = "nemo-rl"

    def __init__(self) -> None:
        self._nr = nemo()

    def _delivered(self, batch, pad_to_seqlen: int = 0, pixel_dtype=None):
        """The rollout write of `batch`, then a worker's `read_columns` of every written field."""
        client, partition = _fresh_client()
        meta = rollout_write(batch, client, partition, pixel_dtype)
        return worker_read(client, meta, meta.fields or [], pad_to_seqlen), meta, client

    def truncate(self, batch, max_len: int):
        data, _meta, _client = self._delivered(batch)
        data.truncate_tensors(dim=1, truncated_len=max_len)
        return _media_back(data, batch)

    def pad_to(self, batch, seq_len: int):
        data, _meta, _client = self._delivered(batch, pad_to_seqlen=seq_len)
        return _media_back(data, batch)

    def validate(self, batch) -> None:
        data, _meta, _client = self._delivered(batch)
        self._nr.check_sequence_dim()(data)

    def stage_fields(self, stage, meta=None) -> list[str]:
        """The fields the stage's worker fetches, as `TQPolicy._logprob_dispatch` /
        `train_from_meta` list them for `meta` (the rollout write's)."""
        s = self._nr.schema
        seed = s.DP_TRAIN_FIELDS if getattr(stage, "value", stage) == "train" else s.LP_SEED_FIELDS
        extra = []
        if self._nr.present_multimodal_fields is not None and meta is not None:
            extra = self._nr.present_multimodal_fields(meta)
        return s.fields_with_optional_routed_experts([*seed, *extra], enabled=False)

    def multimodal_inputs(self, batch, stage, dtype=None) -> dict:
        """The rollout write (with the policy dtype where the version casts there), the stage's
        fetch of what was written, and the workers' `get_multimodal_dict(as_tensors=True)`.

        The fetch asks only for listed fields the rollout wrote: the batches under test hold part
        of a step's columns (prev_logprobs and advantages are written later), and a fetch of an
        unwritten field raises in every NeMo-RL client."""
        client, partition = _fresh_client()
        meta = rollout_write(batch, client, partition, dtype)
        written = set(meta.fields or [])
        fields = [f for f in self.stage_fields(stage, meta) if f in written]
        data = worker_read(client, meta, fields)
        got = data.get_multimodal_dict(as_tensors=True)
        return {k: v for k, v in got.items() if v is not None}  # None: no media (legacy)


# -- the backend ------------------------------------------------------------------------------
def nemo_rl_commit() -> str:
    """The NeMo-RL commit under test: `$NEMO_RL_COMMIT` (for an export, which has no .git), else
    the checkout's `git rev-parse HEAD`, else "unknown"; never a guess."""
    given = os.environ.get("NEMO_RL_COMMIT", "").strip()
    if given:
        return given
    root = nemo().root
    if (root / ".git").exists():
        try:
            out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=9", "HEAD"],
                                 capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown"


def _version() -> str:
    nr = nemo()
    ver = getattr(nr.nemo_rl, "__version__", None) or "?"
    return f"NeMo-RL {ver} at commit {nemo_rl_commit()}"


def expectations_name() -> str:
    """The bundled waiver file for the path this NeMo-RL takes: `nemo-rl` (the tensor-filter
    rollout write of main at 7ea279a) or `nemo-rl-pr2957` (the wire encoder of PR #2957's head).
    Chosen by the entry points found, not by the commit, so an export without a commit gets the
    waivers of the code it holds."""
    return "nemo-rl-pr2957" if nemo().media_step == WIRE_ENCODER else "nemo-rl"


NOTES = {
    "trainer": "not wrapped: NeMo-RL's trainers (TQPolicy, DTensor/Megatron policy workers) "
               "need Ray worker groups and GPUs; its per-stage fetch lists and the workers' "
               "get_multimodal_dict are wrapped as batch_ops.multimodal_inputs instead",
    "rollout": "not wrapped: NeMo-RL generates with vLLM/SGLang engines (GPU); its rollout "
               "write (SyncRolloutActor.rollout_to_tq's media step, kv_first_write) is the "
               "codec's encode",
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
    "batch_union": "BatchedDataDict (a UserDict) has no union of two batches over the same rows: "
                   "callers merge with dict.update, which overwrites a shared key unchecked",
}


def backend() -> Backend:
    """The `nemo-rl` backend; raises ImportError saying what is missing when nemo_rl (or its
    data path) is not importable (`rlconform backends` and `--backend nemo-rl` print it)."""
    nr = nemo()
    nr.check_sequence_dim()  # import it now, so the description says how
    return Backend(
        name="nemo-rl",
        description=f"{_version()} from {nr.root} ({nr.path_label}): NoOpDataPlaneClient "
                    "transport; codec = batched_message_log_to_flat_message, the rollout "
                    "actor's media step, kv_first_write / write_columns, then materialize and "
                    "get_multimodal_dict; KVBatchMeta + shard_meta_for_dp meta; batch ops on the "
                    "worker's read_columns batch with truncate_tensors, check_sequence_dim and "
                    f"the policy's per-stage fetch lists (check_sequence_dim: {nr.validator_import})",
        transport=NemoRLTransport,
        codec=NemoRLCodec,
        meta=lambda: NemoRLMeta,
        batch_ops=NemoRLBatchOps,
        capabilities=frozenset({"partitions", "bfloat16", "dp", "truncation", "padding"}),
        notes=dict(NOTES),
        version=_version(),
        expectations=expectations_name(),
        data_path=DATA_PATH,
    )
