"""The verl adapter's own tests, and verl 0.9.1's defects pinned as strict xfails.

Each defect the expectations file (conformance/expectations/verl.toml) waives, and each one no
clause reaches yet, is shown here on the smallest input, calling verl's function directly: a fix
upstream turns the xfail into a failure to act on (drop the pin and the waiver). The tests that
need TransferQueue share one session (Ray + one SimpleStorage unit, ~10-30 s to start).
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch

for _mod in ("verl.protocol", "tensordict", "transfer_queue", "ray"):
    if os.environ.get("CI"):  # CI installs the verl backend (nox -s tests): never skip there
        importlib.import_module(_mod)
    else:
        pytest.importorskip(_mod, reason=f"the verl backend needs {_mod}")

from rlconform.conformance.backend import load_backend  # noqa: E402
from rlconform.conformance.backends import requirements  # noqa: E402
from rlconform.conformance.backends import verl as adapter  # noqa: E402
from rlconform.fixtures.synthetic import RowPlan, build_batch, default_plan  # noqa: E402

DENSIFY = ("list_of_dict_to_tensordict stacks per-sample tensors dense whenever they share a "
           "shape (one row, or equal lengths); verl's readers need them jagged "
           "(https://github.com/verl-project/verl/pull/7661)")


def _media(n_rows: int) -> np.ndarray:
    out = np.empty(n_rows, dtype=object)
    out[:] = [{"pixel_values": torch.full((4 * (i + 1), 6), float(i)),
               "image_grid_thw": torch.tensor([[1, 2, 2 * (i + 1)]])} if i % 2 == 0 else {}
              for i in range(n_rows)]
    return out


# -- declarations --------------------------------------------------------------------------------
def test_backend_declares_what_it_wraps_and_why_not_the_rest():
    backend = load_backend("verl")
    assert backend.surfaces == ("codec", "meta", "batch_ops")
    assert set(backend.notes) == {"transport", "trainer", "rollout", "truncation"}
    assert "truncation" not in backend.capabilities and "padding" in backend.capabilities
    assert not hasattr(adapter.VerlBatchOps, "truncate"), "verl has none: declared missing"
    assert backend.describe()["notes"] == backend.notes
    reqs = requirements("verl")
    assert "--no-deps verl==0.9.1" in reqs and "tensordict==0.10.0" in reqs


# -- codec: verl's rollout write -------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3", "idefics3", "llava_next"])
def test_codec_roundtrip_of_ragged_rows(family):
    codec = adapter.VerlCodec()
    batch = build_batch(family, default_plan(family))
    wire = codec.encode(batch)
    assert wire.columns["input_ids"].is_nested, "ragged rows must travel jagged"
    assert adapter.MEDIA in wire.columns, "media travel as verl's per-sample dicts"
    got = codec.decode(wire)
    assert batch.first_difference(got) is None and set(got.fields) == set(batch.fields)


def test_codec_rows_enter_as_agent_loop_outputs():
    """Each row is an AgentLoopOutput whose as_dict() verl completes: the prompt is the tokens
    before the first loss token, the response carries the loss mask and the engine's logprobs."""
    batch = build_batch("qwen2_vl", [RowPlan(6, images=[1]), RowPlan(9), RowPlan(1)])
    wire = adapter.VerlCodec().encode(batch)
    assert [t["prompt_len"] for t in wire.tags] == [3, 4, 0]
    assert [t["response_len"] for t in wire.tags] == [3, 5, 1]
    responses = wire.columns["responses"].unbind(0)
    assert responses[1].tolist() == batch["input_ids"][1, 4:9].tolist()
    logprobs = wire.columns["rollout_log_probs"].unbind(0)
    assert logprobs[0].tolist() == batch["generation_logprobs"][0, 3:6].tolist()
    assert "loss_mask" in wire.columns and "metrics" in wire.columns
    assert batch.first_difference(adapter.VerlCodec().decode(wire)) is None


def test_codec_takes_the_prompt_split_the_batch_carries():
    batch = build_batch("qwen2_vl", [RowPlan(6, images=[1]), RowPlan(9)])
    batch = batch.replace(prompt_lengths=torch.tensor([2, 4]))
    codec = adapter.VerlCodec()
    wire = codec.encode(batch)
    assert [t["prompt_len"] for t in wire.tags] == [2, 4]
    assert batch.first_difference(codec.decode(wire)) is None


