"""Hostile inputs against one stack: bodies that are no message, decompression bombs, audio that
declares hours, megabytes of prompt text. Each is refused INVALID_ARGUMENT naming the field,
before it costs the stage memory or time, and nothing else on the stack notices."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.serving.status import field_violations
from services.tools.client import build_request
from services.tools.launcher import health_status
from services.tools.soak import Call, read_loads, wait_settled

from .support import (
    MAX_AUDIO_SECONDS,
    MAX_IMAGE_PIXELS,
    POLL_DEADLINE_S,
    SETTLE_S,
    PeakRss,
    flac_of_silence,
    png_declaring,
    raw_call,
    raw_channel,
    wav_of,
)

# A truncated length-delimited field 1: no message of any of these methods parses it.
NOT_A_MESSAGE = b"\x0a\x05ab"
MB = 1 << 20
MAX_PROMPT_TOKENS = 4096  # the tiny checkpoint's max_position_embeddings (no --max-prompt-tokens)


def methods(stack) -> list[tuple[str, str, bool]]:
    """(address, method, request is streamed) of every method on every port."""
    return [
        (stack.target, "/omni.v1.Omni/Generate", False),
        (stack.address("thinker-0"), "/omni.v1.Thinker/Generate", False),
        (stack.address("talker-0"), "/omni.v1.Talker/Speak", True),
        (stack.address("code2wav-0"), "/omni.v1.Code2Wav/Decode", True),
    ]


def test_a_body_that_is_no_message_is_invalid_argument_on_every_port(stack, omni):
    for address, method, streamed in methods(stack):
        with raw_channel(address) as channel:
            for body in (NOT_A_MESSAGE, b"\xff\xfe garbage \x00\x01"):
                code, details, err, responses = raw_call(channel, method, body, streamed)
                assert code is grpc.StatusCode.INVALID_ARGUMENT, (method, code, details)
                assert field_violations(err) and field_violations(err)[0][0] == "request", (method, details)
                assert responses == 0
            # GetLoad (unary) on the stages too.
            if "Omni" not in method:
                service = method.rsplit("/", 1)[0]
                try:
                    channel.unary_unary(f"{service}/GetLoad")(NOT_A_MESSAGE, timeout=10)
                    raise AssertionError("GetLoad parsed a body that is no LoadRequest")
                except grpc.RpcError as err:
                    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (service, err.code(), err.details())
    assert_still_serving(stack, omni)


def refused(omni, request, field: str) -> str:
    call = Call(omni.Generate, request, 60).run()
    assert call.code is grpc.StatusCode.INVALID_ARGUMENT, (call.code, call.details)
    assert field in call.details and call.messages == 0, call.details
    return call.details


@pytest.mark.parametrize("width, height", [(20000, 20000), (13000, 13000)])
def test_an_image_is_refused_by_the_size_its_header_declares_before_decoding(stack, omni, width, height):
    bomb = png_declaring(width, height)  # a valid png of zeros: 160-390 KB for 169-400 M pixels
    assert len(bomb) < 400_000
    with PeakRss(stack.popen("thinker-0").pid) as rss:
        details = refused(omni, build_request("look", image=bomb), "messages[0].content[0].image")
    assert f"{width * height} pixels" in details and str(MAX_IMAGE_PIXELS) in details, details
    # Decoding it would take width x height bytes (100s of MB); the header alone costs nothing.
    assert rss.growth < 32 * MB, rss.growth
    assert_still_serving(stack, omni)


def test_audio_is_refused_by_the_length_its_header_declares_before_decoding(stack, omni):
    long_silence = flac_of_silence(1000.0, rate=48000)  # ~150 KB declaring 48 M samples (192 MB as float32)
    with PeakRss(stack.popen("thinker-0").pid) as rss:
        details = refused(omni, build_request("listen", audio=long_silence), "messages[0].content[0].audio")
    assert "1000.0 s" in details and f"{MAX_AUDIO_SECONDS}" in details, details
    assert rss.growth < 32 * MB, rss.growth
    assert_still_serving(stack, omni)


def test_limits_hold_exactly_at_the_bound(stack, omni, tiny_checkpoint):
    """An input exactly at a limit is served; one step beyond it is refused, naming the field."""
    side = int(MAX_IMAGE_PIXELS ** 0.5)
    at = Call(omni.Generate, build_request("look", image=png_declaring(side, side), text_only=True, max_new_tokens=2), 60).run()
    assert at.code is grpc.StatusCode.OK, (at.code, at.details)
    refused(omni, build_request("look", image=png_declaring(side + 1, side)), "messages[0].content[0].image")
    at = Call(omni.Generate, build_request("hear", audio=wav_of(MAX_AUDIO_SECONDS), text_only=True,
                                           max_new_tokens=2), 60).run()
    assert at.code is grpc.StatusCode.OK, (at.code, at.details)
    refused(omni, build_request("hear", audio=wav_of(MAX_AUDIO_SECONDS + 0.01)), "messages[0].content[0].audio")
    # Text: one byte over what the prompt limit can hold is refused by its size, before tokenizing.
    from transformers import AutoTokenizer

    from services.runtime.inputs.limits import max_token_bytes, text_byte_limit

    limit = text_byte_limit(MAX_PROMPT_TOKENS, max_token_bytes(AutoTokenizer.from_pretrained(str(tiny_checkpoint))))
    details = refused(omni, build_request("z" * (limit + 1)), "messages")
    assert f"{limit + 1} bytes" in details and str(limit) in details, details
    assert_still_serving(stack, omni)


def test_a_prompt_over_the_byte_bound_is_refused_before_tokenizing_and_neighbours_never_notice(stack, omni):
    """Three 3 MB prompts beside a streaming request: each refused by its size, no health check
    of the thinker misses the router's poll deadline, the router stays ready, the neighbour streams
    on and the thinker's memory barely moves."""
    thinker = stack.address("thinker-0")
    neighbour = Call(omni.Generate, build_request("neighbour", text_only=True, max_new_tokens=1000), 120)
    missed, checks = [], 0
    stop = threading.Event()

    def probe() -> None:
        nonlocal checks
        with grpc.insecure_channel(thinker) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=POLL_DEADLINE_S)
                except grpc.RpcError as err:
                    missed.append(err.code())
                checks += 1
                if health_status(stack.target, "omni.v1.Omni", timeout=POLL_DEADLINE_S) != "SERVING":
                    missed.append("router not ready")
                time.sleep(0.02)

    prober = threading.Thread(target=probe, daemon=True)
    runner = threading.Thread(target=neighbour.run, daemon=True)
    with PeakRss(stack.popen("thinker-0").pid) as rss:
        runner.start()
        prober.start()
        while neighbour.texts < 2 and neighbour.code is None:
            time.sleep(0.01)
        outcomes = []
        huge = [threading.Thread(target=lambda: outcomes.append(Call(omni.Generate, build_request("x" * (3 * MB)),
                                                                     60).run()))
                for _ in range(3)]
        for thread in huge:
            thread.start()
        for thread in huge:
            thread.join(60)
        runner.join(120)
        stop.set()
        prober.join(10)
    assert neighbour.code is grpc.StatusCode.OK and neighbour.texts == 1000, (neighbour.code, neighbour.details)
    print(f"thinker rss growth {rss.growth / MB:.0f} MB, {checks} health checks, {len(missed)} missed")
    assert checks > 0 and not missed, missed[:6]
    # Each request holds its 3 MB body (and the router's and gRPC's copies); tokenizing one took 500+ MB.
    assert rss.growth < 96 * MB, rss.growth
    assert len(outcomes) == 3
    for call in outcomes:  # refused by its size, not after tokenizing
        assert call.code is grpc.StatusCode.INVALID_ARGUMENT and "bytes" in call.details, (call.code, call.details)
    assert_still_serving(stack, omni)


def assert_still_serving(stack, omni) -> None:
    settled = wait_settled(stack.replicas, stack.metrics_url, SETTLE_S)
    assert settled.idle, settled.busy()
    call = Call(omni.Generate, build_request("still there?", max_new_tokens=4, talker_max_new_tokens=8), 60).run()
    assert call.code is grpc.StatusCode.OK, (call.code, call.details)
    assert all(load.reachable for load in read_loads(stack.replicas))
