"""The reference rollout: HF `generate` with per-token generation logprobs, into a `Batch`.

Why it is shaped this way (BACKGROUND.md section 7):
- sampling is restricted to ordinary tokens and the family's end-of-turn tokens (EOS): a random
  tiny policy otherwise samples the image placeholder or control tokens, and the trainer's
  recompute of such a sequence breaks; a sampled EOS ends the completion (it is its last token);
- `max_new_tokens` may be one cap per prompt (as engines take per-request limits), 0 included
  (an empty completion: a row with no loss token), so completions differ in length and
  token-mean, sequence-mean and per-micro-batch means of a loss differ;
- `generation_logprobs` are the log-softmax (float32) of the *raw* logits of each sampled token
  over the full vocabulary, the same distribution the trainer's recompute scores, so
  token_mult_prob_error measures engine-vs-trainer numerics and nothing else;
- each prompt is generated alone (no left padding, no batch variance inside the engine) under a
  forked RNG seeded from (seed, row): a rollout is a pure function of weights, inputs and seed;
- per-token maps (`mm_token_type_ids`, `token_type_ids`) are extended with zeros over the
  completion (Qwen-VL raises without them once images are present);
- floating media with the POLICY dtype policy are cast to `settings.dtype` once, here, at the
  rollout write; integer geometry and KEEP media are never cast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .batch import Batch
from .packed import PackedTensor
from .registry import FAMILIES, FIELDS, DtypePolicy, Kind, spec

# fixture family name -> registry family name, where they differ (none today: the fixtures use
# the registry's names; a family built under another name maps here)
_SEQUENCE_FIELDS = ("input_ids", "attention_mask")


def registry_family(name: str) -> str:
    """The registry FamilySpec name of a fixture family (they share names); unknown raises."""
    if name not in FAMILIES:
        raise KeyError(f"family {name!r} has no registry FamilySpec; known: {sorted(FAMILIES)}")
    return name


class AllowedTokensOnly:
    """A logits processor setting every logit outside `allowed` to -inf (sampling only;
    logprobs use the raw logits). Duck-typed, so importing this module loads no transformers."""

    def __init__(self, allowed: Tensor) -> None:
        self.allowed = allowed.long()

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        keep = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
        keep[self.allowed.to(scores.device)] = True
        return scores.masked_fill(~keep, float("-inf"))


def _fork_rng(device: torch.device):
    """Fork the CPU RNG (and the CUDA one of `device`), so sampling never moves the caller's."""
    return torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [])


def request_caps(prompts: Sequence[str], images: Sequence[list[Any]],
                 max_new_tokens: int | Sequence[int]) -> list[int]:
    """Each prompt's completion cap from a `generate` call's arguments, checked: one image list
    per prompt, one cap for all or one per prompt, none negative."""
    if len(prompts) != len(images):
        raise ValueError(f"{len(prompts)} prompts but {len(images)} image lists")
    caps = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) \
        else [int(c) for c in max_new_tokens]
    if len(caps) != len(prompts) or any(c < 0 for c in caps):
        raise ValueError(f"max_new_tokens must be an int >= 0 or one per prompt "
                         f"({len(prompts)}), got {max_new_tokens!r}")
    return caps


