"""The link between an API process and its engine core process (engine/core_client.py <->
engine/core_proc.py): two typed records, one per direction, as length-prefixed msgpack frames on a
private Unix socket pair. No pickle: a peer can only make the other build the records named here,
with fields of the checked types (a frame that does not decode is the peer's fault, and fatal).

    API process -> engine core   `ToCore`: start, an engine command (engine/commands.py: every
                                 field is data, encoded by its type), a call to the engine side of
                                 the worker's KV transport (`kv`), shutdown
    engine core -> API process   `FromCore`: one per loop turn that changed anything: every request's
                                 new token ids (`RequestDelta`), failures, command replies, stats;
                                 and the KV side's replies and events as they happen

The `kv` calls and events are lists the KV side encodes and checks itself (disagg/worker/core.py):
this layer only carries them.

Every frame starts with `WIRE_VERSION`; the two processes run the same code, so a mismatch is a bug
(refused), never negotiated.

    frame = u32 little-endian length | msgpack [version, field, field, ...]
"""

from __future__ import annotations

import dataclasses
import functools
import socket
import struct
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import msgpack

from pdserve.engine.commands import (
    Abort,
    AddLoRA,
    AddPrefillOnly,
    AddRequest,
    CachedPrefixTokens,
    Command,
    CompleteRemote,
    GeneratorState,
    ListLoRAs,
    PlaceKV,
    PrefillLocally,
    ReleaseKV,
    RemoveLoRA,
    ReserveRemote,
    StopSequence,
)
from pdserve.engine.disk_offload import TierStats
from pdserve.engine.kv_disk_tier import KVTierStats
from pdserve.engine.kv_transfer import KVTarget
from pdserve.engine.llm_engine import EngineStats, RemoteReservation
from pdserve.engine.logprobs import PromptLogprobs, TokenLogprobs
from pdserve.engine.output import RequestDelta, RequestOutput, RequestState, SequenceDelta, StepTokens
from pdserve.engine.sampling_params import SamplingParams

WIRE_VERSION = 3
_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30
ToCoreKind = Literal["start", "command", "kv", "shutdown"]
_KINDS = frozenset(get_args(ToCoreKind))
# every command that crosses, by its class name
COMMANDS: dict[str, type[Command[Any]]] = {cls.__name__: cls for cls in (
    AddRequest, AddPrefillOnly, ReserveRemote, CompleteRemote, PrefillLocally, PlaceKV, ReleaseKV, Abort,
    CachedPrefixTokens, GeneratorState, StopSequence, AddLoRA, RemoveLoRA, ListLoRAs)}


class CoreWireError(ValueError):
    """A frame from the other process that does not decode into its record."""


@dataclass(frozen=True, slots=True)
class ToCore:
    """API process -> engine core. `call_id` > 0: the sender awaits a `CoreReply`."""

    kind: ToCoreKind
    call_id: int = 0
    command: Command[Any] | None = None  # command
    kv: list[Any] | None = None  # kv: [method, *args], for the worker's KV side to check and run
    engine_args: dict[str, Any] | None = None  # start: EngineArgs' fields
    worker: dict[str, Any] | None = None  # start: the KV side to build beside the engine (None: colocated)
    log_level: str = "INFO"  # start: the API process's logging
    log_format: str = "text"


@dataclass(frozen=True, slots=True)
class CoreReply:
    call_id: int
    value: Any = None  # the command's result (`reply_value`) or the KV call's, msgpack-encodable
    error: str | None = None  # the call raised: its message
    error_kind: str = ""  # ... "value" (the caller's fault: a 400), "runtime", or the KV side's names
    error_detail: list[str] = field(default_factory=list)  # ... what that kind carries besides the message


@dataclass(frozen=True, slots=True)
class FromCore:
    """Engine core -> API process: everything one turn of its loop produced (at most one per step),
    or what the KV side has to say (replies to `kv` calls, `kv_events`) as soon as it happens."""

    outputs: list[RequestDelta] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (request id, error): ended alone
    replies: list[CoreReply] = field(default_factory=list)
    stats: EngineStats | None = None  # at most every few ms, and whenever the engine goes idle
    fatal: str | None = None  # the engine died (or could not start): the last message
    ready: bool = False  # the first message: the engine is built
    info: dict[str, Any] | None = None  # the first message: what the KV side tells its API process
    kv_events: list[list[Any]] = field(default_factory=list)  # the KV side's, in order
    kv_stats: dict[str, int] | None = None  # the KV side's counters, with `stats`
    alone: StepTokens = field(default_factory=StepTokens)  # the step's one-token deltas, short (after `outputs`)


# -- encoding ----------------------------------------------------------------------------------

