"""verl 0.9.1: collecting ranks' `BatchMeta`s into a `KVBatchMeta` drops every row's tags.

verl's collect (`single_controller/base/decorator.py` `_concat_data_proto_or_future` ->
`BatchData(list).concat()` in verl/protocol.py) joins the TransferQueue `BatchMeta`s the DP
ranks return with `BatchMeta.concat`, then turns the result into a `KVBatchMeta` with
`batch_meta2kv_batch_meta` (verl/utils/transferqueue_utils.py, `async_batch_meta2kv_batch_meta`).
That function builds `tags=[{}] * meta.size`: each row's `custom_meta` (where the driver's tags,
such as `seq_len`, travel) is discarded, and every row gets the same dict object. verl's own
`tqbridge` re-assigns `tags` after the same call; `BatchData.concat` does not.

The TransferQueue controller's global-index -> key lookup is replaced by a stub below so that no
Ray cluster is needed; verl's code runs unchanged.

Run: python verl-collect-drops-tags.py  (needs verl 0.9.1, TransferQueue 0.1.11, tensordict)

Expected: tags [{'seq_len': 5}, {'seq_len': 3}, {'seq_len': 7}] (the ranks' custom_meta, in
order), one dict per row.
Actual (verl 0.9.1, TransferQueue 0.1.11): tags [{}, {}, {}]; writing one row's tag writes all.
"""

import transfer_queue as tq
import verl.utils.transferqueue_utils as tqu
from transfer_queue import BatchMeta
from verl.protocol import BatchData


class StubClient:  # the controller's lookup: global index -> key
    async def async_kv_retrieve_keys(self, global_indexes, partition_id):
        return [f"k{i}" for i in global_indexes]


tq.get_client = lambda: StubClient()
tqu.TQ_INITIALIZED = True  # skip tq.init() (it would start Ray)

rank0 = BatchMeta(global_indexes=[0, 1], partition_ids=["train"] * 2,
                  custom_meta=[{"seq_len": 5}, {"seq_len": 3}])
rank1 = BatchMeta(global_indexes=[2], partition_ids=["train"], custom_meta=[{"seq_len": 7}])
expected = rank0.get_all_custom_meta() + rank1.get_all_custom_meta()

collected = BatchData([rank0, rank1]).concat()  # verl's collect of the two ranks' outputs
print(f"{type(collected).__name__} keys {collected.keys}")
print(f"expected tags {expected}")
print(f"actual tags   {collected.tags}")
collected.tags[0]["seq_len"] = 9
print(f"after tags[0]['seq_len'] = 9: {collected.tags}")
