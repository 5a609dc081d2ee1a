"""Runs API benchmark over loopback: prints figures, asserts nothing.

    .venv/bin/python bench/runs_bench.py [--runs 200] [--launcher bwrap|zygote]

(the launcher defaults to the server's own default, the zygote)

Starts a real ``shoal serve`` and measures, with one keep-alive ``httpx``
client for every figure (so the client's own cost is the same in each):

- ``/health`` p50, the yardstick every other figure is divided by;
- the first request to reach the runs API after the start (one sample);
- a Python run, ``print(1)``: POST to ``run.completed``, p50 and p99, each
  started once the pool is full again (the steady state of a server whose
  requests arrive slower than it refills: the refill the previous run set off
  is over), after an idle wait, and again with that wait spent on /health
  requests (as /health's own figure is taken: back to back, every cache warm),
  and back to back (saturated: each run races the refill the one before it
  set off, on this machine's two cores);
- a JavaScript run (Bun), ``console.log(1)``: the same two ways;
- an inner tool call's round trip, timed inside the sandbox around the stub
  call, with a client that answers each ``tool_call.required`` at once: p50
  and p99; and what of it the client's own POST took.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from httpx_sse import connect_sse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.serving import start_server  # noqa: E402

TOOL = {"type": "function", "name": "echo", "parameters": {"type": "object"}}


def p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def line(name: str, samples_ms: list[float], health_p50: float) -> None:
    p50 = statistics.median(samples_ms)
    print(f"{name:<38} p50 {p50:8.2f} ms ({p50 / health_p50:5.1f}x /health)   "
          f"p99 {p(samples_ms, 0.99):8.2f} ms   (n={len(samples_ms)})", flush=True)


def wait_warm(http: httpx.Client, size: int) -> None:
    while http.get("/health").json()["pool_ready"] < size:
        time.sleep(0.01)


def settled(http: httpx.Client, size: int) -> None:
    """The pool full, and the last launch's own tail (its warm call) over."""
    wait_warm(http, size)
    time.sleep(0.02)


def settled_busy(http: httpx.Client, size: int) -> None:
    """The same wait, spent asking /health instead of sleeping: the server (and
    this client) stay warm, as under other traffic; the sandbox leased is still
    one that sat idle in the pool."""
    while http.get("/health").json()["pool_ready"] < size:
        pass
    end = time.perf_counter() + 0.02
    while time.perf_counter() < end:
        http.get("/health")


def run_once(http: httpx.Client, body: dict, warm: int = 0, busy: bool = False) -> float:
    if warm:
        (settled_busy if busy else settled)(http, warm)
    started = time.perf_counter()
    with connect_sse(http, "POST", "/v1/code-execution/runs", json=body) as source:
        for sse in source.iter_sse():
            if sse.event == "run.completed":
                elapsed = (time.perf_counter() - started) * 1000
            elif sse.event == "run.failed":
                raise RuntimeError(sse.data)
    return elapsed


def tool_round_trips(http: httpx.Client, calls: int) -> tuple[list[float], list[float]]:
    code = ("import time\nsamples = []\n"
            f"for i in range({calls}):\n"
            "    t = time.perf_counter(); echo(i=i); samples.append((time.perf_counter() - t) * 1000)\n"
            "print(samples)")
    posts = []
    with connect_sse(http, "POST", "/v1/code-execution/runs",
                     json={"code": code, "tools": [TOOL], "allowed_tools": ["echo"],
                           "timeout_ms": 120_000}) as source:
        for sse in source.iter_sse():
            if sse.event == "tool_call.required":
                data = sse.json()
                started = time.perf_counter()
                http.post(f"/v1/code-execution/runs/{data['runId']}/tool-results",
                          json={"results": [{"call_id": c["call_id"], "output": "ok"}
                                            for c in data["calls"]]})
                posts.append((time.perf_counter() - started) * 1000)
            elif sse.event == "run.completed":
                inside = json.loads(sse.json()["stdout"])
            elif sse.event == "run.failed":
                raise RuntimeError(sse.data)
    return inside, posts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--launcher", default=None,
                        help="bwrap or zygote; default: the server's own default (zygote)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        chosen = {"launcher": args.launcher} if args.launcher else {}
        server = start_server(Path(scratch), uid_base=910_000, pool_size=4, max_sessions=16,
                              **chosen)
        try:
            with httpx.Client(base_url=server.url, timeout=60) as http:
                wait_warm(http, 4)
                # Once: the first request to reach the runs API after the start
                # (FastAPI builds a router's routes on first use unless the server
                # built them at start).
                started = time.perf_counter()
                http.get("/v1/code-execution/runs/cexrun_none")
                first = (time.perf_counter() - started) * 1000
                for _ in range(200):
                    http.get("/health")
                health = []
                for _ in range(2000):
                    started = time.perf_counter()
                    http.get("/health")
                    health.append((time.perf_counter() - started) * 1000)
                health_p50 = statistics.median(health)
                print(f"{'/health':<38} p50 {health_p50:8.2f} ms   p99 {p(health, 0.99):8.2f} ms",
                      flush=True)
                print(f"{'first request to the runs API':<38}     {first:8.2f} ms "
                      f"({first / health_p50:5.1f}x /health, one sample, after the start)", flush=True)
                python_body = {"language": "python", "code": "print(1)"}
                python = [run_once(http, python_body, warm=4) for _ in range(args.runs)]
                line("Python run, print(1)", python, health_p50)
                busy = [run_once(http, python_body, warm=4, busy=True) for _ in range(args.runs)]
                line("  the server kept busy between runs", busy, health_p50)
                settled(http, 4)
                burst = [run_once(http, python_body) for _ in range(20)]
                line("  back to back (pool refill paces it)", burst, health_p50)
                js_body = {"language": "javascript", "code": "console.log(1)"}
                javascript = [run_once(http, js_body, warm=4) for _ in range(max(20, args.runs // 4))]
                line("JavaScript run (Bun), console.log(1)", javascript, health_p50)
                settled(http, 4)
                burst = [run_once(http, js_body) for _ in range(20)]
                line("  back to back (pool refill paces it)", burst, health_p50)
                inside, posts = tool_round_trips(http, 300)
                line("inner tool call round trip", inside[20:], health_p50)
                line("  of which the client's POST", posts[20:], health_p50)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
