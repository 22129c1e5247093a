"""GET /v1/realtime: the OpenAI Realtime API over the gateway's WebSocket, driven by the pinned openai
SDK's own realtime client (sync and async), unchanged, with real speech (bench/speech/)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import wave
from pathlib import Path

import grpc
import numpy as np
import pytest
import websockets.sync.client
from gateway_procs import start_gateway
from websockets.exceptions import InvalidStatus

from gateway import g711
from services.base.resample import resample
from tests.sessions.procs import sessions as start_sessions

SPEECH = sorted((Path(__file__).parents[2] / "bench" / "speech").glob("*.wav"))


def speech_24k(i: int, rate: int = 24000) -> bytes:
    """A recording as the Realtime API's audio/pcm: 16-bit at 24 kHz (or `rate`)."""
    with wave.open(str(SPEECH[i])) as w:
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
    return np.clip(np.rint(resample(samples, 16000, rate) * 32767), -32768, 32767).astype("<i2").tobytes()


def appends(pcm: bytes, chunk_ms: int = 100) -> list[str]:
    step = 24000 * chunk_ms // 1000 * 2
    return [base64.b64encode(pcm[i:i + step]).decode() for i in range(0, len(pcm), step)]


def until_done(conn) -> list:
    """The connection's events up to and including the next response.done."""
    events = []
    for event in conn:
        events.append(event)
        if event.type == "response.done":
            return events
    raise AssertionError(f"the connection closed before response.done: {[e.type for e in events]}")


SETTINGS = {"type": "realtime", "instructions": "Answer briefly.", "max_output_tokens": 6,
            "audio": {"output": {"voice": "alloy"}}}


def test_the_sdks_sync_client_speaks_a_turn_and_hears_a_reply_with_its_whole_lifecycle(client):
    with client.realtime.connect(model="tiny-qwen3-omni") as conn:
        created = conn.recv()
        assert created.type == "session.created" and created.session.audio.input.format.rate == 24000
        conn.session.update(session=SETTINGS)
        assert conn.recv().type == "session.updated"
        for chunk in appends(bytes(24000) + speech_24k(0) + bytes(2 * 24000)):
            conn.input_audio_buffer.append(audio=chunk)
        events = until_done(conn)
    seen = [e.type for e in events]
    order = [seen.index(t) for t in (
        "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
        "response.created", "response.output_item.added", "response.content_part.added",
        "response.output_audio_transcript.delta", "response.output_audio.done",
        "response.output_audio_transcript.done", "response.content_part.done", "response.output_item.done",
        "response.done")]
    assert order == sorted(order), seen
    done = events[-1].response
    [message] = done.output
    part_events = [e for e in events if e.type.startswith(("response.output_audio", "response.content_part"))]
    assert {(e.response_id, e.item_id, e.output_index, e.content_index) for e in part_events} == {
        (done.id, message.id, 0, 0)}
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    [transcript_done] = [e for e in events if e.type == "response.output_audio_transcript.done"]
    assert transcript_done.transcript == transcript == message.content[0].transcript
    # max_output_tokens 6: the thinker stops at its limit, and the response says so
    assert (done.status, done.status_details.reason, done.max_output_tokens) == ("incomplete", "max_output_tokens", 6)
    assert len(audio) > 0 and len(audio) % 2 == 0
    assert done.usage.output_token_details.audio_tokens > 0


