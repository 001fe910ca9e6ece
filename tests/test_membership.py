"""The router's membership sources (static URLs, DNS names, registrations) and how the pool takes
their changes: a member gets work only once it says it is ready, and one that leaves the
membership keeps the work this router already gave it until that ends."""

from __future__ import annotations

import asyncio

import dns.exception
import dns.resolver
import pytest

from pdserve.addresses import DnsMember, parse_member
from pdserve.disagg.client import WorkerClient, WorkerUnreachable
from pdserve.disagg.config import RouterConfig
from pdserve.disagg.control import WorkerInfo
from pdserve.disagg.router.membership import DnsSource, Membership, Registry
from pdserve.disagg.router.pool import WorkerPool


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeAnswer(list):
    pass


class FakeRecord:
    def __init__(self, address: str) -> None:
        self.address = address


class FakeResolver:
    """Answers from a dict name -> {rdtype: [addresses]}; `down` makes every lookup time out."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, list[str]]] = {}
        self.down = False
        self.lookups = 0

    async def resolve(self, name: str, rdtype: str, **_: object) -> FakeAnswer:
        self.lookups += 1
        if self.down:
            raise dns.exception.Timeout()
        if name not in self.records:
            raise dns.resolver.NXDOMAIN()
        addresses = self.records[name].get(rdtype, [])
        if not addresses:
            raise dns.resolver.NoAnswer()
        return FakeAnswer(FakeRecord(a) for a in addresses)


def _info(ready: bool = True) -> WorkerInfo:
    return WorkerInfo(role="decode", model="m", kv_layout={}, kv_transport="tcp", kv_address="a:1", ready=ready,
                      num_running=0, num_waiting=0, num_free_kv_blocks=8, num_kv_blocks=8)


def test_members_are_urls_or_dns_names() -> None:
    assert parse_member("http://10.0.0.1:8000/") == "http://10.0.0.1:8000"
    assert parse_member("dns:pdserve-decode.ns.svc.cluster.local:8000") == DnsMember(
        "pdserve-decode.ns.svc.cluster.local", 8000)
    for bad in ("dns:name", "dns:name:0", "dns:na me:80", "10.0.0.1:8000", "http://h/path"):
        with pytest.raises(ValueError):
            parse_member(bad)


def test_registrations_expire_without_heartbeats() -> None:
    clock = Clock()
    registry = Registry(ttl_s=10, clock=clock)
    registry.register("decode", "http://d1:1/")
    registry.register("prefill", "http://p1:1")
    clock.now = 8
    registry.register("decode", "http://d1:1")  # the heartbeat moves the expiry
    assert registry.urls("decode") == ["http://d1:1"] and registry.urls("prefill") == ["http://p1:1"]
    clock.now = 12
    assert registry.urls("prefill") == [] and registry.urls("decode") == ["http://d1:1"]
    assert registry.deregister("http://d1:1") and not registry.deregister("http://d1:1")
    assert registry.urls("decode") == []


def test_a_member_that_leaves_keeps_its_work_but_gets_none_new() -> None:
    pool = WorkerPool(WorkerClient(timeout_s=1), decode=["http://a:1", "http://b:1"])
    a, b = pool.members("decode")
    a.info = b.info = _info()
    a.in_flight = 1  # a stream of this router's still runs on it
    pool.set_members("decode", ["http://b:1", "http://b:1/", "http://c:1"])
    assert [w.url for w in pool.members("decode")] == ["http://b:1", "http://c:1", "http://a:1"]
    assert pool.ready("decode") == [b]  # c has not answered a poll yet; a is leaving
    a.in_flight = 0
    pool.set_members("decode", ["http://b:1", "http://c:1"])
    assert [w.url for w in pool.members("decode")] == ["http://b:1", "http://c:1"]
    pool.set_members("decode", ["http://a:1", "http://b:1"])  # back: a new member, unknown until polled
    assert pool.find("decode", "http://a:1") is not a and pool.ready("decode") == [b]


def test_membership_combines_static_dns_and_registered_workers() -> None:
    async def scenario() -> None:
        clock, resolver = Clock(), FakeResolver()
        resolver.records["decode.svc"] = {"A": ["10.0.0.2", "10.0.0.1"], "AAAA": ["fd00::1"]}
        config = RouterConfig(prefill=("http://p:1",), decode=("http://d:1", "dns:decode.svc:8000"),
                              accept_registrations=True, dns_interval_s=2)
        pool, registry = WorkerPool(WorkerClient(timeout_s=1)), Registry(10, clock=clock)
        membership = Membership(pool, config, registry=registry, resolver=resolver, clock=clock)  # type: ignore[arg-type]
        registry.register("decode", "http://r:1")
        await membership.refresh()
        urls = [w.url for w in pool.members("decode")]
        assert urls == ["http://d:1", "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://[fd00::1]:8000",
                        "http://r:1"]
        resolver.records["decode.svc"] = {"A": ["10.0.0.3"]}
        clock.now = 1
        await membership.refresh()  # not due yet: the last answer stands
        assert resolver.lookups == 2 and len(pool.members("decode")) == 5
        clock.now = 2.5
        resolver.down = True
        await membership.refresh()  # the DNS server does not answer: keep what it said last
        assert len(pool.members("decode")) == 5
        resolver.down = False
        clock.now = 5
        await membership.refresh()
        assert [w.url for w in pool.members("decode")] == ["http://d:1", "http://10.0.0.3:8000", "http://r:1"]
        del resolver.records["decode.svc"]  # the Service has no endpoint left
        clock.now = 12  # and the registration ran out
        await membership.refresh()
        assert [w.url for w in pool.members("decode")] == ["http://d:1"]
        assert [w.url for w in pool.members("prefill")] == ["http://p:1"]

    asyncio.run(scenario())


def test_dns_source_takes_what_either_lookup_answers() -> None:
    resolver = FakeResolver()
    resolver.records["only-v6"] = {"AAAA": ["::1"]}
    source = DnsSource(DnsMember("only-v6", 9000), resolver)  # type: ignore[arg-type]
    assert asyncio.run(source.resolve()) == ["http://[::1]:9000"]

    class RefusesAAAA(FakeResolver):
        async def resolve(self, name: str, rdtype: str, **options: object) -> FakeAnswer:
            if rdtype == "AAAA":
                raise dns.resolver.NoNameservers()  # e.g. a server that refuses what it does not forward
            return await super().resolve(name, rdtype, **options)

    refusing = RefusesAAAA()
    refusing.records["v4"] = {"A": ["10.1.1.1"]}
    source = DnsSource(DnsMember("v4", 80), refusing)  # type: ignore[arg-type]
    assert asyncio.run(source.resolve()) == ["http://10.1.1.1:80"]


def test_a_worker_that_deregisters_gets_no_new_work_at_once_and_its_loss_is_no_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """`WorkerPool.leaving` (the router's POST /pd/deregister): no new work from that moment, not
    from the next membership update; a call that then finds it gone (`pdserve up`'s stop, a
    scale-in) is INFO, where a worker that just vanished is a WARNING."""
    pool = WorkerPool(WorkerClient(timeout_s=1), prefill=["http://p:1"], decode=["http://a:1", "http://b:1"])
    (p,), (a, b) = pool.members("prefill"), pool.members("decode")
    p.info = a.info = b.info = _info()
    a.in_flight = 1
    pool.leaving("http://a:1/")
    assert pool.ready("decode") == [b] and a.in_flight == 1  # its stream goes on
    pool.leaving("http://p:1")
    assert pool.ready("prefill") == [] and not pool.any_ready("prefill")
    caplog.set_level("INFO", logger="pdserve.disagg.router.pool")
    a.mark_unreachable(WorkerUnreachable(a.url, ConnectionRefusedError()))
    b.mark_unreachable(WorkerUnreachable(b.url, ConnectionRefusedError()))
    levels = {r.getMessage().split()[2]: r.levelname for r in caplog.records if "unreachable" in r.getMessage()}
    assert levels == {"http://a:1": "INFO", "http://b:1": "WARNING"}


def test_once_the_router_stops_no_worker_lost_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """`up`'s Ctrl-C stops the router and the workers at once: a call that then finds a worker gone,
    one that has not said it was leaving, is INFO (`WorkerPool.stopping`, set by the router's exit),
    for workers known then and listed later."""
    pool = WorkerPool(WorkerClient(timeout_s=1), prefill=["http://p:1"], decode=["http://a:1"])
    (p,), (a,) = pool.members("prefill"), pool.members("decode")
    p.info = a.info = _info()
    caplog.set_level("INFO", logger="pdserve.disagg.router.pool")
    a.mark_unreachable(WorkerUnreachable(a.url, ConnectionRefusedError()))
    pool.stopping = True
    pool.set_members("decode", ["http://a:1", "http://c:1"])
    c = pool.find("decode", "http://c:1")
    assert c is not None and p.going and c.going
    p.mark_unreachable(WorkerUnreachable(p.url, ConnectionResetError()))
    c.mark_unreachable(WorkerUnreachable(c.url, ConnectionRefusedError()))
    levels = [(r.getMessage().split()[2], r.levelname) for r in caplog.records if "unreachable" in r.getMessage()]
    assert levels == [("http://a:1", "WARNING"), ("http://p:1", "INFO"), ("http://c:1", "INFO")]
