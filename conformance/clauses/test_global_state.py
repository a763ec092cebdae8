"""No hidden effects: no operation of any surface changes process-global state.

torch's, Python's and NumPy's global RNGs, the default dtype and device, grad, inference and
anomaly mode, the deterministic-algorithm, cuDNN and TF32 flags, the thread counts and the
environment are shared by everything in the process (_globals.py lists what is read). An engine
that seeds torch's RNG with its request seed (`transformers.set_seed`) makes every later
dropout mask and shuffle in the process repeat; a trainer step that leaves grad mode off makes
the next backward record nothing; a codec that sets the default dtype gives every later
`torch.tensor(float)` another dtype. None of it raises or shows in the operation's result.

One clause per surface (DP-, WIRE-, META-, BATCH-, TRAIN-, GEN-NO-GLOBAL-EFFECTS), not one
clause with a cell per surface: a clause applies where its surface is provided, so a backend
that replaces only its store is judged on its store alone, and its report's verdict on the
store is not the reference's verdict on the other five.

Each operation runs between a snapshot and a comparison; the first that changed anything fails
the test, naming the operation and each piece of state as `before -> after`, after which the
state is put back (a failing backend's change does not spread to the clauses run after it). A
backend that must change something declares it per surface (`Backend.changes_globals`, with
why): a declared change is allowed and recorded as a metric of the clause, per piece of state
(how many operations changed it). An operation that raises is held to the property too.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from rlconform.conformance.clauses._gc import new_trainer
from rlconform.conformance.engine.items import NA_PREFIX
from rlconform.fixtures.strategies import HeteroRecipe, Recipe
from rlconform.reference_impl.grpo import mint_keys, put_advantages, write_rollout
from rlconform.reference_impl.registry import Stage

from . import _globals
from ._check import Attempts, sample_meta

# two batches for the data-plane surfaces: packed media of unequal sizes with M-RoPE
# position_ids, and per-row dict media (object columns: None, {}, images, videos, both)
PACKED = Recipe("qwen2_vl", "ragged", "ragged", rows=4, position_ids=3, seed=5)
DICT_ROWS = HeteroRecipe("qwen2_vl", "multi_modal_inputs", seed=5)
CASES = [pytest.param(PACKED, id="packed_media"), pytest.param(DICT_ROWS, id="dict_rows")]
FAMILY = "qwen2_vl"  # the trainer's and engine's: media of several sizes, M-RoPE
IMAGES = (1, 2, 1)  # images per prompt for the trainer's batch (test_trainer_order's)


class _Watch(Attempts):
    """Runs one surface's operations, each between a snapshot of the process-global state and
    a comparison."""

    def __init__(self, backend, surface: str):
        super().__init__()
        self.surface = surface
        self.declared = dict(backend.changes_globals.get(surface, {}))
        self.declared_changes: dict[str, list[str]] = {}

    def call(self, what: str, fn):
        """`fn()`, failing if it changed undeclared global state; its result, or None when it
        raised (raising is judged by other clauses)."""
        keep = _globals.saved()
        before = _globals.snapshot()
        out = self.attempt(what, fn)
        changed = _globals.changes(before, _globals.snapshot())
        for name in changed.keys() & self.declared.keys():
            self.declared_changes.setdefault(name, []).append(what)
        hidden = {k: v for k, v in changed.items() if k not in self.declared}
        if hidden:
            _globals.restore(keep)
            allowed = f" (it declares {sorted(self.declared)})" if self.declared else ""
            raise AssertionError(
                f"{self.surface} {what} changed process-global state the backend does not "
                f"declare{allowed}: " + "; ".join(f"{k}: {v}" for k, v in hidden.items()))
        return out

    def finish(self, record_metric) -> None:
        """Something ran; each declared change seen is recorded (state -> operations)."""
        assert self.ran, f"no {self.surface} operation ran (each raised): {self.raised}"
        for name in sorted(self.declared):
            record_metric(f"declared_global_change.{name}",
                          len(self.declared_changes.get(name, ())))


def _needs_object_columns(backend, case) -> None:
    """Per-row dict media are object columns: a backend that does not declare them is not
    asked to carry them (WIRE-OBJECT judges that), so the case does not apply to it."""
    if case is DICT_ROWS and "object_columns" not in backend.capabilities:
        pytest.skip(f"{NA_PREFIX}per-row dict media need the object_columns capability, "
                    "which the backend does not declare")


def _partition() -> str:
    return f"globals-{uuid.uuid4().hex[:8]}"


# -- transport --------------------------------------------------------------------------------
def _store_ops(watch: _Watch, transport, codec, case, label: str) -> None:
    batch = case.build()
    wire = codec.encode(batch)
    part, keys = _partition(), mint_keys(len(batch), 2)
    adv = codec.encode(batch.replace(advantages=torch.linspace(-1, 1, len(batch))))
    watch.call(f"put ({label})",
               lambda: transport.put(part, keys, wire.columns, wire.tags))
    watch.call("list", lambda: transport.list(part))
    watch.call("get", lambda: transport.get(part, keys, list(wire.columns)))
    watch.call("get of two keys, one twice",
               lambda: transport.get(part, [keys[-1], keys[0], keys[-1]], ["input_ids"]))
    watch.call("put of a further column",
               lambda: transport.put(part, keys, {"advantages": adv.columns["advantages"]}))
    watch.call("get of a key not stored", lambda: transport.get(part, ["absent"], ["input_ids"]))
    watch.call("clear of one key", lambda: transport.clear(part, keys[:1]))
    watch.call("clear of the partition", lambda: transport.clear(part))


@pytest.mark.clause("DP-NO-GLOBAL-EFFECTS")
def test_transport_operations_leave_global_state_alone(backend, transport, codec,
                                                       record_metric):
    watch = _Watch(backend, "transport")
    _store_ops(watch, transport, codec, PACKED, "packed media")
    if "object_columns" in backend.capabilities:
        _store_ops(watch, transport, codec, DICT_ROWS, "dict rows")
    watch.finish(record_metric)


# -- codec ------------------------------------------------------------------------------------
@pytest.mark.clause("WIRE-NO-GLOBAL-EFFECTS")
@pytest.mark.parametrize("case", CASES)
def test_codec_operations_leave_global_state_alone(backend, codec_factory, record_metric, case):
    _needs_object_columns(backend, case)
    watch = _Watch(backend, "codec")
    dtypes = [None] + ([torch.bfloat16] if "bfloat16" in backend.capabilities else [])
    for dtype in dtypes:
        codec = codec_factory(pixel_dtype=dtype) if dtype else codec_factory()
        batch = case.build()
        wire = watch.call(f"encode (pixel_dtype {dtype})",
                          lambda c=codec, b=batch: c.encode(b))
        if wire is not None:
            watch.call(f"decode (pixel_dtype {dtype})", lambda c=codec, w=wire: c.decode(w))
    watch.finish(record_metric)


# -- meta -------------------------------------------------------------------------------------
@pytest.mark.clause("META-NO-GLOBAL-EFFECTS")
def test_meta_operations_leave_global_state_alone(backend, meta_cls, record_metric):
    watch = _Watch(backend, "meta")
    n = 7  # three ranks do not divide it
    m = sample_meta(meta_cls, n)
    head = sample_meta(meta_cls, 3, extra={"step": 3, "dp_rank": 0})
    tail = sample_meta(meta_cls, n - 3, extra={"step": 3, "dp_rank": 1}, first=3)
    watch.call("construction", lambda: sample_meta(meta_cls, n))
    watch.call("subset", lambda: m.subset([6, 0, 3]))
    watch.call("slice", lambda: m.slice(2, 5))
    watch.call("concat", lambda: meta_cls.concat([head, tail]))
    watch.call("drop", lambda: m.drop("pixel_values"))
    watch.call("with_fields", lambda: m.with_fields("advantages"))
    watch.call("stamp_tags (one per row)",
               lambda: m.stamp_tags([{"adv": float(i)} for i in range(n)]))
    watch.call("stamp_tags (one for all)", lambda: m.stamp_tags({"adv": 0.5}))
    if "dp" in backend.capabilities:
        for world in (1, 3):
            watch.call(f"shard_for_dp({world})", lambda w=world: m.shard_for_dp(w))
    watch.finish(record_metric)


# -- batch operations -------------------------------------------------------------------------
@pytest.mark.clause("BATCH-NO-GLOBAL-EFFECTS")
@pytest.mark.parametrize("case", CASES)
def test_batch_operations_leave_global_state_alone(backend, batch_ops, record_metric, case):
    _needs_object_columns(backend, case)
    watch = _Watch(backend, "batch_ops")
    batch = case.build()
    b, s = len(batch), batch.seq_len()
    caps = backend.capabilities
    watch.call("validate", lambda: batch_ops.validate(batch))
    for stage in Stage:
        for dtype in (None, torch.bfloat16):
            watch.call(f"multimodal_inputs({stage.value}, {dtype})",
                       lambda st=stage, d=dtype: batch_ops.multimodal_inputs(batch, st, d))
    if "truncation" in caps:
        watch.call(f"truncate({s // 2})", lambda: batch_ops.truncate(batch, s // 2))
    if "padding" in caps:
        watch.call(f"pad_to({s + 3})", lambda: batch_ops.pad_to(batch, s + 3))
    if "batch_algebra" in caps:
        watch.call("select", lambda: batch_ops.select(batch, [b - 1, 0, b - 1]))
        parts = watch.call("split", lambda: batch_ops.split(batch, [1, b - 1]))
        if parts is not None:
            watch.call("concat", lambda: batch_ops.concat([*parts, batch]))
    if "micro_batching" in caps:
        for seed in (None, 7):
            watch.call(f"micro_batches(3, shuffle_seed={seed})",
                       lambda sd=seed: batch_ops.micro_batches(batch, 3, shuffle_seed=sd))
    if "batch_union" in caps:
        extra = type(batch)({"input_lengths": batch["input_lengths"].clone(),
                             "advantages": torch.linspace(-1, 1, b)}, batch.family)
        watch.call("union", lambda: batch_ops.union(batch, extra))
    watch.finish(record_metric)


# -- trainer ----------------------------------------------------------------------------------
def _data_plane_passes(watch: _Watch, trainer, meta) -> None:
    for stage in (Stage.LOGPROB, Stage.REFERENCE_LOGPROB):
        meta = watch.call(f"compute_logprobs ({stage.value})",
                          lambda st=stage, m=meta: trainer.compute_logprobs(m, st)) or meta
    watch.call("train", lambda: trainer.train([meta]))
    watch.call("state_dict", trainer.state_dict)


def _in_memory_passes(watch: _Watch, trainer, batch) -> None:
    prev = watch.call("in-memory compute_logprobs (logprob)",
                      lambda: trainer.compute_logprobs(batch, Stage.LOGPROB))
    ref = watch.call("in-memory compute_logprobs (reference)",
                     lambda: trainer.compute_logprobs(batch, Stage.REFERENCE_LOGPROB))
    if prev is not None and ref is not None:
        ready = batch.replace(prev_logprobs=prev, reference_logprobs=ref)
        watch.call("in-memory train", lambda: trainer.train([ready]))


@pytest.mark.clause("TRAIN-NO-GLOBAL-EFFECTS")
def test_trainer_passes_leave_global_state_alone(backend, transport, codec, meta_cls, rollouts,
                                                 record_metric):
    """A step on the data plane (logprob, reference and train passes, then the weights the
    engine is refitted with), and the in-memory trainer's passes on the same batch."""
    watch = _Watch(backend, "trainer")
    batch, _, _ = rollouts.get(FAMILY, IMAGES)
    part, keys = _partition(), mint_keys(len(batch), 2)
    meta = write_rollout(batch, transport, codec, meta_cls, part, keys)
    adv = torch.linspace(-1.0, 1.0, len(batch))
    meta = put_advantages(batch, adv, transport, codec, meta, part, keys)
    settings = rollouts.settings(FAMILY)
    try:
        _data_plane_passes(watch, new_trainer(backend, settings, transport, codec), meta)
    finally:
        transport.clear(part, keys)
    _in_memory_passes(watch, new_trainer(backend, settings), batch.replace(advantages=adv))
    watch.finish(record_metric)


