"""A minimal headless-Chromium driver over the DevTools protocol, for the dashboard test.

Starts `chromium --headless --remote-debugging-port=N` on a blank page, attaches to that page's
websocket, and keeps every console error / uncaught exception / error log entry it is told about.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from contextlib import ExitStack
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

_START_TIMEOUT_S = 60.0


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Browser:
    def __init__(self, binary: str, port: int) -> None:
        # NOTE: chromium's helper processes can still write to the profile after the browser exits
        # (CI once failed the cleanup with "Directory not empty: 'Default'"): cleaning up is best effort
        self.profile = tempfile.TemporaryDirectory(prefix="pdserve-chromium-", ignore_cleanup_errors=True)
        self.process = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio",
             f"--remote-debugging-port={port}", f"--user-data-dir={self.profile.name}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.errors: list[str] = []
        self._next_id = 0
        self._stack = ExitStack()
        self._ws = self._attach(port)
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable")

    def _attach(self, port: int) -> ClientConnection:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json()
                         if t.get("type") == "page"]
                if pages:
                    return self._stack.enter_context(connect(pages[0]["webSocketDebuggerUrl"], max_size=None,
                                                             open_timeout=10))
            except (httpx.HTTPError, ValueError):
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("chromium did not start its DevTools endpoint")
            time.sleep(0.2)

    def call(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        call_id = self._next_id
        self._ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            message = json.loads(self._ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._on_event(message)

    def pump(self, seconds: float) -> None:
        """Take events for `seconds` (console errors arrive as events)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self._on_event(json.loads(self._ws.recv(timeout=left)))
            except TimeoutError:
                return

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def _on_event(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in
                                                       params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append("exception: " + str(details.get("exception", {}).get("description", details)))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log: {entry.get('text')} {entry.get('url', '')}")

    def close(self) -> None:
        self._stack.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.profile.cleanup()
