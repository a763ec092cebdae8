"""OpenRLHF 0.11.2: split / make-batch / concat results share their source's media dicts.

`Experience.mm_train_inputs` holds one processor dict (or None) per sample. The batch functions
in openrlhf/trainer/ppo_utils/experience.py copy the tensors of an Experience (`torch.stack`,
`zero_pad_sequences`) but pass these dicts on by reference: `split_experience_batch` puts the
source's dict object in each single-sample item, `make_experience_batch` and
`Experience.concat_experiences` chain the items' lists. A result's row is therefore the same dict
as the source's row (a row picked twice is one dict twice), and a key added, popped or replaced
in place on one batch shows up in the other. No 0.11.2 function writes into these dicts yet; any
that does (a dtype cast, a key dropped per stage, a device move in place) corrupts the replay
buffer's copy.

Run: python openrlhf-shared-media-dicts.py  (needs openrlhf 0.11.2, torch)

Expected: results hold their own dicts; a change to a result leaves the source as it was.
Actual (openrlhf 0.11.2, torch 2.13): every result row `is` the source's dict; a key set on the
make-batch result appears in the concat source, the joined batch and both copies of the repeated
row.
"""

import torch
from openrlhf.trainer.ppo_utils.experience import (
    Experience,
    make_experience_batch,
    split_experience_batch,
)


def sample(i):  # one rollout sample, as the rollout makes it: tensors [1, ...], its media dict
    return Experience(sequences=torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 3),
                      action_mask=torch.ones(1, 2), rewards=torch.tensor([float(i)]),
                      mm_train_inputs=[{"pixel_values": torch.full((4, 6), float(i))}])


singles = [sample(0), sample(1)]
batch = Experience.concat_experiences(singles, pad_token_id=0)      # how rollouts are joined
items = split_experience_batch(batch)                               # replay buffer append
picked = make_experience_batch([items[1], items[0], items[1]])      # replay buffer collate
print("concat row 1 is the single's dict:      ", batch.mm_train_inputs[1] is singles[1].mm_train_inputs[0])
print("split item 1 is the batch's dict:       ", items[1].mm_train_inputs[0] is batch.mm_train_inputs[1])
print("make-batch rows 0 and 2 are one dict:   ", picked.mm_train_inputs[0] is picked.mm_train_inputs[2])
picked.mm_train_inputs[0]["pixel_values"] = picked.mm_train_inputs[0]["pixel_values"].half()
picked.mm_train_inputs[0]["scribbled"] = True                       # in place, on the result only
print("source batch row 1 keys after the change:", sorted(batch.mm_train_inputs[1]),
      batch.mm_train_inputs[1]["pixel_values"].dtype, "(expected ['pixel_values'] torch.float32)")
print("the rollout sample's keys:               ", sorted(singles[1].mm_train_inputs[0]))
