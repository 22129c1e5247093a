"""The talker engine of Qwen2.5-Omni: a plain codec LM, one codec token (a frame of one code
group) per step, fed by the thinker's reply parts as they stream in.

Mirrors the talker part of `Qwen2_5OmniForConditionalGeneration.generate` exactly under greedy
decoding (docs/qwen2_5-omni.md, section "The talker stage: prefill and the wait-for-reply rule"):

- Prefill = the thinker's `prompt_hidden` (one row per prompt position), the thinker embedding
  of the voice's bos token, then reply part 0 (the first generated token's). It runs as soon as
  reply part 0 is there. Positions are plain 0, 1, 2, ... on all 3 rope rows and no codec
  embedding is added: generate drops the all-ones attention mask, and the talker's forward
  builds multimodal positions and adds the codec bos/pad embeddings only when it gets a mask.
- Decode step k (k >= 1) feeds the talker's embedding of code k - 1 plus the text vector of
  step k: reply part k while the text lasts, then the text eos embedding once, then the text pad
  embedding. Reply part k comes with thinker token k + 1; a request whose reply part k has not
  arrived while the text goes on waits (its slot kept, the batch runs without it).
- Codes: repetition penalty over the talker's input ids as generate keeps them (the prompt's
  codec mask, pad and bos ids, then every generated code), codec bos suppressed, then greedy or
  sampled. An end id ends the request without a frame (generate cuts the codes before it);
  max_new_tokens N gives at most N frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.base.engine import StepResult
from services.base.finish import FinishReason
from services.base.stages import Stage
from services.base.timing import ForwardTimer
from services.runtime.lm.device_sampling import NONFINITE, Draw, mark_nonfinite
from services.runtime.lm.engine import SlotScheduledEngine
from services.runtime.lm.invariance import linear_weights
from services.runtime.lm.kernels import batch_invariant
from services.runtime.lm.packing import PackedPrompt, Packing
from services.runtime.lm.prefix.check import PrefixCase
from services.runtime.lm.prefix.keys import row_block_keys
from services.runtime.lm.prefix.prefill import Forward, Partial, PromptForward, prefill
from services.runtime.lm.sampling import SamplingConfig, nonfinite_row, select_token
from services.runtime.model.device import to_device
from services.runtime.model.qwen2_5_omni import TALKER_EOS_IDS, talker_prompt_len
from services.talker.engine_base import Frame, TalkerDone, TalkerEngineConfig, TalkerState, end_text, greedy_codes, refresh_ready


@dataclass(frozen=True)
class Qwen2_5TalkerJob:
    prompt_hidden: torch.Tensor  # [P, H_thinker] from the thinker's prefill (Qwen2_5Prefilled)
    text_embeds: torch.Tensor  # [3, H_thinker] thinker embeddings of the voice's bos, text eos, text pad
    sampling: SamplingConfig
    eos_ids: tuple[int, ...] = TALKER_EOS_IDS  # generate's talker_eos_token_id

    @property
    def prompt_len(self) -> int:
        """Cache positions of the prefill: the admission check's and the scheduler's count."""
        return talker_prompt_len(self.prompt_hidden.shape[0])


@dataclass(frozen=True)
class ReplyPart:
    reply: torch.Tensor  # [H_thinker] one generated token's last-layer hidden + layer-0 embedding


@dataclass
class _State(TalkerState):
    job: Qwen2_5TalkerJob
    replies: list[torch.Tensor] = field(default_factory=list)  # [1, 1, H_thinker] each, on the device

    @property
    def ready(self) -> bool:
        """Has the input its next step needs: reply part 0 to prefill, reply part k (or the
        text's end) for decode step k = codes so far."""
        step = len(self.codes) if self.started else 0
        return len(self.replies) > step or self.text_done


class Qwen2_5TalkerEngine(SlotScheduledEngine):
    def __init__(self, model, config, device: str = "cpu", engine_config: TalkerEngineConfig = TalkerEngineConfig()):
        if engine_config.graphs.enabled:
            raise ValueError("CUDA graphs are not implemented for the Qwen2.5-Omni talker (run it with --cuda-graphs off)")
        self.model = model  # Qwen2_5OmniTalkerForConditionalGeneration
        self.config = config  # the full Qwen2_5OmniConfig
        tc = config.talker_config
        self.device = device
        self.engine_config = engine_config
        self.vocab = int(tc.vocab_size)
        self.codec_bos, self.codec_pad, self.codec_mask = (int(tc.tts_codec_start_token_id),
                                                           int(tc.tts_codec_pad_token_id),
                                                           int(tc.tts_codec_mask_token_id))
        self.suppress = torch.zeros(self.vocab, dtype=torch.bool)  # generate's suppress_tokens=[codec_bos]
        self.suppress[self.codec_bos] = True
        # The prompt rows are the thinker's hidden states of the whole history: a conversation's
        # next turn repeats the earlier turns' rows, bit for bit where the thinker's kernels are
        # invariant (gemm), so their blocks are cached like Qwen3-Omni's talker's.
        dtype = next(model.parameters()).dtype
        self.set_up(Stage.TALKER, model.config, model.model, engine_config, device, dtype, self.vocab,
                    suppress=self.suppress)
        self.embed = model.get_input_embeddings()  # codec id -> [H_thinker]
        if engine_config.exact_batching:  # which kernels exact mode runs here (services/runtime/lm/invariance.py)
            self.start_exact_check(Stage.TALKER, engine_config.checks, gemm=engine_config.exact_gemm,
                                   capacity=engine_config.max_batch_size, linear_weights=linear_weights(model),
                                   dtype=dtype, device=device)

    # The loop's interface.
    def add(self, request_id: str, job: Qwen2_5TalkerJob) -> None:
        self.scheduler.add(request_id, job.prompt_len, job.sampling.max_new_tokens, ready=False)
        state = self._requests[request_id] = _State(job=job, **self.draw_state(job.sampling))
        if self.sampler is None:  # the host path's penalty history: the start codes (the device's: penalty_history)
            state.seen = torch.zeros(self.vocab, dtype=torch.bool)
            state.seen[self._start_codes(job)] = True

    def _start_codes(self, job: Qwen2_5TalkerJob) -> list[int]:
        """generate's talker input ids: [codec_mask] * P + [codec_pad, codec_bos], the penalty's history."""
        return [self.codec_pad, self.codec_bos] + ([self.codec_mask] if job.prompt_hidden.shape[0] else [])

    def penalty_history(self, state: _State) -> list[int]:
        """The device penalty's history of a new request: its start codes."""
        return self._start_codes(state.job)

    def add_input(self, request_id: str, payload) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return  # aborted: late input is dropped
        if isinstance(payload, ReplyPart):
            if state.text_done:
                raise ValueError("reply part after the end of the text")
            state.replies.append(payload.reply.to(self.device, self.dtype).view(1, 1, -1))
        else:
            end_text(state, payload)
        refresh_ready(self.scheduler, self._requests, [request_id])

    def after_step(self, plan) -> None:
        refresh_ready(self.scheduler, self._requests, plan.prefill + plan.decode)  # a step may wait for a reply part

    # Model work.
    @torch.inference_mode()
    def prefill(self, request_id: str, slot: int, chunk: tuple[int, int] | None = None) -> StepResult:
        state = self._requests[request_id]
        if not state.replies:  # the text ended after one token: generate has no reply part to start from
            return [(request_id, TalkerDone(FinishReason.STOP, 0))]
        inputs_embeds, ids = self._prompt_inputs(state)
        keys = row_block_keys(ids, inputs_embeds[0]) if self.prefix_pool is not None else []
        stop = chunk[1] if chunk is not None else len(ids)
        result, _ = prefill(self.prefix_pool, keys, len(ids), self.stack, self.prompt_forward(inputs_embeds, self.timer),
                            use_hits=self.prefix_hits, partial=state.partial, stop=stop)
        if stop < len(ids):
            state.partial = Partial(stop, result)
            return []
        state.partial = None
        self.take_slot(state, slot, result.cache)
        return self._after_forward([request_id], [state], result.output.logits[:, -1])

    def pack(self, request_id: str, slot: int) -> PackedPrompt | None:
        """A prompt's rows for a packed prefill; none before reply part 0."""
        state = self._requests[request_id]
        if not state.replies:
            return None
        rows, ids = self._prompt_inputs(state)
        keys = row_block_keys(ids, rows[0]) if self.prefix_pool is not None else []
        return PackedPrompt(request_id, slot, state, rows, len(ids), None, keys)

    def packed_forward(self, prompts: list[PackedPrompt], packing: Packing) -> Forward:
        """The prompts' rows [1, T, H_thinker] end to end, positions as generate's own path counts
        them (from 0 in each prompt, on all 3 rope rows)."""
        positions = torch.cat([torch.arange(n, device=self.device) for n in packing.lengths]).view(1, 1, -1).expand(3, 1, -1)
        return self.prompt_forward(torch.cat([p.inputs for p in prompts], dim=1), self.timer,
                                   attention_mask=packing.mask(self.device), position_ids=positions)

    def packed_events(self, prompts: list[PackedPrompt], spans: list[slice], output) -> StepResult:
        return self._after_forward([p.request_id for p in prompts], [p.state for p in prompts],
                                   output.logits[0, [span.stop - 1 for span in spans]])

    def _prompt_inputs(self, state: _State) -> tuple[torch.Tensor, list[int]]:
        """The prompt's rows [1, P + 2, H_thinker] (the thinker's hidden states, the voice's bos, reply
        part 0) and generate's talker ids for them."""
        job = state.job
        text = job.text_embeds.to(self.device, self.dtype)
        inputs_embeds = torch.cat((job.prompt_hidden.to(self.device, self.dtype).unsqueeze(0), text[None, :1],
                                   state.replies[0]), dim=1)  # [1, P + 2, H_thinker]
        return inputs_embeds, [self.codec_mask] * job.prompt_hidden.shape[0] + [self.codec_pad, self.codec_bos]

    def prompt_forward(self, inputs_embeds: torch.Tensor, timer, **packed) -> Forward:
        """The talker's prompt forward ([1, P, H_thinker] rows) into the cache `prefill` gives it; no
        attention mask and no position ids: generate's own path (see the module docstring), but for
        a packed forward's (`packed`: its mask and positions)."""
        def forward(cache, _prior) -> PromptForward:
            with timer:
                out = self.model(inputs_embeds=inputs_embeds, past_key_values=cache, use_cache=True, **packed)
            return PromptForward(out, cache)
        return forward

    def prefix_case(self, tokens: int, seed: int) -> PrefixCase:
        """Random thinker rows of `tokens` positions, for the prefix-hit check (prefix/check.py)."""
        hidden = self.embed.weight.shape[1]  # the thinker's width, which the talker's rows have
        rows = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(self.device, self.dtype)
        timer = ForwardTimer()  # not the engine's, which its own thread reads
        return PrefixCase(row_block_keys([self.codec_mask] * tokens, rows[0]), tokens,
                          lambda _pool: self.prompt_forward(rows, timer))

    @torch.inference_mode()
    def decode(self, request_ids: list[str], slots: list[int]) -> StepResult:
        """One talker step for every ready request: its last code's embedding + its text vector."""
        states = [self._requests[r] for r in request_ids]
        codes = to_device([[s.codes[-1]] for s in states], torch.long, self.device)  # [B, 1]
        text = torch.cat([self._text_for_step(s) for s in states], dim=0)  # [B, 1, H_thinker]
        inputs_embeds = self.embed(codes) + text
        # Plain positions: the row's cache length, on all 3 rope rows. [3, B, 1]
        position_ids = to_device([self.cache.lengths[s] for s in slots], torch.long, self.device).view(1, -1, 1).expand(3, -1, -1)
        view = self.cache.batch(slots)
        with self.timer, batch_invariant(self.engine_config.exact_batching):
            out = self.model(inputs_embeds=inputs_embeds, position_ids=position_ids, past_key_values=view, use_cache=True)
        view.commit()
        return self._after_forward(request_ids, states, out.logits[:, -1])

    def _text_for_step(self, state: _State) -> torch.Tensor:
        # Step k = codes so far: reply part k while the text lasts, then text eos once, then text pad.
        k = len(state.codes)
        if k < len(state.replies):
            return state.replies[k]
        row = 1 if k == len(state.replies) else 2
        return state.job.text_embeds[row].to(self.device, self.dtype).view(1, 1, -1)

    def _after_forward(self, request_ids, states, logits: torch.Tensor) -> StepResult:
        if self.sampler is not None:  # drawn on the device; their events come from end_step
            codes = self.sampler.sample(logits, [Draw(s.slot, s.job.sampling, s.key, len(s.codes)) for s in states])
            self._drawn.append((request_ids, states, self.host_copy.add(mark_nonfinite(codes, logits))))  # HostCopy index
            return []
        logits = logits.cpu()  # [B, vocab]; sampling runs on the host (CPU generators and masks)
        picked = greedy_codes(states, logits, self.suppress)
        events: StepResult = []
        for row, (request_id, state) in enumerate(zip(request_ids, states)):
            cfg = state.job.sampling
            code = None if nonfinite_row(logits[row], cfg) else picked[row] if row in picked else select_token(
                logits[row], cfg, torch.nonzero(state.seen).flatten().tolist(), state.generator, self.suppress)
            if code is None or nonfinite_row(logits[row], cfg, code):
                events += self.nonfinite(request_id, state.slot)
                continue
            state.seen[code] = True
            events += self._code_events(request_id, state, code)
        return events

    def end_step(self) -> StepResult:
        """The device path's events: the step's drawn codes, copied to the host at once."""
        if not self._drawn:
            return []
        drawn, self._drawn = self._drawn, []
        host = self.host_copy.fetch()
        events: StepResult = []
        for request_ids, states, codes in drawn:
            for request_id, state, code in zip(request_ids, states, host[codes].tolist()):
                events += self._code_events(request_id, state, code)
        return events

    def _code_events(self, request_id: str, state: _State, code: int) -> StepResult:
        """A drawn code's events: the end, or a frame (and the end where it is the last by length)."""
        if code == NONFINITE:
            return self.nonfinite(request_id, state.slot)
        state.codes.append(code)
        if code in state.job.eos_ids:
            return [(request_id, TalkerDone(FinishReason.STOP, state.frames))]
        events: StepResult = [(request_id, Frame(index=state.frames, codes=torch.tensor([code])))]
        state.frames += 1
        if self.scheduler.reaches_length(request_id):
            events.append((request_id, TalkerDone(FinishReason.LENGTH, state.frames)))
        return events
