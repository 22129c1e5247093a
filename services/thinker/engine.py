"""The thinker engine: prefill, then one decode step per generated text token.

Mirrors `Qwen3OmniMoeThinkerForConditionalGeneration.generate` exactly under greedy decoding:
the 4-row position ids (text row + 3 multimodal-rope rows) are computed once at prefill by the
model's own `_prepare_position_ids_for_generation` and advanced by one per step, as `generate`
does, and passed explicitly (no per-module `rope_deltas` state, so requests can interleave).

Events per request: `Prefilled` (what the talker needs from the prompt), then `Token` per
generated token, then `Finished`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.common.finish import FinishReason
from services.common.prompt import PromptInputs
from services.common.sampling import SamplingConfig, select_token


@dataclass(frozen=True)
class ThinkerJob:
    prompt: PromptInputs
    sampling: SamplingConfig
    want_talker_inputs: bool  # compute the prefill hidden states the talker needs


@dataclass(frozen=True)
class Prefilled:
    prompt_token_ids: list[int]
    prompt_embeds: torch.Tensor  # [P, H] layer-0 hidden state of every prompt position
    multimodal_positions: list[int]  # prompt positions holding audio/image/video tokens
    multimodal_hidden: torch.Tensor  # [M, H] hidden state of accept_hidden_layer at those positions
    tts_embeds: torch.Tensor  # [3, H] thinker embeddings of tts_bos, tts_eos, tts_pad
    final: bool = False


@dataclass(frozen=True)
class Token:
    token_id: int
    index: int  # 0-based position among generated tokens
    embedding: torch.Tensor | None  # [H] layer-0 embedding, when the talker is fed
    last: bool  # no token follows (end token, or max_new_tokens reached)
    final: bool = False


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    generated: int
    final: bool = True


@dataclass
class _Running:
    job: ThinkerJob
    cache: object  # transformers DynamicCache
    last_position: torch.Tensor  # [4, 1, 1] position ids of the last fed token
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


class ThinkerEngine:
    def __init__(self, model, config, device: str = "cpu"):
        self.model = model
        self.config = config
        self.device = device
        self.eos_ids = {int(config.im_end_token_id)}
        self.accept_layer = int(config.talker_config.accept_hidden_layer)
        mm = config.thinker_config
        self.multimodal_ids = torch.tensor([mm.audio_token_id, mm.image_token_id, mm.video_token_id])
        self.tts_ids = torch.tensor([[config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]])
        self.embed = model.get_input_embeddings()
        self._waiting: dict[str, ThinkerJob] = {}  # request_id -> job not yet prefilled
        self._running: dict[str, _Running] = {}

    # The loop's interface.
    def add(self, request_id: str, job: ThinkerJob) -> None:
        self._waiting[request_id] = job

    def add_input(self, request_id: str, payload) -> None:
        raise ValueError("the thinker takes no streamed input")

    def abort(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        self._running.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def step(self) -> list[tuple[str, object]]:
        # Prefill one waiting request per step beside one decode step of every running one, so
        # a long prompt delays running requests by at most one prefill.
        events: list[tuple[str, object]] = []
        decoding = list(self._running)
        if self._waiting:
            request_id = next(iter(self._waiting))
            events += self.prefill(request_id, self._waiting.pop(request_id))
        for request_id in decoding:
            events += self.decode_step(request_id)
        return events

    # Model work.
    @torch.inference_mode()
    def prefill(self, request_id: str, job: ThinkerJob) -> list[tuple[str, object]]:
        from transformers import DynamicCache

        kwargs = {k: v.to(self.device) for k, v in job.prompt.model_kwargs().items()}
        position_ids = self.model._prepare_position_ids_for_generation(kwargs["input_ids"], dict(kwargs))
        cache = DynamicCache(config=self.model.config.text_config)
        out = self.model(
            **kwargs, position_ids=position_ids, past_key_values=cache, use_cache=True,
            output_hidden_states=job.want_talker_inputs,
        )
        state = _Running(job=job, cache=cache, last_position=position_ids[..., -1:].clone(),
                         generator=job.sampling.generator())
        self._running[request_id] = state
        events: list[tuple[str, object]] = []
        if job.want_talker_inputs:
            events.append((request_id, self._prefilled(kwargs["input_ids"][0], out.hidden_states)))
        return events + self._sample(request_id, state, out.logits[0, -1])

    @torch.inference_mode()
    def decode_step(self, request_id: str) -> list[tuple[str, object]]:
        state = self._running[request_id]
        state.last_position = state.last_position + 1
        ids = torch.tensor([[state.generated[-1]]], device=self.device)
        out = self.model(input_ids=ids, position_ids=state.last_position, past_key_values=state.cache, use_cache=True)
        return self._sample(request_id, state, out.logits[0, -1])

    def _prefilled(self, prompt_ids: torch.Tensor, hidden_states) -> Prefilled:
        # hidden_states[0]: [1, P, H] inputs of layer 0 (audio/image features merged in);
        # hidden_states[accept_layer]: [1, P, H] output of that decoder layer.
        mm_mask = torch.isin(prompt_ids.cpu(), self.multimodal_ids)
        positions = torch.nonzero(mm_mask).flatten()
        tts = self.embed(self.tts_ids.to(self.device))[0]
        return Prefilled(
            prompt_token_ids=prompt_ids.tolist(),
            prompt_embeds=hidden_states[0][0].cpu(),
            multimodal_positions=positions.tolist(),
            multimodal_hidden=hidden_states[self.accept_layer][0][positions.to(self.device)].cpu(),
            tts_embeds=tts.cpu(),
        )

    def _sample(self, request_id: str, state: _Running, logits: torch.Tensor) -> list[tuple[str, object]]:
        cfg = state.job.sampling
        history = state.job.prompt.input_ids[0].tolist() + state.generated if cfg.repetition_penalty != 1.0 else []
        token = select_token(logits, cfg, history, state.generator)
        state.generated.append(token)
        index = len(state.generated) - 1
        last = token in self.eos_ids or len(state.generated) >= cfg.max_new_tokens
        embedding = None
        if state.job.want_talker_inputs:
            embedding = self.embed(torch.tensor([token], device=self.device))[0].cpu()
        events: list[tuple[str, object]] = [(request_id, Token(token, index, embedding, last))]
        if last:
            reason = FinishReason.STOP if token in self.eos_ids else FinishReason.LENGTH
            events.append((request_id, Finished(reason, state.job.prompt.num_tokens, len(state.generated))))
            del self._running[request_id]
        return events
