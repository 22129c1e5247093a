"""The thinker engine: prefill, then one decode step per generated text token.

Continuous batching: each step prefills waiting requests (one at a time, through the module's own
path) beside one batched decode step of every running request (services/runtime/lm/kernels.py).

Mirrors `Qwen3OmniMoeThinkerForConditionalGeneration.generate` exactly under greedy decoding:
the 4-row position ids (text row + 3 multimodal-rope rows) are computed once at prefill by the
model's own `_prepare_position_ids_for_generation` and advanced by one per step, as `generate`
does, and passed explicitly (no per-module `rope_deltas` state, so requests can interleave).

Events per request: `Prefilled` (what the talker needs from the prompt), then `Token` per
generated token, then `Finished`. A job with `forced_ids` takes those ids in place of sampling
(its `max_new_tokens` is their count): text-to-speech of a given text.

Audio first: a `HoldText` input stops a request after `lead` tokens until `ReleaseText` (the
server sends it when the talker answers) or until its time is up: the request sits out the steps
no other request takes (it rides along in those another one does). Where the stages share cores,
text nobody hears yet then does not compete with the first audio chunk's compute when the thinker
has nothing else to do. Holding changes when tokens come, never which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from services.base.engine import StepResult
from services.base.events import EngineEvent
from services.base.finish import FinishReason
from services.base.stages import Stage
from services.base.timing import ForwardTimer
from services.runtime.inputs.prompt import PromptInputs
from services.runtime.lm.device_sampling import NONFINITE, Draw, Rows, mark_nonfinite
from services.runtime.lm.engine import LMEngineConfig, RequestState, SlotScheduledEngine
from services.runtime.lm.invariance import experts_modules, linear_weights
from services.runtime.lm.kernels import batch_invariant
from services.runtime.lm.packing import PackedPrompt, Packing
from services.runtime.lm.prefix.check import PrefixCase, plain_token_ids
from services.runtime.lm.prefix.keys import PromptPrefix, block_keys
from services.runtime.lm.prefix.pool import PrefixPool
from services.runtime.lm.prefix.prefill import Forward, Partial, Prior, PromptForward, forward_pre_hook, prefill
from services.runtime.lm.sampling import SamplingConfig, nonfinite_row, select_token
from services.runtime.model.device import to_device
from services.thinker.encoder_cache import MEDIA_INPUTS, EncoderCache, PerItemEncoders
from services.thinker.graphs import thinker_step


@dataclass(frozen=True)
class ThinkerJob:
    prompt: PromptInputs
    sampling: SamplingConfig
    want_talker_inputs: bool  # compute the prefill hidden states the talker needs
    # Forced output (text-to-speech): these ids, the end token last, are the "generated" tokens.
    # Each is fed through the model exactly as a sampled one would be (same cache, positions and
    # embeddings), so everything downstream sees what `generate` gives had it produced these ids.
    forced_ids: tuple[int, ...] = ()
    # Its messages as the prefix cache keys them (services/runtime/lm/prefix/); None: not cached.
    prefix: PromptPrefix | None = None


@dataclass(frozen=True)
class Prefilled(EngineEvent):
    prompt_token_ids: list[int]
    prompt_embeds: torch.Tensor  # [P, H] layer-0 hidden state of every prompt position
    multimodal_positions: list[int]  # prompt positions holding audio/image/video tokens
    multimodal_hidden: torch.Tensor  # [M, H] hidden state of accept_hidden_layer at those positions
    tts_embeds: torch.Tensor  # [3, H] thinker embeddings of tts_bos, tts_eos, tts_pad


@dataclass(frozen=True)
class Token(EngineEvent):
    token_id: int
    index: int  # 0-based position among generated tokens
    embedding: torch.Tensor | None  # [H] layer-0 embedding, when the talker is fed (Qwen3-Omni)
    last: bool  # no token follows (end token, or max_new_tokens reached)
    # Qwen2.5-Omni, when the talker is fed: the reply part of the token before this one (index - 1),
    # [H] = its last-layer hidden state + its layer-0 embedding, from the forward that made this
    # token (services/thinker/qwen2_5.py); None on token 0 and for Qwen3-Omni.
    reply: torch.Tensor | None = None


@dataclass(frozen=True)
class Finished(EngineEvent):
    reason: FinishReason
    prompt_tokens: int
    generated: int
    final: ClassVar[bool] = True


@dataclass(frozen=True)
class HoldText:
    """Thinker input: generate at most `lead` tokens of the request until `ReleaseText` comes, for
    `seconds` at most (then it runs freely: a talker that never answers cannot stall its text)."""
    lead: int
    seconds: float


@dataclass(frozen=True)
class ReleaseText:
    """Thinker input: the talker has answered; the request's text runs freely."""


