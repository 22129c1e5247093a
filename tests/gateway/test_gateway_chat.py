"""`POST /v1/chat/completions` through the openai SDK over real HTTP, against the gRPC API.

Every comparison is greedy (the tiny checkpoint's stack, no temperature), so the gateway must
give the gRPC path's text exactly and its audio within one 16-bit LSB (the float audio rounded
once to pcm16)."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
import soundfile as sf

from omni.v1 import omni_pb2
from services.tools.client import build_request, collect

LSB = 1 / 32768


def grpc_result(omni, prompt: str, max_tokens: int, speak: bool, voice: str | None = None, **parts):
    """The router's gRPC answer to the same greedy request."""
    return collect(omni, build_request(prompt, voice=voice, text_only=not speak, max_new_tokens=max_tokens, **parts),
                   timeout=120)


def reply(result) -> str:
    """The gRPC text as an OpenAI reply holds it: without the end token's `<|im_end|>`."""
    return result.text.removesuffix("<|im_end|>")


def pcm16_to_float(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float64) / 32768


def assert_within_lsb(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.max(np.abs(got - want.astype(np.float64)), initial=0) <= LSB


def test_text_only_equals_grpc(client, omni):
    want = grpc_result(omni, "Hello there!", 8, speak=False)
    response = client.chat.completions.create(
        model="tiny-qwen3-omni", messages=[{"role": "user", "content": "Hello there!"}], max_tokens=8)
    choice = response.choices[0]
    assert response.object == "chat.completion" and len(response.choices) == 1
    assert choice.message.role == "assistant"
    assert choice.message.content == reply(want)
    assert choice.message.audio is None
    assert choice.finish_reason == ("length" if want.final.text_finish_reason == 2 else "stop")
    assert response.usage.prompt_tokens == want.final.usage.prompt_tokens
    assert response.usage.completion_tokens == want.final.usage.text_tokens
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_system_and_history_roles_map_onto_the_proto_roles(client, omni):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
                {"role": "user", "content": [{"type": "text", "text": "Again?"}]}]
    request = omni_pb2.GenerateRequest(output_modalities=[omni_pb2.MODALITY_TEXT])
    for role, text in ((omni_pb2.ROLE_SYSTEM, "You are terse."), (omni_pb2.ROLE_USER, "Hi"),
                       (omni_pb2.ROLE_ASSISTANT, "Hello."), (omni_pb2.ROLE_USER, "Again?")):
        request.messages.add(role=role).content.add(text=text)
    request.thinker_sampling.max_new_tokens = 6
    want = collect(omni, request, timeout=120)
    got = client.chat.completions.create(model="m", messages=messages, max_completion_tokens=6)
    assert got.choices[0].message.content == reply(want)
    assert got.usage.prompt_tokens == want.final.usage.prompt_tokens


def test_text_and_audio_non_streaming_equals_grpc(client, omni):
    want = grpc_result(omni, "Say something.", 6, speak=True, voice="chelsie")
    response = client.chat.completions.create(
        model="tiny-qwen3-omni", messages=[{"role": "user", "content": "Say something."}], max_tokens=6,
        modalities=["text", "audio"], audio={"voice": "chelsie", "format": "wav"})
    message = response.choices[0].message
    assert message.audio is not None and message.audio.id and message.audio.expires_at > 0
    assert message.audio.transcript == reply(want)
    samples, rate = sf.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="int16")
    assert rate == 24000 and samples.ndim == 1
    assert_within_lsb(samples.astype(np.float64) / 32768, want.audio)
    usage = response.usage
    assert usage.completion_tokens_details.audio_tokens == want.final.usage.codec_frames > 0
    assert usage.completion_tokens == want.final.usage.text_tokens + want.final.usage.codec_frames


