"""A realtime session's conversation: its items in order (system and user turns as the client gave
them or as committed input audio; assistant replies as what was actually heard), and the Generate
messages of the next turn.

NOTE: a played position -> the reply's text. The talker consumes one text row a codec frame: in
Qwen3-Omni frame t is made from generated text row t (docs/qwen3-omni.md, "The wait-for-row
rule"), in Qwen2.5-Omni code k from reply part k (docs/qwen2_5-omni.md, "What the talker needs
from the thinker"). So the audio of the first F frames was made from at most the first F tokens
of the reply: a reply cut at F frames keeps those tokens' text (all of it once the text ended).
A frame is `samples_per_frame` samples of the audio (AudioChunk.samples_per_frame); a frame whose
audio started playing counts as heard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omni.v1 import common_pb2, omni_pb2

END_TEXT = "<|im_end|>"  # both families' end-of-turn token: the chat template writes it, the reply does not keep it


@dataclass
class Reply:
    """An assistant reply as it streamed, and where it was cut."""

    pieces: list[str] = field(default_factory=list)  # each generated token's text, in order (the end token left out)
    calls: list[omni_pb2.ToolCall] = field(default_factory=list)  # the tool calls it made (the thinker's events)
    audio_samples: int = 0  # sent to the client
    sample_rate: int = 0
    samples_per_frame: int = 0  # 0: not known (the cut is then proportional)
    kept: int | None = None  # tokens the history keeps (None: every one)
    audio_end_ms: int | None = None  # where it was cut

    def add_text(self, delta: omni_pb2.TextDelta) -> None:
        if delta.text == END_TEXT:
            return
        for i in range(max(len(delta.token_ids), 1)):
            self.pieces.append(delta.text if i == 0 else "")

    def add_audio(self, chunk: common_pb2.AudioChunk) -> None:
        self.audio_samples += chunk.num_samples
        self.sample_rate = chunk.sample_rate or self.sample_rate
        self.samples_per_frame = chunk.samples_per_frame or self.samples_per_frame

    @property
    def audio_ms(self) -> int:
        return self.audio_samples * 1000 // self.sample_rate if self.sample_rate else 0

    @property
    def text(self) -> str:
        return "".join(self.pieces[:self.kept])

    @property
    def kept_calls(self) -> list[omni_pb2.ToolCall]:
        """Its calls, unless it was cut before its end (the calls follow the text it spoke)."""
        return self.calls if self.kept is None or self.kept >= len(self.pieces) else []

    def cut(self, audio_end_ms: int) -> None:
        """Keep what the listener heard of it: its audio up to `audio_end_ms`, and the tokens the
        frames up to there were made from (the module's NOTE). A reply without audio keeps its text."""
        self.audio_end_ms = min(audio_end_ms, self.audio_ms)
        if not self.sample_rate:
            return
        samples = min(audio_end_ms * self.sample_rate // 1000, self.audio_samples)
        if self.samples_per_frame:
            frames = -(-samples // self.samples_per_frame)
            self.kept = min(frames, len(self.pieces))
        else:
            self.kept = round(len(self.pieces) * samples / self.audio_samples) if self.audio_samples else 0


@dataclass
class Item:
    item_id: str
    role: int  # omni_pb2.Role
    content: list[omni_pb2.Content] = field(default_factory=list)  # a client's item's parts
    reply: Reply | None = None  # an assistant reply the pipeline made
    tool_calls: list[omni_pb2.ToolCall] = field(default_factory=list)  # a client's assistant item's calls
    tool_call_id: str = ""  # a tool's result (ROLE_TOOL): the call it answers
    transcript: str | None = None  # a committed audio turn's, once transcribed (input_transcription)

    def message(self) -> omni_pb2.Message | None:
        """The item as a Generate message (None: a reply of which nothing was heard). A reply's
        calls are its message's, which the chat template renders as the model wrote them."""
        if self.reply is None:
            return omni_pb2.Message(role=self.role, content=self.content, tool_calls=self.tool_calls,
                                    tool_call_id=self.tool_call_id)
        text, calls = self.reply.text, self.reply.kept_calls
        if not text and not calls:
            return None
        return omni_pb2.Message(role=self.role, content=[omni_pb2.Content(text=text)] if text else [],
                                tool_calls=calls)

    @property
    def text(self) -> str:
        if self.reply is not None:
            return self.reply.text
        return "".join(part.text for part in self.content if part.WhichOneof("part") == "text")


class Conversation:
    def __init__(self):
        self.items: list[Item] = []
        self._by_id: dict[str, Item] = {}  # item_id -> its item
        self.dropped: set[str] = set()  # items a truncation took out of what the turns send

    def add(self, item: Item) -> str:
        """Append `item`; the id of the item before it ('' for the first)."""
        previous = self.items[-1].item_id if self.items else ""
        self.items.append(item)
        self._by_id[item.item_id] = item
        return previous

    def find(self, item_id: str) -> Item | None:
        return self._by_id.get(item_id)

    def delete(self, item_id: str) -> None:
        item = self._by_id.pop(item_id)
        self.items.remove(item)
        self.dropped.discard(item_id)

    def messages(self) -> list[omni_pb2.Message]:
        """The history a turn sends: every item's message not dropped, in order."""
        return [m for m in (item.message() for item in self.items if item.item_id not in self.dropped) if m is not None]

    def drop_oldest_turns(self, ratio: float) -> list[str]:
        """Take the oldest turns out of what is sent, whole, keeping the newest `ratio` of them (at
        least one dropped, the last always kept); the ids dropped, none where only one turn is left.
        A turn is a user item and what follows it up to the next; system items are never dropped."""
        sent = [item for item in self.items if item.item_id not in self.dropped]
        starts = [i for i, item in enumerate(sent) if item.role == omni_pb2.ROLE_USER]
        if len(starts) <= 1:
            return []
        keep = min(max(int(len(starts) * ratio), 1), len(starts) - 1)
        cut = starts[len(starts) - keep]
        dropped = [item.item_id for item in sent[:cut] if item.role != omni_pb2.ROLE_SYSTEM]
        self.dropped.update(dropped)
        return dropped

    @property
    def last_reply(self) -> Item | None:
        for item in reversed(self.items):
            if item.reply is not None:
                return item
        return None
