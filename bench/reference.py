"""The transformers reference for the benchmark: the checkpoint family's `generate`
(`Qwen3OmniMoeForConditionalGeneration` or `Qwen2_5OmniForConditionalGeneration`), greedy, one
request per call or a batch of them.

The model is the one `services.tools.reference.ReferenceRunner` loads, called through its
`generate_greedy` (thinker and talker `do_sample=False`, generate's talker repetition penalty 1.05,
which the talker service uses too), with the pipeline's prompt builder (whose inputs equal the
runner's processor inputs). The benchmark does not call `ReferenceRunner.generate` because it needs
a batch (left-padded, which `generate` supports for text, audio and image prompts in transformers
5.19) and nothing captured. Voices resolve as the runner's (`ReferenceRunner.speaker`: the family's
default when none is given).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.prompts import BenchPrompt
from services.runtime.inputs.prompt import PromptBuilder, PromptInputs
from services.tools.reference import ReferenceRunner


@dataclass(frozen=True)
class Generated:
    text_tokens: int  # generated thinker tokens, the end token included when emitted
    audio_seconds: float


def load_reference(checkpoint: str, device: str = "cpu", dtype: str = "float32") -> ReferenceRunner:
    """ReferenceRunner in `dtype` on `device`."""
    return ReferenceRunner(checkpoint, device=device, dtype=dtype)


def collate(inputs: list[PromptInputs], pad_id: int) -> dict[str, torch.Tensor]:
    """Per-request model inputs -> one batch, left-padded.

    Left: generate appends on the right, and the talker part finds the assistant turn from the
    end of row 0. Audio features [n_audio, 128, T] are right-padded to the longest T (its mask
    marks the padding); image patches and grids concatenate, as the processor batches them.
    """
    width = max(i.num_tokens for i in inputs)
    ids = torch.full((len(inputs), width), pad_id, dtype=torch.long)  # [B, P]
    mask = torch.zeros((len(inputs), width), dtype=torch.long)
    for row, item in enumerate(inputs):
        ids[row, width - item.num_tokens:] = item.input_ids[0]
        mask[row, width - item.num_tokens:] = item.attention_mask[0]
    batch = {"input_ids": ids, "attention_mask": mask}
    audio = [i for i in inputs if i.input_features is not None]
    if audio:
        frames = max(i.input_features.shape[-1] for i in audio)
        pad = lambda t: torch.nn.functional.pad(t, (0, frames - t.shape[-1]))  # noqa: E731
        batch["input_features"] = torch.cat([pad(i.input_features) for i in audio])
        batch["feature_attention_mask"] = torch.cat([pad(i.feature_attention_mask) for i in audio])
    images = [i for i in inputs if i.pixel_values is not None]
    if images:
        batch["pixel_values"] = torch.cat([i.pixel_values for i in images])
        batch["image_grid_thw"] = torch.cat([i.image_grid_thw for i in images])
    videos = [i for i in inputs if i.pixel_values_videos is not None]
    if videos:  # the bench's videos carry no audio track (use_audio_in_video is one flag per batch)
        batch["pixel_values_videos"] = torch.cat([i.pixel_values_videos for i in videos])
        batch["video_grid_thw"] = torch.cat([i.video_grid_thw for i in videos])
        batch["video_second_per_grid"] = torch.cat([i.video_second_per_grid for i in videos])
    return batch


class Reference:
    """Greedy text + audio generation with the whole transformers model, nothing streamed."""

    def __init__(self, runner: ReferenceRunner, device: str, voice: str | None, max_new_tokens: int,
                 talker_max_new_tokens: int):
        self.runner = runner
        self.device = device
        self.speaker = runner.speaker(voice)
        self.max_new_tokens = max_new_tokens
        self.talker_max_new_tokens = talker_max_new_tokens
        # The pipeline's prompt builder: the benchmark times the path a served request takes (the
        # oracle's processor inputs are equal: tests/e2e/test_independent_oracle.py).
        self.prompts = PromptBuilder(runner.folder, runner.config)
        tokenizer = self.prompts.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(runner.eos_id)

    def generate(self, prompts: list[BenchPrompt]) -> list[Generated]:
        """One generate call over all `prompts` (a batch when more than one), prompt building included."""
        inputs = [self.prompts.build(p.messages()) for p in prompts]
        batch = self.runner.model_inputs(collate(inputs, self.pad_id))
        sequences, wavs = self.runner.generate_greedy(batch, self.speaker, self.max_new_tokens,
                                                      self.talker_max_new_tokens)
        generated = sequences[:, batch["input_ids"].shape[1]:].cpu()  # [B, new]
        out = []
        for row, samples in zip(generated.tolist(), wavs):
            end = row.index(self.runner.eos_id) + 1 if self.runner.eos_id in row else len(row)
            out.append(Generated(text_tokens=end, audio_seconds=int(samples.shape[-1]) / self.runner.sample_rate))
        return out