def test_unsupported_and_malformed_events_get_error_events_naming_them_and_the_session_goes_on(client):
    with client.realtime.connect(model="tiny-qwen3-omni") as conn:
        conn.recv()  # session.created
        refused = [
            ({"type": "output_audio_buffer.clear"}, "unsupported", "type"),
            ({"type": "no.such.event"}, "unknown_event", "type"),
            ({"type": "session.update", "session": {"type": "realtime", "tools": [{"type": "function", "name": ""}]}},
             "invalid_value", "session.tools[0].name"),
            ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
                "format": {"type": "audio/g729"}}}}}, "unsupported", "session.audio.input.format.type"),
            # the beta protocol's flat field: dropped, it would leave turn detection on
            ({"type": "session.update", "session": {"type": "realtime", "turn_detection": None}},
             "unknown_parameter", "session.turn_detection"),
            ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "invalid_value", "audio"),
            ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x00\x01\x02").decode()},
             "invalid_value", "audio"),
            # the sessions service's answers, after the gateway's own, in order
            ({"type": "conversation.item.delete", "item_id": "x"}, "item_delete_invalid_item_id", "item_id"),
            ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty", "commit"),
            ({"type": "response.cancel"}, "response_cancel_not_active", "cancel_response"),
        ]
        for event, _, _ in refused:
            conn.send(event)
        errors = [conn.recv() for _ in refused]
        assert [(e.type, e.error.code, e.error.param) for e in errors] == [("error", c, p) for _, c, p in refused]
        conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {
            "type": "semantic_vad", "eagerness": "low"}}}})
        detection = conn.recv().session.audio.input.turn_detection  # served as the detector's settings
        assert (detection.type, detection.silence_duration_ms) == ("server_vad", 1000)
        conn.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}})
        conn.send({"type": "response.create", "response": {"metadata": {"turn": "hello"}}})
        events = until_done(conn)
        assert [e.type for e in events[:3]] == ["conversation.item.added", "conversation.item.done", "response.created"]
        assert events[2].response.metadata == events[-1].response.metadata == {"turn": "hello"}
        assert events[-1].response.status in ("completed", "incomplete")
        conn.send({"type": "conversation.item.retrieve", "item_id": events[-1].response.output[0].id})
        retrieved = conn.recv()
        assert retrieved.type == "conversation.item.retrieved" and retrieved.item == events[-1].response.output[0]
        conn.send({"type": "conversation.item.retrieve", "item_id": "item_none"})
        assert conn.recv().error.code == "item_retrieve_invalid_item_id"


def test_a_telephony_client_speaks_g711_mu_law_and_hears_a_law(client):
    speech = g711.encode(np.frombuffer(speech_24k(0, g711.RATE), "<i2"), "pcmu")  # a byte a sample at 8 kHz
    silence = g711.encode(np.zeros(g711.RATE, "<i2"), "pcmu")
    with client.realtime.connect(model="tiny-qwen3-omni") as conn:
        conn.recv()  # session.created
        conn.session.update(session={**SETTINGS, "audio": {"input": {"format": {"type": "audio/pcmu"}},
                                                           "output": {"format": {"type": "audio/pcma"}}}})
        formats = conn.recv().session.audio
        assert (formats.input.format.type, formats.output.format.type) == ("audio/pcmu", "audio/pcma")
        stream = silence + speech + 2 * silence
        for i in range(0, len(stream), 800):  # 100 ms appends
            conn.input_audio_buffer.append(audio=base64.b64encode(stream[i:i + 800]).decode())
        events = until_done(conn)
    speech_ms = len(speech) * 1000 // g711.RATE
    [started] = [e for e in events if e.type == "input_audio_buffer.speech_started"]
    [stopped] = [e for e in events if e.type == "input_audio_buffer.speech_stopped"]
    # heard where the speech is in the 8 kHz stream: read as mu-law, not as pcm16 bytes
    assert 1000 <= started.audio_start_ms < stopped.audio_end_ms <= 1000 + speech_ms + 1000
    reply = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    samples = np.frombuffer(g711.decode(reply, "pcma"), "<i2").astype(np.float64)
    assert len(reply) > 0 and np.sqrt(np.mean(samples ** 2)) > 0  # a byte a sample, A-law, not silence


