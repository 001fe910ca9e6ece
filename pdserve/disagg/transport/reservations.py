"""The decode side's reservation table: the single place that decides whether a payload may touch
the pool. Every transport's receiver asks it, so all of them validate the same way.

A reservation is the set of destination blocks one request may receive. A payload is admitted
only if its request is reserved, it presents the reservation's token, every destination block is
in that set (each at most once), its layer exists, and its byte count, dtype and shape are exactly
one layer of K and V for those blocks, of the KV heads it names (all of the pool's, or one
tensor-parallel rank's within them). The dtype is the pool's, or one the pool converts from
(`KVLayout.converts_payload`): the byte count is then counted in the payload's dtype. A payload's
scales (LayerHeader) are 1.0 unless its dtype is FP8; FP8 ones other than the pool's are converted.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pdserve.disagg.kv_layout import FP8_DTYPES, KVLayout
from pdserve.disagg.transport.messages import DoneHeader, LayerHeader


class PayloadRejected(Exception):
    """A payload failed validation; `reason` goes back to the sender verbatim."""

    def __init__(self, request_id: str, reason: str, request_known: bool) -> None:
        super().__init__(f"request {request_id}: {reason}")
        self.request_id = request_id
        self.reason = reason
        self.request_known = request_known


@dataclass(slots=True, eq=False)
class Reservation:
    """One request's destination blocks and receive progress. Transports hold it only as a token
    (`check_layer` -> `writing`) to tell whether the request is still the same live reservation."""

    block_ids: frozenset[int]
    token: bytes = b""  # what every payload of it must present
    num_layer_payloads: int = 0
    converted: bool = False  # a payload of it came in another dtype (counted once, when it completes)
    # The final message can overtake layer payloads (nixl's notifications; over tcp, a
    # tensor-parallel prefill worker's other ranks' connections); it waits here until they arrive,
    # with what the transport needs to answer it (`pending_origin`: its sender).
    pending_done: DoneHeader | None = None
    pending_origin: object = None


class ReservationTable:
    """Thread-safe: decode's threads call expect/cancel while a transport thread admits payloads.
    NOTE: bytes land in the pool only while this lock is held and the reservation is live
    (`admit_layer` around a copy, `writing` around each receive syscall), so once `remove` returns
    nothing is writing into that request's blocks any more (RDMA aside, see transport/nixl/receiver.py)."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self._lock = threading.Lock()
        self._reservations: dict[str, Reservation] = {}
        self.num_converted = 0  # completed reservations whose KV was converted on arrival

    def expect(self, request_id: str, block_ids: list[int] | tuple[int, ...], token: str = "") -> None:
        ids = frozenset(block_ids)
        if len(ids) != len(block_ids) or not ids:
            raise ValueError(f"request {request_id}: reservation needs distinct block ids, got {list(block_ids)}")
        if min(ids) < 0 or max(ids) >= self.num_blocks:
            raise ValueError(f"request {request_id}: block ids must be in [0, {self.num_blocks})")
        with self._lock:
            if request_id in self._reservations:
                raise ValueError(f"request {request_id} already has a reservation")
            self._reservations[request_id] = Reservation(ids, token.encode())

    def remove(self, request_id: str) -> Reservation | None:
        """Drop the reservation; the one dropped (None: there was none)."""
        with self._lock:
            return self._reservations.pop(request_id, None)

    def is_reserved(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._reservations

    def is_live(self, request_id: str, reservation: Reservation) -> bool:
        """Whether `reservation` (from `check_layer`) is still the request's live one."""
        with self._lock:
            return self._reservations.get(request_id) is reservation

    def request_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._reservations)

    def check_layer(self, header: LayerHeader) -> Reservation:
        """Raise PayloadRejected unless `header` describes an admissible payload right now."""
        with self._lock:
            return self._check_layer(header)

    @contextmanager
    def writing(self, request_id: str, reservation: Reservation) -> Iterator[bool]:
        """Yields True, holding the lock, while `reservation` is still the request's live one: bytes
        may land in its blocks during the block. After `remove` returned it yields False."""
        with self._lock:
            yield self._reservations.get(request_id) is reservation

    @contextmanager
    def admit_layer(self, header: LayerHeader) -> Iterator[None]:
        """Validate, then hold the lock while the caller writes the payload into the pool; the
        payload counts as received once the block exits without error."""
        with self._lock:
            reservation = self._check_layer(header)
            yield
            reservation.num_layer_payloads += 1
            reservation.converted |= not self.layout.stores_as(header.dtype, header.scales, header.layer)

    def admit_done(self, header: DoneHeader, *, in_order: bool, origin: object = None) -> bool:
        """True: every layer payload announced by `header` was received, the reservation is closed.
        False (only when not `in_order`): layer payloads are still on their way; `take_ready_done`
        returns the header and `origin` once they arrived."""
        with self._lock:
            reservation = self._get_as(header.request_id, header.token)
            received, announced = reservation.num_layer_payloads, header.num_layer_payloads
            if received > announced or (in_order and received != announced):
                raise PayloadRejected(header.request_id, f"final message announces {announced} layer payloads, "
                                      f"{received} were received", request_known=True)
            if received < announced:
                reservation.pending_done, reservation.pending_origin = header, origin
                return False
            self._close(header.request_id, reservation)
            return True

    def count_remote(self, request_id: str) -> bool:
        """Another rank's receiver admitted a layer payload of the request (it validated it);
        False when the request is not reserved any more."""
        with self._lock:
            reservation = self._reservations.get(request_id)
            if reservation is not None:
                reservation.num_layer_payloads += 1
            return reservation is not None

    def take_ready_done(self, request_id: str) -> tuple[DoneHeader, object] | None:
        """The request's final message and its origin, if it was waiting and all its layers have
        now arrived."""
        with self._lock:
            reservation = self._reservations.get(request_id)
            done = reservation.pending_done if reservation is not None else None
            if done is None or reservation is None or reservation.num_layer_payloads < done.num_layer_payloads:
                return None
            self._close(request_id, reservation)
            return done, reservation.pending_origin

    def _close(self, request_id: str, reservation: Reservation) -> None:
        """Its KV arrived whole (lock held)."""
        del self._reservations[request_id]
        self.num_converted += reservation.converted

    def _get(self, request_id: str) -> Reservation:
        reservation = self._reservations.get(request_id)
        if reservation is None:
            raise PayloadRejected(request_id, "unknown request (never reserved, cancelled or finished)",
                                  request_known=False)
        return reservation

    def _get_as(self, request_id: str, token: str) -> Reservation:
        """The reservation, for a payload that presents its token. NOTE: a wrong token is refused
        as if the request were unknown: the payload is dropped, the reservation stays intact (a
        stray or hostile stream cannot end the request the router assigned)."""
        reservation = self._get(request_id)
        if not hmac.compare_digest(token.encode(), reservation.token):
            raise PayloadRejected(request_id, "wrong reservation token", request_known=False)
        return reservation

    def _check_layer(self, header: LayerHeader) -> Reservation:
        reservation = self._get_as(header.request_id, header.token)
        problem = self._layer_problem(header, reservation)
        if problem is not None:
            raise PayloadRejected(header.request_id, problem, request_known=True)
        return reservation

    def _layer_problem(self, header: LayerHeader, reservation: Reservation) -> str | None:
        return self._placement_problem(header, reservation) or self._payload_problem(header)

    def _placement_problem(self, header: LayerHeader, reservation: Reservation) -> str | None:
        """Which layer and blocks the payload is for: within what the request reserved and announced."""
        layout, dst = self.layout, header.dst_block_ids
        done = reservation.pending_done
        if done is not None and reservation.num_layer_payloads >= done.num_layer_payloads:
            return f"layer {header.layer} is beyond the {done.num_layer_payloads} payloads the final message announced"
        if not 0 <= header.layer < layout.num_layers:
            return f"layer {header.layer} out of range [0, {layout.num_layers})"
        outside = sorted(set(dst) - reservation.block_ids)
        if outside:
            return f"destination blocks {outside} are not reserved for this request"
        if len(set(dst)) != len(dst) or not dst:
            return f"destination blocks must be distinct and non-empty, got {list(dst)}"
        return None

    def _payload_problem(self, header: LayerHeader) -> str | None:
        """The payload's dtype, scales, heads, size and shape: what this pool stores (or converts)."""
        layout, dst = self.layout, header.dst_block_ids
        if header.dtype not in FP8_DTYPES and header.scales != (1.0, 1.0):
            return f"scales {list(header.scales)} on a {header.dtype} payload (only FP8 payloads are scaled)"
        if not layout.stores_as(header.dtype, header.scales, header.layer):
            if not layout.converts_payload(header.dtype):
                return f"dtype {header.dtype} != {layout.dtype} (and not one it converts from)"
            layout = layout.as_dtype(header.dtype)  # what the payload's bytes are
        num_heads = header.shape[3] if len(header.shape) == 5 else 0
        if not layout.holds_heads(header.kv_head_start, num_heads):
            return (f"KV heads [{header.kv_head_start}, {header.kv_head_start + num_heads}) are not within this "
                    f"pool's [{layout.kv_head_start}, {layout.kv_head_end})")
        layout = layout.with_heads(header.kv_head_start, num_heads)  # a rank's heads, or all of them
        expected_bytes = len(dst) * layout.block_bytes_per_layer
        if header.num_bytes != expected_bytes:
            return (f"byte count {header.num_bytes} != {len(dst)} blocks x {layout.block_bytes_per_layer} "
                    f"bytes per block and layer = {expected_bytes}")
        if header.shape != layout.payload_shape(len(dst)):
            return f"shape {list(header.shape)} != {list(layout.payload_shape(len(dst)))}"
        return None
