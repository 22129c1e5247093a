"""What the thinker and talker engines share: their one set-up and the loop-facing half of a
slot-scheduled LM.

`set_up` is every LM engine's start, in one order: the attention implementations exact mode runs,
the KV slots, the decode step's CUDA graphs, the scheduler, the prefix pool and its hit policy;
`start_exact_check` (last, once the engine can run a prompt) its exact-mode plan, checked beside
serving (services/runtime/checks.py) with the prefix-hit check for every stage alike
(services/runtime/lm/prefix/check.py).

A subclass owns the model work (`prefill(request_id, slot)`, `decode(request_ids, slots)`, each
returning (request_id, EngineEvent) pairs; a `final` event ends its request) and keeps its
per-request state in `self._requests`. This class runs the step: schedule, prefill the new
requests, one batched decode of the running ones, what both left to do together (`end_step`:
the talker's code predictor over all their rows), then hand the results to the scheduler.

A step's whole prompts go through one forward where exact mode is off (`prefill_packed`): the
choice of prompts, the slots and the pool's bookkeeping here (services/runtime/lm/packing.py,
prefix/prefill.py), the subclass giving only its prompts' inputs (`pack`), their forward end to
end (`packed_forward`) and the events of their last rows (`packed_events`). Device sampling's
sampler and its one copy back (`sampler`, `host_copy`) are made here too, and what a step drew
and did not copy back (`_drawn`) dropped on an abort.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.base.engine import EngineDefaults, StepResult
from services.base.errors import InvalidArgument
from services.base.events import RequestFailed
from services.base.timing import ForwardTimer
from services.runtime.checks import CheckState, StartupCheck
from services.runtime.lm.device_sampling import HostCopy, SlotSampler, device_sampling_wanted, draw_key
from services.runtime.lm.invariance import KernelVerdict, by_construction, exact_check, log_report
from services.runtime.lm.kernels import (
    fuse_rms_norms,
    use_capturable_experts,
    use_exact_rotary,
    use_invariant_attention,
    use_rowwise_attention,
    using_kernels,
)
from services.runtime.lm.kv_slots import SlotKVCache, SlotPositions
from services.runtime.lm.packing import CacheRows, PackedPrompt, Packing
from services.runtime.lm.prefix.check import PrefixCase, refused_hits
from services.runtime.lm.prefix.pool import PrefixPool
from services.runtime.lm.prefix.prefill import DecoderStack, Forward, Partial, Prior, held, keep_packed
from services.runtime.lm.scheduler import LMScheduler, StepPlan
from services.runtime.lm.static_decode import POSITION_ROWS, SlotDecodeGraphs
from services.runtime.model.device import device_clock
from services.runtime.model.settings import (
    CheckSettings,
    GraphSettings,
    ModelConfig,
    device_sampling,
    exact_batching,
    exact_gemm,
    prefix_cache_mb,
)

log = logging.getLogger(__name__)

NONFINITE_MESSAGE = "non-finite logits (NaN or inf): the model's weights or this request's inputs are bad"


@dataclass(frozen=True)
class LMEngineConfig:
    """An LM engine's settings (the thinker's and both talkers' engine configs), what `set_up` reads."""

    max_batch_size: int = 32  # requests decoded together in one step
    num_slots: int = 32  # KV cache slots (requests holding cache at once)
    max_model_len: int = 4096  # cache positions per slot: prompt + max_new_tokens must fit
    exact_batching: bool = True  # batch-invariant kernels (see services/runtime/lm/kernels.py)
    exact_gemm: bool = False  # exact mode's linear layers through the invariant GEMM (--exact-batching gemm)
    max_prefills_per_step: int = -1  # waiting requests prefilled a step (0: all that fit; -1: 0 packed, else 1)
    max_prefill_tokens: int = 0  # prompt tokens prefilled in one step (chunks past it where exact allows; 0: no bound)
    graphs: GraphSettings = GraphSettings()  # CUDA graphs of the decode step (services/runtime/lm/static_decode.py)
    prefix_cache_mb: int = 0  # the prefix cache's pool (services/runtime/lm/prefix/); 0: none
    checks: CheckSettings = CheckSettings()  # exact mode's start-up check: beside serving or before (services/runtime/checks.py)
    device_sampling: bool | None = None  # ids drawn on the device (services/runtime/lm/device_sampling.py); None: on cuda

    @classmethod
    def from_args(cls, args, model: ModelConfig) -> LMEngineConfig:
        """A stage's settings from its engine flags (model/settings.py's add_engine_flags, checked)
        and its model config (graphs, checks)."""
        return cls(max_batch_size=args.max_batch_size, num_slots=args.num_slots, max_model_len=args.max_model_len,
                   exact_batching=exact_batching(args), exact_gemm=exact_gemm(args),
                   max_prefills_per_step=args.max_prefills_per_step, max_prefill_tokens=args.max_prefill_tokens,
                   graphs=model.graphs, prefix_cache_mb=prefix_cache_mb(args.prefix_cache_mb), checks=model.checks,
                   device_sampling=device_sampling(args))


