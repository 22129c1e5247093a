"""Text to speech: `GenerateRequest.forced_text` in the pipeline against transformers, and
`POST /v1/audio/speech` through the openai SDK in every format against the gRPC path."""

from __future__ import annotations

import base64
import io
import json

import httpx2
import numpy as np
import pytest
import soundfile as sf
from conftest import TALKER_FRAMES

from omni.v1 import omni_pb2
from services.tools.client import collect

TEXT = "Hello world, this is a test of the speech endpoint."
VOICE = "aiden"
LSB = 1 / 32768
# The tiny talker never ends by itself: every speech here stops at the stack's frame limit. Asked
# for with max_audio_frames that is the end the caller chose; without it, a cut the caller hears of.
AS_ASKED = {"max_audio_frames": TALKER_FRAMES}


def forced_request(text: str, voice: str, talker_max_new_tokens: int | None = None,
                   return_codec_frames: bool = False) -> omni_pb2.GenerateRequest:
    """What the gateway sends for a speech request (gateway/convert.py speech_to_proto)."""
    request = omni_pb2.GenerateRequest(voice=voice, forced_text=text, return_codec_frames=return_codec_frames)
    request.messages.add(role=omni_pb2.ROLE_USER).content.add(text=text)
    request.output_modalities.extend([omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO])
    if talker_max_new_tokens is not None:
        request.talker_sampling.max_new_tokens = talker_max_new_tokens
    return request


@pytest.fixture(scope="module")
def grpc_speech(omni):
    """The gRPC path's audio for TEXT, once: the request the gateway sends for AS_ASKED."""
    return collect(omni, forced_request(TEXT, VOICE, talker_max_new_tokens=TALKER_FRAMES), timeout=120)


def test_forced_text_equals_reference_talker(omni, tiny_checkpoint):
    """The check: transformers' `Qwen3OmniMoeForConditionalGeneration.generate` on the same
    checkpoint and prompt (the user turn holding TEXT), greedy, with a logits processor on the
    thinker that leaves only the next forced id finite at each step (ReferenceRunner.generate
    `forced_ids`), so its thinker "generates" exactly TEXT's tokens and <|im_end|>; everything
    after that (the thinker's hidden states and embeddings of those tokens, the talker's prompt,
    its codes, the vocoder) is generate's own code. The pipeline gets `forced_text=TEXT` and must
    give the same thinker ids (TEXT's tokens then the end token), the text TEXT itself, and the
    same codec frames, frame for frame."""
    import transformers

    from services.runtime.inputs.prompt import ChatMessage, Part, Role
    from services.tools.reference import ReferenceRunner

    frames = 20
    got = collect(omni, forced_request(TEXT, VOICE, talker_max_new_tokens=frames, return_codec_frames=True),
                  timeout=120)
    transformers.logging.set_verbosity_error()
    reference = ReferenceRunner(tiny_checkpoint)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_checkpoint))  # transformers' own, not ours
    expected_ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"] + [reference.eos_id]
    expected = reference.generate([ChatMessage(Role.USER, (Part(text=TEXT),))], voice=VOICE,
                                  talker_max_new_tokens=frames, forced_ids=expected_ids)

    assert expected.thinker_token_ids == expected_ids  # the oracle did force its thinker
    assert got.thinker_token_ids == expected_ids
    assert got.text == TEXT + "<|im_end|>"
    assert got.codec_frames == expected.codec_frames
    assert len(got.codec_frames) == frames - 1
    assert got.final.usage.text_tokens == len(expected_ids)


def test_forced_text_refuses_sampling_and_empty_text(omni):
    import grpc

    from services.serving.status import field_violations

    bad = forced_request(TEXT, VOICE)
    bad.thinker_sampling.temperature = 0.7
    empty = forced_request("", VOICE)
    for request, field in ((bad, "thinker_sampling"), (empty, "forced_text")):
        with pytest.raises(grpc.RpcError) as caught:
            collect(omni, request, timeout=60)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(caught.value)[0][0] == field


def decoded(data: bytes) -> tuple[np.ndarray, int]:
    samples, rate = sf.read(io.BytesIO(data), dtype="float64", always_2d=False)
    return samples, rate


@pytest.mark.parametrize("fmt", ["wav", "flac", "pcm", "mp3", "opus"])
def test_speech_every_format_decodes_back(client, grpc_speech, fmt):
    want = grpc_speech.audio
    data = client.audio.speech.create(model="tiny-qwen3-omni", input=TEXT, voice=VOICE, response_format=fmt,
                                      extra_body=AS_ASKED).content
    if fmt == "pcm":
        samples, rate = np.frombuffer(data, "<i2").astype(np.float64) / 32768, 24000
    else:
        samples, rate = decoded(data)
    assert rate == 24000 and samples.ndim == 1
    if fmt in ("wav", "flac", "pcm"):  # lossless 16-bit: the float audio rounded once
        assert samples.shape == want.shape
        assert np.max(np.abs(samples - want)) <= LSB
    else:  # lossy: same length as libsndfile decodes it, same loudness roughly
        assert abs(samples.size - want.size) <= 2 * 1152, (samples.size, want.size)
        assert 0.5 < rms(samples) / rms(want) < 2.0


