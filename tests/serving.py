"""Starting real Shoal servers for tests: ``shoal serve`` in a subprocess on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.uid_slots import uid

SHOAL = Path(sys.executable).parent / "shoal"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log_path: Path
    data_dir: Path

    def client(self, token: str | None = None, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


DEFAULT_RUN_DIR = Path("/run/shoal-test")
# drain_seconds 0: a test server stops as soon as it is idle (the drain is for load
# balancers; tests/api/test_operability.py tests it with its own setting).
DEFAULTS = {"pool_size": 2, "memory_limit_mib": 512, "drain_seconds": 0}


def launcher() -> str | None:
    """The launcher the servers of this test run are told to use: ``SHOAL_LAUNCHER`` of
    the test process (a pass of the Makefile sets it); None leaves the server's own
    default."""
    return os.environ.get("SHOAL_LAUNCHER") or None


def start_server(tmp_path: Path, uid_base: int, data_dir: Path | None = None, *,
                 run_dir: Path = DEFAULT_RUN_DIR, env: dict[str, str] | None = None,
                 server_type: type[Server] = Server, fields: dict | None = None,
                 **settings: object) -> Server:
    """Start ``shoal serve`` with the given settings and wait until it is healthy.

    ``env`` adds variables to the server's environment; ``server_type`` and
    ``fields`` let a suite use a richer ``Server`` subclass. The server's own
    environment has no ``SHOAL_*`` variable, so only the flags count; the launcher
    is the test run's (:func:`launcher`) unless ``launcher=`` is given.
    """
    if launcher() is not None:
        settings.setdefault("launcher", launcher())
    uid_base = uid(uid_base)  # this test process's uid slot (tests/uid_slots.py)
    port = free_port()
    data_dir = data_dir or tmp_path / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = tmp_path / f"server-{port}.log"
    environment = {key: value for key, value in os.environ.items() if not key.startswith("SHOAL_")}
    environment.update(env or {})
    args = [str(SHOAL), "serve", "--port", str(port), "--data-dir", str(data_dir),
            "--run-dir", str(run_dir), "--uid-base", str(uid_base)]
    for name, value in {**DEFAULTS, **settings}.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=environment)
    server = server_type(f"http://127.0.0.1:{port}", process, log_path, data_dir, **(fields or {}))
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"shoal serve exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"shoal serve did not become healthy:\n{server.log()}")
