"""Transport clauses: the data plane returns what was put, in the layout it was put."""

from __future__ import annotations

import uuid

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from rlconform.fixtures.strategies import batches
from rlconform.fixtures.synthetic import RowPlan, build_batch, default_plan, media_families
from rlconform.reference_impl.codec import ReferenceCodec, WireBatch, jagged

from ._check import (
    assert_batch_equal,
    assert_columns_equal,
    column_difference,
    expect_stored,
    keys_for,
    shared_container,
)
from ._store_model import shared_between_rows

FAMILIES = media_families()


def _partition() -> str:
    return f"p-{uuid.uuid4().hex[:8]}"


def _block(n: int, base: float = 0.0) -> torch.Tensor:
    """A plain dense (n, 2) column: clauses about tags, merge, clear and aliasing use columns
    every layout handles, so each clause fails only for the defect it is about (1-D columns and
    empty jagged rows are DP-LAYOUT's and DP-ROUNDTRIP's business)."""
    return torch.arange(2 * n, dtype=torch.float32).reshape(n, 2) + base


def _roundtrip_columns(transport, batch, pixel_dtype=None):
    wire = ReferenceCodec(pixel_dtype).encode(batch)
    keys, part = keys_for(len(batch)), _partition()
    transport.put(part, keys, wire.columns, wire.tags)
    cols, tags = transport.get(part, keys, select_fields=list(wire.columns))
    return wire, cols, tags


@pytest.mark.clause("DP-ROUNDTRIP")
@pytest.mark.parametrize("family", FAMILIES)
def test_family_columns_roundtrip(transport, family):
    wire, cols, tags = _roundtrip_columns(transport, build_batch(family, default_plan(family)))
    assert_columns_equal(wire.columns, cols)
    assert tags == wire.tags, "tags came back different from what was put"


@pytest.mark.clause("DP-ROUNDTRIP")
@pytest.mark.parametrize("family", FAMILIES)
def test_media_free_and_bf16_columns_roundtrip(transport, family):
    """A whole media-free batch, and media cast to bf16 at write, come back exactly."""
    from rlconform.fixtures.synthetic import RowPlan

    free = build_batch(family, [RowPlan(3), RowPlan(5)])
    wire, cols, _ = _roundtrip_columns(transport, free)
    assert_columns_equal(wire.columns, cols)
    wire, cols, _ = _roundtrip_columns(transport, build_batch(family, default_plan(family)),
                                       pixel_dtype=torch.bfloat16)
    assert_columns_equal(wire.columns, cols)


@pytest.mark.clause("DP-ROUNDTRIP")
@given(batch=batches())
def test_property_columns_roundtrip(transport, batch):
    wire, cols, tags = _roundtrip_columns(transport, batch)
    assert_columns_equal(wire.columns, cols)
    assert tags == wire.tags


@pytest.mark.clause("DP-ROUNDTRIP")
@pytest.mark.parametrize("family", FAMILIES)
def test_family_columns_fetched_out_of_order(transport, family):
    """A rank fetches a subset of the keys in an order other than the put order."""
    batch = build_batch(family, default_plan(family) * 2, seed=2)
    wire = ReferenceCodec().encode(batch)
    keys, part = keys_for(len(batch)), _partition()
    transport.put(part, keys, wire.columns, wire.tags)
    idx = [6, 1, 3, 0]
    cols, tags = transport.get(part, [keys[i] for i in idx], select_fields=list(wire.columns))
    assert_columns_equal({n: _rows_of(c, idx) for n, c in wire.columns.items()}, cols)
    assert tags == [wire.tags[i] for i in idx], f"tags of keys {idx} out of step"


def _rows_of(col: torch.Tensor, idx: list[int]) -> torch.Tensor:
    if col.is_nested:
        return torch.nested.nested_tensor([col.unbind()[i] for i in idx], layout=torch.jagged)
    return col[idx]


def _one_row(family: str):
    """A batch of one row (two images, and a video where the family has them)."""
    return build_batch(family, [RowPlan(5, images=[2, 3], videos=[1])], seed=1)


@pytest.mark.clause("DP-ROUNDTRIP")
@pytest.mark.parametrize("family", FAMILIES)
def test_one_row_columns_roundtrip(transport, family):
    wire, cols, tags = _roundtrip_columns(transport, _one_row(family))
    assert_columns_equal(wire.columns, cols)
    assert tags == wire.tags