def test_streaming_text_and_audio_equal_grpc_and_interleave(async_client, omni):
    want = grpc_result(omni, "Tell me more.", 10, speak=True)

    async def run():
        async with async_client() as client:
            stream = await client.chat.completions.create(
                model="tiny-qwen3-omni", messages=[{"role": "user", "content": "Tell me more."}], max_tokens=10,
                modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"}, stream=True,
                stream_options={"include_usage": True})
            return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    transcript, pcm, order, finish, usage = "", b"", [], None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.model_dump()["delta"]
            audio = delta.get("audio")
            if audio and audio.get("transcript"):
                transcript += audio["transcript"]
                order.append("text")
            if audio and audio.get("data"):
                pcm += base64.b64decode(audio["data"])
                order.append("audio")
            assert not delta.get("content")  # with audio out, the text is the transcript
            finish = choice.finish_reason or finish
    assert transcript == reply(want)
    assert_within_lsb(pcm16_to_float(pcm), want.audio)
    # One audio delta per chunk the router streamed; the chunking itself depends on timing (code2wav
    # decodes what is ready: 16 and 19 chunks measured for this request), so only "several" is fixed.
    assert order.count("audio") >= 2 and order.count("text") >= 1
    assert finish in ("stop", "length")
    assert chunks[-1].choices == [] and usage.completion_tokens_details.audio_tokens == want.final.usage.codec_frames
    # One SSE chunk per router event, in the order the router sent them (text comes first).
    assert order[0] == "text"


def test_streaming_text_only_uses_delta_content(client, omni):
    want = grpc_result(omni, "Count to three.", 8, speak=False)
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Count to three."}], max_tokens=8, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply(want)
    assert all(c.usage is None for c in chunks)  # include_usage not asked
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_input_audio_and_data_url_image_parts(client, omni, wav_bytes, png_bytes):
    want = grpc_result(omni, "What is this?", 6, speak=False, audio=wav_bytes, image=png_bytes)
    content = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes).decode(), "format": "wav"}},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png_bytes).decode()}},
               {"type": "text", "text": "What is this?"}]
    got = client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}], max_tokens=6)
    assert got.choices[0].message.content == reply(want)
    assert got.usage.prompt_tokens == want.final.usage.prompt_tokens


def test_mp3_input_audio_is_decoded(client):
    t = np.arange(16000) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000, format="MP3")
    content = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(),
                                                        "format": "mp3"}},
               {"type": "text", "text": "Hear it?"}]
    got = client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}], max_tokens=4)
    assert got.usage.prompt_tokens > 20  # the audio's tokens are in the prompt


def test_streamed_audio_and_transcript_interleave_on_a_long_answer(client):
    # ~600 thinker steps take a second or more; the first audio needs the talker prefill, 4 frames
    # and one code2wav chunk (about 0.1 s here), so audio deltas come between transcript deltas.
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Write an essay."}], max_tokens=600,
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"}, stream=True)
    kinds = []
    for chunk in stream:
        for choice in chunk.choices:
            audio = choice.model_dump()["delta"].get("audio") or {}
            kinds += ["text"] * bool(audio.get("transcript")) + ["audio"] * bool(audio.get("data"))
    assert "audio" in kinds
    last_text = len(kinds) - 1 - kinds[::-1].index("text")
    assert kinds.index("audio") < last_text


def test_the_sdks_stream_helper_accumulates_one_audio_id_and_whole_audio(client, omni):
    """`client.chat.completions.stream(...)` adds up every delta: strings are concatenated and numbers
    summed. So the audio's id and expires_at come once (as OpenAI sends them), and each delta's
    base64 is whole 3-byte groups: the accumulated `data` decodes to the whole audio."""
    import time

    want = grpc_result(omni, "Tell me more.", 10, speak=True, voice="ethan")
    import openai

    audio_deltas = 0
    # The tiny thinker never ends by itself: max_tokens ends it, and the helper then raises
    # LengthFinishReasonError holding the accumulated completion.
    with pytest.raises(openai.LengthFinishReasonError) as caught:
        with client.chat.completions.stream(
                model="m", messages=[{"role": "user", "content": "Tell me more."}], max_tokens=10,
                modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"}) as stream:
            for event in stream:
                if event.type == "chunk" and event.chunk.choices:
                    audio_deltas += bool((event.chunk.choices[0].delta.model_dump().get("audio") or {}).get("data"))
            stream.get_final_completion()
    final = caught.value.completion
    assert final.choices[0].finish_reason == "length"
    audio = final.choices[0].message.audio
    assert audio_deltas >= 2
    assert audio.id.startswith("audio_") and len(audio.id) == len("audio_") + 32  # one id, not N of them
    assert abs(audio.expires_at - (time.time() + 3600)) < 600  # one expires_at, not a sum
    assert audio.transcript == reply(want)
    assert_within_lsb(pcm16_to_float(base64.b64decode(audio.data, validate=True)), want.audio)
