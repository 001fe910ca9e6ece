"""The KV port's door: who may open a connection, and the handshake that proves it.

    prefill                                        decode (KVPeerGate)
    connect                       ------>          accept: a slot, or refused (see below)
                                  <------          CHALLENGE {nonce_d}
    HELLO {layout, ..., nonce_p,  ------>          proof checked before anything else is looked at
           HMAC("kv-hello", nonce_d, nonce_p)}
                                  <------          WELCOME {layout, ..., HMAC("kv-welcome", nonce_d, nonce_p)}
    check decode's proof

No secret on the wire (disagg/auth.py). Bounded: at most `max_connections` connections at once;
when they are all taken, the oldest one still in its handshake is dropped for the newcomer (so idle
unauthenticated connections cannot keep a prefill worker out), and when every one is
authenticated the newcomer is refused. A handshake that has not completed within
`handshake_timeout_s` is closed; until it completed, a frame header may be at most
`MAX_HELLO_BYTES`, and no KV payload is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pdserve.disagg.auth import ClusterSecret, check_proof, hello_proof, new_nonce, welcome_proof
from pdserve.disagg.transport import frames
from pdserve.disagg.transport.errors import KVAuthError
from pdserve.disagg.transport.frames import ProtocolError
from pdserve.disagg.transport.messages import Challenge, Hello, Welcome

logger = logging.getLogger(__name__)

MAX_HELLO_BYTES = 256 << 10  # a layout and NIXL connection info fit many times over
AUTH_REFUSAL = "cluster authentication failed"  # how a WELCOME's refusal for want of the secret starts


@dataclass(frozen=True, slots=True)
class KVPeerPolicy:
    """Who may use a decode worker's KV port (WorkerConfig's --cluster-secret-file,
    --kv-max-connections, --kv-handshake-timeout-s)."""

    secret: ClusterSecret | None = None
    max_connections: int = 64
    handshake_timeout_s: float = 5.0


class KVPeerGate:
    """Decode side, I/O thread only: connection slots and the handshake."""

    def __init__(self, policy: KVPeerPolicy) -> None:
        self.policy = policy
        self._handshaking: OrderedDict[socket.socket, None] = OrderedDict()  # oldest first
        self._open: set[socket.socket] = set()
        self.num_refused = 0  # connections closed unauthenticated (refused, evicted, timed out)

    @property
    def num_connections(self) -> int:
        return len(self._handshaking) + len(self._open)

    @contextlib.contextmanager
    def slot(self, sock: socket.socket) -> Iterator[bool]:
        """True while `sock` holds a slot (False: refused, close it)."""
        if self.num_connections >= self.policy.max_connections:
            if not self._handshaking:
                self.num_refused += 1
                logger.warning("KV port: refused a connection: all %d slots hold authenticated peers",
                               self.policy.max_connections)
                yield False
                return
            oldest, _ = self._handshaking.popitem(last=False)
            self.num_refused += 1
            with contextlib.suppress(OSError):
                oldest.shutdown(socket.SHUT_RDWR)  # its handler sees EOF and closes it
        self._handshaking[sock] = None
        try:
            yield True
        finally:
            self._handshaking.pop(sock, None)
            self._open.discard(sock)

    async def handshake(self, sock: socket.socket, decide: Callable[[Hello], Welcome]) -> Hello | None:
        """Challenge, check the peer's proof, answer with `decide`'s Welcome (and our proof). The
        Hello if the connection may go on; None if it was refused (the caller closes it)."""
        try:
            hello = await asyncio.wait_for(_answer_hello(sock, decide, self.policy.secret),
                                           self.policy.handshake_timeout_s)
        except TimeoutError:
            logger.info("KV port: no handshake within %g s; closing", self.policy.handshake_timeout_s)
            hello = None
        if hello is None:
            self.num_refused += 1
            return None
        if sock in self._handshaking:
            del self._handshaking[sock]
            self._open.add(sock)
        return hello


async def _answer_hello(sock: socket.socket, decide: Callable[[Hello], Welcome],
                        secret: ClusterSecret | None) -> Hello | None:
    nonce = new_nonce()
    await frames.send_frame(sock, Challenge(nonce))
    frame = await frames.recv_frame(sock, max_payload_bytes=0, max_header_bytes=MAX_HELLO_BYTES)
    hello = frame.header
    if not isinstance(hello, Hello):
        raise ProtocolError(f"expected HELLO, got {frame.kind.name}")
    if not hello.nonce or not check_proof(secret, hello.proof, hello_proof(secret, nonce, hello.nonce)):
        why = "no or another cluster secret" if secret is not None else "this decode worker has no cluster secret"
        logger.warning("KV port: refused a peer: cluster authentication failed (%s)", why)
        await frames.send_frame(sock, Welcome(hello.layout, f"{AUTH_REFUSAL} ({why})", b""))
        return None
    welcome = dataclasses.replace(decide(hello), proof=welcome_proof(secret, nonce, hello.nonce))
    await frames.send_frame(sock, welcome)
    if welcome.refusal:
        logger.warning("refused a prefill worker: %s", welcome.refusal)
        return None
    return hello


async def say_hello(sock: socket.socket, hello: Hello, secret: ClusterSecret | None) -> Welcome:
    """Prefill's side: answer decode's challenge with `hello` and our proof; decode's WELCOME once
    its proof checked (its layout verdict is the caller's to check). KVAuthError otherwise."""
    frame = await frames.recv_frame(sock, max_payload_bytes=0, max_header_bytes=MAX_HELLO_BYTES)
    if not isinstance(frame.header, Challenge):
        raise ProtocolError(f"expected CHALLENGE, got {frame.kind.name}")
    server_nonce, nonce = frame.header.nonce, new_nonce()
    proof = hello_proof(secret, server_nonce, nonce)
    await frames.send_frame(sock, dataclasses.replace(hello, nonce=nonce, proof=proof))
    frame = await frames.recv_frame(sock, max_payload_bytes=0)
    welcome = frame.header
    if not isinstance(welcome, Welcome):
        raise ProtocolError(f"expected WELCOME, got {frame.kind.name}")
    if welcome.refusal.startswith(AUTH_REFUSAL) or not check_proof(secret, welcome.proof,
                                                                   welcome_proof(secret, server_nonce, nonce)):
        raise KVAuthError(f"decode's KV receiver did not prove the cluster secret: "
                          f"{welcome.refusal or 'no or another cluster secret there'}")
    return welcome
