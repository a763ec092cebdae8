"""Model inputs against an independent answer: the family's own processor.

The model inputs a backend builds for a stage are judged by what the family's real processor
produces for the same rows, never by the backend's own output in another form: a stage that
normalises pixels twice, or hands a row's images over in another order, gives the right names,
dtypes and shapes and passes every comparison of the backend with itself. For every subset of
rows a backend's operations make (truncation, padding, selection, chunks, micro-batches with and
without a shuffle) the processor is run on exactly those rows' prompts and images; each row's
media must also be that sample's own processor output (the processor run on it alone), so media
that moved to another sample are named. Rows carry unequal image counts (0 to 3).
"""

from __future__ import annotations

import functools

import pytest
import torch

from rlconform.fixtures.pairwise import covering_cases
from rlconform.fixtures.synthetic import MEDIA_FORMS
from rlconform.reference_impl.objects import value_difference
from rlconform.reference_impl.registry import FAMILIES, FIELDS, DtypePolicy, Kind, Stage

from ._check import offered

# images per row: unequal counts, a text-only row, more images than rows in one sample; one row
# holding every image among text rows (pack-dim-1 media must keep it in its row); every row the
# same number of images, of unequal sizes (a per-row split by count alone looks right)
PATTERNS = {"mixed": (2, 0, 1, 3, 1), "one_row": (0, 0, 3, 0), "equal": (2, 2, 2, 2)}
# the families with a real processor (fixtures/families.py), named here: importing the
# fixtures at collection would load transformers for every run of the suite
PROCESSOR_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "smolvlm", "idefics3",
                      "llava", "llava_next")


@functools.cache
def _rollout(name: str, pattern: str):
    """(family, prompts, images) of PATTERNS[pattern], built once per process."""
    from rlconform.fixtures.families import build_family
    from rlconform.fixtures.images import make_prompts

    family = build_family(name, "tiny")  # processors' outputs do not depend on the size
    counts = PATTERNS[pattern]
    prompts, images, _ = make_prompts(len(counts), list(counts), seed=0)
    return family, tuple(prompts), tuple(tuple(i) for i in images)


def _batch(name: str, form: str, pattern: str):
    """The batch a rollout holds: the processor's output for every row, in `form`."""
    from rlconform.fixtures.processed import to_batch

    family, prompts, images = _rollout(name, pattern)
    batch = to_batch(family, family.process(list(prompts), [list(i) for i in images]),
                     list(PATTERNS[pattern]))
    return batch if form == "packed" else batch.to_row_dicts(form)


@functools.cache
def _processor(name: str, pattern: str, rows: tuple[int, ...]) -> dict:
    """The processor's output for exactly these rows (in this order): the answer."""
    family, prompts, images = _rollout(name, pattern)
    return family.process([prompts[i] for i in rows], [list(images[i]) for i in rows])


def _media(name: str, pattern: str, features: dict, rows) -> dict:
    """Per-row media segments of `features` for `rows`, split by the fixture's own rule."""
    family = _rollout(name, pattern)[0]
    features = {**features, "input_ids": torch.empty(len(rows), 0)}
    return family.per_sample_media(features, [PATTERNS[pattern][i] for i in rows])


