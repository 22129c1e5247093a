"""The talker engine: codec LM plus code predictor, one frame per step, fed by streamed text.

Mirrors the talker part of `Qwen3OmniMoeForConditionalGeneration.generate` under greedy
decoding (docs/qwen3-omni.md):

- Prefill = user part + 9 assistant positions, built from the thinker's prompt hidden states
  and the first generated text token (row 0). It runs as soon as row 0 is there (section
  "The talker prefill").
- Decode step f feeds the sum of frame f's 16 codec embeddings plus text row f + 1. When that
  row has not arrived and the text is not finished, the request waits (never a pad: padding
  early diverges from the reference). After the text ends: tts_eos once, then tts_pad (section
  "The wait-for-row rule").
- One frame = layer-0 code from the talker head (repetition penalty over generated codes,
  special range suppressed except codec EOS) + 15 residual codes from the code predictor
  (fresh cache: prefill [talker hidden, code embedding], then 14 single steps) (section
  "One frame").
- max_new_tokens N yields at most N - 1 frames, as in `generate`: the N-th token's residual
  codes are never computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.base.engine import StepResult
from services.base.finish import FinishReason
from services.base.stages import Stage
from services.base.timing import ForwardTimer
from services.runtime.lm.device_sampling import (
    NONFINITE,
    Draw,
    Rows,
    SlotSampler,
    device_sampling_wanted,
    mark_nonfinite,
)
from services.runtime.lm.engine import SlotScheduledEngine
from services.runtime.lm.invariance import experts_modules, linear_weights
from services.runtime.lm.kernels import batch_invariant
from services.runtime.lm.packing import PackedPrompt, Packing
from services.runtime.lm.prefix.check import PrefixCase, plain_token_ids
from services.runtime.lm.prefix.keys import row_block_keys
from services.runtime.lm.prefix.prefill import Forward, Partial, PromptForward, prefill
from services.runtime.lm.sampling import SamplingConfig, nonfinite_row, select_token
from services.runtime.model.device import to_device, upload
from services.talker.code_predictor import CodePredictor
from services.talker.engine_base import Frame, TalkerDone, TalkerEngineConfig, TalkerState, end_text, greedy_codes, refresh_ready
from services.talker.graphs import PredictorGraphs, frame_after, talker_step


@dataclass(frozen=True)
class TalkerJob:
    prompt_token_ids: list[int]
    prompt_embeds: torch.Tensor  # [P, H_thinker] layer-0 hidden states
    multimodal_positions: list[int]
    multimodal_hidden: torch.Tensor  # [M, H_thinker] accept-layer hidden states
    tts_embeds: torch.Tensor  # [3, H_thinker] tts_bos, tts_eos, tts_pad (thinker embeddings)
    speaker_id: int
    sampling: SamplingConfig
    prompt_len: int  # cache positions of the prefill (qwen3_omni.talker_prompt_len), computed once at admission
    image_grid_thw: torch.Tensor | None = None  # [images, 3]
    audio_feature_lengths: torch.Tensor | None = None  # [audios]
    video_grid_thw: torch.Tensor | None = None  # [videos, 3]
    video_second_per_grid: torch.Tensor | None = None  # [videos]


@dataclass(frozen=True)
class TextRow:
    embedding: torch.Tensor  # [H_thinker] layer-0 embedding of one generated text token


@dataclass
class _State(TalkerState):
    job: TalkerJob
    rows: list[torch.Tensor] = field(default_factory=list)  # projected text rows, [1, 1, H]
    raw: list[torch.Tensor] = field(default_factory=list)  # text rows as they arrived ([H_thinker], host), to project
    next_codec_embed: torch.Tensor | None = None  # [1, 1, H] sum of the last frame's code embeddings
    tts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # projected bos, eos, pad, [1, 1, H]

    @property
    def ready(self) -> bool:
        """Has the input its next step needs: row 0 to prefill, row f + 1 (or the end) to decode."""
        rows = len(self.rows) + len(self.raw)
        if not self.started:
            return rows > 0 or self.text_done
        return rows > self.frames or self.text_done


def suppressed_codes(vocab: int, eos: int) -> torch.Tensor:
    """[vocab] bool: the codes generate never draws at layer 0, the special range but codec EOS."""
    suppress = torch.zeros(vocab, dtype=torch.bool)
    suppress[vocab - 1024:] = True
    suppress[eos] = False
    return suppress


def predictor_sampling(predictor) -> SamplingConfig:
    """How generate samples the residuals of a sampled talker request: the talker mirrors its do_sample
    onto the code predictor (Qwen3OmniMoeTalkerForConditionalGeneration._prepare_generation_config),
    whose generate gets top_k 50 and top_p 0.8 and keeps the predictor's own temperature (1.0 unless
    its generation config sets one), not the talker's."""
    temperature = getattr(getattr(predictor, "generation_config", None), "temperature", None)
    return SamplingConfig(temperature=float(temperature if temperature is not None else 1.0), top_k=50, top_p=0.8)


