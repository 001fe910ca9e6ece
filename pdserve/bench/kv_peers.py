"""The other ends of the KV transport benchmark (kv_transport.py), each a process of its own: the
decode side (one receiver per transport, on one pool) and the raw socket's receiving end."""

from __future__ import annotations

import asyncio
import multiprocessing.connection
import socket

import torch

from pdserve.bench.kv_workload import KVWorkload, buffer, digest
from pdserve.disagg.transport import KVReceiver, make_receiver

FLUSH_TIMEOUT_S = 60.0


def decode_main(conn: multiprocessing.connection.Connection, work: KVWorkload) -> None:
    """Decode side, driven by the parent over `conn`: one command at a time. One receiver per
    transport, all on the same pool."""
    torch.set_num_threads(1)
    pool = work.pool(None)
    receivers: dict[str, KVReceiver] = {}
    loop = asyncio.new_event_loop()
    while True:
        command, *args = conn.recv()
        if command == "stop":
            for receiver in receivers.values():
                receiver.close()
            conn.send(None)
            return
        if command == "receiver":
            receivers[args[0]] = make_receiver(args[0], work.layout(), pool)
            conn.send(receivers[args[0]].address)
        elif command == "expect":
            receivers[args[0]].expect(*args[1:])
            conn.send(None)
        elif command == "drain":
            conn.send(loop.run_until_complete(_drain(receivers[args[0]], args[1])))
        elif command == "clear":
            pool[:, :, torch.tensor(args[0])] = 0
            conn.send(None)
        elif command == "digest":
            conn.send(digest(pool, args[0]))


async def _drain(receiver: KVReceiver, request_id: str) -> str:
    while True:
        event = await receiver.wait(request_id, FLUSH_TIMEOUT_S)
        if not hasattr(event, "layer"):
            return type(event).__name__


def raw_socket_main(conn: multiprocessing.connection.Connection, num_bytes: int) -> None:
    """The raw socket's receiving end, in a process of its own (no other threads, nothing else
    running): receive `num_bytes` and answer one byte, until the peer closes."""
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname()[1])
    received_bytes = buffer(num_bytes)
    received_bytes.fill_(0)
    view = received_bytes.numpy().data
    with server:
        peer, _ = server.accept()
    with peer:
        while True:
            received = 0
            while received < num_bytes:
                n = peer.recv_into(view[received:], num_bytes - received)
                if n == 0:
                    return
                received += n
            peer.sendall(b"k")