def spoken_reply(client, output: dict) -> tuple[list, bytes]:
    """One spoken turn at 16 kHz (the recording's own rate, no resampling), heard by turn detection; the
    events up to response.done and the reply's audio, in `output`'s format."""
    with wave.open(str(SPEECH[0])) as w:
        speech = w.readframes(w.getnframes())
    with client.realtime.connect(model="tiny-qwen3-omni") as conn:
        conn.recv()  # session.created
        conn.session.update(session={**SETTINGS, "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}},
                                                           "output": {**SETTINGS["audio"]["output"], "format": output}}})
        formats = conn.recv().session.audio
        assert (formats.input.format.rate, formats.output.format.rate) == (16000, output["rate"])
        stream = bytes(32000) + speech + bytes(64000)
        for i in range(0, len(stream), 3200):  # 100 ms appends
            conn.input_audio_buffer.append(audio=base64.b64encode(stream[i:i + 3200]).decode())
        events = until_done(conn)
    speech_ms = len(speech) * 1000 // 32000
    [started] = [e for e in events if e.type == "input_audio_buffer.speech_started"]
    [stopped] = [e for e in events if e.type == "input_audio_buffer.speech_stopped"]
    # heard where the speech is in the 16 kHz stream: read at its declared rate
    assert 1000 <= started.audio_start_ms < stopped.audio_end_ms <= 1000 + speech_ms + 1000
    return events, b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")


def test_pcm16_at_16_khz_in_is_read_at_its_rate_and_the_reply_comes_at_the_rate_asked(client):
    """The same greedy turn twice, 16 kHz in both times: the reply at 48 kHz is the 24 kHz reply's
    words and twice its samples."""
    events24, audio24 = spoken_reply(client, {"type": "audio/pcm", "rate": 24000})
    events48, audio48 = spoken_reply(client, {"type": "audio/pcm", "rate": 48000})
    assert events24[-1].response.output[0].content[0].transcript == events48[-1].response.output[0].content[0].transcript
    assert len(audio24) > 0 and abs(len(audio48) // 2 - 2 * (len(audio24) // 2)) <= 1


def test_an_input_image_reaches_the_turns_generate_and_a_bad_one_is_refused_by_name(client, omni, png_bytes):
    """Greedy: a user item of an image and a question answers as the router's Generate of that message."""
    from test_gateway_chat import grpc_result, reply

    image = "data:image/png;base64," + base64.b64encode(png_bytes).decode()
    with client.realtime.connect(model="tiny-qwen3-omni") as conn:
        conn.recv()  # session.created
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 6,
                                     "audio": {"input": {"turn_detection": None}}})
        conn.recv()  # session.updated
        refused = [({"type": "input_image", "image_url": image, "detail": "low"}, "item.content[0].detail"),
                   ({"type": "input_image", "image_url": "https://example.com/a.png"}, "item.content[0].image_url"),
                   ({"type": "input_image", "image_url": "data:image/png;base64," + base64.b64encode(b"hello").decode()},
                    "item.content[0].image")]  # the sessions service's: not a png
        for part, _ in refused:
            conn.conversation.item.create(item={"type": "message", "role": "user", "content": [part]})
        assert [conn.recv().error.param for _ in refused] == [param for _, param in refused]
        conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": image}, {"type": "input_text", "text": "What is this?"}]})
        conn.response.create()
        events = until_done(conn)
        event = events[-1]
    added = next(e for e in events if e.type == "conversation.item.added")  # the item as created, its image not echoed
    assert [(p.type, p.text, p.image_url) for p in added.item.content] == [
        ("input_image", None, None), ("input_text", "What is this?", None)]
    want = grpc_result(omni, "What is this?", 6, speak=False, image=png_bytes)
    assert event.response.output[0].content[0].text == reply(want)
    # the image's tokens in the prompt: a text-only prompt is far shorter
    text_only = grpc_result(omni, "What is this?", 1, speak=False).final.usage.prompt_tokens
    assert event.response.usage.input_tokens == want.final.usage.prompt_tokens > text_only + 4


