"""OpenRLHF 0.11.2: `merge_mm_train_inputs` raises on per-sample media it cannot `torch.cat` on dim 0.

`merge_mm_train_inputs` (openrlhf/utils/vlm_utils.py) turns the per-sample processor dicts of an
Experience (`mm_train_inputs`, one dict or None per sample, as `process_prompt_with_images` keeps
them) into the model's media inputs: every value goes through `torch.tensor(val)` unless it is a
tensor, then each key is `torch.cat(..., dim=0)`-ed. The train step
(`ActorPPOTrainer.training_step`) and the logprob / reference passes (`PolicyModelActor.forward`,
`ReferenceModelActor.forward`) call it. Tiled images fail:

Idefics3 / SmolVLM (LLaVA-NeXT patches likewise): the processor gives each sample
`pixel_values [1, tiles, 3, H, W]`, and the tile count depends on the image. Samples with
different tile counts cannot be concatenated on dim 0; the processor itself, given the same
images as one batch, pads the tiles to `[2, max_tiles, 3, H, W]`.

(A value holding a list of per-image tensors also raises, in `torch.tensor(list)`; OpenRLHF
never builds one, its per-sample dicts being processor outputs, so that is not shown here.)

Run: python openrlhf-merge-mm-train-inputs.py  (needs openrlhf 0.11.2, torch, transformers,
pillow; no download: Idefics3's image processor is built here with small sizes)

Expected: one media dict for the two samples (tiles padded to the batch max as the processor
pads them, e.g. pixel_values [2, 5, 3, 32, 32]), or an error that names the key.
Actual (openrlhf 0.11.2, torch 2.13, transformers 5.24): RuntimeError "Sizes of tensors must
match except in dimension 0".
"""

from openrlhf.utils.vlm_utils import merge_mm_train_inputs
from PIL import Image
from transformers import Idefics3ImageProcessorPil

proc = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
images = [Image.new("RGB", (64, 32)), Image.new("RGB", (32, 32))]  # one image per sample
rows = [dict(proc(images=[[im]], return_tensors="pt")) for im in images]  # as OpenRLHF keeps them
print("per-sample pixel_values:", [tuple(r["pixel_values"].shape) for r in rows])
print("processor on both samples:", tuple(proc(images=[[im] for im in images],
                                               return_tensors="pt")["pixel_values"].shape))

try:  # as the train step calls it: experience.mm_train_inputs, one entry per sample
    out = merge_mm_train_inputs(rows, "cpu")
    print("tiles of differing count ->", {k: tuple(v.shape) for k, v in out.items()})
except Exception as e:
    print("tiles of differing count ->", type(e).__name__ + ":", str(e).splitlines()[0])
