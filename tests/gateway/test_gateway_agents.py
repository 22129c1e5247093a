"""A real agent framework on /v1/realtime, unchanged and with its defaults: the OpenAI Agents SDK's
RealtimeAgent and RealtimeRunner (openai-agents, pinned), pointed at the gateway by URL. Its
first session.update asks for what its defaults are (semantic_vad, a transcription model, tracing
"auto", the `ash` voice); it speaks a recorded turn and must hear the reply's audio, its end, and
the user's transcript in its history."""

from __future__ import annotations

import asyncio

from agents.realtime import RealtimeAgent, RealtimeRunner
from test_gateway_realtime import speech_24k

CHUNK = 24000 * 2 // 10  # 100 ms of pcm16 at 24 kHz


def user_transcripts(history: list) -> list[str]:
    return [item.content[0].transcript for item in history if getattr(item, "role", None) == "user" and item.content
            and item.content[0].transcript]


async def converse(url: str) -> tuple[list, list]:
    """A spoken turn through the framework: (its events up to the reply's audio end, its history once
    that holds the user's transcript)."""
    runner = RealtimeRunner(RealtimeAgent(name="Assistant", instructions="Answer briefly."))
    session = await runner.run(model_config={"url": url, "api_key": "unused"})
    events, history, ended = [], [], False
    async with session:
        audio = bytes(24000) + speech_24k(0) + bytes(2 * 24000)
        for i in range(0, len(audio), CHUNK):
            await session.send_audio(audio[i:i + CHUNK])
        async for event in session:
            if event.type == "error":
                raise AssertionError(f"the framework got an error: {event.error}")
            if not ended:
                events.append(event)
            ended = ended or event.type == "audio_end"
            if event.type == "history_updated":
                history = event.history
            # The user's transcript is made beside the reply: it may come before or after its end.
            if ended and user_transcripts(history):
                return events, history
    raise AssertionError(f"the session ended first: {[e.type for e in events]}")


def test_the_agents_sdks_realtime_agent_with_its_defaults_hears_a_spoken_turns_reply_to_its_end(gateway):
    url = f"ws://127.0.0.1:{gateway.port}/v1/realtime"
    events, history = asyncio.run(asyncio.wait_for(converse(url), 120))
    audio = [e for e in events if e.type == "audio"]
    assert audio and sum(len(e.audio.data) for e in audio) > 0
    end = events[-1]
    assert end.type == "audio_end" and end.item_id == audio[-1].item_id
    [user] = [item for item in history if getattr(item, "role", None) == "user"]
    assert user_transcripts(history) == [user.content[0].transcript]  # the thinker's text-only pass over the turn
    assert any(getattr(item, "role", None) == "assistant" for item in history)
