"""The thinker engine of Qwen2.5-Omni: ThinkerEngine's slots, continuous batching and
batch-invariant decode, with this family's model facts and the inputs its talker needs.

Mirrors the thinker part of `Qwen2_5OmniForConditionalGeneration.generate` exactly under greedy
decoding (docs/qwen2_5-omni.md, section "The thinker stage"):

- Prefill runs through the module's own path. Its 4-row position ids (text row + the 3 rows of
  `get_rope_index`) come from the model's own `_prepare_position_ids_for_generation`, which reads
  the attention mask; the forward itself gets no mask, as in generate, which drops an all-ones
  mask once the positions are made. Decode advances the positions by one per step and passes
  them explicitly (no per-module `rope_deltas` state, so requests interleave).
- A request ends on the end ids of the thinker's own generation config (what generate stops on).

What the talker needs (`want_talker_inputs`):

- `Qwen2_5Prefilled` at prefill: `prompt_hidden` [P, H] = the last-layer hidden state + the
  layer-0 input embedding of every prompt position, the embedding zeroed at the audio / image /
  video positions of each modality whose features the prompt carries (as generate zeroes them);
  `text_embeds` [3, H] = the thinker's input embeddings of the voice's bos token (spk_dict.pt),
  of the talker's text eos and of its text pad token.
- `Token` i >= 1 carries `reply` [H]: the reply part of token i - 1 (its last-layer hidden state
  + its layer-0 embedding), from the forward of token i - 1, which is the step that made token
  i. Token 0 carries none, and the last token's own reply part is never computed (generate
  never forwards it either).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from services.base.engine import StepResult
from services.base.events import EngineEvent
from services.runtime.lm.kernels import batch_invariant
from services.runtime.model.qwen2_5_omni import text_embed_ids
from services.thinker.engine import ThinkerEngine, ThinkerEngineConfig, ThinkerJob


@dataclass(frozen=True)
class Qwen2_5ThinkerJob(ThinkerJob):
    voice_bos_token: int | None = None  # the voice's bos_token (spk_dict.pt); required with want_talker_inputs


@dataclass(frozen=True)
class Qwen2_5Prefilled(EngineEvent):
    prompt_token_ids: list[int]  # [P]
    prompt_hidden: torch.Tensor  # [P, H] last-layer hidden + layer-0 embeds (multimodal positions zeroed)
    text_embeds: torch.Tensor  # [3, H] thinker embeddings of the voice's bos, text eos, text pad


class Qwen2_5ThinkerEngine(ThinkerEngine):
    feeds_token_embeddings = False  # its talker takes reply parts (Token.reply) instead
    prefill_drops_attention_mask = True  # the NOTE in prefill

    def __init__(self, model, config, device: str = "cpu", engine_config: ThinkerEngineConfig = ThinkerEngineConfig()):
        if engine_config.graphs.enabled:
            raise ValueError("CUDA graphs are not implemented for the Qwen2.5-Omni thinker (run it with --cuda-graphs off)")
        self.model = model
        self.config = config  # the full Qwen2_5OmniConfig
        self.device = device
        self.engine_config = engine_config
        # The end ids generate's thinker stops on: its generation config, which it gets from the thinker's
        # config when the full model is built (not from the folder's generation_config.json).
        eos = GenerationConfig.from_model_config(config.thinker_config).eos_token_id
        self.eos_ids = set() if eos is None else {int(e) for e in (eos if isinstance(eos, list) else [eos])}
        mm = config.thinker_config
        # (placeholder id, the input that holds that modality's features): generate zeroes the talker's
        # layer-0 embeds at a modality's positions only when its features are in the prompt.
        self.modalities = ((int(mm.audio_token_index), "input_features"), (int(mm.image_token_index), "pixel_values"),
                           (int(mm.video_token_index), "pixel_values_videos"))
        self._init_runtime()

    @property
    def prefix_layers(self) -> tuple[int, ...]:
        return 0, -1  # Qwen2_5Prefilled reads the layer-0 inputs and the last layer (normed)

    def add(self, request_id: str, job: ThinkerJob) -> None:
        if job.want_talker_inputs and getattr(job, "voice_bos_token", None) is None:
            raise ValueError("a talker-fed Qwen2.5-Omni thinker job needs voice_bos_token")
        super().add(request_id, job)

    def prefilled(self, request_id: str, request, kwargs: dict, hidden_states, logits: torch.Tensor) -> StepResult:
        # NOTE: generate drops the attention mask once it is all ones (a prompt's always is), after the
        # 4-row positions ([4, 1, P]) are made from it, so the forward runs without one.
        events: StepResult = []
        if request.job.want_talker_inputs:
            events.append((request_id, self._prefilled(request.job, kwargs, hidden_states)))
        return events + self.first_token(request_id, request, logits)

    @torch.inference_mode()
    def decode(self, request_ids: list[str], slots: list[int]) -> StepResult:
        """One step for every request in the batch; talker-fed rows also get the reply part of the
        token they fed (the last-layer hidden state at its position + its layer-0 embedding)."""
        requests = [self._requests[r] for r in request_ids]
        ids, positions = self.step_inputs(requests, slots)
        fed = [r.job.want_talker_inputs for r in requests]
        view = self.cache.batch(slots)
        with self.timer, batch_invariant(self.engine_config.exact_batching):
            out = self.model(input_ids=ids, position_ids=positions, past_key_values=view, use_cache=True,
                             output_hidden_states=any(fed))
        view.commit()
        # hidden_states[-1]: the last layer's output after the final norm; [0]: the layer-0 inputs. [B, H]
        replies = out.hidden_states[-1][:, -1] + out.hidden_states[0][:, -1] if any(fed) else None
        if self.sampler is not None:
            self.draw(request_ids, requests, out.logits[:, -1], replies)
            return []
        logits = out.logits[:, -1].cpu()  # [B, vocab]
        replies = replies.cpu() if replies is not None else None
        picked, _ = self._greedy_rows(requests, logits)
        events: StepResult = []
        for row, (request_id, request) in enumerate(zip(request_ids, requests)):
            reply = replies[row].clone() if fed[row] else None
            events += self._sample(request_id, request, logits[row], picked.get(row), None, reply)
        return events

    def _prefilled(self, job: Qwen2_5ThinkerJob, kwargs: dict, hidden_states) -> Qwen2_5Prefilled:
        # hidden_states[0]: [1, P, H] layer-0 inputs (audio/image features merged in); [-1]: last layer, normed.
        ids = kwargs["input_ids"][0]
        embeds = hidden_states[0][0].clone()
        for token_id, features in self.modalities:
            if kwargs.get(features) is not None:
                embeds[ids == token_id] = 0.0
        prompt_hidden = hidden_states[-1][0] + embeds
        text = self.embed(torch.tensor(text_embed_ids(self.config, job.voice_bos_token), device=self.device))
        return Qwen2_5Prefilled(prompt_token_ids=ids.tolist(), prompt_hidden=prompt_hidden.cpu(), text_embeds=text.cpu())