class HFRollout:
    """`generate(prompts, images, max_new_tokens, seed) -> Batch` on an HF model.

    `family` is a fixtures.families.Family (processor, tokenizer, `build_model`,
    `per_sample_media`, `ordinary_token_ids`); `settings` needs `dtype`, `device`, `seed`
    (a TrainerSettings serves). The engine's weights start equal to a trainer built with the
    same settings (same seed) and follow it through `refit`.
    """

    def __init__(self, family: Any, settings: Any, model: torch.nn.Module | None = None):
        self.family = family
        self.settings = settings
        self.device = torch.device(settings.device)
        self.dtype = settings.dtype
        self.model = model if model is not None else family.build_model(
            seed=settings.seed, dtype=settings.dtype, device=self.device)
        self.model.eval()
        # ordinary tokens, and EOS as a stop (HF generate ends the completion on it)
        self.allowed = torch.cat([family.ordinary_token_ids(),
                                  torch.tensor(family.eos_token_ids, dtype=torch.long)]).unique()
        self.registry_name = registry_family(family.name)

    # -- weights ------------------------------------------------------------------------
    def refit(self, state_dict: dict[str, Tensor]) -> None:
        """Load the trainer's weights (the weight sync between steps)."""
        self.model.load_state_dict(state_dict)

    # -- generation ---------------------------------------------------------------------
    def _model_inputs(self, feats: dict[str, Tensor]) -> dict[str, Tensor]:
        out = {}
        for k, v in feats.items():
            if v.is_floating_point() and k in FIELDS and \
                    FIELDS[k].dtype_policy is DtypePolicy.POLICY:
                v = v.to(self.dtype)
            out[k] = v.to(self.device)
        return out

    def logits_processors(self):
        from transformers import LogitsProcessorList

        return LogitsProcessorList([AllowedTokensOnly(self.allowed)])

    @torch.no_grad()
    def sample(self, feats: dict[str, Tensor], max_new_tokens: int, seed: int
               ) -> tuple[Tensor, Tensor]:
        """One prompt's completion ids `[T]` and their generation logprobs `[T]` (float32);
        `T <= max_new_tokens`, less when EOS was sampled (it is then the last id)."""
        if max_new_tokens == 0:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float32)
        with _fork_rng(self.device):
            torch.manual_seed(seed)
            out = self.model.generate(
                **self._model_inputs(feats),
                max_new_tokens=max_new_tokens,
                do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                logits_processor=self.logits_processors(),
                output_logits=True, return_dict_in_generate=True,
                pad_token_id=self.family.tokenizer.pad_token_id,
            )
        prompt_len = feats["input_ids"].shape[1]
        completion = out.sequences[0, prompt_len:].cpu()
        logits = torch.stack([lg[0] for lg in out.logits[: completion.shape[0]]]).float().cpu()
        return completion, self.token_logprobs(logits, completion)

    def token_logprobs(self, logits: Tensor, tokens: Tensor) -> Tensor:
        """Full-vocabulary log-softmax of the raw logits at the sampled tokens (what the
        trainer's recompute scores), not of the restricted sampling distribution."""
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]

    def generate(self, prompts: list[str], images: list[list[Any]],
                 max_new_tokens: int | Sequence[int], seed: int = 0) -> Batch:
        """`max_new_tokens`: one cap for every prompt, or one per prompt (>= 0)."""
        caps = request_caps(prompts, images, max_new_tokens)
        rows = []
        for i, (prompt, imgs, cap) in enumerate(zip(prompts, images, caps)):
            feats = self.family.process([prompt], [list(imgs)])
            if not bool(feats["attention_mask"].all()):
                raise ValueError("a single-prompt processor output must have no padding")
            completion, logp = self.sample(feats, cap, seed * 1_000_003 + i)
            rows.append((feats, completion, logp, len(imgs)))
        batch = self.assemble(rows)
        batch.extra["completions"] = [
            self.family.tokenizer.decode(c, skip_special_tokens=True) for _, c, _, _ in rows]
        return batch

    def assemble(self, rows: list[tuple[dict[str, Tensor], Tensor, Tensor, int]]) -> Batch:
        """The rollout write: one right-padded Batch with every field the processor emitted."""
        fam = FAMILIES[self.registry_name]
        lengths = [f["input_ids"].shape[1] + c.shape[0] for f, c, _, _ in rows]
        seq = max(lengths)
        b = len(rows)

        def per_token(name: str, dtype: torch.dtype) -> Tensor:
            return torch.full((b, seq), spec(name).pad_value, dtype=dtype)

        fields: dict[str, Tensor | PackedTensor] = {
            "input_ids": per_token("input_ids", torch.long),
            "attention_mask": per_token("attention_mask", torch.long),
            "token_mask": per_token("token_mask", torch.long),
            "generation_logprobs": per_token("generation_logprobs", torch.float32),
            "input_lengths": torch.tensor(lengths, dtype=torch.long),
            "prompt_lengths": torch.tensor([f["input_ids"].shape[1] for f, *_ in rows],
                                           dtype=torch.long),
        }
        maps = sorted({k for f, *_ in rows for k in f
                       if k not in _SEQUENCE_FIELDS and spec(k).kind is Kind.PER_TOKEN})
        for name in maps:
            fields[name] = per_token(name, torch.long)
        media: dict[str, list] = {}
        for i, (feats, completion, logp, n_images) in enumerate(rows):
            p, n = feats["input_ids"].shape[1], lengths[i]
            fields["input_ids"][i, :p] = feats["input_ids"][0]
            fields["input_ids"][i, p:n] = completion
            fields["attention_mask"][i, :n] = 1
            fields["token_mask"][i, p:n] = 1
            fields["generation_logprobs"][i, p:n] = logp
            for name in maps:  # zeros over the completion: completion tokens are text
                if name in feats:
                    fields[name][i, :p] = feats[name][0]
                    fields[name][i, p:n] = 0
            for name, per_row in self.family.per_sample_media(feats, [n_images]).items():
                media.setdefault(name, [None] * b)[i] = per_row[0]
        for name, per_row in media.items():
            packed = PackedTensor.from_rows(fam.segments(name, per_row),
                                            pack_dim=fam.pack_dim(name))
            if FIELDS[name].dtype_policy is DtypePolicy.POLICY and name not in fam.keep_dtype:
                packed = packed.to_dtype(self.dtype)  # the one cast, at rollout write
            fields[name] = packed
        batch = Batch(fields, family=self.registry_name)
        batch.validate()
        return batch
