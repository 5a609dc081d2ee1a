"""Attacks on the newer surfaces: inner tool calls, the run API, the gateway's model access.

Real ``shoal serve`` processes, real sandboxes; the scripted upstream stands in for
the paid model where a test needs one.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from httpx_sse import connect_sse

from shoal.runs import CALLBACKS_AT_ONCE
from tests.gateway.scripted_upstream import (ScriptedUpstream, anthropic_turn, message,
                                             openai_turn, text, tool_use)
from tests.gateway.test_egress import _run
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
    # Stubs waiting on refusals the host never sends would have run to the 60 s timeout
    # (run.failed, nothing printed): this end is the proof, not how soon it came.
    assert end is not None and end.get("stdout") == "1000 1200\n", end


def test_a_flood_of_refused_tool_calls_costs_the_host_no_task_each(flood_server):
    """Calls the host refuses (malformed, or past the per-call cap) were each given a
    task of their own and an answer frame, outside the cap: one 4 MiB frame of
    ``{"ref": …}`` entries made hundreds of thousands of tasks on the server's loop."""
    with flood_server.client() as http:
        session = new_session(http)
        try:
            before = _rss_kib(flood_server.process.pid)
            answer = execute(http, session, FORGE + (
                "entries = [{'ref': format(i, 'x')} for i in range(200_000)]\n"
                "msg = frame({'id': CALL_ID, 'type': 'tool_calls', 'calls': entries})\n"
                "for _ in range(4):\n"
                "    send(msg)\n"
                "print('sent', len(msg))\n"), timeout=30)
            grown = _rss_kib(flood_server.process.pid) - before
            assert answer.status == 200, answer.text[:300]
            # Whatever the host made of it, it stays a small cost to the host.
            assert grown < 100 * 1024, f"the server grew by {grown // 1024} MiB"
            # A host whose loop the refusals held took the frames in past the call's
            # own timeout: the call was cut (124) and its interpreter restarted.
            content = answer.content
            assert content["return_code"] == 0 and content["stdout"].startswith("sent "), content
            assert answer.body["interpreter_restarted"] is False, answer.body
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


ASK_WITH_SAVED_TOKEN = r"""
import json, os, subprocess
token = open('/home/agent/workspace/token.txt').read().strip()
body = json.dumps({"model": "m", "max_tokens": 8,
                   "messages": [{"role": "user", "content": "late"}]})
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
        end = _run(http, container, "python", ASK_WITH_SAVED_TOKEN)
    assert end["event"] == "run.completed", end
    assert end["stdout"] == "shoal-mt- 401\n", end
    assert len(upstream.requests) == 2, [r.body for r in upstream.requests]


INNER_CALL = r"""
import json, os, subprocess, sys
body = json.loads(sys.argv[1])
answer = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", "-X", sys.argv[2],
                         "-H", "content-type: application/json",
                         "-H", "authorization: Bearer " + os.environ["ANTHROPIC_AUTH_TOKEN"],
                         "-d", json.dumps(body), "http://shoal.internal" + sys.argv[3]],
                        capture_output=True, text=True).stdout
