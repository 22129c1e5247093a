"""Under concurrency every request gets exactly what it gets alone (text ids, codec frames and
audio, bit for bit: code2wav batches the requests' blocks where its probe allows), and the ids and
frames generate gives."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from services.runtime.inputs.prompt import ChatMessage, Part, Role
from services.tools.client import build_request, collect

pytestmark = pytest.mark.exactness

VOICES = ("ethan", "chelsie", "aiden")


def cases(wav_bytes, png_bytes):
    """16 requests: text, audio and image inputs mixed; different prompts, lengths and voices."""
    out = []
    for i in range(16):
        kind = ("text", "audio", "image")[i % 3]
        out.append(dict(
            prompt=f"Request {i}: tell me something" + " more" * (i % 5),
            audio=wav_bytes if kind == "audio" else None,
            image=png_bytes if kind == "image" else None,
            voice=VOICES[i % 3],
            max_new_tokens=6 + (i * 5) % 17,
            talker_max_new_tokens=12 + (i * 7) % 23,
        ))
    return out


def as_messages(case) -> list[ChatMessage]:
    parts = [Part(audio=case["audio"])] if case["audio"] else []
    parts += [Part(image=case["image"])] if case["image"] else []
    return [ChatMessage(Role.USER, tuple(parts) + (Part(text=case["prompt"]),))]


def run(omni, case):
    request = build_request(case["prompt"], audio=case["audio"], image=case["image"], voice=case["voice"],
                            max_new_tokens=case["max_new_tokens"],
                            talker_max_new_tokens=case["talker_max_new_tokens"], return_codec_frames=True)
    result = collect(omni, request, timeout=300)
    return result.thinker_token_ids, result.codec_frames, result.audio


def test_sixteen_concurrent_requests_equal_each_alone_and_the_reference(omni, reference, wav_bytes, png_bytes):
    all_cases = cases(wav_bytes, png_bytes)
    with ThreadPoolExecutor(max_workers=16) as pool:
        concurrent = list(pool.map(lambda c: run(omni, c), all_cases))
    alone = [run(omni, c) for c in all_cases]
    for i, case in enumerate(all_cases):
        expected = reference.generate(as_messages(case), voice=case["voice"], max_new_tokens=case["max_new_tokens"],
                                      talker_max_new_tokens=case["talker_max_new_tokens"])
        assert concurrent[i][:2] == alone[i][:2], f"request {i}: concurrent differs from alone"
        assert np.array_equal(concurrent[i][2], alone[i][2]), f"request {i}: concurrent audio differs from alone"
        assert concurrent[i][0] == expected.thinker_token_ids, f"request {i}: text ids differ from generate"
        assert concurrent[i][1] == expected.codec_frames, f"request {i}: codec frames differ from generate"
        assert len(concurrent[i][1]) == case["talker_max_new_tokens"] - 1
