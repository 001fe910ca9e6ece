"""Cluster authentication: one shared secret that every router and worker of a cluster holds
(`--cluster-secret-file`, or env PDSERVE_CLUSTER_SECRET). It never travels: peers prove they hold
it with HMAC-SHA256 over what they send.

- HTTP control plane (`/pd/*` of workers, `/pd/register` of the router): every request carries

      X-PD-Timestamp: unix seconds      X-PD-Nonce: 32 hex digits (random per request)
      X-PD-Signature: hex HMAC(secret, method, raw path, timestamp, nonce, SHA-256(body))

  (`signature_headers`; `SignedRequests` for httpx). `PeerAuth` (ASGI) answers 401 unless the signature is right,
  the timestamp within `MAX_CLOCK_SKEW_S` of its own clock and the nonce unseen in that window
  (a replayed request is refused). Open without it: GET /pd/info and GET /pd/stats (read-only
  status, like /metrics).
- KV handshake (transport/frames.py): decode sends a challenge nonce, prefill answers with its own
  nonce and HMAC("kv-hello", both nonces), decode answers HMAC("kv-welcome", both nonces): each
  side knows the other holds the secret before any KV byte (or NIXL metadata) moves.
- Prefill jobs: the router signs each job (`sign_job`) over every field prefill acts on except the
  attempt id; prefill refuses a job whose signature is wrong (`verify_job`) before it connects
  anywhere: a job taken from Redis, or posted, cannot send prefill to an address no router chose.

No secret configured: all of it is off (signatures empty, nothing checked), and the worker says so
once at startup.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Generator
from http import HTTPStatus

import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve import envs
from pdserve.disagg.control import Placement, PrefillJob
from pdserve.serving.errors import error_response
from pdserve.serving.middleware import wrong_method

logger = logging.getLogger(__name__)

HEADER_TIMESTAMP = "x-pd-timestamp"
HEADER_NONCE = "x-pd-nonce"
HEADER_SIGNATURE = "x-pd-signature"
# NOTE: hosts' clocks must agree within this; a nonce is remembered as long, so a replay is refused
MAX_CLOCK_SKEW_S = 30.0
MIN_SECRET_BYTES = 16
_MAX_NONCES = 1 << 17  # ~20 MiB at most
_MAX_SIGNED_BODY_BYTES = 64 << 20
OPEN_ROUTES = frozenset({("GET", "/pd/info"), ("GET", "/pd/stats")})


class ClusterSecret:
    """The shared secret; `mac` is the only thing done with it."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
        self._key = key

    def __repr__(self) -> str:
        return "ClusterSecret(***)"

    def mac(self, *parts: str | bytes) -> str:
        """HMAC-SHA256 over `parts`, each length-prefixed (no two part lists give the same input)."""
        digest = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            data = part.encode() if isinstance(part, str) else part
            digest.update(len(data).to_bytes(8, "big"))
            digest.update(data)
        return digest.hexdigest()

    def check(self, mac: str, *parts: str | bytes) -> bool:
        return hmac.compare_digest(mac.encode(), self.mac(*parts).encode())


def load_cluster_secret(path: str | None) -> ClusterSecret | None:
    """The file's content (surrounding whitespace stripped), else PDSERVE_CLUSTER_SECRET, else None."""
    if path is not None:
        with open(path, "rb") as f:
            return ClusterSecret(f.read().strip())
    raw = envs.cluster_secret()
    return None if raw is None else ClusterSecret(raw.encode())


def new_secret() -> str:
    """A random secret (`pdserve up`'s, when it was given none)."""
    return secrets.token_hex(32)


def new_nonce() -> str:
    return secrets.token_hex(16)


def warn_if_open(secret: ClusterSecret | None, what: str) -> None:
    if secret is None:
        logger.warning("%s: no cluster secret (--cluster-secret-file / %s): /pd/* and the KV port accept "
                       "any peer that can connect", what, envs.CLUSTER_SECRET)


def _request_parts(method: str, raw_path: bytes, timestamp: str, nonce: str, body: bytes) -> tuple[str | bytes, ...]:
    return ("pd-http", method.upper(), raw_path, timestamp, nonce, hashlib.sha256(body).hexdigest())


def signature_headers(secret: ClusterSecret | None, method: str, raw_path: bytes | str,
                      body: bytes) -> dict[str, str]:
    """The headers that sign one request (raw path: with its query string, as sent); {} without a secret."""
    if secret is None:
        return {}
    timestamp, nonce = f"{time.time():.3f}", new_nonce()
    raw = raw_path.encode() if isinstance(raw_path, str) else raw_path
    return {HEADER_TIMESTAMP: timestamp, HEADER_NONCE: nonce,
            HEADER_SIGNATURE: secret.mac(*_request_parts(method, raw, timestamp, nonce, body))}


class SignedRequests(httpx.Auth):
    """httpx auth: signs every request with the cluster secret (nothing when there is none)."""

    requires_request_body = True

    def __init__(self, secret: ClusterSecret | None) -> None:
        self.secret = secret

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers.update(signature_headers(self.secret, request.method, request.url.raw_path, request.content))
        yield request


