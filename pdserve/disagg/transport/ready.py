"""When a layer's KV is in the pool on the device, for the transport threads that read it there.

The prefill engine's thread learns "layer l is computed" (`layer_done`, model/qwen3.py) once layer
l's kernels are *launched*: on a GPU, Python runs ahead of the device by up to a whole forward. A
NIXL WRITE posted from VRAM at that moment may move blocks the kernels have not written yet, and
decode silently computes on stale KV. So the streamer records an event on the compute stream right
after each layer (`layer_ready`), hands it with the layer's sends, and a sender's I/O thread waits
on it (`synchronize`) before it posts a transfer that reads the device pool:

    engine thread    layer 0 kernels | record e0 | send_layer(.., e0) | layer 1 kernels | record e1 | ...
    device stream    [layer 0 .......]e0 [layer 1 ..........]e1
    I/O thread                 claim l0 ... grant l0: e0.synchronize() -> post WRITE l0 ...

On CPU every op has finished when it returns: the event is `NO_WAIT`, which waits for nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class LayerReady(Protocol):
    """A point on the compute stream; `synchronize` returns once the device has passed it (any thread)."""

    def synchronize(self) -> None: ...


class _NoWait:
    def synchronize(self) -> None:
        return None


NO_WAIT: LayerReady = _NoWait()


def layer_ready(device: torch.device) -> Callable[[], LayerReady]:
    """What the streamer records after each layer on `device`: a CUDA event on its current stream
    (the one the engine computes on), or `NO_WAIT` where ops are done when they return."""
    if device.type != "cuda":
        return lambda: NO_WAIT

    def record() -> LayerReady:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    return record
