"""TRL 1.16.0: `GRPOTrainer`'s entropy bonus changes with how the batch is cut into micro-batches.

`GRPOTrainer._compute_loss` (trl/trainer/grpo_trainer.py) adds the entropy bonus as
`(entropies * mask).sum() / mask.sum().clamp(min=1) / current_gradient_accumulation_steps`:
a token mean per micro-batch, divided by the number of micro-batches. Summed over the
accumulation window that is the mean of the micro-batches' means, not the mean per-token entropy
that `GRPOConfig.entropy_coef` documents ("The bonus is always the mean per-token entropy"), and
it depends on the cut: micro-batches with fewer loss tokens weigh more per token, and a
micro-batch with no loss token (a completion masked by `mask_truncated_completions`, or a tool
turn) adds 0 but still counts in the divisor. The default `dapo` policy term, normalised by the
generation batch's token count, does not change with the cut.

Run: python trl-entropy-bonus-split.py  (needs trl 1.16.0, transformers, torch, datasets; no
download: a one-layer model and a word-level tokenizer are built here)

Setup: one generation batch of 3 rows with 3, 0 and 1 loss tokens, zero advantages (so the
loss is the entropy bonus alone), entropy_coef 0.1, cut as TRL cuts it (split_tensor_dict) into
one micro-batch (per_device_train_batch_size=3) or three (=1, gradient_accumulation_steps=3).
Expected: the window's loss is the same for both cuts: -0.1 x the mean entropy of the 4 tokens.
Actual (trl 1.16.0, transformers 5.24, torch 2.13): one micro-batch -0.207745 (the expected
value), three micro-batches of one row -0.138500. (The comment above the adaptive controller in
`_compute_loss` notes that its window-global mean "can differ from this per-micro-batch mean";
the static bonus itself is not window-global.)
"""

import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import split_tensor_dict

tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
    {"<pad>": 0, "<eos>": 1, "a": 2, "b": 3}, unk_token="a")), pad_token="<pad>", eos_token="<eos>")
batch = {"prompt_ids": torch.tensor([[2, 3]] * 3), "prompt_mask": torch.ones(3, 2, dtype=torch.long),
         "completion_ids": torch.tensor([[3, 2, 3], [2, 2, 2], [3, 0, 0]]),
         "completion_mask": torch.tensor([[1, 1, 1], [0, 0, 0], [1, 0, 0]]),  # 3, 0, 1 loss tokens
         "advantages": torch.zeros(3), "num_items_in_batch": torch.tensor(4.0)}
for micro in (3, 1):
    torch.manual_seed(0)  # the same random weights for both cuts
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=8, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, pad_token_id=0, eos_token_id=1))
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=micro,
                      gradient_accumulation_steps=3 // micro, num_generations=3, entropy_coef=0.1,
                      use_cpu=True, bf16=False, report_to="none")
    trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer,
                          reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          train_dataset=Dataset.from_dict({"prompt": ["a b"] * 3}))
    trainer.model.train()
    chunks = split_tensor_dict(batch, 3 // micro)
    trainer.current_gradient_accumulation_steps = len(chunks)  # as Trainer's accumulation loop sets it
    loss = sum(trainer._compute_loss(trainer.model, c).item() for c in chunks)
    print(f"{len(chunks)} micro-batch(es) of {micro} row(s): window loss {loss:.6f}")
mask = batch["completion_mask"]
_, entropies, _ = trainer._get_per_token_logps_and_entropies(  # TRL's own per-token entropies
    trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
    torch.cat([batch["prompt_mask"], mask], 1), 3, compute_entropy=True)
print(f"expected (documented objective, -0.1 x mean entropy of the 4 loss tokens): "
      f"{-0.1 * ((entropies * mask).sum() / mask.sum()).item():.6f}")