def test_codec_without_rollout_fields_brings_none_back():
    batch = build_batch("qwen2_vl", [RowPlan(6), RowPlan(9)]).without(
        "token_mask", "generation_logprobs")
    codec = adapter.VerlCodec()
    wire = codec.encode(batch)
    assert [t["prompt_len"] for t in wire.tags] == [0, 0]
    got = codec.decode(wire)
    assert set(got.fields) == set(batch.fields) and batch.first_difference(got) is None


def test_codec_a_prompt_logprob_does_not_travel():
    """verl's agent loop output holds logprobs of the response only: a value on a prompt token
    is not carried (what a rollout writes there is zero)."""
    batch = build_batch("qwen2_vl", [RowPlan(6), RowPlan(9)])
    gl = batch["generation_logprobs"].clone()
    gl[1, 0] = -0.5
    codec = adapter.VerlCodec()
    got = codec.decode(codec.encode(batch.replace(generation_logprobs=gl)))
    assert float(got["generation_logprobs"][1, 0]) == 0.0


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "AgentLoopOutput.response_logprobs is a list of Python floats: a float32 logprob reaches "
    "it through a double and as_dict() makes it float32 again, which quiets a signalling NaN "
    "(0x7f800001 comes back 0x7fc00001)"))
def test_agent_loop_output_keeps_a_logprob_bit_for_bit():
    output, metrics = adapter._agent_loop_classes()
    snan = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)
    out = output(prompt_ids=[1], response_ids=[2], response_mask=[1],
                 response_logprobs=snan.tolist(), metrics=metrics()).as_dict()
    got = out["rollout_log_probs"].view(torch.int32).tolist()
    assert got == [0x7F800001], f"came back {[hex(g) for g in got]}"


@pytest.mark.xfail(strict=True, raises=TypeError, reason=DENSIFY)
def test_codec_one_row_batch_stays_jagged():
    codec = adapter.VerlCodec()
    batch = build_batch("qwen2_vl", [RowPlan(5, images=[1])])
    codec.decode(codec.encode(batch))


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=DENSIFY)
def test_list_of_dict_to_tensordict_keeps_equal_length_rows_jagged():
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    td = list_of_dict_to_tensordict([{"input_ids": torch.arange(3)},
                                     {"input_ids": torch.arange(3) + 7}])
    assert td["input_ids"].is_nested, f"stacked dense {list(td['input_ids'].shape)}"


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="list_of_dict_to_tensordict takes its keys from the first "
                   "dict only: a key that only later rows carry is dropped without an error")
def test_list_of_dict_to_tensordict_keeps_every_key():
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    td = list_of_dict_to_tensordict([{"input_ids": torch.arange(3)},
                                     {"input_ids": torch.arange(5), "rollout_log_probs": torch.ones(5)}])
    assert "rollout_log_probs" in td.keys(), f"keys {sorted(td.keys())}"


# -- DataProto ----------------------------------------------------------------------------------
def _proto(n_rows: int = 4):
    from verl.protocol import DataProto

    return DataProto.from_dict(tensors={"input_ids": torch.arange(n_rows * 3).view(n_rows, 3)},
                               non_tensors={adapter.MEDIA: _media(n_rows)})


def test_dataproto_algebra_keeps_media_dicts_with_their_rows():
    from verl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

    p = _proto(4)

    def rows(q):
        return [float(d["pixel_values"][0, 0]) if d else None
                for d in q.non_tensor_batch[adapter.MEDIA]]

    assert rows(DataProto.concat(p.chunk(2))) == rows(p)
    assert rows(p.select_idxs([3, 0, 2])) == [None, 0.0, 2.0]
    assert rows(p.repeat(2, interleave=True)) == [0.0, 0.0, None, None, 2.0, 2.0, None, None]
    padded, pad = pad_dataproto_to_divisor(p, 3)
    assert (len(padded), pad) == (6, 2) and rows(unpad_dataproto(padded, pad)) == rows(p)
    assert rows(padded)[4:] == rows(p)[:2], "padding repeats the first rows, media included"


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="DataProto's algebra indexes numpy object arrays: a result's media "
                   "dicts are the source's objects, so an in-place change reaches both batches")
