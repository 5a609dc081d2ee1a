"""A response its client stops taking is cut after response_stall_seconds, and a
response cut or left lets go of what it streamed from at once.

A client that stays connected and reads nothing held its stream's send for ever,
and the route with it: a run's event log, a gateway turn's upstream connection
(tests/gateway/test_messages.py), an open file.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

MiB = 1 << 20
# About 8 MiB of stdout: the stream carries it twice (its output events, then
# the run's end), far past what the kernel and uvicorn buffer between the two.
LOUD = "import sys\nfor _ in range(2048):\n    sys.stdout.write('x' * 4095 + '\\n')\n"


def _open_run_stream(server, code: str) -> socket.socket:
    address = urlsplit(server.url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # A small window, set before connecting: the server's writes back up at once.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect((address.hostname, address.port))
    body = json.dumps({"language": "python", "code": code}).encode()
    sock.sendall(b"POST /v1/code-execution/runs HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def _read_until_closed(sock: socket.socket, pause_every: int = 0, pause: float = 0.0) -> bytes:
    """Everything up to the server's close; with pause_every, a rest after each
    that many bytes (a slow reader that still reads)."""
    data = bytearray()
    since_pause = 0
    while chunk := sock.recv(65536):
        data += chunk
        since_pause += len(chunk)
        if pause_every and since_pause >= pause_every:
            time.sleep(pause)
            since_pause = 0
        if data.endswith(b"0\r\n\r\n") and b"data: [DONE]" in data[-200:]:
            break  # the whole chunked stream: a keep-alive connection stays open
    return bytes(data)


def test_a_stream_its_client_stops_reading_is_cut(server_factory):
    server = server_factory(response_stall_seconds=1, output_cap_bytes=16 * MiB, pool_size=1)
    sock = _open_run_stream(server, LOUD)
    try:
        time.sleep(3)  # reading nothing, connected: the stall (1 s) and the sweep (0.25 s) pass
        received = _read_until_closed(sock)
    finally:
        sock.close()
    assert received.startswith(b"HTTP/1.1 200"), received[:200]
    assert b"event: run.created" in received
    # Cut: what the buffers held, then the close, never the stream's end.
    assert b"data: [DONE]" not in received
    assert len(received) < 8 * MiB, len(received)
    assert "cut a response: its client took none of it for 1s" in server.log()
    # Expected, already said in the warning: not uvicorn's error for an app bug.
    assert "without completing response" not in server.log()
    # The run itself was not the client's to lose: it finished, whole.
    run_id = received.split(b'"runId": "', 1)[1].split(b'"', 1)[0].decode()
    deadline = time.monotonic() + 30
    record = server.client().get(f"/v1/code-execution/runs/{run_id}").json()
    while record["status"] == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
        record = server.client().get(f"/v1/code-execution/runs/{run_id}").json()
    assert record["status"] == "completed", record
    assert len(record["stdout"]) == 2048 * 4096


def test_a_slow_reader_that_keeps_reading_is_not_cut(server_factory):
    server = server_factory(response_stall_seconds=1, pool_size=1)
    code = "import sys\nfor _ in range(256):\n    sys.stdout.write('x' * 4095 + '\\n')\n"
    sock = _open_run_stream(server, code)
    try:
        started = time.monotonic()
        # 2 MiB and more, a rest of half the stall after every 256 KiB: the
        # response takes several times the stall, but no send waits that long.
        received = _read_until_closed(sock, pause_every=256 * 1024, pause=0.5)
        took = time.monotonic() - started
    finally:
        sock.close()
    assert b"event: run.completed" in received and b"data: [DONE]" in received
    assert took > 2, took  # it did outlast the stall limit, in rests shorter than it
    assert "cut a response" not in server.log()


def _open_handles(pid: int, name: str) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd).endswith(name)
        except OSError:
            continue  # closed meanwhile
    return count


def _handles_gone(pid: int, name: str, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while _open_handles(pid, name):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_download_left_or_stalled_lets_go_of_its_file_at_once(server_factory):
    # A large file streams from an open handle: a client that hung up mid-way, or
    # stopped reading, left it open until a garbage collection (and a volume
    # with an open file does not unmount: its loop device stayed attached).
    server = server_factory(response_stall_seconds=1, max_file_bytes=16 * MiB, pool_size=1)
    pid = server.process.pid
    scope = "stalled-download"
    with server.client() as http:
        answer = http.put("/v1/files/outputs/big-download.bin", params={"scope_id": scope},
                          content=os.urandom(8 * MiB))
        assert answer.status_code == 201, answer.text
        file_id = answer.json()["id"]
    request = (f"GET /v1/files/{file_id}/content?scope_id={scope} HTTP/1.1\r\n"
               "Host: x\r\n\r\n").encode()
    address = urlsplit(server.url)
    for leave in ("hang up", "stop reading"):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((address.hostname, address.port))
        try:
            sock.sendall(request)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            deadline = time.monotonic() + 10
            while not _open_handles(pid, "big-download.bin"):
                assert time.monotonic() < deadline, "the download never opened its file"
                time.sleep(0.05)
            if leave == "hang up":
                sock.close()
            assert _handles_gone(pid, "big-download.bin"), f"{leave}: the file stayed open"
        finally:
            sock.close()
