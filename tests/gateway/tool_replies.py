"""The thinker's scripted replies for the function-calling tests (services/thinker/admission.py's
NOTE: the tiny checkpoint never calls a tool by itself): a request whose last message holds a key
gets its reply, fed through the thinker as if generated. The gateway tests' stack sets them."""

from __future__ import annotations

import json

CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SPOKEN_FIRST = "Sure.\n"  # said before the call of the Rome reply
CALL_ROME = SPOKEN_FIRST + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>'
TWO_CALLS = CALL_PARIS + "\n" + CALL_PARIS.replace("Paris", "Oslo")
ANSWER = "It is 21 C and sunny."
REPLIES = {
    "weather in Paris": CALL_PARIS,
    "weather in Rome": CALL_ROME,
    "Paris and Oslo weather": TWO_CALLS,
    '"temp": 21': ANSWER,  # a tool's result
}
ENV = {"OMNI_THINKER_TEST_REPLIES": json.dumps(REPLIES)}
