"""What one LM decode step costs the device, counted: the thinker's and the talker's engine decode at the
full-size Qwen3-Omni-30B-A3B layout on the meta device (no memory, no data), per batch size.

Counts are deterministic (the same code path gives the same ops), so tests assert them
(tests/gpu/test_step_counts.py) and docs/gpu.md ("LM steps, counted") holds the table this module
prints: `.venv/bin/python -m tests.gpu.step_counts` (about a minute on 2 cores).

Each engine is built as on cuda (exact batching off, sampling on the device, graph hooks wired) and
its decode step runs
under a TorchDispatchMode that sorts every aten op:

- graph nodes: ops inside the functions a CUDA graph captures (the decode step; the talker's code
  predictor frame), i.e. what a replay launches. Views (no kernel) are left out, a reshape that
  copies is counted. Under
  inference mode a linear layer or an SDPA call reaches the mode as one op, as it is one kernel (or
  a few) on cuda: the counts are the device's kernels to within those few, comparable commit to commit;
- eager device ops: ops on the device outside the captured functions (the engine's Python around the
  replay: per-row position updates, inputs copied into the graph's buffers, outputs cloned);
- host ops: ops on CPU tensors (sampling on the host today), which cost the host, not the device;
- host syncs: what makes the host wait for the device: `.item()` (`_local_scalar_dense`), `nonzero`
  (its output size is data), copies from the device to the CPU (`.cpu()`, `.tolist()`: `d2h`), and
  blocking copies from the CPU to the device (`torch.tensor(..., device=)`, seen by a
  TorchFunctionMode, and `.to(device)`: `h2d`; cuda waits for the stream before each, and its sync
  debug mode reports them). On meta there is
  no data: a sync answers zeros of its shape on the CPU, so the step goes on as if every logit were
  0 (token 0, deterministic);
- graph bytes: over the graphs' ops, the bytes of their tensor inputs and outputs, weights left out
  (an indexed read or write, of the KV cache or an embedding table, counts the rows it moves): the
  activations' memory traffic of a replay (an upper bound: a fused kernel keeps some in
  registers), whose part that grows with the positions attended over is the keys' and values'.

Rows decode from a prompt of `LENGTH` tokens (every slot holds that many), greedy (the talker with
generate's repetition penalty 1.05), so the talker's code-predictor frame runs as its graph.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from services.runtime.inputs.prompt import PromptInputs
from services.runtime.lm.cuda_graphs import _as_tuple, plan_padding
from services.runtime.lm.sampling import SamplingConfig
from services.runtime.lm.static_decode import SlotDecodeGraphs
from services.runtime.model.checkpoint import Stage, _stage_classes
from services.runtime.model.full_size import REAL_LAYOUT
from services.runtime.model.settings import DEFAULT_BUCKETS, GraphSettings
from services.talker.engine import TalkerEngine, TalkerJob
from services.talker.engine import _State as TalkerState
from services.talker.engine_base import TalkerEngineConfig
from services.talker.graphs import PredictorGraphs, frame_after, talker_step
from services.thinker.engine import ThinkerEngine, ThinkerEngineConfig, ThinkerJob
from services.thinker.engine import _Request as ThinkerRequest
from services.thinker.graphs import thinker_step
from services.tools.tiny_checkpoint import build_config, build_tokenizer

BATCHES = (1, 16, 64)
LENGTH = 100  # tokens each row's slot holds when the counted step runs
MAX_MODEL_LEN = 4096  # the engines' default
DEVICE = "meta"
_SYNC_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}


@dataclass
class Counts:
    graph_nodes: int = 0
    eager_ops: int = 0  # device ops outside the captured functions
    host_ops: int = 0
    syncs: int = 0  # d2h + h2d
    d2h: int = 0
    h2d: int = 0  # blocking copies from the CPU: cuda waits for each (sync debug mode reports them)
    graph_bytes: int = 0  # activation bytes of the graphs' ops: their inputs' and outputs', weights left out
    graph_ops: dict = field(default_factory=dict)  # op name -> count inside the graphs

    def row(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "graph_ops"}


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _bytes(tensors, weights: set[int]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t.untyped_storage()._cdata not in weights)


def _move(func, args, kwargs) -> tuple[torch.device, torch.device, torch.dtype | None, bool] | None:
    """(source, target device, dtype, non_blocking) of a copy or `to`, else None."""
    non_blocking = bool(kwargs.get("non_blocking", False))
    if func is torch.ops.aten.copy_.default:
        return args[1].device, args[0].device, None, bool(args[2]) if len(args) > 2 else non_blocking
    if func.overloadpacket not in (torch.ops.aten._to_copy, torch.ops.aten.to):
        return None
    target = kwargs.get("device")
    dtype = kwargs.get("dtype")
    for arg in args[1:]:
        if isinstance(arg, torch.Tensor):
            target, dtype = arg.device, arg.dtype
        elif isinstance(arg, (torch.device, str)):
            target = torch.device(arg)
        elif isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, bool):
            non_blocking = non_blocking or arg
    if target is None:
        return None
    return args[0].device, torch.device(target), dtype, non_blocking


_INDEXED = {torch.ops.aten.index_put_, torch.ops.aten.index_select, torch.ops.aten.index, torch.ops.aten.embedding}


def _moved(func, args, inputs: list[torch.Tensor], out, weights: set[int]) -> int:
    """An op's bytes read and written: its inputs' and outputs'; an indexed read or write of a larger
    tensor (a KV cache, a table) moves only the indexed rows: twice its output's (or values') bytes."""
    if func.overloadpacket in _INDEXED:
        indexed = args[0] if func.overloadpacket is not torch.ops.aten.embedding else args[1]
        rest = [t for t in inputs if t is not indexed]
        return _bytes(rest, set()) + _bytes(_tensors(out) if func.overloadpacket is not torch.ops.aten.index_put_
                                           else [args[2]], set())
    return _bytes(inputs, weights) + _bytes(_tensors(out), weights)


def _aliases(out, inputs: list[torch.Tensor]) -> bool:
    """Whether every tensor `out` holds shares the storage of one of `inputs`."""
    storages = {t.untyped_storage()._cdata for t in inputs}
    return all(t.untyped_storage()._cdata in storages for t in _tensors(out))


class StepCounter(TorchDispatchMode):
    """Sorts every aten op of a step into `counts` (see the module docstring); answers the syncs."""

    def __init__(self, weights: set[int] = frozenset()):
        super().__init__()
        self.counts = Counts()
        self.in_graph = False
        self.weights = weights  # storages whose bytes the graph's bytes leave out (the model's parameters)

    @contextlib.contextmanager
    def graph(self):
        previous, self.in_graph = self.in_graph, True
        try:
            yield
        finally:
            self.in_graph = previous

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        on_device = any(t.device.type == DEVICE for t in inputs)
        counts = self.counts
        if on_device and func in _SYNC_OPS:
            counts.syncs += 1
            counts.d2h += 1
            return self._answer(func, inputs[0])
        move = _move(func, args, kwargs)
        if move is not None:
            source, target, dtype, non_blocking = move
            if target.type == "cpu" and source.type == DEVICE:
                counts.syncs += 1
                counts.d2h += 1
                answer = torch.zeros(args[0].shape, dtype=dtype or args[0].dtype)
                return args[0].copy_(answer) if func is torch.ops.aten.copy_.default else answer
            if target.type == DEVICE and source.type == "cpu" and not non_blocking:
                counts.syncs += 1
                counts.h2d += 1
        out = func(*args, **(kwargs or {}))
        if func.is_view and _aliases(out, inputs):  # no kernel (a reshape that copies is one)
            return out
        if self.in_graph:
            counts.graph_nodes += 1
            counts.graph_bytes += _moved(func, args, inputs, out, self.weights)
            name = func.overloadpacket.__name__
            counts.graph_ops[name] = counts.graph_ops.get(name, 0) + 1
        elif on_device or any(t.device.type == DEVICE for t in _tensors(out)):
            counts.eager_ops += 1
        else:
            counts.host_ops += 1
        return out

    @staticmethod
    def _answer(func, tensor: torch.Tensor):
        if func is torch.ops.aten.nonzero.default:
            return torch.zeros((0, tensor.ndim), dtype=torch.long, device=DEVICE)
        if func is torch.ops.aten._local_scalar_dense.default:
            return False if tensor.dtype == torch.bool else 0
        return False


class HostData(TorchFunctionMode):
    """`torch.tensor(data, device=...)` on the device: a blocking copy from the host that the dispatch
    mode does not see (torch makes the tensor below it), counted into `counter` as one."""

    def __init__(self, counter: StepCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and not isinstance(args[0], torch.Tensor) \
                and torch.device(kwargs.get("device") or "cpu").type == DEVICE:
            counts = self.counter.counts
            counts.syncs += 1
            counts.h2d += 1
            counts.eager_ops += 1
        return func(*args, **kwargs)


class CountedRunner:
    """GraphRunner's replay path with the replay run eagerly under `counter.graph()`: the inputs are
    copied into per-key static buffers and the outputs cloned, as GraphRunner does around a replay."""

    enabled = True

    def __init__(self, fn, counter: StepCounter):
        self.fn, self.counter = fn, counter
        self.static: dict = {}

    def __call__(self, key, *inputs):
        if key not in self.static:  # the capture's own copies, made once
            with self.counter.graph():
                self.static[key] = tuple(x.detach().clone() for x in inputs)
        static = self.static[key]
        for buffer, x in zip(static, inputs):
            buffer.copy_(x, non_blocking=True)
        with self.counter.graph():
            outputs = _as_tuple(self.fn(*static))
        return tuple(o.clone() for o in outputs)

    @staticmethod
    def plan(batch: int, buckets: tuple[int, ...]):
        return plan_padding(batch, buckets)

    def summary(self) -> str:
        return "counted"


def meta_models():
    """The thinker and the talker of the full-size layout on the meta device, bfloat16."""
    import transformers

    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as folder:
        ids = build_tokenizer(Path(folder))
    config = build_config(ids, REAL_LAYOUT)
    classes = _stage_classes()
    with torch.device(DEVICE):
        models = {stage: classes[stage][0]._from_config(getattr(config, classes[stage][1]), dtype=torch.bfloat16).eval()
                  for stage in (Stage.THINKER, Stage.TALKER)}
    return config, models


def _capturing():
    """transformers believes a CUDA stream is capturing (it then skips its host-side checks)."""
    import transformers.utils.import_utils as iu

    return mock.patch.object(iu, "is_cuda_stream_capturing", lambda: True)


def _engine_config(cls, batch: int, max_model_len: int):
    return cls(max_batch_size=batch, num_slots=batch, max_model_len=max_model_len, exact_batching=False,
               device_sampling=True)  # as on cuda


def _wire_graphs(engine, step, counter: StepCounter, graphs: bool) -> None:
    """The engine's decode-step graph hook as --cuda-graphs on sets it up (scratch slot, buckets),
    replayed by a `CountedRunner`."""
    from services.runtime.lm.kv_slots import SlotKVCache

    slots = engine.engine_config.num_slots
    engine.cache = SlotKVCache.for_config(engine.model.config.text_config, slots + int(graphs),
                                          engine.engine_config.max_model_len, engine.dtype, DEVICE)
    engine.cache.batched_attention = True  # as the engine's set-up has it with exact batching off
    if not graphs:
        engine.graphs = None
        return
    hook = SlotDecodeGraphs(step(engine.model, engine.cache), engine.cache, slots, GraphSettings(False, DEFAULT_BUCKETS),
                            False, f"{engine.name} decode", DEVICE, sampler=engine.sampler)
    hook.runner = CountedRunner(hook.runner.fn, counter)
    engine.graphs = hook


def thinker_engine(config, model, batch: int, counter: StepCounter, max_model_len: int = MAX_MODEL_LEN,
                   graphs: bool = True) -> tuple[ThinkerEngine, list[str]]:
    """A thinker engine with `batch` requests decoding, each `LENGTH` tokens into its slot."""
    engine = ThinkerEngine(model, config, DEVICE, _engine_config(ThinkerEngineConfig, batch, max_model_len))
    _wire_graphs(engine, thinker_step, counter, graphs)
    ids = torch.ones((1, LENGTH), dtype=torch.long)
    rids = [f"r{i}" for i in range(batch)]
    for slot, rid in enumerate(rids):
        job = ThinkerJob(PromptInputs(ids, torch.ones_like(ids)), SamplingConfig(max_new_tokens=100), True)
        engine.scheduler.add(rid, LENGTH, 100)
        engine._requests[rid] = ThinkerRequest(job=job, generated=[1], slot=slot)
        engine.positions.set(slot, torch.full((4, 1, 1), LENGTH - 1, device=DEVICE))
        engine.cache.lengths[slot] = LENGTH
    return engine, rids


def talker_engine(config, model, batch: int, counter: StepCounter, max_model_len: int = MAX_MODEL_LEN,
                  graphs: bool = True) -> tuple[TalkerEngine, list[str]]:
    """A talker engine with `batch` requests decoding frame 1, each `LENGTH` positions into its slot,
    its next text row there (a step as a talker fed by a thinker runs it)."""
    engine = TalkerEngine(model, config, DEVICE, _engine_config(TalkerEngineConfig, batch, max_model_len))
    _wire_graphs(engine, talker_step, counter, graphs)
    if graphs:
        predictor = PredictorGraphs(model, GraphSettings(False, DEFAULT_BUCKETS), False, DEVICE, engine.dtype)
        predictor.runner = CountedRunner(predictor.runner.fn, counter)
        engine.predictor_graphs = predictor
        engine.graphs.then = frame_after(predictor, engine.residual_sampler)  # one graph a step, as on cuda
    hidden = model.config.text_config.hidden_size
    row = torch.zeros((1, 1, hidden), dtype=engine.dtype, device=DEVICE)
    rids = [f"r{i}" for i in range(batch)]
    for slot, rid in enumerate(rids):
        job = TalkerJob([1] * LENGTH, torch.zeros(LENGTH, 8), [], torch.zeros(0, 8), torch.zeros(3, 8), 0,
                        SamplingConfig(max_new_tokens=100, repetition_penalty=1.05), LENGTH)
        engine.scheduler.add(rid, LENGTH, 100)
        engine._requests[rid] = TalkerState(job=job, rows=[row, row, row], codes=[1], frames=1,
                                            next_codec_embed=row, tts=(row, row, row), slot=slot)
        engine.positions.set(slot, torch.full((4, 1, 1), LENGTH - 1, device=DEVICE))
        engine.cache.lengths[slot] = LENGTH
    return engine, rids


def count_step(engine, rids: list[str], counter: StepCounter) -> Counts:
    """One warm-up step (graph buffers made, state settled), then the counted step: `decode` of every
    row and `end_step` (the talker's code predictor), as `SlotScheduledEngine._step` runs them."""
    slots = list(range(len(rids)))
    with torch.inference_mode(), _capturing(), counter, HostData(counter):
        for _ in range(2):  # the warm-up, then the counted step
            counter.counts = Counts()
            engine.decode(rids, slots)
            engine.end_step()
            for slot in slots:  # the next step decodes from the same place
                engine.cache.lengths[slot] = LENGTH
    return counter.counts


def stage_counts(config, models, stage: Stage, batch: int, max_model_len: int = MAX_MODEL_LEN,
                 graphs: bool = True) -> Counts:
    counter = StepCounter()
    build = thinker_engine if stage is Stage.THINKER else talker_engine
    engine, rids = build(config, models[stage], batch, counter, max_model_len, graphs)
    # The weights as the engine left them (the fused code predictor's projections: new storages).
    counter.weights = {p.untyped_storage()._cdata for p in models[stage].parameters()}
    predictor = getattr(engine, "predictor_graphs", None)
    if predictor is not None:
        counter.weights |= {w.untyped_storage()._cdata for w in predictor.frame.qkv + predictor.frame.gate_up}
    return count_step(engine, rids, counter)


def table(config, models, max_model_lens=(MAX_MODEL_LEN, 256)) -> list[dict]:
    """Every stage x batch x max-model-len's counts, graphs on; and graphs off at the default length."""
    rows = []
    for stage in (Stage.THINKER, Stage.TALKER):
        for max_model_len in max_model_lens:
            for batch in BATCHES:
                counts = stage_counts(config, models, stage, batch, max_model_len)
                rows.append(dict(stage=str(stage), batch=batch, max_model_len=max_model_len, graphs=True,
                                 **counts.row()))
        for batch in BATCHES:
            counts = stage_counts(config, models, stage, batch, MAX_MODEL_LEN, graphs=False)
            rows.append(dict(stage=str(stage), batch=batch, max_model_len=MAX_MODEL_LEN, graphs=False, **counts.row()))
    return rows


def main() -> None:
    config, models = meta_models()
    print("| stage | B | max-model-len | graphs | graph nodes | graph GB | eager device ops | host ops | syncs (d2h + h2d) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table(config, models):
        print(f"| {r['stage']} | {r['batch']} | {r['max_model_len']} | {'on' if r['graphs'] else 'off'} "
              f"| {r['graph_nodes']:,} | {r['graph_bytes'] / 1e9:.2f} | {r['eager_ops']:,} | {r['host_ops']:,} "
              f"| {r['syncs']} ({r['d2h']} + {r['h2d']}) |")


if __name__ == "__main__":
    main()
