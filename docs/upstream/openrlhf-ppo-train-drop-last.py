"""OpenRLHF 0.11.2: `ActorPPOTrainer.ppo_train`'s loader silently drops the rows of a last partial micro-batch.

`ActorPPOTrainer.ppo_train` (openrlhf/trainer/ray/ppo_actor.py; the critic's `ppo_train` in
ppo_critic.py likewise) iterates the replay buffer with
`DataLoader(replay_buffer, batch_size=replay_buffer.sample_batch_size, shuffle=True,
drop_last=True, collate_fn=replay_buffer.collate_fn)`, where `collate_fn` is
`make_experience_batch` and the buffer holds the single-sample Experiences of
`split_experience_batch`. When the buffer's length is not a multiple of the micro-batch size
(the last rollout chunk is short once the prompt loader runs out: `SamplesGenerator` returns
`self._sample_buffer[:chunk_size]`; `setup_dynamic_batch`'s comment notes short buffers with
async / partial rollout), the rows past the last full micro-batch are not trained in that
epoch (with the default one epoch, never), and no warning is given. Which rows are
lost depends on the shuffle, so a row that differs from the others (a long sample, one with
media) is sometimes not trained at all.

Run: python openrlhf-ppo-train-drop-last.py  (needs openrlhf 0.11.2, torch; NaiveReplayBuffer's
constructor asks for a CUDA device, so its items and collate_fn are used as it builds them)

Expected: 8 rows in micro-batches of 3 give 3 micro-batches (3, 3, 2) covering every row once.
Actual (openrlhf 0.11.2, torch 2.13): 2 micro-batches of 3; two rows (with this seed, rows 0
and 4) are in none.
"""

import torch
from openrlhf.trainer.ppo_utils.experience import (
                                                   Experience,
                                                   make_experience_batch,
                                                   split_experience_batch,
)
from torch.utils.data import DataLoader

rows, micro_batch_size = 8, 3
batch = Experience(sequences=torch.ones(rows, 5, dtype=torch.long), attention_mask=torch.ones(rows, 5),
                   action_mask=torch.ones(rows, 2), rewards=torch.arange(rows, dtype=torch.float),
                   prompts=[f"row{i}" for i in range(rows)])
items = split_experience_batch(batch)               # what NaiveReplayBuffer.append stores
loader = DataLoader(items, batch_size=micro_batch_size, shuffle=True, drop_last=True,
                    collate_fn=make_experience_batch,  # = NaiveReplayBuffer.collate_fn
                    generator=torch.Generator().manual_seed(0))
trained = [exp.prompts for exp in loader]
print("micro-batches:", trained)
print("rows never trained:", sorted(set(batch.prompts) - {p for mb in trained for p in mb}),
      "(expected none)")
