"""A decode frame's way through the router, from its frame-stream reader to the request's task,
alone (no sockets): the router's own `_FrameMux` (disagg/client.py) with its reader replaced by a
loop that puts one frame for each of N requests a step, as one read of a step's frames does.

    python -m pdserve.bench.frame_delivery [--streams 64] [--steps 300] [--rounds 3]

Two paths, alternated: "direct", the reader's put wakes the request's task, which reads its inbox
(`WorkerClient.stream_merged` on an open frame stream); "pump", a task per request moves its frames
into the inbox (`merged`, what a request that came while the stream was opening takes, and every
request did before). Printed: CPU µs per frame (process time over the frames), on uvloop as the
router runs.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import uvloop

from pdserve.disagg.client import _FrameMux, _Reply, merged
from pdserve.disagg.control import OutputFrame


class _Attached:
    """The worker's answer to every attach: at once, OK."""

    async def _post(self, url: str, path: str) -> _Reply:
        return _Reply(200, b"{}")


def router_end(client: Any) -> _FrameMux:
    """The router's end of a frame stream without its reader task (the caller puts in its request
    queues what the reader would): `client` answers its attach POSTs (`_post`). Also the tests'."""
    mux = _FrameMux.__new__(_FrameMux)
    mux.client, mux.url, mux.mux_id, mux.broken = client, "http://decode", "bench", None
    mux._queues = {}
    return mux


async def measure(path: str, streams: int, steps: int) -> float:
    """CPU µs a frame over `steps` steps of one frame for each of `streams` requests."""
    mux = router_end(_Attached())
    payload = OutputFrame(frame_no=1, token_ids=[5], text="x").model_dump_json().encode()
    received = 0

    async def request(rid: str) -> None:
        nonlocal received
        inbox: asyncio.Queue[object] = asyncio.Queue()
        items = mux.frames(rid, inbox) if path == "direct" else merged(mux.frames(rid), inbox)
        async for _ in items:
            received += 1

    rids = [f"r{i}" for i in range(streams)]
    tasks = [asyncio.create_task(request(rid)) for rid in rids]
    while len(mux._queues) < streams:
        await asyncio.sleep(0)
    start = time.process_time()
    for step in range(1, steps + 1):
        for rid in rids:
            mux._queues[rid].put_nowait(payload)
        while received < step * streams:  # NOTE: every request takes this step's frame before the next read
            await asyncio.sleep(0)
    cpu = time.process_time() - start
    for rid in rids:
        mux._queues[rid].put_nowait(b"")  # their frames end
    await asyncio.gather(*tasks)
    return cpu / (streams * steps) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args(argv)
    for _ in range(ns.rounds):
        for path in ("pump", "direct"):
            print(f"{path:6s} {uvloop.run(measure(path, ns.streams, ns.steps)):.2f} µs a frame")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
