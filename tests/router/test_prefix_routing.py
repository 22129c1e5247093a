"""Prefix routing in the router, without processes (the router never imports torch): the longest
message prefix a thinker replica holds is the one it is credited for (services/serving/prefix_routing.py), and the
router's `route()` ranks thinkers with the request's own prefix keys (router/server.py).

Pinned bugs (project issue 48, item 0): `PrefixView.matched` returning the shortest held prefix
instead of the longest; `OmniServicer.route` ranking the thinkers without the request's prefix keys
(the unit tests called `ReplicaSet.pick` with keys directly; only a slow end-to-end test saw the
wiring).
"""

from __future__ import annotations

from omni.v1 import common_pb2, omni_pb2
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.server import OmniServicer
from services.base.stages import Stage
from services.serving.prefix_keys import message_keys
from services.serving.prefix_routing import PrefixView, Routing
from services.serving.replicas import Replica, ReplicaSet, ReplicaSource


def conversation(turns: int) -> omni_pb2.GenerateRequest:
    request = omni_pb2.GenerateRequest()
    request.messages.add(role=omni_pb2.ROLE_SYSTEM).content.add(text="Be brief.")
    for t in range(turns):
        request.messages.add(role=omni_pb2.ROLE_USER).content.add(text=f"question {t}")
        request.messages.add(role=omni_pb2.ROLE_ASSISTANT).content.add(text=f"answer {t}")
    request.messages.add(role=omni_pb2.ROLE_USER).content.add(text="and now?")
    return request


def view(held: dict[bytes, int]) -> PrefixView:
    v = PrefixView()
    v.apply(common_pb2.PrefixReport(epoch=1, seq=1, full=True,
                                    held=[common_pb2.PrefixHeld(key=k, tokens=t) for k, t in held.items()]))
    return v


def test_a_replica_is_credited_for_the_longest_prefix_of_the_request_it_holds():
    keys = message_keys(conversation(3))  # system, 3 x (user, assistant), user: 8 keys
    # A replica that held the whole history of the turn before holds every shorter prefix too.
    held = view({keys[0]: 16, keys[2]: 64, keys[6]: 1504})
    assert held.matched(keys) == 1504
    assert held.matched(keys[:5]) == 64  # the request is shorter: its longest held prefix
    assert held.matched(keys[:1]) == 16
    assert view({}).matched(keys) == 0


def thinkers(loads: dict[str, int], held: dict[str, dict[bytes, int]]) -> ReplicaSet:
    replicas = ReplicaSet(Stage.THINKER, ReplicaSource(static=tuple(loads)), routing=Routing.PREFIX)
    for address, load in loads.items():
        replica = Replica(address, healthy=True, in_flight=load, load=common_pb2.LoadReport(running=load))
        replica.prefix = view(held.get(address, {}))
        replicas.replicas[address] = replica
    return replicas


def single(stage: str, address: str) -> ReplicaSet:
    replicas = ReplicaSet(stage, ReplicaSource(static=(address,)))
    replicas.replicas[address] = Replica(address, healthy=True, load=common_pb2.LoadReport())
    return replicas


def servicer(thinker_set: ReplicaSet) -> OmniServicer:
    config = RouterConfig(thinker=ReplicaSource(static=tuple(thinker_set.replicas)),
                          talker=ReplicaSource(static=("talker:1",)), code2wav=ReplicaSource(static=("code2wav:1",)))
    stages = {Stage.THINKER: thinker_set, Stage.TALKER: single(Stage.TALKER, "talker:1"),
              Stage.CODE2WAV: single(Stage.CODE2WAV, "code2wav:1")}
    return OmniServicer(config, stages, RouterMetrics())


def routed(router: OmniServicer, outcome: str) -> float:
    return router.metrics.registry.get_sample_value("omni_router_prefix_routed_total", {"outcome": outcome}) or 0


def test_route_sends_a_conversation_to_the_thinker_that_holds_its_history():
    request = conversation(3)
    keys = message_keys(request)
    # "busy:1" holds the history up to the last reply (1,500 tokens: 6 requests of load at the
    # default weight) and its first message; "idle:1" holds the first message alone.
    held = {"busy:1": {keys[0]: 16, keys[6]: 1500}, "idle:1": {keys[0]: 16}}
    router = servicer(thinkers({"busy:1": 4, "idle:1": 0}, held))
    route, wire = router.route(request)
    assert route[Stage.THINKER].address == "busy:1", "the request's prefix keys reached the thinkers' ranking"
    assert (wire.talker, wire.code2wav) == ("talker:1", "code2wav:1")
    assert routed(router, "held") == 1
    # Another conversation, held nowhere: least loaded.
    other = conversation(3)
    other.messages[0].content[0].text = "Be verbose."
    assert router.route(other)[0][Stage.THINKER].address == "idle:1"
    assert routed(router, "none") == 1