def _params(params: SamplingParams) -> dict[str, Any]:
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    if params.structured is not None:  # NOTE: a [kind, text] pair; SamplingParams rebuilds the spec from it
        fields["structured"] = [params.structured.kind, params.structured.text]
    return fields


def encode_to_core(message: ToCore) -> bytes:
    return _frame([WIRE_VERSION, message.kind, message.call_id,
                   None if message.command is None else encode_command(message.command), message.kv,
                   message.engine_args, message.worker, message.log_level, message.log_format])


def encode_command(command: Command[Any]) -> list[Any]:
    names = [name for name, _ in _command_fields(type(command))]
    return [type(command).__name__, *(_encode(getattr(command, name)) for name in names)]


def _encode(value: Any) -> Any:
    if isinstance(value, SamplingParams):
        return _params(value)
    if isinstance(value, KVTarget):
        return [list(value.block_ids), value.num_cached_tokens, value.sender, value.kv_address, value.token]
    if isinstance(value, PromptLogprobs):
        return _prompt_logprobs(value)
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    return value


def reply_value(result: object) -> Any:
    """A command's result as its reply carries it (an output it emitted travels as a delta)."""
    if isinstance(result, RemoteReservation):
        return [list(result.block_ids), result.num_cached_tokens]
    if isinstance(result, RequestOutput | RequestState):  # NOTE: a CompleteRemote's state goes out as a delta
        return None
    return result


def result_of(command: Command[Any], value: Any) -> Any:
    """A command's result from its reply's value: `reply_value`'s inverse (the API process's side)."""
    if isinstance(command, ReserveRemote):
        if value is None:
            return None
        block_ids, num_cached = value
        return RemoteReservation(tuple(block_ids), int(num_cached))
    if isinstance(command, CachedPrefixTokens):
        return int(value)
    if isinstance(command, PlaceKV):
        return bool(value)
    if isinstance(command, GeneratorState):
        return None if value is None else bytes(value)
    if isinstance(command, AddLoRA | ListLoRAs):  # LoRAInfo records as dicts
        return value
    return None


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
                   [[r.call_id, r.value, r.error, r.error_kind, r.error_detail] for r in message.replies], stats,
                   message.fatal, message.ready, message.info, message.kv_events, message.kv_stats,
                   [message.alone.request_ids, message.alone.token_ids]])


def _frame(fields: list[Any]) -> bytes:
    body = msgpack.packb(fields, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


# -- decoding ----------------------------------------------------------------------------------

def typed(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    """`value` if it is a `kind` (a bool is no int or float here), else CoreWireError naming `what`."""
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float)):
        raise CoreWireError(f"{what}: {type(value).__name__} where {kind} was expected")
    return value


def _opt(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    return None if value is None else typed(value, kind, what)


def _ints(value: Any, what: str) -> list[int]:
    typed(value, list, what)
    for v in value:
        typed(v, int, what)
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
    fields = _fields(data, 9, "ToCore")
    _, kind, call_id, command, kv, engine_args, worker, level, log_format = fields
    if kind not in _KINDS:
        raise CoreWireError(f"ToCore: unknown kind {kind!r}")
    return ToCore(kind, typed(call_id, int, "ToCore.call_id"), None if command is None else decode_command(command),
                  _opt(kv, list, "ToCore.kv"), _opt(engine_args, dict, "ToCore.engine_args"),
                  _opt(worker, dict, "ToCore.worker"), typed(level, str, "ToCore.log_level"),
                  typed(log_format, str, "ToCore.log_format"))


def decode_command(value: Any) -> Command[Any]:
    name, *values = typed(value, list, "command")
    cls = COMMANDS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CoreWireError(f"command: unknown {name!r}")
    fields = _command_fields(cls)
    if len(values) != len(fields):
        raise CoreWireError(f"{name}: expected {len(fields)} fields, got {len(values)}")
    try:
        return cls(*(_decode(hint, v, f"{name}.{f}") for (f, hint), v in zip(fields, values, strict=True)))
    except (TypeError, ValueError) as exc:
        raise CoreWireError(f"{name}: {exc}") from exc


@functools.cache
def _command_fields(cls: type[Command[Any]]) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]  # type: ignore[arg-type]


