"""Data-plane speed, always as ratios to a baseline measured in the same run.

    python bench/bench_dataplane.py [--only copies,grpo] [--backend NAME] [--device cuda]
                                    [--samples 256] [--patches 256] [--repeat 5]
                                    [--grpo-families qwen2_vl,gemma3] [--grpo-rows 64]
                                    [--grpo-world 2] [--grpo-repeat 5] [--json PATH] [--profile]

Runs with only torch and transformers installed (plus rlconform): ray, tensordict, TransferQueue
and Mooncake are imported only for a `--backend` that needs them.

copies (codec and in-memory transport vs torch.clone). The payload is
`realistic_qwen_batch(samples, patches)` (bf16 Qwen2-VL patches, one to three images per sample,
512 tokens per sample), grown until it holds at least 256 MiB of media. Each operation is timed
as the median of `--repeat` runs after a few warm-ups:

- clone:          `torch.clone` of the concatenated media plus the per-token and per-sample
                  tensors: the same bytes as the wire columns, one copy (the baseline);
- encode, decode, encode+decode: the reference codec;
- put, get, put+get: the in-memory data plane on the encoded columns.

GB/s is payload bytes (the wire columns) over the median time. `ratio` is the clone time over
the operation's time (1.0: as fast as one clone of the same bytes). An operation that must copy
the bytes k times cannot beat 1/k, so `ratio/copy` (ratio times k) says how close it is to
copying at clone speed. The copies each operation must make: encode 1 (gather the segments into
one wire buffer), decode 1 (the batch must not alias the wire), put 1 and get 1 (stored data
never aliases a caller's tensor), so encode+decode and put+get 2. Targets: codec
(encode+decode) >= 0.5x and transport (put+get) >= 0.8x clone speed per copy, on any core count.

backend (`--backend NAME`): that backend's transport put/get through our adapter, inside its
`session()`, on the same wire columns; for a bundled real backend (transferqueue-simple,
transferqueue-mooncake, ray-objectstore) also the library's own calls on the same columns
(TransferQueue: `kv_batch_put` of a TensorDict, `kv_batch_get` + `kv_retrieve_meta`; Ray:
`ray.put` / `ray.get` of the column arrays plus the one copy out the surface owes). Target: our
adapter's put and get each <= 1.2x the library's.

grpo (the data-plane GRPO step vs the in-memory step): per family (tiny Qwen2-VL and Gemma3
built from config), one rollout batch of `--grpo-rows` rows trains two trainers that start from
the same weights, one through the reference transport and codec (`dataplane_step`) and one in
memory (`legacy_step`), `--grpo-world` data-parallel shards, alternating which goes first;
median of `--grpo-repeat` steps each on `--device` (cuda where present; bf16 there, fp32 on
the CPU). Target: data plane / in memory <= 1.0x. One more instrumented step of each path says
where the time goes (model passes, transport put/get/clear, codec encode/decode, the rest), and
the weights of both paths must stay bitwise equal. `--profile` adds cProfile of both steps.

Times on a shared or small machine are noisy (page faults on fresh memory dominate a cold clone;
on an oversubscribed box every OpenMP region waits for descheduled threads): the copies table
flags operations whose slowest run exceeds 1.5x the fastest; raise --repeat there.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import torch

from rlconform.fixtures.synthetic import realistic_qwen_batch
from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.codec import ReferenceCodec, WireBatch
from rlconform.reference_impl.packed import PackedTensor

MIN_MEDIA_BYTES = 256 * 2**20
PATCH_WIDTH = 1176  # realistic_qwen_batch: Qwen2-VL patch 14
PARTITION = "bench"
TARGETS = {"codec": ("encode+decode", 0.5), "transport": ("put+get", 0.8)}
GRPO_TARGET = 1.0  # data-plane step time / in-memory step time
ADAPTER_TARGET = 1.2  # our adapter's put (get) time / the library's own put (get) time
NOISY = 1.5
ROUND_TRIP_FAILURES: dict[str, str] = {}  # transport label ("" for the reference) -> why
COPIES = {"clone": 1, "encode": 1, "decode": 1, "encode+decode": 2, "put": 1, "get": 1,
          "put+get": 2}


# -- payload --------------------------------------------------------------------------------
def images_for(samples: int) -> int:
    return sum(1 + i % 3 for i in range(samples))  # realistic_qwen_batch: 1 + i % 3 images


def patches_for_min_media(samples: int, patches: int, dtype: torch.dtype) -> int:
    """`patches`, raised (to a multiple of 16, the grid's h) until media >= MIN_MEDIA_BYTES."""
    per_patch = PATCH_WIDTH * torch.empty(0, dtype=dtype).element_size()
    need = math.ceil(MIN_MEDIA_BYTES / (images_for(samples) * per_patch))
    need = 16 * math.ceil(need / 16)
    return max(patches, need)


def nbytes(t: torch.Tensor) -> int:
    if t.is_nested:
        return t.values().numel() * t.values().element_size()
    return t.numel() * t.element_size()


def clone_sources(batch: Batch) -> list[torch.Tensor]:
    """The batch's bytes as plain tensors: each packed field's logical rows concatenated (what
    the wire column holds), the per-token and per-sample tensors as they are."""
    out = []
    for v in batch.fields.values():
        if isinstance(v, PackedTensor):
            segs = [s.reshape(-1) for i in range(len(v)) for s in (v.row_segments(i) or [])]
            if segs:
                out.append(torch.cat(segs))
        else:
            out.append(v.contiguous())
    return out


# -- timing ---------------------------------------------------------------------------------
WARMUP = 3

def measure(fn: Callable[[], object], repeat: int, setup: Callable[[], None] | None = None,
            teardown: Callable[[], None] | None = None, warmup: int | None = None
            ) -> list[float]:
    """Seconds of `fn` over `repeat` runs after WARMUP warm-ups; setup/teardown are not timed.

    Several warm-ups, because on these VMs memory is handed to the guest lazily: the first
    passes over fresh pages cost page faults (seconds for 300 MB), not the operation."""
    warmup = WARMUP if warmup is None else warmup
    times = []
    for i in range(repeat + warmup):
        if setup:
            setup()
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        del out
        if teardown:
            teardown()
        if i >= warmup:
            times.append(dt)
    return times


def transport_ops(tr, wire: WireBatch, keys: list[str], repeat: int, label: str
                  ) -> dict[str, list[float]]:
    fields = list(wire.columns)

    def put():
        tr.put(PARTITION, keys, wire.columns, wire.tags)

    def get():
        return tr.get(PARTITION, keys, fields)

    def put_get():
        put()
        return get()

    def clear():
        tr.clear(PARTITION)

    out = {f"put{label}": measure(put, repeat, teardown=clear)}
    put()
    out[f"get{label}"] = measure(get, repeat)
    clear()
    out[f"put+get{label}"] = measure(put_get, repeat, teardown=clear)
    check_round_trip(tr, wire, keys, label)
    return out


def check_round_trip(tr, wire: WireBatch, keys: list[str], label: str) -> None:
    """Warn when what came back does not decode to what went in (its numbers mean little)."""
    tr.put(PARTITION, keys, wire.columns, wire.tags)
    cols, tags = tr.get(PARTITION, keys, list(wire.columns))
    tr.clear(PARTITION)
    codec = ReferenceCodec()
    try:
        why = codec.decode(wire).first_difference(codec.decode(WireBatch(cols, tags)))
    except Exception as exc:  # noqa: BLE001 - what came back does not even decode
        why = f"{type(exc).__name__}: {exc}"
    if why:
        ROUND_TRIP_FAILURES[label] = why
        print(f"WARNING: transport{label} did not round-trip the payload: {why}")


# -- profiling ------------------------------------------------------------------------------
def profile(ops: dict[str, Callable[[], object]], top: int) -> str:
    buf = io.StringIO()
    for name, fn in ops.items():
        prof = cProfile.Profile()
        prof.enable()
        out = fn()
        prof.disable()
        del out
        buf.write(f"\n--- cProfile: {name} (top {top} by own time) ---\n")
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


# -- bundled real transports: our adapter vs the library's own calls --------------------------
class _TransferQueueLibrary:
    """TransferQueue's own KV calls on the same columns: `kv_batch_put` with a TensorDict of the
    columns (built before timing) and the tags; `kv_batch_get` for the columns plus
    `kv_retrieve_meta` for the tags (the two library calls that return what our get returns)."""

    def __init__(self, wire: WireBatch):
        import transfer_queue as tq
        from tensordict import TensorDict

        self.tq, self.pid = tq, f"bench-lib-{time.time_ns()}"
        n = len(wire.tags)
        self.fields = TensorDict(dict(wire.columns), batch_size=[n])
        self.tags = [dict(t) for t in wire.tags]

    def put(self, keys):
        self.tq.kv_batch_put(keys=keys, partition_id=self.pid, fields=self.fields, tags=self.tags)

    def get(self, keys, fields):
        data = self.tq.kv_batch_get(keys=keys, partition_id=self.pid, select_fields=fields)
        meta = self.tq.get_client().kv_retrieve_meta(keys=keys, partition_id=self.pid,
                                                     create=False)
        return data, meta.get_all_custom_meta()

    def clear(self, keys):
        self.tq.kv_clear(keys=keys, partition_id=self.pid)


class _RayLibrary:
    """Ray's own calls on the same columns: `ray.put` of each column's arrays (what the adapter
    stores: values, and offsets for a jagged column) and `ray.get` of them, plus the one copy
    out that our surface owes its caller (ray.get returns read-only views of shared memory,
    and a transport's result must not alias the store)."""

    def __init__(self, wire: WireBatch):
        import ray

        from rlconform.conformance.backends.ray_objectstore import _to_payload

        self.ray = ray
        n = len(wire.tags)
        self.payloads = {name: _to_payload(name, col, n)[1] for name, col in wire.columns.items()}
        self.tags = [dict(t) for t in wire.tags]
        self.refs = None

    def put(self, keys):
        self.refs = {name: self.ray.put(p) for name, p in self.payloads.items()}
        self.tags_ref = self.ray.put(self.tags)

    def get(self, keys, fields):
        import numpy as np

        got = self.ray.get([self.refs[f] for f in fields] + [self.tags_ref])
        return [{k: np.array(v) for k, v in p.items()} for p in got[:-1]], got[-1]

    def clear(self, keys):
        self.refs = None


LIBRARIES = {"transferqueue-simple": _TransferQueueLibrary,
             "transferqueue-mooncake": _TransferQueueLibrary,
             "ray-objectstore": _RayLibrary}


def library_ops(name: str, tr, wire: WireBatch, keys: list[str], repeat: int
                ) -> dict[str, list[float]]:
    """Our adapter's put and get and the library's own, interleaved run by run (so a load
    change on a shared machine hits both alike)."""
    lib = LIBRARIES[name](wire)
    fields = list(wire.columns)
    ops = {
        "put": {"adapter": (lambda: tr.put(PARTITION, keys, wire.columns, wire.tags),
                            lambda: tr.clear(PARTITION)),
                "library": (lambda: lib.put(keys), lambda: lib.clear(keys))},
        "get": {"adapter": (lambda: tr.get(PARTITION, keys, fields), None),
                "library": (lambda: lib.get(keys, fields), None)},
    }
    out: dict[str, list[float]] = {}
    tr.put(PARTITION, keys, wire.columns, wire.tags)
    lib.put(keys)
    for op, sides in ops.items():
        for i in range(WARMUP + repeat):
            for side in (("adapter", "library") if i % 2 == 0 else ("library", "adapter")):
                fn, teardown = sides[side]
                t = measure(fn, 1, teardown=teardown, warmup=0)[0]
                if i >= WARMUP:
                    out.setdefault(f"{op} [{name}, {side}]", []).append(t)
        if op == "put":  # the timed puts were cleared: store once more for the gets
            tr.put(PARTITION, keys, wire.columns, wire.tags)
            lib.put(keys)
    tr.clear(PARTITION)
    lib.clear(keys)
    return out


def adapter_verdicts(rows: list[dict], name: str) -> list[dict]:
    by_op = {r["operation"]: r for r in rows}
    out = []
    for op in ("put", "get"):
        ours, lib = by_op.get(f"{op} [{name}, adapter]"), by_op.get(f"{op} [{name}, library]")
        if ours is None or lib is None:
            continue
        overhead = ours["median_s"] / lib["median_s"]
        out.append({"target": "adapter", "operation": f"{op} [{name}]", "overhead": overhead,
                    "need": ADAPTER_TARGET, "met": overhead <= ADAPTER_TARGET})
    return out


# -- the GRPO step: data plane vs in memory ---------------------------------------------------
GRPO_FAMILIES = ("qwen2_vl", "gemma3")
GRPO_GROUP = 2
GRPO_PATTERN = (1, 0, 2)  # images per prompt, cycled: image, text-only and two-image samples


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _Buckets:
    """Wall time per bucket, from wrapped methods (synchronising CUDA at each boundary)."""

    def __init__(self, device: str):
        self.device, self.seconds, self.calls = device, {}, {}

    def wrap(self, obj, method: str, bucket: str) -> None:
        fn = getattr(obj, method)

        def timed(*a, **kw):
            _sync(self.device)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                _sync(self.device)
                self.seconds[bucket] = self.seconds.get(bucket, 0.0) + time.perf_counter() - t0
                self.calls[bucket] = self.calls.get(bucket, 0) + 1

        setattr(obj, method, timed)

    def unwrap(self, obj, method: str) -> None:
        obj.__dict__.pop(method, None)


def _grpo_batch(family: str, rows: int, settings, new_tokens: int):
    from rlconform.conformance.backends.reference_trainer_rollout import make_rollout
    from rlconform.fixtures.families import build_family
    from rlconform.fixtures.images import make_prompts

    prompts, images, _ = make_prompts(rows // GRPO_GROUP, list(GRPO_PATTERN), seed=0)
    prompts = [p for p in prompts for _ in range(GRPO_GROUP)]
    images = [i for i in images for _ in range(GRPO_GROUP)]
    rollout = make_rollout(build_family(family), settings)
    batch = rollout.generate(prompts, images, new_tokens, seed=0)
    del rollout
    # distinct rewards within each group: every advantage non-zero, every gradient real
    rewards = torch.tensor([((7 * i) % 5) / 4 for i in range(len(prompts))])
    return batch, rewards


def grpo_bench(args) -> list[dict]:
    """Median wall time of one GRPO step, data plane vs in memory, same batch and device."""
    return [_grpo_family(args, family) for family in args.grpo_families]


def _grpo_family(args, family: str) -> dict:
    from rlconform.conformance.backends.reference_trainer_rollout import make_trainer
    from rlconform.reference_impl.codec import ReferenceCodec
    from rlconform.reference_impl.dataplane import InMemoryDataPlane
    from rlconform.reference_impl.grpo import dataplane_step, legacy_step
    from rlconform.reference_impl.trainer import TrainerSettings

    dtype = getattr(torch, args.grpo_dtype)
    settings = TrainerSettings(family, micro_batch_size=args.grpo_micro_batch, dtype=dtype,
                               device=args.device, seed=0)
    t0 = time.perf_counter()
    batch, rewards = _grpo_batch(family, args.grpo_rows, settings, args.grpo_new_tokens)
    transport, codec = InMemoryDataPlane(), ReferenceCodec(dtype)
    dp = make_trainer(settings, transport=transport, codec=codec)
    legacy = make_trainer(settings)
    print(f"\nGRPO step, {family}: {batch.batch_size} rows (images per prompt cycling "
          f"{GRPO_PATTERN}, groups of {GRPO_GROUP}), world {args.grpo_world}, micro-batch "
          f"{args.grpo_micro_batch}, {args.device}, {args.grpo_dtype}; media "
          f"{batch.media_nbytes() / 2**20:.1f} MiB; set-up {time.perf_counter() - t0:.1f}s")

    def dp_step(i):
        return dataplane_step(batch, dp, transport, codec, partition=f"bench{i}",
                              rewards=rewards, group_size=GRPO_GROUP, world=args.grpo_world)

    def legacy_step_(i):
        return legacy_step(batch, legacy, rewards=rewards, group_size=GRPO_GROUP,
                           world=args.grpo_world)

    steps = {"data plane": dp_step, "in memory": legacy_step_}
    times: dict[str, list[float]] = {k: [] for k in steps}
    # what set-up made (models, modules, the batch) is frozen out of the garbage collector, as
    # training frameworks do after start-up: a collection that a step's allocations trigger
    # then scans that step's objects, not the whole heap (a full pass is ~100 ms here)
    gc.collect()
    gc.freeze()
    for i in range(args.grpo_warmup + args.grpo_repeat):
        order = list(steps) if i % 2 == 0 else list(steps)[::-1]  # alternate: no drift bias
        for name in order:
            gc.collect()
            _sync(args.device)
            t = time.perf_counter()
            steps[name](i)
            _sync(args.device)
            if i >= args.grpo_warmup:
                times[name].append(time.perf_counter() - t)
    same = all(torch.equal(a, b) for a, b in zip(dp.state_dict().values(),
                                                  legacy.state_dict().values()))
    breakdown = _grpo_breakdown(steps, dp, legacy, transport, codec, args.device)
    gc.unfreeze()
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["data plane"] / med["in memory"]
    row = {"family": family, "rows": batch.batch_size, "world": args.grpo_world,
           "device": args.device, "dtype": args.grpo_dtype,
           "micro_batch": args.grpo_micro_batch, "times_s": times, "median_s": med,
           "ratio": ratio, "need": GRPO_TARGET, "met": ratio <= GRPO_TARGET,
           "bitwise_equal_weights": same, "breakdown_s": breakdown}
    for name in steps:
        spread = max(times[name]) / min(times[name])
        print(f"  {name:<11} median {med[name]:.4f}s  min {min(times[name]):.4f}s  "
              f"(slowest/fastest {spread:.2f}x, {args.grpo_repeat} runs)")
    for name, buckets in breakdown.items():
        total = sum(buckets.values())
        parts = ", ".join(f"{b} {t * 1e3:.1f} ms ({t / total:.0%})"
                          for b, t in sorted(buckets.items(), key=lambda kv: -kv[1]))
        print(f"  where the time goes, {name} (one instrumented step, {total * 1e3:.1f} ms): "
              f"{parts}")
    print(f"  weights bitwise equal after every step of both paths: {same}")
    print(f"target grpo      {family:<10} data plane / in memory needs <= {GRPO_TARGET}x: "
          f"{ratio:.3f}x -> {'MET' if row['met'] else 'NOT MET'}")
    if args.profile:
        print(profile({f"GRPO data-plane step ({family})": lambda: dp_step(-1),
                       f"GRPO in-memory step ({family})": lambda: legacy_step_(-1)}, top=15))
    return row


def _grpo_breakdown(steps, dp, legacy, transport, codec, device) -> dict[str, dict[str, float]]:
    """One more step of each path with its transport, codec and model passes timed."""
    out = {}
    for name, trainer in (("data plane", dp), ("in memory", legacy)):
        b = _Buckets(device)
        wrapped = [(trainer.core, "logprobs", "logprob forwards"),
                   (trainer.core, "train", "train forward+backward+step")]
        if name == "data plane":
            wrapped += [(transport, "put", "transport put"), (transport, "get", "transport get"),
                        (transport, "clear", "transport clear"),
                        (codec, "encode", "codec encode"), (codec, "decode", "codec decode")]
        for obj, method, bucket in wrapped:
            b.wrap(obj, method, bucket)
        try:
            _sync(device)
            t0 = time.perf_counter()
            steps[name](-2)
            _sync(device)
            total = time.perf_counter() - t0
        finally:
            for obj, method, _ in wrapped:
                b.unwrap(obj, method)
        b.seconds["other (driver, meta, advantages)"] = max(0.0, total - sum(b.seconds.values()))
        out[name] = b.seconds
    return out


# -- report ---------------------------------------------------------------------------------
def rows_for(results: dict[str, list[float]], payload: int) -> list[dict]:
    clone = statistics.median(results["clone"])
    rows = []
    for op, times in results.items():
        med = statistics.median(times)
        copies = COPIES[op.split(" ")[0]]
        ratio = clone / med
        rows.append({"operation": op, "median_s": med, "min_s": min(times), "times_s": times,
                     "gb_per_s": payload / med / 1e9, "copies": copies, "ratio": ratio,
                     "ratio_per_copy": ratio * copies})
    return rows


def table(rows: list[dict]) -> str:
    w = max(28, *(len(r["operation"]) + 1 for r in rows))
    head = (f"{'operation':<{w}} {'median s':>9} {'min s':>7} {'GB/s':>7} {'copies':>6} "
            f"{'ratio':>7} {'ratio/copy':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['operation']:<{w}} {r['median_s']:>9.4f} {r['min_s']:>7.4f} "
                     f"{r['gb_per_s']:>7.2f} {r['copies']:>6} {r['ratio']:>6.2f}x "
                     f"{r['ratio_per_copy']:>9.2f}x")
    noisy = [f"{r['operation']} ({max(r['times_s']) / r['min_s']:.1f}x)" for r in rows
             if max(r["times_s"]) > NOISY * r["min_s"]]
    if noisy:
        lines.append(f"noisy (slowest run > {NOISY}x the fastest): {', '.join(noisy)}; "
                     "another process or the memory system interfered, raise --repeat")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> list[dict]:
    """The codec and in-memory transport targets. A `--backend`'s own put+get against clone is
    in the table but has no target of its own: its target is the overhead over its library."""
    by_op = {r["operation"]: r for r in rows}
    out = []
    for target, (base_op, need) in TARGETS.items():
        for op, r in by_op.items():
            if op != base_op:
                continue
            out.append({"target": target, "operation": op, "label": op[len(base_op):],
                        "need_per_copy": need,
                        "ratio_per_copy": r["ratio_per_copy"], "ratio": r["ratio"],
                        "met": r["ratio_per_copy"] >= need})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--patches", type=int, default=256, help="patches per image")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", default="copies,grpo",
                    help="sections: copies (codec and in-memory transport vs clone), grpo (the "
                         "data-plane vs in-memory step); --backend adds that backend's section")
    ap.add_argument("--backend", help="also time this backend's transport (a registered name, "
                                      "mutant:<name> or module:attr); for a bundled real backend "
                                      "also the library's own put and get on the same columns")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="device of the GRPO step (default: cuda where present)")
    ap.add_argument("--grpo-families", type=lambda v: v.split(","), default=list(GRPO_FAMILIES))
    ap.add_argument("--grpo-rows", type=int, default=64)
    ap.add_argument("--grpo-world", type=int, default=2)
    ap.add_argument("--grpo-micro-batch", type=int, default=8)
    ap.add_argument("--grpo-new-tokens", type=int, default=16)
    ap.add_argument("--grpo-repeat", type=int, default=5)
    ap.add_argument("--grpo-warmup", type=int, default=1)
    ap.add_argument("--grpo-dtype", default=None, choices=["float32", "bfloat16"],
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the codec, the data plane and both GRPO steps")
    ap.add_argument("--allow-small", action="store_true",
                    help="keep --patches even below 256 MiB of media (smoke runs)")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.grpo_repeat < 1:
        ap.error("--repeat and --grpo-repeat must be >= 1")
    sections = set(args.only.split(",")) | ({"backend"} if args.backend else set())
    unknown = sections - {"copies", "grpo", "backend"}
    if unknown:
        ap.error(f"--only names unknown sections {sorted(unknown)}")
    if args.grpo_dtype is None:
        args.grpo_dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False")
    if args.backend:
        # load it before measuring anything: an import error is reported in seconds, not after
        # minutes of the other sections
        args.loaded_backend = _load_or_exit(args.backend)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} cores; sections: {', '.join(sorted(sections))}")
    doc: dict = {"config": {"samples": args.samples, "repeat": args.repeat,
                            "backend": args.backend, "torch": torch.__version__,
                            "threads": torch.get_num_threads(), "cores": os.cpu_count(),
                            "device": args.device}}
    checks: list[dict] = []
    if sections & {"copies", "backend"}:
        rows, more = copies_section(args, sections)
        doc["results"] = rows
        checks += more
    if "grpo" in sections:
        doc["grpo"] = grpo_bench(args)
        checks += [{"target": "grpo", "operation": f"step [{r['family']}]",
                    "ratio": r["ratio"], "need": GRPO_TARGET, "met": r["met"]}
                   for r in doc["grpo"]]
    doc["targets"] = checks
    doc["round_trip_failures"] = ROUND_TRIP_FAILURES
    print("\nsummary:")
    for c in checks:
        value = c.get("ratio_per_copy", c.get("overhead", c.get("ratio")))
        print(f"  {c['target']:<9} {c['operation']:<40} {value:.3f} -> "
              f"{'MET' if c['met'] else 'NOT MET'}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
        print(f"wrote {args.json}")
    return 0


def copies_section(args, sections: set[str]) -> tuple[list[dict], list[dict]]:
    dtype = torch.bfloat16
    patches = args.patches if args.allow_small else patches_for_min_media(
        args.samples, args.patches, dtype)
    if patches != args.patches:
        print(f"raising --patches {args.patches} -> {patches} for >= 256 MiB of media")
    batch = realistic_qwen_batch(args.samples, patches, dtype=dtype)
    media = batch.media_nbytes()
    codec = ReferenceCodec()
    wire = codec.encode(batch)
    why = batch.first_difference(codec.decode(wire))
    if why:
        raise SystemExit(f"the reference codec did not round-trip the payload: {why}")
    payload = sum(nbytes(c) for c in wire.columns.values())
    sources = clone_sources(batch)
    clone_bytes = sum(nbytes(t) for t in sources)
    keys = [f"sample-{i}" for i in range(args.samples)]
    print(f"\npayload: {args.samples} samples x {images_for(args.samples) / args.samples:.2f} "
          f"images x {patches} patches x {PATCH_WIDTH} {str(dtype).removeprefix('torch.')}: "
          f"media {media / 2**20:.1f} MiB ({media / 1e6:.1f} MB); wire columns "
          f"{payload / 2**20:.1f} MiB; clone baseline {clone_bytes / 2**20:.1f} MiB in "
          f"{len(sources)} tensors; repeat {args.repeat} (median, after {WARMUP} warm-ups)")

    results: dict[str, list[float]] = {}
    results["clone"] = measure(lambda: [t.clone() for t in sources], args.repeat)
    from rlconform.reference_impl.dataplane import InMemoryDataPlane

    dp = InMemoryDataPlane()
    if "copies" in sections:
        results["encode"] = measure(lambda: codec.encode(batch), args.repeat)
        results["decode"] = measure(lambda: codec.decode(wire), args.repeat)
        results["encode+decode"] = measure(lambda: codec.decode(codec.encode(batch)),
                                           args.repeat)
        results.update(transport_ops(dp, wire, keys, args.repeat, ""))
    if args.backend:
        results.update(backend_section(args, wire, keys, payload))
        # clone again after the backend: a cluster started by session() may have moved the
        # baseline; report it, keep the first as the reference
        results["clone (after backend)"] = measure(lambda: [t.clone() for t in sources],
                                                   args.repeat)

    rows = rows_for(results, payload)
    print()
    print(table(rows))
    print()
    checks = verdicts(rows)
    for c in checks:
        broken = c["target"] == "transport" and c["label"] in ROUND_TRIP_FAILURES
        c["round_trip_ok"] = not broken
        c["met"] = c["met"] and not broken
        print(f"target {c['target']:<9} {c['operation']:<24} needs >= {c['need_per_copy']}x "
              f"clone speed per copy: {c['ratio_per_copy']:.2f}x per copy "
              f"({c['ratio']:.2f}x of one clone) -> {'MET' if c['met'] else 'NOT MET'}"
              f"{' (it did not round-trip the payload)' if broken else ''}")
    name = args.backend
    if name in LIBRARIES:
        for c in adapter_verdicts(rows, name):
            checks.append(c)
            print(f"target adapter   {c['operation']:<24} our adapter / the library's own call "
                  f"needs <= {ADAPTER_TARGET}x: {c['overhead']:.2f}x -> "
                  f"{'MET' if c['met'] else 'NOT MET'}")

    if args.profile and "copies" in sections:
        dp.put(PARTITION, keys, wire.columns, wire.tags)
        fields = list(wire.columns)
        report = profile({
            "encode": lambda: codec.encode(batch),
            "decode": lambda: codec.decode(wire),
            "get": lambda: dp.get(PARTITION, keys, fields),
        }, top=12)
        dp.clear(PARTITION)
        report += profile({"put": lambda: dp.put(PARTITION, keys, wire.columns, wire.tags)}, 12)
        dp.clear(PARTITION)
        print(report)
    for r in rows:
        r["payload_bytes"] = payload
    return rows, checks


def _load_or_exit(spec: str):
    import os as _os

    from rlconform.conformance.backend import load_backend

    if ":" in spec and _os.getcwd() not in sys.path:
        sys.path.insert(0, _os.getcwd())  # module:attr from the current directory
    try:
        backend = load_backend(spec)
    except (LookupError, TypeError, ValueError) as exc:
        raise SystemExit(f"bench: --backend {spec}: {exc}") from None
    if backend.transport is None:
        raise SystemExit(f"bench: backend {backend.name!r} provides no transport surface")
    return backend


def backend_section(args, wire: WireBatch, keys: list[str], payload: int
                    ) -> dict[str, list[float]]:
    mib = payload >> 20
    # room for the payload in the stores the sessions start (their defaults are small)
    os.environ.setdefault("RLCONFORM_MOONCAKE_SEGMENT_MB", str(max(256, 3 * mib)))
    os.environ.setdefault("RLCONFORM_RAY_OBJECT_STORE_MB", str(max(1024, 4 * mib)))
    backend = getattr(args, "loaded_backend", None) or _load_or_exit(args.backend)
    out: dict[str, list[float]] = {}
    try:
        with backend.session():
            tr = backend.transport()
            try:
                out.update(transport_ops(tr, wire, keys, args.repeat, f" [{backend.name}]"))
                if backend.name in LIBRARIES:
                    out.update(library_ops(backend.name, tr, wire, keys, args.repeat))
            finally:
                tr.close()
    except ImportError as exc:
        needs = list(getattr(backend, "requirements", ())) or "its optional dependencies"
        raise SystemExit(f"backend {backend.name!r} could not start: {exc}; it needs "
                         f"{needs}") from exc
    return out


if __name__ == "__main__":
    sys.exit(main())