# -- rollout ----------------------------------------------------------------------------------
@pytest.mark.clause("GEN-NO-GLOBAL-EFFECTS")
def test_engine_operations_leave_global_state_alone(backend, device, dtype, seed,
                                                     record_metric):
    """generate (a group of identical requests, a row without media, a cap of 0) and refit."""
    from rlconform.conformance.backends.reference import backend as reference
    from rlconform.fixtures.families import build_family
    from rlconform.fixtures.images import make_prompts
    from rlconform.reference_impl.trainer import TrainerSettings

    watch = _Watch(backend, "rollout")
    make = backend.rollout if backend.provides("rollout") else reference.rollout
    settings = TrainerSettings(FAMILY, dtype=dtype, device=device, seed=seed)
    family = build_family(FAMILY)
    engine = make(family, settings)
    prompts, images, _ = make_prompts(2, [1, 0], seed=settings.seed)
    prompts, images = [prompts[0], *prompts], [images[0], *images]
    watch.call("generate", lambda: engine.generate(prompts, images, [3, 3, 0], seed=1))
    weights = family.build_model(seed=settings.seed + 1, dtype=settings.dtype,
                                 device=settings.device).state_dict()
    watch.call("refit", lambda: engine.refit(weights))
    watch.call("generate after refit", lambda: engine.generate(prompts[:1], images[:1], 2,
                                                               seed=2))
    watch.finish(record_metric)
