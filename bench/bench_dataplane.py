"""Codec and transport throughput, as ratios to `torch.clone` of the same bytes in the same run.

    python bench/bench_dataplane.py [--samples 256] [--patches 256] [--repeat 5]
                                    [--backend NAME] [--json PATH] [--profile]

The payload is `realistic_qwen_batch(samples, patches)` (bf16 Qwen2-VL patches, one to three
images per sample, 512 tokens per sample), grown until it holds at least 256 MiB of media. Each
operation is timed as the median of `--repeat` runs after a few warm-ups:

- clone:          `torch.clone` of the concatenated media plus the per-token and per-sample
                  tensors: the same bytes as the wire columns, one copy (the baseline);
- encode, decode, encode+decode: the reference codec;
- put, get, put+get: the in-memory data plane on the encoded columns (and, with `--backend`,
  the transport of that backend, inside its `session()`).

GB/s is payload bytes (the wire columns) over the median time. `ratio` is the clone time over
the operation's time (1.0: as fast as one clone of the same bytes). An operation that must copy
the bytes k times cannot beat 1/k, so `ratio/copy` (ratio times k) says how close it is to
copying at clone speed. The copies each operation must make: encode 1 (gather the segments into
one wire buffer), decode 1 (the batch must not alias the wire), put 1 and get 1 (stored data
never aliases a caller's tensor), so encode+decode and put+get 2. Targets: codec
(encode+decode) >= 0.5x and transport (put+get) >= 0.8x clone speed per copy. Times on a shared
or small machine are noisy (page faults on fresh memory dominate a cold clone): the table flags
operations whose slowest run exceeds 1.5x the fastest; raise --repeat there.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
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
            teardown: Callable[[], None] | None = None) -> list[float]:
    """Seconds of `fn` over `repeat` runs after WARMUP warm-ups; setup/teardown are not timed.

    Several warm-ups, because on these VMs memory is handed to the guest lazily: the first
    passes over fresh pages cost page faults (seconds for 300 MB), not the operation."""
    times = []
    for i in range(repeat + WARMUP):
        if setup:
            setup()
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        del out
        if teardown:
            teardown()
        if i >= WARMUP:
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
    why = codec.decode(wire).first_difference(codec.decode(WireBatch(cols, tags)))
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
    by_op = {r["operation"]: r for r in rows}
    out = []
    for target, (base_op, need) in TARGETS.items():
        for op, r in by_op.items():
            if op.split(" ")[0] != base_op:
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
    ap.add_argument("--backend", help="also time this backend's transport (a registered name, "
                                      "mutant:<name> or module:attr)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--profile", action="store_true", help="cProfile codec and data plane")
    ap.add_argument("--allow-small", action="store_true",
                    help="keep --patches even below 256 MiB of media (smoke runs)")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")

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
    print(f"payload: {args.samples} samples x {images_for(args.samples) / args.samples:.2f} "
          f"images x {patches} patches x {PATCH_WIDTH} {str(dtype).removeprefix('torch.')}: "
          f"media {media / 2**20:.1f} MiB ({media / 1e6:.1f} MB); wire columns "
          f"{payload / 2**20:.1f} MiB; clone baseline {clone_bytes / 2**20:.1f} MiB in "
          f"{len(sources)} tensors")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, repeat {args.repeat} "
          f"(median, after {WARMUP} warm-ups)")

    results: dict[str, list[float]] = {}
    results["clone"] = measure(lambda: [t.clone() for t in sources], args.repeat)
    results["encode"] = measure(lambda: codec.encode(batch), args.repeat)
    results["decode"] = measure(lambda: codec.decode(wire), args.repeat)
    results["encode+decode"] = measure(lambda: codec.decode(codec.encode(batch)), args.repeat)

    from rlconform.reference_impl.dataplane import InMemoryDataPlane

    dp = InMemoryDataPlane()
    results.update(transport_ops(dp, wire, keys, args.repeat, ""))
    if args.backend:
        from rlconform.conformance.backend import load_backend

        backend = load_backend(args.backend)
        if backend.transport is None:
            raise SystemExit(f"backend {backend.name!r} provides no transport surface")
        try:
            with backend.session():
                tr = backend.transport()
                try:
                    results.update(transport_ops(tr, wire, keys, args.repeat,
                                                 f" [{backend.name}]"))
                finally:
                    tr.close()
        except ImportError as exc:
            needs = list(getattr(backend, "requirements", ())) or "its optional dependencies"
            raise SystemExit(f"backend {backend.name!r} could not start: {exc}; it needs "
                             f"{needs}") from exc
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

    if args.profile:
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

    if args.json:
        doc = {
            "config": {"samples": args.samples, "patches": patches, "repeat": args.repeat,
                       "dtype": str(dtype), "backend": args.backend,
                       "torch": torch.__version__, "threads": torch.get_num_threads()},
            "bytes": {"media": media, "wire_columns": payload, "clone": clone_bytes},
            "results": rows,
            "targets": checks,
            "round_trip_failures": ROUND_TRIP_FAILURES,
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
