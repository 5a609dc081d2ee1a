"""Egress benchmark: what the sandbox's proxy path adds. Prints figures, asserts nothing.

    .venv/bin/python bench/egress_bench.py [--requests 300] [--megabytes 64]

Starts a host service on loopback and a real ``shoal serve`` that allows it
(``--egress-allow 127.0.0.1:PORT``), and measures with the same client code
(``http.client``, a new connection per request, as a proxied request has):

- ``/health`` p50 of the server, the yardstick;
- a direct loopback request to the service, from the host: p50, p99;
- the same request from inside a sandbox, through the relay and the broker
  (``GET http://127.0.0.1:PORT/`` in absolute form to the relay): p50, p99, and
  the p50 it adds (target: at most 1 ms);
- a body of ``--megabytes`` MB, direct and proxied: MB/s (proxied at the
  server's default ``egress_bytes_per_second``, 64 MiB/s a sandbox, unless
  ``--rate`` sets another: ``--rate 0`` leaves it past what loopback moves, to
  measure the path itself).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from httpx_sse import connect_sse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.runs_bench import p as pct  # noqa: E402
from tests.serving import start_server  # noqa: E402

_BLOCK = b"x" * (1 << 20)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802
        size = int(self.path.rsplit("/", 1)[-1] or 0) if self.path.startswith("/bytes/") else 2
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        while size > 0:
            chunk = _BLOCK[:min(size, len(_BLOCK))]
            self.wfile.write(chunk)
            size -= len(chunk)

    def log_message(self, *args) -> None:
        pass


# The same measuring code runs on the host and in the sandbox.
CLIENT = """
import http.client, json, time
def measure(host, port, proxy, requests, megabytes):
    def once(path):
        if proxy:
            c = http.client.HTTPConnection(*proxy); target = f"http://{host}:{port}{path}"
        else:
            c = http.client.HTTPConnection(host, port); target = path
        c.request("GET", target); r = c.getresponse(); n = len(r.read()); c.close(); return n
    samples = []
    for _ in range(requests):
        t = time.perf_counter(); once("/"); samples.append((time.perf_counter() - t) * 1000)
    size = megabytes << 20
    t = time.perf_counter(); got = once(f"/bytes/{size}"); spent = time.perf_counter() - t
    assert got == size, got
    return {"samples": samples, "mb_per_s": megabytes / spent}
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--megabytes", type=int, default=64)
    parser.add_argument("--launcher", default=None)
    parser.add_argument("--rate", type=int, default=None,
                        help="egress_bytes_per_second for the server; 0: 1 TB/s")
    args = parser.parse_args()

    service = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    service.daemon_threads = True
    threading.Thread(target=service.serve_forever, daemon=True).start()
    port = service.server_address[1]

    settings = {"egress_allow": f"127.0.0.1:{port}", "pool_size": 1}
    if args.launcher:
        settings["launcher"] = args.launcher
    if args.rate is not None:
        settings["egress_bytes_per_second"] = args.rate or 10**12
    server = start_server(Path(tempfile.mkdtemp(prefix="shoal-egress-bench-")), 700_000_000,
                          **settings)
    try:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            health = []
            for _ in range(300):
                t = time.perf_counter()
                client.get("/health")
                health.append((time.perf_counter() - t) * 1000)
            health_p50 = statistics.median(health)

            scope: dict = {}
            exec(CLIENT, scope)
            scope["measure"]("127.0.0.1", port, None, 20, 1)  # warm
            direct = scope["measure"]("127.0.0.1", port, None, args.requests, args.megabytes)

            container = client.post("/v1/containers", json={"name": "bench"}).json()["id"]
            code = (CLIENT + f"\nmeasure('127.0.0.1', {port}, ('127.0.0.1', 3128), 20, 1)\n"
                    f"print(json.dumps(measure('127.0.0.1', {port}, ('127.0.0.1', 3128), "
                    f"{args.requests}, {args.megabytes})))\n")
            with connect_sse(client, "POST", "/v1/code-execution/runs",
                             json={"code": code, "container": container,
                                   "timeout_ms": 300_000}) as source:
                end = [sse.json() for sse in source.iter_sse()
                       if sse.event in ("run.completed", "run.failed")][0]
            if end.get("exit_code") != 0:
                raise SystemExit(f"the sandbox's run failed: {end}")
            proxied = json.loads(end["stdout"])
    finally:
        server.stop()
        service.shutdown()

    print(f"/health p50                          {health_p50:8.3f} ms")
    for name, figures in (("direct loopback request", direct), ("proxied request (sandbox)", proxied)):
        p50 = statistics.median(figures["samples"])
        print(f"{name:<36} p50 {p50:8.3f} ms ({p50 / health_p50:4.1f}x /health)   "
              f"p99 {pct(figures['samples'], 0.99):8.3f} ms   (n={len(figures['samples'])})")
    added = statistics.median(proxied["samples"]) - statistics.median(direct["samples"])
    print(f"added by the proxy path              p50 {added:8.3f} ms   (target <= 1 ms)")
    print(f"throughput, {args.megabytes} MB body: direct {direct['mb_per_s']:8.1f} MB/s   "
          f"proxied {proxied['mb_per_s']:8.1f} MB/s")


if __name__ == "__main__":
    main()
