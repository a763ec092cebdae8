"""TRL 1.16.0: `GRPOTrainer` scores left-padded rows without `position_ids` (log-probs depend on batch-mates).

`GRPOTrainer._generate_and_score_completions` left-pads the prompts of a generation batch
(`pad(..., padding_side="left")`), and `_get_per_token_logps_and_entropies`
(trl/trainer/grpo_trainer.py) calls the model with `input_ids` and `attention_mask` only. Models
that default to `position_ids = arange(seq_len)` then see a padded row's tokens at positions
shifted by its pad count, which depends on the longest prompt among its batch-mates. transformers'
`generate` derives positions from the mask (`attention_mask.cumsum(-1) - 1`), so the sampled
tokens and the scored ones disagree. With absolute position embeddings (GPT-2 family) the
log-probs move by O(1e-2) at random init; with RoPE (Qwen2), which sees relative positions, only
float rounding changes (about 5e-07 seen when a row is cut into other micro-batches). The
experimental Online DPO / XPO / Nash-MD trainers have the same gap: huggingface/trl#6800.

Run: python trl-left-pad-positions.py  (needs trl 1.16.0, transformers, torch, datasets; no
download: a one-layer GPT-2 and a word-level tokenizer are built here)

Expected: the row `a b b a` (prompt `a b`, completion `b a`) gets the same completion log-probs
alone and left-padded by 2 beside a longer prompt.
Actual (trl 1.16.0, transformers 5.24, torch 2.13): alone [-1.894906, -2.095021], left-padded
[-1.966283, -2.122548]: 0.071 apart.
"""

import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
    {"<pad>": 0, "<eos>": 1, "a": 2, "b": 3}, unk_token="a")), pad_token="<pad>", eos_token="<eos>")
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=8, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=1))
args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, num_generations=2,
                  use_cpu=True, bf16=False, report_to="none")
trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer,
                      reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                      train_dataset=Dataset.from_dict({"prompt": ["a b"] * 2}))

alone = torch.tensor([[2, 3, 3, 2]])                         # prompt "a b", completion "b a"
batch = torch.tensor([[0, 0, 2, 3, 3, 2],                   # the same row, prompt left-padded by 2
                      [2, 2, 3, 2, 3, 2]])                  # a batch-mate with a 4-token prompt
with torch.no_grad():
    lp_alone, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, alone, torch.ones_like(alone), 2)
    lp_batch, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, batch, (batch != 0).long(), 2)
print("alone:      ", [round(x, 6) for x in lp_alone[0].tolist()])
print("left-padded:", [round(x, 6) for x in lp_batch[0].tolist()], "(expected the same)")
print("max abs difference:", round((lp_alone[0] - lp_batch[0]).abs().max().item(), 6))
