"""One request's model inputs straight from the processor, a completion appended: the clause
tests' own forward of a row, with no batch, no padding and no trainer or engine code."""

from __future__ import annotations

import torch
from torch import Tensor


def row_inputs(fam, prompt, images, completion: Tensor, dtype, device) -> dict[str, Tensor]:
    """One row as the processor gives it, the completion appended (per-token maps zero over
    it), floating media in the policy dtype."""
    feats = fam.process([prompt], [list(images)])
    t = completion.numel()
    out = {}
    for k, v in feats.items():
        if k == "input_ids":
            v = torch.cat([v, completion[None].to(v.dtype)], dim=1)
        elif k == "attention_mask":
            v = torch.ones(1, v.shape[1] + t, dtype=v.dtype)
        elif v.dim() == 2 and v.shape[:2] == feats["input_ids"].shape:  # per-token map
            v = torch.cat([v, torch.zeros(1, t, dtype=v.dtype)], dim=1)
        elif v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.to(device)
    return out
