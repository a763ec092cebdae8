"""The report package: schema, metric summaries, renderers, diff and every gate rule.

Each gate rule has a report that differs from the all-green one in that one respect and must
fail the gate for that reason alone (exactly one reason), so a rule cannot pass by accident of
another rule firing.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import math
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlconform.reports import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    SCHEMA_VERSION,
    STATUSES,
    ReportValidationError,
    Tolerance,
    diff_reports,
    gate,
    load_report,
    render_diff,
    render_html,
    render_junit,
    render_markdown,
    score,
    summarize_clauses,
    summarize_series,
    summarize_values,
    validate_report,
    write_reports,
)
from rlconform.reports._common import is_flat
from rlconform.reports.html import plot_metric
from rlconform.reports.sample import example_report

XSS = "<script>alert('pwned')</script>"
TODAY = dt.date(2026, 12, 2)


def green() -> dict:
    return example_report()


def clause(report: dict, cid: str) -> dict:
    return next(c for c in report["clauses"] if c["id"] == cid)


def refresh(report: dict) -> dict:
    """Recompute the summary after a test edits clause statuses."""
    report["summary"] = summarize_clauses(report["clauses"])
    return report


def set_status(report: dict, cid: str, status: str, message: str = "boom", **extra) -> dict:
    c = clause(report, cid)
    c.update(status=status, message=message, **extra)
    if status in ("failed", "error"):
        c["tests"][0].update(outcome=status, message=message)
    if status == "skipped":
        for t in c["tests"]:
            t.update(outcome="skipped", message=message)
    return refresh(report)


WAIVER = {
    "index": 1,
    "category": "backend-bug",
    "reason": "known bug",
    "link": None,
    "expires": "2099-01-01",
    "expired": False,
    "scope": {"match": "known"},
    "covered": 1,
    "matched": 1,
    "xpass_tests": [],
    "unused": False,
}


def waive(report: dict, cid: str, waiver: dict | None = None, message: str = "known bug",
          all_tests: bool = False) -> dict:
    """A clause whose first test (every test: `all_tests`) failed and a waiver matched it."""
    c = clause(report, cid)
    tests = c["tests"] if all_tests else c["tests"][:1]
    for t in tests:
        t.update(outcome="waived", message=message, waived_by=[1])
    status = "waived" if len(tests) == len(c["tests"]) else "passed_with_waivers"
    c.update(status=status, message=message, waivers=[{**WAIVER, **(waiver or {})}])
    return refresh(report)


# --- schema and model ------------------------------------------------------------------------


def test_example_reports_are_valid():
    for failing in (False, True):
        validate_report(example_report(failing=failing))
    assert example_report()["schema_version"] == SCHEMA_VERSION


@pytest.mark.parametrize(
    "edit, path, words",
    [
        (lambda r: r["clauses"][3].update(status="bogus"), "$.clauses[3].status", ["bogus"]),
        (lambda r: r.pop("provenance"), "$", ["provenance"]),
        (lambda r: r["clauses"][0].pop("tests"), "$.clauses[0]", ["tests"]),
        (
            lambda r: r["clauses"][2]["tests"][1].update(outcome="xfail"),
            "$.clauses[2].tests[1].outcome",
            ["xfail"],
        ),
        (
            lambda r: r["clauses"][1].update(waivers=[{**WAIVER, "category": "wontfix"}]),
            "$.clauses[1].waivers[0].category",
            ["wontfix"],
        ),
        (
            lambda r: r["clauses"][1].update(waivers=[{**WAIVER, "expires": "soon"}]),
            "$.clauses[1].waivers[0].expires",
            ["soon"],
        ),
        (
            lambda r: clause(r, "TRAIN-RATIO-ONE")["metrics"]["probs_ratio"].pop("quantiles"),
            "$.clauses[11].metrics.probs_ratio",
            ["quantiles"],
        ),
        (
            lambda r: clause(r, "TRAIN-RATIO-ONE")["metrics"]["grad_norm"].update(kind="gauge"),
            "$.clauses[11].metrics.grad_norm.kind",
            ["gauge"],
        ),
        (lambda r: r["summary"].update(passed=-1), "$.summary.passed", ["-1"]),
        (lambda r: r.update(schema_version="3.0"), "$.schema_version", ["3.0"]),
        (lambda r: r["kill_matrix"]["mutants"][0].pop("killed"), "$.kill_matrix", ["killed"]),
    ],
)
def test_schema_rejects_a_broken_report_naming_the_path(edit, path, words):
    report = green()
    edit(report)
    with pytest.raises(ReportValidationError) as err:
        validate_report(report)
    assert err.value.path.startswith(path), str(err.value)
    assert f"at {err.value.path}:" in str(err.value)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    "edit, path, words",
    [
        (lambda r: r["summary"].update(failed=1), "$.summary.failed", ["says 1", "0 clauses"]),
        (lambda r: r["summary"].update(score=0.5), "$.summary.score",
         ["passed (without a waiver) / applicable"]),
        (
            lambda r: r["clauses"][1].update(id=r["clauses"][0]["id"]),
            "$.clauses[1].id",
            ["duplicate"],
        ),
        (
            lambda r: clause(r, "TRAIN-RATIO-ONE")["metrics"]["grad_norm"].update(value=math.nan),
            "$.clauses[11].metrics.grad_norm.value",
            ["finite"],
        ),
        (
            lambda r: clause(r, "GEN-LOGPROB-PARITY")["metrics"]["token_mult_prob_error"][
                "steps"
            ].append(99),
            "$.clauses[13].metrics.token_mult_prob_error",
            ["9 steps but 8 values"],
        ),
    ],
)
def test_cross_field_rules_name_the_path(edit, path, words):
    report = green()
    edit(report)
    with pytest.raises(ReportValidationError) as err:
        validate_report(report)
    assert err.value.path == path, str(err.value)
    for word in words:
        assert word in str(err.value)


def test_minor_versions_unknown_keys_and_rounded_scores_are_accepted():
    report = green()
    report["schema_version"] = "2.7"
    report["written_by_a_newer_runner"] = {"anything": 1}
    validate_report(report)
    report = example_report(failing=True)
    report["summary"]["score"] = round(report["summary"]["score"], 2)  # 0.857 written as 0.86
    validate_report(report)


def test_load_report_names_the_file(tmp_path):
    bad = tmp_path / "report.json"
    bad.write_text("{not json")
    with pytest.raises(ReportValidationError, match=r"report\.json.*not JSON"):
        load_report(bad)
    with pytest.raises(ReportValidationError, match="cannot read"):
        load_report(tmp_path / "missing.json")
    report = green()
    report["clauses"][0]["status"] = "bogus"
    bad.write_text(json.dumps(report))
    with pytest.raises(ReportValidationError, match=re.escape(str(bad))):
        load_report(bad)


def test_score_counts_only_clauses_passed_without_a_waiver():
    summary = {
        "passed": 10,
        "passed_with_waivers": 2,
        "failed": 1,
        "waived": 1,
        "xpass": 0,
        "skipped": 0,
        "incomplete": 0,
        "not_applicable": 3,
        "error": 1,
        "total": 18,
    }
    assert score(summary) == pytest.approx(10 / 15)
    assert score({**summary, "total": 3, "passed": 0, "passed_with_waivers": 0, "failed": 0,
                  "waived": 0, "error": 0}) is None
    # three backends read 100% under the old rule with no clause passing unwaived: now 0
    assert score({**summary, "passed": 0, "passed_with_waivers": 0, "failed": 0, "error": 0,
                  "waived": 15}) == 0.0
    assert example_report(failing=True)["summary"]["score"] == pytest.approx(11 / 14)


def test_a_schema_1_report_is_upgraded_and_scored_honestly():
    """A baseline written before schema 2 still loads: its waived clauses stay waived and its
    score counts them out."""
    from rlconform.reports.model import upgrade

    old = green()
    old["schema_version"] = "1.0"
    for c in old["clauses"]:
        c.pop("waivers")
        c["waiver"] = None
    c = clause(old, "DP-MEDIA-DEDUP")
    c.update(status="waived", waiver={k: WAIVER[k] for k in
                                      ("category", "reason", "link", "expires", "expired")})
    for key in ("passed_with_waivers", "incomplete"):
        old["summary"].pop(key)
    old["summary"]["passed"] -= 1
    old["summary"]["waived"] = 1
    new = upgrade(old)
    validate_report(new)
    assert new["upgraded_from"] == "1.0"
    assert clause(new, "DP-MEDIA-DEDUP")["waivers"][0]["reason"] == "known bug"
    applicable = new["summary"]["total"] - new["summary"]["not_applicable"]
    assert new["summary"]["score"] == pytest.approx((applicable - 1) / applicable)


# --- summarize_values -------------------------------------------------------------------------


def test_summarize_values_quantiles_interpolate_linearly():
    d = summarize_values([4.0, 1.0, 3.0, 2.0])
    assert d["quantiles"]["0.5"] == 2.5
    assert d["quantiles"]["0.25"] == 1.75  # position 0.25 * 3 = 0.75 between 1 and 2
    assert d["quantiles"]["0.99"] == pytest.approx(3.97)
    assert (d["min"], d["max"], d["mean"]) == (1.0, 4.0, 2.5)
    assert d["std"] == pytest.approx(math.sqrt(1.25))  # population std
    d = summarize_values(range(101))
    assert [d["quantiles"][k] for k in ("0.01", "0.05", "0.25", "0.5", "0.75", "0.95", "0.99")] == [
        1.0,
        5.0,
        25.0,
        50.0,
        75.0,
        95.0,
        99.0,
    ]
    assert d["count"] == 101 and sum(d["histogram"]["counts"]) == 101
    assert len(d["histogram"]["edges"]) == 31 and d["histogram"]["scale"] == "linear"


def _reference_quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=200))
def test_summarize_values_matches_a_sorted_reference(values):
    d = summarize_values(values)
    ordered = sorted(values)
    for key, got in d["quantiles"].items():
        assert got == pytest.approx(_reference_quantile(ordered, float(key)), rel=1e-9, abs=1e-6)
    assert d["min"] == ordered[0] and d["max"] == ordered[-1]
    assert ordered[0] - 1e-6 <= d["mean"] <= ordered[-1] + 1e-6
    assert sum(d["histogram"]["counts"]) == len(values)


def test_summarize_values_accepts_tensors_of_any_dtype_and_shape():
    torch = pytest.importorskip("torch")
    values = torch.tensor([[0.5, 1.0], [1.5, 2.0]], dtype=torch.bfloat16)
    assert summarize_values(values) == summarize_values([0.5, 1.0, 1.5, 2.0])
    grad = torch.ones(3, requires_grad=True) * 2
    assert summarize_values(grad)["mean"] == 2.0


def test_model_does_not_import_torch():
    code = (
        "import sys, rlconform.reports.model as m; m.summarize_values([1.0, 2.0]); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_summarize_values_sets_non_finite_values_aside():
    d = summarize_values([1.0, math.nan, math.inf, 3.0, -math.inf])
    assert (d["count"], d["nonfinite"], d["mean"]) == (2, 3, 2.0)
    empty = summarize_values([math.nan])
    assert empty["count"] == 0 and empty["min"] is None and empty["quantiles"]["0.5"] is None
    report = green()
    clause(report, "DP-ROUNDTRIP")["metrics"] = {"ratio": empty}
    validate_report(report)
    assert "ratio" in render_markdown(report) and "ratio" in render_html(report)


def test_summarize_values_log_bins_values_spanning_decades():
    d = summarize_values([1e-3, 1e-2, 1.0, 10.0, 1e3])
    edges = d["histogram"]["edges"]
    assert d["histogram"]["scale"] == "log"
    assert edges[0] == pytest.approx(1e-3) and edges[-1] == pytest.approx(1e3)
    assert edges[2] / edges[1] == pytest.approx(edges[1] / edges[0])


def test_summarize_series_sorts_steps_and_drops_histograms():
    s = summarize_series({2: [3.0], 0: [1.0, 2.0]})
    assert s["steps"] == [0, 2]
    assert [v["mean"] for v in s["values"]] == [1.5, 3.0]
    assert all("histogram" not in v for v in s["values"])


# --- gate -------------------------------------------------------------------------------------


def only_reason(result, needle: str) -> None:
    assert not result.ok and result.exit_code == EXIT_FAILED, result.render()
    assert len(result.reasons) == 1, result.reasons
    assert needle in result.reasons[0], result.reasons


def test_all_green_report_passes_the_gate():
    result = gate(green(), baseline=green(), required=["DP-ROUNDTRIP"], today=TODAY)
    assert (result.ok, result.reasons, result.exit_code) == (True, [], EXIT_OK)


@pytest.mark.parametrize("status", ["failed", "error"])
def test_gate_fails_a_required_clause_that_failed_or_errored(status):
    report = set_status(green(), "DP-ROUNDTRIP", status, "lost pixel_values")
    only_reason(gate(report, today=TODAY), f"required clause DP-ROUNDTRIP {status}: lost pixel")


def test_gate_lets_an_advisory_clause_fail():
    report = set_status(green(), "DP-ROUNDTRIP", "failed", required=False)
    assert gate(report, today=TODAY).ok


def test_gate_required_ids_must_be_present_and_pass():
    report = set_status(green(), "DP-ROUNDTRIP", "failed", required=False)
    only_reason(gate(report, required=["DP-ROUNDTRIP"], today=TODAY), "DP-ROUNDTRIP failed")
    only_reason(gate(green(), required=["NOPE-1"], today=TODAY), "NOPE-1 is not in the report")
    only_reason(
        gate(green(), required=["DP-OBJECT-COLUMNS"], today=TODAY),
        "DP-OBJECT-COLUMNS did not pass (status not_applicable)",
    )


def test_gate_fails_an_expired_waiver():
    report = waive(green(), "DP-MEDIA-DEDUP", {"expires": "2026-11-01", "expired": True})
    only_reason(gate(report, today=TODAY), "waiver #1 of DP-MEDIA-DEDUP expired on 2026-11-01")


def test_gate_fails_a_waiver_whose_date_passed_since_the_run():
    report = waive(green(), "DP-MEDIA-DEDUP", {"expires": "2026-12-01"})
    only_reason(gate(report, today=TODAY), "expired on 2026-12-01")
    assert gate(report, today=dt.date(2026, 11, 30)).ok


def test_gate_accepts_waived_and_passed_with_waivers():
    assert gate(waive(green(), "DP-MEDIA-DEDUP"), today=TODAY).ok
    result = gate(waive(green(), "DP-MEDIA-DEDUP", all_tests=True), today=TODAY)
    assert result.ok
    # a green gate still says how green: the honest score and the waived clause
    s = green()["summary"]
    n = s["total"] - s["not_applicable"]
    assert f"{n - 1} of {n} applicable clauses pass without a waiver" in result.render()
    assert "1 waived" in result.render()


def test_gate_fails_an_unexpected_pass():
    report = waive(green(), "DP-MEDIA-DEDUP")
    c = clause(report, "DP-MEDIA-DEDUP")
    c["tests"][0].update(outcome="xpass", message="covered by DP-MEDIA-DEDUP waiver #1 but "
                         "passed: remove or narrow the waiver")
    set_status(report, "DP-MEDIA-DEDUP", "xpass", c["tests"][0]["message"])
    only_reason(gate(report, today=TODAY), "DP-MEDIA-DEDUP: a waiver no longer holds (xpass)")


def test_gate_fails_an_incomplete_clause():
    report = set_status(green(), "DP-MEDIA-DEDUP", "incomplete", "partial: 1 of 3 reported")
    only_reason(gate(report, today=TODAY), "DP-MEDIA-DEDUP was not fully run (incomplete)")


def test_gate_fails_a_run_that_lost_coverage_unless_told():
    """A backend that stops declaring a capability must not keep a green gate: the baseline
    tested DP-NO-ALIAS, this run does not."""
    report = set_status(green(), "DP-NO-ALIAS", "not_applicable",
                        "backend does not declare ['partitions']", tests=[])
    only_reason(gate(report, baseline=green(), today=TODAY),
                "coverage lost: DP-NO-ALIAS was tested in the baseline and is not now")
    assert gate(report, baseline=green(), today=TODAY,
                allow_coverage_drop=["DP-NO-ALIAS"]).ok
    assert gate(report, baseline=green(), today=TODAY, allow_coverage_drop=["all"]).ok
    report["coverage_drops_allowed"] = [{"clause": "DP-NO-ALIAS", "reason": "dropped on purpose"}]
    assert gate(report, baseline=green(), today=TODAY).ok
    # a clause deselected from the run loses coverage as well (the partial run fails anyway)
    partial = green()
    partial["clauses"] = [c for c in partial["clauses"] if c["id"] != "DP-NO-ALIAS"]
    partial["deselected"] = ["DP-NO-ALIAS"]
    refresh(partial)
    result = gate(partial, baseline=green(), today=TODAY)
    assert any("coverage lost: DP-NO-ALIAS" in r and "deselected" in r for r in result.reasons), \
        result.reasons
    assert result.word == "PARTIAL", result.reasons  # failed only for being a partial run
    # coverage lost for another reason (a capability dropped) beside the partial run: FAIL
    dropped = set_status(green(), "DP-NO-ALIAS", "not_applicable",
                         "backend does not declare ['partitions']", tests=[])
    dropped["deselected"] = ["DP-MEDIA-DEDUP"]
    assert gate(dropped, baseline=green(), today=TODAY).word == "FAIL"


def test_gate_fails_a_skipped_clause():
    report = set_status(green(), "DP-MEDIA-DEDUP", "skipped", "fixture unavailable")
    only_reason(gate(report, today=TODAY), "DP-MEDIA-DEDUP applies but was skipped")


def test_gate_fails_a_kill_matrix_with_a_survivor_or_a_claim_that_did_not_kill():
    report = green()
    km = report["kill_matrix"]
    km["regime"] = {"device": "cuda", "dtype": "bfloat16", "model_size": "production"}
    km["mutants"][0].update(killed=False, failed=[])
    only_reason(gate(report, today=TODAY),
                f"mutant {km['mutants'][0]['name']} survived in the kill matrix (cuda, bfloat16, "
                "production)")
    report = green()
    m = report["kill_matrix"]["mutants"][1]
    report["kill_matrix"]["claims_not_killed"] = [{"mutant": m["name"], "clause": "DP-X"}]
    only_reason(gate(report, today=TODAY), f"DP-X claims to kill {m['name']} but did not")


def test_gate_fails_run_problems():
    report = green()
    report["problems"] = ["waiver for UNKNOWN-ID names no clause"]
    only_reason(gate(report, today=TODAY), "problem: waiver for UNKNOWN-ID names no clause")


def test_gate_fails_a_clause_that_passed_in_the_baseline():
    report = set_status(green(), "DP-ROUNDTRIP", "failed", required=False)
    assert gate(report, today=TODAY).ok  # advisory: only the baseline makes this a failure
    only_reason(
        gate(report, baseline=green(), today=TODAY),
        "regression: clause DP-ROUNDTRIP passed in the baseline, now failed",
    )


def test_gate_fails_a_test_that_passed_in_the_baseline():
    baseline = set_status(green(), "DP-ROUNDTRIP", "failed", required=False)
    report = copy.deepcopy(baseline)
    test = clause(report, "DP-ROUNDTRIP")["tests"][1]
    test.update(outcome="failed", message="second family broke too")
    assert gate(report, baseline=report, today=TODAY).ok
    only_reason(
        gate(report, baseline=baseline, today=TODAY),
        f"regression: test {test['nodeid']} passed in the baseline, now failed",
    )


def test_gate_a_new_waiver_excuses_a_regression_it_matches_and_no_other():
    report = waive(green(), "DP-ROUNDTRIP")
    assert gate(report, baseline=green(), today=TODAY).ok
    other = clause(report, "DP-ROUNDTRIP")["tests"][1]
    other.update(outcome="failed", message="another failure")
    set_status(report, "DP-ROUNDTRIP", "failed", "another failure")
    clause(report, "DP-ROUNDTRIP")["tests"][0].update(outcome="waived")
    reasons = gate(report, baseline=green(), today=TODAY).reasons
    assert any(other["nodeid"] in r or "DP-ROUNDTRIP" in r for r in reasons), reasons


def test_gate_exit_code_2_for_unusable_input(tmp_path):
    broken = green()
    broken["clauses"][0]["status"] = "bogus"
    result = gate(broken)
    assert (result.ok, result.exit_code) == (False, EXIT_USAGE)
    assert "$.clauses[0].status" in result.reasons[0]
    assert gate(green(), baseline=broken).exit_code == EXIT_USAGE
    assert gate(tmp_path / "missing.json").exit_code == EXIT_USAGE
    other = green()
    other["backend"] = "mooncake"
    assert gate(green(), baseline=other).exit_code == EXIT_USAGE


def test_gate_reads_paths(tmp_path):
    paths = write_reports(set_status(green(), "DP-NO-ALIAS", "skipped", "no"), tmp_path)
    result = gate(paths["json"], today=TODAY)
    assert result.exit_code == EXIT_FAILED and "DP-NO-ALIAS" in result.render()


# --- diff -------------------------------------------------------------------------------------


def test_diff_of_identical_reports_is_empty():
    result = diff_reports(green(), green())
    assert result.unchanged and not result.regressed
    assert "no changes" in render_diff(result)


def _edit_metric(report: dict, cid: str, name: str, **stats) -> None:
    metric = clause(report, cid)["metrics"][name]
    target = metric["values"][-1] if metric["kind"] == "series" else metric
    target.update(stats)


@pytest.mark.parametrize(
    "edit, field, expect, section",
    [
        (
            lambda r: set_status(r, "DP-ROUNDTRIP", "failed"),
            "newly_failing",
            ("DP-ROUNDTRIP", "passed", "failed"),
            "newly failing",
        ),
        (
            lambda r: waive(r, "DP-MEDIA-DEDUP", all_tests=True),
            "newly_waived",
            ("DP-MEDIA-DEDUP", "passed", "waived"),
            "newly waived",
        ),
        (
            lambda r: set_status(r, "DP-NO-ALIAS", "not_applicable", "capability dropped"),
            "coverage_lost",
            ("DP-NO-ALIAS", "passed", "not_applicable"),
            "coverage lost",
        ),
        (
            lambda r: set_status(r, "DP-NO-ALIAS", "incomplete", "partial"),
            "newly_failing",
            ("DP-NO-ALIAS", "passed", "incomplete"),
            "newly failing",
        ),
        (
            lambda r: r["clauses"].pop(0) and refresh(r),
            "clauses_removed",
            ("BATCH-TRUNCATE-MEDIA", "passed", None),
            "clauses removed",
        ),
    ],
)
def test_diff_clause_categories(edit, field, expect, section):
    old, new = green(), green()
    old["clauses"].sort(key=lambda c: c["id"])
    new["clauses"].sort(key=lambda c: c["id"])
    edit(new)
    result = diff_reports(old, new)
    changes = getattr(result, field)
    assert [(c.id, c.old, c.new) for c in changes] == [expect]
    assert section in render_diff(result)
    others = [
        f
        for f in (
            "newly_failing",
            "newly_passing",
            "newly_waived",
            "less_waived",
            "clauses_added",
            "clauses_removed",
            "other_status_changes",
            "coverage_gained",
            "coverage_lost",
        )
        if f != field
    ]
    assert all(not getattr(result, f) for f in others)


def test_diff_newly_passing_and_added():
    old = set_status(green(), "DP-ROUNDTRIP", "failed")
    new = green()
    extra = copy.deepcopy(clause(new, "DP-NO-ALIAS"))
    extra.update(id="DP-NEW", tests=[])
    new["clauses"].append(extra)
    refresh(new)
    result = diff_reports(old, new)
    assert [(c.id, c.old, c.new) for c in result.newly_passing] == [
        ("DP-ROUNDTRIP", "failed", "passed")
    ]
    assert [(c.id, c.old, c.new) for c in result.clauses_added] == [("DP-NEW", None, "passed")]
    assert [t.kind for t in result.test_changes] == ["fixed"]
    text = render_diff(result)
    assert "newly passing (1)" in text and "clauses added (1)" in text and "tests fixed" in text


def test_diff_tells_a_waiver_that_hides_less_from_a_new_waiver():
    """waived -> passed with waivers is a partial fix (a framework's PR), not "newly waived"."""
    old = waive(green(), "DP-MEDIA-DEDUP", all_tests=True)
    new = waive(green(), "DP-MEDIA-DEDUP")
    assert clause(new, "DP-MEDIA-DEDUP")["status"] == "passed_with_waivers"
    result = diff_reports(old, new)
    assert [(c.id, c.old, c.new) for c in result.less_waived] == [
        ("DP-MEDIA-DEDUP", "waived", "passed_with_waivers")]
    assert not result.newly_waived and not result.regressed
    assert "passing some tests now (were waived) (1)" in render_diff(result)
    back = diff_reports(new, old)  # the other way round: newly waived, not a fix
    assert [c.id for c in back.newly_waived] == ["DP-MEDIA-DEDUP"] and not back.less_waived


def test_diff_coverage_gained_is_not_a_fix():
    old = set_status(green(), "DP-NO-ALIAS", "not_applicable", "capability not declared")
    for t in clause(old, "DP-NO-ALIAS")["tests"]:
        t.update(outcome="not_applicable")
    result = diff_reports(old, green())
    assert [(c.id, c.old, c.new) for c in result.coverage_gained] == [
        ("DP-NO-ALIAS", "not_applicable", "passed")]
    assert not result.newly_passing
    assert {t.kind for t in result.test_changes} == {"coverage gained"}
    text = render_diff(result)
    assert "coverage gained" in text and "tests fixed" not in text


def test_diff_lists_per_family_fixes_and_breaks():
    old, new = green(), green()
    for report, fam, outcome in ((old, "qwen2_vl", "failed"), (new, "gemma3", "failed")):
        c = clause(report, "DP-ROUNDTRIP")
        c["by_family"] = {"qwen2_vl": {"passed": 1}, "gemma3": {"passed": 1}}
        c["by_family"][fam] = {outcome: 1}
    result = diff_reports(old, new)
    kinds = {(f.clause, f.family): f.kind for f in result.family_changes}
    assert kinds == {("DP-ROUNDTRIP", "qwen2_vl"): "fixed", ("DP-ROUNDTRIP", "gemma3"): "broke"}
    text = render_diff(result)
    assert "per family, fixed (1;" in text and "DP-ROUNDTRIP [qwen2_vl]  0/1 F1 -> 1/1" in text


def test_diff_waiver_expired():
    old = waive(green(), "DP-MEDIA-DEDUP", all_tests=True)
    new = waive(green(), "DP-MEDIA-DEDUP", {"expires": "2026-01-01", "expired": True},
                all_tests=True)
    result = diff_reports(old, new)
    assert [c.id for c in result.waivers_expired] == ["DP-MEDIA-DEDUP"]
    assert result.regressed and "waivers expired (1)" in render_diff(result)


def test_diff_test_level_changes():
    old, new = green(), green()
    tests = clause(new, "DP-ROUNDTRIP")["tests"]
    tests[0].update(outcome="failed", message="row 2 lost")
    removed = tests.pop(1)
    tests.append(
        {
            "nodeid": "conformance/clauses/test_transport.py::test_roundtrip[new]",
            "outcome": "passed",
            "duration_s": 0.1,
            "message": "",
            "hypothesis": None,
        }
    )
    result = diff_reports(old, new)
    kinds = {t.nodeid: t.kind for t in result.test_changes}
    assert kinds == {
        tests[0]["nodeid"]: "regressed",
        removed["nodeid"]: "removed",
        tests[-1]["nodeid"]: "added",
    }
    assert result.regressed and not result.newly_failing
    text = render_diff(result)
    assert "tests regressed (1)" in text and "row 2 lost" in text


def test_diff_shows_run_problems_new_as_regression_and_gone():
    interrupted = "run interrupted before every selected test reported: 115 of 119 tests"
    old, new = green(), green()
    new["problems"] = [interrupted]
    result = diff_reports(old, new)
    assert result.problems_new == [interrupted] and result.regressed and not result.unchanged
    text = render_diff(result)
    assert "new run problems (1)" in text and interrupted in text
    back = diff_reports(new, old)
    assert back.problems_gone == [interrupted] and not back.regressed and not back.unchanged
    assert "run problems gone (1)" in render_diff(back)
    assert diff_reports(new, copy.deepcopy(new)).unchanged, "a problem both runs had is no change"


@pytest.mark.parametrize(
    "cid, name, stats, measure",
    [
        ("TRAIN-RATIO-ONE", "probs_ratio", {"max": 1.001}, "|max - 1|"),
        ("TRAIN-RATIO-ONE", "probs_ratio", {"min": 0.999}, "|min - 1|"),
        ("GEN-LOGPROB-PARITY", "token_mult_prob_error", {"mean": 1.05}, "mean"),
        ("GEN-LOGPROB-PARITY", "token_mult_prob_error", {"max": 1.5}, "max"),
    ],
)
def test_diff_metric_regressions_beyond_tolerance(cid, name, stats, measure):
    new = green()
    _edit_metric(new, cid, name, **stats)
    result = diff_reports(green(), new)
    assert [(m.clause, m.metric, m.measure) for m in result.metric_regressions] == [
        (cid, name, measure)
    ]
    assert result.regressed and "metric regressions (1)" in render_diff(result)


def test_diff_metric_changes_within_tolerance_or_unnamed_are_quiet():
    new = green()
    _edit_metric(new, "TRAIN-RATIO-ONE", "probs_ratio", max=1.0 + 2**-23)  # one float32 ulp
    _edit_metric(new, "GEN-LOGPROB-PARITY", "token_mult_prob_error", mean=1.005)
    _edit_metric(new, "GEN-LOGPROB-PARITY", "logprob_abs_diff", max=5.0)  # no tolerance named
    result = diff_reports(green(), new)
    assert result.metric_regressions == []
    strict = {"logprob_abs_diff": (Tolerance("max", 0.1),)}
    assert [m.metric for m in diff_reports(green(), new, tolerances=strict).metric_regressions] == [
        "logprob_abs_diff"
    ]


# --- markdown ---------------------------------------------------------------------------------


def _unescaped_pipes(line: str) -> int:
    return len(re.findall(r"(?<!\\)\|", line))


def test_markdown_lists_failures_first():
    md = render_markdown(example_report(failing=True))
    assert md.splitlines()[0].endswith("FAIL")
    order = [
        md.index(h)
        for h in (
            "### Why the gate fails",
            "### Failures",
            "### Waivers",
            "### Clauses",
            "### Metrics",
            "### Mutant kill matrix",
            "Provenance",
        )
    ]
    assert order == sorted(order)
    failures = md[md.index("### Failures") : md.index("### Waivers")]
    # the required failure before the advisory one, both with their messages
    assert failures.index("TRAIN-FIELD-PARITY") < failures.index("E2E-GRPO-SMOKE")
    assert "pixel_values missing from the train fetch" in failures
    assert "@reproduce_failure" in failures
    assert "2099-03-01" in md[md.index("### Waivers") :]
    assert "9/10 mutants killed" in md
    assert render_markdown(green()).splitlines()[0].endswith("PASS")


def test_markdown_escapes_pipes_newlines_and_html():
    report = set_status(green(), "DP-ROUNDTRIP", "failed", f"a | b\nc {XSS}")
    md = render_markdown(report)
    assert XSS not in md
    assert "a \\| b<br>c &lt;script&gt;" in md
    table = md[md.index("### Clauses") : md.index("### Metrics")].splitlines()[1:]
    rows = [line for line in table if line.startswith("|")]
    assert rows and all(_unescaped_pipes(line) == 9 for line in rows)  # 8 columns


def test_markdown_caps_failing_tests_per_clause():
    report = green()
    c = clause(report, "DP-ROUNDTRIP")
    c["tests"] = [
        {"nodeid": f"t.py::test_x[{i}]", "outcome": "failed", "message": f"case {i} broke"}
        for i in range(8)
    ]
    md = render_markdown(set_status(report, "DP-ROUNDTRIP", "failed", "eight cases broke"))
    assert "case 4 broke" in md and "case 5 broke" not in md
    assert "and 3 more failing tests" in md


def test_markdown_shows_metric_ranges_and_provenance():
    md = render_markdown(green())
    assert "| TRAIN-RATIO-ONE | probs_ratio | distribution | 812 | 1 | 1 | 1 |" in md
    assert "token_mult_prob_error | series (8 steps)" in md
    assert "packages.torch | 2.13.0" in md


# --- html -------------------------------------------------------------------------------------


def _xss_report() -> dict:
    report = set_status(example_report(failing=True), "DP-ROUNDTRIP", "failed", XSS)
    c = clause(report, "DP-ROUNDTRIP")
    c["title"] = XSS
    c["tests"][0]["hypothesis"] = {"example": XSS, "blob": XSS}
    c["metrics"] = {"x<script>": summarize_values([1.0, 2.0])}
    report["problems"] = [XSS]
    w = clause(report, "DP-MEDIA-DEDUP")["waivers"][0]
    w.update(reason=XSS, function=XSS, input=XSS, scope={"match": XSS})
    return refresh(report)


def test_html_escapes_report_text():
    page = render_html(_xss_report())
    assert XSS not in page
    assert "&lt;script&gt;alert(&#39;pwned&#39;)&lt;/script&gt;" in page
    assert page.count("<script") == 1  # the page's own filter script only


def test_html_is_self_contained_with_one_plot_per_varying_distribution_or_series():
    report = example_report(failing=True)
    page = render_html(report)
    # links may point out (a waiver's issue); nothing the page loads may
    assert not re.search(r"""src=["']?(https?:)?//""", page)
    assert "<link" not in page and "url(" not in page and "@import" not in page
    srcs = re.findall(r'<img src="([^"]+)"', page)
    plotted = [
        m
        for c in report["clauses"]
        for m in (c.get("metrics") or {}).values()
        if m["kind"] == "series" or (m["kind"] == "distribution" and not is_flat(m))
    ]
    assert len(srcs) == len(plotted) >= 5  # a constant distribution is a table row, no plot
    for src in srcs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    for needle in (
        'id="clauses"',
        'id="f-status"',
        'id="f-surface"',
        'id="kill-matrix"',
        'id="provenance"',
        'data-status="failed"',
        'data-surface="transport"',
    ):
        assert needle in page


def test_html_kill_matrix_marks_expected_and_actual_failures():
    page = render_html(example_report(failing=True))
    matrix = page[page.index('id="kill-matrix"') :]
    assert 'class="cell k-killed"' in matrix  # expected and failed
    assert 'class="cell k-missed"' in matrix  # tile_count_lost survived
    assert 'class="cell k-extra"' in matrix  # truncated_wire_tensors also failed DP-ROUNDTRIP


def test_plots_cover_each_metric_kind():
    series = summarize_series({0: [1.0, 2.0], 1: [1.5, 3.0]})
    for metric in (
        summarize_values([1.0] * 5),
        summarize_values([1e-4, 1.0, 1e4]),
        series,
        {**summarize_values([1.0, 2.0]), "histogram": None},
    ):
        metric = {k: v for k, v in metric.items() if v is not None}
        assert plot_metric("C", "probs_ratio", metric)[:4] == b"\x89PNG"
    assert plot_metric("C", "g", {"kind": "scalar", "value": 1.0}) is None
    assert plot_metric("C", "e", summarize_values([math.nan])) is None


# --- junit ------------------------------------------------------------------------------------


def _cases(xml: str) -> dict[str, ET.Element]:
    root = ET.fromstring(xml)
    return {f"{c.get('classname')}::{c.get('name')}": c for c in root.iter("testcase")}


def _props(case: ET.Element, name: str) -> list[str]:
    return [p.get("value") for p in case.iter("property") if p.get("name") == name]


def test_junit_has_clause_properties_and_outcomes():
    report = example_report(failing=True)
    set_status(report, "DP-NO-ALIAS", "error", "fixture crashed")
    merge = clause(report, "DP-MERGE-PUT")
    merge["tests"][0].update(outcome="xpass", message="covered by waiver #1 but passed")
    set_status(report, "DP-MERGE-PUT", "xpass", "waiver #1 expects 1 test(s) to fail",
               waivers=[WAIVER])
    set_status(report, "WIRE-ROUNDTRIP", "skipped", "no fixture")
    report["problems"] = ["waiver for UNKNOWN-ID names no clause"]
    xml = render_junit(report)
    root = ET.fromstring(xml)
    suite = root.find("testsuite")
    assert suite.get("name") == "rlconform.reference"
    cases = _cases(xml)
    assert all(_props(c, "clause") for c in cases.values() if c.get("classname") != "rlconform.run")

    def case(nodeid_part: str) -> ET.Element:
        (hit,) = [c for k, c in cases.items() if nodeid_part in k]
        return hit

    failed = case("test_trainer::test_field_parity[idefics3]")
    assert _props(failed, "clause") == ["TRAIN-FIELD-PARITY"]
    assert failed.find("failure") is not None
    assert "@reproduce_failure" in failed.find("failure").text
    assert case("test_trainer::test_field_parity[qwen2_vl]").find("failure") is None
    waived = case("test_transport::test_media_dedup[gemma3]")
    assert waived.find("failure") is None and _props(waived, "waiver")
    assert waived.find("skipped").get("type") == "waived"
    assert case("test_transport::test_no_alias[qwen2_vl]").find("error") is not None
    assert case("test_transport::test_merge_put[qwen2_vl]").find("failure").get("type") == "xpass"
    assert case("test_codec::test_roundtrip[qwen2_vl]").find("skipped") is not None
    na = cases["rlconform.clause.transport::DP-OBJECT-COLUMNS"]
    assert na.find("skipped") is not None and _props(na, "clause") == ["DP-OBJECT-COLUMNS"]
    assert cases["rlconform.run::problem[0]"].find("failure") is not None
    counted = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    assert counted == {
        "tests": len(cases),
        "failures": sum(c.find("failure") is not None for c in cases.values()),
        "errors": sum(c.find("error") is not None for c in cases.values()),
        "skipped": sum(c.find("skipped") is not None for c in cases.values()),
    }


def test_junit_merges_a_test_tied_to_two_clauses_and_survives_control_characters():
    report = green()
    shared = copy.deepcopy(clause(report, "DP-ROUNDTRIP")["tests"][0])
    clause(report, "DP-MERGE-PUT")["tests"].append(shared)
    set_status(report, "DP-ROUNDTRIP", "failed", "ansi \x1b[31mred\x1b[0m and nul \x00")
    cases = _cases(render_junit(report))
    classname, name = shared["nodeid"].split("::")
    merged = cases[f"{classname.removesuffix('.py').replace('/', '.')}::{name}"]
    assert _props(merged, "clause") == ["DP-ROUNDTRIP", "DP-MERGE-PUT"]
    assert "\\x1b[31mred" in merged.find("failure").text


def _minimal(clauses: list[dict]) -> dict:
    return {
        "schema_version": "2.0",
        "backend": "bare",
        "backend_info": {"name": "bare", "surfaces": ["transport"], "capabilities": []},
        "provenance": {
            "rlconform_version": "0.1.0",
            "python": "3.11",
            "platform": "linux",
            "packages": {},
            "device": {"type": "cpu"},
        },
        "summary": summarize_clauses(clauses),
        "clauses": clauses,
    }


@pytest.mark.parametrize(
    "clauses",
    [[], [{"id": "DP-X", "status": "failed", "message": "only the required keys", "tests": []}]],
)
def test_a_minimal_report_renders_in_every_format(clauses, tmp_path):
    report = _minimal(clauses)
    paths = write_reports(report, tmp_path)
    assert load_report(paths["json"]) == report
    verdict = gate(report)
    assert verdict.ok is (not clauses)
    if not clauses:
        assert "0 of 0 applicable clauses pass without a waiver (score n/a)" in \
            paths["markdown"].read_text()
    else:
        assert "DP-X" in paths["html"].read_text()
        (case,) = ET.parse(paths["junit"]).getroot().iter("testcase")
        assert case.find("failure").get("message") == "only the required keys"


# --- write ------------------------------------------------------------------------------------


def test_write_reports_writes_every_format(tmp_path):
    report = example_report(failing=True)
    paths = write_reports(report, tmp_path / "out")
    assert {p.name for p in paths.values()} == {
        "report.json",
        "report.md",
        "report.html",
        "junit.xml",
    }
    assert load_report(paths["json"]) == report
    ET.parse(paths["junit"])
    assert paths["html"].read_text().startswith("<!DOCTYPE html>")
    assert paths["markdown"].read_text() == render_markdown(report)


def test_write_reports_rejects_an_invalid_report_and_writes_nothing(tmp_path):
    report = green()
    report["summary"]["passed"] += 1
    with pytest.raises(ReportValidationError, match=r"\$\.summary\.passed"):
        write_reports(report, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_statuses_match_the_schema():
    from rlconform.reports.model import load_schema

    assert tuple(load_schema()["$defs"]["status"]["enum"]) == STATUSES


def test_gate_fails_a_partial_run():
    from rlconform.reports.gate import gate
    from rlconform.reports.sample import example_report

    report = example_report(failing=False)
    assert gate(report).ok, gate(report).reasons
    report["deselected"] = ["TRAIN-RATIO-ONE"]
    result = gate(report)
    assert not result.ok and any("TRAIN-RATIO-ONE" in r for r in result.reasons)


def test_a_partial_run_with_nothing_failing_reads_partial_not_fail():
    """`--surfaces transport` on a store whose every clause passes: the gate fails the partial
    run, and every format says PARTIAL (it said "FAIL: 24 of 24 ... pass")."""
    from rlconform.reports._common import headline
    from rlconform.reports.sample import example_report

    report = example_report(failing=False)
    report["deselected"] = ["TRAIN-RATIO-ONE"]
    assert headline(report).startswith("PARTIAL: "), headline(report)
    assert render_markdown(report).splitlines()[0].endswith("· PARTIAL")
    assert ">PARTIAL</span>" in render_html(report)
    report["clauses"][0]["status"] = "failed"  # a failure as well: FAIL everywhere
    report["summary"] = summarize_clauses(report["clauses"])
    assert headline(report).startswith("FAIL: ")
    assert render_markdown(report).splitlines()[0].endswith("· FAIL")


def test_flat_distributions_are_not_plotted():
    from rlconform.reports._common import is_flat

    assert is_flat({"kind": "distribution", "min": 1.0, "max": 1.0})
    assert is_flat({"kind": "distribution", "min": 0.0, "max": 1.1e-13})
    assert not is_flat({"kind": "distribution", "min": 0.83, "max": 1.08})
    assert not is_flat({"kind": "series", "steps": [0], "values": []})


def test_the_headline_is_the_honest_score_with_the_rest_beside_it(tmp_path):
    """A heavily waived backend does not read 100%: every format leads with the clauses that
    pass without a waiver over the applicable ones, and names waived and untested beside it."""
    clauses = [{"id": f"DP-{i}", "status": s, "message": "", "tests": []}
               for i, s in enumerate(["passed", "waived", "passed_with_waivers",
                                      "not_applicable"])]
    for c in clauses:
        if c["status"] in ("waived", "passed_with_waivers"):
            c["waivers"] = [{**WAIVER}]
    report = _minimal(clauses)
    report["not_tested"] = [{"kind": "capability", "name": "partitions", "clauses": ["DP-3"],
                             "why": "no partitions"}]
    paths = write_reports(report, tmp_path)
    head = "1 of 3 applicable clauses pass without a waiver (score 33.3%)"
    beside = "1 passed with waivers, 1 waived"
    for fmt in ("markdown", "html"):
        text = paths[fmt].read_text()
        assert head in text and beside in text, fmt
        assert "not tested: 1 by a capability not declared" in text
        assert "100" not in text.split(head)[0][-40:]
    interrupted = _minimal([{"id": "DP-0", "status": "passed", "message": "", "tests": []}])
    interrupted["problems"] = ["run interrupted before every selected test reported: 3 of 9"]
    md = write_reports(interrupted, tmp_path / "int")["markdown"].read_text()
    assert "score n/a: run incomplete" in md and "100.0%" not in md


# --- scores per surface ------------------------------------------------------------------------


def store_author_report(failing=("DP-CONCURRENT",), deselected=()) -> dict:
    """The report of `Backend.from_reference("my-store", transport=MyStore)` over the whole
    catalogue: every clause applies (the reference lends the other five surfaces); `failing`
    clauses failed, `deselected` ones were left out of the run."""
    from rlconform.conformance import catalogue

    report = example_report(failing=False)
    template = report["clauses"][0]
    report["backend"] = "my-store"
    report["backend_info"].update(
        name="my-store", surfaces=["transport", "codec", "meta", "batch_ops", "trainer",
                                   "rollout"],
        lent_surfaces=["codec", "meta", "batch_ops", "trainer", "rollout"])
    clauses = []
    for c in catalogue.CLAUSES:
        if c.id in deselected:
            continue
        entry = copy.deepcopy(template)
        entry.update(id=c.id, title=c.must, surface=c.surface, mutants=list(c.mutants))
        entry["tests"] = entry["tests"][:1]
        if c.id in failing:
            entry.update(status="failed", message="boom")
            entry["tests"][0].update(outcome="failed", message="boom")
        clauses.append(entry)
    report["clauses"] = clauses
    report["deselected"] = list(deselected)
    report["summary"] = summarize_clauses(clauses, not_run=len(deselected))
    return report


def test_a_store_authors_report_scores_the_store_on_the_clauses_that_touch_it():
    """A store built with from_reference: the store is scored on the clauses whose tests
    touch it (its own, and trainer / generation / rank clauses that move data through it,
    listed with the reference parts they ran with); the codec, meta, batch-ops, trainer and
    rollout clauses that never touch the store do not dilute its score."""
    from rlconform.reports.surfaces import derive, lines, surface_scores

    report = store_author_report()
    validate_report(report)
    scores = surface_scores(report)
    assert scores["implemented"] == ["transport"]
    assert scores["not_scored"] == ["codec", "meta", "batch_ops", "trainer", "rollout"]
    (store,) = scores["surfaces"]
    ids = set(store["clauses"])
    assert {"DP-CONCURRENT", "DP-ROUNDTRIP", "TRAIN-RATIO-ONE", "RANK-DP-PARITY"} <= ids
    assert not ids & {"WIRE-ROUNDTRIP", "META-TAGS", "BATCH-TRUNCATE", "GEN-ROLLOUT-FIELDS"}
    assert store["failed"] == 1 and store["passed"] == store["applicable"] - 1 < 72
    assert store["score"] == pytest.approx((len(ids) - 1) / len(ids))
    assert report["summary"]["score"] > store["score"]  # the run's score is diluted
    joint = {j["clause"]: j["lent"] for j in store["joint"]}
    assert joint["TRAIN-RATIO-ONE"] == ["codec", "meta", "trainer"]
    assert joint["DP-ROUNDTRIP"] == ["codec"] and "DP-CONCURRENT" not in joint
    assert lines(report)[0].startswith(f"transport: FAIL {store['score']:.1%} (")
    # written into a new report, derived from an older one: the same verdict
    assert derive(report) == scores
    report["surface_scores"] = scores
    validate_report(report)
    assert surface_scores(report) is report["surface_scores"]

    md = render_markdown(report)
    top = md[:md.index("### Clauses")]
    assert "### Surfaces judged" in top
    assert re.search(r"\| transport \| FAIL \| [\d.]+% \(\d+/\d+\)", top), top
    assert re.search(r"- transport jointly with the reference's codec, meta, trainer: "
                     r"[A-Z-, ]*TRAIN-RATIO-ONE", top), top
    assert "not scored (not implemented by the backend" in top
    page = render_html(report)
    assert 'id="surface-scores"' in page and "TRAIN-RATIO-ONE" in page
    text = gate(report).render()
    assert "surfaces judged" in text and "· transport: FAIL" in text, text


def test_a_reference_part_left_out_of_the_run_makes_the_surface_score_a_lower_bound():
    """`--surfaces transport` on a store author's backend: the trainer clauses that touch the
    store are not run, so the store's verdict is PARTIAL with a lower-bound score; the gate
    names the clauses not run once, briefly, and the report's top lists them once."""
    from rlconform.conformance import catalogue
    from rlconform.reports.surfaces import surface_scores

    left_out = [c.id for c in catalogue.CLAUSES if "transport" not in c.surfaces]
    report = store_author_report(failing=(), deselected=left_out)
    validate_report(report)
    (store,) = surface_scores(report)["surfaces"]
    touching = [cid for cid in left_out if cid.startswith(("TRAIN-", "GEN-LOGPROB", "GEN-REFIT"))]
    assert touching and store["not_run"] == len(touching) and store["lower_bound"]
    assert store["failed"] == 0 and store["score"] < 1
    result = gate(report)
    assert not result.ok and result.word == "PARTIAL"
    (reason,) = [r for r in result.reasons if "not run" in r]
    assert reason.startswith(f"partial run: {len(left_out)} applicable clause(s) not run: ")
    assert f"and {len(left_out) - 8} more" in reason
    assert "· transport: PARTIAL" in result.render() and "a lower bound" in result.render()
    page = render_html(report)
    header = page[:page.index("<h2>Clauses</h2>")]
    assert header.count(left_out[-1]) == 1, "a clause not run is listed twice at the top"
    md = render_markdown(report)
    assert md.count(left_out[-1]) == 1, md[:3000]
