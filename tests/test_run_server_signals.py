"""`run_server` (every command's uvicorn server) and the signals that stop it: one that lands
before uvicorn listens for signals (a supervisor draining a worker that is still starting) stops
the server once it is up, after its drain hook ran, and the process exits 0."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from server_fixtures import free_port

# NOTE: the signal is sent from inside run_server's window: the first gc.collect it makes
_SCRIPT = textwrap.dedent("""
    import argparse, gc, os, signal, sys
    from starlette.applications import Starlette
    from pdserve.ops.serve import run_server

    collect = gc.collect
    def collect_once_signalled(*args):
        gc.collect = collect
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))
        return collect(*args)
    gc.collect = collect_once_signalled
    ns = argparse.Namespace(host="127.0.0.1", port=int(sys.argv[1]), log_level="WARNING")
    run_server(Starlette(), ns, on_exit=lambda: print("drain hook ran", flush=True))
    print("server returned", flush=True)
""")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_before_uvicorn_listens_still_stops_the_server(sig: str) -> None:
    try:
        done = subprocess.run([sys.executable, "-c", _SCRIPT, str(free_port()), sig], capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the server kept running after {sig}: {exc.stdout!r} {exc.stderr!r}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["drain hook ran", "server returned"], (done.stdout, done.stderr)
