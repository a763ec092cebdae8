"""`--wandb`: log a finished run's summary, metrics and report files to a wandb run.

Imported only when the flag is given. wandb runs offline unless the user configured otherwise
(`WANDB_MODE`), so a CI box without network still gets a run under ./wandb/offline-run-*.
"""

from __future__ import annotations

import os
from pathlib import Path


def _flat_metrics(report: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in report["clauses"]:
        for name, m in c.get("metrics", {}).items():
            key = f"{c['id']}/{name}"
            if m.get("kind") == "scalar" and m.get("value") is not None:
                out[key] = m["value"]
            elif m.get("kind") == "distribution":
                for stat in ("min", "max", "mean"):
                    if m.get(stat) is not None:
                        out[f"{key}/{stat}"] = m[stat]
    return out


def log_report(report: dict, report_dir: Path) -> None:
    os.environ.setdefault("WANDB_MODE", "offline")
    import wandb

    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "rlconform"),
                     name=f"{report['backend']}-{report['provenance']['started_at']}",
                     config={"backend": report["backend_info"], **report["provenance"]})
    summary = {f"summary/{k}": v for k, v in report["summary"].items() if v is not None}
    run.log({**summary, **_flat_metrics(report)})
    for c in report["clauses"]:
        for name, m in c.get("metrics", {}).items():
            if m.get("kind") == "series":
                for step, v in zip(m["steps"], m["values"]):
                    run.log({f"{c['id']}/{name}/mean": v.get("mean")}, step=step)
    art = wandb.Artifact(f"rlconform-report-{report['backend'].replace(':', '_')}", "report")
    for f in ("report.json", "report.md", "report.html", "junit.xml"):
        if (report_dir / f).is_file():
            art.add_file(str(report_dir / f))
    run.log_artifact(art)
    run.finish()
