"""Decode's pool as NIXL exposes it: one registration per reservation, revoked when it ends.

RDMA is one-sided: a peer that holds a registration's remote keys (the agent metadata NIXL
serializes for it) can WRITE anywhere in it, and NIXL refuses only addresses outside the
registrations that peer loaded. So the pool is never registered as one piece. The first granted
claim of a reservation registers that reservation's regions (every layer's K and V of its blocks,
adjacent ones merged), and the GRANT carries that registration's partial metadata, nothing else;
the claims of its other layers find it registered:

    first claim of r, valid       -> register r's regions; GRANT {addrs, r's metadata}
    later claims of r             -> GRANT {addrs} (the metadata again only to a peer that lacks it)
    r's WRITTEN                   -> that grant is closed (its bytes landed)
    r ends: KV complete, cancel,  -> deregister r's regions: now when no grant of r is open, else
    reject, lease, peer gone         after `hold_s` (LATE_WRITE_WINDOW_S): a WRITE granted before the
                                     end may still be in flight, and over InfiniBand one that meets
                                     a deregistered key fails the peer's whole connection

One registration per reservation, not per claim: a claim then costs nothing more than before (a
dict lookup), and the registration, its metadata and its revocation are paid once per request
(docs/BENCHMARKS.md, "NIXL grants"). I/O thread only, like every NIXL call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport import regions
from pdserve.disagg.transport.nixl.agent import Registration, memory_kind, register
from pdserve.disagg.transport.reservations import Reservation


@dataclass(slots=True, eq=False)
class _Exposed:
    """One reservation's registration, while the reservation lives."""

    reservation: Reservation  # identity: the live reservation it was made for
    registration: Registration
    peers: set[str] = field(default_factory=set)  # agents its metadata went to
    num_open_grants: int = 0  # granted, WRITTEN not yet seen


class ReservationGrants:
    def __init__(self, agent: Any, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        self._agent = agent
        self._kv_cache = kv_cache
        self._layout = layout
        self._kind = memory_kind(kv_cache)
        self._live: dict[str, _Exposed] = {}
        self._held: list[tuple[float, Registration]] = []  # (deregister at (monotonic), registration)

    @property
    def num_registrations(self) -> int:
        """Registrations not yet deregistered, live or held (tests: none left behind)."""
        return len(self._live) + len(self._held)

    def grant(self, peer: str, request_id: str, reservation: Reservation, hold_s: float) -> tuple[bytes, int]:
        """One more open grant of `reservation`; registers its regions on the first. The metadata
        `peer` must load before it writes ("" when it already has it) and the registration's
        device id."""
        exposed = self._live.get(request_id)
        if exposed is not None and exposed.reservation is not reservation:  # an ended one of that id
            self._revoke(request_id, hold_s)
            exposed = None
        if exposed is None:
            exposed = self._live[request_id] = _Exposed(reservation, self._register(reservation))
        exposed.num_open_grants += 1
        registration = exposed.registration
        if peer in exposed.peers:
            return b"", registration.device_id
        exposed.peers.add(peer)
        return registration.metadata, registration.device_id

    def written(self, request_id: str) -> None:
        """A grant of the request closed: its WRITE landed."""
        exposed = self._live.get(request_id)
        if exposed is not None and exposed.num_open_grants > 0:
            exposed.num_open_grants -= 1

    def revoke_ended(self, is_live: Callable[[str, Reservation], bool], hold_s: float) -> None:
        """Deregister (or hold) the registrations of reservations that are no longer live."""
        for request_id in [r for r, e in self._live.items() if not is_live(r, e.reservation)]:
            self._revoke(request_id, hold_s)

    def forget_peer(self, peer: str) -> None:
        """Its agent is gone: a new one (a restarted worker) gets the metadata again. NOTE: its open
        grants stay open, so its reservations' registrations are held when they end."""
        for exposed in self._live.values():
            exposed.peers.discard(peer)

    def expire(self) -> None:
        now = time.monotonic()
        due = [reg for until, reg in self._held if until <= now]
        self._held = [(until, reg) for until, reg in self._held if until > now]
        for registration in due:
            self._agent.deregister_memory(registration.descs)

    def close(self) -> None:
        for registration in [e.registration for e in self._live.values()] + [reg for _, reg in self._held]:
            self._agent.deregister_memory(registration.descs)
        self._live.clear()
        self._held.clear()

    def _revoke(self, request_id: str, hold_s: float) -> None:
        exposed = self._live.pop(request_id)
        if exposed.num_open_grants:
            self._held.append((time.monotonic() + hold_s, exposed.registration))
        else:
            self._agent.deregister_memory(exposed.registration.descs)

    def _register(self, reservation: Reservation) -> Registration:
        """Every layer's K and V regions of the reservation's blocks, adjacent ones merged."""
        blocks = sorted(reservation.block_ids)
        num_pool_blocks = self._kv_cache.shape[2]
        offsets = np.concatenate([regions.payload_offsets(self._layout, num_pool_blocks, layer, blocks)
                                  for layer in range(self._layout.num_layers)])
        spans = regions.coalesce(offsets, self._layout.region_bytes)
        return register(self._agent, self._kv_cache.data_ptr() + spans.starts, spans.lengths, self._kind)
