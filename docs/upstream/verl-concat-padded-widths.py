"""verl 0.9.1: `DataProto.concat` cannot join batches padded to different sequence lengths.

`DataProto.concat` (verl/protocol.py) joins the batches' TensorDicts with
`torch.cat(batch_lst, dim=0)`. Two valid batches whose per-token fields were padded to different
widths (e.g. two rollout chunks, or a text-only and a media chunk, each padded to its own
longest row) make torch.cat raise a bare size error that names no key. verl never pads or checks
the widths itself: it relies on every producer padding to one configured length beforehand, and
its docstring states no such precondition ("The batch is concatenated among dim=0").

Run: python verl-concat-padded-widths.py  (needs verl 0.9.1, torch, numpy, tensordict)

Expected: a batch of 3 rows, per-token fields right-padded to the longest width (input_ids
[3, 7]); or at least an error naming the field and the widths.
Actual (verl 0.9.1, tensordict 0.10.0, torch 2.13): RuntimeError: Sizes of tensors must match
except in dimension 0. Expected size 5 but got size 7 for tensor number 1 in the list.
"""

import torch
from verl.protocol import DataProto


def batch(rows, width):
    return DataProto.from_dict(tensors={"input_ids": torch.ones(rows, width, dtype=torch.long),
                                        "attention_mask": torch.ones(rows, width, dtype=torch.long)})


a, b = batch(2, 5), batch(1, 7)  # each chunk padded to its own longest row
print(f"a input_ids {list(a.batch['input_ids'].shape)}, b input_ids {list(b.batch['input_ids'].shape)}")
try:
    out = DataProto.concat([a, b])
    print(f"concat input_ids {list(out.batch['input_ids'].shape)}")
except Exception as exc:
    print(f"concat: {type(exc).__name__}: {exc}")
