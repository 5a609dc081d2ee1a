"""Connections are bounded: a request's headers have request_header_seconds, and
past max_connections a connection is closed and a request answered 503.

uvicorn starts its keep-alive clock only after a response, so a connection that
sent nothing, or part of a request's headers, was held for ever: each an fd of
the server's, and a few hundred left it unable to accept or start sandboxes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from urllib.parse import urlsplit

import pytest

from tests.serving import SHOAL
from tests.uid_slots import uid

HEADER_SECONDS = 2
KEEP_ALIVE_SECONDS = 5
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def deadline_server(server_factory):
    return server_factory(request_header_seconds=HEADER_SECONDS,
                          keep_alive_seconds=KEEP_ALIVE_SECONDS, pool_size=1)


def _connect(server) -> socket.socket:
    address = urlsplit(server.url)
    return socket.create_connection((address.hostname, address.port), timeout=30)


def _response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response's head and body (by its content-length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bytes, float]:
    """What the server sent up to its close, and when the close came (monotonic);
    fails if the connection is still open after ``seconds``."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except socket.timeout:
        pytest.fail(f"still open after {seconds}s, having sent {data!r}")
    except ConnectionResetError:
        pass
    return data, time.monotonic()


def test_a_connection_that_does_not_finish_its_headers_is_closed(deadline_server):
    opened = time.monotonic()
    silent = _connect(deadline_server)
    half = _connect(deadline_server)
    half.sendall(b"POST /sessions HTTP/1.1\r\nHost: x\r\nContent-")

    # Meanwhile a slow but complete request: its headers in pieces within the
    # deadline, its body after the deadline has passed (it bounds headers only).
    slow = _connect(deadline_server)
    body = b'{"tool": "code_execution", "input": {"code": "1"}}'
    head = (b"POST /sessions/nonexistent/exec HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    for start in range(0, len(head), len(head) // 5 + 1):
        slow.sendall(head[start:start + len(head) // 5 + 1])
        time.sleep(HEADER_SECONDS / 10)
    time.sleep(HEADER_SECONDS * 0.75)
    slow.sendall(body)
    status, _ = _response(slow)
    assert status.startswith(b"HTTP/1.1 404"), status  # served: no such session
    slow.sendall(HEALTH)  # and kept alive
    assert _response(slow)[0].startswith(b"HTTP/1.1 200")
    slow.close()

    # A plain request on another connection is served meanwhile.
    with deadline_server.client() as client:
        assert client.get("/health").status_code == 200

    sent, closed = _closed_within(silent, HEADER_SECONDS * 3)
    assert sent == b""  # sent nothing: closed as an idle connection is
    assert closed - opened >= HEADER_SECONDS * 0.9
    sent, closed = _closed_within(half, HEADER_SECONDS * 3)
    assert sent.startswith(b"HTTP/1.1 408 "), sent
    assert b"connection: close" in sent.lower()
    silent.close()
    half.close()


def test_a_kept_alive_connection_stalling_in_its_next_headers_is_closed(deadline_server):
    stalled, blank, idle = (_connect(deadline_server) for _ in range(3))
    for sock in (stalled, blank, idle):
        sock.sendall(HEALTH)
        assert _response(sock)[0].startswith(b"HTTP/1.1 200")
    answered = time.monotonic()
    stalled.sendall(b"GET /health HTTP/1.1\r\nHo")
    # A bare CRLF begins no request (the parser skips it) but cancels uvicorn's
    # keep-alive timer: the header clock must start on it all the same.
    blank.sendall(b"\r\n")

    sent, closed = _closed_within(stalled, HEADER_SECONDS * 3)
    assert sent.startswith(b"HTTP/1.1 408 "), sent
    assert HEADER_SECONDS * 0.9 <= closed - answered < KEEP_ALIVE_SECONDS
    sent, closed = _closed_within(blank, HEADER_SECONDS * 3)
    assert sent == b""
    assert HEADER_SECONDS * 0.9 <= closed - answered < KEEP_ALIVE_SECONDS

    # An idle kept-alive connection is still kept for keep_alive_seconds, not
    # request_header_seconds: it takes another request past the header deadline.
    idle.sendall(HEALTH)
    assert _response(idle)[0].startswith(b"HTTP/1.1 200")
    kept = time.monotonic()
    sent, closed = _closed_within(idle, KEEP_ALIVE_SECONDS * 3)
    assert sent == b""
    assert closed - kept >= KEEP_ALIVE_SECONDS * 0.9
    for sock in (stalled, blank, idle):
        sock.close()


def test_past_max_connections_a_request_is_answered_503_and_closed(server_factory):
    cap = 20
    server = server_factory(max_connections=cap, pool_size=1)
    # uvicorn's limit_concurrency: a request is refused once the open connections,
    # its own among them, reach the cap; a connection past the cap is not kept.
    held = [_connect(server) for _ in range(cap - 2)]
    try:
        kept = _connect(server)
        kept.sendall(HEALTH)  # the cap's 19th connection: served, and kept alive
        assert _response(kept)[0].startswith(b"HTTP/1.1 200")
        held.append(kept)
        at_cap = _connect(server)  # the 20th: accepted
        held.append(at_cap)
        over = _connect(server)  # the 21st: closed at once, whatever it would send
        sent, _ = _closed_within(over, 10)
        over.close()
        assert sent == b""
        assert f"refusing connections: {cap} are open, max_connections is {cap}" in server.log()
        body = b'{"model": "m"}'
        at_cap.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        sent, _ = _closed_within(at_cap, 10)  # answered, then closed: not held
        assert sent.startswith(b"HTTP/1.1 503 "), sent
        head, _, answer = sent.partition(b"\r\n\r\n")
        assert b"connection: close" in head.lower() and b"retry-after: 1" in head.lower()
        # In the route's dialect (Anthropic's, here), which a client's SDK retries on.
        assert json.loads(answer)["error"]["type"] == "overloaded_error", answer
        # The kept-alive connection under the cap is served still.
        kept.sendall(HEALTH)
        assert _response(kept)[0].startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
    # Once they close, everyone is served again.
    deadline = time.monotonic() + 10
    with server.client() as client:
        while (status := client.get("/health").status_code) != 200:
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        assert client.post("/sessions", json={}).status_code == 201


@pytest.mark.parametrize("max_connections, fits", [("4096", False), ("500", True)])
def test_shoal_check_says_whether_the_open_file_limit_holds_max_connections(
        tmp_path, max_connections, fits):
    """Past the open-file limit the server can neither accept nor start a sandbox:
    check says whether max_connections fits beside the sandboxes' share."""
    args = ["prlimit", "--nofile=2000:2000", str(SHOAL), "check",
            "--data-dir", str(tmp_path / "data"), "--run-dir", str(tmp_path / "run"),
            "--uid-base", str(uid(591_000)), "--max-connections", max_connections]
    kept = {name: os.environ[name] for name in ("PYTHONPATH",) if name in os.environ}
    outcome = subprocess.run(args, capture_output=True, text=True, timeout=120,
                             env={"PATH": "/usr/bin:/bin", **kept})
    assert outcome.returncode == 0, outcome.stderr
    (line,) = [line for line in outcome.stdout.splitlines() if line.startswith("connections:")]
    if fits:
        assert "the open-file limit 2000 holds max_connections (500)" in line, line
    else:
        assert "the open-file limit 2000 cannot hold max_connections (4096)" in line, line
        # Each of the 64 sessions' tool callbacks (4 at once) has its fds too.
        assert "lower max_connections to 624" in line, line


def test_a_front_ends_open_file_limit_counts_a_host_connection_per_client():
    """A cluster front end holds, beside each client's connection, the one to the
    host relaying that client's call: it was counted as holding none (and it
    relayed at most 1,024 calls at once, so with 4,096 clients a call past them
    waited 30 s for a 503)."""
    from shoal.config import Settings
    from shoal.server import open_files_shortfall

    front = Settings(cluster="127.0.0.1:6379", max_connections=4096)
    assert open_files_shortfall(front, 8192 + 64) is None
    short = open_files_shortfall(front, 8000)
    assert short is not None and "connections to the sandbox hosts" in short, short
    assert "lower max_connections to 3968" in short, short
    assert open_files_shortfall(Settings(cluster="127.0.0.1:6379", max_connections=3968),
                                8000) is None
