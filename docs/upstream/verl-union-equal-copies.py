"""verl 0.9.1: `DataProto.union` raises on equal per-sample media dicts that are distinct objects.

`DataProto.union` (verl/protocol.py) joins the non-tensor columns with `union_numpy_dict`, which
asserts `_deep_equal` on a column both sides hold. For an object array `_deep_equal` compares
each row with `==`; two dicts holding tensors compare their values with `==` too, and
`bool(tensor == tensor)` raises for a tensor of more than one element. If both sides hold the
very same dict objects, `dict.__eq__` short-cuts on identity and never calls `bool` on a
tensor, so the verdict depends on object identity, not on value. Copies arise whenever a batch
crosses a process (a Ray hop pickles it) or is deep-copied.

Run: python verl-union-equal-copies.py  (needs verl 0.9.1, torch, numpy, tensordict)

Expected: both unions succeed (the two sides hold the same values), batch size 2.
Actual (verl 0.9.1, torch 2.13): the same-objects union succeeds; the equal-copies union raises
RuntimeError: Boolean value of Tensor with more than one value is ambiguous.
"""

import copy

import torch
from verl.protocol import DataProto

rows = [{"pixel_values": torch.ones(4, 2), "image_grid_thw": torch.tensor([[1, 2, 2]])},
        {"pixel_values": torch.zeros(4, 2), "image_grid_thw": torch.tensor([[1, 2, 2]])}]
ids = torch.arange(6).view(2, 3)


def proto(media):
    return DataProto.from_dict(tensors={"input_ids": ids.clone()},
                               non_tensors={"multi_modal_inputs": media})


for label, other in (("same dict objects", list(rows)), ("equal copies", copy.deepcopy(rows))):
    try:
        print(f"{label}: union ok, batch size {len(proto(rows).union(proto(other)))}")
    except Exception as exc:
        print(f"{label}: {type(exc).__name__}: {exc}")
