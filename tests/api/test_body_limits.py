"""Request bodies are bounded: each one (413), and all in progress together (503).

Without the bounds a client could make the server buffer any number of gigabytes
of JSON: one body, or many at once from many connections.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

MiB = 1 << 20
CAP = 1 * MiB * 4 // 3 + MiB  # the shared server's max_file_bytes, base64, and a margin


def _connect(server) -> socket.socket:
    address = urlsplit(server.url)
    return socket.create_connection((address.hostname, address.port), timeout=30)


def _response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """Status, headers and body of one HTTP/1.1 answer (Content-Length framed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server hung up without answering: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    headers = {k.lower(): v for k, v in headers.items()}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("path, shape", [
    ("/sessions", "protocol"), ("/v1/messages", "anthropic"), ("/v1/responses", "openai")])
def test_a_body_over_the_cap_is_refused_in_the_routes_dialect(server, path, shape):
    body = json.dumps({"padding": "x" * (CAP + 10)}).encode()
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
    response = httpx.post(server.url + path, content=body, headers=headers, timeout=60)
    assert response.status_code == 413, response.text[:300]
    answer = response.json()
    message = {"protocol": lambda: answer["detail"],
               "anthropic": lambda: answer["error"]["message"],
               "openai": lambda: answer["error"]["message"]}[shape]()
    assert f"{CAP}-byte cap" in message, answer
    if shape == "anthropic":
        assert answer["type"] == "error"
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_chunked_body_over_the_cap_is_refused_as_it_arrives(server):
    sent = 0

    def chunks():
        nonlocal sent
        for _ in range(64):  # 4 MiB in all, past the cap
            sent += 64 * 1024
            yield b" " * (64 * 1024)

    response = httpx.post(server.url + "/sessions", content=chunks(),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413, response.text
    assert "Content-Length" not in response.request.headers  # it was chunked
    assert f"{CAP}-byte cap" in response.json()["detail"]


def test_bodies_in_progress_are_bounded_together(server_factory):
    server = server_factory(max_file_bytes=MiB, request_buffer_mib=4, pool_size=1)
    size = 3 * MiB // 2  # under the cap; two of them hold 3 of the budget's 4 MiB
    held = []
    try:
        for _ in range(2):  # two bodies sent but for their last byte: both held
            sock = _connect(server)
            sock.sendall(b"POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         b"\r\nContent-Length: %d\r\n\r\n{" % (size + 1) + b" " * (size - 1))
            held.append(sock)
        time.sleep(2)  # the server has read what was sent (4 MiB over loopback)
        third = _connect(server)
        third.sendall(b"POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                      b"\r\nContent-Length: %d\r\n\r\n" % (size + 1) + b" " * size)
        status, headers, body = _response(third)
        third.close()
        assert status == 503, body
        assert headers.get("retry-after") == "1"
        assert "request bodies" in json.loads(body)["detail"]
        for sock in held:  # the two finish, and are served: their bytes are given back
            sock.sendall(b"}")
            status, _, body = _response(sock)
            assert status == 201, body
            httpx.delete(f"{server.url}/sessions/{json.loads(body)['session_id']}")
            sock.close()
        held.clear()
        created = httpx.post(server.url + "/sessions", content=b"{}" + b" " * size,
                             headers={"content-type": "application/json"}, timeout=60)
        assert created.status_code == 201, created.text
    finally:
        for sock in held:
            sock.close()


def _held_post(server, size: int, token: str | None = None,
               scheme: bytes = b"Bearer") -> socket.socket:
    """A POST /sessions whose body is sent but for its last byte: the server holds it."""
    sock = _connect(server)
    auth = b"Authorization: %s %s\r\n" % (scheme, token.encode()) if token else b""
    sock.sendall(b"POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + auth + b"Content-Length: %d\r\n\r\n{" % (size + 1) + b" " * (size - 1))
    return sock


def test_one_tenants_held_bodies_leave_the_others_room(server_factory):
    # One tenant's stalled uploads held the whole budget, and every other
    # tenant's requests with a body were 503s for as long as it liked. The share
    # was keyed by the header's bytes too: "Bearer", "bearer", "BEARER" and
    # "Bearer  tok" (all one token to the auth check) were four shares.
    server = server_factory(max_file_bytes=MiB, request_buffer_mib=4, pool_size=1,
                            tokens="tok-a=a,tok-b=b")
    size = 3 * MiB // 2
    held = [_held_post(server, size, "tok-a")]
    try:
        time.sleep(1)
        # Past tenant a's half of the budget, however its token is spelt.
        for scheme in (b"Bearer", b"bearer", b"BEARER", b"Bearer "):
            again = _held_post(server, size, "tok-a", scheme=scheme)
            held.append(again)
            status, _, body = _response(again)
            assert status == 503 and "request bodies" in json.loads(body)["detail"], (scheme, body)
        other = _held_post(server, size, "tok-b")
        held.append(other)
        other.sendall(b"}")
        status, _, body = _response(other)
        assert status == 201, body
    finally:
        for sock in held:
            sock.close()


def test_a_body_that_stops_arriving_is_answered_and_gives_its_room_back(server_factory):
    server = server_factory(request_body_idle_seconds=1, pool_size=1)
    sock = _held_post(server, 1000)
    try:
        started = time.monotonic()
        status, _, body = _response(sock)
        assert status == 408, body
        assert "stopped arriving for 1s" in json.loads(body)["detail"]
        assert time.monotonic() - started < 10
    finally:
        sock.close()
    # A body that keeps coming, slowly, is not cut off.
    sock = _connect(server)
    try:
        sock.sendall(b"POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 4\r\n\r\n{")
        for piece in (b" ", b" ", b"}"):
            time.sleep(0.6)
            sock.sendall(piece)
        status, _, body = _response(sock)
        assert status == 201, body
        httpx.delete(f"{server.url}/sessions/{json.loads(body)['session_id']}")
    finally:
        sock.close()
