"""The tiny VLM families behave like the real ones the suite stands in for.

Each family must run its real processor on a mixed batch (two images of different sizes, one
image, text only), forward / backward / generate on exactly what the processor returns, split
its packed media per sample losslessly, reload offline with identical outputs, and repeat a
forward bitwise. Models are built once per module; import time dominates the run.
"""

from __future__ import annotations

import functools
import json
import os
import random

import pytest
import torch
from transformers import LogitsProcessorList

from rlconform.fixtures.families import (
    FAMILY_NAMES,
    PACKING_MODES,
    OrdinaryTokensOnly,
    build_family,
    load_processor,
)
from rlconform.fixtures.images import (
    NUMBER_WORDS,
    SIZES,
    make_image,
    make_prompts,
    make_sample,
    reward,
)

VLMS = tuple(n for n in FAMILY_NAMES if n != "text")
EXPECTED = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "smolvlm", "idefics3", "llava",
            "llava_next", "text"}
IMAGES_PER_SAMPLE = [2, 1, 0]


@functools.cache
def _model(name: str) -> torch.nn.Module:
    return build_family(name).build_model(seed=0)


@functools.cache
def _batch(name: str) -> tuple[list[str], list[list], list[int]]:
    """Two images of different sizes, one image, and a text-only row (text: three rows)."""
    if name == "text":
        prompts, _, _ = make_prompts(3, [0], seed=3)
        return prompts, [[], [], []], [0, 0, 0]
    two = [make_image(11, (40, 60), 3)[0], make_image(12, (84, 28), 2)[0]]
    one, prompt, _ = make_sample(random.Random(13), (56, 56), "colour")
    prompts = ["how many shapes are there in the images ?", prompt,
               "count the shapes : circle square . how many shapes are there ?"]
    return prompts, [two, [one], []], list(IMAGES_PER_SAMPLE)


def _features(name: str, padding_side: str = "right") -> dict[str, torch.Tensor]:
    prompts, images, _ = _batch(name)
    return build_family(name).process(prompts, images, padding_side=padding_side)


def test_family_names():
    assert set(FAMILY_NAMES) == EXPECTED
    assert build_family("qwen2_vl") is build_family("qwen2_vl")
    with pytest.raises(KeyError, match="unknown family"):
        build_family("nope")


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_process_emits_declared_fields(name):
    fam = build_family(name)
    feats = _features(name)
    assert set(feats) == {"input_ids", "attention_mask", *fam.media_fields}
    assert set(fam.packing) <= set(fam.media_fields)
    assert all(mode in PACKING_MODES for mode in fam.packing.values())
    ids, mask = feats["input_ids"], feats["attention_mask"]
    b, s = ids.shape
    for per_token in set(fam.media_fields) - set(fam.packing):
        assert feats[per_token].shape == (b, s), per_token
    # right padding: each row is ones then zeros
    lengths = mask.sum(1)
    assert torch.equal(mask, (torch.arange(s)[None] < lengths[:, None]).long())
    assert (ids[mask == 0] == fam.tokenizer.pad_token_id).all()
    if fam.image_token_id is not None:
        n_image_tokens = (ids == fam.image_token_id).sum(1)
        counts = _batch(name)[2]
        assert [bool(n) for n in n_image_tokens] == [bool(c) for c in counts]
    if "mm_token_type_ids" in feats:
        assert torch.equal(feats["mm_token_type_ids"] == 1, ids == fam.image_token_id)
    if "token_type_ids" in feats:
        assert torch.equal(feats["token_type_ids"] == 1, ids == fam.image_token_id)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_forward_backward_and_repeat_is_bitwise(name):
    fam, model = build_family(name), _model(name)
    feats = _features(name)
    with torch.no_grad():
        a = model(**feats).logits
        b = model(**feats).logits
    vocab = fam.config.get_text_config().vocab_size
    assert a.shape == (*feats["input_ids"].shape, vocab)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b)

    model.zero_grad(set_to_none=True)
    out = model(**feats, labels=feats["input_ids"].masked_fill(feats["attention_mask"] == 0, -100))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    if name != "text":  # the images reached the loss: the vision tower has non-zero gradients
        vision = [p.grad for n, p in model.named_parameters()
                  if p.grad is not None and ("visual" in n or "vision" in n)]
        assert vision and any(g.abs().sum() > 0 for g in vision)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", VLMS)
