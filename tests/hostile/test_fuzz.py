"""Fuzzing the public API with hypothesis against one stack.

Generated `GenerateRequest`s (every field within and beyond its limit, random content parts,
random bytes for audio and images, images declaring any size) and raw random bodies, sent in
batches of `BATCH` at once. Every answer is OK or a clean status (never UNKNOWN or INTERNAL);
INVALID_ARGUMENT names a field in its BadRequest detail; meanwhile a probe checks every stage's
health within the router's poll deadline and none may miss; no process dies; at the end every
in-flight count is back to zero. The default suite runs a few hundred requests, `-m slow` 10,000+.
Cases are drawn fresh each run from the seed the run prints (tests/fuzzing.py).
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from omni.v1 import omni_pb2
from services.serving.status import field_violations
from services.tools.soak import Call, method_for, wait_settled
from tests.fuzzing import fuzz_settings, seeded

from .support import MAX_AUDIO_SECONDS, POLL_DEADLINE_S, SETTLE_S, png_declaring, raw_channel, wav_of

BATCH = 8  # requests sent at once per example (the router admits MAX_IN_FLIGHT = 16)
CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}

_WAV = wav_of(0.3)
_PNG = png_declaring(40, 40)

floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 0.5, 1.0, 1.5, -1.0]))
int32s = st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-3, 70))
small_tokens = st.integers(1, 4)


@st.composite
def sampling(draw, message: omni_pb2.SamplingParams, small) -> None:
    if draw(st.booleans()):
        message.temperature = draw(floats)
    if draw(st.booleans()):
        message.top_k = draw(int32s)
    if draw(st.booleans()):
        message.top_p = draw(floats)
    if draw(st.booleans()):
        message.repetition_penalty = draw(floats)
    # Mostly small, so that requests that pass are quick; sometimes anything an int32 holds.
    message.max_new_tokens = draw(st.one_of(small, small, small, int32s))
    if draw(st.booleans()):
        message.seed = draw(st.integers(0, 2**64 - 1))


audio_bytes = st.one_of(
    st.binary(max_size=300),
    st.just(_WAV),
    st.integers(1, len(_WAV) - 1).map(lambda n: _WAV[:n]),  # truncated
    st.binary(min_size=1, max_size=16).map(lambda junk: _WAV[:44] + junk),  # a header and garbage
    st.just(wav_of(MAX_AUDIO_SECONDS + 0.5)),  # over the limit
)
image_bytes = st.one_of(
    st.binary(max_size=300),
    st.just(_PNG),
    st.integers(1, len(_PNG) - 1).map(lambda n: _PNG[:n]),
    st.tuples(st.integers(0, 40_000), st.integers(0, 40_000)).map(lambda wh: png_declaring(*wh, rows=1)),
    st.tuples(st.integers(1, 90), st.integers(1, 90)).map(lambda wh: png_declaring(*wh)),
    st.binary(min_size=1, max_size=64).map(lambda junk: b"\xff\xd8\xff" + junk),  # jpeg-ish
)
text = st.one_of(st.text(max_size=40), st.text(max_size=40), st.integers(20_000, 200_000).map(lambda n: "y" * n))
part = st.one_of(text.map(lambda t: ("text", t)), audio_bytes.map(lambda b: ("audio", b)),
                 image_bytes.map(lambda b: ("image", b)), st.just(("empty", None)))


@st.composite
def requests(draw) -> omni_pb2.GenerateRequest:
    request = omni_pb2.GenerateRequest(request_id=draw(st.text(max_size=20)))
    for _ in range(draw(st.integers(0, 3))):
        message = request.messages.add(role=draw(st.one_of(st.sampled_from([1, 2, 3]), st.integers(0, 9))))
        for kind, value in draw(st.lists(part, max_size=3)):
            content = message.content.add()
            if kind != "empty":
                setattr(content, kind, value)
    request.output_modalities.extend(draw(st.one_of(st.just([1]), st.just([1, 2]), st.lists(st.integers(0, 5),
                                                                                          max_size=3))))
    if draw(st.booleans()):
        request.voice = draw(st.one_of(st.sampled_from(["ethan", "chelsie", "AIDEN"]), st.text(max_size=10)))
    draw(sampling(request.thinker_sampling, small_tokens))
    draw(sampling(request.talker_sampling, st.integers(1, 8)))
    request.return_codec_frames = draw(st.booleans())
    return request


@st.composite
def mostly_valid(draw) -> omni_pb2.GenerateRequest:
    """A request that is valid except, half the time, for one field drawn from anywhere."""
    request = omni_pb2.GenerateRequest(request_id=draw(st.text(max_size=8)))
    if draw(st.booleans()):
        request.messages.add(role=omni_pb2.ROLE_SYSTEM).content.add(text=draw(st.text(max_size=30)))
    user = request.messages.add(role=omni_pb2.ROLE_USER)
    media = draw(st.sampled_from(["none", "none", "audio", "image"]))
    if media == "audio":
        user.content.add(audio=_WAV)
    elif media == "image":
        user.content.add(image=_PNG)
    user.content.add(text=draw(st.text(min_size=1, max_size=60)))
    request.output_modalities.extend(draw(st.sampled_from([[1], [1, 2], []])))
    request.thinker_sampling.max_new_tokens = draw(small_tokens)
    request.talker_sampling.max_new_tokens = draw(st.integers(1, 8))
    if draw(st.booleans()):
        request.thinker_sampling.temperature = draw(st.sampled_from([0.0, 0.7, 1.0]))
        request.thinker_sampling.seed = draw(st.integers(0, 2**64 - 1))
        request.thinker_sampling.top_k = draw(st.integers(0, 2**31 - 1))
        request.thinker_sampling.top_p = draw(st.floats(0.25, 1.0, width=32))
    mutation = draw(st.sampled_from(["none", "none", "sampling", "talker", "part", "voice", "modalities", "role"]))
    if mutation == "sampling":
        draw(sampling(request.thinker_sampling, small_tokens))
    elif mutation == "talker":
        draw(sampling(request.talker_sampling, st.integers(1, 8)))
    elif mutation == "part":
        kind, value = draw(part)
        content = user.content.add()
        if kind != "empty":
            setattr(content, kind, value)
    elif mutation == "voice":
        request.voice = draw(st.one_of(st.sampled_from(["ethan", "chelsie", "AIDEN"]), st.text(max_size=10)))
    elif mutation == "modalities":
        request.output_modalities.extend(draw(st.lists(st.integers(0, 5), max_size=3)))
    elif mutation == "role":
        user.role = draw(st.integers(0, 9))
    return request


bodies = st.one_of(mostly_valid(), mostly_valid(), requests(), st.binary(max_size=400))


class Probe:
    """Health checks of every stage and the router, one after another, each within the deadline."""

    def __init__(self, addresses: list[str]):
        self.addresses = addresses
        self.checks = 0
        self.missed: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        channels = {a: grpc.insecure_channel(a) for a in self.addresses}
        while not self._stop.is_set():
            for address, channel in channels.items():
                try:
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=POLL_DEADLINE_S)
                except grpc.RpcError as err:
                    self.missed.append((address, err.code().name))
                self.checks += 1
            time.sleep(0.05)
        for channel in channels.values():
            channel.close()

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


def check_answer(call: Call, body) -> None:
    what = body if isinstance(body, bytes) else body.SerializeToString()[:300]
    assert call.code in CLEAN, (call.code, call.details, what)
    if call.code is grpc.StatusCode.INVALID_ARGUMENT:
        assert call.messages == 0, (call.details, what)
        assert call.details.split(":", 1)[0].strip(), call.details
    if call.code is grpc.StatusCode.OK:
        assert call.final is not None, what


def fuzz(stack, examples: int) -> int:
    """Run `examples` hypothesis examples of BATCH requests each; returns the requests sent."""
    channel = raw_channel(stack.target)
    codes: dict[str, int] = {}
    pool = ThreadPoolExecutor(BATCH)
    processes = list(stack.stack.processes.values())

    @seeded
    @fuzz_settings(examples)
    @given(st.lists(bodies, min_size=BATCH, max_size=BATCH))
    def batch(items) -> None:
        calls = [Call(method_for(channel, body), body, 120) for body in items]
        list(pool.map(lambda c: c.run(), calls))
        for call, body in zip(calls, items):
            check_answer(call, body)
            codes[call.code.name] = codes.get(call.code.name, 0) + 1
        dead = [p.name for p in processes if p.popen.poll() is not None]
        assert not dead, dead

    addresses = [stack.target] + [stack.address(p.name) for p in processes if p.stage != "router"]
    with Probe(addresses) as probe:
        batch()
    pool.shutdown()
    channel.close()
    assert probe.checks > 0 and not probe.missed, probe.missed[:10]
    settled = wait_settled(stack.replicas, stack.metrics_url, SETTLE_S)
    assert settled.idle, settled.busy()
    print(f"fuzz: {codes}, {probe.checks} health checks")
    assert codes.get("OK", 0) >= sum(codes.values()) // 20, codes  # the happy path is exercised too
    return sum(codes.values())


def test_fuzzed_requests_and_raw_bodies_end_cleanly(stack):
    assert fuzz(stack, examples=40) >= 300


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(3600)
def test_ten_thousand_fuzzed_requests_end_cleanly(stack):
    assert fuzz(stack, examples=math.ceil(10_000 / BATCH)) >= 10_000


def test_every_invalid_argument_names_its_field_in_a_bad_request_detail(stack):
    """A sample of the generated requests, checked through the full error (BadRequest detail)."""
    channel = raw_channel(stack.target)
    checked = []  # the field each INVALID_ARGUMENT named

    @seeded
    @fuzz_settings(60)
    @given(bodies)
    def one(body) -> None:
        try:
            for _ in method_for(channel, body)(body, timeout=120):
                pass
        except grpc.RpcError as err:
            assert err.code() in CLEAN, (err.code(), err.details())
            if err.code() is grpc.StatusCode.INVALID_ARGUMENT:
                violations = field_violations(err)
                assert violations and violations[0][0], (err.details(), violations)
                assert err.details().startswith(violations[0][0]), (err.details(), violations)
                checked.append(violations[0][0])

    one()
    channel.close()
    # The strategies go beyond the stack's limits (MAX_IMAGE_PIXELS, MAX_AUDIO_SECONDS, bad bytes)
    # often: a run that drew no refused request checked nothing.
    assert len(checked) >= 5, checked
    print(f"fields named: {sorted(set(checked))}")


STAGE_METHODS = (("thinker-0", "/omni.v1.Thinker/Generate", False), ("talker-0", "/omni.v1.Talker/Speak", True),
                 ("code2wav-0", "/omni.v1.Code2Wav/Decode", True))


def test_raw_bodies_on_every_stage_port_end_cleanly(stack):
    """Random bytes straight to each stage's streaming method: refused with INVALID_ARGUMENT naming
    a field (nothing else: not a deadline, not UNKNOWN or INTERNAL, not OK for bytes that are no
    complete request), well within the call's deadline, and the stage keeps serving."""
    channels = {name: raw_channel(stack.address(name)) for name, _, _ in STAGE_METHODS}
    codes: dict[str, int] = {}

    @seeded
    @fuzz_settings(60)
    @given(st.sampled_from(STAGE_METHODS), st.lists(st.binary(max_size=200), min_size=1, max_size=3))
    def one(target, messages) -> None:
        name, method, streamed = target
        channel = channels[name]
        try:
            if streamed:
                call = channel.stream_stream(method)(iter(messages), timeout=30)
            else:
                call = channel.unary_stream(method)(messages[0], timeout=30)
            outputs = list(call)
            raise AssertionError(f"{name} answered OK to random bytes with {len(outputs)} messages: {messages}")
        except grpc.RpcError as err:
            codes[f"{name} {err.code().name}"] = codes.get(f"{name} {err.code().name}", 0) + 1
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (name, err.code(), err.details(), messages)
            violations = field_violations(err)
            assert violations and violations[0][0], (name, err.details(), messages)

    with Probe([stack.address(name) for name in channels]) as probe:
        one()
    for channel in channels.values():
        channel.close()
    print(f"stage ports: {codes}")
    assert not probe.missed, probe.missed[:10]
    assert all(p.popen.poll() is None for p in stack.stack.processes.values())
    settled = wait_settled(stack.replicas, stack.metrics_url, SETTLE_S)
    assert settled.idle, settled.busy()
