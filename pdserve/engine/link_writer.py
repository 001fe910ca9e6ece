"""`LinkWriter`: the engine-core client's writing side of its socket to the engine process
(engine/core_client.py), which never waits on the reader at the other end."""

from __future__ import annotations

import logging
import queue
import socket
import threading

logger = logging.getLogger(__name__)


class LinkWriter:
    """Writes frames to a socket in order without ever waiting on the reader at the other end: a
    frame goes out from the sending thread itself when nothing is queued before it and the socket
    takes it at once (no thread hop on a request's path); else, with whatever part the socket did
    not take, it goes to the writer thread, which waits for the socket in its place."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._send_lock = threading.Lock()  # the socket's writing side; the writer may hold it long
        self._count_lock = threading.Lock()  # _backlog only: never held while waiting
        self._backlog = 0  # frames queued for the writer or being written by it
        self._writer = threading.Thread(target=self._write, name="pdserve-engine-core-writer", daemon=True)
        self._writer.start()

    def send(self, data: bytes) -> None:
        if self._send_lock.acquire(blocking=False):  # NOTE: held by the writer while it sends
            try:
                with self._count_lock:
                    direct = not self._backlog
                if direct:
                    try:
                        sent = self._sock.send(data, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        sent = 0
                    except OSError:
                        return
                    if sent == len(data):
                        return
                    data = data[sent:]  # NOTE: the rest before anything else: queued while the lock is held
                self._enqueue(data)
            finally:
                self._send_lock.release()
            return
        self._enqueue(data)

    def close(self) -> None:
        """The writer stops once what is queued before this is written."""
        self._outbox.put(None)

    def join(self, timeout_s: float) -> None:
        self._writer.join(timeout=timeout_s)

    def _enqueue(self, data: bytes) -> None:
        with self._count_lock:
            self._backlog += 1
        self._outbox.put(data)

    def _write(self) -> None:
        """The writer thread: frames in the order they were queued."""
        while (data := self._outbox.get()) is not None:
            try:
                with self._send_lock:
                    self._sock.sendall(data)
                with self._count_lock:
                    self._backlog -= 1
            except OSError:
                logger.debug("engine core link closed: the writer stops")
                return
