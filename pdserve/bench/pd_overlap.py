"""How much KV transfer time layer-wise streaming hides behind prefill compute.

    python -m pdserve.bench.pd_overlap [--prompt-len 4096] [--transport tcp|nixl]

One process, two engines (prefill and decode) on the random `small` preset, a real transport
between their pools (its I/O runs on its own thread). For a prompt of `--prompt-len` tokens:
- compute: prefill alone, no transfer;
- transfer: the finished prompt's KV sent afterwards, all layers, until decode acknowledged it;
- streamed: prefill with each layer sent as soon as it is computed (chunk by chunk); what is
  left to wait for once compute ends is the exposed part of the transfer.
hidden = 1 - exposed / transfer: the share of the transfer that streaming overlapped with compute
(target >= 70%). Medians of --reps runs after one warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass

from pdserve.bench.common import hardware_line, print_table
from pdserve.config import EngineArgs
from pdserve.disagg.handoff import HandOffDone
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport import KVReceiver, KVSender, make_receiver, make_sender
from pdserve.disagg.worker.kv_streamer import KVStreamer
from pdserve.engine.llm_engine import KVTransferSetup, LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.demo_checkpoint import default_model_dir

_PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
_FLUSH_TIMEOUT_S = 120.0


def _prefill(engine: LLMEngine, rid: str, prompt: list[int]) -> int:
    engine.add_request(rid, prompt, _PARAMS, prefill_only=True)
    first = -1
    while engine.has_unfinished_requests():
        for out in engine.step():
            first = out.outputs[0].token_ids[0]
    return first


@dataclass(frozen=True, slots=True)
class _Pair:
    """A prefill engine and a decode engine, linked by a KV sender and its receiver."""

    prefill: LLMEngine
    decode: LLMEngine
    sender: KVSender
    receiver: KVReceiver


def _one_run(pair: _Pair, prompt: list[int], rid: str, stream: bool) -> tuple[float, float]:
    """(seconds of prefill compute, seconds from the end of compute until decode acknowledged
    everything: the transfer time left exposed)."""
    p, d, sender, receiver = pair.prefill, pair.decode, pair.sender, pair.receiver
    reservation = d.reserve_remote(rid, prompt, _PARAMS)
    assert reservation is not None and reservation.num_cached_tokens == 0
    receiver.expect(rid, list(reservation.block_ids))
    streamer = KVStreamer(p.config.cache.block_size, p.config.model.num_hidden_layers, sender.send_layer)
    streamer.expect(rid, reservation.block_ids, 0)
    p.configure_kv_transfer(KVTransferSetup(layer_observer=streamer if stream else None))
    start = time.perf_counter()
    first = _prefill(p, rid, prompt)
    computed = time.perf_counter()
    if not stream:
        held = p.held_block_ids(rid)
        for layer in range(p.config.model.num_hidden_layers):
            sender.send_layer(rid, layer, held, list(reservation.block_ids))
    sender.send_done(rid, HandOffDone(first).encode())
    asyncio.run(sender.flush(rid, _FLUSH_TIMEOUT_S))
    done = time.perf_counter()
    p.configure_kv_transfer(KVTransferSetup())
    p.release_kv(rid)
    d.abort_request(rid)
    receiver.cancel(rid)
    return computed - start, done - computed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-len", type=int, default=4000)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--transport", default="tcp", choices=["tcp", "nixl"])
    parser.add_argument("--reps", type=int, default=3)
    ns = parser.parse_args()
    model_dir = ns.model or str(default_model_dir("small"))
    args = EngineArgs(model=model_dir, dtype="float32", kv_cache_memory="1GiB", enable_prefix_caching=False,
                      max_num_batched_tokens=ns.max_num_batched_tokens, max_model_len=ns.prompt_len + 16)
    p, d = LLMEngine.from_engine_args(args), LLMEngine.from_engine_args(args)
    for engine in (p, d):
        # NOTE: the pools are committed lazily (engine/host_memory.py) and every run takes blocks
        # no run used before, so without this every run would time first-touch page faults
        # (~1 ms per MiB here), not the steady state of a server whose pool has been used.
        engine.runner.kv_cache.fill_(0)
    layout = KVLayout.from_pool("bench", p.runner.kv_cache)
    receiver = make_receiver(ns.transport, layout, d.runner.kv_cache, host="127.0.0.1", port=0)
    sender = make_sender(ns.transport, layout, p.runner.kv_cache)
    sender.connect(receiver.address)
    rng = random.Random(0)
    kv_bytes = ns.prompt_len * layout.block_bytes_per_layer * layout.num_layers // layout.block_size
    print(f"hardware: {hardware_line()}")
    print(f"model: {model_dir}; prompt {ns.prompt_len} tokens ({kv_bytes / 2**20:.0f} MiB of KV), chunks of "
          f"{ns.max_num_batched_tokens} tokens, transport {ns.transport}, median of {ns.reps} runs")
    compute, transfer, streamed = [], [], []
    pair = _Pair(p, d, sender, receiver)
    try:
        for rep in range(ns.reps + 1):
            prompt = [rng.randrange(0, 150_000) for _ in range(ns.prompt_len)]
            c, x = _one_run(pair, prompt, f"x{rep}", stream=False)
            _, s = _one_run(pair, prompt, f"s{rep}", stream=True)  # s: exposed tail
            if rep:  # the first round warms up
                compute.append(c)
                transfer.append(x)
                streamed.append(s)
    finally:
        sender.close()
        receiver.close()
    c, x, s = (statistics.median(v) for v in (compute, transfer, streamed))
    hidden = 1 - s / x
    print_table(["prefill compute s", "transfer after compute s", "exposed transfer when streamed s",
                 "transfer hidden"],
                [[f"{c:.3f}", f"{x:.4f}", f"{s:.4f}", f"{100 * hidden:.0f}% (target >= 70%)"]])

if __name__ == "__main__":
    main()
