"""bench/long_session.py's client: a turn every period, each turn's end of speech -> first audio kept
per turn (None for a turn not answered within its period), against a scripted server on a fake
transport (the real run is `omni-bench --realtime 1 --session-minutes M`)."""

from __future__ import annotations

import asyncio

from bench import long_session
from bench.long_session import TurnSpeaker


def test_each_turn_gets_its_own_first_audio_and_an_unanswered_turn_is_none(monkeypatch):
    monkeypatch.setattr(long_session, "PERIOD_S", 0.3)
    utterance = bytes(2 * long_session.RATE // 10)  # 0.1 s
    speaker = TurnSpeaker([utterance], turns=3)
    answer = {0: 0.05, 2: 0.1}  # turn -> seconds after its speech ended; turn 1 is never answered
    sent = {"turn": -1, "answered": set()}

    async def send(kind: str, data: bytes) -> None:  # the server: a reply's first audio after `answer[turn]`
        if speaker.speech_ended is None:
            return
        turn = len(speaker.turn_first_audio)
        if turn in answer and turn not in sent["answered"]:
            sent["answered"].add(turn)

            async def reply(turn=turn) -> None:
                await asyncio.sleep(answer[turn])
                speaker.on_created(f"r{turn}")
                speaker.on_audio(f"r{turn}", 0.02)
            asyncio.get_running_loop().create_task(reply())

    asyncio.run(speaker.speak(send))
    first, missing, last = speaker.turn_first_audio
    assert missing is None and 0.05 <= first < 0.25 and 0.1 <= last < 0.25
    assert speaker.figures.errors == []
