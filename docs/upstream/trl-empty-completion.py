"""TRL 1.16.0: `GRPOTrainer` raises IndexError when a `rollout_func` returns an empty completion.

`GRPOTrainer._generate` (trl/trainer/grpo_trainer.py) computes
`is_truncated = torch.tensor([ids[-1] not in eos_and_pad for ids in completion_ids])`, which
indexes the last token of every completion. The `rollout_func` contract (GRPOTrainer's
docstring: a dict with "prompt_ids", "completion_ids" and "logprobs") does not exclude a
completion of no token, which an external engine returns for a request capped at 0 new tokens,
an aborted request, or a multi-turn episode that ends before the policy speaks.

Run: python trl-empty-completion.py  (needs trl 1.16.0, transformers, torch, datasets; no
download: a one-layer model and a word-level tokenizer are built here)

Expected: one optimizer step; the empty completion contributes no loss token.
Actual (trl 1.16.0, transformers 5.24): IndexError: list index out of range, in _generate.
"""

import tempfile

from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

words = ["<pad>", "<eos>", "<unk>", "count", "the", "shapes", "two", "three"]
core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
core.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                    eos_token="<eos>", unk_token="<unk>")
model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(words), hidden_size=16,
                                     intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1,
                                     pad_token_id=0, eos_token_id=1))
prompt = tokenizer("count the shapes")["input_ids"]


def rollout_func(prompts, trainer):
    # two completions per prompt: "two <eos>" and an empty one
    return {"prompt_ids": [prompt] * len(prompts), "logprobs": None,
            "completion_ids": [[] if i % 2 else [6, 1] for i in range(len(prompts))]}


args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2,
                  num_generations=2, gradient_accumulation_steps=1, max_steps=1, use_cpu=True,
                  bf16=False, report_to="none", save_strategy="no", disable_tqdm=True)
trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer,
                      train_dataset=Dataset.from_dict({"prompt": ["count the shapes"] * 2}),
                      reward_funcs=lambda completions, **kw: [float(i) for i in
                                                              range(len(completions))],
                      rollout_func=rollout_func)
trainer.train()
print("one step, global_step =", trainer.state.global_step)
