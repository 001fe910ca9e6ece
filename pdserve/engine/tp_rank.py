"""Entry point of a tensor-parallel rank other than 0 (started by `tensor_parallel.start_tensor_parallel`):
`python -m pdserve.engine.tp_rank ADDRESS`, the connection's authkey on stdin."""

from __future__ import annotations

import sys
from multiprocessing.connection import Client

from pdserve.engine.tensor_parallel import rank_main


def main() -> None:
    authkey = sys.stdin.buffer.read()
    rank_main(Client(sys.argv[1], "AF_UNIX", authkey=authkey))


if __name__ == "__main__":
    main()