@pytest.mark.clause("WIRE-TRANSPORT-ROUNDTRIP")
@pytest.mark.parametrize("family", FAMILIES)
def test_one_row_batch_roundtrip_through_transport(transport, codec, family):
    batch = _one_row(family)
    wire = codec.encode(batch)
    keys, part = keys_for(1), _partition()
    transport.put(part, keys, wire.columns, wire.tags)
    cols, tags = transport.get(part, keys, select_fields=list(wire.columns))
    assert_batch_equal(batch, codec.decode(WireBatch(cols, tags)), f"{family}, one row")


@pytest.mark.clause("WIRE-TRANSPORT-ROUNDTRIP")
@given(batch=batches())
def test_property_batch_roundtrip_through_transport(transport, codec, batch):
    wire = codec.encode(batch)
    keys, part = keys_for(len(batch)), _partition()
    transport.put(part, keys, wire.columns, wire.tags)
    cols, tags = transport.get(part, keys, select_fields=list(wire.columns))
    assert_batch_equal(batch, codec.decode(WireBatch(cols, tags)), "after encode/put/get/decode")


@pytest.mark.clause("WIRE-TRANSPORT-ROUNDTRIP")
@pytest.mark.parametrize("family", FAMILIES)
def test_family_batch_roundtrip_through_transport_in_shards(transport, codec, family):
    """Each DP rank fetches its own subset of keys, in its own order."""
    batch = build_batch(family, default_plan(family) * 2)
    wire = codec.encode(batch)
    keys, part = keys_for(len(batch)), _partition()
    transport.put(part, keys, wire.columns, wire.tags)
    for idx in ([0, 2, 4, 6], [7, 5, 3, 1]):
        cols, tags = transport.get(part, [keys[i] for i in idx], select_fields=list(wire.columns))
        want = batch.select(idx)
        want = want.truncate(int(want.seq_lens.max()))  # the wire form pads to the longest row
        assert_batch_equal(want, codec.decode(WireBatch(cols, tags)), f"shard {idx}")


