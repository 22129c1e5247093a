"""Fuzzing the stage-to-stage messages: what a thinker sends a talker (TalkerInput streams) and a
talker sends a code2wav (Code2WavInput streams), drawn by hypothesis as well-formed protobuf
messages with wrong orders, shapes, dtypes, ids and ends, against each stage's real servicer
(built by its own `create_server`, in this process, over real gRPC on loopback).

The code2wav stream has an exact oracle (`expect_code2wav`): the status a stream must end with and
the field an INVALID_ARGUMENT must name. The talker's is coarser: OK for a stream left valid, and
for any other INVALID_ARGUMENT naming a field, except that a stream spoiled only after the talker's
answer was complete may end either way (its reader races the engine); never another status, never
a hang. Cases are drawn fresh each run from the printed seed (tests/fuzzing.py); `-m slow` draws
many more.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni.v1 import common_pb2, stages_pb2
from services.code2wav.config import Code2WavConfig
from services.code2wav.server import create_server as create_code2wav
from services.runtime.model.checkpoint import load_config
from services.runtime.model.settings import ModelConfig
from services.serving.config import ServingConfig
from services.serving.status import field_violations
from services.serving.wire import tensor_to_proto
from services.talker.engine_base import TalkerEngineConfig
from services.talker.server import TalkerConfig
from services.talker.server import create_server as create_talker
from tests.fuzzing import fuzz_settings, seeded
from tests.serving.inprocess import serving

CALL_TIMEOUT_S = 60.0  # far above any case's time: a call that runs into it hung
LOOPBACK = ServingConfig(host="127.0.0.1", port=0, stream_idle_timeout_s=20.0)


class Background:
    """Stage servers on an asyncio loop of their own (a thread), for synchronous test code."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._exits = []

    def enter(self, manager):
        value = asyncio.run_coroutine_threadsafe(manager.__aenter__(), self.loop).result(120)
        self._exits.append(manager)
        return value

    def close(self) -> None:
        for manager in reversed(self._exits):
            asyncio.run_coroutine_threadsafe(manager.__aexit__(None, None, None), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass(frozen=True)
class Stages:
    code2wav: str  # loopback address
    talker: str
    codebook_size: int
    samples_per_frame: int
    groups: int  # codec ids per frame
    hidden: int  # the thinker's hidden size: the width of the talker's text rows
    im_start: int  # token ids a thinker's prompt is made of
    user: int
    assistant: int


@pytest.fixture(scope="module")
def stages(tiny_checkpoint, one_torch_thread) -> Stages:
    model = ModelConfig(checkpoint=str(tiny_checkpoint))
    background = Background()
    try:
        code2wav, c2w_engine = background.enter(serving(create_code2wav, Code2WavConfig(serving=LOOPBACK, model=model)))
        talker, _ = background.enter(serving(create_talker, TalkerConfig(
            serving=LOOPBACK, model=model, engine=TalkerEngineConfig(max_model_len=512))))
        config = load_config(tiny_checkpoint)
        yield Stages(code2wav, talker, c2w_engine.codebook_size, c2w_engine.geometry.samples_per_frame,
                     c2w_engine.num_quantizers, config.thinker_config.text_config.hidden_size,
                     config.im_start_token_id, config.user_token_id, config.assistant_token_id)
    finally:
        background.close()


def run_stream(address: str, method: str, request_type, messages: list) -> tuple[grpc.StatusCode, list, grpc.RpcError | None]:
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(method, request_serializer=request_type.SerializeToString,
                                     response_deserializer=lambda b: b)(iter(messages), timeout=CALL_TIMEOUT_S)
        outputs = []
        try:
            for output in call:
                outputs.append(output)
        except grpc.RpcError as err:
            return err.code(), outputs, err
        return grpc.StatusCode.OK, outputs, None


def assert_names(err: grpc.RpcError, field: str | None) -> None:
    violations = field_violations(err)
    assert violations and violations[0][0], (err.details(), violations)
    if field is not None:
        assert violations[0][0] == field, (err.details(), violations)


# --- code2wav: Code2WavInput streams -------------------------------------------------------------

def c2w_frames(ids: list[int], groups: int, first: int = 0) -> stages_pb2.Code2WavInput:
    return stages_pb2.Code2WavInput(frames=common_pb2.CodecFrames(first_frame=first, num_code_groups=groups, ids=ids))


C2W_START = stages_pb2.Code2WavInput(start=stages_pb2.Code2WavStart(request_id="fuzz"))
C2W_END = stages_pb2.Code2WavInput(end=stages_pb2.CodecEnd())


def expect_code2wav(messages: list[stages_pb2.Code2WavInput], stages: Stages) -> tuple[grpc.StatusCode, str | None, int]:
    """(status, the field an INVALID_ARGUMENT names, frames decoded when OK) for a Decode stream."""
    bad = grpc.StatusCode.INVALID_ARGUMENT
    if not messages or messages[0].WhichOneof("event") != "start":
        return bad, "start", 0
    frames = 0
    for message in messages[1:]:
        kind = message.WhichOneof("event")
        if kind == "frames":
            groups, ids = message.frames.num_code_groups, list(message.frames.ids)
            if groups <= 0 or len(ids) % groups:
                return bad, "tensor", 0
            if groups != stages.groups:
                return bad, "frames.num_code_groups", 0
            if ids and not all(0 <= i < stages.codebook_size for i in ids):
                return bad, "frames.ids", 0
            frames += len(ids) // groups
        elif kind == "end":
            return grpc.StatusCode.OK, None, frames
        else:
            return bad, "event", 0
    return bad, "end", 0


@st.composite
def code2wav_streams(draw, groups: int, codebook: int) -> list[stages_pb2.Code2WavInput]:
    ids_in_range = st.integers(0, codebook - 1)
    any_id = st.one_of(ids_in_range, ids_in_range, st.integers(-3, -1), st.integers(codebook, codebook + 3),
                       st.integers(-(2**31), 2**31 - 1))

    def frames_message():
        frames = draw(st.integers(0, 6))
        kind = draw(st.sampled_from(["good", "good", "good", "bad id", "bad groups", "ragged"]))
        if kind == "good":
            return c2w_frames(draw(st.lists(ids_in_range, min_size=frames * groups, max_size=frames * groups)), groups)
        if kind == "bad id":
            return c2w_frames(draw(st.lists(any_id, min_size=frames * groups, max_size=frames * groups)), groups)
        if kind == "bad groups":
            other = draw(st.integers(0, 20).filter(lambda g: g != groups))
            return c2w_frames(draw(st.lists(ids_in_range, min_size=frames * max(other, 1),
                                            max_size=frames * max(other, 1))), other)
        return c2w_frames(draw(st.lists(ids_in_range, min_size=1, max_size=3 * groups)), groups)

    # Hypothesis leans to the low end of each range (0 first): there, the stream is well formed (a
    # start, good frames, an end), so every run draws some that must end OK.
    messages = [C2W_START] if draw(st.integers(0, 9)) < 9 else []
    for _ in range(draw(st.integers(0, 4))):
        choice = draw(st.sampled_from(["frames", "frames", "frames", "start", "empty"]))
        messages.append(frames_message() if choice == "frames" else C2W_START if choice == "start"
                        else stages_pb2.Code2WavInput())
    if draw(st.integers(0, 5)) < 5:
        messages.append(C2W_END)
    return messages


def check_code2wav(stages: Stages, messages: list[stages_pb2.Code2WavInput]) -> str:
    want, field, frames = expect_code2wav(messages, stages)
    code, outputs, err = run_stream(stages.code2wav, "/omni.v1.Code2Wav/Decode", stages_pb2.Code2WavInput, messages)
    assert code is want, (code, err.details() if err else None, want, field, messages)
    if code is grpc.StatusCode.OK:
        decoded = [stages_pb2.Code2WavOutput.FromString(o) for o in outputs]
        samples = sum(o.audio.num_samples for o in decoded if o.HasField("audio"))
        assert decoded[-1].HasField("final") and decoded[-1].final.audio_samples == samples, decoded[-1]
        assert (samples > 0) == (frames > 0), (samples, frames)  # audio exactly when frames came
    else:
        assert_names(err, field)
    return code.name


@pytest.mark.parametrize("bad_id", ["-1", "codebook_size"])
def test_code2wav_refuses_codec_ids_out_of_range_naming_the_field(stages, bad_id):
    value = -1 if bad_id == "-1" else stages.codebook_size
    ids = [0] * (2 * stages.groups)
    ids[stages.groups + 3] = value
    messages = [C2W_START, c2w_frames(ids, stages.groups), C2W_END]
    code, _, err = run_stream(stages.code2wav, "/omni.v1.Code2Wav/Decode", stages_pb2.Code2WavInput, messages)
    assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, err.details() if err else None)
    assert_names(err, "frames.ids")
    assert f"[0, {stages.codebook_size})" in err.details(), err.details()
    # The edges of the range decode.
    edge = [0] * stages.groups + [stages.codebook_size - 1] * stages.groups
    assert check_code2wav(stages, [C2W_START, c2w_frames(edge, stages.groups), C2W_END]) == "OK"