@dataclass
class _Request(RequestState):
    job: ThinkerJob
    generated: list[int] = field(default_factory=list)
    hold: tuple[int, float] | None = None  # HoldText's (lead, monotonic deadline) until released
    inputs: tuple[dict, torch.Tensor] | None = None  # a chunked prompt's model inputs and positions, from its first chunk


@dataclass(frozen=True)
class ThinkerEngineConfig(LMEngineConfig):
    """The thinker engine's settings."""

    encoder_cache_mb: int = 0  # the media encoders' outputs kept by content (encoder_cache.py); 0: none kept

    @classmethod
    def from_args(cls, args, model) -> ThinkerEngineConfig:
        return dataclasses.replace(super().from_args(args, model), encoder_cache_mb=args.encoder_cache_mb)


class ThinkerEngine(SlotScheduledEngine):
    # Token events of talker-fed requests carry the token's layer-0 embedding (Qwen3-Omni's talker input).
    feeds_token_embeddings: ClassVar[bool] = True
    # The prompt's forward gets no attention mask (Qwen2.5-Omni's generate drops an all-ones one).
    prefill_drops_attention_mask: ClassVar[bool] = False

    def __init__(self, model, config, device: str = "cpu", engine_config: ThinkerEngineConfig = ThinkerEngineConfig()):
        self.model = model
        self.config = config
        self.device = device
        self.engine_config = engine_config
        self.eos_ids = {int(config.im_end_token_id)}
        self.accept_layer = int(config.talker_config.accept_hidden_layer)
        mm = config.thinker_config
        self.multimodal_ids = torch.tensor([mm.audio_token_id, mm.image_token_id, mm.video_token_id])
        self.tts_ids = torch.tensor([[config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]])
        self._init_runtime()

    def _init_runtime(self) -> None:
        """Every family's thinker set up alike (SlotScheduledEngine.set_up), then exact mode's check."""
        model, engine_config = self.model, self.engine_config
        self.embed = model.get_input_embeddings()
        dtype = next(model.parameters()).dtype
        identity = f"{getattr(model.config, '_name_or_path', '')} {dtype} {self.device} gemm={engine_config.exact_gemm}"
        self.encoder_cache = EncoderCache(engine_config.encoder_cache_mb << 20, identity) \
            if engine_config.encoder_cache_mb > 0 else None
        self.encoders = PerItemEncoders(model, self.encoder_cache) if self.encoder_cache is not None else None
        self.set_up(Stage.THINKER, model.config.text_config, model.model, engine_config, self.device, dtype,
                    int(model.lm_head.weight.shape[0]), step=lambda cache: thinker_step(model, cache),
                    step_input=torch.zeros((1, 1), dtype=torch.long), extra_layers=len(self.prefix_layers))
        if engine_config.exact_batching:  # which kernels exact mode runs here (services/runtime/lm/invariance.py)
            decoder = [model.model, model.lm_head]
            self.start_exact_check(Stage.THINKER, engine_config.checks, gemm=engine_config.exact_gemm,
                                   capacity=engine_config.max_batch_size, linear_weights=linear_weights(*decoder),
                                   experts=experts_modules(*decoder), dtype=dtype, device=self.device)

    @property
    def prefix_layers(self) -> tuple[int, ...]:
        """The hidden states (indices into a forward's `hidden_states`) the talker's inputs are read
        from at prefill: kept per prefix-cache block, so a hit gives the same `Prefilled`."""
        return 0, self.accept_layer

    def prefix_case(self, tokens: int, seed: int) -> PrefixCase:
        """A text prompt of `tokens` plain ids, for the prefix-hit check (prefix/check.py)."""
        vocab = int(self.model.config.text_config.vocab_size)
        configs = (self.config, getattr(self.config, "thinker_config", None), self.model.config.text_config)
        ids = plain_token_ids(configs, vocab, tokens, seed).to(self.device)
        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        positions = self.model._prepare_position_ids_for_generation(ids, dict(kwargs))
        if self.prefill_drops_attention_mask:
            kwargs.pop("attention_mask")
        timer = ForwardTimer()  # not the engine's, which its own thread reads
        return PrefixCase(block_keys(ids[0].tolist(), {}), tokens,
                          lambda pool: self.prompt_forward(kwargs, positions, True, pool, timer))

    # The loop's interface.
    def add(self, request_id: str, job: ThinkerJob) -> None:
        self.scheduler.add(request_id, job.prompt.num_tokens, job.sampling.max_new_tokens)
        self._requests[request_id] = _Request(job=job, **self.draw_state(job.sampling))

    def add_input(self, request_id: str, payload) -> None:
        request = self._requests.get(request_id)
        match payload:
            case HoldText(lead, seconds):
                if request is not None:
                    request.hold = (lead, time.monotonic() + seconds)
            case ReleaseText():
                if request is not None:
                    request.hold = None
                    self.scheduler.set_ready(request_id, True)
            case _:
                raise ValueError(f"the thinker takes no streamed input ({type(payload).__name__})")

    def _apply_holds(self) -> None:
        """Holds past their deadline end; a request at its lead sits out the steps, unless another
        request takes the step anyway: then it rides along (a row more in a batched step costs
        little, and a thinker that steps for held requests one at a time later costs more)."""
        now = time.monotonic()
        held = []
        for request_id, request in self._requests.items():
            if request.hold is not None and now >= request.hold[1]:
                request.hold = None
                self.scheduler.set_ready(request_id, True)
            elif request.hold is not None and len(request.generated) >= request.hold[0]:
                held.append(request_id)
        others = len(held) < len(self._requests)
        for request_id in held:
            self.scheduler.set_ready(request_id, others)

    def has_work(self) -> bool:
        self._apply_holds()
        return self.scheduler.has_work

    def step(self) -> StepResult:
        self._apply_holds()
        return super().step()

    def wake_in(self) -> float | None:
        """Seconds until the earliest hold ends (the loop then steps without a command), or None."""
        deadlines = [r.hold[1] for r in self._requests.values() if r.hold is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    # Model work.
    @torch.inference_mode()
    def prefill(self, request_id: str, slot: int, chunk: tuple[int, int] | None = None) -> StepResult:
        """One request through the module's own path (as generate runs it), then into its slot; with
        `chunk`, the prompt positions [start, stop) only (no events before the last chunk)."""
        request = self._requests[request_id]
        done = self._prefill_forward(request, slot, chunk)
        if done is None:
            return []
        out, kwargs = done
        return self.prefilled(request_id, request, kwargs, out.hidden_states, out.logits[0, -1])

    def prefilled(self, request_id: str, request: _Request, kwargs: dict, hidden_states, logits: torch.Tensor
                  ) -> StepResult:
        """A finished prefill's events: what the talker needs of the prompt (hidden_states: the whole
        prompt's, [1, P, H] each), then the first token from the last row's `logits` [vocab]."""
        events: StepResult = []
        if request.job.want_talker_inputs:
            events.append((request_id, self._prefilled(kwargs["input_ids"][0], hidden_states)))
        return events + self.first_token(request_id, request, logits)

    def first_token(self, request_id: str, request: _Request, logits: torch.Tensor) -> StepResult:
        """The token after the prompt from its last row's `logits` [vocab]: its events, or none yet
        where the device draws it (they come from end_step)."""
        if self.sampler is None:
            return self._sample(request_id, request, logits.cpu())
        self.draw([request_id], [request], logits[None])
        return []

    def penalty_history(self, request: _Request) -> list[int]:
        """The device penalty's history of a new request: its prompt's ids (where it has a penalty)."""
        return request.job.prompt.input_ids[0].tolist() if request.job.sampling.repetition_penalty != 1.0 else []

    def _model_inputs(self, job: ThinkerJob) -> tuple[dict, torch.Tensor]:
        """The prompt's model inputs on the device and its [4, 1, P] positions, made by the model's own
        `_prepare_position_ids_for_generation` (which reads the attention mask).
        `prefill_drops_attention_mask`: the forward gets no mask (the positions are still made with it)."""
        # Prompt tensors arrive as float32 on the CPU: floating inputs take the model's dtype (not
        # video_second_per_grid, float32 in generate too); use_audio_in_video is a plain flag.
        kwargs = {k: v if not isinstance(v, torch.Tensor) else v.to(self.device) if k == "video_second_per_grid"
                  else v.to(self.device, self.dtype) if v.is_floating_point() else v.to(self.device)
                  for k, v in job.prompt.model_kwargs().items()}
        position_ids = self.model._prepare_position_ids_for_generation(kwargs["input_ids"], dict(kwargs))
        if self.prefill_drops_attention_mask:
            kwargs.pop("attention_mask")
        return kwargs, position_ids

    def _prefill_forward(self, request: _Request, slot: int, chunk: tuple[int, int] | None = None):
        """The prompt's forward as every family's prefill runs it (`_model_inputs`), into a fresh cache
        that then goes into `slot`, all hidden states where the talker needs them, from the prefix
        cache's blocks where it holds the prompt's first ones; a chunk at a time with `chunk`.
        Returns the forward's output and the inputs it got, None after a chunk that is not the last."""
        job, partial = request.job, request.partial
        kwargs, position_ids = self._model_inputs(job) if partial is None else request.inputs
        forward_kwargs = kwargs
        if partial is not None:  # the stack takes the first chunk's inputs (`cutting`): no media encoder runs again
            forward_kwargs = {k: v for k, v in kwargs.items() if k in ("input_ids", "attention_mask")}
        stop = chunk[1] if chunk is not None else job.prompt.num_tokens
        inputs = partial.inputs if partial is not None else {} if stop < job.prompt.num_tokens else None
        result, _ = prefill(self.prefix_pool, self._block_keys(job), job.prompt.num_tokens, self.stack,
                            self.prompt_forward(forward_kwargs, position_ids, job.want_talker_inputs, self.prefix_pool,
                                                self.timer),
                            use_hits=self.prefix_hits, need_extras=job.want_talker_inputs,
                            need_finals=self.prefix_pool is not None, publish=job.prefix, partial=partial,
                            stop=stop, stack_inputs=inputs)
        if stop < job.prompt.num_tokens:
            request.partial, request.inputs = Partial(stop, result, inputs), (kwargs, position_ids)
            return None
        request.partial = request.inputs = None
        self.take_slot(request, slot, result.cache, position_ids)
        return result.output, kwargs

    def pack(self, request_id: str, slot: int) -> PackedPrompt | None:
        """A text prompt's ids and positions for a packed prefill; one with media is prefilled alone."""
        request = self._requests[request_id]
        job = request.job
        kwargs, positions = self._model_inputs(job)
        if any(isinstance(v, torch.Tensor) for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")):
            return None
        return PackedPrompt(request_id, slot, request, kwargs, job.prompt.num_tokens, positions, self._block_keys(job),
                            job.want_talker_inputs, job.prefix)

    def packed_forward(self, prompts: list[PackedPrompt], packing: Packing) -> Forward:
        """The prompts' ids [1, T] and positions [4, 1, T] end to end through `prompt_forward`."""
        kwargs = {"input_ids": torch.cat([p.inputs["input_ids"] for p in prompts], dim=1),
                  "attention_mask": packing.mask(self.device)}
        return self.prompt_forward(kwargs, torch.cat([p.positions for p in prompts], dim=-1),
                                   any(p.extras for p in prompts), self.prefix_pool, self.timer)

    def packed_events(self, prompts: list[PackedPrompt], spans: list[slice], output) -> StepResult:
        events: StepResult = []
        for prompt, span in zip(prompts, spans):
            hidden = None if output.hidden_states is None else tuple(h[:, span] for h in output.hidden_states)
            events += self.prefilled(prompt.request_id, prompt.state, prompt.inputs, hidden, output.logits[0, span.stop - 1])
        return events

    def _block_keys(self, job: ThinkerJob) -> list[bytes]:
        if self.prefix_pool is None or job.prefix is None:
            return []
        return block_keys(job.prompt.input_ids[0].tolist(), job.prefix.media_at)

    def prompt_forward(self, kwargs: dict, position_ids: torch.Tensor, want_hidden: bool, pool: PrefixPool | None,
                       timer) -> Forward:
        """The prompt's forward through the module's own path into the cache `prefill` gives it, the LM
        head over every row (`_lm_head_rows`), timed by `timer`; its hidden states completed with the
        prior rows' `prefix_layers` (a hit's, from `pool`, or earlier chunks'), and [extra, P, hidden]
        of those layers kept with `want_hidden`; media through `self.encoders` where the encoder cache is on
        (a text prompt, such as the prefix check's on its own thread, leaves the model's methods alone)."""
        encoders = self.encoders if self.encoders and MEDIA_INPUTS.intersection(kwargs) else contextlib.nullcontext()

        def forward(cache, prior: Prior) -> PromptForward:
            finals: list[torch.Tensor] = []
            with timer, self._lm_head_rows(pool, prior, finals), encoders:
                out = self.model(**kwargs, position_ids=position_ids, past_key_values=cache, use_cache=True,
                                 output_hidden_states=want_hidden)
            final = finals[0] if finals else None
            if not want_hidden:
                return PromptForward(out, cache, final)
            states = list(out.hidden_states)
            layers = [layer % len(states) for layer in self.prefix_layers]
            if prior.tokens:
                for i, layer in enumerate(layers):  # prior.hidden: [extra, prior tokens, hidden]
                    states[layer] = torch.cat([prior.hidden[i].unsqueeze(0), states[layer]], dim=1)
                out.hidden_states = tuple(states)
            return PromptForward(out, cache, final, torch.stack([states[layer][0] for layer in layers]))
        return forward

    @contextlib.contextmanager
    def _lm_head_rows(self, pool: PrefixPool | None, prior: Prior, finals: list):
        """With a prefix cache, the LM head's input is recorded into `finals` (the blocks keep it),
        and after prior rows (a hit, earlier chunks) it gets theirs before the computed ones: the LM
        head then runs over the whole prompt's rows, the cold prefill's call, so the last row's
        logits cannot depend on how many rows were computed (a matmul's row can: fewer rows, other
        blocking)."""
        if pool is None:
            yield
            return

        def whole_prompt(_module, args):
            rows = args[0]
            if prior.tokens:
                rows = torch.cat([prior.finals.unsqueeze(0), rows], dim=1)
            finals.append(rows[0])
            return (rows, *args[1:])

        with forward_pre_hook(self.model.lm_head, whole_prompt):
            yield

    @torch.inference_mode()
    def decode(self, request_ids: list[str], slots: list[int]) -> StepResult:
        """One decode step for every request in the batch, each over its own slot."""
        requests = [self._requests[r] for r in request_ids]
        ids, positions = self.step_inputs(requests, slots)
        rows = Rows(self._draws(requests), self.device) if self.sampler is not None else None
        with self.timer:
            replayed = self.graphs.decode(ids, positions, slots, rows) if self.graphs is not None else None
        if replayed is not None and rows is not None:  # drawn inside the graph
            self.draw(request_ids, requests, None, drawn=replayed)
            return []
        if replayed is not None:
            logits = replayed[0]  # [B, vocab]
        else:
            view = self.cache.batch(slots)
            with self.timer, batch_invariant(self.engine_config.exact_batching):
                out = self.model(input_ids=ids, position_ids=positions, past_key_values=view, use_cache=True)
            view.commit()
            logits = out.logits[:, -1]
        if self.sampler is not None:
            self.draw(request_ids, requests, logits, rows=rows)
            return []
        logits = logits.cpu()  # sampling runs on the host (CPU generators and masks); a no-op on CPU
        picked, embeddings = self._greedy_rows(requests, logits)
        events: StepResult = []
        for row, (request_id, request) in enumerate(zip(request_ids, requests)):
            events += self._sample(request_id, request, logits[row], picked.get(row), embeddings.get(row))
        return events

    def step_inputs(self, requests: list[_Request], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's ids [B, 1] and position ids [4, B, 1] on the device: one upload (each row's
        last token and slot, queued without waiting) and the slots' positions advanced in place."""
        ids, slot_ids = to_device([[r.generated[-1] for r in requests], slots], torch.long, self.device)
        return ids[:, None], self.positions.advance(slot_ids)

    @staticmethod
    def _draws(requests: list[_Request]) -> list[Draw]:
        return [Draw(r.slot, r.job.sampling, r.key, len(r.generated),
                     r.job.forced_ids[len(r.generated)] if r.job.forced_ids else -1) for r in requests]

    def draw(self, request_ids: list[str], requests: list[_Request], logits: torch.Tensor | None,
             replies: torch.Tensor | None = None, rows: Rows | None = None,
             drawn: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Draw the rows' tokens on the device (logits [B, vocab]; `rows` their settings, made once a
        step; `drawn`: (ids, their host view) a decode graph drew instead) and gather what their events
        carry there (the token embeddings a talker is fed; `replies` [B, H], Qwen2.5-Omni's), for
        end_step's one copy."""
        if drawn is None:
            ids = self.sampler.sample(logits, rows if rows is not None else self._draws(requests))
            drawn = ids, mark_nonfinite(ids, logits)
        ids, marked = drawn
        fed = [row for row, r in enumerate(requests) if r.job.want_talker_inputs and self.feeds_token_embeddings]
        embeddings = None
        if fed:
            embeddings = self.host_copy.add(self.embed(ids if len(fed) == len(requests)
                                                       else ids.index_select(0, to_device(fed, torch.long, self.device))))
        # (request_ids, requests, ids, (fed rows, embeddings), replies): HostCopy indices, for end_step
        self._drawn.append((request_ids, requests, self.host_copy.add(marked), (fed, embeddings),
                            None if replies is None else self.host_copy.add(replies)))

    def end_step(self) -> StepResult:
        """The device path's events: the step's drawn tokens (and what their events carry), copied to
        the host at once."""
        if not self._drawn:
            return []
        drawn, self._drawn = self._drawn, []
        host = self.host_copy.fetch()
        events: StepResult = []
        for request_ids, requests, ids, (fed, embeddings), replies in drawn:
            tokens = host[ids].tolist()
            rows = {row: host[embeddings][i].clone() for i, row in enumerate(fed)}
            for row, (request_id, request) in enumerate(zip(request_ids, requests)):
                if tokens[row] == NONFINITE:
                    events += self.nonfinite(request_id, request.slot)
                    continue
                reply = host[replies][row].clone() if replies is not None and request.job.want_talker_inputs else None
                events += self._sample(request_id, request, None, tokens[row], rows.get(row), reply)
        return events

    def _greedy_rows(self, requests, logits: torch.Tensor) -> tuple[dict, dict]:
        """Tokens (row -> id) of the rows that are greedy without a repetition penalty, picked by one
        argmax over their logits, and their embeddings (row -> [H] on the host) from one lookup.
        Exact: argmax takes each row's first maximum as select_token's does, and a lookup copies."""
        rows = [row for row, r in enumerate(requests)
                if r.job.sampling.greedy and r.job.sampling.repetition_penalty == 1.0 and not r.job.forced_ids]
        if len(rows) < 2:
            return {}, {}
        picked = dict(zip(rows, torch.argmax(logits[rows].float(), dim=-1).tolist()))
        want = [row for row in rows if requests[row].job.want_talker_inputs and self.feeds_token_embeddings]
        embeddings = {}
        if want:
            table = self.embed(torch.tensor([picked[row] for row in want], device=self.device)).cpu()  # [n, H]
            embeddings = {row: table[i].clone() for i, row in enumerate(want)}
        return picked, embeddings

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

    def _sample(self, request_id: str, request: _Request, logits: torch.Tensor | None, token: int | None = None,
                embedding: torch.Tensor | None = None, reply: torch.Tensor | None = None) -> StepResult:
        """`token` / `embedding`: already picked / looked up for this row (`_greedy_rows`); `reply`:
        what the event carries for the token before (Qwen2.5-Omni)."""
        cfg = request.job.sampling
        if logits is not None and nonfinite_row(logits, cfg):
            return self.nonfinite(request_id, request.slot)
        forced = request.job.forced_ids
        if forced:
            token = forced[len(request.generated)]
        elif token is None:
            history = (request.job.prompt.input_ids[0].tolist() + request.generated
                       if cfg.repetition_penalty != 1.0 else [])
            token = select_token(logits, cfg, history, request.generator)
        if logits is not None and nonfinite_row(logits, cfg, token):
            return self.nonfinite(request_id, request.slot)
        request.generated.append(token)
        index = len(request.generated) - 1
        last = token in self.eos_ids or self.scheduler.reaches_length(request_id)
        if embedding is None and request.job.want_talker_inputs and self.feeds_token_embeddings:
            embedding = self.embed(torch.tensor([token], device=self.device))[0].cpu()
        events: StepResult = [(request_id, Token(token, index, embedding, last, reply))]
        if last:
            reason = FinishReason.STOP if token in self.eos_ids else FinishReason.LENGTH
            events.append((request_id, Finished(reason, request.job.prompt.num_tokens, len(request.generated))))
        return events
