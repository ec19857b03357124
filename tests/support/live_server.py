"""A uvicorn server on a background thread, on a free loopback port (the server tests)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """A uvicorn server on a background thread."""

    def __init__(self, app, **config) -> None:
        """``config``: more ``uvicorn.Config`` options (``http=`` a protocol class)."""
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", **config)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class ServeProcess:
    """``deepinfer serve MODEL ARGS`` in a process of its own on a free loopback port, as a
    user runs it (the tests' own threads and objects then compete with nothing in it)."""

    def __init__(self, model: str, *args: str, timeout_s: float = 180) -> None:
        import subprocess
        import sys

        import httpx

        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deepinfer.cli", "serve", model, "--port", str(self.port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.time() + timeout_s
        while True:
            if self.proc.poll() is not None or time.time() > deadline:
                self.kill()
                raise AssertionError(f"deepinfer serve did not come up: {self.stderr[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def terminate(self, timeout_s: float = 60) -> int:
        """SIGTERM, then wait for the exit; returns the exit code (``stderr`` holds the log)."""
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.stdout, self.stderr = self.proc.communicate(timeout=timeout_s)
        return self.proc.returncode

    def wait(self, timeout_s: float = 60) -> int:
        """Wait for the exit (after a signal the test sent itself); returns the exit code."""
        self.stdout, self.stderr = self.proc.communicate(timeout=timeout_s)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.stdout, self.stderr = self.proc.communicate()
