"""KVStreamer: which blocks of which layer go out when (the prefill side of the layer-wise hand-off)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.disagg.worker.kv_streamer import SMALL_STEP_KV_BYTES, KVStreamer, small_step_blocks

BLOCK = 4
LAYERS = 3


def _chunk(rid: str, computed: int, new: int, num_blocks: int) -> Any:
    request = SimpleNamespace(request_id=rid, num_computed_tokens=computed,
                              block_ids=list(range(100, 100 + num_blocks)))
    return SimpleNamespace(request=request, num_new_tokens=new)


def _step(streamer: KVStreamer, chunks: list[Any], sent: list[tuple]) -> list[int]:
    """Runs a step's layers; returns how many sends had gone out when each layer's callback returned."""
    seen = []
    for layer in range(LAYERS):
        streamer(layer, chunks)
        seen.append(len(sent))
    return seen


def test_a_small_step_sends_every_layer_after_the_last_one_in_order() -> None:
    sent: list[tuple] = []
    streamer = KVStreamer(BLOCK, LAYERS, lambda *a: sent.append(a), small_blocks=2)
    streamer.expect("small", [7, 8], 0)
    streamer.expect("big", [1, 2, 3], 0)
    # NOTE: "small" (5 tokens: 2 blocks) is held; "big" (9 tokens: 3 blocks) goes layer by layer
    seen = _step(streamer, [_chunk("small", 0, 5, 2), _chunk("big", 0, 9, 3)], sent)
    assert seen == [1, 2, 3 + LAYERS]
    small = [s for s in sent if s[0] == "small"]
    assert [s[1] for s in small] == list(range(LAYERS))
    assert all(s[2:4] == ([100, 101], [7, 8]) for s in small)
    assert [s[1] for s in sent if s[0] == "big"] == list(range(LAYERS))
    # the next chunk re-sends the half-full block, completed, and is held again
    sent.clear()
    assert _step(streamer, [_chunk("small", 5, 2, 2)], sent) == [0, 0, LAYERS]
    assert all(s[2:4] == ([101], [8]) for s in sent)


def test_layer_by_layer_without_small_blocks_and_nothing_held_across_steps() -> None:
    sent: list[tuple] = []
    streamer = KVStreamer(BLOCK, LAYERS, lambda *a: sent.append(a))
    streamer.expect("r", [5], 0)
    assert _step(streamer, [_chunk("r", 0, 3, 1)], sent) == [1, 2, 3]
    held = KVStreamer(BLOCK, LAYERS, lambda *a: sent.append(a), small_blocks=4)
    held.expect("a", [5], 0)
    held(0, [_chunk("a", 0, 3, 1)])
    held.forget("a")  # NOTE: between steps only, in the engine; here mid-step, to check nothing leaks on
    held(LAYERS - 1, [_chunk("a", 0, 3, 1)])
    assert not held._held


def test_the_threshold_follows_the_kv_bytes_of_a_block() -> None:
    assert small_step_blocks(SMALL_STEP_KV_BYTES // 8, 2) == 4
    assert small_step_blocks(SMALL_STEP_KV_BYTES, 28) == 0  # a real model's block: layer by layer


def test_a_refused_destination_leaves_no_target() -> None:
    sent: list[tuple] = []
    streamer = KVStreamer(BLOCK, LAYERS, lambda *a: sent.append(a))
    with pytest.raises(ValueError, match="whole blocks"):
        streamer.expect("r", [5], BLOCK + 1)
    assert "r" not in streamer._targets
    assert _step(streamer, [_chunk("r", 0, 3, 1)], sent) == [0, 0, 0]
    streamer.expect("u", None)  # not placed yet: nothing goes out until `place`
    assert _step(streamer, [_chunk("u", 0, 3, 1)], sent) == [0, 0, 0]
    assert streamer.place("u", [9], 0, request=_chunk("u", 3, 0, 1).request)
    assert [(s[0], s[1], s[2], s[3]) for s in sent] == [("u", layer, [100], [9]) for layer in range(LAYERS)]
    assert not streamer.place("gone", [9], 0)
