"""The router's admission bounds and replica choice, without processes."""

from __future__ import annotations

import asyncio
import socket

import pytest

from omni.v1 import common_pb2
from router.admission import Admission, AdmissionConfig, Rejected
from services.base.errors import UserError
from services.serving.replicas import Replica, ReplicaSet, ReplicaSource


def test_admission_admits_up_to_the_bound_queues_then_rejects_at_once():
    async def scenario():
        admission = Admission(AdmissionConfig(max_in_flight=2, max_queue=1, queue_timeout_s=5))
        await admission.acquire()
        await admission.acquire()
        waiter = asyncio.create_task(admission.acquire())  # queued
        await asyncio.sleep(0)
        assert admission.queued == 1
        with pytest.raises(Rejected, match="queue of 1 full"):
            await admission.acquire()  # the queue is full: refused at once
        admission.release()  # the place goes straight to the waiter
        await asyncio.wait_for(waiter, 1)
        assert admission.in_flight == 2 and admission.queued == 0
        admission.release()
        admission.release()
        assert admission.in_flight == 0

    asyncio.run(scenario())


def test_admission_wait_expires_and_a_cancelled_waiter_gives_its_place_back():
    async def scenario():
        admission = Admission(AdmissionConfig(max_in_flight=1, max_queue=4, queue_timeout_s=0.05))
        await admission.acquire()
        with pytest.raises(Rejected, match="no place within"):
            await admission.acquire()
        admission.config = AdmissionConfig(max_in_flight=1, max_queue=4, queue_timeout_s=5)
        waiter = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        admission.release()
        assert admission.in_flight == 0 and admission.queued == 0

    asyncio.run(scenario())


def test_replica_sources_parse_static_lists_and_dns_names():
    assert ReplicaSource.parse("a:1, b:2", "--talker").static == ("a:1", "b:2")
    dns = ReplicaSource.parse("dns:///omni-talker:50062", "--talker")
    assert (dns.dns_host, dns.dns_port) == ("omni-talker", 50062)
    for bad in ("", "dns:///nohost", "host-without-port"):
        with pytest.raises(UserError, match="--talker"):
            ReplicaSource.parse(bad, "--talker")


def test_a_dns_source_resolves_every_address_of_the_name():
    addresses = ReplicaSource.parse("dns:///localhost:50062", "--talker").resolve()
    expected = {info[4][0] for info in socket.getaddrinfo("localhost", 50062, type=socket.SOCK_STREAM)}
    assert addresses and len(addresses) == len(expected)
    assert all(a.endswith(":50062") for a in addresses)


def test_pick_takes_the_least_loaded_healthy_replica_that_is_not_draining():
    replicas = ReplicaSet("talker", ReplicaSource(static=("a:1", "b:1", "c:1", "d:1")))
    load = lambda queue, running: common_pb2.LoadReport(queue_depth=queue, running=running)  # noqa: E731
    replicas.replicas = {
        "a:1": Replica("a:1", healthy=True, load=load(3, 4)),
        "b:1": Replica("b:1", healthy=True, load=load(0, 2), in_flight=1),
        "c:1": Replica("c:1", healthy=False, load=load(0, 0)),
        "d:1": Replica("d:1", healthy=True, draining=True, load=load(0, 0)),
    }
    assert replicas.pick().address == "b:1"
    replicas.replicas["b:1"].in_flight = 9  # what this router sent since the last poll counts too
    assert replicas.pick().address == "a:1"
    replicas.mark_failed("a:1")
    replicas.mark_failed("b:1")
    assert replicas.pick() is None


def test_a_missed_poll_is_suspect_and_a_refused_one_down():
    import grpc

    from services.serving.replicas import DOWN, SUSPECT, UP, poll_verdict

    assert poll_verdict(None, serving=True) == UP
    assert poll_verdict(None, serving=False) == DOWN  # NOT_SERVING
    assert poll_verdict(grpc.StatusCode.DEADLINE_EXCEEDED, serving=False) == SUSPECT
    assert poll_verdict(grpc.StatusCode.UNAVAILABLE, serving=False) == DOWN  # refused or reset
