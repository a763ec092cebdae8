"""verl 0.9.1: `repeat`, `concat`, `select_idxs` and dynamic micro-batches share per-sample dict rows.

DataProto's non-tensor columns are numpy object arrays. `DataProto.repeat` (`np.repeat` /
`np.tile`), `DataProto.concat` (`np.concatenate`), `DataProto.select_idxs` (`val[idxs]`) in
verl/protocol.py, and `seqlen_balancing.prepare_dynamic_batch` (`value[batch_idx]`,
verl/utils/seqlen_balancing.py) all copy references only: the result's `multi_modal_inputs`
rows are the source's dict objects, and `repeat(n)`, a repeated index or concat of one batch
twice makes several rows of one result the same dict. The tensors of repeat/concat/select_idxs
are copies and prepare_dynamic_batch deep-copies meta_info, so only the per-sample dicts leak.
A key popped or added on one row (as the agent loop does to a media dict,
`_compute_position_ids`) reaches the source and every sibling row. (`DataProto.chunk` shares
rows the same way, but its tensors are views too, so it is left out here.)

Run: python verl-batch-ops-share-dict-rows.py  (needs verl 0.9.1, torch, numpy, tensordict)

Expected: for every operation, mutating the result's row 0 dict leaves the source (and the
result's other rows) unchanged: "source changed: False".
Actual (verl 0.9.1): "source changed: True" for every operation; repeat(2), select_idxs([0, 0])
and concat([p, p]) also hold one dict object in two of their rows.
"""

import torch
from verl.protocol import DataProto
from verl.utils.seqlen_balancing import prepare_dynamic_batch


def source():
    return DataProto.from_dict(
        tensors={"input_ids": torch.ones(2, 3, dtype=torch.long),
                 "attention_mask": torch.ones(2, 3, dtype=torch.long)},
        non_tensors={"multi_modal_inputs": [{"pixel_values": torch.full((2, 2), float(i))}
                                            for i in range(2)]})


ops = {"repeat(2)": lambda p: p.repeat(2),
       "select_idxs([0, 0])": lambda p: p.select_idxs([0, 0]),
       "concat([p, p])": lambda p: DataProto.concat([p, p]),
       "prepare_dynamic_batch micro-batch 0": lambda p: prepare_dynamic_batch(
           p, max_token_len=3, min_num_micro_batch=2)[0][0]}
for label, op in ops.items():
    src = source()
    out = op(src)
    rows = out.non_tensor_batch["multi_modal_inputs"]
    rows[0]["scribbled"] = True
    changed = any("scribbled" in r for r in src.non_tensor_batch["multi_modal_inputs"])
    shared = len({id(r) for r in rows}) < len(rows)
    print(f"{label}: source changed: {changed}; two result rows one object: {shared}")
