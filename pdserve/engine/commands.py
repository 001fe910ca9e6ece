"""What the event loop asks of the engine thread (`AsyncLLM.send`): one message per operation.

Each command is applied on the engine thread, between two steps, by one named `LLMEngine` method,
and its result comes back to the caller typed: `await llm.send(ReserveRemote(...))` is a
`RemoteReservation | None`. A command also says what it does to the output streams:

    stream_of(result)  the request whose outputs go to the caller's stream from now on
    closes()           the request whose stream ends here (nothing more is delivered to it)
    emitted(result)    an output the command produced, delivered like a step's outputs

Every field is data, so a command crosses the engine-core link as it is (engine/core_wire.py). What
a command must do to a worker's KV transport at a fixed point (tell the streamer where a request's
KV goes, have the receiver expect a transfer) goes through the hooks the transport set on the
engine (engine/kv_transfer.py), on the side where the engine runs.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Generic, TypeVar

from pdserve.engine.kv_transfer import KVTarget
from pdserve.engine.llm_engine import LLMEngine, RemoteReservation
from pdserve.engine.logprobs import PromptLogprobs
from pdserve.engine.output import RequestOutput, RequestState
from pdserve.engine.sampling_params import SamplingParams

R = TypeVar("R")


class Command(abc.ABC, Generic[R]):
    """Contract: `apply` runs on the engine thread only, between steps; an exception it raises
    goes to the caller and the engine carries on. The other methods are pure."""

    __slots__ = ()

    @abc.abstractmethod
    def apply(self, engine: LLMEngine) -> R: ...

    def stream_of(self, result: R) -> str | None:
        return None

    def closes(self) -> str | None:
        return None

    def emitted(self, result: R) -> RequestOutput | None:
        return None


@dataclass(frozen=True, slots=True)
class AddRequest(Command[None]):
    """Start a request (colocated serving); its outputs go to the caller's stream."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams

    def apply(self, engine: LLMEngine) -> None:
        engine.add_request(self.request_id, self.prompt_token_ids, self.params)

    def stream_of(self, result: None) -> str | None:
        return self.request_id


@dataclass(frozen=True, slots=True)
class AddPrefillOnly(Command[None]):
    """Prefill role: compute the prompt, sample the first token, finish, and keep the blocks until
    `ReleaseKV`. Its KV goes to `target` (None: not placed yet, `PlaceKV` says where). The outputs
    go to the caller's stream."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    target: KVTarget | None = None

    def apply(self, engine: LLMEngine) -> None:
        targets = engine.stream_targets
        # NOTE: the streamer learns the target before the request exists, so no step can compute a
        # layer of it that would not be streamed; a refused request leaves nothing behind there.
        if targets is not None:
            targets.expect(self.request_id, self.target)
        try:
            engine.add_request(self.request_id, self.prompt_token_ids, self.params, prefill_only=True)
        except BaseException:
            if targets is not None:
                targets.forget(self.request_id)
            raise

    def stream_of(self, result: None) -> str | None:
        return self.request_id


@dataclass(frozen=True, slots=True)
class ReserveRemote(Command[RemoteReservation | None]):
    """Decode role: reserve blocks for a prompt a prefill worker computes; None when the pool has
    no room now. With a `transfer_id`, the KV receiver expects that attempt's KV (presenting
    `token`) from the moment the blocks are reserved. Once reserved, the request's outputs go to
    the caller's stream."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    transfer_id: str = ""
    token: str = ""

    def apply(self, engine: LLMEngine) -> RemoteReservation | None:
        reservation = engine.reserve_remote(self.request_id, self.prompt_token_ids, self.params)
        if reservation is not None and self.transfer_id and engine.expectations is not None:
            # NOTE: before the caller learns of the reservation, so before prefill can possibly send a byte
            engine.expectations.expect(self.transfer_id, list(reservation.block_ids), self.token)
        return reservation

    def stream_of(self, result: RemoteReservation | None) -> str | None:
        return None if result is None else self.request_id


