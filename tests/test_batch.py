"""Unit tests of the reference Batch (reference_impl/batch.py): truncate, pad, validate, select, the
sequence dim of each field, the conversions to and from per-row dicts and the batch algebra (split,
concat, micro-batches)."""

from __future__ import annotations

import pytest
import torch
from _helpers import ALL_FAMILIES, CODEC, packed_fields, qwen, ragged, seq, through_transport

from rlconform.fixtures.synthetic import RowPlan, build_batch, default_plan
from rlconform.reference_impl import registry
from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.objects import ObjectColumn
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.registry import (
    FieldSpec,
    Kind,
    Stage,
    spec,
)


class TestBatch:
    def test_requires_input_lengths_and_registered_fields(self):
        with pytest.raises(KeyError, match="'input_lengths' is required"):
            Batch({"input_ids": torch.zeros(2, 3, dtype=torch.long)})
        with pytest.raises(KeyError, match="'bogus' is not registered"):
            Batch({"input_lengths": torch.tensor([1]), "bogus": torch.zeros(1)})

    def test_canonical_batches_validate(self):
        for fam in ALL_FAMILIES:
            build_batch(fam, default_plan(fam)).validate()

    @pytest.mark.parametrize(
        "field, value, error, message",
        [
            ("input_ids", lambda b: b["input_ids"].float(), TypeError,
             r"field 'input_ids' has dtype torch.float32"),
            ("pixel_values",
             lambda b: PackedTensor([s.long() for s in b["pixel_values"].segments],
                                    b["pixel_values"].rows), TypeError,
             r"field 'pixel_values' has dtype torch.int64"),
            ("attention_mask", lambda b: b["attention_mask"][:, :-1], ValueError,
             r"per-token field 'attention_mask' has sequence dim"),
            ("mm_token_type_ids", lambda b: b["mm_token_type_ids"][:, 0], ValueError,
             r"per-token field 'mm_token_type_ids' must be \[B, S\]"),
            ("advantages", lambda b: b["advantages"][:3], ValueError,
             r"field 'advantages' has 3 rows, expected 4"),
            ("image_grid_thw", lambda b: b["image_grid_thw"].slice(0, 3), ValueError,
             r"field 'image_grid_thw' has 3 rows, expected 4"),
            ("token_mask", lambda b: b["token_mask"][:3], ValueError,
             r"field 'token_mask' has 3 rows, expected 4"),
        ],
        ids=["dtype", "packed-dtype", "misaligned", "per-token-1d", "rows", "packed-rows",
             "per-token-rows"],
    )
    def test_validate_errors_name_the_field(self, field, value, error, message):
        b = qwen()
        bad = b.replace(**{field: value(b)})
        with pytest.raises(error, match=message):
            bad.validate()
        with pytest.raises(error, match=message):
            CODEC.encode(bad)

    def test_completion_starts_at_each_rows_first_loss_token(self):
        b = qwen()
        mask = torch.zeros_like(b["token_mask"])
        lens = b.seq_lens.tolist()
        mask[0, 2:lens[0]] = True
        mask[1, lens[1] - 1] = True
        mask[3, 0] = True
        mask[2, lens[2]:] = True  # beyond row 2's length: not its tokens, so no completion
        assert b.replace(token_mask=mask).completion_starts() == [2, lens[1] - 1, lens[2], 0]
        with pytest.raises(ValueError, match="no 'token_mask'"):
            b.without("token_mask").completion_starts()

    def test_validate_input_lengths_beyond_sequence(self):
        b = qwen()
        bad = b.replace(input_lengths=b.seq_lens + 100)
        with pytest.raises(ValueError, match="field 'input_lengths' has max"):
            bad.validate()

    def test_validate_coupled_none_ness_mismatch(self):
        b = qwen()
        assert b["pixel_values"].is_none(2)
        grid = b["image_grid_thw"]
        rows = list(grid.rows)
        rows[2] = rows[1]  # row 2 has a grid but no pixels
        bad = b.replace(image_grid_thw=PackedTensor(grid.segments, rows))
        with pytest.raises(ValueError, match=r"row 2: field 'pixel_values' is None but coupled "
                                             r"field 'image_grid_thw' is present"):
            bad.validate()

    def test_truncate_narrows_only_per_token(self):
        b = qwen()
        t = b.truncate(3)
        t.validate()
        for name in b.names(Kind.PER_TOKEN):
            assert torch.equal(t[name], seq(name, b[name], 0, 3))
        assert t.seq_lens.tolist() == b.seq_lens.clamp(max=3).tolist()
        for name in b.names(Kind.PACKED):
            assert t[name] is b[name]  # media are never narrowed
        assert torch.equal(t["advantages"], b["advantages"])
        assert b.truncate(1000) == b
        with pytest.raises(ValueError, match="max_len must be >= 0"):
            b.truncate(-1)

    def test_pad_to_pads_per_token_only(self):
        b = qwen()
        s = b.seq_len()
        p = b.pad_to(s + 5)
        p.validate()
        for name in b.names(Kind.PER_TOKEN):
            axis = spec(name).seq_axis(b[name].dim())
            assert p[name].shape[axis] == s + 5 and p[name].shape[0] == 4
            assert torch.equal(seq(name, p[name], 0, s), b[name])
            assert torch.count_nonzero(seq(name, p[name], s, 5)) == 0
        for name in b.names(Kind.PACKED):
            assert p[name] is b[name]
        assert p.truncate(s) == b
        assert b.pad_to(s - 1) == b  # never narrows

    def test_select_and_slice(self):
        b = qwen()
        s = b.select([3, 0])
        assert s.batch_size == 2
        assert torch.equal(s["input_ids"], b["input_ids"][[3, 0]])
        assert s["pixel_values"] == b["pixel_values"].select([3, 0])
        assert s["pixel_values"].is_deduplicated()  # row 3 shares row 0's media
        assert b.slice(1, 3) == b.select([1, 2])

    def test_concat_of_slices_restores_and_pads(self):
        b = qwen()
        assert Batch.concat([b.slice(0, 1), b.slice(1, 4)]) == b
        short = build_batch("qwen2_vl", [RowPlan(2, images=[1])], seed=1)
        cat = Batch.concat([b, short])
        cat.validate()
        assert cat.seq_len() == b.seq_len()
        assert cat.batch_size == 5
        assert cat.select([4])["input_ids"].shape == (1, b.seq_len())
        with pytest.raises(KeyError, match="cannot concat batches with fields"):
            Batch.concat([b, b.without("advantages")])
        with pytest.raises(ValueError, match="at least one"):
            Batch.concat([])

    @pytest.mark.parametrize("mb", [1, 3, 4, 10])
    def test_shard(self, mb):
        b = qwen()
        shards = b.shard(mb)
        sizes = [s.batch_size for s in shards]
        assert sum(sizes) == 4 and all(n == mb for n in sizes[:-1]) and 0 < sizes[-1] <= mb
        assert Batch.concat(shards) == b

    def test_shard_rejects_non_positive(self):
        with pytest.raises(ValueError, match="micro_batch_size must be positive"):
            qwen().shard(0)

    @pytest.mark.parametrize("stage", list(Stage))
    def test_multimodal_inputs_per_stage(self, stage):
        b = qwen()
        out = b.multimodal_inputs(stage)
        expected = {n for n in b.fields if spec(n).multimodal and stage in spec(n).stages}
        expected -= {n for n, v in packed_fields(b).items() if v.as_tensor() is None}
        assert set(out) == expected
        assert {"pixel_values", "image_grid_thw", "mm_token_type_ids"} <= set(out)
        assert "input_ids" not in out
        assert torch.equal(out["pixel_values"], b["pixel_values"].as_tensor())
        n_patches = sum(s.shape[0] for i in range(len(b)) for s in
                        (b["pixel_values"].row_segments(i) or []))
        assert out["pixel_values"].shape == (n_patches, 1176)

    def test_multimodal_inputs_stage_filter(self, monkeypatch):
        monkeypatch.setitem(registry.FIELDS, "train_only_map", FieldSpec(
            "train_only_map", Kind.PER_TOKEN, multimodal=True, dtypes=(torch.int64,),
            stages=frozenset({Stage.TRAIN})))
        b = qwen()
        b = b.replace(train_only_map=torch.zeros_like(b["input_ids"]))
        assert "train_only_map" in b.multimodal_inputs(Stage.TRAIN)
        assert "train_only_map" not in b.multimodal_inputs(Stage.LOGPROB)
        assert "train_only_map" not in b.multimodal_inputs(Stage.REFERENCE_LOGPROB)

    def test_multimodal_inputs_dtype_policy(self):
        b = qwen()
        out = b.multimodal_inputs(Stage.LOGPROB, dtype=torch.bfloat16)
        assert out["pixel_values"].dtype == torch.bfloat16
        assert out["pixel_values_videos"].dtype == torch.bfloat16
        assert out["image_grid_thw"].dtype == torch.int64
        assert out["mm_token_type_ids"].dtype == torch.int64
        nemo = build_batch("nemotron_omni", default_plan("nemotron_omni"))
        kept = nemo.multimodal_inputs(Stage.TRAIN, dtype=torch.bfloat16)
        assert kept["pixel_values"].dtype == torch.float32  # fp32 on purpose

    def test_multimodal_inputs_media_free_left_out(self):
        b = build_batch("qwen2_vl", [RowPlan(3), RowPlan(5)])
        out = b.multimodal_inputs(Stage.TRAIN)
        assert "pixel_values" not in out and "image_grid_thw" not in out
        assert "mm_token_type_ids" in out

    def test_multimodal_inputs_pack_dim1(self):
        b = build_batch("idefics3", [RowPlan(3, images=[2]), RowPlan(4), RowPlan(5, images=[1])])
        out = b.multimodal_inputs(Stage.TRAIN)
        assert out["pixel_values"].shape == (3, 2, 3, 4, 4)
        assert out["pixel_attention_mask"].shape == (3, 2, 4, 4)
        assert torch.count_nonzero(out["pixel_attention_mask"][1]) == 0
        assert torch.count_nonzero(out["pixel_attention_mask"][2, 1:]) == 0


