"""A session never dead-ends on its own length (project issue 56, item 3): when a turn's prompt no
longer fits a stage's per-request cache, the oldest turns are dropped, whole, and the turn is sent
again; it equals the one-shot request of the turns kept. A thinker whose cache holds 256 positions
makes a session of short text turns run out of room within a dozen turns."""

from __future__ import annotations

import grpc
import pytest

from omni.v1 import omni_pb2
from services.tools.client import connect
from tests.sessions.session_support import MANUAL, SessionCall, sampling
from tests.stacks import stack_of

# slow: a stack of its own (a small thinker cache)
pytestmark = [pytest.mark.slow, pytest.mark.exactness]

TOKENS = 6
TEXT_ONLY = [omni_pb2.MODALITY_TEXT]


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    with stack_of(tiny_checkpoint, thinker_args=("--max-model-len", "256")) as stack:
        yield stack


def one_shot_text(target: str, messages) -> list[int]:
    channel, omni = connect(target)
    request = omni_pb2.GenerateRequest(messages=messages, output_modalities=TEXT_ONLY,
                                       thinker_sampling=sampling(TOKENS))
    ids = [i for r in omni.Generate(request, timeout=60) if r.WhichOneof("event") == "text" for i in r.text.token_ids]
    channel.close()
    return ids


def ask(call: SessionCall, text: str) -> tuple[list[int], omni_pb2.ResponseDone, list[str]]:
    """A user text item and a response: its ids, its done event and the items it dropped."""
    call.send(create_item=omni_pb2.CreateItem(message=omni_pb2.Message(
        role=omni_pb2.ROLE_USER, content=[omni_pb2.Content(text=text)])))
    call.next_event("item_added")
    call.send(create_response=omni_pb2.CreateResponse())
    created = call.next_event("response_created")
    ids, _, done = call.response(created.response_id)
    dropped = [i for e in call.events if e.response_id == created.response_id
               and e.WhichOneof("event") == "conversation_truncated" for i in e.conversation_truncated.item_ids]
    return ids, done, dropped


def question(i: int) -> str:
    return f"Question {i}: tell me one more thing about the sea, the sky and the stars, please."


def test_a_long_session_drops_its_oldest_turns_and_every_turn_equals_the_one_shot_of_the_turns_kept(stack):
    call = SessionCall(stack.sessions_target)
    call.next_event("created")
    call.send(update=omni_pb2.SessionSettings(turn_detection=MANUAL, output_modalities=TEXT_ONLY,
                                              thinker_sampling=sampling(TOKENS)))
    assert call.next_event("updated").updated.settings.truncation.enabled  # on by default
    history, truncated_at = [], []  # (user text, reply) of every turn; turns that truncated
    kept_from = 0  # the first turn still sent
    for i in range(14):
        ids, done, dropped = ask(call, question(i))
        assert done.status == omni_pb2.RESPONSE_STATUS_COMPLETED, f"turn {i}: {done.error}"
        if dropped:
            truncated_at.append(i)
            kept_from += len(dropped) // 2  # a user item and its reply a turn
        history.append((question(i), done.transcript))
        messages = [omni_pb2.Message(role=role, content=[omni_pb2.Content(text=text)])
                    for user, reply in history[kept_from:i] for role, text in
                    ((omni_pb2.ROLE_USER, user), (omni_pb2.ROLE_ASSISTANT, reply))]
        messages.append(omni_pb2.Message(role=omni_pb2.ROLE_USER, content=[omni_pb2.Content(text=question(i))]))
        assert ids == one_shot_text(stack.target, messages), f"turn {i} (turns {kept_from}.. kept)"
    assert truncated_at, "no turn ran out of room"

    # Truncation off: a turn that does not fit fails alone, INVALID_ARGUMENT naming the field.
    call.send(update=omni_pb2.SessionSettings(truncation=omni_pb2.Truncation(enabled=False)))
    call.next_event("updated")
    for i in range(14, 40):
        ids, done, _ = ask(call, question(i))
        if done.status == omni_pb2.RESPONSE_STATUS_FAILED:
            assert done.error.code == grpc.StatusCode.INVALID_ARGUMENT.name.lower()
            assert done.error.field.endswith("sampling.max_new_tokens")
            break
    else:
        pytest.fail("truncation off: every turn still fitted")
    call.close()
