"""The scoreboard (reports/scoreboard.py, `rlconform scoreboard`): every backend against every
clause, from report.json files; statuses, waivers, versions, older reports, bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlconform.conformance.cli import main
from rlconform.reports import scoreboard as sb
from rlconform.reports.model import summarize_clauses
from rlconform.reports.sample import example_report

ROOT = Path(__file__).resolve().parents[1]
XSS = "<script>alert('pwned')</script>"
WAIVER = {"index": 1, "category": "unsupported", "reason": "no truncation | in this system",
          "function": "sys.truncate", "link": "https://example.invalid/issue/7",
          "expires": "2099-01-01", "expired": False, "scope": {"match": "truncat"}}


def report(backend: str, version: str | None = "Sys 1.0", **statuses) -> dict:
    """example_report under another backend name, with clause statuses set (ID_WITH_UNDERSCORES
    -> status, or (status, message, waiver))."""
    r = example_report()
    r["backend"] = r["backend_info"]["name"] = backend
    if version is not None:
        r["backend_info"]["version"] = version
    by_id = {c["id"]: c for c in r["clauses"]}
    for key, value in statuses.items():
        status, message, waiver = value if isinstance(value, tuple) else (value, "boom", None)
        c = by_id[key.replace("_", "-")]
        c.update(status=status, message=message, waivers=[waiver] if waiver else [])
        if status in ("waived", "passed_with_waivers"):
            tests = c["tests"] if status == "waived" else c["tests"][:1]
            for t in tests:
                t.update(outcome="waived", message=message, waived_by=[1])
    r["summary"] = summarize_clauses(r["clauses"])
    return r


def write(dirpath: Path, name: str, rep: dict) -> Path:
    dirpath.mkdir(parents=True, exist_ok=True)
    p = dirpath / name
    p.write_text(json.dumps(rep), encoding="utf-8")
    return p


def row(md: str, clause_id: str) -> list[str]:
    line = next(x for x in md.splitlines() if x.startswith(f"| {clause_id} |"))
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_every_status_lands_in_its_backends_column(tmp_path):
    a = report("alpha", DP_ROUNDTRIP="failed", DP_NO_ALIAS="error", DP_MERGE_PUT="skipped",
               WIRE_ROUNDTRIP=("waived", "m", WAIVER),
               BATCH_TRUNCATE_MEDIA=("passed_with_waivers", "m", WAIVER),
               DP_JAGGED_LAYOUT=("xpass", "waiver #1 matched nothing: remove or narrow it",
                                 dict(WAIVER, category="backend-bug")))
    b = report("beta", "Other 2.3")
    write(tmp_path / "a", "report.json", a)
    write(tmp_path / "b", "report.json", b)
    board = sb.build(sb.load_entries([tmp_path]))
    assert [e.backend for e in board.entries] == ["beta", "alpha"], "ordered by score"
    md = sb.render_markdown(board, tmp_path)
    want = {"DP-ROUNDTRIP": "FAIL", "DP-NO-ALIAS": "ERROR", "DP-MERGE-PUT": "SKIP",
            "WIRE-ROUNDTRIP": "waived (3/3 tests)",
            "BATCH-TRUNCATE-MEDIA": "pass+w (1/3 tests)",
            "DP-JAGGED-LAYOUT": "XPASS",
            "DP-OBJECT-COLUMNS": "n/a", "TRAIN-RATIO-ONE": "PASS"}
    for cid, label in want.items():
        cells = row(md, cid)
        n = len(next(c for c in a["clauses"] if c["id"] == cid)["tests"])
        label = label.replace("3/3", f"{n}/{n}").replace("1/3", f"1/{n}")
        assert cells[3].startswith(label), (cid, cells)
        assert cells[2] in ("PASS", "n/a"), (cid, cells)
    # the waiver's category, reason, function, link and expiry are in the footnote
    ref = re.search(r"\[\^(\d+)\]", row(md, "WIRE-ROUNDTRIP")[3]).group(1)
    note = next(x for x in md.splitlines() if x.startswith(f"[^{ref}]:"))
    assert "`alpha` WIRE-ROUNDTRIP: #1 unsupported: no truncation \\| in this system" in note
    assert "[sys.truncate]" in note
    assert "https://example.invalid/issue/7" in note and "expires 2099-01-01" in note
    xp = re.search(r"\[\^(\d+)\]", row(md, "DP-JAGGED-LAYOUT")[3]).group(1)
    assert "remove or narrow it" in next(x for x in md.splitlines()
                                         if x.startswith(f"[^{xp}]:"))
    fail = re.search(r"\[\^(\d+)\]", row(md, "DP-ROUNDTRIP")[3]).group(1)
    assert next(x for x in md.splitlines() if x.startswith(f"[^{fail}]:")).endswith("boom")


def test_versions_scores_and_provenance_head_each_column(tmp_path):
    a = report("alpha", "Sys 1.0", DP_ROUNDTRIP="failed")
    b = report("beta", None)  # an older report: no backend_info.version
    write(tmp_path, "alpha-1.0.json", a)
    write(tmp_path, "beta.json", b)
    (tmp_path / "alpha-1.0.md").write_text("# alpha\n")
    board = sb.build(sb.load_entries([tmp_path]))
    md = sb.render_markdown(board, tmp_path)
    lines = {x.split("|")[1].strip(): x for x in md.splitlines() if x.startswith("| `")}
    assert "| Sys 1.0 |" in lines["`alpha`"] and "| — |" in lines["`beta`"]
    n_app = a["summary"]["total"] - a["summary"]["not_applicable"]
    assert f"| {a['summary']['score']:.1%} ({a['summary']['passed']}/{n_app}) | 0 | 0 | 1 |" \
        in lines["`alpha`"]
    assert "profile ci" in lines["`alpha`"]
    assert "[alpha-1.0.md](alpha-1.0.md)" in lines["`alpha`"], "links the Markdown beside the JSON"
    assert "[beta.json](beta.json)" in lines["`beta`"]
    page = sb.render_html(board, tmp_path)
    assert "Sys 1.0" in page and f"{a['summary']['score']:.1%}" in page


def test_a_clause_an_older_report_lacks_shows_as_absent(tmp_path):
    new = report("new")
    old = report("old")
    old["clauses"] = [c for c in old["clauses"] if c["id"] != "WIRE-ROUNDTRIP"]
    old["summary"] = summarize_clauses(old["clauses"])
    board = sb.build(sb.load_entries([write(tmp_path, "n.json", new),
                                      write(tmp_path, "o.json", old)]))
    cells = row(sb.render_markdown(board), "WIRE-ROUNDTRIP")
    assert cells[2] == "PASS" and cells[3] == "absent"
    assert "class='s absent'" in sb.render_html(board)


def test_clause_rows_follow_the_catalogue_then_unknown_ids(tmp_path):
    from rlconform.conformance.catalogue import CLAUSES

    r = report("alpha")
    ids = {c["id"] for c in r["clauses"]}
    known = next(c for c in reversed(CLAUSES) if c.id not in ids)
    r["clauses"].append(dict(r["clauses"][0], id=known.id, title="old words"))
    r["summary"] = summarize_clauses(r["clauses"])
    board = sb.build(sb.load_entries([write(tmp_path, "r.json", r)]))
    order = [c.id for c in CLAUSES]
    in_catalogue = [i for i in board.clause_ids if i in order]
    assert board.clause_ids[:len(in_catalogue)] == sorted(in_catalogue, key=order.index), \
        "catalogue clauses lead, in catalogue order"
    rest = board.clause_ids[len(in_catalogue):]
    assert rest and rest == sorted(rest) and not set(rest) & set(order)
    assert board.titles[known.id] == known.must, "titles come from the current catalogue"


def test_any_number_of_reports(tmp_path):
    for i in range(7):
        write(tmp_path / f"r{i}", "report.json", report(f"b{i}", f"v{i}"))
    write(tmp_path / "ref", "report.json", report("reference"))
    board = sb.build(sb.load_entries([tmp_path]))
    assert [e.backend for e in board.entries] == ["reference"] + [f"b{i}" for i in range(7)], \
        "the reference (the baseline) leads, then backends by score, then by name"
    assert len(row(sb.render_markdown(board), "DP-ROUNDTRIP")) == 2 + 8


def test_two_versions_of_one_backend_get_columns_named_apart(tmp_path):
    """A framework before and after a fix: each column is named by its report's file, or by
    the version where the file is a plain report.json."""
    write(tmp_path, "fw-abc1234.json", report("fw", "Fw 1.0 at commit abc1234"))
    write(tmp_path, "fw-pr99-def5678.json", report("fw", "Fw 1.0 at commit def5678"))
    write(tmp_path / "run", "report.json", report("fw", "Fw 0.9"))
    write(tmp_path / "other", "report.json", report("solo"))
    board = sb.build(sb.load_entries([tmp_path, tmp_path / "run", tmp_path / "other"]))
    labels = {e.label for e in board.entries}
    assert labels == {"fw-abc1234", "fw-pr99-def5678", "fw Fw 0.9", "solo"}, labels
    md = sb.render_markdown(board)
    header = next(x for x in md.splitlines() if x.startswith("| clause | surface |"))
    assert all(f"`{label}`" in header for label in labels), header
    assert all(f"<code>{label}</code>" in sb.render_html(board) for label in labels)


def test_html_escapes_report_text():
    r = report("alpha", XSS, DP_ROUNDTRIP=("failed", XSS, None))
    page = sb.render_html(sb.build([sb.Entry(Path("r.json"), r)]))
    assert XSS not in page and "&lt;script&gt;" in page


@pytest.mark.parametrize("content, words", [
    ("{not json", ["bad.json", "not JSON"]),
    (json.dumps({"schema_version": "2.0"}), ["bad.json", "invalid report at $", "backend"]),
    (json.dumps({"mutants": []}), ["bad.json", "invalid report"]),
])
def test_bad_input_is_named(tmp_path, content, words):
    (tmp_path / "bad.json").write_text(content)
    with pytest.raises(ValueError) as exc:
        sb.load_entries([tmp_path])
    for w in words:
        assert w in str(exc.value), (w, str(exc.value))


def test_missing_paths_and_duplicate_backends_are_named(tmp_path):
    with pytest.raises(ValueError, match="nope: no such file"):
        sb.load_entries([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: no report.json"):
        sb.load_entries([tmp_path / "empty"])
    a = write(tmp_path / "x", "report.json", report("alpha"))
    b = write(tmp_path / "y", "report.json", report("alpha"))
    with pytest.raises(ValueError, match="two reports of backend 'alpha' Sys 1.0") as exc:
        sb.load_entries([a, b])
    assert str(a) in str(exc.value) and str(b) in str(exc.value)
    assert len(sb.load_entries([a, a])) == 1, "one file named twice is one report"


def test_cli_writes_both_pages_and_exits_2_on_bad_input(tmp_path, capsys):
    write(tmp_path / "in" / "alpha", "report.json", report("alpha"))
    assert main(["scoreboard", str(tmp_path / "in"), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "scoreboard.md").read_text().startswith("# rlconform scoreboard")
    assert (tmp_path / "out" / "scoreboard.html").read_text().startswith("<!doctype html>")
    (tmp_path / "in" / "junk.json").write_text("[]")
    assert main(["scoreboard", str(tmp_path / "in"), "--md", str(tmp_path / "x.md")]) == 2
    assert "junk.json" in capsys.readouterr().err


def test_committed_scoreboard_is_current():
    """docs/scoreboard.md is generated from the committed reports in docs/backend-reports/."""
    doc = ROOT / "docs" / "scoreboard.md"
    board = sb.build(sb.load_entries([ROOT / "docs" / "backend-reports"]))
    assert board.entries, "docs/backend-reports/ holds no report.json files"
    assert doc.read_text(encoding="utf-8") == sb.render_markdown(board, doc.parent), (
        "docs/scoreboard.md is stale: run `rlconform scoreboard docs/backend-reports "
        "--md docs/scoreboard.md`")


def test_mutant_reports_in_a_folder_are_left_out_unless_named(tmp_path):
    write(tmp_path / "reference", "report.json", report("reference"))
    m = report("mutant:densify_uniform_rows")
    m["backend_info"]["source"] = "mutant:densify_uniform_rows"
    path = write(tmp_path / "mutants" / "mutant_densify_uniform_rows", "report.json", m)
    assert [e.backend for e in sb.load_entries([tmp_path])] == ["reference"]
    assert sorted(e.backend for e in sb.load_entries([tmp_path, path])) == [
        "mutant:densify_uniform_rows", "reference"]


def test_a_report_of_another_catalogue_is_marked_stale_and_families_are_shown(tmp_path):
    from rlconform.conformance.catalogue import fingerprint
    from rlconform.conformance.catalogue.content import fingerprint as content

    fresh = report("fresh")
    fresh["provenance"]["catalogue"] = fingerprint()
    fresh["provenance"]["content"] = content(None, None)
    old = report("old")
    old["provenance"]["catalogue"] = "0000000000000000"
    for r in (fresh, old):
        c = next(c for c in r["clauses"] if c["id"] == "DP-ROUNDTRIP")
        c["by_family"] = {"qwen2_vl": {"passed": 2}, "gemma3": {"passed": 1, "waived": 1}}
    board = sb.build(sb.load_entries([write(tmp_path, "f.json", fresh),
                                      write(tmp_path, "o.json", old)]))
    md = sb.render_markdown(board)
    lines = {x.split("|")[1].strip(): x for x in md.splitlines() if x.startswith("| `")}
    assert "stale" in lines["`old`"] and "stale" not in lines["`fresh`"]
    fam = {x.split("|")[1].strip(): x for x in md.splitlines() if x.startswith("| gemma3")}
    assert "0/1 (w1)" in fam["gemma3"]
    assert "Per model family" in sb.render_html(board)


def test_committed_reports_are_current():
    """Every committed report was made under the current clause catalogue (its fingerprint:
    clause definitions and their tests) and from the current content of every file its verdicts
    rest on (test bodies, fixtures, tolerances, reference parts, verdict rules, its adapter and
    waiver file): a submission that changes them regenerates the reports (`nox -s
    backend_reports`), or CI fails here naming the stale ones and the files."""
    from rlconform.conformance.catalogue import fingerprint
    from rlconform.conformance.catalogue.content import changed

    current = fingerprint()
    stale = []
    for path in sorted((ROOT / "docs" / "backend-reports").glob("*.json")):
        prov = json.loads(path.read_text())["provenance"]
        made = prov.get("catalogue")
        files = changed(prov.get("content"))
        if made != current:
            stale.append(f"{path.name} (catalogue {made or 'not recorded'})")
        elif files is None:
            stale.append(f"{path.name} (no content fingerprint)")
        elif files:
            stale.append(f"{path.name} ({len(files)} files its verdicts rest on changed: "
                         f"{', '.join(files[:4])}{' ...' if len(files) > 4 else ''})")
    assert not stale, (f"committed reports made under another clause catalogue than the "
                       f"current one ({current}) or before a change to what their verdicts "
                       f"rest on: {'; '.join(stale)}; regenerate them with "
                       "`nox -s backend_reports -- NAME ...`")


def test_each_implemented_surface_is_scored_in_its_backends_column(tmp_path):
    """The per-surface table: a store built with from_reference is scored on its store alone
    (the surfaces it borrows read `lent`); the reference on every surface; a surface a backend
    neither implements nor borrows reads `-`. Committed reports without the section get it at
    read time."""
    ref = report("reference")
    ref["backend_info"]["surfaces"] = ["transport", "codec", "meta", "batch_ops", "trainer",
                                       "rollout"]
    store = report("my-store")
    store["backend_info"].update(surfaces=["transport", "codec", "trainer", "rollout"],
                                 lent_surfaces=["codec", "trainer", "rollout"])
    board = sb.build(sb.load_entries([write(tmp_path, "r.json", ref),
                                      write(tmp_path, "s.json", store)]))
    md = sb.render_markdown(board)
    assert "Per surface:" in md
    transport, codec = row(md, "transport"), row(md, "codec")
    assert transport[1].startswith("100.0% (") and transport[2].startswith("100.0% (")
    assert "joint" in transport[2] and "joint" not in transport[1]
    assert codec[1].startswith("100.0%") and codec[2] == "lent"
    assert row(md, "trainer")[2] == "lent"
    assert "id='surfaces'" in sb.render_html(board)


def test_the_content_fingerprint_names_what_changed(tmp_path):
    """A changed test body, a new or gone file and a changed waiver file each change the
    digest, and `changed` names the file (what the staleness test prints)."""
    from rlconform.conformance.catalogue import content

    waivers = tmp_path / "w.toml"
    waivers.write_text("# none\n")
    now = content.fingerprint("rlconform.conformance.backends.verl:backend", waivers)
    assert "conformance/clauses/test_codec.py" in now["files"]
    assert "conformance/backends/verl.py" in now["files"]
    assert content.changed(now) == []
    edited = json.loads(json.dumps(now))
    edited["files"]["conformance/clauses/test_codec.py"] = "0" * 12
    assert content.changed(edited) == ["conformance/clauses/test_codec.py"]
    del edited["files"]["fixtures/strategies.py"]
    edited["files"]["conformance/clauses/test_gone.py"] = "0" * 12
    assert content.changed(edited) == ["conformance/clauses/test_codec.py",
                                       "conformance/clauses/test_gone.py (gone)",
                                       "fixtures/strategies.py (new)"]
    waivers.write_text("# one more line\n")
    assert content.changed(now) == [waivers.resolve().as_posix()]
    assert content.fingerprint("rlconform.conformance.backends.verl:backend",
                               waivers)["digest"] != now["digest"]
    assert content.changed(None) is None
