"""The benchmark's pieces on the tiny Qwen2.5-Omni checkpoint:
the transformers reference (one request and a left-padded batch), the thinker + talker part of the
first-chunk floor, and the whole floor to streaming Token2Wav's first audio."""

from __future__ import annotations

import pytest

from bench.floor import FloorMeter, LMFloor
from bench.prompts import BenchPrompt
from bench.reference import Reference
from bench.systems import GatewaySystem
from services.tools.reference import ReferenceRunner

MAX_TEXT, MAX_TALKER = 8, 12
SAMPLES_PER_CODE = 480  # Token2Wav: 2 mel frames a code, 240 samples a mel frame, at 24 kHz

# 11 s of Qwen2.5-Omni reference and floor runs: make test-slow (CI).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def runner(tiny_qwen2_5_checkpoint) -> ReferenceRunner:
    return ReferenceRunner(tiny_qwen2_5_checkpoint)


def test_reference_generates_one_request_and_a_batch_of_mixed_prompts(runner, wav_bytes, png_bytes):
    reference = Reference(runner, "cpu", None, MAX_TEXT, MAX_TALKER)
    assert reference.speaker == "Chelsie"  # generate's default, as the thinker stage's
    prompts = [BenchPrompt("Hello! How are you today?", "Answer briefly."),
               BenchPrompt("What do you hear?", audio=wav_bytes), BenchPrompt("Describe it.", image=png_bytes)]
    # The tiny checkpoint never ends early: every request runs to both limits.
    (alone,) = reference.generate(prompts[:1])
    assert alone.text_tokens == MAX_TEXT and alone.audio_seconds == MAX_TALKER * SAMPLES_PER_CODE / 24000
    batch = reference.generate(prompts)
    assert [(g.text_tokens, g.audio_seconds) for g in batch] == [(alone.text_tokens, alone.audio_seconds)] * 3


@pytest.mark.parametrize("frames", [4, 1])
def test_floor_lms_reach_the_first_chunk_one_token_later_than_qwen3(runner, frames):
    # Qwen2.5-Omni's talker starts on reply part 0, which comes with token 1, and frame f needs
    # reply part f: a first chunk of n frames takes n + 1 thinker tokens (Qwen3-Omni's takes n).
    floor = LMFloor(runner, "cpu", "ethan", MAX_TEXT, MAX_TALKER, first_chunk_frames=frames)
    first = floor.measure(BenchPrompt("Hello! How are you today?", "Answer briefly."))
    assert first.chunk.shape == (frames, 1) and first.thinker_tokens == frames + 1
    assert all(t > 0 for t in (first.prompt_ms, first.thinker_prefill_ms, first.thinker_decode_ms,
                               first.talker_prefill_ms))
    assert (first.talker_decode_ms > 0) == (frames > 1)
    assert not floor.thinker.has_work() and not floor.talker.has_work()  # aborted after the chunk
    assert floor.thinker.running == 0 and floor.talker.running == 0


@pytest.mark.exactness
def test_floor_lms_codes_are_generates(runner):
    floor = LMFloor(runner, "cpu", None, MAX_TEXT, MAX_TALKER, first_chunk_frames=4)
    prompt = BenchPrompt("Hello! How are you today?")
    want = runner.generate(prompt.messages(), None, MAX_TEXT, MAX_TALKER)
    assert floor.measure(prompt).chunk[:, 0].tolist() == [frame[0] for frame in want.codec_frames[:4]]


def test_the_floor_runs_to_token2wav_s_first_audio(runner):
    # Streaming Token2Wav's first audio needs a chunk plus its look-ahead of codes (24 + 48): the
    # talker part runs to that many frames, and the one push gives the first chunk's samples.
    meter = FloorMeter(runner, "cpu", None, MAX_TEXT, 80)
    sample = meter.measure(BenchPrompt("Hello! How are you today?"))
    assert sample.frames == 72 and sample.code2wav_ms > 0
    assert meter.lms.first_chunk_frames == 72
    # A burst of two: both reach Token2Wav's first audio, and the engines hold nothing afterwards.
    assert len(meter.measure_burst([BenchPrompt("Hello! How are you today?"), BenchPrompt("Tell me a story.")])) == 2
    assert meter.lms.thinker.running == meter.lms.talker.running == 0



def test_gateway_requests_leave_the_voice_to_the_stack_when_none_is_given():
    body = GatewaySystem("http://127.0.0.1:1", None, 16, 5).request(BenchPrompt("Hi"))
    assert b'"audio": {"format": "pcm16"}' in body


def test_a_request_shorter_than_a_chunk_and_its_look_ahead_hears_its_audio_at_its_end(runner):
    sample = FloorMeter(runner, "cpu", None, MAX_TEXT, MAX_TALKER).measure(BenchPrompt("Hello! How are you today?"))
    assert 0 < sample.frames < 72 and sample.code2wav_ms > 0  # the flush decoded it
