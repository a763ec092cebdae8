"""The `raw_prompt` column: each row's prompt as the dataset held it, beside the rollout's output.

A driver keeps what it sampled from the dataset next to what the engine generated (verl's
`raw_prompt` / `multi_modal_data`, TRL's dataset rows): a trainer whose own code renders the
chat template and runs the processor on the images (TRL's `_generate_and_score_completions`)
needs the prompt text and images, not only the processor's outputs. The column is an object
field (reference_impl.objects.ObjectColumn) that no stage fetches by the registry's rule; a
trainer that reads it says so (the trainer factory's `reads_prompts`) and fetches it itself.

A row is `{"text": uint8 [L]}` (the prompt's UTF-8 bytes), plus `"images": [uint8 [H, W, 3],
...]` (each RGB image's pixels, in prompt order) when the row has images: tensors, so every
codec and data plane carries the column as it carries other per-row dicts, exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .batch import Batch
from .objects import ObjectColumn

FIELD = "raw_prompt"


def _pixels(i: int, k: int, image: Any) -> torch.Tensor:
    mode = getattr(image, "mode", None)
    if mode != "RGB":
        raise ValueError(f"{FIELD} row {i} image {k}: expected an RGB PIL image, got "
                         f"{type(image).__name__}" + (f" in mode {mode!r}" if mode else ""))
    return torch.from_numpy(np.array(image, dtype=np.uint8))


def prompt_column(prompts: Sequence[str], images: Sequence[Sequence[Any]]) -> ObjectColumn:
    """The column of rows with prompt text `prompts[i]` and RGB PIL images `images[i]`."""
    if len(prompts) != len(images):
        raise ValueError(f"{FIELD}: {len(prompts)} prompts but {len(images)} image lists")
    rows = []
    for i, (text, imgs) in enumerate(zip(prompts, images)):
        if not isinstance(text, str):
            raise TypeError(f"{FIELD} row {i}: the prompt is a {type(text).__name__}, not a str")
        row: dict[str, Any] = {"text": torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)}
        if imgs:
            row["images"] = [_pixels(i, k, img) for k, img in enumerate(imgs)]
        rows.append(row)
    return ObjectColumn(rows)


def with_prompts(batch: Batch, prompts: Sequence[str], images: Sequence[Sequence[Any]]) -> Batch:
    """`batch` with its rows' `raw_prompt` column (one prompt and image list per row)."""
    if len(prompts) != len(batch):
        raise ValueError(f"{FIELD}: {len(prompts)} prompts for a batch of {len(batch)} rows")
    return Batch({**batch.fields, FIELD: prompt_column(prompts, images)}, batch.family,
                 dict(batch.extra))


def prompt_rows(column: ObjectColumn) -> list[tuple[str, list[Any]]]:
    """Each row's (prompt text, RGB PIL images): what `prompt_column` was given, exactly."""
    from PIL import Image

    out = []
    for i in range(len(column)):
        row = column[i]
        if not isinstance(row, dict) or "text" not in row:
            raise ValueError(f"{FIELD} row {i} has no 'text' (got {row!r})")
        text = row["text"]
        if not isinstance(text, torch.Tensor) or text.dtype != torch.uint8 or text.dim() != 1:
            raise ValueError(f"{FIELD} row {i} 'text' must be a 1-D uint8 tensor of UTF-8 "
                             f"bytes, got {getattr(text, 'dtype', type(text).__name__)}")
        images = []
        for k, px in enumerate(row.get("images") or []):
            if px.dtype != torch.uint8 or px.dim() != 3 or px.shape[-1] != 3:
                raise ValueError(f"{FIELD} row {i} image {k} must be uint8 [H, W, 3], got "
                                 f"{px.dtype} {tuple(px.shape)}")
            images.append(Image.fromarray(px.contiguous().numpy()))  # uint8 HxWx3: RGB
        out.append((bytes(text.tolist()).decode("utf-8"), images))
    return out
