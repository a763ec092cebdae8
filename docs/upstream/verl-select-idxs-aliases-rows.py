"""verl 0.9.1: `DataProto.select_idxs` returns the source's per-sample dict objects.

`select_idxs` (verl/protocol.py) copies each tensor (`tensor[idxs]`, advanced indexing) but
selects each non-tensor column with `val[idxs_np]`, which for a numpy object array copies only
the references: row i of the result's `multi_modal_inputs` is the source's dict object. Adding
or popping a key on the result's row (verl's agent loop pops `mm_token_type_ids` from a media
dict, `_compute_position_ids`) changes the source's row too, even when every row is selected in
order. The result's tensors do not alias the source, so the two halves of one result behave
differently.

Run: python verl-select-idxs-aliases-rows.py  (needs verl 0.9.1, torch, numpy, tensordict)

Expected: the selected batch shares nothing mutable with its source: after writing to the
result, the source's input_ids and media dict are unchanged.
Actual (verl 0.9.1): input_ids unchanged, but the source's row 0 dict gained the key added to
the result's row 0 and lost the key popped from it (result row is source row: True).
"""

import torch
from verl.protocol import DataProto

src = DataProto.from_dict(
    tensors={"input_ids": torch.arange(6).view(3, 2)},
    non_tensors={"multi_modal_inputs": [{"pixel_values": torch.ones(2, 2),
                                         "mm_token_type_ids": torch.zeros(1, 2)} for _ in range(3)]})
out = src.select_idxs([0, 1, 2])  # every row, in order
out.batch["input_ids"][0, 0] = 99
out.non_tensor_batch["multi_modal_inputs"][0]["added"] = 1
out.non_tensor_batch["multi_modal_inputs"][0].pop("mm_token_type_ids")
print(f"source input_ids[0]: {src.batch['input_ids'][0].tolist()} (result wrote 99)")
print(f"source row 0 keys: {sorted(src.non_tensor_batch['multi_modal_inputs'][0])}")
print("expected keys:     ['mm_token_type_ids', 'pixel_values']")
print(f"result row is source row: "
      f"{out.non_tensor_batch['multi_modal_inputs'][0] is src.non_tensor_batch['multi_modal_inputs'][0]}")
