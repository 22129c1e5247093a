"""What both families' talker engines share (engine.py for Qwen3-Omni, qwen2_5.py): their config,
a request's state, the end of the text as input, the frame and done events, how a request's
readiness follows its input (a step waits for the text row it needs), and the greedy rows' codes
picked together."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from services.base.events import EngineEvent
from services.base.finish import FinishReason
from services.runtime.lm.engine import LMEngineConfig, RequestState
from services.runtime.lm.scheduler import LMScheduler


class TalkerEngineConfig(LMEngineConfig):
    """Either talker engine's settings; max_model_len holds its prompt part + 9 + max_new_tokens, and
    `graphs` covers the code predictor's frame too."""


@dataclass
class TalkerState(RequestState):
    """What either family's talker keeps of a request (each adds its text inputs)."""

    text_done: bool = False
    codes: list[int] = field(default_factory=list)  # generated codes (layer 0's; Qwen2.5-Omni's end id included)
    frames: int = 0
    seen: torch.Tensor | None = None  # [vocab] bool: the ids the host path's repetition penalty applies to


@dataclass(frozen=True)
class TextEnd:
    pass


@dataclass(frozen=True)
class Frame(EngineEvent):
    index: int
    codes: torch.Tensor  # [num_code_groups] int64


@dataclass(frozen=True)
class TalkerDone(EngineEvent):
    reason: FinishReason
    frames: int
    final: ClassVar[bool] = True


def end_text(state, payload) -> None:
    """Either family's talker input that is not a text part: a TextEnd ends the request's text (its
    state's `text_done`); anything else is a wiring mistake."""
    if not isinstance(payload, TextEnd):
        raise TypeError(f"unexpected talker input {type(payload).__name__}")
    state.text_done = True


def refresh_ready(scheduler: LMScheduler, requests: dict, request_ids) -> None:
    """Mark each request of `request_ids` still held ready or waiting, by its state's `ready`: after
    an input arrives, and after a step (its next step may have to wait for text not yet streamed)."""
    for request_id in request_ids:
        if request_id in requests:
            scheduler.set_ready(request_id, requests[request_id].ready)


def greedy_codes(states: list[TalkerState], logits: torch.Tensor, suppress: torch.Tensor) -> dict[int, int]:
    """Codes (row -> id) of the greedy rows, selected together: select_token's ops on a [rows, vocab]
    batch. The repetition penalty divides positive and multiplies negative scores of the codes seen
    (a per-row mask instead of gather/scatter: the same float32 products and quotients on the same
    elements), then the `suppress`ed ids are masked and one argmax takes each row's first maximum.
    Bit for bit select_token's."""
    rows = [row for row, s in enumerate(states) if s.job.sampling.greedy]
    if len(rows) < 2:
        return {}
    scores = logits[rows].float()  # [R, vocab]
    vocab = scores.shape[-1]
    seen = torch.stack([states[r].seen if states[r].seen is not None else torch.zeros(vocab, dtype=torch.bool)
                        for r in rows])
    penalty = torch.tensor([[states[r].job.sampling.repetition_penalty] for r in rows], dtype=scores.dtype)
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    scores = torch.where(seen & (penalty != 1.0), penalized, scores).masked_fill(suppress, float("-inf"))
    return dict(zip(rows, torch.argmax(scores, dim=-1).tolist()))
