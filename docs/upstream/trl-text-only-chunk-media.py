"""TRL 1.16.0: `GRPOTrainer` raises when a chunk of a mixed image / text batch holds only text rows.

`GRPOTrainer._get_per_token_logps_and_entropies` (trl/trainer/grpo_trainer.py) runs the model
on chunks of `batch_size` rows and slices the media for each chunk by `num_images`
(`pixel_values[row_start:row_end]`, `image_grid_thw[img_start:img_end]`). A chunk whose rows
have no image gets empty `pixel_values` / `image_grid_thw` instead of none, and the model's
vision tower raises on them. The reference and old-logprob passes of
`_generate_and_score_completions` call it with `batch_size=per_device_train_batch_size`
(beta > 0, num_iterations > 1, or vLLM importance sampling), and `_compute_loss` calls it on each
shuffled micro-batch, so a batch that mixes image and text-only prompts (which GRPOTrainer
accepts, huggingface/trl#5139) fails whenever the text rows fall in one chunk.

Run: python trl-text-only-chunk-media.py  (needs trl 1.16.0, transformers, torch, datasets; no
download: a one-layer Qwen2-VL and a word-level tokenizer are built here)

Setup: 4 rows with 1, 1, 0, 0 images (each image a (1, 2, 2) grid: 4 patch rows, 1 image token),
tensors in the form _generate_and_score_completions passes them.
Expected: log-probs [4, 2] for every cut.
Actual (trl 1.16.0, transformers 5.24, torch 2.13): the whole batch, and chunks of 2 that each
hold an image, work; chunks of 2 where rows 2:4 are the text rows raise ValueError:
torch.cat(): expected a non-empty list of Tensors (transformers' get_vision_position_ids, in
Qwen2-VL's vision tower, called with the chunk's empty image_grid_thw).
"""

import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
from trl import GRPOConfig, GRPOTrainer

tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
    {"<pad>": 0, "<eos>": 1, "a": 2, "b": 3}, unk_token="a")), pad_token="<pad>", eos_token="<eos>")
torch.manual_seed(0)
model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(
    text_config=dict(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1,
                     bos_token_id=1, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                      "mrope_section": [1, 1, 2]}),
    vision_config=dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, patch_size=2),
    image_token_id=5, video_token_id=6, vision_start_token_id=7, vision_end_token_id=8))
args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, num_generations=2,
                  use_cpu=True, bf16=False, report_to="none")
trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer,
                      reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                      train_dataset=Dataset.from_dict({"prompt": ["a b"] * 2}))

# prompt + 2 completion tokens; rows 0 and 1 hold one image each (<vision_start> <image> <end>)
ids = torch.tensor([[7, 5, 8, 2, 3], [7, 5, 8, 3, 3], [2, 2, 2, 2, 3], [3, 3, 2, 2, 3]])
pixel_values, image_grid_thw = torch.rand(8, 24), torch.tensor([[1, 2, 2]] * 2)
num_images = [1, 1, 0, 0]
with torch.no_grad():
    for order, batch_size in (([0, 1, 2, 3], None), ([0, 2, 1, 3], 2), ([0, 1, 2, 3], 2)):
        rows = ids[order]  # [0, 2, 1, 3]: each chunk of 2 holds an image; [0, 1, 2, 3]: rows 2:4 do not
        try:
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, rows, torch.ones_like(rows), 2, batch_size=batch_size,
                pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                num_images=[num_images[i] for i in order], mm_token_type_ids=(rows == 5).long())
            print(f"rows {order}, batch_size={batch_size}: log-probs {tuple(logps.shape)}")
        except Exception as e:
            print(f"rows {order}, batch_size={batch_size}: {type(e).__name__}: {e}")