def test_dataproto_select_does_not_share_media_dicts():
    p = _proto(4)
    out = p.select_idxs([2, 0])
    out.non_tensor_batch[adapter.MEDIA][0].pop("pixel_values")
    assert "pixel_values" in p.non_tensor_batch[adapter.MEDIA][2], \
        "popping a key from the selected row removed it from the source row"


@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="DataProto.union compares non-tensor columns with _deep_equal, which "
                   "compares dicts with ==: equal media dicts holding different tensor objects "
                   "raise 'Boolean value of Tensor with more than one value is ambiguous'")
def test_dataproto_union_of_equal_media_columns():
    a, b = _proto(4), _proto(4)  # equal values, distinct tensor objects (as after a Ray hop)
    a.union(b)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="DataProto (from_dict, check_consistency) checks only "
                   "dim 0: a per-token field one column short of input_ids is accepted")
def test_dataproto_rejects_misaligned_per_token_field():
    from verl.protocol import DataProto

    try:
        DataProto.from_dict(tensors={"input_ids": torch.zeros(2, 5, dtype=torch.long),
                                     "mm_token_type_ids": torch.zeros(2, 4, dtype=torch.long)}
                            ).check_consistency()
    except (AssertionError, ValueError) as exc:
        assert "mm_token_type_ids" in str(exc), f"the error does not name the field: {exc}"
    else:
        raise AssertionError("mm_token_type_ids [2, 4] next to input_ids [2, 5] was accepted")


# -- padding removal, micro-batches, stage inputs -------------------------------------------------
def _no_padding_td():
    from verl.protocol import DataProto
    from verl.workers.utils.padding import left_right_2_no_padding

    lens = [5, 3, 4, 2]
    mask = (torch.arange(5)[None] < torch.tensor(lens)[:, None]).long()
    pos = (torch.arange(5)[None, None] + 10 * torch.arange(4)[None, :, None]).expand(4, 4, 5)
    p = DataProto.from_dict(tensors={"input_ids": torch.arange(20).view(4, 5) * mask,
                                     "attention_mask": mask, "response_mask": mask,
                                     "position_ids": pos * mask[:, None]},
                            non_tensors={adapter.MEDIA: _media(4)})
    return left_right_2_no_padding(p.to_tensordict()), lens


def test_no_padding_micro_batches_keep_mrope_rows_and_media():
    from verl.utils import tensordict_utils as tu
    from verl.utils.seqlen_balancing import rearrange_micro_batches, restore_dynamic_batch

    td, lens = _no_padding_td()
    assert [tuple(r.shape) for r in td["position_ids"].unbind()] == [(4, n) for n in lens]
    micro, idx = rearrange_micro_batches(td, max_token_len=14, min_num_micro_batch=2)
    assert sorted(i for part in idx for i in part) == [0, 1, 2, 3]
    for mb, part in zip(micro, idx):
        assert [r.shape[-1] for r in mb["position_ids"].unbind()] == [lens[i] for i in part]
        assert [bool(d) for d in tu.get(mb, adapter.MEDIA)] == [i % 2 == 0 for i in part]
    joined = tu.concat_tensordict(micro)
    restored = restore_dynamic_batch(joined["position_ids"], idx)
    assert all(torch.equal(a, b) for a, b in zip(restored.unbind(), td["position_ids"].unbind()))


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="chunk_tensordict rebuilds 3-D jagged position_ids with "
                   "nested_tensor_from_tensor_list, which sets _ragged_idx=2 after building the "
                   "tensor: rows unbind right, but .shape says [rows, j, total_tokens]")
def test_chunked_mrope_position_ids_report_their_shape():
    from verl.utils.tensordict_utils import chunk_tensordict

    td, _ = _no_padding_td()
    part = chunk_tensordict(td, 2)[0]["position_ids"]
    assert part.shape[1] == 4, f"shape {part.shape}"


@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="extract_multi_modal_inputs torch.cat()s a dict key's rows on dim 0: "
                   "Idefics3/SmolVLM pixel_values [1, tiles, ...] with differing tile counts raise")