class TestSeqDim:
    def test_seq_axis(self):
        pos = spec("position_ids")
        assert pos.seq_dim == -1 and pos.kind is Kind.PER_TOKEN and pos.dtypes == (torch.int64,)
        assert pos.seq_axis(2) == 1 and pos.seq_axis(3) == 2
        assert spec("input_ids").seq_axis(3) == 1  # [B, S, k]: default seq_dim 1
        with pytest.raises(ValueError, match="per-token field 'position_ids' needs a sequence dim"):
            pos.seq_axis(1)

    @pytest.mark.parametrize("channels", [0, 3, 4])
    def test_truncate_pad_select_concat(self, channels):
        b = build_batch("qwen2_vl", default_plan("qwen2_vl"), position_ids=channels)
        pos = b["position_ids"]
        s = b.seq_len()
        assert pos.shape == ((4, s) if not channels else (4, channels, s))
        assert torch.count_nonzero(pos[..., 6:][b.seq_lens <= 6]) == 0  # pad past each row
        t = b.truncate(3)
        assert torch.equal(t["position_ids"], pos[..., :3])
        p = b.pad_to(s + 2)
        assert torch.equal(p["position_ids"][..., :s], pos) and p["position_ids"].shape[-1] == s + 2
        assert b.select([2, 0])["position_ids"].shape[:-1] == (2, *pos.shape[1:-1])
        short = b.select([2]).truncate(int(b.seq_lens[2]))
        cat = Batch.concat([short, b.select([0])])
        cat.validate()
        assert torch.equal(cat["position_ids"][0], p["position_ids"][2, ..., :s])

    def test_validate_names_a_misaligned_position_ids(self):
        b = build_batch("qwen2_vl", default_plan("qwen2_vl"), position_ids=3)
        with pytest.raises(ValueError, match=r"'position_ids' has sequence dim 6 \(dim 2 of "
                                             r"\[4, 3, 6\]\)"):
            b.replace(position_ids=b["position_ids"][..., :-1]).validate()
        with pytest.raises(ValueError, match=r"per-token field 'position_ids' must be \[B, S\]"):
            b.replace(position_ids=b["position_ids"][:, 0, 0]).validate()
        with pytest.raises(TypeError, match="field 'position_ids' has dtype torch.int32"):
            b.replace(position_ids=b["position_ids"].int()).validate()

    @pytest.mark.parametrize("channels", [0, 3, 4])
    def test_codec_rows_are_len_by_other_dims(self, channels):
        b = build_batch("qwen3_vl", default_plan("qwen3_vl"), position_ids=channels)
        wire = CODEC.encode(b)
        rows = wire.columns["position_ids"].unbind()
        for i, r in enumerate(rows):
            n = int(b.seq_lens[i])
            want = b["position_ids"][i, ..., :n]
            assert r.shape == ((n,) if not channels else (n, channels))
            assert torch.equal(r, want.movedim(-1, 0))
        assert CODEC.decode(wire) == b
        assert CODEC.decode(through_transport(wire)) == b

    def test_seq_dim_1_with_trailing_dims(self, monkeypatch):
        monkeypatch.setitem(registry.FIELDS, "routed_experts", FieldSpec(
            "routed_experts", Kind.PER_TOKEN, dtypes=(torch.int16,)))  # verl: [B, S, L, K]
        b = qwen()
        s = b.seq_len()
        experts = torch.arange(4 * s * 6, dtype=torch.int16).reshape(4, s, 2, 3)
        experts[~b["attention_mask"].bool()] = 0
        b = b.replace(routed_experts=experts)
        wire = CODEC.encode(b)
        assert wire.columns["routed_experts"].unbind()[0].shape == (int(b.seq_lens[0]), 2, 3)
        assert CODEC.decode(wire) == b
        assert b.truncate(2)["routed_experts"].shape == (4, 2, 2, 3)


