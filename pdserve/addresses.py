"""Addresses as pdserve's flags and messages write them: a server's root URL, HOST[:PORT], a pool
member (a worker URL, or `dns:NAME:PORT`), an allowlist of hosts (addresses, CIDRs, `dns:NAME`).
Validated where they are parsed, so a typo is a usage error, not a connection error later."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

HTTP_URL_PATTERN = r"^https?://[^/\s]+/?$"  # a server's root: scheme, host[:port], nothing after


def is_http_url(text: str) -> bool:
    return re.match(HTTP_URL_PATTERN, text) is not None


def http_url(host: str, port: int) -> str:
    """http://HOST:PORT, an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def parse_host_port(text: str, default_port: int) -> tuple[str, int]:
    """'10.0.0.1:5353' -> ('10.0.0.1', 5353); 'dns.local' -> ('dns.local', default_port); '[::1]:53'."""
    match = re.fullmatch(r"\[([0-9a-fA-F:.]+)\](?::(\d+))?|([^:\s\[\]]+)(?::(\d+))?", text)
    if match is None:
        raise ValueError(f"expected HOST[:PORT], got {text!r}")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4) or default_port)
    if not 0 < port < 65536:
        raise ValueError(f"port out of range in {text!r}")
    return host, port


@dataclass(frozen=True, slots=True)
class DnsMember:
    """`dns:NAME:PORT`: every A/AAAA record of NAME is a worker at http://ADDRESS:PORT."""

    name: str
    port: int


def parse_member(text: str) -> str | DnsMember:
    """A pool member as written on the command line: a worker URL, or `dns:NAME:PORT`."""
    if text.startswith("dns:"):
        match = re.fullmatch(r"dns:([A-Za-z0-9_.-]+):(\d+)", text)
        if match is None or not 0 < int(match.group(2)) < 65536:
            raise ValueError(f"expected dns:NAME:PORT (e.g. dns:pdserve-decode.default.svc.cluster.local:8000), "
                             f"got {text!r}")
        return DnsMember(match.group(1), int(match.group(2)))
    if not is_http_url(text):
        raise ValueError(f"a worker is a URL like http://host:port or dns:NAME:PORT, got {text!r}")
    return text.rstrip("/")


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_allow(entries: Sequence[str]) -> tuple[tuple[IPNetwork, ...], tuple[str, ...]]:
    """An allowlist of hosts as flags write it: IP addresses and CIDRs (as networks), `dns:NAME`
    (as names); ValueError for an entry that is neither."""
    networks: list[IPNetwork] = []
    names: list[str] = []
    for entry in entries:
        if re.fullmatch(r"dns:[A-Za-z0-9_.-]+", entry):
            names.append(entry.removeprefix("dns:"))
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError as exc:
            raise ValueError(f"expected an IP address, a CIDR (10.0.0.0/8) or dns:NAME, got {entry!r}") from exc
    return tuple(networks), tuple(names)