def test_images_move_only_their_rows(name):
    """Perturbing pixels changes image rows and leaves the text-only row bitwise alone."""
    model, feats = _model(name), _features(name)
    pv = feats["pixel_values"]
    bumped = dict(feats, pixel_values=torch.where(pv != 0, pv + 0.5, pv))  # keep padding tiles
    with torch.no_grad():
        a = model(**feats).logits.log_softmax(-1)
        b = model(**bumped).logits.log_softmax(-1)
    mask = feats["attention_mask"].bool()
    for row, n_images in enumerate(IMAGES_PER_SAMPLE):
        delta = (a[row] - b[row])[mask[row]].abs().max().item()
        if n_images:
            assert delta > 1e-3, (row, delta)
        else:
            assert delta == 0.0, (row, delta)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_generate_emits_only_ordinary_tokens(name):
    fam, model = build_family(name), _model(name)
    ordinary = fam.ordinary_token_ids()
    banned = set(fam.tokenizer.all_special_ids)
    if fam.image_token_id is not None:
        banned.add(fam.image_token_id)
    assert not banned & set(ordinary.tolist())
    feats = _features(name, padding_side="left")
    torch.manual_seed(0)
    out = model.generate(**feats, max_new_tokens=5, do_sample=True, top_k=0,
                         logits_processor=LogitsProcessorList([OrdinaryTokensOnly(ordinary)]))
    new = out[:, feats["input_ids"].shape[1]:]
    assert new.shape == (feats["input_ids"].shape[0], 5)
    assert torch.isin(new, ordinary).all()


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_per_sample_media_round_trips(name):
    fam = build_family(name)
    feats = _features(name)
    counts = _batch(name)[2]
    split = fam.per_sample_media(feats, counts)
    assert set(split) == set(fam.packing)
    for field_name, rows in split.items():
        assert len(rows) == len(counts)
        for row, n in zip(rows, counts):
            if n == 0:
                assert row is None
            elif fam.packing[field_name] == "rows":
                assert len(row) == 1
            else:
                assert len(row) == n
    if name.startswith("qwen"):
        assert [s.shape for s in split["image_grid_thw"][0]] == [(1, 3), (1, 3)]
        grids = split["image_grid_thw"][0]
        assert [s.shape[0] for s in split["pixel_values"][0]] == [int(g.prod()) for g in grids]
    if fam.packing.get("pixel_values") == "rows":  # real tiles only, padding tiles dropped
        tiles = split["pixel_values"][1][0]  # the one-image row has fewer tiles than the max
        assert tiles.shape[0] < feats["pixel_values"].shape[1]
        assert tiles.flatten(1).ne(0).any(1).all()
    packed = fam.pack_media(split)
    assert set(packed) == set(fam.packing)
    for field_name, tensor in packed.items():
        assert tensor.dtype == feats[field_name].dtype
        assert torch.equal(tensor, feats[field_name]), field_name


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_image_free_batch(name):
    """A whole image-free shard: no media fields, None rows, and the model still runs."""
    fam, model = build_family(name), _model(name)
    prompts, _, _ = make_prompts(2, [0], seed=5)
    feats = fam.process(prompts, [[], []])
    assert set(feats) == {"input_ids", "attention_mask"} | (
        set(fam.media_fields) - set(fam.packing)) & {"mm_token_type_ids", "token_type_ids"}
    assert all(rows == [None, None] for rows in fam.per_sample_media(feats, [0, 0]).values())
    with torch.no_grad():
        assert torch.isfinite(model(**feats).logits).all()


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_save_and_reload_processor(name, tmp_path):
    fam = build_family(name)
    fam.save(tmp_path)
    reloaded = load_processor(tmp_path)
    prompts, images, _ = _batch(name)
    texts = [fam.prompt_text(p, len(i)) for p, i in zip(prompts, images)]
    kwargs = {"padding": True, "padding_side": "right", "return_tensors": "pt"}
    if fam.processor is None:
        again = reloaded(texts, **kwargs)
    else:
        assert type(reloaded) is type(fam.processor)
        assert type(reloaded.image_processor).__name__.endswith("Pil")  # backend pinned
        again = reloaded(text=texts, images=images, **kwargs)
    again = {k: v for k, v in again.items() if isinstance(v, torch.Tensor)}
    feats = _features(name)
    assert set(again) == set(feats)
    assert all(torch.equal(again[k], feats[k]) for k in feats)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == (
        fam.config.model_type)
    if fam.processor is not None and hasattr(fam.processor, "video_processor"):
        saved = json.loads((tmp_path / "processor_config.json").read_text())
        video = saved.get("video_processor") or json.loads(
            (tmp_path / "video_preprocessor_config.json").read_text())
        assert video["video_processor_type"].endswith("VideoProcessor")
        assert video["video_processor_type"] != "_NoVideoProcessor"


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_chat_template_renders_the_rollouts_prompt_text(name, tmp_path):
    """The processor's (and tokenizer's) chat template, before and after a save, renders a
    user turn as exactly `prompt_text`: string content or image / text blocks, any number of
    images, text that looks like template syntax or JSON escapes."""
    fam = build_family(name)
    fam.save(tmp_path)
    holders = [fam.processor or fam.tokenizer, load_processor(tmp_path)]
    text = 'count {{ x }} {% if %} "q" \\n \u00e9 .'
    for holder in holders:
        for n in [0] if fam.processor is None else [0, 1, 3]:
            blocks = [*({"type": "image"} for _ in range(n)), {"type": "text", "text": text}]
            for content in [blocks] + ([text] if n == 0 else []):
                got = holder.apply_chat_template([{"role": "user", "content": content}],
                                                 tokenize=False, add_generation_prompt=True)
                assert got == fam.prompt_text(text, n), (n, content)
        bare = holder.apply_chat_template([{"role": "user", "content": text}], tokenize=False)
        assert fam.prompt_text(text, 0).startswith(bare) and bare != fam.prompt_text(text, 0)
    with pytest.raises(Exception, match="user turns only"):
        holders[0].apply_chat_template([{"role": "system", "content": text}], tokenize=False)


