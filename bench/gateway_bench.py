"""Gateway benchmark: Shoal's own time per tool-loop iteration, and time to first byte.

    .venv/bin/python bench/gateway_bench.py [--requests 100] [--round-trips 3]

Starts the scripted upstream model (tests/gateway/scripted_upstream.py) and a
real ``shoal serve`` in front of it, and prints, for each dialect:

- the gateway's overhead per loop iteration (one upstream call and the code
  call it asks for): what the server reports in its ``Server-Timing`` header as
  time spent neither waiting for the upstream nor running code in the sandbox,
  divided by the request's iterations, p50 and p99 over the requests;
- the whole request, for scale;
- time to the first streamed byte through Shoal, and straight from the upstream.

Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gateway.scripted_upstream import (ScriptedUpstream, anthropic_turn, function_call,  # noqa: E402
                                             message, openai_turn, text, tool_use)
from tests.serving import start_server  # noqa: E402


def p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def report(name: str, samples: list[float]) -> None:
    print(f"{name:<52} p50 {statistics.median(samples):8.3f} ms   p99 {p(samples, 0.99):8.3f} ms"
          f"   (n={len(samples)})", flush=True)


def gateway_ms(response: httpx.Response) -> float:
    for metric in response.headers["server-timing"].split(","):
        name, *params = [part.strip() for part in metric.split(";")]
        if name == "gateway":
            return float(next(v for v in params if v.startswith("dur="))[4:])
    raise ValueError("no gateway timing")


def first_byte(client: httpx.Client, url: str, body: dict) -> float:
    started = time.perf_counter()
    elapsed = None
    with client.stream("POST", url, json=body) as response:
        for _ in response.iter_raw():
            if elapsed is None:
                elapsed = (time.perf_counter() - started) * 1000
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--round-trips", type=int, default=3)
    args = parser.parse_args()
    k = args.round_trips
    with ScriptedUpstream() as upstream, tempfile.TemporaryDirectory() as scratch:
        server = start_server(Path(scratch), uid_base=940_000, pool_size=2,
                              upstream_anthropic_url=upstream.url, upstream_anthropic_key="k",
                              upstream_openai_url=upstream.url, upstream_openai_key="k")
        try:
            with httpx.Client(base_url=server.url, timeout=120) as http:
                anthropic_body = {"model": "m", "max_tokens": 64, "container": "bench-anthropic",
                                  "tools": [{"type": "code_execution_20250825", "name": "code_execution"}],
                                  "messages": [{"role": "user", "content": "go"}]}
                openai_body = {"model": "m", "input": "go",
                               "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}
                overhead = {"anthropic": [], "openai": []}
                totals = {"anthropic": [], "openai": []}
                for index in range(args.requests + 10):
                    upstream.script(*[anthropic_turn(tool_use("bash_code_execution", {"command": "true"}))
                                      for _ in range(k)], anthropic_turn(text("done")))
                    started = time.perf_counter()
                    response = http.post("/v1/messages", json=anthropic_body)
                    total = (time.perf_counter() - started) * 1000
                    response.raise_for_status()
                    if index >= 10:  # the first requests start the container's sandbox
                        overhead["anthropic"].append(gateway_ms(response) / (k + 1))
                        totals["anthropic"].append(total)
                previous = None
                for index in range(args.requests + 10):
                    upstream.script(*[openai_turn(function_call("code_interpreter", {"code": "x = 1"}))
                                      for _ in range(k)], openai_turn(message("done")))
                    body = {**openai_body, **({"previous_response_id": previous} if previous else {})}
                    started = time.perf_counter()
                    response = http.post("/v1/responses", json=body)
                    total = (time.perf_counter() - started) * 1000
                    response.raise_for_status()
                    previous = response.json()["id"]
                    if index >= 10:
                        overhead["openai"].append(gateway_ms(response) / (k + 1))
                        totals["openai"].append(total)
                print(f"({k} code calls per request: {k + 1} loop iterations)")
                for dialect in ("anthropic", "openai"):
                    report(f"{dialect}: gateway overhead per loop iteration", overhead[dialect])
                    report(f"{dialect}: whole request", totals[dialect])
                with httpx.Client(timeout=60) as direct:
                    for dialect, path, turn, body in (
                            ("anthropic", "/v1/messages", lambda: anthropic_turn(text("hello " * 20)),
                             {**anthropic_body, "stream": True}),
                            ("openai", "/v1/responses", lambda: openai_turn(message("hello " * 20)),
                             {**openai_body, "stream": True})):
                        through, straight = [], []
                        for _ in range(args.requests):
                            upstream.script(turn())
                            through.append(first_byte(http, path, body))
                            upstream.script(turn())
                            straight.append(first_byte(direct, upstream.url + path, body))
                        report(f"{dialect}: first streamed byte through Shoal", through)
                        report(f"{dialect}: first streamed byte from the upstream", straight)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
