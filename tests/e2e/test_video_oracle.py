"""Video in the user turn, against an oracle that shares no input code with the pipeline.

The oracle's inputs come from transformers' own processor with its real video processor
(services/tools/video_oracle.py: `Qwen2VLVideoProcessor`, run in a child process where
torchvision imports); the pipeline's from the project's PromptBuilder (services/runtime/inputs/video.py).
Then the real stack over gRPC against `generate` on those inputs: text ids and codec frames equal,
with and without the audio track (Qwen3-Omni interleaves the track's pads with the frames' pads by
time), in both containers: mp4 (h264, aac) and webm (vp9, vorbis; a webm declares no frame count).
The videos are made here with PyAV (services/tools/synthetic_video.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

from omni.v1 import omni_pb2
from services.runtime.inputs.prompt import ChatMessage, Part, PromptBuilder, Role
from services.tools.client import collect
from services.tools.synthetic_video import frame_images, video
from services.tools.video_oracle import video_inputs
from tests.e2e.test_independent_oracle import ROLES, image, wav

# slow: the oracle's child process imports transformers again (~20-50 s on 2 cores)
pytestmark = [pytest.mark.slow, pytest.mark.exactness]

FPS = 2.0  # PromptLimits.video_fps


@functools.cache  # one encoding of each video for the oracle and the pipeline alike
def cases() -> dict[str, tuple[list[ChatMessage], bool]]:
    S, U = Role.SYSTEM, Role.USER
    clip = video(frames=12, width=64, height=48, fps=6, audio_seconds=2.0, seed=1)
    # A webm: vp9 and a 16 kHz Vorbis track (Opus decodes at 48 kHz, which the oracle does not resample).
    webm = video(frames=12, width=64, height=48, fps=6, container="webm", audio_seconds=2.0, audio_codec="vorbis",
                 seed=3)
    return {
        # 12 frames at 6 fps, 2 sampled a second: 4 frames, 2 temporal patches.
        "video_and_text": ([ChatMessage(S, (Part(text="Answer briefly."),)),
                            ChatMessage(U, (Part(video=clip), Part(text="What moves?")))], False),
        # The track (2 s at 16 kHz) interleaved with the frames; an audio part before it shares the
        # audio feature batch, in prompt order.
        "video_with_its_audio_track_after_an_audio": (
            [ChatMessage(U, (Part(audio=wav(0.6, 330)), Part(text="then"),
                             Part(video=clip, use_audio_in_video=True), Part(text="What is heard?")))], True),
        "webm_and_text": ([ChatMessage(U, (Part(text="Look."), Part(video=webm), Part(text="What moves?")))], False),
        "webm_with_its_audio_track": ([ChatMessage(U, (Part(video=webm, use_audio_in_video=True),
                                                       Part(text="What is heard?")))], True),
        # A video given as its 12 png frames at 6 fps (Content.video_frames), after an image.
        "video_as_frames": ([ChatMessage(U, (Part(image=image(48, 64, 5)),
                                             Part(video_frames=frame_images(seed=2), video_fps=6.0),
                                             Part(text="What moves?")))], False),
    }


def as_video_request(messages: list[ChatMessage], use_audio: bool, voice: str, max_new: int, talker_max: int):
    request = omni_pb2.GenerateRequest(return_codec_frames=True, voice=voice, use_audio_in_video=use_audio)
    for message in messages:
        turn = request.messages.add(role=ROLES[message.role])
        for part in message.parts:
            if part.video_frames is not None:
                turn.content.add(video_frames=omni_pb2.VideoFrames(frames=part.video_frames, fps=part.video_fps))
                continue
            kind = next(k for k in ("text", "audio", "image", "video") if getattr(part, k) is not None)
            turn.content.add(**{kind: getattr(part, kind)})
    request.output_modalities.extend([omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO])
    request.thinker_sampling.max_new_tokens = max_new
    request.talker_sampling.max_new_tokens = talker_max
    return request


@pytest.fixture(scope="module")
def oracle_inputs(tiny_checkpoint):
    names = sorted(cases())
    return dict(zip(names, video_inputs(tiny_checkpoint, [cases()[name] for name in names], FPS)))


@pytest.mark.parametrize("case", sorted(cases()))
def test_video_prompt_inputs_equal_transformers_video_processor(case, oracle_inputs, reference, tiny_checkpoint):
    messages, use_audio = cases()[case]
    oracle = oracle_inputs[case]
    built = PromptBuilder(tiny_checkpoint, reference.config).build(messages).model_kwargs()
    assert built.pop("use_audio_in_video", False) is use_audio
    assert sorted(built) == sorted(oracle)
    for key, value in oracle.items():
        assert built[key].shape == value.shape, key
        assert torch.equal(built[key].to(value.dtype), value), key
    ids = oracle["input_ids"][0].tolist()
    cfg = reference.config.thinker_config
    assert oracle["video_grid_thw"].tolist() == [[2, 20, 28]]  # 4 frames of 320x448 (the processor's minimum size)
    assert ids.count(cfg.video_token_id) == 2 * 20 * 28 // 4
    if use_audio:  # the track's pads lie between the video's pads
        video_at = [i for i, t in enumerate(ids) if t == cfg.video_token_id]
        audio_at = [i for i, t in enumerate(ids) if t == cfg.audio_token_id]
        assert any(video_at[0] < i < video_at[-1] for i in audio_at)


@pytest.mark.parametrize("case", sorted(cases()))
def test_pipeline_equals_generate_on_video_inputs(case, oracle_inputs, omni, reference):
    messages, use_audio = cases()[case]
    inputs = dict(oracle_inputs[case], **({"use_audio_in_video": True} if use_audio else {}))
    expected = reference.generate([], voice="aiden", max_new_tokens=10, talker_max_new_tokens=30, inputs=inputs)
    got = collect(omni, as_video_request(messages, use_audio, "aiden", 10, 30), timeout=240)
    assert got.thinker_token_ids == expected.thinker_token_ids
    assert got.codec_frames == expected.codec_frames
    assert len(got.codec_frames) == 29
    assert got.final.usage.prompt_tokens == expected.prompt_tokens


# Qwen2.5-Omni: its processor's own video defaults (28-pixel factor, 25 positions a second) and its
# interleave (2-second chunks: each chunk's video pads, then its audio pads); the talker takes the
# thinker's hidden states, so the video reaches it through them alone.
@pytest.fixture(scope="module")
def qwen2_5(tiny_qwen2_5_checkpoint):
    from services.tools.reference import ReferenceRunner
    from tests.stacks import stack_of

    names = sorted(cases())
    inputs = dict(zip(names, video_inputs(tiny_qwen2_5_checkpoint, [cases()[n] for n in names], FPS)))
    with stack_of(tiny_qwen2_5_checkpoint) as stack:
        yield inputs, ReferenceRunner(tiny_qwen2_5_checkpoint), stack


@pytest.mark.parametrize("case", sorted(cases()))
def test_qwen2_5_video_inputs_and_outputs_equal_transformers(case, qwen2_5, tiny_qwen2_5_checkpoint):
    from services.tools.client import connect

    oracle_inputs, runner, stack = qwen2_5
    messages, use_audio = cases()[case]
    oracle = oracle_inputs[case]
    built = PromptBuilder(tiny_qwen2_5_checkpoint, runner.config).build(messages).model_kwargs()
    assert built.pop("use_audio_in_video", False) is use_audio
    assert sorted(built) == sorted(oracle)
    for key, value in oracle.items():
        assert built[key].shape == value.shape and torch.equal(built[key].to(value.dtype), value), key

    inputs = dict(oracle, **({"use_audio_in_video": True} if use_audio else {}))
    expected = runner.generate([], voice="ethan", max_new_tokens=10, talker_max_new_tokens=30, inputs=inputs)
    channel, stub = connect(stack.target)
    try:
        got = collect(stub, as_video_request(messages, use_audio, "ethan", 10, 30), timeout=240)
    finally:
        channel.close()
    assert got.thinker_token_ids == expected.thinker_token_ids
    assert got.codec_frames == expected.codec_frames and len(got.codec_frames) > 0
    assert got.final.usage.prompt_tokens == expected.prompt_tokens
