"""Entry point of a tensor-parallel rank other than 0, started by `tensor_parallel.start_tensor_parallel`:
`python -m pdserve.engine.tp_rank FD`, FD its end of a socket pair with rank 0."""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from pdserve.engine.tensor_parallel import rank_main


def main() -> None:
    rank_main(Connection(int(sys.argv[1])))


if __name__ == "__main__":
    main()
