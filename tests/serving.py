"""Starts `python -m serve.run` in a subprocess for the HTTP tests and stops it."""

import os
import queue
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT_S = 600  # a bound for a hung start-up, not a timing assertion


class Server:
    """A running server: its base url, process and stderr log file."""

    def __init__(self, args: list[str], tmp):
        self.log_path = tmp / "server.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "serve.run", "--port", "0", "--compile-cache", str(tmp / "jax-cache"), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)
        self.lines: queue.Queue = queue.Queue()  # stdout lines after the start-up line
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()
        self.url, deadline = None, time.monotonic() + START_TIMEOUT_S
        while self.url is None:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"the server did not start:\n{self.log()[-4000:]}")
                continue
            if "http://" in line:
                self.url = "http://" + line.split("http://")[1].split()[0]

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return open(self.log_path).read()

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()
