"""HTTP benchmark over loopback: prints figures, asserts nothing.

    .venv/bin/python bench/http_bench.py [--sessions 32] [--seconds 10]

Starts a real ``shoal serve`` and drives it with a minimal keep-alive HTTP/1.1
client (raw asyncio streams, so the client spends as little of the machine's
two cores as possible). Prints create-session p50/p99, first-exec p50/p99,
trivial exec p50/p99 and exec throughput with N concurrent sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.serving import start_server  # noqa: E402

TRIVIAL = json.dumps({"tool": "code_execution", "input": {"code": "x = 1"}}).encode()


class Connection:
    """One keep-alive HTTP/1.1 connection; enough protocol for this benchmark."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> "Connection":
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        head = (f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        return status, await self.reader.readexactly(length) if length else b""

    def close(self) -> None:
        self.writer.close()


def summary(name: str, samples_ms: list[float]) -> None:
    ordered = sorted(samples_ms)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    print(f"{name:<34} p50 {statistics.median(ordered):8.3f} ms   p99 {p99:8.3f} ms"
          f"   (n={len(ordered)})", flush=True)


async def wait_for_pool(connection: Connection, size: int) -> None:
    while True:
        _, body = await connection.request("GET", "/health")
        if json.loads(body)["pool_ready"] >= size:
            return
        await asyncio.sleep(0.2)


async def run(port: int, sessions: int, seconds: float, pool_size: int) -> None:
    control = await Connection.open(port)
    print("... waiting for the warm pool", file=sys.stderr, flush=True)
    await wait_for_pool(control, pool_size)

    create_ms, ids = [], []
    for _ in range(sessions):
        t0 = time.perf_counter()
        status, body = await control.request("POST", "/sessions", b"{}")
        create_ms.append((time.perf_counter() - t0) * 1000)
        assert status == 201, body
        ids.append(json.loads(body)["session_id"])
    summary("create session", create_ms)

    first_ms = []
    for session_id in ids:
        t0 = time.perf_counter()
        status, body = await control.request("POST", f"/sessions/{session_id}/exec", TRIVIAL)
        first_ms.append((time.perf_counter() - t0) * 1000)
        assert status == 200, body
    summary("first exec in a session", first_ms)

    print("... letting the pool refill before timing execs", file=sys.stderr, flush=True)
    await wait_for_pool(control, pool_size)
    trivial_ms = []
    for _ in range(200):
        await control.request("POST", f"/sessions/{ids[0]}/exec", TRIVIAL)
    for _ in range(2000):
        t0 = time.perf_counter()
        status, _ = await control.request("POST", f"/sessions/{ids[0]}/exec", TRIVIAL)
        trivial_ms.append((time.perf_counter() - t0) * 1000)
    summary("trivial exec (x = 1)", trivial_ms)

    connections = [await Connection.open(port) for _ in ids]
    done = 0
    errors = 0
    deadline = time.perf_counter() + seconds

    async def worker(connection: Connection, session_id: str) -> None:
        nonlocal done, errors
        while time.perf_counter() < deadline:
            status, _ = await connection.request("POST", f"/sessions/{session_id}/exec", TRIVIAL)
            done += 1
            errors += status != 200

    started = time.perf_counter()
    await asyncio.gather(*(worker(c, s) for c, s in zip(connections, ids)))
    elapsed = time.perf_counter() - started
    print(f"{'throughput, ' + str(len(ids)) + ' concurrent sessions':<34} "
          f"{done / elapsed:8.0f} execs/s   ({done} execs in {elapsed:.1f} s, {errors} errors)")

    control.close()  # idle through the run: the server's keep-alive timeout closed it
    control = await Connection.open(port)
    for session_id in ids:
        await control.request("DELETE", f"/sessions/{session_id}")
    for connection in (*connections, control):
        connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10)
    args = parser.parse_args()
    pool_size = args.sessions + 8
    with tempfile.TemporaryDirectory() as scratch:
        server = start_server(Path(scratch), uid_base=900_000, pool_size=pool_size,
                              max_sessions=args.sessions + 16)
        try:
            port = int(server.url.rsplit(":", 1)[1])
            asyncio.run(run(port, args.sessions, args.seconds, pool_size))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