def test_save_with_weights_reloads_same_model(tmp_path):
    name = "qwen2_vl"
    fam, model = build_family(name), _model(name)
    fam.save(tmp_path, model=model)
    assert any(f.endswith(".safetensors") for f in os.listdir(tmp_path))
    again = fam.model_class.from_pretrained(tmp_path, attn_implementation="eager").eval()
    feats = _features(name)
    with torch.no_grad():
        assert torch.equal(model(**feats).logits, again(**feats).logits)


def test_build_model_is_deterministic_and_leaves_rng_alone():
    fam = build_family("text")
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = fam.build_model(seed=7), fam.build_model(seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    c = fam.build_model(seed=8)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert any(not torch.equal(pa[k], pc[k]) for k in pa)
    assert not a.training
    bf16 = fam.build_model(seed=7, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())


def test_synthetic_images_are_deterministic_and_rewarded():
    p1, i1, a1 = make_prompts(8, [0, 1, 2, 3], seed=4)
    p2, i2, a2 = make_prompts(8, [0, 1, 2, 3], seed=4)
    assert (p1, a1) == (p2, a2)
    assert [len(x) for x in i1] == [0, 1, 2, 3] * 2
    assert all(x.tobytes() == y.tobytes() for r, s in zip(i1, i2) for x, y in zip(r, s))
    assert {im.size for r in i1 for im in r} <= set(SIZES)
    assert make_prompts(8, [0, 1, 2, 3], seed=5)[2] != a1 or make_prompts(
        8, [0, 1, 2, 3], seed=5)[0] != p1
    for answer in a1:
        assert answer in NUMBER_WORDS or answer in ("red", "green", "blue", "yellow", "purple",
                                                    "orange")
        assert reward(answer, f"i think {answer} .") == 1.0
        assert reward(answer, "no idea") == 0.0
    assert reward("three", "3") == 1.0
    assert reward("two", "three or two") == 0.0
    img, prompt, answer = make_sample(random.Random(0), (84, 56), "count")
    assert img.size == (84, 56) and "how many" in prompt and answer in NUMBER_WORDS
