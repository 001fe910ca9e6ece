"""The link between an API process and its engine core process (engine/core_client.py <->
engine/core_proc.py): two typed records, one per direction, as length-prefixed msgpack frames on a
private Unix socket pair. No pickle: a peer can only make the other build the records named here,
with fields of the checked types (a frame that does not decode is the peer's fault, and fatal).

    API process -> engine core   `ToCore`: start, add, abort, stop_sequence, cached_prefix, shutdown
    engine core -> API process   `FromCore`: one per loop turn that changed anything: every request's
                                 new token ids (`RequestDelta`), failures, command replies, stats

Every frame starts with `WIRE_VERSION`; the two processes run the same code, so a mismatch is a bug
(refused), never negotiated.

    frame = u32 little-endian length | msgpack [version, field, field, ...]
"""

from __future__ import annotations

import dataclasses
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import msgpack

from pdserve.engine.disk_offload import TierStats
from pdserve.engine.kv_disk_tier import KVTierStats
from pdserve.engine.llm_engine import EngineStats
from pdserve.engine.sampler import PromptLogprobs, TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams

WIRE_VERSION = 1
_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30
ToCoreKind = Literal["start", "add", "abort", "stop_sequence", "cached_prefix", "shutdown"]
_KINDS = frozenset(get_args(ToCoreKind))


class CoreWireError(ValueError):
    """A frame from the other process that does not decode into its record."""


@dataclass(frozen=True, slots=True)
class ToCore:
    """API process -> engine core: one command. `call_id` > 0: the sender awaits a `CoreReply`."""

    kind: ToCoreKind
    call_id: int = 0
    request_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    params: SamplingParams | None = None  # add
    index: int = 0  # stop_sequence: which of the request's n sequences
    stop: str = ""  # stop_sequence: the stop string the API process found
    engine_args: dict[str, Any] | None = None  # start: EngineArgs' fields
    log_level: str = "INFO"  # start: the API process's logging
    log_format: str = "text"


