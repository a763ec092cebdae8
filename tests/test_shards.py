"""Shards (`rlconform run --shard K/N`, `--placement`, `rlconform mutants --shard K/N`) and their
merge (`rlconform merge`): a shard split is a partition of the selection, the same on every
call, that keeps xdist groups whole; the merged report of a real run's shards has the verdicts
of the run made in one piece; a missing shard reads incomplete; reports of different runs are
refused, naming what differs."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlconform.conformance.engine import shards
from rlconform.conformance.engine.kill_matrix import shard_scope, summarize
from rlconform.conformance.engine.merge import MergeError, merge, merge_matrices
from rlconform.reports.diff import diff_reports, render_diff
from rlconform.reports.gate import gate
from rlconform.reports.model import load_report
from rlconform.reports.scoreboard import write as write_scoreboard

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "rlconform.conformance.cli"]


# -- the split ----------------------------------------------------------------------------------
def test_parse_takes_k_of_n_and_refuses_the_rest():
    assert shards.parse("2/3") == (2, 3) and shards.parse(None) is None
    for bad in ("0/3", "4/3", "3", "a/b", "1/0", "-1/2"):
        with pytest.raises(ValueError, match="K/N"):
            shards.parse(bad)


def test_assign_is_a_deterministic_balanced_partition_that_keeps_groups_whole():
    costs = {f"t{i}": float((i * 7) % 11 + 1) for i in range(40)}
    groups = {"t3": "g", "t17": "g", "t30": "g"}
    for n in (1, 2, 3, 5):
        where = shards.assign(costs, n, groups)
        assert set(where) == set(costs) and set(where.values()) <= set(range(1, n + 1))
        assert where == shards.assign(dict(reversed(list(costs.items()))), n, groups), \
            "the order names arrive in must not change the split"
        assert len({where[t] for t in groups}) == 1, "an xdist group was split"
        loads = [sum(c for t, c in costs.items() if where[t] == k) for k in range(1, n + 1)]
        unit_max = max(max(costs.values()), sum(costs[t] for t in groups))
        assert max(loads) - min(loads) <= unit_max, loads  # the LPT bound


def test_costs_come_from_the_record_then_the_function_then_the_cost_model():
    record = {"regimes": {"cuda/production/nightly": {"tests": {
        "test_a.py::test_x[qwen2_vl]": 30.0, "test_a.py::test_x[gemma3]": 10.0}}}}
    ids = {"test_a.py::test_x[qwen2_vl]": True, "test_a.py::test_x[smolvlm]": True,
           "test_b.py::test_y[smolvlm]": True, "test_b.py::test_z": False}
    fams = {"test_a.py::test_x[qwen2_vl]": "qwen2_vl", "test_a.py::test_x[smolvlm]": "smolvlm",
            "test_b.py::test_y[smolvlm]": "smolvlm", "test_b.py::test_z": None}
    c = shards.test_costs(ids, "cuda/production/nightly", fams, record)
    assert c["test_a.py::test_x[qwen2_vl]"] == 30.0
    assert c["test_a.py::test_x[smolvlm]"] == 20.0  # the function's mean
    assert c["test_b.py::test_y[smolvlm]"] > shards.MODEL_TEST_S  # smolvlm's plan > default
    assert c["test_b.py::test_z"] == shards.OTHER_TEST_S


def test_the_committed_record_covers_the_gpu_nightly():
    rec = shards.load_durations()["regimes"]
    assert len(rec["cuda/production/nightly"]["tests"]) > 400
    assert rec["cuda/production/ci"]["mutants"]


def test_the_record_folds_in_a_reports_durations_under_its_regime(tmp_path):
    matrix = {"regime": {"device": "cuda", "model_size": "production", "profile": "ci"},
              "mutants": [{"name": "m1", "duration_s": 12.5}, {"name": "m2", "duration_s": 0.0,
                                                                "error": "no report"}]}
    regime, tests, mutants = shards.durations_from(matrix)
    assert (regime, tests, mutants) == ("cuda/production/ci", {}, {"m1": 12.5})
    folded = shards.fold({"regimes": {"cuda/production/ci": {"mutants": {"m0": 3.0}}}},
                         regime, mutants=mutants)
    assert folded["regimes"]["cuda/production/ci"]["mutants"] == {"m0": 3.0, "m1": 12.5}
    with pytest.raises(ValueError, match="shard reports"):
        shards.durations_from({"clauses": [], "provenance": {"merged_shards": {}}})


def test_the_record_keeps_the_tests_that_killed_each_mutant():
    matrix = {"regime": {"device": "cpu", "model_size": "tiny", "profile": "ci"},
              "mutants": [
                  {"name": "m1", "killed": True, "duration_s": 2.0, "failed_tests": {
                      "test_a.py::t[b]": {"kind": "assertion"},
                      "test_a.py::t[c]": {"kind": "exception"}}},
                  {"name": "m2", "killed": False, "duration_s": 1.0, "failed_tests": {}},
                  {"name": "m3", "killed": True, "error": "no report", "failed_tests": {}}]}
    assert shards.killers_from(matrix) == {"m1": ["test_a.py::t[b]"]}  # by assertion only
    folded = shards.fold({"regimes": {}}, "cpu/tiny/ci", killed_by=shards.killers_from(matrix))
    assert shards.killers("cpu/tiny/ci", folded) == {"m1": ["test_a.py::t[b]"]}
    assert shards.killers("cuda/production/ci", folded) == {}
    # the committed record holds the main job's: every mutant killed there has its tests
    rec = shards.killers("cpu/tiny/ci")
    assert len(rec) > 150 and all(rec.values())


def test_a_mutant_run_puts_its_recorded_killers_first():
    from types import SimpleNamespace

    from rlconform.conformance.engine.mutant_worker import _KillersFirst

    root = "/x/rlconform/conformance/clauses/"
    items = [SimpleNamespace(nodeid=f"{root}test_a.py::t[{c}]") for c in "abcde"]
    _KillersFirst(["test_a.py::t[d]", "test_a.py::t[b]"]).pytest_collection_modifyitems(
        None, None, items)
    assert [i.nodeid[-2] for i in items] == ["b", "d", "a", "c", "e"]  # stable otherwise
    _KillersFirst([]).pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid[-2] for i in items] == ["b", "d", "a", "c", "e"]


def _collect(tmp_path: Path, *extra: str) -> tuple[list[str], dict]:
    """(ids a --collect-only run selects, its report's provenance.shard)."""
    out = tmp_path / f"c{len(list(tmp_path.glob('c*')))}"
    proc = subprocess.run([*CLI, "run", "--workers", "0", "--collect-only", "-q",
                           "--report-dir", str(out), *extra], capture_output=True, text=True,
                          cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    # (a collection alone runs no clause test: the run's exit status says so)
    assert "tests collected" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    ids = [ln.rsplit("clauses/", 1)[-1] for ln in proc.stdout.splitlines() if "::" in ln]
    return ids, json.loads((out / "reference" / "report.json").read_text())["provenance"]


# a plugin that puts the codec tests of one family in one xdist group, as a clause module may
GROUPER = textwrap.dedent("""
    import pytest

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(items):
        for item in items:
            if "test_codec" in item.nodeid and "gemma3" in item.nodeid:
                item.add_marker(pytest.mark.xdist_group("together"))
""")


# codec tests (two families), a trainer clause's tests and the RANK clauses' tests
SPLIT = ["-p", "rlc_grouper", "-k",
         "(test_codec and (qwen2_vl or gemma3)) or ratio_one_from or test_ranks"]


@pytest.fixture(scope="module")
def whole_selection(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("split")
    (tmp / "rlc_grouper.py").write_text(GROUPER)
    ids, _ = _collect(tmp, *SPLIT)
    return tmp, ids


def test_run_shards_partition_the_selection_after_k_and_keep_groups(whole_selection):
    tmp, whole = whole_selection
    got, scopes = {}, []
    for k in (1, 2, 3):
        ids, prov = _collect(tmp, *SPLIT, "--shard", f"{k}/3")
        shard = prov["shard"]
        assert (shard["k"], shard["n"]) == (k, 3)
        assert sorted(shard["scope"]) == sorted(whole), "the scope is the whole run's selection"
        assert sorted(ids) == sorted(i for i, e in shard["scope"].items() if e["shard"] == k)
        assert all(e["clauses"] for e in shard["scope"].values())
        scopes.append(shard["scope"])
        got[k] = ids
    assert scopes[0] == scopes[1] == scopes[2], "every shard computes the same split"
    assert sorted(sum(got.values(), [])) == sorted(whole), "union = the selection, disjoint"
    assert all(got.values()), "every shard got tests"
    grouped = {k for k, ids in got.items() for i in ids if "test_codec" in i and "gemma3" in i}
    assert len(grouped) == 1, f"the xdist group was split over shards {grouped}"


def test_placements_split_device_clauses_from_the_rest(whole_selection):
    tmp, whole = whole_selection
    device, prov = _collect(tmp, *SPLIT, "--placement", "device")
    host, _ = _collect(tmp, *SPLIT, "--placement", "host")
    assert sorted(device + host) == sorted(whole) and not set(device) & set(host)
    assert device and all("test_trainer" in i or "test_ranks" in i for i in device), device
    assert any("test_ranks" in i for i in device) and host
    assert (prov["shard"]["k"], prov["shard"]["n"], prov["shard"]["placement"]) == \
        (1, 1, "device")


def test_mutant_shards_partition_the_mutants():
    from rlconform.conformance.mutants import load_all

    n = 3
    scope = shard_scope([], n)
    assert sorted(scope) == sorted(load_all()) and set(scope.values()) == {1, 2, 3}
    assert scope == shard_scope([], n)
    trainer = [m for m, v in load_all().items() if v.surface == "trainer"]
    sub = shard_scope(["--device", "cuda", "--model-size", "production"], 2, trainer)
    assert sorted(sub) == sorted(trainer)


# -- the merge of a real run ----------------------------------------------------------------------
# DP-NO-ALIAS's two tests (one fails on the mutant, waived) and DP-LAYOUT's four: a waiver whose
# tests may fall in different shards, and several clauses to split
SELECT = "test_no_aliasing or test_tags_are_not_aliased or test_layout_preserved"
WAIVER = """
[[waiver]]
clause = "DP-NO-ALIAS"
category = "backend-bug"
reason = "put keeps the caller's tensor"
function = "T.put"
input = "a batch mutated by the caller after put"
tests = ["test_no_aliasing"]
match = "values differ at the bit level"
expires = 2099-01-01
"""


def _run(tmp_path: Path, name: str, *extra: str) -> Path:
    waivers = tmp_path / "waivers.toml"
    waivers.write_text(WAIVER)
    out = tmp_path / name
    subprocess.run([*CLI, "run", "--backend", "mutant:aliasing_put", "--workers", "0", "-q",
                    "--surfaces", "transport", "-k", SELECT, "--expectations", str(waivers),
                    "--report-dir", str(out), *extra], capture_output=True, text=True,
                   cwd=ROOT, timeout=300)
    path = out / "mutant_aliasing_put" / "report.json"
    assert path.is_file(), f"{name} wrote no report"
    return path


def _verdicts(report: dict) -> dict:
    return {c["id"]: (c["status"], c["message"], c["by_family"],
                      sorted((t["nodeid"], t["outcome"], t.get("failure_kind")) for t in c["tests"]),
                      [(w["index"], w["covered"], w["matched"], w["unused"]) for w in c["waivers"]])
            for c in report["clauses"]}


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shards")
    whole = _run(tmp, "whole")
    # shard 3 under xdist: its controller learns the scope from the workers
    parts = [_run(tmp, f"s{k}", "--shard", f"{k}/3", *(["--workers", "2"] if k == 3 else []))
             for k in (1, 2, 3)]
    return tmp, whole, parts


def test_merged_shards_give_the_verdicts_of_the_unsharded_run(real_run):
    tmp, whole, parts = real_run
    one = json.loads(whole.read_text())
    shard_tests = [sum(len(c["tests"]) for c in json.loads(p.read_text())["clauses"])
                   for p in parts]
    assert all(shard_tests) and sum(shard_tests) == sum(len(c["tests"]) for c in one["clauses"])
    assert _clause_status(one, "DP-NO-ALIAS") == "passed_with_waivers"  # the case is live
    for p in parts:  # every shard knows the run's scope, the xdist one (3) included
        shard = json.loads(p.read_text())["provenance"]["shard"]
        assert shard["scope"] and "scope_unknown" not in shard, shard
    report, _ = merge(parts, tmp / "merged")
    assert _verdicts(report) == _verdicts(one)
    assert report["summary"] == one["summary"] and report["deselected"] == one["deselected"]
    # the cells of the run: every shard's split undone, the run's own filters kept
    assert report["cells"] == one["cells"] and one["cells"]["partial"]
    assert "shard" not in {r["by"] for r in report["cells"]["dropped_by"]}
    for p in parts:
        alone = json.loads(p.read_text())
        assert "shard" in {r["by"] for r in alone["cells"]["dropped_by"]}
        assert "shard" not in alone["cells"]["partial_by"], "a shard is partial by design"
    assert report["problems"] == one["problems"]
    on_disk = load_report(tmp / "merged" / "report.json")  # the schema holds
    assert not any("record" in t for c in on_disk["clauses"] for t in c["tests"]), \
        "shard-only fields leaked into the merged report"
    assert {s["k"] for s in on_disk["provenance"]["merged_shards"]["shards"]} == {1, 2, 3}
    assert (tmp / "merged" / "report.md").is_file() and (tmp / "merged" / "junit.xml").is_file()
    # gate, diff and scoreboard read it as one run
    assert gate(tmp / "merged" / "report.json").render() == gate(whole).render()
    assert "no changes" in render_diff(diff_reports(one, on_disk))
    board = write_scoreboard([str(tmp / "merged" / "report.json")], str(tmp / "b.md"), None)
    assert len(board.entries) == 1


def _clause_status(report: dict, cid: str) -> str:
    return next(c["status"] for c in report["clauses"] if c["id"] == cid)


def test_one_shard_alone_reads_partial_and_names_itself(real_run):
    _, _, parts = real_run
    result = gate(parts[0])
    assert not result.ok and result.partial_only
    assert any("shard 1/3" in r and "rlconform merge" in r for r in result.reasons)


def test_a_missing_shard_reads_incomplete_and_fails_the_gate(real_run):
    tmp, _, parts = real_run
    missing = json.loads(parts[1].read_text())["provenance"]["shard"]
    lost = [i for i, e in missing["scope"].items() if e["shard"] == 2]
    assert lost
    report, _ = merge([parts[0], parts[2]], tmp / "missing")
    assert any(p.startswith("shard 2/3 missing") and f"its {len(lost)} tests" in p
               for p in report["problems"]), report["problems"]
    clauses_lost = {c for i in lost for c in missing["scope"][i]["clauses"]}
    for cid in clauses_lost:
        assert _clause_status(report, cid) == "incomplete", cid
        assert "shard(s) 2/3 not merged" in next(c["message"] for c in report["clauses"]
                                                 if c["id"] == cid)
    assert not set(clauses_lost) & set(report["deselected"])
    result = gate(tmp / "missing" / "report.json")
    assert not result.ok and not result.partial_only
    assert any("shard 2/3 missing" in r for r in result.reasons)
    code = subprocess.run([*CLI, "gate", str(tmp / "missing" / "report.json")],
                          capture_output=True, text=True).returncode
    assert code == 1


def _edited(tmp: Path, path: Path, name: str, edit) -> Path:
    doc = json.loads(path.read_text())
    edit(doc)
    out = tmp / f"{name}.json"
    out.write_text(json.dumps(doc))
    return out


@pytest.mark.parametrize("name, edit, said", [
    ("commit", lambda d: d["provenance"].update(git_commit="0" * 40), "git commit differs"),
    ("backend", lambda d: d.update(backend="other"), "backend differs"),
    ("dtype", lambda d: d["provenance"].update(dtype="bfloat16"), "dtype differs"),
    ("count", lambda d: d["provenance"]["shard"].update(n=4), "shard count differs"),
    ("scope", lambda d: d["provenance"]["shard"]["scope"].popitem(), "different selections"),
])
def test_reports_of_different_runs_are_refused_naming_what_differs(real_run, name, edit, said):
    tmp, _, parts = real_run
    odd = _edited(tmp, parts[1], name, edit)
    with pytest.raises(MergeError, match=said):
        merge([parts[0], odd, parts[2]], tmp / f"refused-{name}")


def test_the_merge_refuses_duplicates_unsharded_reports_and_another_catalogue(real_run, tmp_path):
    tmp, whole, parts = real_run
    with pytest.raises(MergeError, match="shard 1/3 given twice"):
        merge([parts[0], parts[0]], tmp_path / "a")
    with pytest.raises(MergeError, match="not a shard report"):
        merge([parts[0], whole], tmp_path / "b")
    cat = [_edited(tmp_path, p, f"cat{i}", lambda d: d["provenance"].update(catalogue="x"))
           for i, p in enumerate(parts)]
    with pytest.raises(MergeError, match="catalogue x"):
        merge(cat, tmp_path / "c")
    proc = subprocess.run([*CLI, "merge", str(parts[0]), str(whole), "-o", str(tmp_path / "d")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "not a shard report" in proc.stderr


# -- kill-matrix shards ---------------------------------------------------------------------------
def _row(name: str, expected: list[str], killed: bool) -> dict:
    return {"name": name, "defect": "", "surface": "codec", "expected": expected,
            "ran": expected, "failed": expected if killed else [],
            "failed_by_exception_only": [], "killed": killed,
            "missed": [] if killed else expected, "duration_s": 1.0, "failed_tests": {}}


def test_kill_matrix_shards_merge_and_a_missing_one_leaves_no_verdict(tmp_path):
    from rlconform.conformance.engine.kill_matrix import claims

    names = sorted(claims())[:4]
    expected = claims(names)
    scope = {n: 1 + i % 2 for i, n in enumerate(names)}
    regime = {"device": "cpu", "dtype": "float32", "model_size": "tiny", "profile": "ci"}
    paths = []
    for k in (1, 2):
        rows = [_row(n, expected[n], True) for n in names if scope[n] == k]
        m = summarize(rows, regime, False, False, 1.0) | {"shard": {"k": k, "n": 2,
                                                                    "scope": scope}}
        paths.append(tmp_path / f"km{k}.json")
        paths[-1].write_text(json.dumps(m))
    _, whole = merge(paths, tmp_path / "all")
    assert [r["name"] for r in whole["mutants"]] == names and not whole["errors"]
    assert whole["mutants"] == summarize([_row(n, expected[n], True) for n in names], regime,
                                         False, False, 2.0)["mutants"]
    _, part = merge(paths[:1], tmp_path / "one")
    lost = sorted(n for n in names if scope[n] == 2)
    assert sorted(e["mutant"] for e in part["errors"]) == lost
    assert all("shard 2/2" in e["error"] for e in part["errors"])
    odd = copy.deepcopy(json.loads(paths[1].read_text()))
    odd["regime"]["device"] = "cuda"
    with pytest.raises(MergeError, match="regime differs"):
        merge_matrices([(str(paths[0]), json.loads(paths[0].read_text())), ("odd", odd)])
