"""GET /v1/realtime: the OpenAI Realtime API over the gateway's WebSocket, driven by the pinned openai
SDK's own realtime client (sync and async), unchanged, with real speech (bench/speech/)."""

from __future__ import annotations

import asyncio
import base64
import wave
from pathlib import Path

import numpy as np
import pytest

from services.base.resample import resample

SPEECH = sorted((Path(__file__).parents[2] / "bench" / "speech").glob("*.wav"))


def speech_24k(i: int) -> bytes:
    """A recording as the Realtime API's audio/pcm: 16-bit at 24 kHz."""
    with wave.open(str(SPEECH[i])) as w:
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
    return np.clip(np.rint(resample(samples, 16000, 24000) * 32767), -32768, 32767).astype("<i2").tobytes()


def appends(pcm: bytes, chunk_ms: int = 100) -> list[str]:
    step = 24000 * chunk_ms // 1000 * 2
    return [base64.b64encode(pcm[i:i + step]).decode() for i in range(0, len(pcm), step)]


SETTINGS = {"type": "realtime", "instructions": "Answer briefly.", "max_output_tokens": 6,
            "audio": {"output": {"voice": "alloy"}}}


def test_the_sdks_sync_client_speaks_a_turn_and_hears_a_reply(client):
    with client.realtime.connect(model="tiny-qwen3-omni") as conn:
        created = conn.recv()
        assert created.type == "session.created" and created.session.audio.input.format.rate == 24000
        conn.session.update(session=SETTINGS)
        assert conn.recv().type == "session.updated"
        for chunk in appends(bytes(24000) + speech_24k(0) + bytes(2 * 24000)):
            conn.input_audio_buffer.append(audio=chunk)
        seen, audio, transcript = [], b"", ""
        for event in conn:
            seen.append(event.type)
            if event.type == "response.output_audio.delta":
                audio += base64.b64decode(event.delta)
            elif event.type == "response.output_audio_transcript.delta":
                transcript += event.delta
            elif event.type == "response.done":
                done = event.response
                break
    order = [seen.index(t) for t in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                                     "input_audio_buffer.committed", "conversation.item.added", "response.created")]
    assert order == sorted(order), seen
    assert done.status == "completed" and done.output[0].content[0].transcript == transcript
    assert len(audio) > 0 and len(audio) % 2 == 0
    assert done.usage.output_token_details.audio_tokens > 0


def test_unsupported_and_malformed_events_get_error_events_naming_them_and_the_session_goes_on(client):
    with client.realtime.connect(model="tiny-qwen3-omni") as conn:
        conn.recv()  # session.created
        refused = [
            ({"type": "conversation.item.delete", "item_id": "x"}, "unsupported", "type"),
            ({"type": "no.such.event"}, "unknown_event", "type"),
            ({"type": "session.update", "session": {"type": "realtime", "tools": [{"type": "function", "name": "f"}]}},
             "unsupported", "session.tools"),
            ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
                "format": {"type": "audio/pcmu"}}}}}, "unsupported", "session.audio.input.format.type"),
            ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "invalid_value", "audio"),
            ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x00\x01\x02").decode()},
             "invalid_argument", "audio"),
            ({"type": "input_audio_buffer.commit"}, "no_input", "commit"),
        ]
        for event, _, _ in refused:
            conn.send(event)
        errors = [conn.recv() for _ in refused]
        assert [(e.type, e.error.code, e.error.param) for e in errors] == [("error", c, p) for _, c, p in refused]
        conn.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}})
        conn.send({"type": "response.create"})
        types = []
        for event in conn:
            types.append(event.type)
            if event.type == "response.done":
                assert event.response.status == "completed"
                break
        assert types[:3] == ["conversation.item.added", "conversation.item.done", "response.created"]


def test_the_sdks_async_client_cancels_a_response_with_response_cancel(async_client):
    async def run():
        async with async_client().realtime.connect(model="tiny-qwen3-omni") as conn:
            await conn.recv()
            await conn.session.update(session={**SETTINGS, "audio": {"input": {"turn_detection": None}}})
            assert (await conn.recv()).session.audio.input.turn_detection is None
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": base64.b64encode(speech_24k(1)).decode()}]})
            await conn.response.create()
            async for event in conn:
                if event.type == "response.created":
                    await conn.response.cancel()
                elif event.type == "response.done":
                    return event.response
    response = asyncio.run(run())
    assert response.status in ("cancelled", "completed")  # a tiny reply may finish before the cancel lands
    if response.status == "cancelled":
        assert response.status_details.reason == "client_cancelled"


@pytest.mark.parametrize("path", ["/v1/realtime?model=x"])
def test_a_refused_bearer_token_is_a_401_in_the_handshake(gateway, tiny_checkpoint, tmp_path, path):
    import websockets.sync.client
    from gateway_procs import start_gateway
    from websockets.exceptions import InvalidStatus

    tokens = tmp_path / "tokens"
    tokens.write_text("secret\n")
    guarded = start_gateway("127.0.0.1:1", tmp_path, "--auth-token-file", str(tokens))
    try:
        with pytest.raises(InvalidStatus) as refused:
            websockets.sync.client.connect(f"ws://127.0.0.1:{guarded.port}{path}",
                                           additional_headers={"Authorization": "Bearer wrong"})
        assert refused.value.response.status_code == 401
    finally:
        guarded.stop()
