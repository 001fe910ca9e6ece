"""Decode role under tensor parallelism with a KV pool per rank (CUDA; CPU with
PDSERVE_TP_RANK_POOLS=1): every rank receives its own KV heads, on a receiver of its own, straight
into its pool. Rank 0 keeps the reservations and decides when a request's KV is whole:

    rank 0 (engine process, DecodeService)            rank r
    receiver (heads of rank 0)                         receiver (heads of rank r), address Ar
    kv_address "A0,A1,..." (prefill: transport/ranked.py)
    expect / cancel           --- control (waits) -->  the same on its receiver
    end (KV whole or failed)  --- control --------->   drops its reservation
    counts rank r's payloads  <-- reports ----------   admitted (request, layer, blocks) | rejected

The control and report connections are `multiprocessing.connection` pairs over a Unix socket with
a random key (the ranks of one worker share a host; a TCP one would hold back a run of small
reports behind Nagle's algorithm and the peer's delayed ack: ~13 ms of every hand-off here).
Rank 0's final message waits until every rank's payloads were counted
(`KVReceiver.remote_admitted`); a payload a rank rejects ends the request on rank 0 too. Rank r's
receiver answers its prefill peers itself (acks, rejections).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Protocol

import torch

from pdserve.config import EngineConfig
from pdserve.disagg.auth import load_cluster_secret
from pdserve.disagg.transport import make_receiver
from pdserve.disagg.transport.base import KVReceiver
from pdserve.disagg.transport.handshake import KVPeerPolicy
from pdserve.disagg.worker.rank_streaming import rank_layout
from pdserve.engine.kv_transfer import RankPools

logger = logging.getLogger(__name__)
_CONNECT_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class RankReceivingSpec:
    """Picklable: builds rank r's `RankReceiving` there (`RankPools.install_rank_hook`)."""

    transport: str
    model_name: str
    kv_host: str
    kv_port: int  # rank 0's; rank r listens on kv_port + r (0: any free port)
    cluster_secret_file: str | None
    max_connections: int
    handshake_timeout_s: float
    rank0: str  # where rank 0 listens for the control and report connections (a Unix socket's path)
    authkey: bytes

    def __call__(self, kv_cache: torch.Tensor, config: EngineConfig, rank: int) -> RankReceiving:
        return RankReceiving(self, kv_cache, config, rank)


class RankReceiving:
    """Rank r's side (`RankHook`): its receiver, driven by rank 0 over the control connection."""

    def __init__(self, spec: RankReceivingSpec, kv_cache: torch.Tensor, config: EngineConfig, rank: int) -> None:
        peers = KVPeerPolicy(load_cluster_secret(spec.cluster_secret_file), spec.max_connections,
                             spec.handshake_timeout_s)
        self.receiver = make_receiver(spec.transport, rank_layout(spec.model_name, kv_cache, config, rank),
                                      kv_cache, host=spec.kv_host,
                                      port=spec.kv_port + rank if spec.kv_port else 0, peers=peers)
        self.control = Client(spec.rank0, authkey=spec.authkey)
        self.control.send((rank, "control"))
        self.reports = Client(spec.rank0, authkey=spec.authkey)
        self.reports.send((rank, "reports"))
        self._reports_lock = threading.Lock()
        self.receiver.on_admitted = lambda *report: self._report("admitted", *report)
        self.receiver.on_rejected = lambda *report: self._report("rejected", *report)
        threading.Thread(target=self._serve_control, name=f"pdserve-rank{rank}-kv-control", daemon=True).start()

    def command(self, message: tuple[Any, ...]) -> str:
        if message != ("address",):
            raise ValueError(f"unknown rank receiving command {message!r}")
        return self.receiver.address

    def step(self, message: object) -> None:
        return None

    def close(self) -> None:
        self.receiver.close()
        self.control.close()
        self.reports.close()

    def _report(self, *report: object) -> None:
        with self._reports_lock, contextlib.suppress(OSError):  # OSError: rank 0 is gone; this rank ends with it
            self.reports.send(report)

    def _serve_control(self) -> None:
        while True:
            try:
                kind, *args = self.control.recv()
            except (EOFError, OSError):
                return
            try:
                if kind == "expect":
                    self.receiver.expect(*args)
                    reply: tuple[str, Any] = ("ok", None)
                elif kind in ("cancel", "end"):
                    self.receiver.cancel(*args)
                    reply = ("ok", None)
                elif kind == "reserved":
                    reply = ("ok", sorted(self.receiver.reserved_request_ids()))
                else:
                    reply = ("error", f"unknown control message {kind!r}")
            except Exception as exc:  # noqa: BLE001 - rank 0 raises it
                reply = ("error", repr(exc))
            if kind != "end":
                self.control.send(reply)


