"""Start `python -m jaxpaged.serve` in a subprocess on a free 127.0.0.1 port and wait until it is healthy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None, timeout: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        cmd = [sys.executable, "-m", "jaxpaged.serve", "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "WARNING"]
        cmd += args + (["--api-key", api_key] if api_key else [])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_healthy(timeout)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log()[-4000:]}")

    def metrics(self) -> dict[str, float]:
        """/metrics as {series: value}, e.g. 'jaxpaged:kv_blocks_used' or 'jaxpaged:request_finished_total{...}'."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def wait_metrics(self, predicate, timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until `predicate` holds (the loop publishes right after it hands outputs over)."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics()
            if predicate(values) or time.monotonic() > deadline:
                return values
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