def test_speech_streams_raw_pcm_as_it_comes(client, grpc_speech):
    with client.audio.speech.with_streaming_response.create(
            model="m", input=TEXT, voice=VOICE, response_format="pcm", stream_format="audio",
            extra_body=AS_ASKED) as response:
        assert response.headers["content-type"].startswith("audio/pcm")
        pieces = list(response.iter_bytes())
    samples = np.frombuffer(b"".join(pieces), "<i2").astype(np.float64) / 32768
    assert samples.shape == grpc_speech.audio.shape
    assert np.max(np.abs(samples - grpc_speech.audio)) <= LSB


def sse_events(response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]


def test_speech_sse_deltas_then_done_with_usage(client, grpc_speech):
    with client.audio.speech.with_streaming_response.create(
            model="m", input=TEXT, voice=VOICE, response_format="pcm", stream_format="sse",
            extra_body=AS_ASKED) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert events[-1]["type"] == "speech.audio.done" and len(deltas) == len(events) - 1
    # One delta per chunk the pipeline streamed; how the audio is cut into chunks depends on timing
    # (code2wav decodes what is ready: 17 and 20 chunks measured for the same request), so several.
    assert len(deltas) >= 2
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    samples = np.frombuffer(pcm, "<i2").astype(np.float64) / 32768
    assert np.max(np.abs(samples - grpc_speech.audio)) <= LSB
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == grpc_speech.final.usage.codec_frames
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0


def test_speech_sse_in_a_container_format(client, grpc_speech):
    with client.audio.speech.with_streaming_response.create(
            model="m", input=TEXT, voice=VOICE, response_format="flac", stream_format="sse",
            extra_body=AS_ASKED) as response:
        events = sse_events(response)
    assert [e["type"] for e in events] == ["speech.audio.delta", "speech.audio.done"]
    samples, rate = decoded(base64.b64decode(events[0]["audio"]))
    assert rate == 24000 and np.max(np.abs(samples - grpc_speech.audio)) <= LSB


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x))))


def assert_like(samples: np.ndarray, want: np.ndarray, fmt: str) -> None:
    """wav/pcm: the float audio rounded once; mp3/opus (lossy): about its length and loudness. The
    progressive mp3 has no LAME tag to trim the encoder's delay and padding by: up to 2 frames more."""
    if fmt in ("wav", "pcm"):
        assert samples.shape == want.shape and np.max(np.abs(samples - want)) <= LSB
    else:
        assert abs(samples.size - want.size) <= 2 * 1152, (samples.size, want.size)
        assert 0.5 < rms(samples) / rms(want) < 2.0


@pytest.mark.parametrize("fmt", ["mp3", "opus", "wav", "pcm"])
def test_speech_is_encoded_and_sent_as_the_audio_comes(client, grpc_speech, fmt):
    """with_streaming_response: the file arrives in pieces while the pipeline still streams (more
    than one read), and the pieces together decode to the gRPC path's audio."""
    with client.audio.speech.with_streaming_response.create(
            model="m", input=TEXT, voice=VOICE, response_format=fmt, extra_body=AS_ASKED) as response:
        assert "content-length" not in response.headers  # chunked: sent before the audio is all there
        pieces = [piece for piece in response.iter_bytes() if piece]
    assert len(pieces) >= 2, [len(p) for p in pieces]
    data = b"".join(pieces)
    if fmt == "pcm":
        samples = np.frombuffer(data, "<i2").astype(np.float64) / 32768
    else:
        samples, rate = decoded(data)
        assert rate == 24000
    assert_like(samples, grpc_speech.audio, fmt)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "wav"])
def test_speech_sse_in_a_streamed_format_sends_deltas_as_encoded(client, grpc_speech, fmt):
    with client.audio.speech.with_streaming_response.create(
            model="m", input=TEXT, voice=VOICE, response_format=fmt, stream_format="sse",
            extra_body=AS_ASKED) as response:
        events = sse_events(response)
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert events[-1]["type"] == "speech.audio.done" and len(deltas) >= 2
    samples, rate = decoded(b"".join(base64.b64decode(e["audio"]) for e in deltas))
    assert rate == 24000
    assert_like(samples, grpc_speech.audio, fmt)


