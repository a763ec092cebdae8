"""The plugin's options and hypothesis profiles, declared once: pytest_addoption registers the
options, `rlconform run --help` lists them and `rlconform mutants` checks what it passes through
to each mutant's run against them."""

from __future__ import annotations

import pytest

PROFILES = {
    # dev: fast feedback while writing a backend
    "dev": dict(max_examples=15, deadline=None, print_blob=True),
    # ci: derandomized and bounded, so a run is reproducible and fits the CI budget
    "ci": dict(max_examples=40, deadline=None, derandomize=True, database=None, print_blob=True),
    # nightly: large search on the GPU box
    "nightly": dict(max_examples=300, deadline=None, print_blob=True),
}
# Capabilities a profile requires of every backend it judges: a backend that does not declare
# one fails the run (a problem in the report) instead of quietly not testing it. The nightly
# GPU job trains in bfloat16, so a backend that cannot carry it has not been judged there.
PROFILE_REQUIRES: dict[str, frozenset[str]] = {
    "dev": frozenset(),
    "ci": frozenset(),
    "nightly": frozenset({"bfloat16"}),
}


def report_formats(text: str) -> list[str]:
    """`--report-formats`: the comma-separated list, each one a format write_reports knows."""
    import argparse

    from rlconform.reports.write import FILENAMES

    formats = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FILENAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown report formats {unknown}; known: "
                                         f"{', '.join(f for f in FILENAMES if f != 'json')}")
    return formats


# The plugin's options (they pass through to pytest).
OPTIONS: list[tuple[str, dict]] = [
    ("--backend", dict(default="reference",
                       help="backend under test: a registered name, mutant:<name>, or "
                            "module:attr")),
    ("--profile", dict(default="dev", choices=sorted(PROFILES),
                       help="hypothesis profile: dev (fast), ci (derandomized, bounded), "
                            "nightly (large; requires " + ", ".join(
                                sorted(PROFILE_REQUIRES["nightly"])) + ")")),
    ("--require", dict(default="", metavar="CAP[,CAP]",
                       help="capabilities the backend must declare (besides the profile's); "
                            "a missing one fails the run")),
    ("--device", dict(default="cpu", help="device for trainer clauses: cpu or cuda")),
    ("--model-size", dict(default=None, choices=["tiny", "production", "tiny-head32"],
                          help="trainer and rollout models: tiny (~2 layers, hidden 64; CPU CI) "
                               "or production (published widths of a real checkpoint per "
                               "family, random weights, built on the device; families without "
                               "one are deselected), or tiny-head32 (tiny with 32-wide attention heads, "
                               "for engines without head_dim 16: vLLM on CPU) (default: "
                               "$RLCONFORM_MODEL_SIZE or tiny)")),
    ("--dtype", dict(default="float32", choices=["float32", "bfloat16"],
                     help="policy dtype (pixel fields, trainer)")),
    ("--seed", dict(type=int, default=0, help="seed for models and fixtures")),
    ("--expectations", dict(default=None,
                            help="waiver file (default: the backend's bundled expectations, "
                                 "if any)")),
    ("--replay", dict(default=None,
                      help="re-run hypothesis tests with a failure blob from a report: "
                           "VERSION:BLOB")),
    ("--report-dir", dict(default="reports/out",
                          help="reports go to REPORT_DIR/<backend>/")),
    ("--no-report", dict(action="store_true", help="write no report files")),
    ("--with-kill-matrix", dict(action="store_true",
                                help="run the mutant kill matrix beside the clause run (the "
                                     "reference backend on the CPU; the main job): one kill-"
                                     "matrix worker while the clause tests run, every core "
                                     "after; the report waits for it and carries it")),
    ("--report-formats", dict(default=None, metavar="F,F", type=report_formats,
                              help="formats written beside report.json: any of markdown, "
                                   "html, junit, comma-separated (default: all; the kill "
                                   "matrix's mutant runs write report.json only)")),
    ("--surfaces", dict(default=None,
                        help="comma-separated surfaces: run only the clauses of these surfaces "
                             "(a partial run: the gate fails it)")),
    ("--partial-ok", dict(action="store_true",
                          help="a partial run is intended: exit 0 although a filter (-k, -m, "
                               "--deselect, --surfaces, the model size) dropped cells of "
                               "applicable clauses; the report records it and still reads "
                               "PARTIAL (the gate fails it)")),
    ("--shard", dict(default=None, metavar="K/N",
                     help="run only shard K of N of the selected tests (balanced by recorded "
                          "durations; `rlconform merge` joins the N shard reports into one)")),
    ("--placement", dict(default=None, choices=["device", "host"],
                         help="run only the clauses that need --device (device: trainer and "
                              "rollout models, the RANK clauses' rank processes) or only the "
                              "rest (host: data structures on CPU tensors); the two parts of "
                              "one run join with `rlconform merge`")),
    ("--wandb", dict(action="store_true",
                     help="log the summary, metrics and report files to wandb (offline by "
                          "default)")),
]


def options_help(skip: tuple[str, ...] = ("--backend",)) -> str:
    """The plugin's options as `rlconform run --help` shows them (`skip`: the run command's
    own options)."""
    lines = ["options passed through to the clause run (pytest plugin rlconform):"]
    for flag, kw in OPTIONS:
        if flag in skip:
            continue
        meta = "" if kw.get("action") == "store_true" else " " + (
            kw.get("metavar") or ("{" + ",".join(kw["choices"]) + "}" if "choices" in kw
                                  else flag.lstrip("-").upper().replace("-", "_")))
        default = kw.get("default")
        tail = "" if default is None or default is False or default == "" \
            else f" (default: {default})"
        lines.append(f"  {flag}{meta}")
        lines.append(f"      {kw['help']}{tail}")
    lines.append("any other argument goes to pytest (e.g. -k EXPR, -x, -q)")
    return "\n".join(lines)


def register_profiles() -> None:
    from hypothesis import HealthCheck, settings

    # filter_too_much: a backend that refuses most inputs (an operation it does not offer, a
    # field it does not register) leaves most examples exercising nothing, and tests drop those
    # (assume); a run in which none exercised anything still fails, as unsatisfiable
    common = dict(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.function_scoped_fixture,
                                         HealthCheck.filter_too_much])
    for name, kw in PROFILES.items():
        settings.register_profile(f"rlconform-{name}", **common, **kw)


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("rlconform", "rlconform conformance suite")
    for flag, kw in OPTIONS:
        g.addoption(flag, **kw)


def required_capabilities(config: pytest.Config) -> frozenset[str]:
    extra = {c.strip() for c in (config.getoption("--require") or "").split(",") if c.strip()}
    return PROFILE_REQUIRES[config.getoption("--profile")] | extra