def test_a_beta_client_speaks_the_beta_protocol_with_its_flat_session_fields(gateway):
    """The SDK's beta realtime client (it sends OpenAI-Beta: realtime=v1), unchanged: turn_detection null
    turns detection off, and the reply comes with the beta event names."""
    import openai

    # The beta client takes wss:// of the base URL unless told its WebSocket URL (the GA one derives ws://).
    client = openai.OpenAI(base_url=gateway.base_url, websocket_base_url=gateway.base_url.replace("http", "ws", 1),
                           api_key="unused", max_retries=0, timeout=120)
    with client, client.beta.realtime.connect(model="tiny-qwen3-omni") as conn:
        created = conn.recv()
        assert created.type == "session.created" and created.session.input_audio_format == "pcm16"
        assert conn.recv().type == "conversation.created"
        conn.session.update(session={"modalities": ["text", "audio"], "instructions": "Answer briefly.", "voice": "alloy",
                                     "turn_detection": None, "max_response_output_tokens": 6})
        updated = conn.recv()
        assert updated.type == "session.updated" and updated.session.turn_detection is None
        assert updated.session.max_response_output_tokens == 6
        conn.session.update(session={"turn_detection": {"type": "server_vad", "threshold": -1}})
        assert conn.recv().error.param == "session.turn_detection.threshold"
        conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_audio", "audio": base64.b64encode(speech_24k(1)).decode()}]})
        conn.response.create()
        events = until_done(conn)
    seen = {e.type for e in events}
    assert {"conversation.item.created", "response.audio.delta", "response.audio.done",
            "response.audio_transcript.done", "response.content_part.done", "response.output_item.done"} <= seen
    assert not {t for t in seen if t.startswith(("response.output_audio", "conversation.item.added",
                                                  "conversation.item.done"))}
    done = events[-1].response
    [transcript] = [e.transcript for e in events if e.type == "response.audio_transcript.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.audio_transcript.delta")
    assert transcript == deltas == done.output[0].content[0].transcript and done.modalities == ["text", "audio"]


def test_the_sdks_async_client_cancels_a_response_with_response_cancel(async_client):
    async def run():
        async with async_client().realtime.connect(model="tiny-qwen3-omni") as conn:
            await conn.recv()
            await conn.session.update(session={**SETTINGS, "audio": {"input": {"turn_detection": None}}})
            assert (await conn.recv()).session.audio.input.turn_detection is None
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": base64.b64encode(speech_24k(1)).decode()}]})
            await conn.response.create()
            async for event in conn:
                if event.type == "response.created":
                    await conn.response.cancel()
                elif event.type == "response.done":
                    return event.response
    response = asyncio.run(run())
    assert response.status in ("cancelled", "completed", "incomplete")  # a tiny reply may finish before the cancel lands
    if response.status == "cancelled":
        assert response.status_details.reason == "client_cancelled"


def test_the_sdks_async_client_gets_the_users_transcript_and_an_out_of_band_answer_with_its_own_settings(async_client):
    """A spoken turn with input transcription: its transcript names the committed item and becomes
    the item's; then an out-of-band response to that item (an item_reference) with its own
    instructions, modalities, token limit and metadata: answered, and the conversation untouched."""
    async def run():
        async with async_client().realtime.connect(model="tiny-qwen3-omni") as conn:
            await conn.recv()
            await conn.session.update(session={**SETTINGS, "audio": {"input": {"transcription": {
                "model": "gpt-4o-transcribe", "language": "en"}}}})
            updated = await conn.recv()
            assert updated.session.audio.input.transcription.model == "tiny-qwen3-omni"
            for chunk in appends(bytes(24000) + speech_24k(0) + bytes(2 * 24000)):
                await conn.input_audio_buffer.append(audio=chunk)
            events, done, transcribed = [], None, None
            async for event in conn:
                events.append(event)
                done = event if event.type == "response.done" else done
                if event.type == "conversation.item.input_audio_transcription.completed":
                    transcribed = event
                if done and transcribed:
                    break
            [committed] = [e for e in events if e.type == "input_audio_buffer.committed"]
            await conn.conversation.item.retrieve(item_id=committed.item_id)
            retrieved = await conn.recv()
            await conn.response.create(response={
                "conversation": "none", "instructions": "Summarize in one word.", "output_modalities": ["text"],
                "max_output_tokens": 3, "metadata": {"purpose": "summary"},
                "input": [{"type": "item_reference", "id": committed.item_id}]})
            oob = []
            async for event in conn:
                oob.append(event)
                if event.type == "response.done":
                    break
            await conn.conversation.item.retrieve(item_id=oob[-1].response.output[0].id)
            return events, committed, transcribed, retrieved, oob, await conn.recv()

    events, committed, transcribed, retrieved, oob, gone = asyncio.run(run())
    deltas = [e for e in events if e.type == "conversation.item.input_audio_transcription.delta"]
    assert {(e.item_id, e.content_index) for e in deltas + [transcribed]} == {(committed.item_id, 0)}
    assert "".join(e.delta for e in deltas) == transcribed.transcript
    assert retrieved.item.content[0].transcript == transcribed.transcript
    # out of band: its own settings, its output, no conversation item
    assert not [e for e in oob if e.type.startswith("conversation.")]
    response = oob[-1].response
    assert (response.conversation_id, response.metadata, response.output_modalities, response.max_output_tokens) == (
        None, {"purpose": "summary"}, ["text"], 3)
    assert response.status in ("completed", "incomplete") and response.output[0].content[0].type == "output_text"
    assert gone.type == "error" and gone.error.code == "item_retrieve_invalid_item_id"


