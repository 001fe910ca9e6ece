"""Who is in the router's pool: the members of each role come from three sources, combined.

- static: worker URLs given on the command line (`--decode http://…`);
- DNS: `--decode dns:NAME:PORT`, the Kubernetes headless-Service way: every A/AAAA record of NAME
  is a worker at http://ADDRESS:PORT, resolved again every `dns_interval_s`;
- registration: workers started with `--register http://ROUTER` POST /pd/register once they
  serve and every 2 s after (the heartbeat), and /pd/deregister when they drain. One silent for
  `registration_ttl_s` is forgotten.

`Membership.refresh()` hands the union to `WorkerPool.set_members`; membership alone sends no
traffic: a member gets requests only once its own GET /pd/info says it is ready (pool.py), and
leaves the ready set at the first failed poll or call, long before any source forgets it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.resolver

from pdserve.addresses import DnsMember, http_url, parse_host_port, parse_member
from pdserve.disagg.config import RouterConfig
from pdserve.disagg.router.pool import WorkerPool
from pdserve.disagg.router.stats import WorkerRole

logger = logging.getLogger(__name__)
_ROLES: tuple[WorkerRole, ...] = ("prefill", "decode")
_DNS_TIMEOUT_S = 2.0


@dataclass(slots=True)
class _Registered:
    role: WorkerRole
    expires_at: float


class Registry:
    """Workers that announced themselves, until they leave or fall silent."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._workers: dict[str, _Registered] = {}

    def register(self, role: WorkerRole, url: str) -> None:
        url = url.rstrip("/")
        known = self._workers.get(url)
        if known is None or known.role != role:
            # NOTE: DEBUG: the pool says when it joins ("is in the pool"), once it answers its polls
            logger.debug("%s worker %s registered", role, url)
        self._workers[url] = _Registered(role, self._clock() + self._ttl_s)

    def deregister(self, url: str) -> bool:
        gone = self._workers.pop(url.rstrip("/"), None)
        if gone is not None:
            logger.info("%s worker %s deregistered", gone.role, url)
        return gone is not None

    def urls(self, role: WorkerRole) -> list[str]:
        now = self._clock()
        for url, worker in list(self._workers.items()):
            if worker.expires_at <= now:
                logger.warning("%s worker %s forgotten: no heartbeat for %.0f s", worker.role, url, self._ttl_s)
                del self._workers[url]
        return [url for url, worker in self._workers.items() if worker.role == role]


class DnsSource:
    """One `dns:NAME:PORT` member. A name that does not exist (or has no records) means no worker;
    a DNS server that does not answer keeps the last answer (and says so), so a DNS outage
    does not empty the pool."""

    def __init__(self, member: DnsMember, resolver: dns.asyncresolver.Resolver) -> None:
        self.member = member
        self._resolver = resolver
        self.urls: list[str] = []

    async def resolve(self) -> list[str]:
        """The workers NAME lists now: its A and AAAA records. When neither lookup gets an answer
        (an error rather than "no such name" or "no such record"), the last answer stands."""
        answers = await asyncio.gather(*(self._lookup(rdtype) for rdtype in ("A", "AAAA")))
        if all(isinstance(a, dns.exception.DNSException) for a in answers):
            logger.warning("DNS lookup of %s failed, keeping its %d workers: %s", self.member.name, len(self.urls),
                           answers[0])
            return self.urls
        addresses = {address for answer in answers if isinstance(answer, list) for address in answer}
        urls = sorted(http_url(address, self.member.port) for address in addresses)
        if urls != self.urls:
            logger.info("dns:%s:%d now lists %d workers: %s", self.member.name, self.member.port, len(urls),
                        ", ".join(urls) or "none")
        self.urls = urls
        return urls

    async def _lookup(self, rdtype: str) -> list[str] | dns.exception.DNSException:
        try:
            answer = await self._resolver.resolve(self.member.name, rdtype, search=True, lifetime=_DNS_TIMEOUT_S)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except dns.exception.DNSException as exc:
            return exc
        return [record.address for record in answer]


def make_resolver(server: str) -> dns.asyncresolver.Resolver:
    """The system's resolver (/etc/resolv.conf), or `server` (HOST[:PORT]) alone."""
    if not server:
        return dns.asyncresolver.Resolver()
    host, port = parse_host_port(server, 53)
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [host]
    resolver.port = port
    return resolver


class Membership:
    """The pool's members: static URLs, DNS names and registrations, combined in that order."""

    def __init__(self, pool: WorkerPool, config: RouterConfig, *, registry: Registry | None = None,
                 resolver: dns.asyncresolver.Resolver | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self.registry = registry
        self._clock = clock
        self._dns_interval_s = config.dns_interval_s
        self._next_dns = 0.0
        members = {"prefill": [parse_member(m) for m in config.prefill],
                   "decode": [parse_member(m) for m in config.decode]}
        self._static = {role: [m for m in members[role] if isinstance(m, str)] for role in _ROLES}
        names = {role: [m for m in members[role] if isinstance(m, DnsMember)] for role in _ROLES}
        self._dns: dict[WorkerRole, list[DnsSource]] = {role: [] for role in _ROLES}
        if any(names.values()):
            shared = resolver or make_resolver(config.dns_server)
            self._dns = {role: [DnsSource(m, shared) for m in names[role]] for role in _ROLES}
        self._apply()

    @property
    def uses_dns(self) -> bool:
        return any(self._dns.values())

    async def refresh(self) -> None:
        """Resolve the DNS members when due, then give the pool the current members."""
        now = self._clock()
        if self.uses_dns and now >= self._next_dns:
            self._next_dns = now + self._dns_interval_s
            await asyncio.gather(*(source.resolve() for role in _ROLES for source in self._dns[role]))
        self._apply()

    def _apply(self) -> None:
        for role in _ROLES:
            urls = [*self._static[role], *(url for source in self._dns[role] for url in source.urls)]
            if self.registry is not None:
                urls += self.registry.urls(role)
            self._pool.set_members(role, urls)
