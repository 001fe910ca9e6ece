"""Which prefill workers a gateway decode worker may send jobs to (`--gateway-prefill-allow`).

The header `x-prefiller-host-port` comes with the client's request: the endpoint picker sets it,
but a gateway that passes a client's own header through would have the decode worker POST to any
address the client names (llm-d's sidecar guards this with `--enable-ssrf-protection`, the pool's
pods). With an allowlist, a header naming anything else is not contacted: the prompt is prefilled
here instead (worker/directed_prefill.py, reason `not_allowed`).

Entries: an IP address, a CIDR (`10.0.0.0/8`), or `dns:NAME`: every address NAME resolves to,
looked up again at most every `_DNS_TTL_S` (in Kubernetes, the prefill workers' headless Service:
its ready pods). A header naming a host rather than an address is resolved too; every address it
resolves to must be allowed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.addresses import IPNetwork, parse_allow

logger = logging.getLogger(__name__)

_DNS_TTL_S = 5.0
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


async def _resolve(host: str) -> set[Address]:
    """Every address `host` (a name or an address) stands for; empty when it does not resolve."""
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in infos}


@dataclass(slots=True)
class PrefillAllowlist:
    """`--gateway-prefill-allow` (module docstring). Used from the worker's event loop."""

    networks: tuple[IPNetwork, ...]
    names: tuple[str, ...]
    _resolved: dict[str, tuple[float, set[Address]]] = field(default_factory=dict)  # name -> (when, addresses)

    @classmethod
    def of(cls, entries: Sequence[str]) -> PrefillAllowlist | None:
        """None for no entries: any prefill worker may be named."""
        return cls(*parse_allow(entries)) if entries else None

    async def permits(self, host: str) -> bool:
        addresses = await _resolve(host)
        if not addresses:
            return False
        allowed = await self._name_addresses()
        return all(a in allowed or any(a in n for n in self.networks) for a in addresses)

    async def _name_addresses(self) -> set[Address]:
        now = time.monotonic()
        found: set[Address] = set()
        for name in self.names:
            when, addresses = self._resolved.get(name, (float("-inf"), set()))
            if now - when > _DNS_TTL_S:
                addresses = await _resolve(name)
                if not addresses:
                    logger.warning("--gateway-prefill-allow: dns:%s resolves to nothing now", name)
                self._resolved[name] = (now, addresses)
            found |= addresses
        return found