def _without_empty_media(b: Batch) -> Batch:
    return b.without(*[n for n, v in packed_fields(b).items() if v.as_tensor() is None])


class TestRowDicts:
    def test_qwen_rows_hold_what_the_processor_emits_per_sample(self):
        b = qwen()
        o = b.to_row_dicts()
        assert "pixel_values" not in o and "mm_token_type_ids" in o and "position_ids" in o
        rows = o["multi_modal_inputs"]
        pv = b["pixel_values"]
        r0 = rows[0]
        assert r0["pixel_values"].shape == (sum(s.shape[0] for s in pv.row_segments(0)), 1176)
        assert torch.equal(r0["pixel_values"], pv.row(0))
        assert r0["image_grid_thw"].shape == (2, 3)  # [n_images, 3]
        assert torch.equal(r0["image_grid_thw"], b["image_grid_thw"].row(0))
        assert int(r0["image_grid_thw"].prod(-1).sum()) == r0["pixel_values"].shape[0]
        assert set(rows[1]) == {"pixel_values", "image_grid_thw"}  # no video: key left out
        assert rows[2] == {}  # verl: {} for a text-only row
        assert b.to_row_dicts("mm_train_inputs")["mm_train_inputs"][2] is None  # OpenRLHF
        o.validate()

    @pytest.mark.parametrize("family", ALL_FAMILIES)
    @pytest.mark.parametrize("into", ["multi_modal_inputs", "mm_train_inputs"])
    def test_round_trip_and_model_inputs(self, family, into):
        for plan in (default_plan(family), ragged(9), [RowPlan(3), RowPlan(2)]):
            b = build_batch(family, plan, seed=5)
            o = b.to_row_dicts(into)
            o.validate()
            assert set(o.names(Kind.PACKED)) == set()
            back = o.from_row_dicts(into)
            why = _without_empty_media(b).first_difference(back)
            assert why is None, why
            for stage in Stage:
                want, got = b.multimodal_inputs(stage), o.multimodal_inputs(stage)
                assert set(want) == set(got)
                for k in want:
                    assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k

    def test_list_values_where_one_tensor_cannot_give_the_segments_back(self):
        nemo = build_batch("nemotron_omni", [RowPlan(3, images=[1, 2]), RowPlan(2, images=[3])])
        rows = nemo.to_row_dicts()["multi_modal_inputs"]
        assert isinstance(rows[0]["pixel_values"], list)  # H, W differ per image
        assert rows[1]["pixel_values"].shape == (1, 3, 12, 16)
        segs = [torch.ones(2, 3, 4, 4), torch.zeros(1, 3, 4, 4)]  # two segments on pack dim 1
        b = build_batch("idefics3", [RowPlan(3, images=[2]), RowPlan(3)])
        b = b.replace(pixel_values=PackedTensor.from_rows([segs, None], pack_dim=1)).without(
            "pixel_attention_mask")
        o = b.to_row_dicts()
        assert isinstance(o["multi_modal_inputs"][0]["pixel_values"], list)
        assert o.from_row_dicts() == b
        one = build_batch("idefics3", [RowPlan(3, images=[2])]).to_row_dicts()
        assert one["multi_modal_inputs"][0]["pixel_values"].shape == (1, 2, 3, 4, 4)

    def test_bad_row_dicts_name_field_row_and_key(self):
        o = qwen().to_row_dicts()
        rows = o["multi_modal_inputs"].rows
        bad = [dict(r) if r else r for r in rows]
        bad[1] = {**bad[1], "image_grid_thw": torch.tensor([[1, 2, 5]])}
        with pytest.raises(ValueError, match=r"'multi_modal_inputs' row 1 key 'pixel_values': "
                                             r"grid \[\[1, 2, 5\]\] gives 10 rows"):
            o.replace(multi_modal_inputs=ObjectColumn(bad)).from_row_dicts()
        for row, error, message in [
            ({"bogus": torch.ones(1)}, KeyError, "row 2 has key 'bogus', which is not registered"),
            ({"mm_token_type_ids": torch.ones(1, 3, dtype=torch.long)}, ValueError,
             "row 2 has key 'mm_token_type_ids', a per_token field"),
            ({"image_grid_thw": torch.ones(1, 3)}, TypeError,
             "row 2 key 'image_grid_thw' has dtype torch.float32"),
        ]:
            with pytest.raises(error, match=message):
                o.replace(multi_modal_inputs=ObjectColumn(rows[:2] + [row] + rows[3:])).validate()
        both = o.replace(image_grid_thw=qwen()["image_grid_thw"])
        with pytest.raises(ValueError, match="'image_grid_thw' is both a batch field and a key"):
            both.validate()
        with pytest.raises(ValueError, match="is a per_token field, not an object field"):
            qwen().to_row_dicts("input_ids")
        with pytest.raises(ValueError, match="already has object field"):
            o.to_row_dicts()
        with pytest.raises(TypeError, match="object field 'multi_modal_inputs' must be an "
                                            "ObjectColumn, got list"):
            o.replace(multi_modal_inputs=list(rows)).validate()
        idefics = build_batch("idefics3", [RowPlan(3, images=[2])]).to_row_dicts()
        flat = ObjectColumn([{"pixel_values": torch.ones(2, 3, 4, 4)}])
        with pytest.raises(ValueError, match=r"a pack_dim 1 value is \[1, tiles, ...\]"):
            idefics.replace(multi_modal_inputs=flat).from_row_dicts()


