"""Turn a finished run (the plugin's state) into the report dict of reports/schema.json."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from importlib import metadata
from pathlib import Path

from rlconform.conformance import catalogue

SCHEMA_VERSION = "1.0"
KEY_PACKAGES = ("rlconform", "torch", "transformers", "tokenizers", "hypothesis", "pytest",
                "pytest-xdist", "tensordict", "ray", "TransferQueue", "vllm", "numpy", "verl")


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _device_info(device: str) -> dict:
    info = {"type": "cuda" if device.startswith("cuda") else "cpu", "name": None,
            "driver": None, "cuda": None}
    if info["type"] == "cuda" and "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            info["name"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True, text=True, timeout=10)
                info["driver"] = out.stdout.strip().splitlines()[0] if out.stdout else None
            except (OSError, subprocess.TimeoutExpired, IndexError):
                pass
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


def provenance(st, config) -> dict:
    now = time.time()
    return {
        "rlconform_version": _version("rlconform") or "not installed (source tree)",
        "git_commit": os.environ.get("RLCONFORM_GIT_COMMIT") or _git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {p: v for p in KEY_PACKAGES if (v := _version(p))},
        "device": _device_info(config.getoption("--device")),
        "cpu_count": os.cpu_count(),
        "profile": config.getoption("--profile"),
        "dtype": config.getoption("--dtype"),
        "seed": config.getoption("--seed"),
        **_model_size(),
        "started_at": st.started_at,
        "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "duration_s": round(now - st.started, 3),
        "command": " ".join(sys.argv),
    }


def _model_size() -> dict:
    from rlconform.fixtures.sizes import PRODUCTION, PRODUCTION_MODELS, model_size

    size = model_size()
    out: dict = {"model_size": size}
    if size == PRODUCTION:
        out["models"] = {f: f"{m} widths, random weights" for f, m in PRODUCTION_MODELS.items()}
    return out


def clause_status(tests: list[dict], waived: bool) -> str:
    outcomes = {t["outcome"] for t in tests}
    if not tests or outcomes == {"not_applicable"}:
        return "not_applicable"
    if "error" in outcomes:
        raw = "error"
    elif "failed" in outcomes:
        raw = "failed"
    elif "skipped" in outcomes:
        raw = "skipped"  # a declared clause that did not run counts as a failure
    else:
        raw = "passed"
    if waived:
        return {"failed": "waived", "error": "waived", "passed": "xpass"}.get(raw, raw)
    return raw


def _param(nodeid: str) -> str:
    """`test_x[qwen2_vl-2]` -> `qwen2_vl-2`; '' for an unparametrized test."""
    name = nodeid.rsplit("::", 1)[-1]
    return name[name.index("[") + 1:-1] if name.endswith("]") and "[" in name else ""


def _metrics(tests: list[dict]) -> dict:
    """Metrics by name; a name that several tests record is kept per test (`name[param]`),
    never overwritten or pooled across families."""
    out: dict = {}
    series: dict = defaultdict(list)
    recorders: dict = defaultdict(set)
    for t in tests:
        for m in t["metrics"]:
            recorders[m["name"]].add(t["nodeid"])
    for t in tests:
        for m in t["metrics"]:
            name = m["name"]
            if len(recorders[name]) > 1:
                name = f"{name}[{_param(t['nodeid']) or t['nodeid'].rsplit('::', 1)[-1]}]"
            if m["step"] is None:
                out[name] = m["summary"]
            else:
                series[name].append((m["step"], m["summary"]))
    for name, pts in series.items():
        pts.sort(key=lambda p: p[0])
        vals = [{k: v for k, v in s.items() if k != "histogram"} for _, s in pts]
        out[name] = {"kind": "series", "steps": [p[0] for p in pts], "values": vals}
    return out


def build_report(st, config) -> dict:
    by_clause: dict[str, list[dict]] = defaultdict(list)
    for r in st.results.values():
        for cid in r["clauses"]:
            by_clause[cid].append(r)
    clauses = []
    deselected = []
    from rlconform.conformance.plugin import applicability

    for c in catalogue.CLAUSES:
        tests = by_clause.get(c.id, [])
        na = applicability(st.backend, c)
        if not tests and na is None:
            deselected.append(c.id)
            continue
        w = st.waivers.get(c.id)
        active = w is not None and not w.expired
        status = "not_applicable" if na else clause_status(tests, active)
        failing = [t for t in tests if t["outcome"] in ("failed", "error", "skipped")]
        if status == "not_applicable":
            message = na or (tests[0]["message"] if tests else "")
        elif status == "xpass":
            message = f"waived ({w.category}) but passed: remove the waiver ({w.reason})"
        elif failing:
            message = f"{failing[0]['nodeid'].split('::')[-1]}: {failing[0]['message']}"
        else:
            message = ""
        clauses.append({
            "id": c.id, "title": c.must, "surface": c.surface,
            "capabilities": list(c.capabilities), "required": c.required,
            "status": status, "message": message, "defect": c.defect,
            "mutants": list(c.mutants), "regime": c.regime,
            "duration_s": round(sum(t["duration_s"] for t in tests), 4),
            "tests": [{"nodeid": t["nodeid"], "outcome": t["outcome"],
                       "duration_s": round(t["duration_s"], 4), "message": t["message"],
                       "hypothesis": t["hypothesis"]} for t in tests],
            "waiver": w.to_json() if w else None,
            "metrics": _metrics(tests),
        })
    from rlconform.reports.model import summarize_clauses

    summary = summarize_clauses(clauses)
    problems = list(st.problems)
    if not st.results:
        problems.append("no clause test ran")
    return {
        "schema_version": SCHEMA_VERSION,
        "backend": st.backend.name,
        "backend_info": st.backend.describe(),
        "provenance": provenance(st, config),
        "summary": summary,
        "clauses": clauses,
        "deselected": deselected,
        "not_tested": not_tested(st.backend),
        "kill_matrix": _kill_matrix(config, st.backend.name),
        "mutant_effects": _beside_mutants(config, st.backend.name, "mutant_effects.json"),
        "problems": problems,
    }


NOT_DECLARED = "not declared by the backend (it gave no reason)"


def not_tested(backend) -> list[dict]:
    """Clauses that did not apply, grouped by the surface (or capabilities) the backend left
    out, with the backend's note saying why: a gate that passes must not hide what it never
    looked at."""
    groups: dict[tuple[str, str], list[str]] = {}
    for c in catalogue.CLAUSES:
        if not any(backend.provides(s) for s in c.surfaces):
            key = ("surface", c.surface)
        else:
            lacking = [cap for cap in c.capabilities if cap not in backend.capabilities]
            if not lacking:
                continue
            key = ("capability", ", ".join(lacking))
        groups.setdefault(key, []).append(c.id)
    out = []
    for (kind, name), ids in groups.items():
        why = [backend.notes[n] for n in name.split(", ") if n in backend.notes]
        out.append({"kind": kind, "name": name, "clauses": ids,
                    "why": "; ".join(why) or NOT_DECLARED})
    return out


def _kill_matrix(config, backend_name: str) -> dict | None:
    """The last mutant run's matrix, shown in the reference backend's report."""
    return _beside_mutants(config, backend_name, "mutants/kill_matrix.json")


def _beside_mutants(config, backend_name: str, name: str) -> dict | None:
    """A mutant measurement of the last run under the report dir (the kill matrix, the
    mutants' numeric effects), shown in the reference backend's report."""
    if backend_name != "reference":
        return None
    p = Path(config.getoption("--report-dir")) / name
    if not p.is_file():
        return None
    import json

    return json.loads(p.read_text())


def write(report: dict, out_dir: Path) -> None:
    from rlconform.reports.write import write_reports

    out_dir.mkdir(parents=True, exist_ok=True)
    write_reports(report, out_dir)
