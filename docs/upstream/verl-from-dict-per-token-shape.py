"""verl 0.9.1: `DataProto.from_dict` / `check_consistency` accept per-token fields of the wrong length.

`DataProto.from_dict` (verl/protocol.py) checks only that every tensor shares dim 0 (its
docstring: "All the tensor in tensors have the same dim0"), and `check_consistency` checks only
the batch dims and the non-tensor columns' dim 0. A per-token field one position shorter than
`input_ids` (mm_token_type_ids [B, 6] beside input_ids [B, 7]), or M-RoPE position_ids
[B, 3, 6], is accepted; the misalignment surfaces only later, far from its cause (a wrong
position or token type for every token after the gap, or a shape error inside the model).

Run: python verl-from-dict-per-token-shape.py  (needs verl 0.9.1, torch, numpy, tensordict)

Expected: from_dict or check_consistency rejects each batch, naming the field whose sequence
dim (last dim) differs from input_ids' 7.
Actual (verl 0.9.1): both batches are accepted.
"""

import torch
from verl.protocol import DataProto

B, L = 2, 7
base = {"input_ids": torch.ones(B, L, dtype=torch.long),
        "attention_mask": torch.ones(B, L, dtype=torch.long)}
for name, bad in (("mm_token_type_ids", torch.zeros(B, L - 1, dtype=torch.long)),
                  ("position_ids", torch.zeros(B, 3, L - 1, dtype=torch.long))):
    try:
        proto = DataProto.from_dict(tensors={**base, name: bad})
        proto.check_consistency()
        print(f"{name} {list(bad.shape)} beside input_ids {[B, L]}: accepted")
    except Exception as exc:
        print(f"{name} {list(bad.shape)}: rejected, {type(exc).__name__}: {exc}")
