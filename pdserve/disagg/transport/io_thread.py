"""An asyncio event loop on a daemon thread, owned by one transport object. All of a transport's
socket and NIXL calls run on it, so the caller's threads and event loops never block on the wire
and the NIXL agent is only ever used from one thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class IoThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        # NOTE: also runs at interpreter exit if nobody called stop(): a NIXL agent whose thread is
        # still polling when the interpreter tears down aborts the process ("terminate called").
        self._finalizer = weakref.finalize(self, _shutdown, self.loop, self._thread)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coro` on the loop and block the calling thread (never the loop's own) for its result."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("IoThread.run called from its own loop: it would deadlock")
        return self.submit(coro).result(timeout_s)

    def call(self, fn: Callable[..., T], *args: object, timeout_s: float | None = None) -> T:
        """Run a plain function on the loop's thread and return its result (blocking the caller)."""

        async def invoke() -> T:
            return fn(*args)

        return self.run(invoke(), timeout_s)

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    @property
    def running(self) -> bool:
        return self._finalizer.alive

    def stop(self) -> None:
        """Cancel every task, stop the loop and join the thread. Idempotent."""
        self._finalizer()


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    if thread is threading.current_thread():
        loop.stop()  # cannot join ourselves; the thread ends when the loop returns
        return
    if thread.is_alive():
        asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
    loop.close()


async def _cancel_other_tasks() -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
