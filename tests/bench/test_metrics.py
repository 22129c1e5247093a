"""Metric definitions (docs/architecture.md, Measures) on synthetic timelines, seconds from the send."""

from __future__ import annotations

import pytest

from bench.metrics import (
    RequestTiming,
    continuity,
    percentile,
    percentiles,
    ratio,
    simulate_playback,
    summarize,
    whole_response,
)


def streamed(text=(0.05, 0.1), audio=(0.5, 1.0, 1.5), durations=(1.0, 1.0, 1.0), done=1.6) -> RequestTiming:
    return RequestTiming(text_times=text, audio_times=audio, audio_durations=durations, done=done)


def test_percentiles_interpolate_linearly_between_closest_ranks():
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_percentiles_skip_missing_values_and_count_the_rest():
    p = percentiles([3.0, None, 1.0, 2.0])
    assert (p.p50, p.mean, p.n) == (2.0, 2.0, 3)
    empty = percentiles([None])
    assert (empty.p50, empty.p90, empty.p99, empty.mean, empty.n) == (None, None, None, None, 0)


def test_streaming_rtf_runs_from_the_first_chunk_over_the_audio_after_it():
    # Chunks at 0.5, 1.0, 1.5 s of 1 s each: 1 s to make the 2 s after the first chunk.
    assert streamed().streaming_rtf == pytest.approx(0.5)
    assert streamed().rtf == pytest.approx(0.5)  # 1.5 s for 3 s, TTFP included
    slow_start = streamed(audio=(3.0, 3.5, 4.0))
    assert slow_start.streaming_rtf == pytest.approx(0.5) and slow_start.rtf == pytest.approx(4 / 3)
    assert streamed(audio=(0.5,), durations=(1.0,)).streaming_rtf is None  # one chunk: nothing streamed after it
    assert streamed(audio=(), durations=()).streaming_rtf is None


def test_ttft_and_ttfp_are_the_first_text_and_audio_arrivals():
    t = streamed()
    assert t.ttft_s == 0.05
    assert t.ttfp_s == 0.5


def test_rtf_is_last_audio_chunk_time_over_seconds_of_audio():
    t = streamed()  # last chunk at 1.5 s, 3 s of audio
    assert t.audio_seconds == 3.0
    assert t.rtf == pytest.approx(0.5)


def test_rtf_and_ttfp_are_undefined_without_audio():
    t = RequestTiming(text_times=(0.1,), audio_times=(), audio_durations=(), done=0.2)
    assert t.ttfp_s is None and t.rtf is None and t.audio_seconds == 0.0


def test_timeline_rejects_mismatched_or_unordered_chunks():
    with pytest.raises(ValueError):
        RequestTiming(text_times=(), audio_times=(0.1, 0.2), audio_durations=(1.0,), done=1.0)
    with pytest.raises(ValueError):
        RequestTiming(text_times=(), audio_times=(0.3, 0.2), audio_durations=(1.0, 1.0), done=1.0)


def test_a_whole_response_has_ttft_equal_ttfp_including_the_queue_wait():
    t = whole_response(wall_s=1.0, audio_seconds=4.0, wait_s=2.0)
    assert t.ttft_s == t.ttfp_s == 3.0
    assert t.rtf == pytest.approx(0.75)
    assert simulate_playback(t.audio_times, t.audio_durations).underruns == 0


def test_chunks_arriving_faster_than_playback_never_underrun():
    play = simulate_playback((0.5, 1.0, 1.5), (1.0, 1.0, 1.0))
    assert (play.underruns, play.underrun_s, play.start_s) == (0, 0.0, 0.5)


def test_a_late_chunk_is_one_underrun_as_long_as_the_gap():
    # Plays 0.0-0.5, runs dry until the chunk at 1.0, plays 1.0-1.5; the chunk at 1.2 is in time.
    play = simulate_playback((0.0, 1.0, 1.2), (0.5, 0.5, 0.5))
    assert play.underruns == 1
    assert play.underrun_s == pytest.approx(0.5)


def test_gaps_add_up_over_a_request():
    # 0.0-0.2, dry 0.2-0.4, 0.4-0.6, dry 0.6-1.0, 1.0-1.2
    play = simulate_playback((0.0, 0.4, 1.0), (0.2, 0.2, 0.2))
    assert play.underruns == 2
    assert play.underrun_s == pytest.approx(0.6)


def test_a_chunk_arriving_exactly_when_audio_runs_out_is_not_an_underrun():
    assert simulate_playback((0.0, 0.5), (0.5, 0.5)).underruns == 0


def test_a_prebuffer_delays_the_start_and_absorbs_gaps_shorter_than_it():
    late = ((0.0, 1.0, 1.2), (0.5, 0.5, 0.5))
    assert simulate_playback(*late, prebuffer_s=0.5).underruns == 0  # plays 0.5-1.0, then 1.0-1.5
    partial = simulate_playback(*late, prebuffer_s=0.2)  # plays 0.2-0.7, dry until 1.0
    assert partial.underruns == 1 and partial.underrun_s == pytest.approx(0.3)
    assert partial.start_s == pytest.approx(0.2)


def test_no_audio_means_no_playback():
    play = simulate_playback((), ())
    assert (play.underruns, play.underrun_s, play.start_s) == (0, 0.0, None)


def test_continuity_counts_requests_with_underruns():
    smooth = streamed()
    gappy = RequestTiming(text_times=(), audio_times=(0.0, 1.0), audio_durations=(0.5, 0.5), done=1.0)
    c = continuity([smooth, gappy, gappy])
    assert c.requests_with_underrun == 2
    assert c.underruns_per_request.mean == pytest.approx(2 / 3)
    assert c.underrun_s_per_request.p50 == pytest.approx(0.5)


def test_throughput_is_completions_and_audio_per_wall_second():
    s = summarize([streamed(), streamed()], errors=1, wall_s=4.0)
    assert s.requests == 2 and s.errors == 1
    assert s.req_per_s == pytest.approx(0.5)
    assert s.audio_s_per_s == pytest.approx(1.5)  # 2 x 3 s of audio in 4 s
    assert s.ttfp_ms.p50 == pytest.approx(500.0)
    assert s.ttft_ms.p50 == pytest.approx(50.0)
    assert s.rtf.p99 == pytest.approx(0.5)


def test_ratio_is_undefined_when_either_side_is_missing_or_zero():
    assert ratio(1.0, 4.0) == 0.25
    assert ratio(None, 1.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None