@dataclass(frozen=True, slots=True)
class SequenceDelta:
    """What one sequence of a request gained since the last `FromCore` that carried it."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None  # one per new token, when the request asked for them
    finish_reason: str | None  # set once, with the message that ends the sequence
    stop_reason: int | str | None


@dataclass(frozen=True, slots=True)
class RequestDelta:
    request_id: str
    sequences: list[SequenceDelta]
    num_cached_tokens: int
    first_scheduled_time: float | None  # time.monotonic() in the engine process (the same clock)
    prompt_logprobs: list[PromptLogprobs | None] | None  # once, complete


@dataclass(frozen=True, slots=True)
class CoreReply:
    call_id: int
    value: int | None = None  # cached_prefix: the number of tokens
    error: str | None = None  # the command raised: its message
    error_is_value: bool = False  # ... a ValueError (the caller's fault: a 400)


@dataclass(frozen=True, slots=True)
class FromCore:
    """Engine core -> API process: everything one turn of its loop produced (at most one per step)."""

    outputs: list[RequestDelta] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (request id, error): ended alone
    replies: list[CoreReply] = field(default_factory=list)
    stats: EngineStats | None = None  # at most every few ms, and whenever the engine goes idle
    fatal: str | None = None  # the engine died (or could not start): the last message
    ready: bool = False  # the first message: the engine is built


# -- encoding ----------------------------------------------------------------------------------

def _params(params: SamplingParams) -> dict[str, Any]:
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    if params.structured is not None:  # NOTE: a [kind, text] pair; SamplingParams rebuilds the spec from it
        fields["structured"] = [params.structured.kind, params.structured.text]
    return fields


def encode_to_core(message: ToCore) -> bytes:
    return _frame([WIRE_VERSION, message.kind, message.call_id, message.request_id, message.prompt_token_ids,
                   None if message.params is None else _params(message.params), message.index, message.stop,
                   message.engine_args, message.log_level, message.log_format])


def _token_logprobs(lp: TokenLogprobs) -> list[Any]:
    return [lp.token_id, lp.logprob, [list(t) for t in lp.top]]


def _prompt_logprobs(lp: PromptLogprobs | None) -> list[Any] | None:
    return None if lp is None else [lp.token_id, lp.logprob, lp.rank, [list(t) for t in lp.top]]


def _delta(d: RequestDelta) -> list[Any]:
    sequences = [[s.index, s.token_ids, None if s.logprobs is None else [_token_logprobs(x) for x in s.logprobs],
                  s.finish_reason, s.stop_reason] for s in d.sequences]
    return [d.request_id, sequences,
            d.num_cached_tokens, d.first_scheduled_time,
            None if d.prompt_logprobs is None else [_prompt_logprobs(x) for x in d.prompt_logprobs]]


def encode_from_core(message: FromCore) -> bytes:
    stats = None if message.stats is None else dataclasses.asdict(message.stats)
    return _frame([WIRE_VERSION, [_delta(d) for d in message.outputs], [list(f) for f in message.failures],
                   [[r.call_id, r.value, r.error, r.error_is_value] for r in message.replies], stats,
                   message.fatal, message.ready])


def _frame(fields: list[Any]) -> bytes:
    body = msgpack.packb(fields, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


# -- decoding ----------------------------------------------------------------------------------

def _is(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float)):
        raise CoreWireError(f"{what}: {type(value).__name__} where {kind} was expected")
    return value


def _opt(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    return None if value is None else _is(value, kind, what)


def _ints(value: Any, what: str) -> list[int]:
    _is(value, list, what)
    for v in value:
        _is(v, int, what)
    return value


def _fields(data: bytes, count: int, what: str) -> list[Any]:
    try:
        fields = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for malformed input
        raise CoreWireError(f"{what}: not msgpack ({exc})") from exc
    if not isinstance(fields, list) or len(fields) != count:
        raise CoreWireError(f"{what}: expected {count} fields")
    if fields[0] != WIRE_VERSION:
        raise CoreWireError(f"{what}: wire version {fields[0]!r}, this process speaks {WIRE_VERSION}")
    return fields


def decode_to_core(data: bytes) -> ToCore:
    fields = _fields(data, 11, "ToCore")
    _, kind, call_id, request_id, prompt, params, index, stop, engine_args, level, log_format = fields
    if kind not in _KINDS:
        raise CoreWireError(f"ToCore: unknown kind {kind!r}")
    try:
        sampling = None if params is None else SamplingParams(**_is(params, dict, "ToCore.params"))
    except (TypeError, ValueError) as exc:
        raise CoreWireError(f"ToCore.params: {exc}") from exc
    return ToCore(kind, _is(call_id, int, "ToCore.call_id"), _is(request_id, str, "ToCore.request_id"),
                  _ints(prompt, "ToCore.prompt_token_ids"), sampling, _is(index, int, "ToCore.index"),
                  _is(stop, str, "ToCore.stop"), _opt(engine_args, dict, "ToCore.engine_args"),
                  _is(level, str, "ToCore.log_level"), _is(log_format, str, "ToCore.log_format"))


def _top(value: Any) -> tuple[tuple[int, float], ...]:
    return tuple((_is(t, int, "top id"), float(_is(lp, (int, float), "top logprob")))
                 for t, lp in _is(value, list, "top"))


def _decode_token_logprobs(value: Any) -> TokenLogprobs:
    token_id, logprob, top = _is(value, list, "logprobs")
    return TokenLogprobs(_is(token_id, int, "logprobs id"), float(_is(logprob, (int, float), "logprob")), _top(top))


def _decode_prompt_logprobs(value: Any) -> PromptLogprobs | None:
    if value is None:
        return None
    token_id, logprob, rank, top = _is(value, list, "prompt logprobs")
    return PromptLogprobs(_is(token_id, int, "prompt id"), float(_is(logprob, (int, float), "logprob")),
                          _is(rank, int, "rank"), _top(top))


def _decode_delta(value: Any) -> RequestDelta:
    request_id, sequences, num_cached, scheduled, prompt_logprobs = _is(value, list, "RequestDelta")
    seqs = []
    for seq in _is(sequences, list, "RequestDelta.sequences"):
        index, token_ids, logprobs, finish_reason, stop_reason = _is(seq, list, "SequenceDelta")
        seqs.append(SequenceDelta(_is(index, int, "index"), _ints(token_ids, "token_ids"),
                                  None if logprobs is None else [_decode_token_logprobs(x) for x in
                                                                 _is(logprobs, list, "logprobs")],
                                  _opt(finish_reason, str, "finish_reason"),
                                  _opt(stop_reason, (int, str), "stop_reason")))
    return RequestDelta(_is(request_id, str, "request_id"), seqs, _is(num_cached, int, "num_cached_tokens"),
                        _opt(scheduled, float, "first_scheduled_time"),
                        None if prompt_logprobs is None else [_decode_prompt_logprobs(x) for x in
                                                              _is(prompt_logprobs, list, "prompt_logprobs")])


def _decode_stats(value: dict[str, Any]) -> EngineStats:
    try:
        tier = value.get("kv_tier")
        if tier is not None:
            disk = dict(tier["disk"], load_latency_counts=tuple(tier["disk"]["load_latency_counts"]))
            value = dict(value, kv_tier=TierStats(KVTierStats(**disk), tier["num_pool_hit_blocks"]))
        return EngineStats(**value)
    except (TypeError, KeyError) as exc:
        raise CoreWireError(f"FromCore.stats: {exc}") from exc


def decode_from_core(data: bytes) -> FromCore:
    _, outputs, failures, replies, stats, fatal, ready = _fields(data, 7, "FromCore")
    return FromCore(
        [_decode_delta(d) for d in _is(outputs, list, "FromCore.outputs")],
        [(_is(r, str, "failure id"), _is(e, str, "failure")) for r, e in _is(failures, list, "FromCore.failures")],
        [CoreReply(_is(c, int, "call_id"), _opt(v, int, "value"), _opt(e, str, "error"), _is(b, bool, "error_is_value"))
         for c, v, e, b in _is(replies, list, "FromCore.replies")],
        None if stats is None else _decode_stats(_is(stats, dict, "FromCore.stats")),
        _opt(fatal, str, "FromCore.fatal"), _is(ready, bool, "FromCore.ready"))


# -- framing -----------------------------------------------------------------------------------

class FrameReader:
    """Reassembles frames from a stream socket's bytes (`feed`), in order."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[bytes]:
        self._buffer += data
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if length > MAX_FRAME_BYTES:
                raise CoreWireError(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
            end = _LENGTH.size + length
            if len(self._buffer) < end:
                return
            frame = bytes(self._buffer[_LENGTH.size:end])
            del self._buffer[:end]
            yield frame


LINK_BUFFER_BYTES = 8 << 20  # a burst of large prompts or of outputs waits in the socket, not in a sender


def link_buffers(sock: socket.socket) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, LINK_BUFFER_BYTES)


def recv_frames(sock: socket.socket, reader: FrameReader, size: int = 1 << 20) -> list[bytes] | None:
    """The frames completed by one `recv` (which may block); None when the peer closed the link."""
    data = sock.recv(size)
    if not data:
        return None
    return list(reader.feed(data))
