"""Batching per-request inputs for transformers' generate: left padding, padded audio features."""

from __future__ import annotations

import torch

from bench.reference import collate
from services.runtime.inputs.prompt import PromptInputs


def inputs(ids: list[int], audio_frames: int | None = None, patches: int | None = None) -> PromptInputs:
    t = torch.tensor([ids])
    extra = {}
    if audio_frames is not None:
        extra = {"input_features": torch.ones((1, 128, audio_frames)),
                 "feature_attention_mask": torch.ones((1, audio_frames), dtype=torch.long)}
    if patches is not None:
        extra.update(pixel_values=torch.ones((patches, 12)), image_grid_thw=torch.tensor([[1, 2, patches // 2]]))
    return PromptInputs(input_ids=t, attention_mask=torch.ones_like(t), **extra)


def test_token_ids_are_left_padded_so_every_prompt_ends_in_the_last_column():
    batch = collate([inputs([5, 6, 7]), inputs([8])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert set(batch) == {"input_ids", "attention_mask"}


def test_audio_features_are_right_padded_to_the_longest_and_masked():
    batch = collate([inputs([1], audio_frames=4), inputs([2]), inputs([3], audio_frames=6)], pad_id=0)
    assert batch["input_features"].shape == (2, 128, 6)  # only the prompts with audio
    assert batch["feature_attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6]
    assert batch["input_features"][0, :, 4:].abs().sum() == 0


def test_image_patches_and_grids_concatenate():
    batch = collate([inputs([1], patches=4), inputs([2], patches=6)], pad_id=0)
    assert batch["pixel_values"].shape == (10, 12)
    assert batch["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 3]]
