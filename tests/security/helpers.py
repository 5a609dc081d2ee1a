"""Helpers shared by the adversarial suite: probes run inside sandboxes, HTTP calls
that report what the server answered, and a raw HTTP client for requests that
ordinary clients refuse to send (encoded dots kept verbatim, control bytes).

Every probe reports what the kernel answered (an errno, a listing, a byte
count) as one tagged JSON line; the tests assert on that answer.
"""

from __future__ import annotations

import json
import socket
import textwrap
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

PROBE_TAG = "SHOAL-SEC-PROBE:"

# ctypes preamble for probes that make raw system calls: ``sc(nr, *args)`` answers
# the errno of a failed call, or ``("ok", value)`` when the kernel let it through.
LIBC = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L = ctypes.c_long
def sc(nr, *args):
    ctypes.set_errno(0)
    rc = libc.syscall(L(nr), *[L(a) if isinstance(a, int) else a for a in args])
    return ctypes.get_errno() if rc == -1 else ["ok", rc]
def in_child(fn):
    # Run fn in a forked child, so that a call that works cannot change the prober.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, repr(fn()).encode())
        finally:
            os._exit(0)
    os.close(w)
    value = os.read(r, 256).decode() or "-1"
    os.waitpid(pid, 0)
    return int(value) if value.lstrip("-").isdigit() else value
"""


def probe_source(body: str) -> str:
    """Wrap a probe body that fills ``res`` so that it prints one tagged JSON line."""
    return ("import json as _json\nres = {}\n" + textwrap.dedent(body).strip("\n")
            + f"\nprint({PROBE_TAG!r} + _json.dumps(res, default=repr))\n")


def parse_probe(stdout: str, stderr: str, return_code: int, what: str) -> dict:
    assert return_code == 0, (f"{what} probe failed: rc={return_code}\n"
                              f"stdout={stdout[-2000:]}\nstderr={stderr[-2000:]}")
    for line in reversed(stdout.splitlines()):
        if line.startswith(PROBE_TAG):
            return json.loads(line[len(PROBE_TAG):])
    raise AssertionError(f"{what} probe printed no result:\n{stdout[-2000:]}\n{stderr[-2000:]}")


async def probe(sandbox, body: str, timeout: float = 30) -> dict:
    """Run a probe in the session's own interpreter (the agent's process)."""
    result = await sandbox.run_python(probe_source(body), timeout=timeout)
    return parse_probe(result.stdout, result.stderr, result.return_code, "python")


async def probe_child(sandbox, body: str, timeout: float = 30) -> dict:
    """Run a probe in a fresh python3 child, for probes that could harm the prober;
    the body may use ``libc``, ``L``, ``sc`` and ``in_child`` (see ``LIBC``)."""
    source = probe_source(LIBC + textwrap.dedent(body))
    script = "python3 - <<'SHOAL_PY_EOF'\n" + source + "SHOAL_PY_EOF\n"
    result = await sandbox.run_bash(script, timeout=timeout)
    return parse_probe(result.stdout, result.stderr, result.return_code, "child python")


# -- HTTP ---------------------------------------------------------------------------------
@dataclass
class Answer:
    """What the server answered to one exec, with how long it took."""

    status: int
    body: dict
    seconds: float
    text: str

    @property
    def content(self) -> dict:
        return self.body["result_block"]["content"]


TOOLS = {"python": ("code_execution", "code"), "bash": ("bash_code_execution", "command")}


def execute(http: httpx.Client, session_id: str, source: str, tool: str = "python",
            timeout: int | None = None) -> Answer:
    kind, field = TOOLS[tool]
    body: dict = {"tool": kind, "input": {field: source}}
    if timeout is not None:
        body["timeout_seconds"] = timeout
    started = time.monotonic()
    response = http.post(f"/sessions/{session_id}/exec", json=body)
    elapsed = time.monotonic() - started
    try:
        payload = response.json()
    except ValueError:
        payload = {}
    return Answer(response.status_code, payload if isinstance(payload, dict) else {},
                  elapsed, response.text)


def run_ok(http: httpx.Client, session_id: str, source: str, tool: str = "python",
           timeout: int | None = None) -> dict:
    """Run a call that must succeed; its result content."""
    answer = execute(http, session_id, source, tool, timeout)
    assert answer.status == 200, answer.text[:2000]
    assert answer.content["return_code"] == 0, answer.content
    return answer.content


def http_probe(http: httpx.Client, session_id: str, body: str, timeout: int = 30) -> dict:
    content = run_ok(http, session_id, probe_source(body), timeout=timeout)
    return parse_probe(content["stdout"], content["stderr"], content["return_code"], "http")


def new_session(http: httpx.Client, **body) -> str:
    response = http.post("/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()["session_id"]


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    raw: bytes


def raw_request(base_url: str, method: str, target: str, headers: dict[str, str] | None = None,
                body: bytes = b"", timeout: float = 30) -> RawResponse | None:
    """Send exactly these bytes (nothing normalized or re-encoded) and read the answer.

    Returns None when the server closed the connection without answering.
    """
    parts = urlsplit(base_url)
    lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.hostname}", "Connection: close"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body or method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(body)}")
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "surrogateescape") + body
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(request)
        chunks = []
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        return None
    head, _, rest = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    found = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        found[name.strip().lower()] = value.strip()
    return RawResponse(int(status_line.split()[1]), found, rest, raw)


def leaked(data: bytes | str, host_secrets: list[bytes]) -> list[bytes]:
    """The host secrets (see the ``host_secrets`` fixture) that ``data`` holds."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogateescape")
    return [secret for secret in host_secrets if secret in data]