def test_a_refused_bearer_token_is_a_401_in_the_handshake(gateway, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("secret\n")
    guarded = start_gateway("127.0.0.1:1", tmp_path, "--auth-token-file", str(tokens))
    try:
        with pytest.raises(InvalidStatus) as refused:
            websockets.sync.client.connect(f"ws://127.0.0.1:{guarded.port}/v1/realtime?model=x",
                                           additional_headers={"Authorization": "Bearer wrong"})
        assert refused.value.response.status_code == 401
    finally:
        guarded.stop()


@pytest.fixture(scope="module")
def one_place_gateway(gw_stack, tmp_path_factory):
    """A gateway in front of a second sessions service that takes one session (--max-sessions 1)."""
    sessions = start_sessions(gw_stack.target, "--max-sessions", "1")
    gateway = start_gateway(gw_stack.target, tmp_path_factory.mktemp("gw1"), "--sessions", sessions.target)
    yield gateway
    gateway.stop()
    sessions.stop()


def test_a_session_over_the_sessions_services_capacity_is_a_429_with_retry_after_in_the_handshake(one_place_gateway):
    url = f"ws://127.0.0.1:{one_place_gateway.port}/v1/realtime?model=x"
    deadline = time.monotonic() + 30
    while True:  # the gateway connects to the second sessions service
        try:
            holder = websockets.sync.client.connect(url)
            break
        except (InvalidStatus, OSError):
            assert time.monotonic() < deadline, "the one-place gateway never took a session"
            time.sleep(0.2)
    try:
        assert json.loads(holder.recv(timeout=10))["type"] == "session.created"
        with pytest.raises(InvalidStatus) as refused:
            websockets.sync.client.connect(url)
        response = refused.value.response
        assert response.status_code == 429 and int(response.headers["Retry-After"]) >= 1
        assert json.loads(response.body)["error"]["type"] == "rate_limit_error"
    finally:
        holder.close()


def test_sessions_spread_over_the_sessions_replicas_least_loaded_first(gw_stack, tmp_path):
    """Two sessions replicas behind one gateway: four sessions opened one after another go two to each
    (the gateway counts its own sessions on each replica between polls, as the router counts requests)."""
    from omni.v1 import common_pb2, omni_pb2_grpc

    replicas = [start_sessions(gw_stack.target) for _ in range(2)]
    gateway = start_gateway(gw_stack.target, tmp_path, "--sessions", ",".join(r.target for r in replicas))
    sockets = []
    try:
        for _ in range(4):
            ws = websockets.sync.client.connect(f"ws://127.0.0.1:{gateway.port}/v1/realtime?model=x")
            sockets.append(ws)
            assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        held = []
        for replica in replicas:
            with grpc.insecure_channel(replica.target) as channel:
                held.append(omni_pb2_grpc.SessionsStub(channel).GetLoad(common_pb2.LoadRequest(), timeout=5).running)
        assert held == [2, 2]
    finally:
        for ws in sockets:
            ws.close()
        gateway.stop()
        for replica in replicas:
            replica.stop()


def test_a_draining_sessions_replica_takes_no_new_session(gw_stack, tmp_path):
    """SIGTERM to one of two sessions replicas: once the gateway's poll sees it NOT_SERVING, every new
    session goes to the other, however many the other already holds."""
    import signal

    from omni.v1 import common_pb2, omni_pb2_grpc
    from tests.sessions.procs import health

    def held(replica) -> int:
        with grpc.insecure_channel(replica.target) as channel:
            return omni_pb2_grpc.SessionsStub(channel).GetLoad(common_pb2.LoadRequest(), timeout=5).running

    serving = start_sessions(gw_stack.target)
    draining = start_sessions(gw_stack.target, "--drain-delay-s", "60", "--grace-s", "60")
    gateway = start_gateway(gw_stack.target, tmp_path, "--sessions", f"{serving.target},{draining.target}")
    sockets = []
    try:
        draining.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while health(draining.target) != "NOT_SERVING":
            assert time.monotonic() < deadline, "the replica never reported NOT_SERVING"
            time.sleep(0.1)
        # Sessions opened one after another, each kept open: until the gateway's next poll some may still
        # go to the draining replica; after it, four in a row go to the other although it holds the most.
        in_a_row = 0
        while in_a_row < 4:
            assert time.monotonic() < deadline, "new sessions kept going to the draining replica"
            before = held(serving)
            ws = websockets.sync.client.connect(f"ws://127.0.0.1:{gateway.port}/v1/realtime?model=x")
            sockets.append(ws)
            assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
            in_a_row = in_a_row + 1 if held(serving) == before + 1 else 0
        assert held(serving) > held(draining)
    finally:
        for ws in sockets:
            ws.close()
        gateway.stop()
        serving.stop()
        draining.kill()


@pytest.fixture(scope="module")
def long_reply_stack(tiny_checkpoint):
    """A stack whose talker speaks up to 1,500 frames a reply (two minutes of audio: seconds of work)."""
    from services.tools.launcher import Stack, StackOptions
    from tests.threads import torch_threads

    options = StackOptions(checkpoint=str(tiny_checkpoint), port=0, threads=torch_threads(1), log_prefix=False,
                           thinker_args=("--default-max-new-tokens", "8"),
                           talker_args=("--default-max-new-tokens", "1500"), http_port=0)
    with Stack(options) as stack:
        yield stack


@pytest.mark.slow
def test_a_client_that_closes_its_socket_mid_reply_frees_the_response_in_every_stage(long_reply_stack):
    """The socket closed at the reply's first audio: the gateway cancels the session's call, and the
    sessions service the response everywhere (it ran on to its end when the router took the cancel for a
    half-close)."""
    from omni.v1 import common_pb2
    from services.serving.stage_stubs import stage_stub

    def held() -> int:
        total = 0
        for stage in ("thinker", "talker", "code2wav"):
            with grpc.insecure_channel(long_reply_stack.addresses(stage)[0]) as channel:
                load = stage_stub(stage, channel).GetLoad(common_pb2.LoadRequest(), timeout=5)
            total += load.queue_depth + load.running + load.in_flight
        return total

    url = long_reply_stack.http_url.replace("http://", "ws://") + "/v1/realtime?model=x"
    for _ in range(4):  # the router missed the gateway's cancel 1 time in 3 before it took any end as the end
        with websockets.sync.client.connect(url, max_size=None) as ws:
            ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "audio": {"input": {"turn_detection": None}}}}))
            ws.send(json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                "content": [{"type": "input_text", "text": "Tell me a long story."}]}}))
            ws.send(json.dumps({"type": "response.create"}))
            while json.loads(ws.recv(timeout=30))["type"] != "response.output_audio.delta":
                pass
        closed = time.monotonic()
        while held():
            assert time.monotonic() - closed < 5, "the reply ran on after its socket closed"
            time.sleep(0.1)
