"""`pdserve up` end to end: one command starts router + workers, serves, and Ctrl-C stops all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_fixtures import free_port

pytestmark = pytest.mark.slow  # the whole cluster as processes, through the CLI


def test_up_serves_then_stops_everything_on_ctrl_c(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    port = free_port()
    # NOTE: a file, not a pipe: workers log to the same output, and a pipe nobody drains blocks them.
    log = tmp_path / "up.log"
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model_dirs["tiny"]), "--port", str(port),
           "--kv-transport", "tcp", "--num-kv-blocks", "256", "--dtype", "float32"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "pdserve is up" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "pdserve is up" in log.read_text(), log.read_text()[-3000:]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            workers = http.get("/workers").json()
            assert sorted(w["role"] for w in workers) == ["decode", "prefill"] and all(w["ready"] for w in workers)
            reply = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # an impatient second Ctrl-C must not orphan a worker
        assert proc.wait(timeout=30) == 0
        children = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True).stdout.split()
        assert not [c for c in children if int(c) != proc.pid], children
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
