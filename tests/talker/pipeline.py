"""The in-process loop both families' talker engine tests drive (tests/talker/test_engine.py for
Qwen3-Omni, tests/talker/test_qwen2_5_engine.py for Qwen2.5-Omni): the thinker and talker engines
stepped in turn, what the thinker makes handed to the talker as its server would pass it on.
"""

from __future__ import annotations

from collections import defaultdict, deque

from services.base.events import RequestFailed
from services.talker.engine_base import Frame, TalkerDone


class TwoStagePipeline:
    """The stepping both families' `Pipeline` share. A subclass builds the engines, adds its cases
    (`add`), turns thinker events into talker jobs and inputs queued in `inbox`
    (`on_thinker_event`), and records each frame (`on_frame`).

    `text_every[request_id] = k` holds that request's talker inputs back and hands over one every
    k steps (a slow thinker or network) instead of as soon as they exist."""

    def __init__(self, thinker, talker, text_every: dict | None = None):
        self.thinker = thinker
        self.talker = talker
        self.text_every = text_every or {}
        self.inbox: dict[str, deque] = defaultdict(deque)  # request_id -> talker inputs not handed over yet
        self.frame_steps: dict[str, list[int]] = defaultdict(list)  # request_id -> talker steps that made a frame
        self.waited: dict[str, list[int]] = defaultdict(list)  # request_id -> steps it held a slot, not ready
        self.done: dict[str, TalkerDone] = {}  # request_id -> the talker's end
        self.failed: dict[str, dict] = defaultdict(dict)  # request_id -> {"thinker" | "talker": RequestFailed}
        self.steps = 0

    def on_thinker_event(self, rid: str, event) -> None:
        raise NotImplementedError

    def on_frame(self, rid: str, event: Frame) -> None:
        raise NotImplementedError

    def busy(self) -> bool:
        return self.thinker.has_work() or self.talker.has_work() or any(self.inbox.values())

    def step(self) -> None:
        if self.thinker.has_work():
            for rid, event in self.thinker.step():
                if isinstance(event, RequestFailed):  # the request's stream ends: the talker's half too
                    self.failed[rid]["thinker"] = event
                    self.talker.abort(rid)
                    self.inbox.pop(rid, None)
                self.on_thinker_event(rid, event)
        for rid, queue in self.inbox.items():
            every = self.text_every.get(rid, 0)
            while queue and (not every or self.steps % every == 0):
                self.talker.add_input(rid, queue.popleft())
                if every:
                    break
        for rid, seq in self.talker.scheduler.seqs.items():
            if seq.slot is not None and not seq.ready:
                self.waited[rid].append(self.steps)
        if self.talker.has_work():
            for rid, event in self.talker.step():
                if isinstance(event, Frame):
                    self.on_frame(rid, event)
                    self.frame_steps[rid].append(self.steps)
                elif isinstance(event, TalkerDone):
                    self.done[rid] = event
                elif isinstance(event, RequestFailed):
                    self.failed[rid]["talker"] = event
        self.steps += 1

    def abort(self, rid: str) -> None:
        """Cancel a request everywhere, as the thinker servicer and the talker loop do: both engines,
        and its talker inputs not handed over yet."""
        self.thinker.abort(rid)
        self.talker.abort(rid)
        self.inbox.pop(rid, None)

    def drive(self, cases, add, max_steps: int) -> TwoStagePipeline:
        """`add(case)` each case at its join_step, stepping until both engines are idle."""
        pending = sorted(cases, key=lambda c: c.join_step)
        while pending or self.busy():
            while pending and pending[0].join_step <= self.steps:
                add(pending.pop(0))
            self.step()
            assert self.steps < max_steps, "the pipeline stopped making progress"
        return self


def assert_clean(pipe: TwoStagePipeline) -> None:
    """Both engines idle, every slot free, no request state left behind."""
    for engine in (pipe.thinker, pipe.talker):
        assert engine.running == 0 and engine.queue_depth == 0 and not engine.has_work()
        assert sorted(engine.scheduler.free_slots) == list(range(engine.engine_config.num_slots))
        assert not engine._requests


def seeded_job(config, user_tokens: int, seed: int, max_new_tokens: int, text_rows: int,
               repetition_penalty: float = 1.05):
    """A Qwen3-Omni talker job without the thinker: a user turn of `user_tokens` ids, then the
    assistant's, its rows seeded stand-ins for the thinker's outputs (the rows are what a batch or
    the prefix cache must keep), and `text_rows` text rows then TextEnd. 1.05: the talker
    service's default penalty."""
    import torch

    from services.runtime.lm.sampling import SamplingConfig
    from services.runtime.model.qwen3_omni import talker_prompt_len
    from services.talker.engine import TalkerJob, TextRow
    from services.talker.engine_base import TextEnd

    hidden = config.thinker_config.text_config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    ids = ([config.im_start_token_id, config.user_token_id] + list(range(20, 20 + user_tokens))
           + [config.im_start_token_id, config.assistant_token_id, 23])
    job = TalkerJob(prompt_token_ids=ids, prompt_embeds=torch.randn(len(ids), hidden, generator=gen),
                    multimodal_positions=[], multimodal_hidden=torch.zeros(0, hidden),
                    tts_embeds=torch.randn(3, hidden, generator=gen),
                    speaker_id=int(next(iter(config.talker_config.speaker_id.values()))),
                    sampling=SamplingConfig(max_new_tokens=max_new_tokens, repetition_penalty=repetition_penalty),
                    prompt_len=talker_prompt_len(ids, config))
    return job, [TextRow(torch.randn(hidden, generator=gen)) for _ in range(text_rows)] + [TextEnd()]
