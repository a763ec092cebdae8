"""The rlconform pytest plugin: runs the clause tests against one backend and writes its report.

Load it with `-p rlconform.conformance.engine.plugin` (`rlconform run` does). Its hooks and
fixtures live in small modules, one job each, registered here:
- options: the plugin's options and hypothesis profiles;
- session: loads the backend (`--backend`) and its waivers (`--expectations`) into the run's
  state, checks the profile's capabilities and the GPU memory plan;
- cells: records the cells collection produced before any filter, and which filter dropped
  which (engine/cells.py), so a report shows cells judged of cells in scope;
- collection: ties every collected test to its clauses (`@pytest.mark.clause(ID, ...)`), marks
  tests of clauses the backend does not declare as not applicable, and gives each test the
  waivers that cover it (web-platform-tests style expectations, per test: engine/verdicts.py);
- shards: `--shard K/N` keeps shard K's share of the selection and records the whole run's
  scope, for `rlconform merge`;
- fixtures: the backend's surfaces and the run's settings as the clause tests receive them;
- outcomes: each test's verdict, folded into the run's results on the controller (xdist-safe:
  everything it needs travels in the test reports' user_properties);
- beside: `--with-kill-matrix` runs the mutant kill matrix beside the clause run (the main
  job) and waits for it before the report is built;
- report: writes the report and sets the exit status: non-zero when a clause failed, errored,
  passed where a waiver expected a failure (xpass), was skipped although declared or left
  partial, or a waiver is bad.
"""

pytest_plugins = [
    "rlconform.conformance.engine.options",
    "rlconform.conformance.engine.session",
    "rlconform.conformance.engine.cells",
    "rlconform.conformance.engine.collection",
    "rlconform.conformance.engine.shards",
    "rlconform.conformance.engine.fixtures",
    "rlconform.conformance.engine.outcomes",
    "rlconform.conformance.engine.beside",
    "rlconform.conformance.engine.report",
]
