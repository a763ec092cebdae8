"""The `raw_prompt` column (reference_impl/prompts.py): each row's prompt text and images as the
dataset held them travel with the rollout's output exactly, through batch operations, the
reference codec and data plane, and stay out of every stage's fetch and model inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from rlconform.fixtures.images import make_prompts
from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.codec import ReferenceCodec, WireBatch
from rlconform.reference_impl.dataplane import InMemoryDataPlane
from rlconform.reference_impl.prompts import FIELD, prompt_column, prompt_rows, with_prompts
from rlconform.reference_impl.registry import Stage, stage_fields

TEXTS = ["count the shapes é {{x}}", "", "a\nb"]


def _held():
    prompts, images, _ = make_prompts(3, [2, 0, 1], seed=3)
    prompts[0] = TEXTS[0]
    return prompts, images


def _same(rows, prompts, images):
    assert [t for t, _ in rows] == list(prompts)
    for (_, got), want in zip(rows, images):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.mode == w.mode == "RGB" and g.size == w.size
            assert np.array_equal(np.asarray(g), np.asarray(w))


def _batch(n: int) -> Batch:
    return Batch({"input_ids": torch.arange(4 * n).reshape(n, 4),
                  "input_lengths": torch.full((n,), 4)}, "qwen2_vl")


def test_rows_come_back_as_given():
    prompts, images = _held()
    col = prompt_column(prompts, images)
    assert "images" not in col[1] and col[1]["text"].dtype == torch.uint8
    _same(prompt_rows(col), prompts, images)
    _same(prompt_rows(prompt_column(TEXTS, [[], [], []])), TEXTS, [[], [], []])


def test_rows_follow_their_batch_through_selection_and_concat():
    prompts, images = _held()
    batch = with_prompts(_batch(3), prompts, images)
    picked = batch.select([2, 0])
    _same(prompt_rows(picked[FIELD]), [prompts[2], prompts[0]], [images[2], images[0]])
    joined = Batch.concat([batch.select([1]), batch.select([0])])
    _same(prompt_rows(joined[FIELD]), [prompts[1], prompts[0]], [images[1], images[0]])


def test_the_reference_codec_and_data_plane_carry_the_column_exactly():
    prompts, images = _held()
    batch = with_prompts(_batch(3), prompts, images)
    codec, store = ReferenceCodec(), InMemoryDataPlane()
    wire = codec.encode(batch)
    keys = ["a", "b", "c"]
    store.put("p", keys, wire.columns, wire.tags)
    cols, tags = store.get("p", keys, select_fields=list(wire.columns))
    back = codec.decode(WireBatch(cols, tags))
    assert back[FIELD] == batch[FIELD]
    _same(prompt_rows(back[FIELD]), prompts, images)


def test_no_stage_fetches_it_and_no_model_sees_it():
    prompts, images = _held()
    batch = with_prompts(_batch(3), prompts, images)
    for stage in Stage:
        assert FIELD not in stage_fields(stage)
        assert FIELD not in batch.multimodal_inputs(stage)


def test_bad_input_is_refused_naming_the_column_and_row():
    prompts, images = _held()
    with pytest.raises(ValueError, match=f"{FIELD}: 3 prompts for a batch of 2 rows"):
        with_prompts(_batch(2), prompts, images)
    with pytest.raises(ValueError, match=f"{FIELD}: 3 prompts but 2 image lists"):
        prompt_column(prompts, images[:2])
    grey = [[Image.new("L", (4, 4))], [], []]
    with pytest.raises(ValueError, match=f"{FIELD} row 0 image 0: expected an RGB PIL image, "
                                         "got Image in mode 'L'"):
        prompt_column(prompts, grey)
    with pytest.raises(TypeError, match=f"{FIELD} row 1: the prompt is a bytes"):
        prompt_column(["a", b"b"], [[], []])