def test_stage_inputs_of_dim1_media_with_differing_tiles():
    from verl.utils.model import extract_multi_modal_inputs

    got = extract_multi_modal_inputs([{"pixel_values": torch.ones(1, 2, 3, 4, 4)},
                                      {"pixel_values": torch.ones(1, 3, 3, 4, 4)}])
    assert got["pixel_values"].shape == (2, 3, 3, 4, 4)


@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="a per-token map kept in the media dict (Gemma3 token_type_ids, as the "
                   "processor emits it) is torch.cat()ed on dim 0: rows of different lengths raise")
def test_stage_inputs_carry_a_per_token_map_of_ragged_rows():
    from verl.utils.model import extract_multi_modal_inputs

    got = extract_multi_modal_inputs([{"token_type_ids": torch.ones(1, 5, dtype=torch.long)},
                                      {"token_type_ids": torch.ones(1, 7, dtype=torch.long)}])
    assert got["token_type_ids"].shape == (2, 7)


def test_stage_inputs_concatenate_rows_in_order():
    from verl.utils.model import extract_multi_modal_inputs

    got = extract_multi_modal_inputs(list(_media(5)))
    assert got["pixel_values"][:, 0].unique_consecutive().tolist() == [0.0, 2.0, 4.0]
    assert got["image_grid_thw"][:, 2].tolist() == [2, 6, 10]


# -- the adapter's batch_ops on DataProto (what its waived clauses still check) ---------------------
@pytest.mark.parametrize("form", ["packed", "multi_modal_inputs"])
def test_batch_ops_algebra_and_micro_batches_keep_rows(form):
    ops = adapter.VerlBatchOps()
    batch = build_batch("qwen2_5_vl", default_plan("qwen2_5_vl") * 2, media_form=form)
    assert batch["position_ids"].dim() == 3, "the fixture carries M-RoPE position_ids"
    for idx in ([7, 0, 2, 2, 5], []):
        assert batch.select(idx).first_difference(ops.select(batch, idx)) is None
    parts = ops.split(batch, [3, 0, 5])
    assert [len(p) for p in parts] == [3, 0, 5]
    assert batch.first_difference(ops.concat([parts[0], parts[2]])) is None
    micro = ops.micro_batches(batch, 3)
    assert sorted(i for idx, _ in micro for i in idx) == list(range(8)) and len(micro) == 3
    for idx, mb in micro:
        assert batch.select(idx).first_difference(mb) is None, f"micro-batch {idx}"


# -- meta: dispatch and collect through TransferQueue ----------------------------------------------
@pytest.fixture(scope="module")
def tq_session():
    with adapter.verl_session():
        yield


def _meta(n: int):
    return adapter.VerlBatchMeta(
        "rollout", [f"uid{i // 2}_g{i % 2}" for i in range(n)], ["input_ids"],
        [3 + (i * 5) % 7 for i in range(n)],
        [{"row": i, "pixel_values": {"shapes": [[4 * (i + 1), 1176]]}} for i in range(n)],
        {"step": 3})


def test_dispatch_gives_balanced_shards_with_their_tags(tq_session):
    m = _meta(8)
    shards, inverse = m.shard_for_dp(4)
    assert [len(s) for s in shards] == [2, 2, 2, 2]
    by_key = dict(zip(m.keys, m.tags))
    for s in shards:
        assert all(by_key[k] == t for k, t in zip(s.keys, s.tags)), "a rank lost a row's tag"
        assert s.extra == {"step": 3}
    tokens = [sum(s.seq_lens) for s in shards]
    assert max(tokens) - min(tokens) <= max(m.seq_lens)
    assert adapter.VerlBatchMeta.concat(shards).subset(inverse).keys == m.keys


def test_dp_shards_need_a_divisible_batch(tq_session):
    with pytest.raises(AssertionError, match="% 3 != 0"):
        _meta(4).shard_for_dp(3)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="BatchData(list of rank BatchMetas).concat() converts with "
                   "transferqueue_utils.batch_meta2kv_batch_meta, which sets tags=[{}] * size: every "
                   "row's tag is dropped (and all rows share one dict)")
def test_collect_keeps_each_rows_tag(tq_session):
    m = _meta(4)
    shards, inverse = m.shard_for_dp(2)
    back = adapter.VerlBatchMeta.concat(shards).subset(inverse)
    assert back.tags == m.tags, f"collected tags {back.tags}"