def _layout_columns(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    lens = [0 if i % 3 == 1 else 1 + i for i in range(n)]
    return {
        "input_lengths": torch.arange(n, dtype=torch.long) + 1,  # 1-D (N,)
        "advantages": torch.randn(n, generator=g),  # 1-D float
        "rewards": torch.randn(n, 1, generator=g),  # (N, 1) must stay (N, 1)
        "image_sizes": torch.randn(n, 3, 2, generator=g).to(torch.bfloat16),
        "pixel_values": jagged([torch.randn(k, generator=g) for k in lens], torch.float32),
        "input_ids": jagged([torch.arange(4) for _ in range(n)], torch.long),  # uniform jagged
        "pixel_values_videos": torch.nested.nested_tensor(
            [torch.randn(k, 4, generator=g) for k in lens], layout=torch.jagged),
    }


@pytest.mark.clause("DP-LAYOUT")
@pytest.mark.parametrize("n", [1, 2, 5])
def test_layout_preserved(transport, n):
    cols = _layout_columns(n)
    keys, part = keys_for(n), _partition()
    transport.put(part, keys, cols)
    got, _ = transport.get(part, keys, select_fields=list(cols))
    assert_columns_equal(cols, got)


@pytest.mark.clause("DP-LAYOUT")
def test_layout_preserved_for_a_subset(transport):
    cols = _layout_columns(5)
    keys, part = keys_for(5), _partition()
    transport.put(part, keys, cols)
    got, _ = transport.get(part, [keys[3]], select_fields=list(cols))
    for name, col in cols.items():
        want = col[3:4] if not col.is_nested else torch.nested.nested_tensor(
            [col.unbind()[3]], layout=torch.jagged)
        why = column_difference(name, want, got[name])
        assert why is None, why


@pytest.mark.clause("DP-TAGS")
def test_tags_follow_keys_in_request_order(transport):
    n = 6
    cols = {"rewards": _block(n)}
    tags = [{"row": i, "pixel_values": {"shapes": [[i + 1, 1176]], "pack_dim": 0}}
            for i in range(n)]
    keys, part = keys_for(n), _partition()
    transport.put(part, keys, cols, tags)
    for order in ([5, 0, 3], [1], list(range(n))[::-1]):
        got_cols, got_tags = transport.get(part, [keys[i] for i in order],
                                           select_fields=["rewards"])
        assert len(got_tags) == len(order), f"{len(got_tags)} tags for {len(order)} keys"
        assert got_tags == [tags[i] for i in order], f"tags out of step for order {order}"
        assert got_cols["rewards"][:, 0].tolist() == [2.0 * i for i in order]


@pytest.mark.clause("DP-MISSING")
def test_missing_partition_key_field_raise(transport):
    keys, part = keys_for(3), _partition()
    transport.put(part, keys, {"rewards": _block(3)}, [{}] * 3)
    with pytest.raises(KeyError, match="nope-partition"):
        transport.get("nope-partition", keys, select_fields=["rewards"])
    with pytest.raises(KeyError, match="missing-key"):
        transport.get(part, keys + ["missing-key"], select_fields=["rewards"])
    with pytest.raises(KeyError, match="pixel_values"):
        transport.get(part, keys, select_fields=["rewards", "pixel_values"])


@pytest.mark.clause("DP-MISSING")
def test_select_fields_required(transport):
    keys, part = keys_for(2), _partition()
    transport.put(part, keys, {"advantages": _block(2), "rewards": _block(2, 1.0)})
    with pytest.raises((TypeError, ValueError)):
        transport.get(part, keys)  # no select_fields: must not default to "everything"


@pytest.mark.clause("DP-MERGE")
def test_later_put_merges_columns_and_tags(transport):
    n = 4
    first = {"pixel_values": jagged([torch.randn(4 * (i + 1)) for i in range(n)], torch.float32),
             "image_grid_thw": torch.tensor([[1, 2, 2 * (i + 1)] for i in range(n)])}
    tags = [{"pixel_values": {"shapes": [[4 * (i + 1), 1]], "pack_dim": 0}} for i in range(n)]
    keys, part = keys_for(n), _partition()
    transport.put(part, keys, first, tags)
    rewards = _block(n)
    transport.put(part, keys, {"rewards": rewards}, [{"scored": True}] * n)
    cols, got = expect_stored(lambda: transport.get(part, keys, select_fields=[*first, "rewards"]),
                              "a later put of new columns lost the columns put first")
    assert_columns_equal({**first, "rewards": rewards}, cols)
    assert got == [{**t, "scored": True} for t in tags], "merge lost or changed tags"


@pytest.mark.clause("DP-CLEAR-ISOLATION")
def test_clear_removes_exactly_what_it_names(transport):
    keys = keys_for(4)
    a, b = _partition(), _partition()
    for p, base in ((a, 0.0), (b, 10.0)):
        transport.put(p, keys, {"rewards": _block(4, base)})
    transport.clear(a, [keys[0], keys[2]])
    kept = expect_stored(lambda: transport.list(a),
                         "clear of two keys removed the partition's other keys")
    assert sorted(kept) == sorted([keys[1], keys[3]])
    with pytest.raises(KeyError):
        transport.get(a, [keys[0]], select_fields=["rewards"])
    cols, _ = expect_stored(lambda: transport.get(b, keys, select_fields=["rewards"]),
                            "clear of partition a removed partition b's keys")
    assert torch.equal(cols["rewards"], _block(4, 10.0)), "clear touched partition b"
    transport.clear(a)
    try:
        left = transport.list(a)
    except KeyError:
        left = []
    assert left == [], f"keys {left} survived clear of the partition"
    assert sorted(transport.list(b)) == sorted(keys)


@pytest.mark.clause("DP-CLEAR-ISOLATION")
def test_partitions_are_isolated(transport):
    keys = keys_for(2)
    a, b = _partition(), _partition()
    transport.put(a, keys, {"rewards": _block(2)})
    transport.put(b, keys, {"rewards": _block(2, 100.0)})
    ga, _ = transport.get(a, keys, select_fields=["rewards"])
    gb, _ = transport.get(b, keys, select_fields=["rewards"])
    assert torch.equal(ga["rewards"], _block(2)) and torch.equal(gb["rewards"], _block(2, 100.0))
    with pytest.raises(KeyError):  # a partition nobody wrote holds nothing
        transport.get(_partition(), keys, select_fields=["rewards"])


@pytest.mark.clause("DP-NO-ALIAS")
@given(mutate=st.sampled_from(["caller_after_put", "result_of_get"]))
@example(mutate="caller_after_put")
@example(mutate="result_of_get")
def test_no_aliasing(transport, mutate):
    dense = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    ragged = jagged([torch.ones(2), torch.ones(1), torch.ones(3)], torch.float32)
    want = {"image_sizes": dense.clone(), "pixel_values": ragged.clone()}
    keys, part = keys_for(3), _partition()
    transport.put(part, keys, {"image_sizes": dense, "pixel_values": ragged})
    if mutate == "caller_after_put":
        dense.fill_(-1)
        ragged.values().fill_(-1)
    else:
        got, _ = transport.get(part, keys, select_fields=list(want))
        got["image_sizes"].fill_(-1)
        got["pixel_values"].values().fill_(-1)
    again, _ = transport.get(part, keys, select_fields=list(want))
    assert_columns_equal(want, again)


@pytest.mark.clause("DP-NO-ALIAS")
def test_tags_are_not_aliased(backend, transport):
    """Tags at every depth: the caller's after put, the ones a get returned, and the rows of one
    get that names a key more than once (no two places of its result, tags, an object column's
    dict rows or their tensors, or a column's rows, may be one object or one memory: a stage
    that stamps one row changes its repeat)."""
    import copy

    from rlconform.reference_impl.objects import ObjectColumn

    def tags_of(n):
        # JSON-safe on purpose: whether tuples stay tuples is DP-TAG-VALUES' question
        return [{"shapes": [[i + 1, 2]], "meta": {"ids": [i]}, "t": [i, [i]]} for i in range(n)]

    tags = tags_of(3)
    want = copy.deepcopy(tags)
    assert all(isinstance(t["meta"]["ids"], list) for t in tags), "fixture lost its nesting"
    keys, part = keys_for(3), _partition()
    transport.put(part, keys, {"rewards": _block(3)}, tags)
    tags[0]["shapes"][0][0] = 99
    tags[1]["meta"]["ids"].append(-1)
    tags[2]["t"][1].append(-1)
    tags[0]["new"] = True
    _, got = transport.get(part, keys, select_fields=["rewards"])
    assert got == want, f"mutating the caller's tags after put changed the store: {got}"
    got[0]["shapes"][0][0] = -5
    got[1]["meta"]["ids"].clear()
    got[2]["t"][1].append(7)
    got[0]["fetched"] = 1
    _, again = transport.get(part, keys, select_fields=["rewards"])
    assert again == want, f"mutating the tags a get returned changed the store: {again}"
    cols = {"rewards": _block(3)}
    if "object_columns" in backend.capabilities:
        cols["multi_modal_inputs"] = ObjectColumn(
            [{"pixel_values": [torch.ones(1, 2), torch.zeros(2, 2)]}, None, {}])
    again_part = _partition()
    transport.put(again_part, keys, cols, want)
    asked = [keys[0], keys[1], keys[0], keys[2], keys[0]]
    got = transport.get(again_part, asked, select_fields=list(cols))
    why = shared_container(got, f"get{asked}")
    assert why is None, f"one get handed out a container twice: {why}"
    # tensor memory too: an object row's tensors, a column's rows (a repeated key's row handed
    # out as a view of the same bytes is changed by a stage that writes the other)
    why = shared_between_rows(*got)
    assert why is None, f"get{asked} handed out one memory to two rows: {why}"


@pytest.mark.clause("DP-ROUNDTRIP", "WIRE-TRANSPORT-ROUNDTRIP")
@pytest.mark.parametrize("form", ["multi_modal_inputs", "mm_train_inputs"])
@pytest.mark.parametrize("family", ["qwen3_vl", "idefics3", "nemotron_omni"])
def test_dict_media_and_position_ids_through_transport(transport, codec, family, form):
    """Per-row dict media (flattened `<field>.<key>` columns, None / {} rows on the tags) and
    position_ids [B, 4, S], fetched whole and as a reordered subset."""
    from rlconform.fixtures.synthetic import RowPlan

    plan = default_plan(family) + [RowPlan(2), RowPlan(5, images=[3])]
    batch = build_batch(family, plan, media_form=form, position_ids=4)
    wire = codec.encode(batch)
    keys, part = keys_for(len(batch)), _partition()
    transport.put(part, keys, wire.columns, wire.tags)
    cols, tags = transport.get(part, keys, select_fields=list(wire.columns))
    assert_columns_equal(wire.columns, cols)
    assert tags == wire.tags, "tags (with None / {} object rows) came back different"
    idx = [5, 2, 0]
    cols, tags = transport.get(part, [keys[i] for i in idx], select_fields=list(wire.columns))
    want = batch.select(idx)
    want = want.truncate(int(want.seq_lens.max()))
    assert_batch_equal(want, codec.decode(WireBatch(cols, tags)), f"subset {idx}")


def _object_rows() -> list:
    return [
        {"pixel_values": torch.randn(8, 1176, generator=torch.Generator().manual_seed(0)),
         "image_grid_thw": torch.tensor([[1, 2, 4]])},
        {},
        None,
        {"pixel_values": [torch.ones(1, 3, 4, 8), torch.zeros(1, 3, 8, 4)]},
        {"pixel_values": torch.tensor([[float("nan"), -0.0, 1e-42, -float("inf")]])},
    ]


@pytest.mark.clause("DP-OBJECT")
def test_object_columns_roundtrip_without_aliasing(transport):
    from rlconform.reference_impl.objects import ObjectColumn

    col = ObjectColumn(_object_rows())
    want = col.clone()
    n = len(col)
    keys, part = keys_for(n), _partition()
    transport.put(part, keys, {"multi_modal_inputs": col, "advantages": _block(n)})
    for idx in (list(range(n)), [4, 0, 2], [2], [1]):
        got, _ = transport.get(part, [keys[i] for i in idx],
                               select_fields=["multi_modal_inputs", "advantages"])
        obj = got["multi_modal_inputs"]
        assert isinstance(obj, ObjectColumn), f"object column came back as {type(obj).__name__}"
        why = want.select(idx).first_difference(obj)
        assert why is None, f"keys {idx}: {why}"
    col[0].pop("image_grid_thw")  # the caller mutates its rows after put
    col[0]["pixel_values"].fill_(-1)
    got, _ = transport.get(part, keys, select_fields=["multi_modal_inputs"])
    assert want.first_difference(got["multi_modal_inputs"]) is None, \
        "mutating the caller's rows after put changed what the store returns"
    got["multi_modal_inputs"][3]["pixel_values"].append(torch.ones(1))
    got["multi_modal_inputs"][4]["pixel_values"].fill_(0)
    again, _ = transport.get(part, keys, select_fields=["multi_modal_inputs"])
    why = want.first_difference(again["multi_modal_inputs"])
    assert why is None, f"mutating a fetched object column changed the store: {why}"
    transport.put(part, keys, {"rewards": _block(n, 1.0)})  # a later put merges
    merged, _ = transport.get(part, keys, select_fields=["multi_modal_inputs", "rewards"])
    assert want.first_difference(merged["multi_modal_inputs"]) is None, \
        "a later put of another column changed the object column"


THROUGHPUT_REPEAT = 3


@pytest.mark.clause("DP-ROUNDTRIP")
def test_put_get_throughput_beside_the_reference(transport, record_metric):
    """A realistic Qwen2-VL payload (bf16 patches, 1-3 images a row) put and fetched whole,
    through this transport and through the in-memory reference in the same process: the
    report carries both throughputs (MB/s, median of THROUGHPUT_REPEAT) beside each other; the
    round trip must be exact."""
    import statistics
    import time

    from rlconform.fixtures.synthetic import realistic_qwen_batch
    from rlconform.reference_impl.dataplane import InMemoryDataPlane, jagged_parts

    wire = ReferenceCodec().encode(realistic_qwen_batch(16, 128))
    data = [jagged_parts(c)[0] if c.is_nested else c for c in wire.columns.values()]
    payload = sum(d.numel() * d.element_size() for d in data)
    assert payload > 4e6 and "pixel_values" in wire.columns, "fixture lost its media"
    keys, fields = keys_for(len(wire.tags)), list(wire.columns)

    def rates(store) -> tuple[float, float, dict, list]:
        puts, gets = [], []
        for _ in range(THROUGHPUT_REPEAT):
            part = _partition()
            t0 = time.perf_counter()
            store.put(part, keys, wire.columns, wire.tags)
            t1 = time.perf_counter()
            cols, tags = store.get(part, keys, select_fields=fields)
            t2 = time.perf_counter()
            store.clear(part)
            puts.append(t1 - t0)
            gets.append(t2 - t1)
        mb = payload / 1e6
        return mb / statistics.median(puts), mb / statistics.median(gets), cols, tags

    ref_put, ref_get, _, _ = rates(InMemoryDataPlane())
    put, get, cols, tags = rates(transport)
    record_metric("payload_MB", payload / 1e6)
    record_metric("put_MBps", put)
    record_metric("get_MBps", get)
    record_metric("reference_put_MBps", ref_put)
    record_metric("reference_get_MBps", ref_get)
    assert_columns_equal(wire.columns, cols)
    assert tags == wire.tags, "tags came back different from what was put"
