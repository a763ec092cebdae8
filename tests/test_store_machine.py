"""The store machine's counterexample is a runnable test: the snippet a failure prints fails
against the store it came from, by its own assertion, and passes against the reference."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from rlconform.conformance.backend import load_backend
from rlconform.conformance.clauses.test_store_machine import StoreMachine, machine_for
from rlconform.fixtures import names as alphabet

SEARCH = settings(max_examples=60, stateful_step_count=20, derandomize=True, database=None,
                  deadline=None, report_multiple_bugs=False)


def _snippet(mutant: str, names: str) -> str:
    spec = f"mutant:{mutant}"
    machine = machine_for(StoreMachine, load_backend(spec), spec, names)
    with pytest.raises(AssertionError) as failure:
        run_state_machine_as_test(machine, settings=SEARCH)
    text = str(failure.value)
    assert "runnable:\n" in text, f"no snippet in the failure: {text[:500]}"
    return textwrap.dedent(text.split("runnable:\n", 1)[1])


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("mutant, names", [
    ("reput_keeps_old_value", "case"),  # a row's bits: tensor_difference against its source
    ("repeated_key_returns_one_row", "case"),  # a column's shape
    ("key_trailing_spaces_ignored", "whitespace"),  # list
    ("list_of_unknown_partition_raises", "case"),  # a call that raises
])
def test_the_printed_sequence_fails_on_its_store_and_passes_on_the_reference(mutant, names):
    code = _snippet(mutant, names)
    assert f"load_backend('mutant:{mutant}')" in code and "t = backend.transport()" in code
    bad = _run(code)
    assert bad.returncode != 0, f"the snippet passed on mutant {mutant}:\n{code}"
    assert "AssertionError" in bad.stderr or "KeyError" in bad.stderr, bad.stderr[-2000:]
    good = _run(code.replace(f"'mutant:{mutant}'", "'reference'"))
    assert good.returncode == 0, f"the snippet fails on the reference:\n{code}\n" \
                                 f"{good.stderr[-2000:]}"


def test_every_world_holds_confusable_pairs_the_contract_allows():
    from rlconform.reference_impl.dataplane import check_name

    for cls in (*alphabet.CLASSES, "mixed"):
        world = alphabet.worlds(cls).example()
        for role in (world.partitions, world.keys, world.fields):
            assert len(set(role)) == len(role) >= 2, f"{cls}: {role}"
            for name in role:
                check_name("name", name)
                assert eval(alphabet.source(name)) == name  # noqa: S307 - our own source
