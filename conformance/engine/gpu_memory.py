"""A memory plan for the model tests that share one GPU: reserve before building, wait when the
reservation does not fit, fail fast when the GPU can never hold the largest test.

At production widths a test's trainers, frozen reference and rollout engine take 17-90 GiB of
GPU memory, and the xdist workers of a nightly run share one GPU. Which tests meet on it is up
to the scheduler, so memory cannot be left to luck: each model test on CUDA reserves its planned
peak from a budget the workers share (a small ledger file under a lock), waits while other
workers' reservations leave too little, and releases it in its teardown. The planned peaks
(`gpu_memory_plan.json` beside this file, GiB of `torch.cuda.max_memory_reserved`) were measured
on an H200; every CUDA run records each test's own peak in its report, and `rlconform
memory-plan REPORT --write` folds a run's peaks into the plan.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

PLAN_PATH = Path(__file__).with_name("gpu_memory_plan.json")
LEDGER_ENV = "RLCONFORM_GPU_LEDGER"
# share of the GPU the reservations may fill: the rest is the CUDA contexts of every worker
# (0.5-1 GiB each), the caching allocator's rounding and what data-plane tests hold
BUDGET_SHARE = 0.9
WAIT_LIMIT_S = 1200.0  # a reservation that waits this long is a planning error: say so
POLL_S = 0.5


def load_plan(path: Path = PLAN_PATH) -> dict:
    return json.loads(path.read_text())


def planned_gib(plan: dict, family: str | None, test: str) -> float:
    """The peak a test is planned to reach: its own measured peak, else its family's largest
    plus the plan's margin, else the plan's default."""
    fam = plan["families"].get(family or "", {})
    function = test.split("[", 1)[0]
    if function in fam.get("tests", {}):
        return float(fam["tests"][function]) * plan["margin"]
    if "peak_gib" in fam:
        return float(fam["peak_gib"]) * plan["margin"]
    return float(plan["default_gib"])


def budget_gib(total_bytes: int) -> float:
    return total_bytes / 2**30 * BUDGET_SHARE


def preflight(plan: dict, families: list[str], total_bytes: int, device_name: str,
              tests: dict[str, set[str]] | None = None) -> str | None:
    """Why this GPU cannot run the planned tests at all (the largest one alone does not fit
    the budget), or None: said before any test starts, not as an out-of-memory error later.
    `tests`: the selected test functions of each family; a family's need is then the largest
    of those tests' planned peaks (`planned_gib`), not its own largest (a run that leaves
    SmolVLM's two 86-GiB tests out with -k fits an H100); without it, the family's largest."""
    budget = budget_gib(total_bytes)
    worst = []
    for family in families:
        fam = plan["families"].get(family, {})
        if tests is not None and tests.get(family):
            need = max(planned_gib(plan, family, function) for function in tests[family])
        else:
            peaks = [*fam.get("tests", {}).values(), fam.get("peak_gib", 0.0)]
            need = max(peaks, default=plan["default_gib"]) * plan["margin"]
        if need > budget:
            worst.append(f"{family} needs {need:.0f} GiB")
    if not worst:
        return None
    return (f"the GPU memory plan does not fit {device_name} ({total_bytes / 2**30:.0f} GiB, "
            f"{budget:.0f} GiB usable for model tests): {'; '.join(worst)}. Run on a larger "
            "GPU, or leave those families or their largest tests out (-k)")


class Ledger:
    """Reservations of the workers sharing one GPU: {pid: GiB} in a JSON file, changed under
    an exclusive lock; reservations of processes that died are dropped."""

    def __init__(self, path: str | Path, budget: float):
        self.path = Path(path)
        self.budget = budget

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                try:
                    held = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    held = {}
                held = {pid: gib for pid, gib in held.items() if _alive(int(pid))}
                yield held
                self.path.write_text(json.dumps(held))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def try_reserve(self, gib: float) -> bool:
        """Reserve `gib` for this process if it fits (or if nothing else is reserved: the
        largest test must run even when it needs the whole budget)."""
        with self._locked() as held:
            others = sum(v for pid, v in held.items() if int(pid) != os.getpid())
            if others and others + gib > self.budget:
                return False
            held[str(os.getpid())] = gib
            return True

    def release(self) -> None:
        with self._locked() as held:
            held.pop(str(os.getpid()), None)

    def held(self) -> dict[str, float]:
        with self._locked() as held:
            return dict(held)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def reservation(ledger: Ledger, gib: float, what: str) -> Iterator[float]:
    """Hold `gib` of the shared budget for the body; waits (polling) while it does not fit.
    Yields the seconds waited."""
    t0 = time.monotonic()
    while not ledger.try_reserve(gib):
        if time.monotonic() - t0 > WAIT_LIMIT_S:
            raise RuntimeError(
                f"{what}: waited {WAIT_LIMIT_S:.0f} s for {gib:.0f} GiB of GPU memory "
                f"(budget {ledger.budget:.0f} GiB, held by others: {ledger.held()}): the "
                "memory plan (conformance/engine/gpu_memory_plan.json) is wrong for this GPU")
        time.sleep(POLL_S)
    try:
        yield time.monotonic() - t0
    finally:
        ledger.release()


def drop_failed_frames() -> None:
    """Let go of the last failed test's frames (engine/session.py calls it before a CUDA test's
    teardown). pytest keeps a failed test's exception in
    `sys.last_*` (for post-mortem debugging) until the next test's call phase, after that test's
    fixtures have reserved and built its models: the failed test's frames, and the trainers in
    their locals, then hold tens of GB that the ledger counts as released. A mutant job fails
    tests by design: three jobs on one H100 ran out of memory so (docs/gpu-runs/2026-12-07-h100-h)."""
    value = getattr(sys, "last_value", None)
    seen: set[int] = set()
    while value is not None and id(value) not in seen:  # the chain's frames too
        seen.add(id(value))
        if value.__traceback__ is not None:
            traceback.clear_frames(value.__traceback__)
        value = value.__cause__ or value.__context__
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)


def fold_report(plan: dict, report: dict) -> dict:
    """The plan with a CUDA run's measured per-test peaks folded in (the larger of old and
    new per family and test function)."""
    out = json.loads(json.dumps(plan))
    for clause in report["clauses"]:
        if clause.get("surface") not in ("trainer", "rollout"):
            continue  # only model tests reserve memory
        for t in clause["tests"]:
            peak = t.get("gpu_peak_gib")
            family = (t.get("params") or {}).get("family")
            if peak is None or family is None:
                continue
            fam = out["families"].setdefault(family, {"tests": {}})
            tests = fam.setdefault("tests", {})
            function = t["nodeid"].split("::", 1)[-1].split("[", 1)[0]
            tests[function] = round(max(tests.get(function, 0.0), peak), 1)
            fam["peak_gib"] = max(fam.get("peak_gib", 0.0), tests[function])
    return out
