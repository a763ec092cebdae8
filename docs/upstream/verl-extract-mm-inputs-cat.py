"""verl 0.9.1: `extract_multi_modal_inputs` cannot join per-sample media whose inner dims differ.

verl's engines (FSDP, Megatron, TorchTitan, AutoModel `transformer_impl.py`) build every stage's
media inputs with `extract_multi_modal_inputs(micro_batch["multi_modal_inputs"])`
(verl/utils/model.py). It collects each key over the per-sample dicts (one processor output per
sample, as the agent loop stores them) and joins them with `torch.cat(values, dim=0)`, padding
only the keys in `_VARLEN_MULTI_MODAL_KEYS` (input_features, feature_attention_mask,
mm_token_type_ids). Fields whose non-batch dims differ between samples by design raise:
- Idefics3/SmolVLM pixel_values [1, tiles, 3, H, W] (and pixel_attention_mask): tile counts
  differ per sample; the processor pads tiles to the batch max when it sees the whole batch.
- LLaVA-NeXT pixel_values [images, patches, 3, H, W]: the anyres patch count differs per image
  size; the processor pads patches to the batch max.
- Gemma3 token_type_ids [1, prompt_len]: a per-token map like mm_token_type_ids, but not in
  `_VARLEN_MULTI_MODAL_KEYS`, so prompts of different lengths cannot be joined.

Run: python verl-extract-mm-inputs-cat.py  (needs verl 0.9.1, torch, numpy, tensordict)

Expected: one model input per key for the two samples (padded as the processor pads a batch,
e.g. Idefics3 pixel_values [2, 3, 3, 4, 4] with the mask marking the padding tile).
Actual (verl 0.9.1, torch 2.13): each case raises RuntimeError "Failed to concatenate
multi-modal input ...; shapes: ...".
"""

import torch
from verl.utils.model import extract_multi_modal_inputs

H = W = 4
cases = {
    "Idefics3/SmolVLM, 2 and 3 tiles": [
        {"pixel_values": torch.rand(1, n, 3, H, W), "pixel_attention_mask": torch.ones(1, n, H, W)}
        for n in (2, 3)],
    "LLaVA-NeXT, 5 and 3 patches": [
        {"pixel_values": torch.rand(1, n, 3, H, W), "image_sizes": torch.tensor([[h, 8]])}
        for n, h in ((5, 16), (3, 8))],
    "Gemma3 token_type_ids, prompts of 5 and 7": [
        {"pixel_values": torch.rand(1, 3, H, W), "token_type_ids": torch.zeros(1, n, dtype=torch.long)}
        for n in (5, 7)],
}
for label, rows in cases.items():
    try:
        out = extract_multi_modal_inputs(rows)
        print(f"{label}: ok {{{', '.join(f'{k}: {list(v.shape)}' for k, v in out.items())}}}")
    except Exception as exc:
        print(f"{label}: {type(exc).__name__}: {exc}")
