"""Protos survive serialisation; the tensor/audio/frames wire format is bit-exact; sampling validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni.v1 import common_pb2, omni_pb2, stages_pb2
from services.base.errors import InvalidArgument
from services.runtime.lm.sampling import SamplingConfig
from services.serving.convert import sampling_from_proto, sampling_to_proto
from services.serving.wire import (
    WireError,
    audio_from_proto,
    audio_to_proto,
    frames_from_proto,
    frames_to_proto,
    tensor_from_proto,
    tensor_to_proto,
)

WIRE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32]
# Same bit width integer view, to compare floats bit for bit (NaN payloads and -0.0 included).
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def roundtrip(message):
    return type(message).FromString(message.SerializeToString())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype]) if t.dtype in BITS else t


# --- protos ---


def test_generate_request_roundtrip_keeps_messages_media_and_presence(wav_bytes, png_bytes):
    request = omni_pb2.GenerateRequest(
        request_id="r-1",
        messages=[
            omni_pb2.Message(role=omni_pb2.ROLE_SYSTEM, content=[omni_pb2.Content(text="Be brief.")]),
            omni_pb2.Message(role=omni_pb2.ROLE_USER, content=[
                omni_pb2.Content(audio=wav_bytes), omni_pb2.Content(image=png_bytes), omni_pb2.Content(text="Hi"),
            ]),
        ],
        output_modalities=[omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO],
        voice="chelsie",
        thinker_sampling=common_pb2.SamplingParams(temperature=0.0, top_k=0, max_new_tokens=8),
        return_codec_frames=True,
    )
    got = roundtrip(request)
    assert got == request
    user = got.messages[1]
    assert [c.WhichOneof("part") for c in user.content] == ["audio", "image", "text"]
    assert user.content[0].audio == wav_bytes and user.content[1].image == png_bytes
    assert got.HasField("voice") and got.voice == "chelsie"
    # Explicit zeros are set, not defaults; untouched fields stay unset.
    sp = got.thinker_sampling
    assert sp.HasField("temperature") and sp.temperature == 0.0
    assert sp.HasField("top_k") and sp.top_k == 0
    assert not sp.HasField("top_p") and not sp.HasField("seed")
    assert got.HasField("thinker_sampling") and not got.HasField("talker_sampling")


def test_generate_request_without_optional_fields_has_none():
    got = roundtrip(omni_pb2.GenerateRequest(messages=[omni_pb2.Message(role=omni_pb2.ROLE_USER)]))
    assert not got.HasField("voice") and got.voice == ""
    assert not got.HasField("request_id") and got.request_id == ""
    assert not got.HasField("thinker_sampling")
    assert list(got.output_modalities) == []
    assert got.messages[0].content == []


@pytest.mark.parametrize("message, field", [
    (stages_pb2.TalkerStart(request_id="r"), "voice"),
    (stages_pb2.Code2WavStart(request_id="r"), "voice"),
    (common_pb2.StageLimits(max_model_len=8), "text_rows_to_first_chunk"),
])
def test_fields_whose_absence_means_the_default_have_presence(message, field):
    # An explicit empty value is set, and the wire keeps the difference (the stages read absence
    # as "the default voice" and "not known", never the empty value).
    assert not roundtrip(message).HasField(field)
    setattr(message, field, type(getattr(message, field))())
    assert roundtrip(message).HasField(field)


def test_content_part_is_a_oneof():
    content = omni_pb2.Content(text="hi")
    content.image = b"\x89PNG"
    assert content.WhichOneof("part") == "image"
    assert not content.HasField("text")
    assert omni_pb2.Content().WhichOneof("part") is None


@pytest.mark.parametrize("event", ["text", "audio", "codec_frames", "final"])
def test_generate_response_oneof_roundtrip(event):
    payload = {
        "text": omni_pb2.TextDelta(text="hé", token_ids=[1, 2]),
        "audio": audio_to_proto(np.array([0.25, -0.5], np.float32), 24000, index=3, first_frame=7),
        "codec_frames": frames_to_proto(torch.arange(32).reshape(2, 16), first_frame=4),
        "final": omni_pb2.Final(
            text_finish_reason=common_pb2.FINISH_REASON_STOP,
            audio_finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=omni_pb2.Usage(prompt_tokens=10, text_tokens=8, codec_frames=23, audio_seconds=1.8165),
            timings=omni_pb2.Timings(queue_ms=0.5, ttft_ms=12.0, ttfp_ms=40.0, total_ms=300.0),
        ),
    }[event]
    response = omni_pb2.GenerateResponse(request_id="r-1", **{event: payload})
    got = roundtrip(response)
    assert got == response
    assert got.WhichOneof("event") == event
    assert getattr(got, event) == payload


def test_talker_input_oneof_roundtrip():
    start = stages_pb2.TalkerStart(
        request_id="r-1",
        route=stages_pb2.Route(talker="127.0.0.1:1", code2wav="127.0.0.1:2"),
        voice="ethan",
        sampling=common_pb2.SamplingParams(seed=7),
        prompt_token_ids=[1, 2, 3],
        prompt_embeds=tensor_to_proto(torch.randn(3, 4)),
        multimodal_positions=[],
        tts_embeds=tensor_to_proto(torch.randn(3, 4).to(torch.bfloat16)),
    )
    events = [
        stages_pb2.TalkerInput(start=start),
        stages_pb2.TalkerInput(token=stages_pb2.TextToken(token_id=5, embedding=tensor_to_proto(torch.ones(4)))),
        stages_pb2.TalkerInput(finished=stages_pb2.TextFinished()),
    ]
    got = [roundtrip(e) for e in events]
    assert got == events
    assert [e.WhichOneof("event") for e in got] == ["start", "token", "finished"]
    assert got[0].start.sampling.HasField("seed") and not got[0].start.sampling.HasField("temperature")
    assert not got[0].start.HasField("image_grid_thw") and got[0].start.HasField("prompt_embeds")
    assert torch.equal(tensor_from_proto(got[1].token.embedding), torch.ones(4))


def test_code2wav_input_and_output_oneofs_roundtrip():
    inputs = [
        stages_pb2.Code2WavInput(start=stages_pb2.Code2WavStart(request_id="r-1")),
        stages_pb2.Code2WavInput(frames=frames_to_proto(torch.zeros(3, 16, dtype=torch.int64), first_frame=0)),
        stages_pb2.Code2WavInput(end=stages_pb2.CodecEnd()),
    ]
    assert [roundtrip(m).WhichOneof("event") for m in inputs] == ["start", "frames", "end"]
    assert [roundtrip(m) for m in inputs] == inputs
    outputs = [
        stages_pb2.Code2WavOutput(audio=audio_to_proto(np.zeros(4, np.float32), 24000, index=0)),
        stages_pb2.Code2WavOutput(final=stages_pb2.Code2WavFinal(audio_samples=4)),
    ]
    assert [roundtrip(m).WhichOneof("event") for m in outputs] == ["audio", "final"]
    talker_out = stages_pb2.TalkerOutput(final=stages_pb2.TalkerFinal(
        finish_reason=common_pb2.FINISH_REASON_CANCELLED, codec_frames=3, audio_samples=5205))
    assert roundtrip(talker_out).final.finish_reason == common_pb2.FINISH_REASON_CANCELLED


# --- tensors ---


def sample_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 1e3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)


@pytest.mark.parametrize("shape", [(2, 3, 5), (7,), (), (0,), (4, 0, 2)], ids=str)
@pytest.mark.parametrize("dtype", WIRE_DTYPES, ids=str)
def test_tensor_roundtrip_is_bit_exact(dtype, shape):
    t = sample_tensor(dtype, shape)
    p = roundtrip(tensor_to_proto(t))
    assert list(p.shape) == list(shape)
    assert len(p.data) == t.numel() * t.element_size()
    got = tensor_from_proto(p)
    assert got.dtype == dtype and got.shape == t.shape
    assert torch.equal(bits(got), bits(t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_float_specials_survive_the_wire(dtype):
    t = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40], dtype=torch.float32).to(dtype)
    assert torch.equal(bits(tensor_from_proto(tensor_to_proto(t))), bits(t))


def test_bfloat16_travels_as_its_16_bit_pattern():
    t = torch.tensor([1.0, -2.5], dtype=torch.bfloat16)
    p = tensor_to_proto(t)
    assert p.dtype == common_pb2.Tensor.DTYPE_BFLOAT16
    assert p.data == t.view(torch.int16).numpy().astype("<i2").tobytes()


def test_non_contiguous_tensor_is_sent_in_row_major_order():
    t = torch.arange(6, dtype=torch.int64).reshape(2, 3).T  # [3, 2], a transposed view
    got = tensor_from_proto(tensor_to_proto(t))
    assert torch.equal(got, t)


def test_decoded_tensor_is_writable_and_owns_its_memory():
    p = tensor_to_proto(torch.zeros(3))
    got = tensor_from_proto(p)
    got += 1  # frombuffer over the proto's immutable bytes would fail or alias
    assert torch.equal(tensor_from_proto(p), torch.zeros(3))


def test_tensor_bytes_not_matching_shape_is_a_wire_error():
    p = tensor_to_proto(torch.zeros(2, 3))
    short = common_pb2.Tensor(dtype=p.dtype, shape=p.shape, data=p.data[:-1])
    with pytest.raises(WireError, match="do not match"):
        tensor_from_proto(short)
    wrong_shape = common_pb2.Tensor(dtype=p.dtype, shape=[4, 3], data=p.data)
    with pytest.raises(WireError):
        tensor_from_proto(wrong_shape)
    negative = common_pb2.Tensor(dtype=p.dtype, shape=[-2, -3], data=p.data)
    with pytest.raises(WireError):
        tensor_from_proto(negative)
    scalar_without_bytes = common_pb2.Tensor(dtype=p.dtype, shape=[], data=b"")
    with pytest.raises(WireError):
        tensor_from_proto(scalar_without_bytes)


def test_shape_overflowing_int64_is_a_wire_error():
    with pytest.raises(WireError):
        tensor_from_proto(common_pb2.Tensor(dtype=common_pb2.Tensor.DTYPE_FLOAT32, shape=[2**62, 4], data=b""))


@pytest.mark.parametrize("dtype", [common_pb2.Tensor.DTYPE_UNSPECIFIED, 99])
def test_unknown_tensor_dtype_is_a_wire_error(dtype):
    with pytest.raises(WireError, match="unknown tensor dtype"):
        tensor_from_proto(common_pb2.Tensor(dtype=dtype, shape=[1], data=b"\0\0\0\0"))


def test_dtype_without_wire_encoding_is_a_wire_error():
    with pytest.raises(WireError, match="no wire encoding"):
        tensor_to_proto(torch.zeros(2, dtype=torch.float64))


# --- audio and codec frames ---


def test_audio_roundtrip_is_bit_exact_float32():
    samples = np.random.default_rng(0).uniform(-1, 1, 1365).astype(np.float32)
    p = roundtrip(audio_to_proto(samples, 24000, index=2, first_frame=11))
    assert (p.sample_rate, p.index, p.num_samples, p.first_frame) == (24000, 2, 1365, 11)
    got = audio_from_proto(p)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, samples)


def test_audio_to_proto_converts_float64_to_float32():
    samples = np.array([0.1, -0.2], dtype=np.float64)
    got = audio_from_proto(audio_to_proto(samples, 16000, index=0))
    np.testing.assert_array_equal(got, samples.astype(np.float32))


def test_empty_audio_roundtrip():
    p = roundtrip(audio_to_proto(np.zeros(0, np.float32), 24000, index=0))
    assert p.num_samples == 0 and audio_from_proto(p).shape == (0,)


def test_audio_with_a_partial_sample_is_a_wire_error():
    with pytest.raises(WireError, match="float32"):
        audio_from_proto(common_pb2.AudioChunk(pcm=b"\0" * 6, sample_rate=24000))


@pytest.mark.parametrize("n_frames", [0, 1, 23])
def test_frames_roundtrip(n_frames):
    frames = torch.randint(0, 2048, (n_frames, 16), generator=torch.Generator().manual_seed(n_frames))
    p = roundtrip(frames_to_proto(frames, first_frame=5))
    assert (p.first_frame, p.num_code_groups, len(p.ids)) == (5, 16, n_frames * 16)
    got = frames_from_proto(p)
    assert got.dtype == torch.int64 and got.shape == (n_frames, 16)
    assert torch.equal(got, frames)


def test_frames_not_splitting_into_groups_is_a_wire_error():
    with pytest.raises(WireError):
        frames_from_proto(common_pb2.CodecFrames(num_code_groups=16, ids=list(range(17))))
    with pytest.raises(WireError):
        frames_from_proto(common_pb2.CodecFrames(num_code_groups=0, ids=[]))


# --- sampling ---


def parse(field: str = "thinker_sampling", **fields) -> SamplingConfig:
    return sampling_from_proto(common_pb2.SamplingParams(**fields), field, default_max_new_tokens=64,
                               max_new_tokens_limit=512)


def test_unset_sampling_is_greedy_with_server_defaults():
    cfg = sampling_from_proto(common_pb2.SamplingParams(), "talker_sampling", default_max_new_tokens=256,
                              max_new_tokens_limit=4096, default_repetition_penalty=1.05)
    assert cfg == SamplingConfig(max_new_tokens=256, repetition_penalty=1.05)
    assert cfg.greedy and cfg.generator() is None


def test_set_sampling_fields_are_taken():
    cfg = parse(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.1, max_new_tokens=12, seed=3)
    assert cfg.temperature == pytest.approx(0.7) and cfg.top_p == pytest.approx(0.8)
    assert (cfg.top_k, cfg.max_new_tokens, cfg.seed) == (20, 12, 3)
    assert cfg.repetition_penalty == pytest.approx(1.1)
    assert not cfg.greedy
    assert cfg.generator().initial_seed() == 3


def test_explicit_zero_temperature_is_greedy():
    assert parse(temperature=0.0).greedy


@pytest.mark.parametrize(
    "fields, bad",
    [
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 11.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 513}, "max_new_tokens"),
    ],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("where", ["thinker_sampling", "talker_sampling"])
def test_invalid_sampling_names_the_field(fields, bad, where):
    with pytest.raises(InvalidArgument) as err:
        parse(where, **fields)
    assert err.value.field == f"{where}.{bad}"
    assert str(err.value).startswith(f"{where}.{bad}: must be")


def test_sampling_config_survives_the_proto_both_ways():
    # What the in-process handoff (services/tools/inprocess.py) sends through the talker adapter.
    for cfg in (SamplingConfig(), SamplingConfig(temperature=0.5, top_k=7, top_p=0.75, repetition_penalty=1.25,
                                                 max_new_tokens=9, seed=3)):
        p = roundtrip(sampling_to_proto(cfg))
        assert sampling_from_proto(p, "s", default_max_new_tokens=1, max_new_tokens_limit=100) == cfg
