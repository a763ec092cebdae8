"""Garbage collection before a trainer is built: trainers built one after another inside a test
must not hold the device's memory together."""

from __future__ import annotations

import gc


def new_trainer(backend, *args):
    """`backend.trainer(*args)`, on a GPU after collecting the trainers a test has dropped. A
    trainer sits in reference cycles (modules, hooks, optimizer), so dropping it frees nothing
    until the garbage collector runs: at production widths each one holds 20-45 GB of GPU memory
    (policy, frozen reference, AdamW state), and two workers share one GPU (how a production run
    found it: docs/gpu-runs/2026-12-03-h200-production/README.md, run 5). The freed blocks stay
    in this process's cache for the next trainer; the test's teardown hands them back to the
    driver. On the CPU (`settings.device`, the first argument) nothing is collected: a tiny
    trainer's memory does not matter there, and each full collection walks every object torch
    and transformers created (~0.25 s on 2 cores; it was 45% of the trainer clauses' time)."""
    settings = args[0] if args else None
    if str(getattr(settings, "device", "cpu")).startswith("cuda"):
        gc.collect()
    return backend.trainer(*args)
