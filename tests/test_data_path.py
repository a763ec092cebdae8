"""Declared data paths (Backend.data_path, PathStep): their checks, the generated tables in
docs/backends.md, and their place in the report. Whether an adapter's entered steps are really
called is each adapter's own test (tests/_data_path.py `assert_entered`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlconform.conformance.backend import Backend, PathStep

ROOT = Path(__file__).resolve().parents[1]


def _ops():
    from rlconform.reference_impl.batch import BatchOps

    return BatchOps()


@pytest.mark.parametrize("kwargs, match", [
    ({"function": "verl.protocol.DataProto.from_dict", "status": "called"}, "not one of"),
    ({"function": "verl.protocol.DataProto.from_dict", "status": "stubbed"}, "say why"),
    ({"function": "verl.protocol.DataProto.from_dict", "status": "rebuilt", "why": " "},
     "say why"),
    ({"function": "from_dict", "status": "entered"}, "dotted import path"),
    ({"function": "a.b", "status": "entered", "surface": "engine"}, "surface"),
])
def test_a_path_step_says_what_it_is(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PathStep(**kwargs)


def test_a_backend_names_each_step_once_and_reports_its_path():
    step = PathStep("verl.protocol.DataProto.concat", "entered", surface="batch_ops")
    with pytest.raises(ValueError, match="more than once"):
        Backend(name="x", batch_ops=_ops, data_path=(step, step))
    with pytest.raises(TypeError, match="PathStep"):
        Backend(name="x", batch_ops=_ops, data_path=({"function": "a.b"},))
    info = Backend(name="x", batch_ops=_ops, data_path=(step,),
                   normalisations={"BATCH-ALGEBRA": "re-pads"}).describe()
    assert info["data_path"] == [step.describe()]
    assert info["normalisations"] == {"BATCH-ALGEBRA": "re-pads"}
    assert "data_path" not in Backend(name="y", batch_ops=_ops).describe()


def test_the_docs_tables_are_generated_from_the_adapters():
    from rlconform.conformance.catalogue.docs import FRAMEWORK_ADAPTERS, data_path_tables

    table = data_path_tables()
    assert table in (ROOT / "docs" / "backends.md").read_text(), \
        "docs/backends.md's data-path tables are stale: run `nox -s docs`"
    for module in FRAMEWORK_ADAPTERS:
        assert f"conformance/backends/{module}.py" in table


def test_every_adapter_declares_its_path_and_clause_ids_it_normalises():
    import importlib

    from rlconform.conformance.catalogue import CLAUSES
    from rlconform.conformance.catalogue.docs import FRAMEWORK_ADAPTERS

    ids = {c.id for c in CLAUSES}
    for module in FRAMEWORK_ADAPTERS:
        mod = importlib.import_module(f"rlconform.conformance.backends.{module}")
        assert mod.DATA_PATH, f"{module}.py declares no data path"
        unknown = sorted(set(getattr(mod, "NORMALISATIONS", {})) - ids)
        assert not unknown, f"{module}.py normalises clauses that do not exist: {unknown}"


def test_the_report_shows_the_path_and_each_clause_normalisation():
    from rlconform.reports.html import render_html
    from rlconform.reports.markdown import render_markdown
    from rlconform.reports.model import validate_report
    from rlconform.reports.sample import example_report

    report = example_report()
    report["backend_info"]["data_path"] = [
        {"function": "fw.mod.entered_fn", "status": "entered", "why": "", "surface": "codec"},
        {"function": "fw.mod.rebuilt_fn", "status": "rebuilt", "why": "needs a GPU",
         "surface": ""}]
    cid = report["clauses"][0]["id"]
    report["backend_info"]["normalisations"] = {cid: "pads jagged rows back"}
    report["clauses"][0]["adapter_normalisation"] = "pads jagged rows back"
    validate_report(report)
    md = render_markdown(report)
    assert "1 entered · 0 stubbed · 1 rebuilt" in md and "fw.mod.rebuilt_fn" in md
    assert f"adapter normalisation, {cid}: pads jagged rows back" in md
    html = render_html(report)
    assert "fw.mod.rebuilt_fn" in html and "pads jagged rows back" in html