# -- the declared data path is the path the adapter takes ---------------------------------------------
def _from_source(counts):
    """Count the trainer methods the adapter compiles from verl's trainer_base.py and the agent
    loop's as_dict it compiles from agent_loop.py (neither module imports without verl's GPU or
    rollout stack)."""
    import contextlib
    from unittest import mock

    real = adapter._trainer_method
    output, metrics = adapter._agent_loop_classes()

    class Counted(output):
        def as_dict(self):
            counts["verl.experimental.agent_loop.agent_loop.AgentLoopOutput.as_dict"] += 1
            return super().as_dict()

    def counted(name, namespace):
        fn = real(name, namespace)
        key = f"verl.trainer.ppo.v1.trainer_base.PPOTrainer.{name}"

        def run(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)

        return run

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(adapter, "_trainer_method", counted))
    stack.enter_context(mock.patch.object(adapter, "_agent_loop_classes",
                                          lambda: (Counted, metrics)))
    return stack


def _run_every_surface():
    batch = build_batch("qwen2_5_vl", default_plan("qwen2_5_vl") * 2)
    codec = adapter.VerlCodec()
    assert batch.first_difference(codec.decode(codec.encode(batch))) is None
    ops = adapter.VerlBatchOps()
    ops.validate(batch)
    ops.pad_to(batch, batch.seq_len() + 2)
    ops.multimodal_inputs(batch, "train")
    ops.select(batch, [1, 0])
    ops.concat(ops.split(batch, [3, 5]))
    text = build_batch("qwen2_vl", [RowPlan(4), RowPlan(6)])  # media rows hit verl's _deep_equal
    ops.union(text, text.select([0, 1]))
    ops.micro_batches(batch, 2)
    shards, inverse = _meta(4).shard_for_dp(2)
    adapter.VerlBatchMeta.concat(shards).subset(inverse)


def test_every_entered_step_of_the_declared_path_is_called(tq_session):
    from _data_path import assert_entered

    counts = assert_entered(load_backend("verl"), _run_every_surface, _from_source)
    assert counts["verl.trainer.ppo.v1.trainer_base.PPOTrainer._balance_batch"] == 1


def test_a_declared_entered_step_the_adapter_never_calls_fails():
    import dataclasses

    from _data_path import assert_entered

    from rlconform.conformance.backend import PathStep

    backend = dataclasses.replace(load_backend("verl"), data_path=(
        PathStep("verl.workers.utils.padding.left_right_2_no_padding", "entered"),))
    with pytest.raises(AssertionError, match="left_right_2_no_padding"):
        assert_entered(backend, lambda: adapter.VerlBatchOps().validate(
            build_batch("qwen2_vl", default_plan("qwen2_vl"))))


def test_balance_batch_is_verls_own():
    """The balancing runs trainer_base.py's `_balance_batch`: the same partitions as verl's
    `get_seqlen_balanced_partitions(equal_size=True)` over the tags' seq_len workloads."""
    from transfer_queue import KVBatchMeta
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    lens = [3, 9, 4, 8, 5, 7]
    meta = KVBatchMeta(keys=[f"k{i}" for i in range(6)], tags=[{"seq_len": n} for n in lens],
                       partition_id="p", fields=["input_ids"], extra_info={})
    out = adapter._balance_batch(meta, 3)
    parts = get_seqlen_balanced_partitions(calculate_workload(torch.tensor(lens)).tolist(),
                                           k_partitions=3, equal_size=True)
    assert out.keys == [f"k{j}" for p in parts for j in p]


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="DataProto.from_dict builds a "
                   "non-tensor column with np.array(rows, dtype=object): rows that are tensors "
                   "of one shape are unpacked into a 2-D array of scalars, so row i is no "
                   "longer the tensor the caller gave (docs/upstream/verl-from-dict-tensor-rows.py)")
def test_from_dict_keeps_tensor_rows():
    from verl.protocol import DataProto

    rows = [torch.arange(3), torch.arange(3) + 10]
    p = DataProto.from_dict(tensors={"input_ids": torch.zeros(2, 3, dtype=torch.long)},
                            non_tensors={"routed": rows})
    col = p.non_tensor_batch["routed"]
    assert col.shape == (2,) and all(isinstance(r, torch.Tensor) for r in col), \
        f"column of shape {col.shape}, row 0 a {type(col[0]).__name__}"
