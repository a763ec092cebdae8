"""The end of a run on the controller: the report is built from the run's state and written
(REPORT_DIR/<backend>/: json, md, html, junit; wandb when asked), the terminal summary is
printed, and the exit status says whether a clause failed or the run has a problem."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlconform.conformance.backend import Backend
from rlconform.conformance.engine.fixtures import STORE_UNREACHABLE_EXIT
from rlconform.conformance.engine.session import state


def pytest_sessionfinish(session, exitstatus) -> None:
    config = session.config
    if hasattr(config, "workerinput"):
        return
    st = state(config)
    st.exitstatus = exitstatus
    from rlconform.conformance.engine import stopping
    from rlconform.conformance.engine.report_builder import build_report

    st.stopped_by = stopping.received()
    report = build_report(st, config)
    report_dir = None
    if not config.getoption("--no-report"):
        report_dir = report_folder(config, st.backend)
        from rlconform.conformance.engine.report_builder import write

        write(report, report_dir, config.getoption("--report-formats"))
        if config.getoption("--wandb"):
            from rlconform.conformance.engine.wandb_log import log_report

            log_report(report, report_dir)
    st.report = report
    from rlconform.reports.model import FAILING

    failing = [c["id"] for c in report["clauses"] if c["status"] in FAILING]
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        _print_summary(tr, report, report_dir)
        if report.get("cells") and report["cells"]["partial_ok"] and report["cells"]["partial"]:
            tr.write_line("  partial run intended (--partial-ok): recorded in the report; "
                          "the gate still fails it")
    interrupted = exitstatus in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.USAGE_ERROR,
                                 pytest.ExitCode.INTERNAL_ERROR, STORE_UNREACHABLE_EXIT)
    if interrupted:
        return
    collection_failed = session.testsfailed and not st.results
    refused = _partial_refused(report, config)
    if refused and tr is not None:
        tr.write_line(f"  {refused}")
    session.exitstatus = (pytest.ExitCode.TESTS_FAILED
                          if failing or report["problems"] or collection_failed or refused
                          else pytest.ExitCode.OK)


def _partial_refused(report: dict, config: pytest.Config) -> str | None:
    """Why a partial run exits non-zero (a filter dropped cells of applicable clauses, and the
    run was not told a partial run is intended), or None. A shard's or part's split is partial
    by design: its merge is judged."""
    from rlconform.conformance.engine.cells import needs_consent

    if config.getoption("collectonly", False) or config.getoption("--partial-ok"):
        return None
    cells = report.get("cells")
    if cells is not None:
        if not needs_consent(cells):
            return None
        by = ", ".join(cells["partial_by"])
    elif report.get("deselected") and not (report["provenance"].get("shard")):
        by = "deselection"  # cells not recorded: clauses left out whole still count
    else:
        return None
    return (f"PARTIAL run ({by} dropped cells in scope): exit status 1; pass --partial-ok "
            "when a partial run is intended (the report still reads PARTIAL)")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def report_folder(config: pytest.Config, backend: Backend) -> Path:
    return Path(config.getoption("--report-dir")) / _safe(backend.name)


def report_dir_clash(folder: Path, backend: Backend) -> str | None:
    """Why `backend` must not write into `folder` (it holds another backend's report), or None.

    Two backends with one name would overwrite each other's reports; the report records where
    its backend was loaded from, and a run from another source refuses the folder."""
    import json

    path = folder / "report.json"
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    theirs = (old.get("backend_info") or {}).get("source") or ""
    if theirs and backend.source and theirs != backend.source:
        return (f"{folder} holds the report of backend {old.get('backend')!r} loaded from "
                f"{theirs}; this backend ({backend.source}) has the same name. Give it its own "
                "name, or another --report-dir")
    return None


def _print_summary(tr, report: dict, report_dir: Path | None) -> None:
    from rlconform.reports._common import headline

    tr.write_sep("=", f"rlconform: {report['backend']}")
    for c in report["clauses"]:
        if c["status"] != "passed" or c["message"]:  # a passed clause's note: partial evidence
            if c["status"] == "not_applicable":
                continue  # listed once per surface or capability below
            label = c["status"].upper() + (" (PARTIAL)" if (c.get("cells") or {}).get("dropped")
                                           else "")
            tr.write_line(f"  {label:19} {c['id']}: {c['message'][:200]}")
    for e in report.get("not_tested") or ():
        tr.write_line(f"  NOT TESTED          {e['kind']} {e['name']} ({len(e['clauses'])} "
                      f"clauses): {e['why'][:120]}")
    for p in report["problems"]:
        tr.write_line(f"  PROBLEM             {p}")
    tr.write_line(f"  {headline(report)}")
    if report_dir is not None:
        tr.write_line(f"  report: {report_dir}/report.html (.json, .md, junit.xml)")
