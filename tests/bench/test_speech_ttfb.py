"""`python -m bench.probes.speech_ttfb`: its figure is TTFB p50 / TTFP p50 per format (pure functions)."""

from __future__ import annotations

from bench.probes.speech_ttfb import SpeechTiming, ratios, report


def test_ratio_is_each_formats_p50_over_the_grpc_ttfp_p50():
    results = [SpeechTiming("grpc", [0.4, 0.5, 0.6]), SpeechTiming("pcm", [0.5, 0.6, 0.7]),
               SpeechTiming("mp3", [0.6, 0.9, 0.75])]
    got = ratios(results)
    assert set(got) == {"pcm", "mp3"}
    assert round(got["pcm"], 6) == 1.2 and round(got["mp3"], 6) == 1.5
    text = report(results)
    assert "1.20" in text and "1.50" in text and text.splitlines()[1].startswith("grpc")