def _decode(hint: Any, value: Any, what: str) -> Any:
    """`value` as a field annotated `hint` (the types commands use; anything else is refused)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        [inner] = [a for a in args if a is not type(None)]
        return _decode(inner, value, what)
    if origin is list:
        return [_decode(args[0], v, what) for v in typed(value, list, what)]
    if origin is tuple:
        return tuple(_decode(args[0], v, what) for v in typed(value, list, what))
    if hint is SamplingParams:
        return SamplingParams(**typed(value, dict, what))
    if hint is KVTarget:
        blocks, cached, sender, address, token = typed(value, list, what)
        return KVTarget(tuple(_ints(blocks, what)), typed(cached, int, what), typed(sender, int, what),
                        typed(address, str, what), typed(token, str, what))
    if hint is PromptLogprobs:
        return _decode_prompt_logprobs(value)
    if hint in (str, int, bool, bytes):
        return typed(value, hint, what)
    if hint is float:
        return float(typed(value, (int, float), what))
    raise CoreWireError(f"{what}: a field of type {hint} does not cross the link")


def _top(value: Any) -> tuple[tuple[int, float], ...]:
    return tuple((typed(t, int, "top id"), float(typed(lp, (int, float), "top logprob")))
                 for t, lp in typed(value, list, "top"))


def _decode_token_logprobs(value: Any) -> TokenLogprobs:
    token_id, logprob, top = typed(value, list, "logprobs")
    return TokenLogprobs(typed(token_id, int, "logprobs id"), float(typed(logprob, (int, float), "logprob")), _top(top))


def _decode_prompt_logprobs(value: Any) -> PromptLogprobs | None:
    if value is None:
        return None
    token_id, logprob, rank, top = typed(value, list, "prompt logprobs")
    return PromptLogprobs(typed(token_id, int, "prompt id"), float(typed(logprob, (int, float), "logprob")),
                          typed(rank, int, "rank"), _top(top))


def _decode_delta(value: Any) -> RequestDelta:
    request_id, sequences, num_cached, scheduled, prompt_logprobs = typed(value, list, "RequestDelta")
    seqs = []
    for seq in typed(sequences, list, "RequestDelta.sequences"):
        index, token_ids, logprobs, finish_reason, stop_reason = typed(seq, list, "SequenceDelta")
        seqs.append(SequenceDelta(typed(index, int, "index"), _ints(token_ids, "token_ids"),
                                  None if logprobs is None else [_decode_token_logprobs(x) for x in
                                                                 typed(logprobs, list, "logprobs")],
                                  _opt(finish_reason, str, "finish_reason"),
                                  _opt(stop_reason, (int, str), "stop_reason")))
    return RequestDelta(typed(request_id, str, "request_id"), seqs, typed(num_cached, int, "num_cached_tokens"),
                        _opt(scheduled, float, "first_scheduled_time"),
                        None if prompt_logprobs is None else [_decode_prompt_logprobs(x) for x in
                                                              typed(prompt_logprobs, list, "prompt_logprobs")])


def _decode_stats(value: dict[str, Any]) -> EngineStats:
    try:
        tier = value.get("kv_tier")
        if tier is not None:
            disk = dict(tier["disk"], load_latency_counts=tuple(tier["disk"]["load_latency_counts"]))
            value = dict(value, kv_tier=TierStats(KVTierStats(**disk), tier["num_pool_hit_blocks"]))
        for name in ("running_lora_adapters", "waiting_lora_adapters"):  # NOTE: msgpack makes tuples lists
            if name in value:
                value = dict(value, **{name: tuple(value[name])})
        return EngineStats(**value)
    except (TypeError, KeyError) as exc:
        raise CoreWireError(f"FromCore.stats: {exc}") from exc


def decode_from_core(data: bytes) -> FromCore:
    _, outputs, failures, replies, stats, fatal, ready, info, kv_events, kv_stats, alone = _fields(data, 11, "FromCore")
    return FromCore(
        [_decode_delta(d) for d in typed(outputs, list, "FromCore.outputs")],
        [(typed(r, str, "failure id"), typed(e, str, "failure"))
         for r, e in typed(failures, list, "FromCore.failures")],
        [CoreReply(typed(c, int, "call_id"), v, _opt(e, str, "error"), typed(k, str, "error_kind"),
                   [typed(d, str, "error_detail") for d in typed(detail, list, "error_detail")])
         for c, v, e, k, detail in typed(replies, list, "FromCore.replies")],
        None if stats is None else _decode_stats(typed(stats, dict, "FromCore.stats")),
        _opt(fatal, str, "FromCore.fatal"), typed(ready, bool, "FromCore.ready"), _opt(info, dict, "FromCore.info"),
        [typed(e, list, "FromCore.kv_events") for e in typed(kv_events, list, "FromCore.kv_events")],
        _opt(kv_stats, dict, "FromCore.kv_stats"), _decode_alone(alone))


def _decode_alone(value: Any) -> StepTokens:
    if len(typed(value, list, "FromCore.alone")) != 2:
        raise CoreWireError("FromCore.alone: expected [request ids, token ids]")
    request_ids, token_ids = value
    ids = [typed(r, str, "alone request id") for r in typed(request_ids, list, "FromCore.alone")]
    tokens = _ints(token_ids, "alone token_ids")
    if len(ids) != len(tokens):
        raise CoreWireError(f"FromCore.alone: {len(ids)} request ids for {len(tokens)} tokens")
    return StepTokens(ids, tokens)


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
