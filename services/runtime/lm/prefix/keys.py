"""What names a block of a prompt: a hash chain over its tokens (and media digests, or the talker's
input rows), so the same block after the same history is the same key (the package's docstring)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

BLOCK_TOKENS = 16
_KEY_BYTES = 16


@dataclass(frozen=True)
class PromptPrefix:
    """What the cache keys of a prompt use of its messages: where each message starts in the
    prompt's tokens (then where the generation prompt starts), each message's media digest (None:
    no media) and each message-prefix key (services/serving/prefix_keys.py)."""

    starts: tuple[int, ...]  # len(messages) + 1
    media: tuple[bytes | None, ...]  # len(messages)
    keys: tuple[bytes, ...]  # len(messages)

    @property
    def media_at(self) -> dict[int, bytes]:
        """Token index of a message's start -> its media digest, for the messages with media."""
        return {start: digest for start, digest in zip(self.starts, self.media) if digest is not None}


def block_keys(input_ids: list[int], media_at: dict[int, bytes]) -> list[bytes]:
    """The key of every whole block of a prompt (`media_at`: token index of a message's start ->
    that message's media digest)."""
    keys, key = [], b"omni-blocks-v1"
    for start in range(0, len(input_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        h = hashlib.blake2b(key, digest_size=_KEY_BYTES)
        h.update(b"".join(t.to_bytes(4, "little") for t in input_ids[start:start + BLOCK_TOKENS]))
        for i in range(start, start + BLOCK_TOKENS):
            if i in media_at:
                h.update(i.to_bytes(4, "little") + media_at[i])
        key = h.digest()
        keys.append(key)
    return keys


def row_block_keys(ids: list[int], rows: torch.Tensor) -> list[bytes]:
    """The key of every whole block of a prompt given as input rows ([P, hidden], the talker's:
    projected from the thinker's hidden states) with their token ids: a hash chain over both, so
    the same rows after the same rows are the same block, bit for bit."""
    data = rows.detach().to("cpu").contiguous().view(torch.uint8)  # [P, hidden * element size]
    keys, key = [], b"omni-rows-v1"
    for start in range(0, len(ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        h = hashlib.blake2b(key, digest_size=_KEY_BYTES)
        h.update(b"".join(t.to_bytes(4, "little") for t in ids[start:start + BLOCK_TOKENS]))
        h.update(data[start:start + BLOCK_TOKENS].numpy().tobytes())
        key = h.digest()
        keys.append(key)
    return keys