def _assert_inputs(name: str, pattern: str, got: dict, rows: list[int], what: str, *,
                   cut: int | None = None, dtype: torch.dtype | None = None,
                   per_sample: bool = False) -> str | None:
    """`got` (a stage's model inputs for `rows`) is what the processor gives those rows: media
    tensors bit for bit (cast to `dtype` where the policy casts); per-token maps over each row's
    tokens (the first `cut` where truncated); with `per_sample` (rows that moved), each row's
    media that sample's own processor output. Returns why the names differ (the test asserts
    that last, after every value it can compare), or None."""
    want = _processor(name, pattern, tuple(rows))
    lens = want["attention_mask"].sum(dim=1).tolist()
    expected = {k for k in want if FIELDS[k].multimodal}
    keep = FAMILIES[name].keep_dtype
    for key in sorted(expected & set(got)):  # values first: they say more than names
        fs, t = FIELDS[key], want[key]
        if fs.kind is Kind.PER_TOKEN:
            g = got[key]
            for j, n in enumerate(lens):
                n = n if cut is None else min(n, cut)
                why = value_difference(f"{what}: {key!r} row {j} (sample {rows[j]}) tokens 0..{n}",
                                       t[j, :n], g[j, :n])
                assert why is None, why
            continue
        if dtype is not None and fs.dtype_policy is DtypePolicy.POLICY and key not in keep \
                and t.is_floating_point():
            t = t.to(dtype)
        why = value_difference(f"{what}: {key!r} against the processor's output for these rows",
                               t, got[key])
        assert why is None, why
    names = None if set(got) == expected else \
        f"{what}: model inputs {sorted(got)}, the processor gives these rows {sorted(expected)}"
    if not per_sample:
        return names
    mine = _media(name, pattern, got, rows)
    for j, i in enumerate(rows):
        own = _media(name, pattern, _processor(name, pattern, (i,)), [i])
        for key, per_row in mine.items():
            a, b = own[key][0], per_row[j]
            where = f"{what}: row {j}'s {key!r} against sample {i}'s own processor output"
            if a is None or b is None:
                assert a is None and b is None, \
                    f"{where}: {'no media' if b is None else 'media'}, the sample has " \
                    f"{'none' if a is None else len(a)}"
                continue
            why = value_difference(where, a, b)
            assert why is None, why
    return names


CASES = [(c["family"], c["form"], c["pattern"]) for c in covering_cases(
    {"family": PROCESSOR_FAMILIES, "form": MEDIA_FORMS, "pattern": tuple(PATTERNS)})]


@pytest.mark.clause("BATCH-MODEL-INPUTS")
@pytest.mark.parametrize("family, form, pattern", CASES, ids=["-".join(c) for c in CASES])
def test_stage_inputs_are_what_the_processor_gives_those_rows(backend, batch_ops, family, form,
                                                               pattern):
    batch = _batch(family, form, pattern)
    counts = PATTERNS[pattern]
    b = len(batch)
    assert b == len(counts), "fixture lost its rows"
    if pattern == "equal":
        sizes = [[im.size for im in row] for row in _rollout(family, pattern)[2]]
        assert all(len(set(s)) == len(s) > 1 for s in sizes), \
            f"fixture lost its unequal image sizes within a row: {sizes}"
    else:
        assert len(set(counts)) > 1 and 0 in counts, "fixture lost its unequal image counts"
    every = list(range(b))
    names: list = []  # name mismatches, asserted after every value comparison

    def check(inputs, rows, what, **kw):
        names.append(_assert_inputs(family, pattern, inputs, rows,
                                    f"{family} {form} {pattern} {what}", **kw))

    for stage in Stage:
        check(batch_ops.multimodal_inputs(batch, stage), every, stage.value)
    cut = int(batch.seq_lens.max()) - 3
    if offered(backend, "truncate"):
        check(batch_ops.multimodal_inputs(batch_ops.truncate(batch, cut), Stage.TRAIN), every,
              f"after truncate({cut})", cut=cut)
    if offered(backend, "pad_to"):
        check(batch_ops.multimodal_inputs(batch_ops.pad_to(batch, batch.seq_len() + 4),
                                          Stage.TRAIN), every, "after pad_to")
    if "batch_algebra" in backend.capabilities:
        idx = [3, 0, b - 1, 1, 3]  # out of order, a text-only row, a repeat
        check(batch_ops.multimodal_inputs(batch_ops.select(batch, idx), Stage.TRAIN), idx,
              f"after select({idx})", per_sample=True)
        start = 0
        for k, part in enumerate(batch_ops.split(batch, [2, b - 2])):
            check(batch_ops.multimodal_inputs(part, Stage.LOGPROB),
                  every[start:start + len(part)], f"split chunk {k}")
            start += len(part)
    if "micro_batching" in backend.capabilities:
        for n, seed in ((2, None), (2, 11), (3, 5)):
            for k, (idx, mb) in enumerate(batch_ops.micro_batches(batch, n, shuffle_seed=seed)):
                check(batch_ops.multimodal_inputs(mb, Stage.TRAIN), list(idx),
                      f"micro-batch {k} of {n} (shuffle_seed {seed})", per_sample=True)
    problems = sorted({n for n in names if n})
    assert not problems, "; ".join(problems)
    check(batch_ops.multimodal_inputs(batch, Stage.TRAIN, torch.bfloat16), every,
          "train in bfloat16", dtype=torch.bfloat16)
    assert names[-1] is None, names[-1]
