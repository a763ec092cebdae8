"""The derandomised `ci` profile reaches every family and every regime, in every clause test that
draws batches.

The clause tests decorated with `given_batches` / `given_heterogeneous` run against the
reference under the `ci` profile (`rlconform run`, in a subprocess, as CI runs them), each
appending the regimes of every batch it receives to a log (fixtures.strategies.OBSERVE_ENV).
A family, layout, media regime, media form, layout with M-RoPE position ids, or kind of
heterogeneous dict row that a test's strategy has in scope but never reaches fails here, and so
does a *pair* of them (family x media regime, layout x row count, M-RoPE x form, ...) that can
occur together but that no batch of the test's explicit cases holds: those cases are a covering
array (fixtures/pairwise.py), so every profile reaches every pair. Run with `-s` to see, per
test, what its explicit cases and its drawn examples reach.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import rlconform.conformance.clauses as clauses
from rlconform.fixtures.pairwise import pairs_of, required_pairs
from rlconform.fixtures.strategies import MULTI_ROW_MEDIA, OBSERVE_ENV, ROW_COUNTS, tiles_images
from rlconform.fixtures.synthetic import (
    LAYOUTS,
    MEDIA_FORMS,
    MEDIA_REGIMES,
    POSITION_CHANNELS,
    media_families,
)

ROOT = Path(__file__).resolve().parents[1]
HETERO_ROWS = {"None and {} rows", "different key sets", "list and tensor values of one key",
               "keys in another order"}


def _drawing_tests() -> dict[str, tuple[str, dict]]:
    """`module::test` -> (strategy name, its arguments) for every test that draws batches."""
    out = {}
    for info in pkgutil.iter_modules(clauses.__path__):
        if not info.name.startswith("test_"):
            continue
        mod = importlib.import_module(f"{clauses.__name__}.{info.name}")
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            if name.startswith("test_") and hasattr(fn, "rlconform_strategy"):
                out[f"{info.name}::{name}"] = fn.rlconform_strategy
    return out


def _in_scope(strategy: str, kw: dict) -> dict[str, set]:
    families = [kw["family"]] if kw.get("family") else list(kw.get("families")
                                                           or media_families())
    default_forms = MEDIA_FORMS[1:] if strategy == "heterogeneous_batches" else MEDIA_FORMS
    scope = {"family": set(families), "form": set(kw.get("media_forms", default_forms))}
    if strategy == "heterogeneous_batches":
        scope["rows"] = set(HETERO_ROWS)
        return scope
    # turned media differ by shape, not by count: they are counted as the count classes
    medias = [kw["shape_mode"]] if kw.get("shape_mode") else list(MEDIA_REGIMES)
    scope["media"] = {m for m in medias if m != "turned"}
    scope["layout"] = {kw["layout"]} if kw.get("layout") else set(LAYOUTS)
    if any(f in POSITION_CHANNELS for f in families):
        scope["mrope_layout"] = set(scope["layout"])
    return scope


# the regimes whose pairs the explicit cases must reach, as regimes_of observes them
PAIR_FACTORS = ("family", "layout", "media", "form", "mrope", "row_count")
_ROW_CLASS = {1: "one", 4: "even", 5: "odd"}


def _observed_rule(case: dict) -> bool:
    """Which observed regimes can occur together (fixtures.strategies.batch_rule, as observed)."""
    if case.get("mrope") is True and case.get("family") not in (None, *POSITION_CHANNELS):
        return False
    fam = case.get("family")
    if fam is not None and case.get("media") == "equal_count" and tiles_images(fam):
        return False
    layout, rows = case.get("layout"), case.get("row_count")
    if layout is not None and rows is not None and (layout == "single_row") != (rows == "one"):
        return False
    return not (rows == "one" and case.get("media") in MULTI_ROW_MEDIA)


def _pairs_in_scope(strategy: str, kw: dict) -> set:
    scope = _in_scope(strategy, kw)
    if strategy == "heterogeneous_batches":
        return set()
    factors = {"family": sorted(scope["family"]), "layout": sorted(scope["layout"]),
               "media": sorted(scope["media"]), "form": sorted(scope["form"]),
               "mrope": [False] + ([True] if "mrope_layout" in scope else []),
               "row_count": [_ROW_CLASS[r] for r in ROW_COUNTS if r <= kw.get("max_rows", 6)]}
    return required_pairs({k: v for k, v in factors.items() if v}, _observed_rule)


@pytest.fixture(scope="module")
def reached(tmp_path_factory):
    """test -> {"explicit" | "drawn" -> feature -> values reached} under the ci profile."""
    tmp = tmp_path_factory.mktemp("regimes")
    log = tmp / "regimes.jsonl"
    names = sorted({t.split("::")[1] for t in _drawing_tests()})
    cmd = [sys.executable, "-m", "rlconform.conformance.cli", "run", "--backend", "reference",
           "--profile", "ci", "--workers", "0", "--report-dir", str(tmp / "out"), "-q",
           "--partial-ok", "-k", " or ".join(names)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200,
                          env={**os.environ, OBSERVE_ENV: str(log)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    out: dict = defaultdict(lambda: {"explicit": defaultdict(set), "drawn": defaultdict(set)})
    for line in log.read_text().splitlines():
        r = json.loads(line)
        seen = out[r["test"]]["explicit" if r["explicit"] else "drawn"]
        for key in ("family", "layout", "media", "form"):
            seen[key].add(r[key])
        if r["mrope"]:
            seen["mrope_layout"].add(r["layout"])
        seen["rows"].update(r["rows"])
        seen["pairs"].update(pairs_of({k: r[k] for k in PAIR_FACTORS}))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("test", sorted(_drawing_tests()))
def test_ci_profile_reaches_every_family_and_regime(reached, test):
    strategy, kw = _drawing_tests()[test]
    got = reached.get(test)
    assert got is not None, f"{test} ran on no batch under the ci profile"
    print(f"\n{test} ({strategy}{', ' + str(kw) if kw else ''})")
    for where in ("explicit", "drawn"):
        for key, values in sorted(got[where].items()):
            if key == "pairs":
                print(f"  {where:8} {'pairs':12} {len(values)}")
            elif values:
                print(f"  {where:8} {key:12} {len(values):2}: {', '.join(sorted(values))}")
    scope = _in_scope(strategy, kw)
    both = {k: got["explicit"][k] | got["drawn"][k] for k in scope}
    missing = {k: sorted(v - both[k]) for k, v in scope.items() if v - both[k]}
    assert not missing, f"{test} under the ci profile never reaches {missing}"
    # pairs: the explicit cases alone (every profile runs them) must hold every pair in scope
    unpaired = sorted(_pairs_in_scope(strategy, kw) - got["explicit"]["pairs"], key=repr)
    assert not unpaired, \
        f"{test}: its explicit cases never hold these pairs of regimes: {unpaired[:12]}" \
        f"{f' and {len(unpaired) - 12} more' if len(unpaired) > 12 else ''}"
