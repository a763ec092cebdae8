"""OpenRLHF 0.11.2: `Experience.concat_experiences` pads per-sample `[B]` tensors along the batch dim.

`concat_experiences` (openrlhf/trainer/ppo_utils/experience.py) merges every tensor field with
`Experience._merge_item` -> `zero_pad_sequences(items, side="right")` (openrlhf/utils/utils.py),
which right-pads each tensor on its last dim to the longest and concatenates on dim 0. For the
per-token `[B, T]` fields that is right. For the per-sample episode fields `[B]` (`rewards`,
`scores`, `response_length`, `truncated`, `total_length`) and 1-D `info` entries, the last dim
is the batch dim: joining experiences of 2 and 1 samples pads the 1-sample tensor to 2 entries,
so the result has 4 rewards for 3 sequences, with a 0 inserted after the last sample.
0.11.2's own caller (`RemoteExperienceMaker.split_rollout_samples`) joins only single-sample
rollout Experiences, where every `[B]` tensor has 1 entry and nothing is padded; any caller that
joins larger Experiences gets misaligned rows.

Run: python openrlhf-concat-episode-padding.py  (needs openrlhf 0.11.2, torch)

Expected: 3 sequences, rewards [1., 2., 3.], total_length [7, 5, 4].
Actual (openrlhf 0.11.2, torch 2.13): 3 sequences, rewards [1., 2., 3., 0.],
total_length [7, 5, 4, 0], info['score'] [0.5, 1.0, 1.5, 0.0].
"""

import torch
from openrlhf.trainer.ppo_utils.experience import Experience


def experience(rewards, lengths):  # an Experience of len(rewards) samples
    b = len(rewards)
    return Experience(sequences=torch.ones(b, 7, dtype=torch.long), attention_mask=torch.ones(b, 7),
                      action_mask=torch.ones(b, 3), rewards=torch.tensor(rewards),
                      total_length=torch.tensor(lengths), info={"score": torch.tensor(rewards) / 2})


joined = Experience.concat_experiences([experience([1.0, 2.0], [7, 5]), experience([3.0], [4])],
                                       pad_token_id=0)
print("sequences:   ", tuple(joined.sequences.shape), "-> 3 samples")
print("rewards:     ", joined.rewards.tolist(), "(expected [1.0, 2.0, 3.0])")
print("total_length:", joined.total_length.tolist(), "(expected [7, 5, 4])")
print("info score:  ", joined.info["score"].tolist(), "(expected [0.5, 1.0, 1.5])")
