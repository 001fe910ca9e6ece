"""What KV-cache events (`--kv-events-config`, ZMQ publisher) cost the engine's step, measured in one
run: two engines on the tiny demo model, one with events published over ZMQ (a subscriber drains
them), one without, each running the same 64 concurrent streams, alternated over several rounds; the
ratio of their mean step times is printed (1.00: free). Each round's prompts are fresh, and the pool
is small enough that blocks are evicted, so every step records stored and removed blocks.

    python -m pdserve.bench.kv_events_cost [--streams 64] [--rounds 4] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import statistics
import threading
from typing import Any

import torch

from pdserve import LLM
from pdserve.bench.common import hardware_line, print_table
from pdserve.engine.llm import TokensPrompt
from pdserve.engine.sampling_params import SamplingParams

_PROMPT_LEN = 40
_EVENTS = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}'


def _drain(endpoint: str, stop: threading.Event, counts: list[int]) -> None:
    """A subscriber reading every message (so the publisher's sends really go somewhere)."""
    import zmq

    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    while not stop.is_set():
        if sub.poll(100):
            sub.recv_multipart()
            counts[0] += 1
    context.destroy(linger=0)


def _round(llm: LLM, streams: int, max_tokens: int, seed: int) -> tuple[float, int]:
    """(mean step seconds, steps) of one round of `streams` concurrent requests."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(0, 150_000, (_PROMPT_LEN,), generator=gen).tolist())
               for _ in range(streams)]
    engine = llm.engine
    steps0, time0 = engine._num_steps, engine._step_time_s
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    steps = engine._num_steps - steps0
    return (engine._step_time_s - time0) / max(1, steps), steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # NOTE: a pool of ~1.2x what the streams hold at once: later rounds evict earlier rounds' blocks
    blocks = int(1.2 * args.streams * -(-(_PROMPT_LEN + args.max_tokens) // 16))
    common: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": blocks, "block_size": 16, "seed": 0}
    off, on = LLM(**common), LLM(kv_events_config=_EVENTS, **common)
    publisher = on.engine.kv_event_publisher
    assert publisher is not None and publisher.endpoints is not None and publisher.endpoints.publish is not None
    stop, counts = threading.Event(), [0]
    drain = threading.Thread(target=_drain, args=(publisher.endpoints.publish, stop, counts), daemon=True)
    drain.start()
    _round(off, args.streams, 8, seed=-1)  # warm-up
    _round(on, args.streams, 8, seed=-2)
    times: dict[str, list[float]] = {"off": [], "on": []}
    num_steps = 0
    for r in range(args.rounds):
        for name, llm in (("off", off), ("on", on)) if r % 2 == 0 else (("on", on), ("off", off)):
            mean_s, steps = _round(llm, args.streams, args.max_tokens, seed=r)
            times[name].append(mean_s)
            num_steps += steps
    stop.set()
    drain.join()
    stored = on.engine.scheduler.kv.pool.num_evictions
    off.engine.close()
    on.engine.close()
    print(f"hardware: {hardware_line()}")
    print(f"workload: tiny demo model, {args.streams} streams x ({_PROMPT_LEN} prompt + {args.max_tokens} generated) "
          f"tokens, block 16, {blocks} blocks ({stored} evictions with events on), {args.rounds} rounds alternated; "
          f"{counts[0]} event batches received")
    off_ms, on_ms = statistics.mean(times["off"]) * 1e3, statistics.mean(times["on"]) * 1e3
    print_table(["events", "mean step (ms)", "per round (ms)", "ratio"],
                [["off", f"{off_ms:.3f}", " ".join(f"{t * 1e3:.2f}" for t in times["off"]), "1.000"],
                 ["zmq", f"{on_ms:.3f}", " ".join(f"{t * 1e3:.2f}" for t in times["on"]), f"{on_ms / off_ms:.3f}"]])


if __name__ == "__main__":
    main()
