"""A prompt's logprobs (`PromptLogprobs` per prompt token after the first) packed into bytes for the
prefill worker's hand-off record (`HandOffDone.prompt_logprobs`, disagg/handoff.py), and back on decode.

Lists of records are no wire.py field type, and a long prompt's JSON would be several times the
size, so the entries travel as one little-endian blob (base64 in the message's JSON):

    +-------+---------------+---------------------------+-------------------------------+------------+
    | k u32 | positions u32 | token ids i32 [pos, 1+k]  | logprobs f32 [pos, 1+k]       | rank i32   |
    |       |               | (prompt token, then top k)| (same order)                  | [pos]      |
    +-------+---------------+---------------------------+-------------------------------+------------+

NOTE: f32 loses nothing: the sampler computes every logprob in float32 (`sampler.prompt_logprobs`).
"""

from __future__ import annotations

import struct

import numpy as np

from pdserve.engine.logprobs import PromptLogprobs

_HEAD = struct.Struct("<II")
MAX_TOP = 20  # SamplingParams' bound on prompt_logprobs


def packed_bytes(num_positions: int, k: int) -> int:
    """Size of the blob for `num_positions` entries with `k` alternatives each."""
    return _HEAD.size + num_positions * ((1 + k) * 8 + 4)


def pack(entries: list[PromptLogprobs | None]) -> bytes:
    """Entries of prompt positions 1..P-1 (position 0's None is left out); each has the same
    number k of alternatives (the request's, as the sampler gives them)."""
    body = [e for e in entries[1:] if e is not None]
    k = len(body[0].top) if body else 0
    if len(body) != len(entries) - 1 or any(len(e.top) != k for e in body):
        raise ValueError("prompt logprobs to pack: one entry, with k alternatives, per position after the first")
    ids = np.array([[e.token_id, *(t for t, _ in e.top)] for e in body], dtype="<i4").reshape(len(body), 1 + k)
    logprobs = np.array([[e.logprob, *(lp for _, lp in e.top)] for e in body], dtype="<f4").reshape(len(body), 1 + k)
    ranks = np.array([e.rank for e in body], dtype="<i4")
    return _HEAD.pack(k, len(body)) + ids.tobytes() + logprobs.tobytes() + ranks.tobytes()


def unpack(data: bytes) -> list[PromptLogprobs | None]:
    """The entries of every prompt position (position 0: None); ValueError for a malformed blob."""
    if len(data) < _HEAD.size:
        raise ValueError("prompt logprobs: truncated")
    k, num_positions = _HEAD.unpack_from(data)
    if k > MAX_TOP or len(data) != packed_bytes(num_positions, k):
        raise ValueError(f"prompt logprobs: {len(data)} bytes do not hold {num_positions} positions of k={k}")
    width = 1 + k
    ids_end = _HEAD.size + num_positions * width * 4
    ids = np.frombuffer(data, dtype="<i4", count=num_positions * width, offset=_HEAD.size).reshape(-1, width)
    logprobs = np.frombuffer(data, dtype="<f4", count=num_positions * width, offset=ids_end).reshape(-1, width)
    ranks = np.frombuffer(data, dtype="<i4", count=num_positions, offset=ids_end + num_positions * width * 4)
    if np.isnan(logprobs).any():  # NOTE: -inf is a logprob (a token the model rules out)
        raise ValueError("prompt logprobs: NaN")
    out: list[PromptLogprobs | None] = [None]
    for row_ids, row_logprobs, rank in zip(ids.tolist(), logprobs.tolist(), ranks.tolist(), strict=True):
        out.append(PromptLogprobs(row_ids[0], row_logprobs[0], rank, tuple(zip(row_ids[1:], row_logprobs[1:],
                                                                                 strict=True))))
    return out