class TalkerEngine(SlotScheduledEngine):
    def __init__(self, model, config, device: str = "cpu", engine_config: TalkerEngineConfig = TalkerEngineConfig()):
        self.model = model
        self.config = config  # the full Qwen3OmniMoeConfig
        self.tc = config.talker_config
        self.device = device
        self.engine_config = engine_config
        self.eos = int(self.tc.codec_eos_token_id)
        self.suppress = suppressed_codes(self.tc.text_config.vocab_size, self.eos)
        self.num_groups = int(self.tc.num_code_groups)
        self.predictor_sampling = predictor_sampling(model.code_predictor)
        self.dtype = next(model.parameters()).dtype
        self._set_up_models()
        if engine_config.exact_batching:  # which kernels exact mode runs here (services/runtime/lm/invariance.py)
            self.start_exact_check(
                Stage.TALKER, engine_config.checks, gemm=engine_config.exact_gemm,
                capacity=engine_config.max_batch_size,
                linear_weights=linear_weights(model.model, model.codec_head, model.code_predictor),
                linear_tokens=(1, 2), experts=experts_modules(model.model),
                attention=self.predictor_cache.attention_shapes(), dtype=self.dtype, device=device)

    def _set_up_models(self) -> None:
        """The talker's LM (SlotScheduledEngine.set_up) and its code predictor: the lean loop and its
        keys and values for one frame of every row of a batch, and with CUDA graphs the predictor's
        frame, its own graph for the rows a prefill starts and, with device sampling, the end of the
        decode step's graph (one replay a decode step)."""
        model, engine_config, device, dtype = self.model, self.engine_config, self.device, self.dtype
        hidden = model.config.text_config.hidden_size
        # Device sampling (services/runtime/lm/device_sampling.py) draws the residuals inside the
        # predictor's loop too; the step's [B, 16] codes are copied back once, in end_step.
        self.residual_sampler = None
        if device_sampling_wanted(engine_config.device_sampling, device):
            self.residual_sampler = SlotSampler(engine_config.num_slots + 1,
                                                int(model.code_predictor.lm_head[0].weight.shape[0]), device)
        self.predictor_graphs = then = None
        if engine_config.graphs.enabled:
            self.predictor_graphs = PredictorGraphs(model, engine_config.graphs, engine_config.exact_batching,
                                                    device, dtype)
            if self.residual_sampler is not None:
                then = frame_after(self.predictor_graphs, self.residual_sampler)
        self.set_up(Stage.TALKER, model.config.text_config, model.model, engine_config, device, dtype,
                    self.tc.text_config.vocab_size, suppress=self.suppress, rowwise_configs=(model.code_predictor.config,),
                    step=lambda cache: talker_step(model, cache), step_input=torch.zeros((1, 1, hidden), dtype=dtype),
                    then=then)
        self.predictor_cache = CodePredictor(model, engine_config.max_batch_size, device, dtype)
        if self.predictor_graphs is not None:
            self.predictor_graphs.capture_all(hidden, dtype)
        # (request_id, state, hidden [1, 1, H], code [1] on the device or None) whose layer-0 code is
        # picked (on the host: in state.codes), residuals to come (end_step)
        self._to_predict: list[tuple[str, _State, torch.Tensor, torch.Tensor | None]] = []

    # The loop's interface.
    def add(self, request_id: str, job: TalkerJob) -> None:
        self.scheduler.add(request_id, job.prompt_len, job.sampling.max_new_tokens, ready=False)
        self._requests[request_id] = _State(job=job, **self.draw_state(job.sampling))

    def add_input(self, request_id: str, payload) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        if isinstance(payload, TextRow):
            if state.text_done:
                raise ValueError("text row after the end of the text")
            state.raw.append(payload.embedding)  # projected with the others before the next step
        else:
            end_text(state, payload)
        refresh_ready(self.scheduler, self._requests, [request_id])

    def after_step(self, plan) -> None:
        refresh_ready(self.scheduler, self._requests, plan.prefill + plan.decode)

    def _step(self) -> StepResult:
        self._project_text()
        return super()._step()

    @torch.inference_mode()
    def _project_text(self) -> None:
        """The text rows that arrived since the last step, every request's, through the text
        projection at once: one upload (pinned, not waited for on cuda) and one projection, each
        row's bits as projected alone where exact batching is on (`batch_invariant`); before, each
        row was its own blocking upload and projection as it arrived."""
        waiting = [state for state in self._requests.values() if state.raw]
        if not waiting:
            return
        rows = torch.stack([row.to(self.dtype) for state in waiting for row in state.raw])  # any dtype the thinker sent
        with batch_invariant(self.engine_config.exact_batching):
            projected = self.model.text_projection(upload(rows, self.device)[:, None])  # [N, 1, H]
        start = 0
        for state in waiting:
            state.rows += projected[start:start + len(state.raw)].split(1)
            start += len(state.raw)
            state.raw = []

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        # A step that raised between its forwards and end_step leaves rows behind: not this one's.
        self._to_predict = [row for row in self._to_predict if row[0] != request_id]

    # Model work.
    @torch.inference_mode()
    def prefill(self, request_id: str, slot: int, chunk: tuple[int, int] | None = None) -> StepResult:
        state = self._requests[request_id]
        if not state.rows:  # the text ended before any token: nothing to say
            return [(request_id, TalkerDone(FinishReason.STOP, 0))]
        inputs_embeds, talker_ids, attention_mask, position_ids = self._prompt_inputs(state)
        stop = chunk[1] if chunk is not None else talker_ids.shape[1]
        result, _ = prefill(self.prefix_pool, self._row_keys(talker_ids[0].tolist(), inputs_embeds[0]),
                            talker_ids.shape[1], self.stack,
                            self.prompt_forward(inputs_embeds, attention_mask, position_ids, self.timer),
                            use_hits=self.prefix_hits, partial=state.partial, stop=stop)
        if stop < talker_ids.shape[1]:
            state.partial = Partial(stop, result)
            return []
        state.partial = None
        out = result.output
        self.take_slot(state, slot, result.cache, position_ids)
        return self._after_forward([request_id], [state], out.logits[:, -1], out.hidden_states[0][-1][:, -1:])

    def pack(self, request_id: str, slot: int) -> PackedPrompt | None:
        """A prompt's rows and positions for a packed prefill; none before the text's first row."""
        state = self._requests[request_id]
        if not state.rows:
            return None
        rows, ids, _, positions = self._prompt_inputs(state)
        return PackedPrompt(request_id, slot, state, rows, ids.shape[1], positions, self._row_keys(ids[0].tolist(), rows[0]))

    def packed_forward(self, prompts: list[PackedPrompt], packing: Packing) -> Forward:
        """The prompts' rows [1, T, H] and positions [3, 1, T] end to end through `prompt_forward`."""
        return self.prompt_forward(torch.cat([p.inputs for p in prompts], dim=1), packing.mask(self.device),
                                   torch.cat([p.positions for p in prompts], dim=-1), self.timer)

    def packed_events(self, prompts: list[PackedPrompt], spans: list[slice], output) -> StepResult:
        last = [span.stop - 1 for span in spans]
        return self._after_forward([p.request_id for p in prompts], [p.state for p in prompts], output.logits[0, last],
                                   output.hidden_states[0][-1][0, last].unsqueeze(1))

    def _prompt_inputs(self, state: _State):
        """The prompt's rows [1, P, H], ids [1, P], mask [1, P] and positions [3, 1, P] (as generate
        builds them: the user part, then the 9 assistant positions)."""
        job, talker = state.job, self.model
        ids = torch.tensor([job.prompt_token_ids], device=self.device)  # [1, P]
        # The thinker's tensors arrive in its dtype: cast to the talker's own.
        embeds = job.prompt_embeds.to(self.device, self.dtype).unsqueeze(0)  # [1, P, Ht]
        tts = talker.text_projection(job.tts_embeds.to(self.device, self.dtype).unsqueeze(0))  # [1, 3, H]
        state.tts = tuple(t.view(1, 1, -1) for t in tts[0])  # bos, eos, pad as [1, 1, H]
        user_embeds, user_ids = self._user_part(job, ids, embeds)
        inputs_embeds = torch.cat((user_embeds, self._assistant_part(state, ids, embeds)), dim=1)
        talker_ids = torch.cat((user_ids, torch.full((1, 9), self.config.tts_pad_token_id, device=self.device)), dim=1)
        attention_mask = torch.ones_like(talker_ids)
        position_ids = talker._prepare_position_ids_for_generation(
            inputs_embeds, self._position_kwargs(job, attention_mask, talker_ids))
        return inputs_embeds, talker_ids, attention_mask, position_ids

    def prompt_forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                       timer) -> Forward:
        """The talker's prompt forward ([1, P, H] rows) into the cache `prefill` gives it, timed by `timer`."""
        def forward(cache, _prior) -> PromptForward:
            with timer:
                out = self.model(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=cache, use_cache=True, output_hidden_states=True)
            return PromptForward(out, cache)
        return forward

    def _row_keys(self, ids: list[int], rows: torch.Tensor) -> list[bytes]:
        """The pool's keys of a prompt's rows ([P, H]): a hash chain over their ids and bits."""
        return row_block_keys(ids, rows) if self.prefix_pool is not None else []

    def prefix_case(self, tokens: int, seed: int) -> PrefixCase:
        """Random rows of `tokens` text positions, for the prefix-hit check (prefix/check.py)."""
        thinker = self.config.thinker_config
        text = getattr(thinker, "text_config", thinker)
        ids = plain_token_ids((self.config, thinker, self.tc), int(text.vocab_size), tokens, seed).to(self.device)
        rows = torch.randn(1, tokens, self.tc.text_config.hidden_size,
                           generator=torch.Generator().manual_seed(seed)).to(self.device, self.dtype)
        mask = torch.ones_like(ids)
        positions = self.model._prepare_position_ids_for_generation(rows, {"attention_mask": mask,
                                                                           "talker_input_ids": ids})
        timer = ForwardTimer()  # not the engine's, which its own thread reads
        return PrefixCase(row_block_keys(ids[0].tolist(), rows[0]), tokens,
                          lambda _pool: self.prompt_forward(rows, mask, positions, timer))

    def _user_part(self, job: TalkerJob, ids: torch.Tensor, embeds: torch.Tensor):
        """Every position of every user turn (embeds [1, U, H], ids [1, U]), projected as generate
        does: all text positions in one batch, all multimodal positions in another, then gathered."""
        cfg, talker = self.config, self.model
        length = ids.shape[1]
        mm_mask = torch.zeros_like(ids, dtype=torch.bool)
        mm_mask[0, job.multimodal_positions] = True
        full = torch.empty((1, length, self.tc.text_config.hidden_size), device=self.device, dtype=embeds.dtype)
        if job.multimodal_positions:
            full[mm_mask] = talker.hidden_projection(job.multimodal_hidden.to(self.device, self.dtype))
        full[~mm_mask] = talker.text_projection(embeds[~mm_mask])
        positions = torch.arange(length, device=self.device).unsqueeze(0)
        im_start = torch.where(ids == cfg.im_start_token_id, positions, positions.new_full((), -1))
        previous = torch.cummax(im_start, dim=-1).values.clamp_min(0)
        roles = ids.gather(1, (previous + 1).clamp_max(length - 1))
        user = (roles == cfg.user_token_id)[0]
        return full[:, user], ids[:, user]

    def _assistant_part(self, state: _State, ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The 9 assistant positions [1, 9, H]: <|im_start|> assistant \n, 4 x tts_pad, tts_bos,
        text row 0, plus the codec stream [0, 0, 0, nothink, think_bos, think_eos, speaker,
        codec_pad, codec_bos]."""
        cfg, talker = self.config, self.model
        starts = torch.nonzero((ids[0, :-1] == cfg.im_start_token_id) & (ids[0, 1:] == cfg.assistant_token_id))
        start = int(starts.flatten()[-1])
        head = talker.text_projection(embeds[:, start:start + 3])  # [1, 3, H]
        bos, _, pad = state.tts
        text_part = torch.cat((head, pad.expand(1, 4, -1), bos, state.rows[0]), dim=1)
        codec_ids = torch.tensor([[self.tc.codec_nothink_id, self.tc.codec_think_bos_id, self.tc.codec_think_eos_id,
                                   state.job.speaker_id, self.tc.codec_pad_id, self.tc.codec_bos_id]], device=self.device)
        codec_part = torch.cat(
            (torch.zeros((1, 3, head.shape[-1]), device=self.device, dtype=head.dtype),
             talker.get_input_embeddings()(codec_ids)), dim=1,
        )
        return text_part + codec_part

    def _position_kwargs(self, job: TalkerJob, attention_mask: torch.Tensor, talker_ids: torch.Tensor) -> dict:
        """What the talker's rope positions are computed from (its prompt's media grids)."""
        kwargs = {"attention_mask": attention_mask, "talker_input_ids": talker_ids}
        if job.image_grid_thw is not None:
            kwargs["image_grid_thw"] = job.image_grid_thw.to(self.device)
        if job.audio_feature_lengths is not None:
            kwargs["audio_feature_lengths"] = job.audio_feature_lengths.to(self.device)
        if job.video_grid_thw is not None:  # NOTE: generate gives the talker no use_audio_in_video
            kwargs["video_grid_thw"] = job.video_grid_thw.to(self.device)
            kwargs["video_second_per_grid"] = job.video_second_per_grid.to(self.device)
        return kwargs

    @torch.inference_mode()
    def decode(self, request_ids: list[str], slots: list[int]) -> StepResult:
        """One talker step for every ready request: frame f's codec embeddings + text row f + 1."""
        states = [self._requests[r] for r in request_ids]
        # Each row's codec embeddings plus its text row, in one add (the same sums as row by row), and
        # the rows' position ids from their slots: ops that do not grow with the batch.
        inputs_embeds = (torch.cat([s.next_codec_embed for s in states])
                         + torch.cat([self._text_for_next_step(s) for s in states]))
        position_ids = self.positions.advance(to_device(slots, torch.long, self.device))
        rows = Rows(self._draws(states), self.device) if self.sampler is not None else None
        framing = rows is not None and self.graphs is not None and self.graphs.then is not None
        more = (Rows(self._residual_draws(states), self.device).params,) if framing and rows.sampled else ()
        with self.timer:
            replayed = self.graphs.decode(inputs_embeds, position_ids, slots, rows, more) \
                if self.graphs is not None else None
        if replayed is not None and framing:  # the whole frame made inside the graph (frame_after)
            marked, codes, embeds = replayed
            # (request_ids, states, codes [B, 16], the layer-0 codes' host view [B], embeds [B, 1, H]):
            # copied back with the predicted ones in end_step
            self._drawn.append(([*request_ids], states, codes, marked, embeds))
            return []
        if replayed is not None and rows is not None:  # layer-0 codes drawn inside the graph
            codes, marked, hidden = replayed
            return self._after_forward(request_ids, states, None, hidden, drawn=(codes, marked))
        if replayed is not None:
            return self._after_forward(request_ids, states, *replayed)
        view = self.cache.batch(slots)
        with self.timer, batch_invariant(self.engine_config.exact_batching):
            out = self.model(
                inputs_embeds=inputs_embeds, position_ids=position_ids,
                past_key_values=view, use_cache=True, output_hidden_states=True,
                generation_step=0,  # bookkeeping of generate only: the forward returns it + 1
            )
        view.commit()
        return self._after_forward(request_ids, states, out.logits[:, -1], out.hidden_states[0][-1][:, -1:], rows=rows)

    @staticmethod
    def _draws(states: list[_State]) -> list[Draw]:
        return [Draw(s.slot, s.job.sampling, s.key, 16 * s.frames) for s in states]

    @staticmethod
    def _text_for_next_step(state: _State) -> torch.Tensor:
        # Text for step f is row f + 1; past the end: tts_eos once, then tts_pad.
        f = state.frames - 1
        if f + 1 < len(state.rows):
            return state.rows[f + 1]
        return state.tts[1] if f + 1 == len(state.rows) else state.tts[2]

    def _after_forward(self, request_ids, states, logits: torch.Tensor | None, hidden: torch.Tensor,
                       rows: Rows | None = None, drawn: tuple[torch.Tensor, torch.Tensor] | None = None):
        # logits: [B, vocab]; hidden: [B, 1, H] last layer at the last position; `rows`: the device
        # sampler's settings of the rows, made once a step; `drawn`: (codes, their host view) a graph drew.
        if self.sampler is not None:  # drawn on the device; which rows end is known in end_step
            if drawn is None:
                codes = self.sampler.sample(logits, rows if rows is not None else self._draws(states))
                drawn = codes, mark_nonfinite(codes, logits)  # what the host reads of the layer-0 codes
            codes, marked = drawn
            self._to_predict += [(request_id, state, hidden[row:row + 1], (codes[row:row + 1], marked[row:row + 1]))
                                 for row, (request_id, state) in enumerate(zip(request_ids, states))]
            return []
        logits = logits.cpu()  # sampling runs on the host (CPU generators and masks); a no-op on CPU
        picked = greedy_codes(states, logits, self.suppress)
        events: StepResult = []
        keep: list[int] = []  # rows that go on to make a frame
        for row, (request_id, state) in enumerate(zip(request_ids, states)):
            cfg = state.job.sampling
            code = None if nonfinite_row(logits[row], cfg) else picked[row] if row in picked else \
                select_token(logits[row], cfg, state.codes, state.generator, self.suppress)
            if code is None or nonfinite_row(logits[row], cfg, code):
                events += self.nonfinite(request_id, state.slot)
                continue
            state.codes.append(code)
            if state.seen is None:
                state.seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
            state.seen[code] = True
            if code == self.eos:
                events.append((request_id, TalkerDone(FinishReason.STOP, state.frames)))
            elif self.scheduler.reaches_length(request_id):
                events.append((request_id, TalkerDone(FinishReason.LENGTH, state.frames)))
            else:
                keep.append(row)
        # Their residual codes come at the end of the step, for the prefilled rows and the decoded
        # ones together (end_step).
        self._to_predict += [(request_ids[row], states[row], hidden[row:row + 1], None) for row in keep]
        return events

    @torch.inference_mode()
    def end_step(self) -> StepResult:
        """The code predictor over every row this step's prefills and decode left, in one batch.

        NOTE: why together. The predictor's 15 small steps cost about as much for one row as for a
        batch (6.1 of a 7.8 ms prefill on the tiny checkpoint, in-process), so a prefill that ran
        them for its row alone made each step of a burst pay them twice. The predictor is batch-
        invariant (code_predictor.py), so each row's codes are the same either way."""
        if not self._to_predict and not self._drawn:
            return []
        rows, self._to_predict = self._to_predict, []
        if self.sampler is not None:
            return self._device_frames(rows)
        states, past_hidden = [state for _, state, *_ in rows], torch.cat([hidden for _, _, hidden, _ in rows])
        with self.timer:
            codes, embeds = self.predict_residuals(states, past_hidden)
        events: StepResult = []
        for i, (request_id, state, *_) in enumerate(rows):
            state.next_codec_embed = embeds[i:i + 1]
            events.append((request_id, Frame(index=state.frames, codes=codes[i])))
            state.frames += 1
        return events

    def _device_frames(self, rows) -> StepResult:
        """The device path's end of a step: every row's residuals (a row whose layer-0 code ends it
        too: which ones do is known once the codes are on the host) where a decode graph did not make
        them, then the [R, 16] codes copied back, the step's one host sync; the frames and ends as the
        host path gives them."""
        parts, self._drawn = self._drawn, []
        if rows:
            states = [state for _, state, *_ in rows]
            with self.timer:
                codes, embeds = self.predict_frame(states, torch.cat([hidden for _, _, hidden, _ in rows]),
                                                   torch.cat([code for *_, (code, _) in rows])[:, None])
            parts = [([r for r, *_ in rows], states, codes, torch.cat([marked for *_, (_, marked) in rows]), embeds),
                     *parts]
        request_ids = [r for part in parts for r in part[0]]
        states = [s for part in parts for s in part[1]]
        codes, marked, embeds = (torch.cat([part[k] for part in parts]) if len(parts) > 1 else parts[0][k]
                                 for k in (2, 3, 4))
        self.host_copy.add(codes)
        self.host_copy.add(marked)
        codes, marked = self.host_copy.fetch()
        frames, firsts = codes.unbind(0), marked.tolist()  # views of the one host copy
        events: StepResult = []
        for i, (request_id, state) in enumerate(zip(request_ids, states)):
            code = firsts[i]
            if code == NONFINITE:
                events += self.nonfinite(request_id, state.slot)
                continue
            state.codes.append(code)
            if code == self.eos:
                events.append((request_id, TalkerDone(FinishReason.STOP, state.frames)))
            elif self.scheduler.reaches_length(request_id):
                events.append((request_id, TalkerDone(FinishReason.LENGTH, state.frames)))
            else:
                state.next_codec_embed = embeds[i:i + 1]
                events.append((request_id, Frame(index=state.frames, codes=frames[i])))
                state.frames += 1
        return events

    def predict_residuals(self, states: list[_State], past_hidden: torch.Tensor):
        """Code predictor for a batch of frames: fresh cache, prefill [talker hidden, layer-0 code
        embedding], then num_code_groups - 2 single steps. Returns (codes [B, 16] on the host, embed
        sums [B, 1, H])."""
        codes, codec_embed = self.predict_frame(states, past_hidden,
                                                torch.tensor([[s.codes[-1]] for s in states], device=self.device))
        return codes.cpu(), codec_embed

    def predict_frame(self, states: list[_State], past_hidden: torch.Tensor, codes0: torch.Tensor):
        """`predict_residuals` from the layer-0 codes [B, 1] on the device, its codes left there."""
        if self.predictor_graphs is not None and all(s.job.sampling.greedy for s in states):
            replayed = self.predictor_graphs.predict(past_hidden, codes0)
            if replayed is not None:
                codes, codec_embed = replayed
                return codes.to(torch.int64), codec_embed
        if all(s.job.sampling.greedy for s in states):
            pick = _argmax_rows  # argmax is exact: a batch's rows pick what each picks alone
        elif self.residual_sampler is not None:
            pick = self._residual_picks(states)
        else:
            pick = lambda logits: torch.tensor(  # noqa: E731  (rows picked on the host: a no-op on CPU)
                [self._pick_residual(row, s) for row, s in zip(logits.cpu(), states)], device=self.device)
        codes, codec_embed = self.predictor_cache(past_hidden, codes0, pick, self.engine_config.exact_batching)
        return codes.to(torch.int64), codec_embed

    def _residual_draws(self, states: list[_State]) -> list[Draw]:
        """The residuals' draws: sampled rows as generate samples them (`predictor_sampling`), greedy
        ones by argmax; group g of frame f draws with counter 16 f + g (`counter_offset` g)."""
        return [Draw(0, self.predictor_sampling if not s.job.sampling.greedy else SamplingConfig(), s.key,
                     16 * s.frames) for s in states]

    def _residual_picks(self, states: list[_State]):
        """The predictor's picks on the device (`_residual_draws`), batched over the rows."""
        rows = Rows(self._residual_draws(states), self.device)
        groups = iter(range(1, self.num_groups))
        return lambda logits: self.residual_sampler.sample(logits, rows, remember=False, counter_offset=next(groups))

    def _pick_residual(self, logits: torch.Tensor, state: _State) -> int:
        if state.job.sampling.greedy:
            return int(torch.argmax(logits))
        return select_token(logits, self.predictor_sampling, [], state.generator)


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)