def test_openai_voice_names_speak_as_the_mapped_checkpoint_voice(client, omni):
    """alloy -> chelsie, onyx -> aiden (gateway/voices.py): the same audio as asking for it by name."""
    from gateway.voices import OPENAI_VOICES

    for openai_name, own in (("alloy", "chelsie"), ("onyx", "aiden")):
        assert OPENAI_VOICES[openai_name][0] == own
        want = collect(omni, forced_request(TEXT, own, talker_max_new_tokens=8), timeout=120).audio
        data = client.audio.speech.create(model="m", input=TEXT, voice=openai_name, response_format="pcm",
                                          extra_body={"max_audio_frames": 8}).content
        got = np.frombuffer(data, "<i2").astype(np.float64) / 32768
        assert got.shape == want.shape and np.max(np.abs(got - want)) <= LSB


def test_speech_cut_at_the_talkers_limit_is_not_a_whole_response(client):
    """No max_audio_frames: the talker's own limit (24 frames here) cut the speech. The raw stream
    ends without HTTP's last chunk (the SDK's reader, httpx2, raises), SSE ends in an error event instead of
    speech.audio.done, and a file written whole (flac) is a 500 naming the cut."""
    with client.audio.speech.with_streaming_response.create(
            model="m", input=TEXT, voice=VOICE, response_format="pcm") as response:
        got = []
        with pytest.raises(httpx2.RemoteProtocolError):
            for piece in response.iter_bytes():
                got.append(piece)
    assert sum(map(len, got)) > 0  # the audio up to the cut came first
    with client.audio.speech.with_streaming_response.create(
            model="m", input=TEXT, voice=VOICE, response_format="pcm", stream_format="sse") as response:
        events = sse_events(response)
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["error"]["code"] == "audio_truncated"
    assert not any(e.get("type") == "speech.audio.done" for e in events)
    import openai

    with pytest.raises(openai.InternalServerError) as caught:
        client.audio.speech.create(model="m", input=TEXT, voice=VOICE, response_format="flac")
    assert caught.value.response.json()["error"]["code"] == "audio_truncated"



@pytest.mark.slow  # three speech streams and a code2wav kill: ~26 s; make test-slow (CI)
def test_a_stage_failing_mid_stream_is_not_a_whole_response(client, gw_stack, omni):
    """code2wav killed (-9) while three speech streams are under way: the router's call fails
    (UNAVAILABLE) after the headers and some audio went out. Raw pcm and raw mp3 end without
    HTTP's final chunk, so the SDK's reader (httpx2) raises instead of returning a short body that
    looks whole; SSE ends in an error event naming the failure, never `speech.audio.done`. Then
    code2wav is restarted on its port and the stack serves again (the session's other tests
    share it)."""
    import contextlib
    import time

    from services.tools.launcher import health_status, http_ready

    victim = "code2wav-0"
    streams, broken = [], {}
    try:
        with contextlib.ExitStack() as opened:
            for fmt, stream_format in (("pcm", "audio"), ("mp3", "audio"), ("pcm", "sse")):
                response = opened.enter_context(client.audio.speech.with_streaming_response.create(
                    model="m", input=TEXT, voice=VOICE, response_format=fmt, stream_format=stream_format,
                    extra_body={"max_audio_frames": 2000}))  # a minute of streaming here: going on at the kill
                pieces = response.iter_lines() if stream_format == "sse" else response.iter_bytes()
                first = next(piece for piece in pieces if piece)  # audio came before the failure
                streams.append((fmt, stream_format, pieces, first))
            gw_stack.kill(victim)
            for fmt, stream_format, pieces, first in streams:
                if stream_format == "sse":  # an SSE stream ends in an event: HTTP's end is clean
                    lines = [first, *pieces]
                    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
                    continue
                got = len(first)
                with pytest.raises(httpx2.RemoteProtocolError) as caught:
                    for piece in pieces:
                        got += len(piece)
                broken[fmt] = (got, str(caught.value))
    finally:
        gw_stack.processes[victim].popen.wait(timeout=30)
        gw_stack.restart(victim)
        deadline = time.monotonic() + 60
        while not (health_status(gw_stack.target, "omni.v1.Omni") == "SERVING"
                   and http_ready(f"{gw_stack.http_url}/health")):
            assert time.monotonic() < deadline, "the router or the gateway never took code2wav back"
            time.sleep(0.1)
    assert set(broken) == {"pcm", "mp3"} and all(got > 0 for got, _ in broken.values()), broken
    assert all("incomplete" in why for _, why in broken.values()), broken
    assert events[0]["type"] == "speech.audio.delta"
    assert not any(e.get("type") == "speech.audio.done" for e in events), events[-1]
    error = events[-1]["error"]
    assert error["code"] == "service_unavailable" and "code2wav" in error["message"], error
    # Back: whole speech again.
    data = client.audio.speech.create(model="m", input=TEXT, voice=VOICE, response_format="pcm",
                                      extra_body={"max_audio_frames": 8}).content
    want = collect(omni, forced_request(TEXT, VOICE, talker_max_new_tokens=8), timeout=120).audio
    got = np.frombuffer(data, "<i2").astype(np.float64) / 32768
    assert got.shape == want.shape and np.max(np.abs(got - want)) <= LSB
