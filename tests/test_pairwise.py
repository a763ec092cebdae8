"""Pairwise coverage (fixtures/pairwise.py): the covering array holds every allowed pair, never a
forbidden combination, and is the same in every process; the batch cases built from it are in
the regimes they declare."""

from __future__ import annotations

import itertools
import subprocess
import sys

from rlconform.fixtures.pairwise import (
    covering_cases,
    pairs_of,
    required_pairs,
    uncovered_pairs,
)
from rlconform.fixtures.strategies import (
    MULTI_ROW_MEDIA,
    batch_cases,
    batch_factors,
    batch_rule,
)
from rlconform.fixtures.synthetic import regimes_of

FACTORS = {"a": (0, 1, 2, 3), "b": ("x", "y", "z"), "c": (True, False), "d": (1, 2, 3)}


def _no_a3_with_x(case: dict) -> bool:
    return not (case.get("a") == 3 and case.get("b") == "x")


def test_every_pair_is_covered_in_few_cases():
    cases = covering_cases(FACTORS)
    every = {p for c in itertools.product(*FACTORS.values())
             for p in pairs_of(dict(zip(FACTORS, c)))}
    assert uncovered_pairs(cases, every) == []
    assert 12 <= len(cases) <= 14  # the two largest factors' product is the least possible
    assert len(cases) < len(list(itertools.product(*FACTORS.values())))


def test_a_rule_removes_exactly_the_pairs_it_forbids():
    required = required_pairs(FACTORS, _no_a3_with_x)
    assert (("a", 3), ("b", "x")) not in required
    assert (("a", 3), ("b", "y")) in required
    cases = covering_cases(FACTORS, _no_a3_with_x)
    assert uncovered_pairs(cases, required) == []
    assert all(_no_a3_with_x(c) for c in cases)


def test_a_pair_no_complete_case_allows_is_not_required():
    # c=True needs d=1, and a=0 forbids d=1: (a=0, c=True) can never occur
    def rule(case):
        if case.get("c") is True and case.get("d", 1) != 1:
            return False
        return not (case.get("a") == 0 and case.get("d") == 1)

    required = required_pairs(FACTORS, rule)
    assert (("a", 0), ("c", True)) not in required
    assert uncovered_pairs(covering_cases(FACTORS, rule), required) == []


def test_the_array_is_the_same_in_every_process():
    code = ("from rlconform.fixtures.strategies import batch_cases; "
            "print([(r.family, r.layout, r.media, r.rows, r.form) for r in batch_cases()])")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": seed}, check=True).stdout
            for seed in ("1", "2")}
    assert len(runs) == 1


def test_batch_cases_cover_their_pairs_and_obey_the_rule():
    factors = batch_factors()
    cases = batch_cases()
    declared = [{"family": r.family, "positions": {None: "none", 0: "flat"}.get(
                     r.position_ids, "mrope"), "layout": r.layout, "rows": r.rows,
                 "media": r.media, "form": r.form, "dtype": r.dtype, "specials": r.specials}
                for r in cases]
    assert all(batch_rule(c) for c in declared)
    assert uncovered_pairs(declared, required_pairs(factors, batch_rule)) == []
    assert len(cases) < 100, f"{len(cases)} explicit cases: the array grew"


def test_batch_cases_are_in_the_regimes_they_declare():
    """Built and observed (regimes_of): family, layout, media regime (turned media are told by
    shape, observed by count), form, M-RoPE and row count."""
    for r in batch_cases():
        got = regimes_of(r.build())
        want_rows = {1: "one", 4: "even", 5: "odd"}[r.rows]
        assert (got["family"], got["layout"], got["form"], got["row_count"]) == \
            (r.family, r.layout, r.form, want_rows), r
        assert got["mrope"] == (r.position_ids not in (None, 0)), r
        if r.media != "turned":
            assert got["media"] == r.media, r
        if r.rows == 1:
            assert r.media not in MULTI_ROW_MEDIA, r