@dataclass
class RequestState:
    """What every LM engine keeps of a request (each engine's state adds its own)."""

    job: Any
    generator: torch.Generator | None = None  # the host path's draws (`draw_state`)
    partial: Partial | None = None  # a prompt prefilled a chunk a step: what the chunks so far gave
    slot: int = -1  # its KV slot, once prefilled (the device sampler's penalty history is per slot)
    key: int = 0  # the device sampler's noise key (device_sampling.draw_key)

    @property
    def started(self) -> bool:
        """Prefilled: in its slot."""
        return self.slot >= 0


class SlotScheduledEngine(EngineDefaults):
    scheduler: LMScheduler
    _requests: dict  # request_id -> the subclass's per-request state
    exact_report: KernelVerdict | None = None  # exact mode's kernel paths here (services/runtime/lm/invariance.py)
    exact_check: StartupCheck | None = None  # the check whose verdict replaces them, beside serving
    prefix_pool: PrefixPool | None = None  # prompt blocks kept across requests (services/runtime/lm/prefix/)
    prefix_hits: bool = True  # whether a prefill takes the pool's blocks (exact mode: once checked)

    def set_up(self, name: str, text_config, decoder, engine_config: LMEngineConfig, device, dtype, vocab: int, *,
               suppress: torch.Tensor | None = None, rowwise_configs: tuple = (),
               step: Callable[[SlotKVCache], Callable] | None = None, step_input: torch.Tensor | None = None,
               extra_layers: int = 0, then: Callable | None = None) -> None:
        """Every LM engine's set-up. `text_config`: the decoder stack's config (KV layout, attention);
        `decoder`: the stack a prefill from cached blocks cuts; `vocab`, `suppress`: the ids the device
        sampler draws from and those it never draws ([vocab] bool); `rowwise_configs`: more configs whose
        attention exact mode runs per row (the code predictor's); `step`: cache -> the decode step
        its CUDA graphs capture (None: no graphs), `step_input` its captured input, `then` what the
        graphs go on to do with the ids the sampler drew inside them (static_decode.SlotDecodeGraphs);
        `extra_layers`: hidden-state layers the prefix pool keeps per block (the thinker's, for the talker)."""
        self.name = name
        self.device, self.dtype = device, dtype
        # Seconds in model forwards (services/base/timing.py), waiting for the GPU's kernels on cuda.
        self.timer = ForwardTimer(clock=device_clock(torch.device(device)))
        # Sampling on the device: a step's ids drawn there (inside the decode graphs where they run; a row
        # more for their scratch slot) and copied back once, in end_step (`_drawn` until then).
        self.sampler = self.host_copy = None
        if device_sampling_wanted(engine_config.device_sampling, device):
            self.sampler = SlotSampler(engine_config.num_slots + 1, vocab, device, suppress)
            self.host_copy = HostCopy(device)
        self._drawn: list[tuple] = []
        use_rowwise_attention(text_config, *rowwise_configs)
        use_exact_rotary(decoder)
        if engine_config.exact_gemm:
            use_invariant_attention(text_config)  # what makes a prefix hit exact (kernels.invariant_attention)
        graphs = engine_config.graphs.enabled and step is not None
        if not engine_config.exact_batching and torch.device(device).type != "cpu":
            fuse_rms_norms(decoder)  # one kernel a norm, not eight, where no bits are promised (a GPU)
        # With graphs, one extra slot that no request owns takes the padded rows' writes.
        self.cache = SlotKVCache.for_config(text_config, engine_config.num_slots + int(graphs),
                                            engine_config.max_model_len, dtype, device)
        # Exact mode attends row by row (each row's bits as alone); otherwise a decode batch in one SDPA.
        self.cache.batched_attention = not engine_config.exact_batching
        # Each slot's position ids on the device: a decode step's come from one gather (no per-row ops).
        self.positions = SlotPositions(engine_config.num_slots + int(graphs), POSITION_ROWS, device)
        self.graphs = None
        if graphs:
            use_capturable_experts(text_config, dtype=dtype)
            self.graphs = SlotDecodeGraphs(step(self.cache), self.cache, engine_config.num_slots, engine_config.graphs,
                                           engine_config.exact_batching, f"{name} decode", device,
                                           sampler=self.sampler, then=then)
            self.graphs.capture_all(step_input)
        # Admission: packed prompts where exact mode is off (their rows are not each prompt's alone
        # bits); chunks where their rows are exact or not asked to be (off; gemm: the invariant GEMM and
        # attention make a chunk after cached keys the whole prefill's bits, as a prefix hit).
        self.packs_prefills = not engine_config.exact_batching
        prefills = engine_config.max_prefills_per_step
        if prefills < 0:  # auto: every one that fits where one forward takes them all; on CPU, where each
            prefills = 0 if self.packs_prefills else 1  # is its own forward, a step of 16 only moved a burst's wait
        self.scheduler = LMScheduler(engine_config.max_batch_size, engine_config.num_slots,
                                     engine_config.max_model_len, prefills,
                                     engine_config.max_prefill_tokens,
                                     chunking=not engine_config.exact_batching or engine_config.exact_gemm)
        self._requests = {}
        self.stack = DecoderStack(decoder, text_config)
        # Hits: used without exact mode; with it, once the check found them exact (gemm), or never (per-row
        # kernels: the pool keeps its bookkeeping alone, what hits would have saved still counted).
        self.prefix_hits = not engine_config.exact_batching
        if engine_config.prefix_cache_mb > 0:
            self.prefix_pool = PrefixPool.for_model(
                text_config, engine_config.prefix_cache_mb, extra_layers, dtype, device,
                keeps_tensors=not engine_config.exact_batching or engine_config.exact_gemm)

    def start_exact_check(self, stage: str, settings, **check) -> None:
        """Exact mode's plan: a verdict kept on disk or checked now (before serving), else the paths
        invariant by construction while the check runs beside serving (`adopt_checks` takes its
        verdict); with a prefix pool, the hit check too. `check`: invariance.exact_check's."""
        safe = by_construction(check["gemm"])
        if self.prefix_pool is not None:
            safe.more["prefix_hit"] = "refused"
            check |= {"then": self._prefix_hit_verdict, "then_shapes": {"prefix": self.stack.config.to_dict()}}
        self.exact_check = exact_check(stage, settings, **check)
        verdict = self.exact_check.start()
        self.exact_report = dataclasses.replace(verdict or safe, check=self.exact_check.state)
        if verdict is not None:
            self.adopt_verdict(self.exact_report)
        if self.exact_check.state is not CheckState.RUNNING:
            log_report(self.exact_report, self.exact_check)

    def _prefix_hit_verdict(self, report: KernelVerdict) -> None:
        """The check's word on prefix-cache hits (on the check's thread)."""
        why = refused_hits(self, report.kernels)
        report.more["prefix_hit"] = "refused" if why else "used"
        report.reasons["prefix_hit"] = why or "a prefill from cached blocks matched one without, bitwise"

    def prefix_case(self, tokens: int, seed: int) -> PrefixCase:
        """A prompt of `tokens` of the engine's own for the prefix-hit check (prefix/check.py)."""
        raise NotImplementedError

    def adopt_checks(self) -> None:
        """The check's verdict, once it ended beside serving, between steps: every path it adopts
        gives each row the bits the per-row path gives it."""
        check = self.exact_check
        if check is None or not check.ended():
            return
        report = dataclasses.replace(check.verdict or self.exact_report, check=check.state)
        if check.verdict is not None:
            self.adopt_verdict(report)
        self.exact_report = report
        log_report(report, check)

    def close(self) -> None:
        """A check still running beside serving stops with the engine (checks.StartupCheck.stop)."""
        if self.exact_check is not None:
            self.exact_check.stop()

    def adopt_verdict(self, report: KernelVerdict) -> None:
        """What the engine takes from a verdict besides the kernel paths: its prefix hits (refused:
        the pool lets its tensors go and keeps the bookkeeping)."""
        if self.prefix_pool is None:
            return
        self.prefix_hits = report.more.get("prefix_hit") == "used"
        if not self.prefix_hits:
            self.prefix_pool.drop_tensors()

    def kernels(self):
        """The engine's exact-mode kernel paths on this thread, for a block of its model work."""
        return using_kernels(self.exact_report.kernels) if self.exact_report is not None else contextlib.nullcontext()

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._requests.pop(request_id, None)
        # Ids drawn and not copied back outlive a step only when it raised (the loop then fails its
        # requests): dropped, so the next step's copy holds its own rows alone.
        self._drawn = []
        if self.host_copy is not None:
            self.host_copy.clear()

    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def queue_depth(self) -> int:
        return self.scheduler.queue_depth

    @property
    def running(self) -> int:
        return self.scheduler.running

    def step(self) -> StepResult:
        self.adopt_checks()
        with self.kernels():
            return self._step()

    def _step(self) -> StepResult:
        plan = self.scheduler.schedule()
        self.step_prefills = len(plan.prefill)
        events = self.admit(plan)
        if plan.decode:
            events += self.decode(list(plan.decode), [plan.slots[r] for r in plan.decode])
        events += self.end_step()
        finished = {request_id for request_id, event in events if event.final}
        self.scheduler.update(plan, finished)
        for request_id in finished:
            self._requests.pop(request_id, None)
        self.after_step(plan)
        return events

    def admit(self, plan: StepPlan) -> StepResult:
        """This step's prefills: chunks of longer prompts one by one, whole prompts packed into one
        forward where exact mode is off (`prefill_packed`), else one by one."""
        events: StepResult = []
        whole = []
        for request_id in plan.prefill:
            start, stop = plan.chunks[request_id]
            if start == 0 and stop == self.scheduler.seqs[request_id].prompt_len:
                whole.append(request_id)
            else:
                events += self.prefill_alone(request_id, plan.slots[request_id], (start, stop))
        if len(whole) > 1 and self.packs_prefills:
            return events + self.prefill_packed(whole, [plan.slots[r] for r in whole])
        for request_id in whole:
            events += self.prefill_alone(request_id, plan.slots[request_id])
        return events

    def nonfinite(self, request_id: str, slot: int) -> StepResult:
        """A request whose logits came out NaN or inf ends alone, INTERNAL naming the stage; its slot
        is wiped (stale NaN there would reach the next request through attention's 0 x NaN)."""
        log.error("%s: request %s: non-finite logits (NaN or inf); ending it", self.name, request_id)
        if slot >= 0:
            self.cache.wipe(slot)
        return [(request_id, RequestFailed(NONFINITE_MESSAGE))]

    def prefill_alone(self, request_id: str, slot: int, chunk: tuple[int, int] | None = None) -> StepResult:
        """`prefill`, a failure ending this request alone: the others of the step go on (a media part
        the model refuses is the request's fault, INVALID_ARGUMENT naming the field)."""
        try:
            return self.prefill(request_id, slot, chunk)
        except (InvalidArgument, ValueError) as exc:
            log.warning("%s: request %s's prefill refused its input: %s", self.name, request_id, exc)
            return [(request_id, RequestFailed(str(exc), getattr(exc, "field", None) or "messages"))]
        except Exception as exc:  # noqa: BLE001 - one request's failure, not the step's
            log.exception("%s: request %s's prefill failed", self.name, request_id)
            return [(request_id, RequestFailed(f"{type(exc).__name__}: {exc}"))]

    def take_slot(self, state, slot: int, cache, positions: torch.Tensor | None = None) -> None:
        """A prefilled prompt into `slot`: its keys and values (`cache`, batch 1), the decode steps'
        positions going on from its last (`positions` [rows, 1, P]; None: the engine counts them from
        the cache), the device sampler's penalty history there its `penalty_history`."""
        self.cache.load(slot, cache)
        state.slot = slot
        if positions is not None:
            self.positions.set(slot, positions[..., -1:])
        if self.sampler is not None:
            self.sampler.reset(slot, self.penalty_history(state))

    def draw_state(self, sampling) -> dict:
        """A new request's means to draw (RequestState's fields): the device sampler's noise key, or
        the host path's generator."""
        return {"key": draw_key(sampling)} if self.sampler is not None else {"generator": sampling.generator()}

    def penalty_history(self, state) -> Sequence[int]:
        """Hook: the ids a new request's repetition penalty starts from on the device (none here)."""
        return ()

    @torch.inference_mode()
    def prefill_packed(self, request_ids: list[str], slots: list[int]) -> StepResult:
        """Whole prompts the prefix pool holds nothing of, end to end through one forward
        (packing.py), each then into its slot and its blocks into the pool; the others (`pack` gives
        None, or the pool holds their first blocks) alone, as is a packed forward's lone prompt."""
        events: StepResult = []
        packed: list[PackedPrompt] = []
        for request_id, slot in zip(request_ids, slots):
            prompt = self.pack(request_id, slot)
            if prompt is None or self.prefix_hits and held(self.prefix_pool, prompt.keys, prompt.tokens, prompt.extras):
                events += self.prefill_alone(request_id, slot)
            else:
                packed.append(prompt)
        if len(packed) > 1:
            try:
                return events + self._prefill_packed(packed)
            except Exception:  # noqa: BLE001 - which prompt failed is the alone prefills' to tell
                log.exception("%s: a packed prefill failed; prefilling its prompts one by one", self.name)
        return events + [event for p in packed for event in self.prefill_alone(p.request_id, p.slot)]

    def _prefill_packed(self, prompts: list[PackedPrompt]) -> StepResult:
        from transformers import DynamicCache

        packing = Packing(tuple(p.tokens for p in prompts))
        result = self.packed_forward(prompts, packing)(DynamicCache(config=self.stack.config), Prior())
        for prompt, span in zip(prompts, packing.spans):
            rows = CacheRows(result.cache, span)
            self.take_slot(prompt.state, prompt.slot, rows, prompt.positions)
            if prompt.keys:
                keep_packed(self.prefix_pool, prompt.keys, prompt.tokens, rows, result, span, use_hits=self.prefix_hits,
                            need_extras=prompt.extras, publish=prompt.publish)
        return self.packed_events(prompts, packing.spans, result.output)

    def pack(self, request_id: str, slot: int) -> PackedPrompt | None:
        """Hook: a whole prompt's inputs for a packed forward; None: it is prefilled alone (media, no
        text yet). The base packs none."""
        return None

    def packed_forward(self, prompts: list[PackedPrompt], packing: Packing) -> Forward:
        """Hook: the prompts' forward end to end (`packing`'s block-diagonal mask, each prompt's own
        positions) into the cache it is given, with `Prior()` (nothing before its rows)."""
        raise NotImplementedError

    def packed_events(self, prompts: list[PackedPrompt], spans: list[slice], output) -> StepResult:
        """Hook: the prompts' first events from the packed forward's `output` (each prompt's rows at
        its span), their slots already taken."""
        raise NotImplementedError

    def end_step(self) -> StepResult:
        """Hook: work this step's prefills and decode left to be done together (the talker's code
        predictor over all their rows); its events."""
        return []

    def after_step(self, plan: StepPlan) -> None:
        """Hook: e.g. mark requests whose next step must wait for input."""

    def prefill(self, request_id: str, slot: int, chunk: tuple[int, int] | None = None) -> StepResult:
        """A request's prompt into its slot, its first events; with `chunk` only its positions
        [start, stop), no events before the last chunk."""
        raise NotImplementedError

    def decode(self, request_ids: list[str], slots: list[int]) -> StepResult:
        raise NotImplementedError
