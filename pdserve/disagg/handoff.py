"""The hand-off record: what a prefill worker tells decode along with a request's KV, in one typed,
versioned record the KV transports carry as opaque bytes.

    prefill (prefill_service)                                       decode (decode_service)
    HandOffDone(first token, ...).encode() -> sender.send_done(rid, record, token=...)
                            transports: DONE {rid, n payloads, token, record bytes}
                                                   receiver -> KVDone(rid, record) -> HandOffDone.decode(record)

The transports (transport/*) move KV and request ids and check the reservation token; they never
read the record. A new application field touches this record, its producer and its consumer only.

Encoding: the record's JSON (wire.py: typed fields, bytes as base64, no pickle), with `version`.
Version rule: bump `HANDOFF_VERSION` with any change to the fields. A decoder takes every version up
to its own (a field an older producer did not know is absent and takes its default) and refuses a
newer one, or a malformed record, with `HandOffError` (a ValueError) naming what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pdserve.disagg import wire
from pdserve.disagg.phases import PrefillPhases
from pdserve.disagg.prompt_logprobs_wire import MAX_TOP, packed_bytes

# 1: first token, generator state, prefill phases (queue and compute seconds), cached tokens, prompt logprobs
# 2: the LoRA adapter the KV was computed under, and its weights' digest
HANDOFF_VERSION = 2

_FIXED_BYTES_BOUND = 64 << 10  # everything but the prompt logprobs (a CPU generator state is ~5 KB)


class HandOffError(ValueError):
    """A hand-off record this worker cannot take: malformed, or of a newer version."""


@dataclass(frozen=True, slots=True)
class HandOffDone:
    """Prefill's side of a finished prefill: its first token, its sampler's generator state (None:
    unseeded; decode samples on from it), how long the prompt waited for and took to compute on
    prefill (None: not measured; decode reports them in the TTFT phases), how many leading prompt
    tokens prefill found in its own prefix cache and, for a request that asked for them, the
    prompt's logprobs (packed: disagg/prompt_logprobs_wire.py), and the LoRA adapter the KV was
    computed under (None: the base model) with its weights' digest on prefill: decode refuses KV
    of another adapter, or of another version of it (engine/lora_manager.py)."""

    first_token_id: int
    generator_state: bytes | None = None
    prefill_phases: PrefillPhases | None = None
    prefill_cached_tokens: int = 0
    prompt_logprobs: bytes | None = None
    lora_name: str | None = None
    lora_digest: str = ""
    version: int = field(default=HANDOFF_VERSION, kw_only=True)

    def encode(self) -> bytes:
        return wire.dumps(self)

    @classmethod
    def decode(cls, data: bytes) -> HandOffDone:
        """The record of `data`; HandOffError when it is malformed or newer than this worker knows."""
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise HandOffError(f"hand-off record: not JSON ({e})") from e
        version = obj.get("version") if isinstance(obj, dict) else None
        if type(version) is not int or version < 1:
            raise HandOffError(f"hand-off record: no valid version (got {version!r})")
        if version > HANDOFF_VERSION:
            raise HandOffError(f"hand-off record version {version} is newer than this worker's "
                               f"({HANDOFF_VERSION}): the prefill worker runs a later pdserve")
        try:
            return wire.from_json_obj(cls, obj)
        except wire.WireFormatError as e:
            raise HandOffError(f"hand-off record version {version}: {e}") from e


def max_record_bytes(num_prompt_tokens: int) -> int:
    """An upper bound on the encoded record of a prompt of up to `num_prompt_tokens` tokens (its
    prompt logprobs dominate: base64 of their packed bytes)."""
    return _FIXED_BYTES_BOUND + 4 * -(-packed_bytes(num_prompt_tokens, MAX_TOP) // 3)
