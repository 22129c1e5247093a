"""The talker engine: codec LM plus code predictor, one frame per step, fed by streamed text.

Mirrors the talker part of `Qwen3OmniMoeForConditionalGeneration.generate` under greedy
decoding (NOTES-qwen3-omni.md, "What the talker needs"):

- Prefill = user part + 9 assistant positions, built from the thinker's prompt hidden states
  and the first generated text token (row 0). It runs as soon as row 0 is there.
- Decode step f feeds the sum of frame f's 16 codec embeddings plus text row f + 1. When that
  row has not arrived and the text is not finished, the request waits (never a pad: padding
  early diverges from the reference). After the text ends: tts_eos once, then tts_pad.
- One frame = layer-0 code from the talker head (repetition penalty over generated codes,
  special range suppressed except codec EOS) + 15 residual codes from the code predictor
  (fresh cache: prefill [talker hidden, code embedding], then 14 single steps).
- max_new_tokens N yields at most N - 1 frames, as in `generate`: the N-th token's residual
  codes are never computed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from services.common.finish import FinishReason
from services.common.sampling import SamplingConfig, select_token


@dataclass(frozen=True)
class TalkerJob:
    prompt_token_ids: list[int]
    prompt_embeds: torch.Tensor  # [P, H_thinker] layer-0 hidden states
    multimodal_positions: list[int]
    multimodal_hidden: torch.Tensor  # [M, H_thinker] accept-layer hidden states
    tts_embeds: torch.Tensor  # [3, H_thinker] tts_bos, tts_eos, tts_pad (thinker embeddings)
    speaker_id: int
    sampling: SamplingConfig
    image_grid_thw: torch.Tensor | None = None  # [images, 3]
    audio_feature_lengths: torch.Tensor | None = None  # [audios]


@dataclass(frozen=True)
class TextRow:
    embedding: torch.Tensor  # [H_thinker] layer-0 embedding of one generated text token


@dataclass(frozen=True)
class TextEnd:
    pass


@dataclass(frozen=True)
class Frame:
    index: int
    codes: torch.Tensor  # [num_code_groups] int64
    final: bool = False


@dataclass(frozen=True)
class TalkerDone:
    reason: FinishReason
    frames: int
    final: bool = True


class Phase(enum.Enum):
    WAIT_FIRST_TEXT = "wait_first_text"
    DECODE = "decode"


@dataclass
class _State:
    job: TalkerJob
    phase: Phase = Phase.WAIT_FIRST_TEXT
    rows: list[torch.Tensor] = field(default_factory=list)  # projected text rows, [1, 1, H]
    text_done: bool = False
    cache: object = None
    last_position: torch.Tensor | None = None  # [4, 1, 1]
    codes: list[int] = field(default_factory=list)  # generated layer-0 codes
    frames: int = 0
    next_codec_embed: torch.Tensor | None = None  # [1, 1, H] sum of the last frame's code embeddings
    tts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # projected bos, eos, pad, [1, 1, H]
    generator: torch.Generator | None = None


class TalkerEngine:
    def __init__(self, model, config, device: str = "cpu"):
        self.model = model
        self.config = config  # the full Qwen3OmniMoeConfig
        self.tc = config.talker_config
        self.device = device
        vocab = self.tc.text_config.vocab_size
        self.eos = int(self.tc.codec_eos_token_id)
        self.suppress = torch.zeros(vocab, dtype=torch.bool)
        self.suppress[vocab - 1024:] = True
        self.suppress[self.eos] = False
        self.num_groups = int(self.tc.num_code_groups)
        self._states: dict[str, _State] = {}  # request_id -> state

    # The loop's interface.
    def add(self, request_id: str, job: TalkerJob) -> None:
        self._states[request_id] = _State(job=job, generator=job.sampling.generator())

    def add_input(self, request_id: str, payload) -> None:
        state = self._states.get(request_id)
        if state is None:
            return
        if isinstance(payload, TextRow):
            if state.text_done:
                raise ValueError("text row after the end of the text")
            with torch.inference_mode():
                state.rows.append(self.model.text_projection(payload.embedding.to(self.device).view(1, 1, -1)))
        elif isinstance(payload, TextEnd):
            state.text_done = True
        else:
            raise TypeError(f"unexpected talker input {type(payload).__name__}")

    def abort(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def has_work(self) -> bool:
        return any(self._ready(s) for s in self._states.values())

    @property
    def queue_depth(self) -> int:
        return sum(1 for s in self._states.values() if s.phase is Phase.WAIT_FIRST_TEXT)

    @property
    def running(self) -> int:
        return sum(1 for s in self._states.values() if s.phase is Phase.DECODE)

    def _ready(self, state: _State) -> bool:
        if state.phase is Phase.WAIT_FIRST_TEXT:
            return bool(state.rows) or state.text_done
        return len(state.rows) > state.frames or state.text_done

    def step(self) -> list[tuple[str, object]]:
        events: list[tuple[str, object]] = []
        for request_id, state in list(self._states.items()):
            if not self._ready(state):
                continue  # waits for its next text row without holding others back
            if state.phase is Phase.WAIT_FIRST_TEXT:
                events += self.prefill(request_id, state)
            else:
                events += self.decode_step(request_id, state)
        return events

    # Model work.
    @torch.inference_mode()
    def prefill(self, request_id: str, state: _State) -> list[tuple[str, object]]:
        from transformers import DynamicCache

        if not state.rows:  # the text ended before any token: nothing to say
            return self._finish(request_id, FinishReason.STOP)
        job, cfg, talker = state.job, self.config, self.model
        ids = torch.tensor([job.prompt_token_ids], device=self.device)  # [1, P]
        embeds = job.prompt_embeds.to(self.device).unsqueeze(0)  # [1, P, Ht]
        tts = talker.text_projection(job.tts_embeds.to(self.device).unsqueeze(0))  # [1, 3, H]
        state.tts = tuple(t.view(1, 1, -1) for t in tts[0])  # bos, eos, pad as [1, 1, H]

        # User part: every position of every user turn; projected as generate does (all text
        # positions in one batch, all multimodal positions in another), then gathered.
        length = ids.shape[1]
        mm_mask = torch.zeros_like(ids, dtype=torch.bool)
        mm_mask[0, job.multimodal_positions] = True
        full = torch.empty((1, length, self.tc.text_config.hidden_size), device=self.device, dtype=embeds.dtype)
        if job.multimodal_positions:
            full[mm_mask] = talker.hidden_projection(job.multimodal_hidden.to(self.device))
        full[~mm_mask] = talker.text_projection(embeds[~mm_mask])
        positions = torch.arange(length, device=self.device).unsqueeze(0)
        im_start = torch.where(ids == cfg.im_start_token_id, positions, positions.new_full((), -1))
        previous = torch.cummax(im_start, dim=-1).values.clamp_min(0)
        roles = ids.gather(1, (previous + 1).clamp_max(length - 1))
        user = (roles == cfg.user_token_id)[0]
        user_embeds = full[:, user]  # [1, U, H]
        user_ids = ids[:, user]

        # Assistant part: <|im_start|> assistant \n, 4 x tts_pad, tts_bos, first text token, plus
        # the codec stream [0, 0, 0, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos].
        starts = torch.nonzero((ids[0, :-1] == cfg.im_start_token_id) & (ids[0, 1:] == cfg.assistant_token_id))
        start = int(starts.flatten()[-1])
        head = talker.text_projection(embeds[:, start:start + 3])  # [1, 3, H]
        bos, _, pad = state.tts
        text_part = torch.cat((head, pad.expand(1, 4, -1), bos, state.rows[0]), dim=1)
        codec_ids = torch.tensor([[self.tc.codec_nothink_id, self.tc.codec_think_bos_id, self.tc.codec_think_eos_id,
                                   job.speaker_id, self.tc.codec_pad_id, self.tc.codec_bos_id]], device=self.device)
        codec_part = torch.cat(
            (torch.zeros((1, 3, head.shape[-1]), device=self.device, dtype=head.dtype),
             talker.get_input_embeddings()(codec_ids)), dim=1,
        )
        inputs_embeds = torch.cat((user_embeds, text_part + codec_part), dim=1)
        talker_ids = torch.cat((user_ids, torch.full((1, 9), cfg.tts_pad_token_id, device=self.device)), dim=1)
        attention_mask = torch.ones_like(talker_ids)

        model_kwargs = {"attention_mask": attention_mask, "talker_input_ids": talker_ids}
        if job.image_grid_thw is not None:
            model_kwargs["image_grid_thw"] = job.image_grid_thw.to(self.device)
        if job.audio_feature_lengths is not None:
            model_kwargs["audio_feature_lengths"] = job.audio_feature_lengths.to(self.device)
        position_ids = talker._prepare_position_ids_for_generation(inputs_embeds, dict(model_kwargs))
        state.cache = DynamicCache(config=self.tc.text_config)
        out = talker(
            inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=state.cache, use_cache=True, output_hidden_states=True,
        )
        state.last_position = position_ids[..., -1:].clone()
        state.phase = Phase.DECODE
        return self._after_forward(request_id, state, out)

    @torch.inference_mode()
    def decode_step(self, request_id: str, state: _State) -> list[tuple[str, object]]:
        # Text for step f is row f + 1; past the end: tts_eos once, then tts_pad.
        f = state.frames - 1
        if f + 1 < len(state.rows):
            text = state.rows[f + 1]
        elif f + 1 == len(state.rows):
            text = state.tts[1]
        else:
            text = state.tts[2]
        state.last_position = state.last_position + 1
        out = self.model(
            inputs_embeds=state.next_codec_embed + text, position_ids=state.last_position,
            past_key_values=state.cache, use_cache=True, output_hidden_states=True,
            generation_step=f,  # bookkeeping only: the forward returns it + 1
        )
        return self._after_forward(request_id, state, out)

    def _after_forward(self, request_id: str, state: _State, out) -> list[tuple[str, object]]:
        cfg = state.job.sampling
        code = select_token(out.logits[0, -1], cfg, state.codes, state.generator, self.suppress)
        state.codes.append(code)
        if code == self.eos:
            return self._finish(request_id, FinishReason.STOP)
        if len(state.codes) >= cfg.max_new_tokens:
            return self._finish(request_id, FinishReason.LENGTH)
        past_hidden = out.hidden_states[0][-1][:, -1:]  # [1, 1, H] last layer, last position
        codes, state.next_codec_embed = self.predict_residuals(code, past_hidden, state)
        frame = Frame(index=state.frames, codes=codes)
        state.frames += 1
        return [(request_id, frame)]

    def predict_residuals(self, code0: int, past_hidden: torch.Tensor, state: _State):
        """Code predictor: 15 residual codes for one frame; returns (codes [16], embed sum [1,1,H])."""
        from transformers import DynamicCache

        predictor = self.model.code_predictor
        embeddings = predictor.get_input_embeddings()  # ModuleList of num_code_groups - 1
        first = self.model.get_input_embeddings()(torch.tensor([[code0]], device=self.device))  # [1, 1, H]
        cache = DynamicCache(config=predictor.config)
        out = predictor(inputs_embeds=torch.cat((past_hidden, first), dim=1), past_key_values=cache, use_cache=True)
        codes, hiddens = [code0], [first]
        greedy = state.job.sampling.greedy
        for step in range(1, self.num_groups):
            logits = out.logits[0, -1]
            code = int(torch.argmax(logits)) if greedy else self._sample_residual(logits, state)
            codes.append(code)
            ids = torch.tensor([[code]], device=self.device)
            hiddens.append(embeddings[step - 1](ids))
            if step < self.num_groups - 1:
                out = predictor(input_ids=ids, past_key_values=cache, use_cache=True, generation_steps=step)
        codec_embed = torch.cat(hiddens, dim=1).sum(1, keepdim=True)
        return torch.tensor(codes, dtype=torch.int64), codec_embed

    @staticmethod
    def _sample_residual(logits: torch.Tensor, state: _State) -> int:
        # As generate samples the code predictor: top_k 50, top_p 0.8, the talker's temperature.
        cfg = SamplingConfig(temperature=state.job.sampling.temperature, top_k=50, top_p=0.8)
        return select_token(logits, cfg, [], state.generator)

    def _finish(self, request_id: str, reason: FinishReason) -> list[tuple[str, object]]:
        state = self._states.pop(request_id)
        return [(request_id, TalkerDone(reason=reason, frames=state.frames))]
