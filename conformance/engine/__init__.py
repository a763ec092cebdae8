"""The engine: what runs the clause tests against a backend and judges the run.

plugin.py is the pytest plugin (its hooks and fixtures in options, session, collection, fixtures,
outcomes and report); runner.py starts a run; kill_matrix.py and mutant_worker.py run the mutants;
verdicts.py and waivers.py decide what a failure means under a backend's expectations;
report_builder.py and provenance.py turn a run into its report; progress.py prints per-clause
lines while it runs; gpu_memory.py shares a GPU between the workers' model tests.
"""
