"""What the router and the thinker both compute of a request's messages to agree on which thinker
replica holds the prefix of a conversation: one key per message prefix, and a digest of each
message's media. Standard library and protos only, so the router (no torch, no tokenizer) and the
thinker compute them with the same function from the same bytes.

NOTE: why message keys. The router cannot tokenize, and a conversation re-sends its history
message by message, so the unit both sides can name is a message prefix: key j hashes the role and
content of messages 0..j (text as UTF-8, media as their bytes' digest) and the request's
use_audio_in_video. A thinker replica reports the keys whose tokens it holds in its prefix cache
(services/runtime/lm/prefix/), with how many tokens that is; the router matches the longest
key of a new request against each replica's report (services/serving/prefix_routing.py).
"""

from __future__ import annotations

import hashlib

from omni.v1 import omni_pb2

DIGEST_BYTES = 16


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def _content_parts(content: omni_pb2.Content) -> tuple[bytes, bytes]:
    """(kind, payload) of one content part; media by their bytes' digest."""
    kind = content.WhichOneof("part") or ""
    if kind == "text":
        return b"text", content.text.encode()
    if kind == "video_frames":
        frames = content.video_frames
        return b"video_frames", _digest(repr(float(frames.fps)).encode(), *frames.frames)
    if kind:
        return kind.encode(), _digest(getattr(content, kind))
    return b"", b""


def media_digest(message: omni_pb2.Message) -> bytes | None:
    """A digest of the message's media parts in order (None when it has none): what makes the same
    text with another image another prefix."""
    media = [_content_parts(c) for c in message.content if c.WhichOneof("part") not in ("text", None)]
    return _digest(*(b for part in media for b in part)) if media else None


def message_keys(request: omni_pb2.GenerateRequest) -> list[bytes]:
    """Key j names messages 0..j of the request (with its use_audio_in_video, and its tools and
    tool choice when it has tools: they are rendered before the first message)."""
    key = _digest(b"omni-prefix-v1", b"1" if request.use_audio_in_video else b"0")
    if request.tools:
        key = _digest(key, *(t.SerializeToString(deterministic=True) for t in request.tools),
                      request.tool_choice.SerializeToString(deterministic=True))
    keys = []
    for message in request.messages:
        calls = [c.SerializeToString(deterministic=True) for c in message.tool_calls]
        answers = [message.tool_call_id.encode()] if message.tool_call_id else []
        key = _digest(key, str(int(message.role)).encode(), *(b for c in message.content for b in _content_parts(c)),
                      *calls, *answers)
        keys.append(key)
    return keys


def media_digests(request: omni_pb2.GenerateRequest) -> list[bytes | None]:
    """Each message's media digest (None where it has no media), in message order."""
    return [media_digest(message) for message in request.messages]