text, _, status = answer.rpartition("\n")
print(json.dumps({"status": status, "text": text}))
"""


def _inner(body: dict, method: str = "POST", path: str = "/v1/messages") -> str:
    """A bash command: the code calls the model API with ``body``; prints what came back."""
    return (f"cat > inner.py <<'EOF'\n{INNER_CALL}\nEOF\n"
            f"python3 inner.py {json.dumps(json.dumps(body))} {method} {path}")


def _outer_reply(command: str, seen: dict):
    """The scripted model: outer turns run ``command``; inner turns (the code's own model
    calls, told apart by their first message) run ``cat secret.txt`` once."""
    def reply(body):
        messages = body["messages"]
        results = [b for b in (messages[-1]["content"] if isinstance(messages[-1]["content"], list)
                               else []) if b.get("type") == "tool_result"]
        if "from inside" in json.dumps(messages[0]["content"]):
            if results:
                return anthropic_turn(text("inner done"))
            return anthropic_turn(tool_use("bash_code_execution", {"command": "cat secret.txt"}))
        if results:
            seen.update(json.loads(results[-1]["content"]))
            return anthropic_turn(text("done"))
        return anthropic_turn(tool_use("bash_code_execution", {"command": command}))
    return reply


@pytest.mark.parametrize("aim", ["named", "named-in-responses", "other-user"])
def test_the_codes_model_token_reaches_only_its_own_container(gateway_server, upstream, aim):
    """The token is the container's: the gateway ran the code's own model call in any
    container of the tenant it named (or in the container of any user it claimed to
    be), so code in one user's container read another user's files. A container
    named is refused; none named, the code gets one of its own (not the one it
    runs in, busy with the code that waits on the call)."""
    secret = f"SECRET-{uuid.uuid4().hex}"
    with gateway_server.client(ALPHA) as http:
        victim_user = f"bob-{uuid.uuid4().hex[:6]}"
        if aim.startswith("named"):
            created = http.post("/v1/containers", json={"name": "victim"})
            assert created.status_code == 200, created.text
            victim = created.json()["id"]
            inner = {"container": victim}
        else:  # bob's own container, keyed on his user id
            bobs = _messages_with_code(http, upstream, "echo hi", user=victim_user)
            victim = bobs["container"]["id"]
            inner = {"metadata": {"user_id": victim_user}}
        end = _run(http, victim, "python", f"open('secret.txt', 'w').write({secret!r})")
        assert end["event"] == "run.completed", end
        seen: dict = {}
        upstream.reset()
        command = _inner({"model": "m", "max_tokens": 64, "tools": [CODE_TOOL],
                          "messages": [{"role": "user", "content": "from inside"}], **inner})
        if aim == "named-in-responses":
            command = _inner({"model": "m", "input": "from inside", "tools": [
                {"type": "code_interpreter", "container": victim}]}, "POST", "/v1/responses")
        reply = _outer_reply(command, seen)
        upstream.script(*[reply] * 4)
        message = _messages(http, tools=[CODE_TOOL], metadata={"user_id": "alice"},
                            messages=[{"role": "user", "content": "go"}])
        assert message["content"][-1]["text"] == "done", message
        assert message["container"]["id"] != victim
    assert seen.get("stdout"), seen
    called = json.loads(seen["stdout"])
    assert secret not in called["text"], called
    if aim == "named":
        assert called["status"] == "403", called
        assert json.loads(called["text"])["type"] == "error", called  # Anthropic's shape
    elif aim == "named-in-responses":
        assert called["status"] == "403", called
        assert "message" in json.loads(called["text"])["error"], called  # OpenAI's shape
    else:  # served, in a container of the code's own, neither bob's nor alice's
        assert called["status"] == "200", called
        used = json.loads(called["text"])["container"]["id"]
        assert used not in (victim, message["container"]["id"]), called


def _messages_with_code(http: httpx.Client, upstream, command: str, user: str) -> dict:
    upstream.reset()
    upstream.script(anthropic_turn(tool_use("bash_code_execution", {"command": command})),
                    anthropic_turn(text("ok")))
    return _messages(http, tools=[CODE_TOOL], metadata={"user_id": user},
                     messages=[{"role": "user", "content": "hello"}])


def test_the_codes_model_token_cannot_read_or_delete_stored_responses(gateway_server, upstream):
    """The token reaches the model, not the tenant's stored responses (other users'
    conversations): GET and DELETE of /v1/responses/{id} went through."""
    seen: dict = {}
    upstream.reset()
    command = _inner({}, "GET", "/v1/responses/resp_anything")
    upstream.script(_outer_reply(command, seen), _outer_reply(command, seen))
    with gateway_server.client(ALPHA) as http:
        message = _messages(http, tools=[CODE_TOOL], messages=[{"role": "user", "content": "go"}])
    assert message["content"][-1]["text"] == "done", message
    assert json.loads(seen["stdout"])["status"] == "403", seen


@pytest.mark.parametrize("kept", ["here", "upstream", "upstream item"])
def test_the_codes_model_token_continues_only_conversations_its_code_started(
        gateway_server, upstream, kept):
    """A stored conversation of the tenant that ran no code names no container, so
    the container check let the code's own call continue it by its id: another
    user's conversation, sent to the model as the code's context. One passed
    through (no code tool) is kept by the upstream, which continued it for
    whoever named it, and filled in any of its items an input named by id."""
    tools = [{"type": "caronte:code_execution"}] if kept == "here" else []
    upstream.reset()
    upstream.script(openai_turn(message("the answer to a private question")))
    with gateway_server.client(ALPHA) as http:
        stored = http.post("/v1/responses", json={
            "model": "m", "input": "a private question", "tools": tools})
        assert stored.status_code == 200, stored.text
        seen: dict = {}
        upstream.reset()
        named = stored.json()["output"][0]["id"]
        command = _inner({"model": "m", "input": "from inside",
                          "previous_response_id": stored.json()["id"], "tools": tools}
                         if kept != "upstream item" else
                         {"model": "m", "tools": tools, "input": [
                             {"type": "item_reference", "id": named},
                             {"role": "user", "content": "from inside"}]},
                         "POST", "/v1/responses")
        outer = _outer_reply(command, seen)

        def reply(body):
            if "input" in body:  # the code's own call, had it gone through
                return openai_turn(message("continued"))
            return outer(body)
        upstream.script(*[reply] * 4)
        answer = _messages(http, tools=[CODE_TOOL], messages=[{"role": "user", "content": "go"}])
    assert answer["content"][-1]["text"] == "done", answer
    called = json.loads(seen["stdout"])
    assert called["status"] == "403", called
    assert "message" in json.loads(called["text"])["error"], called  # OpenAI's shape
    assert not any("private question" in json.dumps(request.body)
                   or request.body.get("previous_response_id") == stored.json()["id"]
                   or named in [item.get("id") for item in request.body.get("input") or []
                                if isinstance(item, dict)]
                   for request in upstream.requests), "the conversation reached the model"


# -- programmatic tools' callbacks ----------------------------------------------------------------
class _Internal(ThreadingHTTPServer):
    """A service on the host's loopback that no callback may reach by a name."""

    daemon_threads = True
    request_queue_size = 512  # every call the flood makes is taken in at once

    def __init__(self) -> None:
        self.hits = 0
        self.hosts: list[str] = []
        self.held = 0
        self.release = threading.Event()
        super().__init__(("127.0.0.1", 0), _InternalHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _InternalHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path == "/slow":  # a tool that takes its time, until the test lets it go
            self.server.held += 1
            self.server.release.wait(60)
        else:
            self.server.hits += 1
            self.server.hosts.append(self.headers.get("host"))
        body = json.dumps({"content": "INTERNAL-ONLY-ANSWER"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def internal_service():
    service = _Internal()
    yield service
    service.shutdown()
    service.server_close()


def _call_back(server, url: str, token: str | None = None, code: str | None = None,
               wait: int = 10) -> str:
    with server.client(token) as http:
        session = new_session(http)
        registered = http.post(f"/sessions/{session}/programmatic-tools/register", json={
            "callback_url": url, "token": "t",
            "tools": [{"name": "lookup", "doc": ""}], "timeout_seconds": wait})
        assert registered.status_code == 200, registered.text
        answer = execute(http, session, code or (
            "from _platform_tools import lookup, ToolError\n"
            "try:\n    print(lookup(q=1))\nexcept ToolError as e:\n    print('ToolError', e)\n"),
            timeout=30)
        http.delete(f"/sessions/{session}")
    assert answer.status == 200, answer.text
    return answer.content["stdout"]


def test_a_callback_name_that_resolves_to_a_private_address_is_refused(security_server_factory,
                                                                       internal_service):
    """Callback hosts were matched by name only, and the host's client resolved the
    name itself: an allowed name pointed by DNS at loopback (or the metadata
    service) had the host POST there and hand the answer to the code. The egress
    broker's rule holds for callbacks too: a private address is reached only where
    the operator named it literally."""
    port = internal_service.server_address[1]
    server = security_server_factory(callback_allow=f"localhost:{port}", pool_size=1)
    stdout = _call_back(server, f"http://localhost:{port}/hook")
    assert "INTERNAL-ONLY-ANSWER" not in stdout and internal_service.hits == 0, stdout
    assert stdout.startswith("ToolError") and "not allowed" in stdout, stdout
    # Named literally too, the address is the operator's choice: the call goes to the
    # address checked, under the name the client registered.
    server = security_server_factory(callback_allow=f"localhost:{port},127.0.0.1:{port}",
                                     pool_size=1)
    assert _call_back(server, f"http://localhost:{port}/hook") == "INTERNAL-ONLY-ANSWER\n"
    assert internal_service.hosts == [f"localhost:{port}"]
    server.stop()


def test_a_callback_token_that_cannot_be_a_header_is_refused_at_registration(
        security_server_factory, internal_service):
    """The sandbox never learns the token: one httpx could not send was accepted, and
    each call then failed with httpx's words quoting the header, token and all, as
    the ToolError the code read (or, past ASCII, went unanswered until its limit)."""
    port = internal_service.server_address[1]
    server = security_server_factory(callback_allow=f"127.0.0.1:{port}", pool_size=1)
    with server.client() as http:
        session = new_session(http)
        try:
            for token in ("hook-secret\nsecond-line", "hook-secret\x00", "hook-sécret"):
                registered = http.post(
                    f"/sessions/{session}/programmatic-tools/register", json={
                        "callback_url": f"http://127.0.0.1:{port}/hook", "token": token,
                        "tools": [{"name": "lookup", "doc": ""}], "timeout_seconds": 5})
                if registered.status_code == 200:  # what the code could then read
                    answer = execute(http, session, (
                        "from _platform_tools import lookup, ToolError\n"
                        "try:\n    print(lookup(q=1))\n"
                        "except ToolError as e:\n    print('ToolError', e)\n"), timeout=30)
                    assert "hook-s" not in answer.text, (repr(token), answer.text)
                assert registered.status_code == 422, (repr(token), registered.text)
                assert "hook-s" not in registered.text
        finally:
            http.delete(f"/sessions/{session}")
    server.stop()


# -- protocol v1 streaming exec -------------------------------------------------------------------
def test_streamed_execs_a_client_left_cannot_pile_up_on_a_session(flood_server):
    """A streamed exec runs on whoever listens, so its client may leave at once: each
    left a task holding its code (up to the frame cap) queued on the session, with
    no connection, slot or count to bound them; a tenant parked hundreds of
    megabytes in the server, and days of queued calls on the sandbox."""
    filler = "#" + "x" * (1 << 20) + "\n"
    with flood_server.client() as http:
        session = new_session(http)
        try:
            before = _rss_kib(flood_server.process.pid)
            statuses = []
            for number in range(150):
                code = ("import time; time.sleep(5)\n" if number == 0 else "print(1)\n") + filler
                body = {"tool": "code_execution", "input": {"code": code}}
                with http.stream("POST", f"/sessions/{session}/exec", json=body,
                                 headers={"accept": "text/event-stream"}) as answer:
                    statuses.append(answer.status_code)
            grown = _rss_kib(flood_server.process.pid) - before
            refused = [status for status in statuses if status == 429]
            assert grown < 64 * 1024 and refused, (grown // 1024, statuses)
            assert set(statuses) <= {200, 429}, statuses
            # The calls that were let in run, and the session is usable after them.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                answer = execute(http, session, "print('free')", timeout=10)
                if answer.status == 200:
                    break
                assert answer.status == 429, answer.text
                time.sleep(1)
            assert answer.status == 200 and answer.content["stdout"] == "free\n", answer.text
        finally:
            with flood_server.client() as own:
                own.delete(f"/sessions/{session}")


def test_one_tenants_slow_callbacks_do_not_hold_another_tenants(security_server_factory,
                                                                internal_service):
    """Every session's callbacks shared one connection pool of 100: a tenant whose
    code made 100 calls at once to a slow tool took all of it, and every other
    tenant's callbacks waited behind them (for up to their whole wait limit)."""
    port = internal_service.server_address[1]
    server = security_server_factory(callback_allow=f"127.0.0.1:{port}", pool_size=2,
                                     tokens="slow-token=slow,quick-token=quick")
    internal_service.release.clear()
    internal_service.held = 0
    flood = ("import asyncio\n"
             "from _platform_tools import lookup_async\n"
             "async def main():\n"
             "    return await asyncio.gather(*[lookup_async(q=i) for i in range(150)],\n"
             "                                return_exceptions=True)\n"
             "print(len(asyncio.run(main())))\n")
    slow = threading.Thread(target=_call_back, daemon=True,
                            args=(server, f"http://127.0.0.1:{port}/slow", "slow-token", flood,
                                  120))
    slow.start()
    try:
        # The flood has taken what it can: at least its own share, at most all of it.
        deadline = time.monotonic() + 10
        while internal_service.held < 100 and time.monotonic() < deadline:
            time.sleep(0.1)
        # Short of its share, the flood held too little for the quick call to wait behind it.
        assert internal_service.held >= CALLBACKS_AT_ONCE, internal_service.held
        # Held behind the flood, the quick callback would wait out its 10 s and the
        # code would print a ToolError instead.
        stdout = _call_back(server, f"http://127.0.0.1:{port}/quick", "quick-token")
        assert stdout == "INTERNAL-ONLY-ANSWER\n", stdout
    finally:
        internal_service.release.set()
        slow.join(60)


def test_a_model_token_is_refused_in_another_tenants_container_of_the_same_id():
    """Clients name their containers, so two tenants may each have a "report":
    a token was taken in any sandbox whose container had its container's id,
    and the request then ran as the token's tenant."""
    from shoal.egress.tokens import ModelTokens, TokenRefused

    tokens = ModelTokens(60, 5)
    token = tokens.issue("alpha", "report", "user-1")
    with pytest.raises(TokenRefused) as refused:
        tokens.spend(token, "beta", "report")
    assert refused.value.status == 401
    spent = tokens.spend(token, "alpha", "report")
    assert (spent.tenant, spent.container_id, spent.requests_left) == ("alpha", "report", 4)