def fuzz_code2wav(stages: Stages, examples: int) -> dict[str, int]:
    codes: dict[str, int] = {}

    @seeded
    @fuzz_settings(examples)
    @given(code2wav_streams(stages.groups, stages.codebook_size))
    def one(messages) -> None:
        code = check_code2wav(stages, messages)
        codes[code] = codes.get(code, 0) + 1

    one()
    print(f"code2wav streams: {codes}")
    return codes


def test_fuzzed_code2wav_streams_end_as_the_oracle_says(stages):
    codes = fuzz_code2wav(stages, 40)
    assert sum(codes.values()) == 40 and codes.get("OK", 0) >= 1, codes


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(1800)
def test_many_fuzzed_code2wav_streams_end_as_the_oracle_says(stages):
    codes = fuzz_code2wav(stages, 2000)
    assert codes.get("OK", 0) >= 100, codes


# --- talker: TalkerInput streams -----------------------------------------------------------------

def floats(shape, rng: np.random.Generator, dtype=np.float32) -> common_pb2.Tensor:
    import torch

    return tensor_to_proto(torch.from_numpy(rng.standard_normal(shape).astype(dtype)))


@st.composite
def talker_streams(draw, stages: Stages) -> tuple[list[stages_pb2.TalkerInput], bool, str]:
    """(messages, valid, mutation): a start as a thinker sends it (random rows of the right widths), some
    tokens, finished; then, half the time, one mutation that makes it invalid."""
    import torch

    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    hidden = stages.hidden
    # A thinker's prompt: a user turn of random text ids, then "<|im_start|>assistant\n".
    words = draw(st.lists(st.integers(0, 200), min_size=1, max_size=8))
    ids = [stages.im_start, stages.user, *words, stages.im_start, stages.assistant, draw(st.integers(0, 200))]
    prompt = len(ids)
    start = stages_pb2.TalkerStart(
        request_id="fuzz", route=stages_pb2.Route(code2wav=stages.code2wav), voice=draw(st.sampled_from(["", "ethan"])),
        sampling=common_pb2.SamplingParams(max_new_tokens=draw(st.integers(1, 6))),
        prompt_token_ids=ids,
        prompt_embeds=floats((prompt, hidden), rng), tts_embeds=floats((3, hidden), rng))
    tokens = [stages_pb2.TalkerInput(token=stages_pb2.TextToken(token_id=draw(st.integers(0, 200)),
                                                                embedding=floats((hidden,), rng)))
              for _ in range(draw(st.integers(0, 4)))]
    finished = stages_pb2.TalkerInput(finished=stages_pb2.TextFinished())
    mutation = draw(st.sampled_from(["none"] * 6 + [
        "no assistant turn", "no start", "embeds rows", "embeds width", "embeds dtype", "tts shape", "multimodal", "token width",
        "no finished", "voice", "max_new_tokens", "raw tensor bytes"]))
    if mutation == "no assistant turn":  # random ids (no "<|im_start|>assistant" pair), embeddings to match
        del start.prompt_token_ids[:]
        start.prompt_token_ids.extend(draw(st.lists(st.integers(0, 200).filter(lambda t: t != stages.assistant),
                                                    min_size=prompt, max_size=prompt)))
    elif mutation == "embeds rows":
        start.prompt_embeds.CopyFrom(floats((prompt + draw(st.integers(1, 3)), hidden), rng))
    elif mutation == "embeds width":
        start.prompt_embeds.CopyFrom(floats((prompt, hidden + draw(st.integers(1, 9))), rng))
    elif mutation == "embeds dtype":
        start.prompt_embeds.CopyFrom(tensor_to_proto(torch.zeros((prompt, hidden), dtype=torch.int64)))
    elif mutation == "tts shape":
        start.tts_embeds.CopyFrom(floats((draw(st.sampled_from([1, 2, 4])), hidden), rng))
    elif mutation == "multimodal":
        start.multimodal_positions.extend(draw(st.lists(st.integers(-2, prompt + 3), min_size=1, max_size=3)))
        start.multimodal_hidden.CopyFrom(floats((draw(st.integers(0, 4)), hidden), rng))
    elif mutation == "voice":
        start.voice = draw(st.text(min_size=1, max_size=8).filter(lambda v: v.lower() not in ("ethan", "chelsie",
                                                                                                "aiden")))
    elif mutation == "max_new_tokens":
        start.sampling.max_new_tokens = draw(st.sampled_from([10**6, 2**31 - 1]))
    elif mutation == "raw tensor bytes":
        start.prompt_embeds.data = start.prompt_embeds.data[:-draw(st.integers(1, 8))]
    messages = [] if mutation == "no start" else [stages_pb2.TalkerInput(start=start)]
    if mutation == "token width" and tokens:
        tokens[-1].token.embedding.CopyFrom(floats((hidden - 1,), rng))
    messages += tokens
    if mutation != "no finished":
        messages.append(finished)
    if mutation == "no finished":  # enough frames asked that the talker must wait for the text's end
        start.sampling.max_new_tokens = len(tokens) + 8
    inside = len(start.multimodal_hidden.shape) == 2 and start.multimodal_hidden.shape[0] == len(
        start.multimodal_positions) and all(0 <= p < prompt for p in start.multimodal_positions) and all(
        a < b for a, b in zip(start.multimodal_positions, start.multimodal_positions[1:]))
    valid = (mutation == "none" or (mutation == "token width" and not tokens) or (mutation == "multimodal" and inside))
    return messages, valid, mutation


