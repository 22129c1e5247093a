"""Large requests: over the router's message limit a 413 naming the part (not a retryable 429),
mp3 input resampled to what the thinker takes and capped in length, and the gateway's memory for
one request at the body limit.

The memory test's gateway calls a port where nothing listens: it does all its own work on the
request (read, parse, decode, build and send the gRPC message) and then answers 503, so what it
holds is the gateway's alone."""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import soundfile as sf
from gateway_procs import start_gateway

from services.tools.launcher import free_port

LIMIT_MB = 8
# Measured: 6.1x the body at the limit (the body, its JSON text, the validated model's string, the
# decoded bytes, the proto and its serialised copy all live at once), 48 MB over 74 MB at rest.
MAX_GROWTH_PER_BODY_BYTE = 8


@pytest.fixture(scope="module")
def small_gateway(gw_stack, tmp_path_factory):
    """Towards the stack, with a 1 MB router message limit and a 4 MB body limit (413 in between),
    and 2 s of mp3 at most."""
    running = start_gateway(gw_stack.target, tmp_path_factory.mktemp("gw-small"), "--max-message-mb", "1",
                            "--max-body-mb", "4", "--max-audio-seconds", "2")
    yield running
    running.stop()


def sdk(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=60)


def wav(seconds: float, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def mp3(seconds: float, rate: int = 44100, channels: int = 2) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    x = np.stack([0.3 * np.sin(2 * np.pi * 440 * (c + 1) * t) for c in range(channels)], 1).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="MP3")
    return buf.getvalue()


def audio_message(data: bytes, fmt: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": "Hear this."},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}]}]


def test_a_request_over_the_routers_message_limit_is_413_naming_its_part(small_gateway):
    # 1.5 MB of wav: under the 4 MB body limit, over the 1 MB gRPC message limit.
    with pytest.raises(openai.APIStatusError) as caught:
        sdk(small_gateway).chat.completions.create(model="m", messages=audio_message(wav(48), "wav"), max_tokens=1)
    assert caught.value.status_code == 413  # not 429: the SDK does not retry it
    error = caught.value.response.json()["error"]
    assert error["code"] == "request_too_large" and error["param"] == "messages[0].content[1].input_audio"


def test_mp3_input_over_the_audio_limit_is_400_naming_the_part(small_gateway):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(small_gateway).chat.completions.create(model="m", messages=audio_message(mp3(3.0), "mp3"), max_tokens=1)
    error = caught.value.response.json()["error"]
    assert error["param"] == "messages[0].content[1].input_audio" and "longer than 2 s" in error["message"]


def test_mp3_input_reaches_the_thinker_as_16_khz_mono(small_gateway):
    """A 44.1 kHz stereo mp3 is sent on as a 16 kHz mono float wav (64 kB a second, not 353), and the
    thinker takes it."""
    from gateway.audio import input_audio_to_wire

    data = mp3(1.5)
    wire = input_audio_to_wire(data, "mp3", max_seconds=2)
    samples, rate = sf.read(io.BytesIO(wire), dtype="float32", always_2d=True)
    assert rate == 16000 and samples.shape[1] == 1
    decoded, source_rate = sf.read(io.BytesIO(data), dtype="float32")
    assert abs(samples.shape[0] - round(decoded.shape[0] * 16000 / source_rate)) <= 1
    got = sdk(small_gateway).chat.completions.create(model="m", messages=audio_message(data, "mp3"), max_tokens=2)
    assert got.usage.prompt_tokens > 20  # the audio's tokens are in the prompt


def rss(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_memory_for_one_request_at_the_body_limit_is_bounded(tmp_path):
    gateway = start_gateway(f"127.0.0.1:{free_port()}", tmp_path, "--max-body-mb", str(LIMIT_MB),
                            "--max-message-mb", str(LIMIT_MB))
    try:
        urllib.request.urlopen(f"{gateway.url}/live", timeout=10).read()
        at_rest = rss(gateway.popen.pid, "VmRSS")
        samples = int((LIMIT_MB << 20) * 0.74 / 2) - 200  # int16 wav whose base64 fills the body to the limit
        body = json.dumps({"model": "m", "max_tokens": 1, "messages": audio_message(
            wav(samples / 16000), "wav")}).encode()
        assert (LIMIT_MB << 20) * 0.95 < len(body) <= LIMIT_MB << 20
        request = urllib.request.Request(f"{gateway.url}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=60)
        assert caught.value.code == 503  # the whole request was built and sent; nobody answered
        peak = rss(gateway.popen.pid, "VmHWM")
    finally:
        gateway.stop()
    assert peak - at_rest <= MAX_GROWTH_PER_BODY_BYTE * len(body), (at_rest >> 20, peak >> 20)