class TestBatchAlgebra:
    @pytest.mark.parametrize("sizes", [[4], [1, 3], [0, 2, 0, 2], [3, 1]])
    def test_split_restores(self, sizes):
        for b in (qwen(), qwen().to_row_dicts()):
            parts = b.split(sizes)
            assert [len(p) for p in parts] == sizes
            assert Batch.concat(parts) == b
            assert parts[-1] == b.slice(4 - sizes[-1], 4)

    def test_split_rejects_bad_sizes(self):
        for sizes in ([1, 2], [5, -1], [2, 3]):
            with pytest.raises(ValueError, match="must be >= 0 and sum to the batch size 4"):
                qwen().split(sizes)

    @pytest.mark.parametrize("n", [1, 2, 3, 4])
    @pytest.mark.parametrize("seed", [None, 0, 7])
    def test_micro_batches(self, n, seed):
        b = build_batch("qwen2_vl", ragged(7), position_ids=4).to_row_dicts()
        mbs = b.micro_batches(n, shuffle_seed=seed)
        sizes = [len(idx) for idx, _ in mbs]
        assert len(mbs) == n and max(sizes) - min(sizes) <= 1 and sorted(sizes, reverse=True) == sizes
        flat = [i for idx, _ in mbs for i in idx]
        assert sorted(flat) == list(range(7))
        if seed is None:
            assert flat == list(range(7))
        for idx, mb in mbs:
            assert mb == b.select(idx)
        inverse = sorted(range(7), key=flat.__getitem__)
        assert Batch.concat([mb for _, mb in mbs]).select(inverse) == b
        assert [i for i, _ in b.micro_batches(n, seed)] == [i for i, _ in mbs]  # deterministic

    def test_micro_batches_shuffle_depends_on_the_seed(self):
        b = build_batch("qwen2_vl", ragged(8))
        orders = {tuple(i for idx, _ in b.micro_batches(2, s) for i in idx) for s in range(4)}
        assert len(orders) > 1 and tuple(range(8)) not in orders or len(orders) > 2
        for n in (0, 9):
            with pytest.raises(ValueError, match=f"micro-batch count n={n} must be in 1..8"):
                b.micro_batches(n)

    def test_concat_rejects_mixed_families_and_holders(self):
        q = qwen()
        with pytest.raises(ValueError, match="cannot concat batches of families"):
            Batch.concat([q, build_batch("qwen2_5_vl", default_plan("qwen2_5_vl")).without(
                "second_per_grid_ts")])
        with pytest.raises(KeyError, match="cannot concat batches with fields"):
            Batch.concat([q, q.to_row_dicts()])


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3", "llava_next"])
def test_row_dicts_are_what_the_processor_emits_per_sample(family):
    """verl's multi_modal_inputs / OpenRLHF's mm_train_inputs hold the processor's output for one
    sample: our per-row dicts of a real processor batch equal exactly that, except where one
    tensor cannot give the images back (LLaVA-NeXT images of differing patch counts: a list)."""
    from rlconform.fixtures.families import build_family
    from rlconform.fixtures.images import make_prompts
    from rlconform.fixtures.processed import to_batch

    fam = build_family(family)
    prompts, images, _ = make_prompts(3, [2, 1, 0], seed=0)
    batch = to_batch(fam, dict(fam.process(prompts, images)), [len(i) for i in images])
    rows = batch.to_row_dicts("mm_train_inputs")["mm_train_inputs"]
    assert rows[2] is None
    for i in (0, 1):
        one = dict(fam.process([prompts[i]], [images[i]]))
        for key, value in rows[i].items():
            if isinstance(value, list):
                assert family == "llava_next" and i == 0, (family, i, key)
                assert torch.equal(PackedTensor.from_rows([value]).as_tensor(), one[key])
                continue
            assert value.shape == one[key].shape and torch.equal(value, one[key]), (i, key)