class RankLinks:
    """Rank 0's end: the other ranks' receivers (built there), their control and report
    connections. `receiver` (rank 0's) then expects, cancels and counts on every rank."""

    def __init__(self, ranks: RankPools, receiver: KVReceiver, spec: RankReceivingSpec,
                 listener: Listener) -> None:
        self.receiver = receiver
        num_ranks = ranks.num_other_ranks
        accepted: dict[tuple[int, str], Connection] = {}
        with listener:
            accepting = threading.Thread(target=_accept, args=(listener, 2 * num_ranks, accepted), daemon=True)
            accepting.start()
            ranks.install_rank_hook(spec)
            accepting.join(_CONNECT_TIMEOUT_S)
        if len(accepted) != 2 * num_ranks:
            raise RuntimeError(f"decode ranks connected {len(accepted)} of {2 * num_ranks} control/report links")
        self.controls = [accepted[rank, "control"] for rank in range(1, num_ranks + 1)]
        self._lock = threading.Lock()  # one control exchange at a time
        self.addresses: list[str] = ranks.rank_command(("address",))
        for rank in range(1, num_ranks + 1):
            threading.Thread(target=self._read_reports, args=(accepted[rank, "reports"],),
                             name=f"pdserve-rank{rank}-kv-reports", daemon=True).start()
        receiver.ranks = self

    def expect(self, request_id: str, block_ids: list[int] | tuple[int, ...], token: str) -> None:
        self._ask(("expect", request_id, list(block_ids), token))

    def cancel(self, request_id: str) -> None:
        self._ask(("cancel", request_id))

    def end(self, request_id: str) -> None:
        """The request's KV is whole on every rank, or it failed: the ranks drop its reservation
        (no answer awaited: any later control message reaches them after this one)."""
        with self._lock:
            for control in self.controls:
                _send(control, ("end", request_id))

    def reserved_request_ids(self) -> frozenset[str]:
        return frozenset().union(*self._ask(("reserved",)))

    def _ask(self, message: tuple[Any, ...]) -> list[Any]:
        replies, errors = [], []
        with self._lock:
            for rank, control in enumerate(self.controls, start=1):
                _send(control, message)
                try:
                    status, reply = control.recv()
                except (EOFError, OSError) as exc:
                    raise RuntimeError(f"decode rank {rank} is gone: {exc!r}") from exc
                if status != "ok":
                    errors.append(f"decode rank {rank}: {reply}")
                replies.append(reply)
        if errors:
            raise RuntimeError("; ".join(errors))
        return replies

    def _read_reports(self, reports: Connection) -> None:
        while True:
            try:
                kind, *args = reports.recv()
            except (EOFError, OSError):
                return
            if kind == "admitted":
                self.receiver.remote_admitted(*args)
            else:
                self.receiver.remote_rejected(*args)


def _accept(listener: Listener, count: int, accepted: dict[tuple[int, str], Connection]) -> None:
    for _ in range(count):
        try:
            conn = listener.accept()
            rank, kind = conn.recv()
        except (OSError, EOFError) as exc:  # NOTE: a wrong key, or a rank that died connecting
            logger.warning("a decode rank's link failed: %r", exc)
            return
        accepted[rank, kind] = conn


def _send(control: Connection, message: tuple[Any, ...]) -> None:
    try:
        control.send(message)
    except OSError as exc:
        raise RuntimeError(f"a decode rank is gone: {exc!r}") from exc


class ReceivingAt(Protocol):
    """What `link_ranks` reads of a decode worker's KV settings (disagg/worker/kv_side.py's `KVSideSpec`)."""

    @property
    def transport(self) -> str: ...

    @property
    def model_name(self) -> str: ...

    @property
    def kv_host(self) -> str: ...

    @property
    def kv_port(self) -> int: ...

    @property
    def cluster_secret_file(self) -> str | None: ...


def link_ranks(ranks: RankPools, receiver: KVReceiver, at: ReceivingAt, peers: KVPeerPolicy) -> RankLinks:
    """Receivers on the other ranks, linked to rank 0's `receiver` (`receiver.kv_address` lists them)."""
    authkey = secrets.token_bytes(32)
    listener = Listener(family="AF_UNIX", authkey=authkey)
    spec = RankReceivingSpec(at.transport, at.model_name, at.kv_host, at.kv_port, at.cluster_secret_file,
                             peers.max_connections, peers.handshake_timeout_s, listener.address, authkey)
    return RankLinks(ranks, receiver, spec, listener)