@dataclass(frozen=True, slots=True)
class CompleteRemote(Command[RequestState | None]):
    """Decode role: the prompt's KV is in the reserved blocks; the output with prefill's first
    token goes out at once (none when the engine samples the first tokens itself: n > 1, logprobs)."""

    request_id: str
    first_token_id: int
    generator_state: bytes | None = None
    prefill_cached_tokens: int = 0  # prompt tokens prefill found in its own prefix cache
    prompt_logprobs: list[PromptLogprobs | None] | None = None  # computed by prefill, when asked for
    lora_name: str | None = None  # the LoRA adapter prefill computed the KV under ...
    lora_digest: str = ""  # ... and its weights' digest there (engine/lora_manager.py)

    def apply(self, engine: LLMEngine) -> RequestState | None:
        return engine.complete_remote(self.request_id, self.first_token_id, self.generator_state,
                                      self.prefill_cached_tokens, self.prompt_logprobs,
                                      (self.lora_name, self.lora_digest))

    def emitted(self, result: RequestState | None) -> RequestOutput | None:
        return None if result is None else result.snapshot()


@dataclass(frozen=True, slots=True)
class PrefillLocally(Command[None]):
    """Decode role: the KV will not come (or is not worth sending): compute the prompt here."""

    request_id: str

    def apply(self, engine: LLMEngine) -> None:
        engine.prefill_locally(self.request_id)


@dataclass(frozen=True, slots=True)
class PlaceKV(Command[bool]):
    """Prefill role: the request's KV destination is known now (False: the request is gone, or
    not expected). Between steps, so what is sent of the layers computed so far and what the next
    step streams never overlap."""

    request_id: str
    target: KVTarget

    def apply(self, engine: LLMEngine) -> bool:
        if engine.stream_targets is None:
            raise ValueError("this engine streams no KV (not a prefill worker)")
        return engine.stream_targets.place(self.request_id, self.target, engine.prefill_request(self.request_id))


@dataclass(frozen=True, slots=True)
class ReleaseKV(Command[None]):
    """Prefill role: the hand-off ended; stop the request if it still runs and free its blocks."""

    request_id: str

    def apply(self, engine: LLMEngine) -> None:
        engine.release_kv(self.request_id)
        # NOTE: after the release, so the layer observer never meets a request it has forgotten.
        if engine.stream_targets is not None:
            engine.stream_targets.forget(self.request_id)

    def closes(self) -> str | None:
        return self.request_id


@dataclass(frozen=True, slots=True)
class Abort(Command[RequestOutput | None]):
    """End a request wherever it is and free its blocks; its last snapshot reaches the output
    listener (metrics), not the stream, which closes."""

    request_id: str

    def apply(self, engine: LLMEngine) -> RequestOutput | None:
        return engine.abort_request(self.request_id)

    def closes(self) -> str | None:
        return self.request_id

    def emitted(self, result: RequestOutput | None) -> RequestOutput | None:
        return result


@dataclass(frozen=True, slots=True)
class CachedPrefixTokens(Command[int]):
    """How many leading tokens of this prompt the prefix cache holds now."""

    prompt_token_ids: list[int]

    def apply(self, engine: LLMEngine) -> int:
        return engine.num_cached_prefix_tokens(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class GeneratorState(Command[bytes | None]):
    """Prefill role: the seeded generator's state after a finished request's first token."""

    request_id: str

    def apply(self, engine: LLMEngine) -> bytes | None:
        return engine.generator_state(self.request_id)


@dataclass(frozen=True, slots=True)
class StopSequence(Command[None]):
    """A stop string ended sequence `index` of the request where its text is made (the API process
    of an engine core): finish it there too."""

    request_id: str
    index: int
    stop: str

    def apply(self, engine: LLMEngine) -> None:
        engine.stop_sequence(self.request_id, self.index, self.stop)


@dataclass(frozen=True, slots=True)
class AddLoRA(Command[dict[str, object]]):
    """Load and register LoRA adapter `name` from `path` (all or nothing; a bad adapter raises a
    ValueError naming it). The result is its `LoRAInfo` as a dict (it crosses the engine-core link)."""

    name: str
    path: str

    def apply(self, engine: LLMEngine) -> dict[str, object]:
        return dataclasses.asdict(engine.add_lora(self.name, self.path))


@dataclass(frozen=True, slots=True)
class RemoveLoRA(Command[None]):
    """Unregister LoRA adapter `name` (ValueError: not loaded, or in use by a request)."""

    name: str

    def apply(self, engine: LLMEngine) -> None:
        engine.remove_lora(self.name)


@dataclass(frozen=True, slots=True)
class ListLoRAs(Command[list[dict[str, object]]]):
    """The registered LoRA adapters, each its `LoRAInfo` as a dict."""

    def apply(self, engine: LLMEngine) -> list[dict[str, object]]:
        return [dataclasses.asdict(info) for info in engine.list_loras()]
