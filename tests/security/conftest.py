"""Fixtures of the adversarial suite: real ``shoal serve`` processes of its own, and
host canaries that must never come back through the API.

The servers here get a uid range and a run directory of their own, so that they
never share a uid lease or a volume mount with the servers of other test
directories that may run at the same time; everything is unmounted and removed
at the end. The in-process ``pool`` and ``sandbox`` fixtures of tests/conftest.py
serve the probes that need no HTTP.
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.serving import Server, start_server

# Far from tests/api (590_000 and up), the in-process pool (200_000) and tests/reliability
# (2_000_000 to 502_000_000); per process, so that two runs of this suite never meet.
_uid_bases = itertools.count(700_000_000 + (os.getpid() % 1000) * 100_000, 10_000)


def _unmount_under(directory: Path) -> None:
    with open("/proc/self/mountinfo") as handle:
        points = [line.split()[4] for line in handle]
    for point in sorted((p for p in points if p.startswith(f"{directory}/")), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True)


@pytest.fixture(scope="session")
def security_run_dir() -> Iterator[Path]:
    path = Path("/run/shoal-test") / f"security-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    path.mkdir(mode=0o711, parents=True)
    yield path
    _unmount_under(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def security_server_factory(tmp_path_factory, security_run_dir):
    """Start servers with their own settings, uid range and run directory."""
    started: list[Server] = []
    numbers = itertools.count(1)

    def start(**settings) -> Server:
        run_dir = security_run_dir / f"server-{next(numbers)}"
        run_dir.mkdir(mode=0o711)
        settings.setdefault("run_dir", run_dir)
        server = start_server(tmp_path_factory.mktemp("security-server"), next(_uid_bases),
                              **settings)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def security_server(security_server_factory) -> Server:
    """An open server (no tokens) with small caps, shared by the HTTP attacks."""
    return security_server_factory(max_file_bytes=1024 * 1024, max_sessions=24, pool_size=2,
                                   max_timeout_seconds=30)


@pytest.fixture
def http(security_server) -> Iterator[httpx.Client]:
    with security_server.client() as client:
        yield client


@pytest.fixture
def session_id(security_server, http) -> Iterator[str]:
    response = http.post("/sessions", json={})
    assert response.status_code == 201, response.text
    session_id = response.json()["session_id"]
    yield session_id
    # A fresh client: after a 500 the server drops the connection the test was using.
    with security_server.client() as own:
        own.delete(f"/sessions/{session_id}")


@dataclass(frozen=True)
class Canary:
    """A host file no sandbox can see: a link to it must never be followed by the server."""

    path: Path
    content: bytes


@pytest.fixture(scope="session")
def canary(tmp_path_factory) -> Canary:
    directory = tmp_path_factory.mktemp("canary")
    os.chmod(directory, 0o755)
    content = f"SHOAL-HOST-CANARY-{secrets.token_hex(16)}\n".encode()
    path = directory / "secret.txt"
    path.write_bytes(content)
    os.chmod(path, 0o644)
    return Canary(path, content)


@pytest.fixture(scope="session")
def host_secrets(canary) -> list[bytes]:
    """Byte strings that exist only on the host: none may appear in any response."""
    secrets_ = [canary.content.strip()]
    for name in ("/etc/shadow", "/etc/gshadow"):
        try:
            lines = Path(name).read_bytes().splitlines()
        except OSError:
            continue
        secrets_ += [line for line in lines if len(line) > 8]
    # Host /etc/passwd lines that the sandbox's synthetic passwd does not have.
    synthetic = {b"root:x:0:0:root:/root:/usr/sbin/nologin"}
    secrets_ += [line for line in Path("/etc/passwd").read_bytes().splitlines()
                 if line.count(b":") == 6 and line not in synthetic
                 and not line.startswith((b"agent:", b"nobody:"))]
    assert secrets_, "no host secrets to look for"
    return secrets_