def late_row(mutation: str, messages: list[stages_pb2.TalkerInput]) -> int | None:
    """The text row a mutation in a later message spoils (the last token's width; the missing
    text-finished mark, which stands where row len(tokens) would), or None for one in the start."""
    tokens = sum(m.HasField("token") for m in messages)
    if mutation == "token width" and tokens:
        return tokens - 1
    return tokens if mutation == "no finished" else None


def rows_needed(final: stages_pb2.TalkerFinal) -> int:
    """How many text rows the talker had to read: frame f is computed from row f (the engine's
    `ready`), and a codec end drawn at step f computed one more step than the frames it kept."""
    return final.codec_frames + (final.finish_reason == common_pb2.FINISH_REASON_STOP)


def fuzz_talker(stages: Stages, examples: int) -> dict[str, int]:
    codes: dict[str, int] = {}

    @seeded
    @fuzz_settings(examples)
    @given(talker_streams(stages))
    def one(case) -> None:
        messages, valid, mutation = case
        code, outputs, err = run_stream(stages.talker, "/omni.v1.Talker/Speak", stages_pb2.TalkerInput, messages)
        details = err.details() if err else None
        late = late_row(mutation, messages)
        if late is not None and code is grpc.StatusCode.OK:
            # The talker finished before it needed the bad (or missing) message, and whether its
            # reader had read that far by then is a race: a complete answer, nothing to refuse.
            final = stages_pb2.TalkerOutput.FromString(outputs[-1]).final
            assert rows_needed(final) <= late, (mutation, late, final)
        elif valid:
            assert code is grpc.StatusCode.OK, (code, details)
            final = stages_pb2.TalkerOutput.FromString(outputs[-1])
            assert final.HasField("final"), final  # (random weights may draw the codec end at once: 0 frames)
        else:
            assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details, [m.WhichOneof("event") for m in messages])
            assert_names(err, None)
        codes[code.name] = codes.get(code.name, 0) + 1

    one()
    print(f"talker streams: {codes}")
    return codes