class NonceCache:
    """Nonces seen within the clock-skew window, at most `max_entries` (signed calls beyond that
    rate, ~2,000 a second, are refused until older nonces expire)."""

    def __init__(self, window_s: float = MAX_CLOCK_SKEW_S, max_entries: int = _MAX_NONCES) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when seen, oldest first

    def first_use(self, nonce: str, now: float) -> bool:
        """False for a nonce seen before, and (NOTE: never forgetting one that could still be
        replayed) while the cache is full of nonces of the window."""
        # a nonce is kept 2 windows: its timestamp may lie a window before or after its arrival
        while self._seen and next(iter(self._seen.values())) < now - 2 * self.window_s:
            self._seen.popitem(last=False)
        if nonce in self._seen or len(self._seen) >= self.max_entries:
            return False
        self._seen[nonce] = now
        return True


class PeerAuth:
    """ASGI: every request under `prefix` (but OPEN_ROUTES) must be signed with the cluster secret,
    else 401 in the error envelope. The body is read (up to 64 MiB: 413) to check its digest and
    handed on unchanged."""

    def __init__(self, app: ASGIApp, secret: ClusterSecret, prefix: str = "/pd/",
                 clock: Callable[[], float] = time.time) -> None:
        self.app = app
        self.secret = secret
        self.prefix = prefix
        self.clock = clock
        self.nonces = NonceCache()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = str(scope.get("path", "")), str(scope.get("method", ""))
        if scope["type"] != "http" or not path.startswith(self.prefix) or (method, path) in OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        problem = "request body too large" if body is None else self._problem(scope, method, body)
        # NOTE: a method no route takes is the app's 405 (with `Allow`), not an authentication failure
        if problem and not (body is not None and wrong_method(scope)):
            logger.warning("refused %s %s from %s: %s", method, path, scope.get("client"), problem)
            status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE if body is None else HTTPStatus.UNAUTHORIZED
            await error_response(f"cluster authentication failed: {problem}", status)(scope, receive, send)
            return
        await self.app(scope, _replay(body or b"", receive), send)

    def _problem(self, scope: Scope, method: str, body: bytes) -> str:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        timestamp, nonce = headers.get(HEADER_TIMESTAMP, ""), headers.get(HEADER_NONCE, "")
        signature = headers.get(HEADER_SIGNATURE, "")
        if not (timestamp and nonce and signature):
            return "unsigned request (no cluster secret?)"
        raw_path = scope.get("raw_path") or str(scope["path"]).encode()
        if scope.get("query_string"):  # NOTE: httpx signs the path with its query (`URL.raw_path`)
            raw_path += b"?" + scope["query_string"]
        if not self.secret.check(signature, *_request_parts(method, raw_path, timestamp, nonce, body)):
            return "bad signature (another cluster secret?)"
        try:
            skew = abs(self.clock() - float(timestamp))
        except ValueError:
            return "unreadable timestamp"
        if skew > MAX_CLOCK_SKEW_S:
            return f"timestamp {skew:.0f} s away from this host's clock (at most {MAX_CLOCK_SKEW_S:g})"
        if not self.nonces.first_use(nonce, self.clock()):
            return "replayed request (nonce seen before), or too many signed calls in the window"
        return ""


async def _read_body(receive: Receive) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > _MAX_SIGNED_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the body already read, then the server's own messages (a
    streamed response listens on it for the client's disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


def _job_parts(job: PrefillJob) -> tuple[str, ...]:
    # NOTE: everything but the attempt id (a re-delivered job runs as a new attempt, unsigned again)
    return ("pd-job", job.model_copy(update={"transfer_id": "", "signature": ""}).model_dump_json())


def sign_job(secret: ClusterSecret | None, job: PrefillJob) -> PrefillJob:
    return job if secret is None else job.model_copy(update={"signature": secret.mac(*_job_parts(job))})


def sign_placement(secret: ClusterSecret | None, placement: Placement) -> Placement:
    if secret is None:
        return placement
    return placement.model_copy(update={"signature": secret.mac(*_placement_parts(placement))})


def verify_placement(secret: ClusterSecret | None, placement: Placement) -> None:
    """ValueError unless a holder of the secret signed the placement as it is (nothing without a secret)."""
    if secret is not None and not secret.check(placement.signature, *_placement_parts(placement)):
        raise ValueError(f"placement of {placement.transfer_id!r} is not signed with the cluster secret; refused")


def _placement_parts(placement: Placement) -> tuple[str, ...]:
    return ("pd-placement", placement.model_copy(update={"signature": ""}).model_dump_json())


def verify_job(secret: ClusterSecret | None, job: PrefillJob) -> None:
    """ValueError unless a holder of the secret signed the job as it is (nothing without a secret)."""
    if secret is not None and not secret.check(job.signature, *_job_parts(job)):
        raise ValueError(f"prefill job {job.transfer_id!r} is not signed with the cluster secret; refused")


def hello_proof(secret: ClusterSecret | None, server_nonce: str, client_nonce: str) -> str:
    """KV handshake, prefill -> decode ("" without a secret)."""
    return "" if secret is None else secret.mac("kv-hello", server_nonce, client_nonce)


def welcome_proof(secret: ClusterSecret | None, server_nonce: str, client_nonce: str) -> str:
    """KV handshake, decode -> prefill ("" without a secret)."""
    return "" if secret is None else secret.mac("kv-welcome", server_nonce, client_nonce)


def check_proof(secret: ClusterSecret | None, proof: str, expected: str) -> bool:
    """Without a secret only an empty proof passes (a peer with one and a peer without disagree)."""
    if secret is None:
        return not proof
    return hmac.compare_digest(proof.encode(), expected.encode())
