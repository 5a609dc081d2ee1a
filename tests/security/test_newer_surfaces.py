"""Attacks on the newer surfaces: inner tool calls, the run API, the gateway's model access.

Real ``shoal serve`` processes, real sandboxes; the scripted upstream stands in for
the paid model where a test needs one.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from httpx_sse import connect_sse

from tests.gateway.scripted_upstream import ScriptedUpstream, anthropic_turn, text, tool_use
from tests.security.helpers import execute, new_session
from tests.security.test_channel_abuse import FORGE


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def flood_server(security_server_factory):
    return security_server_factory(max_sessions=8, pool_size=1, max_timeout_seconds=60,
                                   tool_wait_seconds=10)


QUERY_TOOL = {"type": "function", "name": "lookup", "description": "Look up.",
              "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}


def test_stub_calls_past_the_cap_fail_at_once_in_the_code(flood_server):
    """The host answers only so many refusals per call: stubs refuse calls past the
    cap themselves, so real code never waits on an answer the host will not send."""
    code = ("import asyncio\n"
            "async def main():\n"
            "    return await asyncio.gather(*[lookup_async(q=str(i)) for i in range(2200)],\n"
            "                                return_exceptions=True)\n"
            "got = asyncio.run(main())\n"
            "print(sum(r == 'ok' for r in got), sum('at most 1000' in str(r) for r in got))\n")
    started = time.monotonic()
    with flood_server.client() as http, connect_sse(
            http, "POST", "/v1/code-execution/runs",
            json={"language": "python", "code": code, "tools": [QUERY_TOOL],
                  "allowed_tools": ["lookup"], "timeout_ms": 60_000}) as source:
        end = None
        for sse in source.iter_sse():
            if sse.event == "tool_call.required":
                data = sse.json()
                answered = http.post(f"/v1/code-execution/runs/{data['runId']}/tool-results",
                                     json={"results": [{"call_id": c["call_id"], "output": "ok"}
                                                       for c in data["calls"]]})
                assert answered.status_code == 200, answered.text
            elif sse.event in ("run.completed", "run.failed"):
                end = sse.json()
    assert end is not None and end.get("stdout") == "1000 1200\n", end
    assert time.monotonic() - started < 45


def test_a_flood_of_refused_tool_calls_costs_the_host_no_task_each(flood_server):
    """Calls the host refuses (malformed, or past the per-call cap) were each given a
    task of their own and an answer frame, outside the cap: one 4 MiB frame of
    ``{"ref": …}`` entries made hundreds of thousands of tasks on the server's loop."""
    with flood_server.client() as http:
        session = new_session(http)
        try:
            before = _rss_kib(flood_server.process.pid)
            started = time.monotonic()
            answer = execute(http, session, FORGE + (
                "entries = [{'ref': format(i, 'x')} for i in range(200_000)]\n"
                "msg = frame({'id': CALL_ID, 'type': 'tool_calls', 'calls': entries})\n"
                "for _ in range(4):\n"
                "    send(msg)\n"
                "print('sent', len(msg))\n"), timeout=30)
            elapsed = time.monotonic() - started
            grown = _rss_kib(flood_server.process.pid) - before
            assert answer.status == 200, answer.text[:300]
            # Whatever the host made of it, it stays a small cost to the host.
            assert grown < 100 * 1024, f"the server grew by {grown // 1024} MiB"
            assert elapsed < 15, elapsed
            with httpx.Client(base_url=flood_server.url, timeout=10) as other:
                assert other.get("/health").status_code == 200
        finally:
            with flood_server.client() as own:
                own.delete(f"/sessions/{session}")


# -- the sandbox's model access ----------------------------------------------------------------
ALPHA, BETA = "newer-alpha-token", "newer-beta-token"
OPERATOR_KEY = "newer-operator-upstream-key"
CODE_TOOL = {"type": "code_execution_20250825", "name": "code_execution"}


@pytest.fixture(scope="module")
def upstream():
    with ScriptedUpstream() as scripted:
        yield scripted


@pytest.fixture(scope="module")
def gateway_server(security_server_factory, upstream):
    return security_server_factory(
        upstream_anthropic_url=upstream.url, upstream_anthropic_key=OPERATOR_KEY,
        upstream_openai_url=upstream.url, upstream_openai_key=OPERATOR_KEY,
        tokens=f"{ALPHA}=alpha,{BETA}=beta", pool_size=1, model_token_seconds=600)


def _messages(http: httpx.Client, **body) -> dict:
    answer = http.post("/v1/messages", json={"model": "m", "max_tokens": 64, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _run_python(http: httpx.Client, container: str, code: str) -> dict:
    with connect_sse(http, "POST", "/v1/code-execution/runs", json={
            "language": "python", "code": code, "container": container,
            "timeout_ms": 60_000}) as source:
        assert source.response.status_code == 200, source.response.read()
        ends = [{"event": sse.event, **sse.json()} for sse in source.iter_sse()
                if sse.event in ("run.completed", "run.failed")]
    assert len(ends) == 1, ends
    return ends[0]


ASK_WITH_SAVED_TOKEN = r"""
import json, os, subprocess
token = open('/home/agent/workspace/token.txt').read().strip()
body = json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "late"}]})
code = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                       "-H", "content-type: application/json",
                       "-H", f"authorization: Bearer {token}", "-d", body,
                       "http://shoal.internal/v1/messages"], capture_output=True, text=True)
print(token[:9], code.stdout)
"""


def test_a_model_token_dies_with_the_run_it_was_issued_for(gateway_server, upstream):
    """A token was good for its whole lifetime (15 minutes), after the request that
    ran the code had ended: anything the code left in its container (the token in a
    file, a background job) called the model as that request's user, from later runs
    that were given no model access at all."""
    upstream.reset()
    upstream.script(
        anthropic_turn(tool_use("bash_code_execution", {
            "command": "echo \"$ANTHROPIC_AUTH_TOKEN\" > token.txt; echo saved"})),
        anthropic_turn(text("done")),
        anthropic_turn(text("a late answer")))
    with gateway_server.client(ALPHA) as http:
        message = _messages(http, tools=[CODE_TOOL],
                            messages=[{"role": "user", "content": "go"}])
        assert message["content"][-1]["text"] == "done", message
        container = message["container"]["id"]
        # A later run on the same container, with no model access of its own.
        end = _run_python(http, container, ASK_WITH_SAVED_TOKEN)
    assert end["event"] == "run.completed", end
    assert end["stdout"] == "shoal-mt- 401\n", end
    assert len(upstream.requests) == 2, [r.body for r in upstream.requests]