@pytest.mark.parametrize("positions", [[2, 2, 2], [3, 1]])
def test_multimodal_positions_out_of_prompt_order_are_refused_naming_the_field(stages, positions):
    """The talker places the multimodal rows at their positions in prompt order (a mask, as generate
    does): a repeated or unordered position is refused, not a failed step (the fuzzer found
    [0, 0, 0] passing the check and failing the prefill with INTERNAL)."""
    rng = np.random.default_rng(0)
    ids = [stages.im_start, stages.user, 5, 6, 7, stages.im_start, stages.assistant, 8]
    start = stages_pb2.TalkerStart(
        request_id="order", route=stages_pb2.Route(code2wav=stages.code2wav),
        sampling=common_pb2.SamplingParams(max_new_tokens=1), prompt_token_ids=ids,
        prompt_embeds=floats((len(ids), stages.hidden), rng), tts_embeds=floats((3, stages.hidden), rng),
        multimodal_positions=positions, multimodal_hidden=floats((len(positions), stages.hidden), rng))
    code, _, err = run_stream(stages.talker, "/omni.v1.Talker/Speak", stages_pb2.TalkerInput, [
        stages_pb2.TalkerInput(start=start), stages_pb2.TalkerInput(finished=stages_pb2.TextFinished())])
    assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, err and err.details())
    assert_names(err, "start.multimodal_positions")


def test_fuzzed_talker_streams_end_ok_or_invalid_argument_naming_a_field(stages):
    codes = fuzz_talker(stages, 30)
    assert sum(codes.values()) == 30, codes


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(1800)
def test_many_fuzzed_talker_streams_end_ok_or_invalid_argument_naming_a_field(stages):
    codes = fuzz_talker(stages, 1000)
    assert codes.get("OK", 0) >= 50 and codes.get("INVALID_ARGUMENT", 0) >= 50, codes
