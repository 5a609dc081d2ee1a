"""Protocol v1's additive extensions, over real HTTP: JavaScript, streaming exec,
and the reference backend's programmatic tools with a real callback server.

None of these change the v1 shapes: a client that does not ask for them gets
exactly what the contract says (checked against the contract's own schemas).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from httpx_sse import connect_sse

from tests.serving import free_port


@pytest.fixture(scope="module")
def callback_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def extension_server(server_factory, callback_port):
    return server_factory(callback_allow=f"127.0.0.1:{callback_port}", pool_size=2)


@pytest.fixture
def http(extension_server):
    with extension_server.client() as client:
        yield client


@pytest.fixture
def session(http):
    session_id = http.post("/sessions", json={}).json()["session_id"]
    yield session_id
    http.delete(f"/sessions/{session_id}")


def exec_code(http, session, code, **input_fields):
    return http.post(f"/sessions/{session}/exec", json={
        "tool": "code_execution", "input": {"code": code, **input_fields}})


# -- JavaScript ---------------------------------------------------------------------------------
def test_input_language_javascript_runs_on_bun(http, session, schema_errors):
    response = exec_code(http, session, "console.log(typeof Bun, [1, 2, 3].map(x => x * 2))",
                         language="javascript")
    assert response.status_code == 200, response.text
    assert schema_errors("ExecResponse", response.json()) == []
    content = response.json()["result_block"]["content"]
    assert content["stdout"] == "object [ 2, 4, 6 ]\n" and content["return_code"] == 0


def test_python_stays_the_default_and_keeps_its_state(http, session):
    exec_code(http, session, "kept = 41")
    assert exec_code(http, session, "kept + 1").json()["result_block"]["content"]["stdout"] == "42\n"
    explicit = exec_code(http, session, "kept + 2", language="python")
    assert explicit.json()["result_block"]["content"]["stdout"] == "43\n"


@pytest.mark.parametrize("language", ["ruby", "JavaScript", "", 3, None])
def test_an_unknown_language_is_a_422(http, session, language):
    response = exec_code(http, session, "1", language=language)
    assert response.status_code == 422, response.text
    assert "language" in response.json()["detail"]


# -- streaming exec -----------------------------------------------------------------------------
def test_exec_streams_output_then_the_v1_envelope(http, session, schema_errors):
    stamps, events = {}, []
    body = {"tool": "code_execution", "tool_use_id": "toolu_stream",
            "input": {"code": "import time\nprint('a', flush=True)\ntime.sleep(1)\nprint('b')"}}
    with connect_sse(http, "POST", f"/sessions/{session}/exec", json=body) as source:
        assert source.response.headers["content-type"].startswith("text/event-stream")
        for sse in source.iter_sse():
            events.append(sse)
            stamps.setdefault(sse.event, time.monotonic())
    assert [e.event for e in events] == ["output", "output", "result"]
    assert events[0].json() == {"stream": "stdout", "text": "a\n"}
    assert stamps["result"] - stamps["output"] >= 0.5
    envelope = events[-1].json()
    assert schema_errors("ExecResponse", envelope) == []
    assert envelope["tool_use_id"] == "toolu_stream"
    assert envelope["result_block"]["content"]["stdout"] == "a\nb\n"
    assert all(e.id for e in events)


def test_a_streamed_exec_cut_off_says_so_as_the_json_answer_would(http, session):
    # The error event carried the exception's own text, an internal sandbox name
    # in it ("sandbox 31301.f82284-48 was closed during the call").
    body = {"tool": "code_execution", "input": {"code": "import time\nprint('a', flush=True)\n"
                                                        "time.sleep(30)"}}
    events = []
    with connect_sse(http, "POST", f"/sessions/{session}/exec", json=body) as source:
        for sse in source.iter_sse():
            events.append(sse)
            if sse.event == "output":
                assert http.delete(f"/sessions/{session}").status_code == 204
    assert [e.event for e in events] == ["output", "error"], [e.event for e in events]
    error = events[-1].json()
    assert error["status"] == 404 and error["detail"].startswith("the session ended while the call "
                                                                 "ran"), error


def test_a_streamed_execs_events_are_held_to_the_run_log_budget(server_factory):
    # Code runs in the agent's process and can send output frames of one
    # character each: every one was an event held in the stream's log, ~230
    # bytes of host memory per byte of output (1 MB of it took 227 MiB), with no
    # bound. The log has a run's budget now; the result still carries it all.
    server = server_factory(run_log_bytes=1 << 20, pool_size=1)
    frames = 20_000
    code = ("import gc\n"
            "agent = next(o for o in gc.get_objects()\n"
            "             if type(o).__name__ == 'Agent' and hasattr(o, '_current'))\n"
            f"for _ in range({frames}):\n"
            "    agent.send({'id': agent._current, 'type': 'out', 'stream': 'stdout', 'data': 'x'})\n")
    with server.client() as http:
        session = http.post("/sessions", json={}).json()["session_id"]
        events = []
        body = {"tool": "code_execution", "input": {"code": code}}
        with connect_sse(http, "POST", f"/sessions/{session}/exec", json=body) as source:
            events = [(sse.event, sse.data) for sse in source.iter_sse()]
        outputs = [data for event, data in events if event == "output"]
        assert events[-1][0] == "result", events[-1]
        assert json.loads(events[-1][1])["result_block"]["content"]["stdout"] == "x" * frames
        assert 0 < len(outputs) < frames // 2  # the rest past the budget, left out
        http.delete(f"/sessions/{session}")


def test_without_the_header_nothing_changes(http, session, schema_errors):
    response = exec_code(http, session, "print(1)")
    assert response.headers["content-type"].startswith("application/json")
    assert schema_errors("ExecResponse", response.json()) == []


# -- programmatic tools -------------------------------------------------------------------------
class _Callback(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802 - the stdlib's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        _Callback.received.append({"body": body, "auth": self.headers.get("authorization")})
        name = body["name"]
        if name == "broken":
            self.send_response(500)
            self.end_headers()
            return
        if name == "huge":  # more than any result may be: 6 MiB of valid JSON
            answer = {"content": "x" * (6 * 1024 * 1024)}
        elif name == "refuses":
            answer = {"is_error": True, "content": "no such mailbox"}
        else:
            answer = {"content": {"echo": body["input"], "call_id": body["call_id"]}}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def callback(callback_port):
    server = ThreadingHTTPServer(("127.0.0.1", callback_port), _Callback)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{callback_port}/tools"
    server.shutdown()
    server.server_close()


def register(http, session, url, **extra):
    return http.post(f"/sessions/{session}/programmatic-tools/register", json={
        "callback_url": url, "token": "cb-secret",
        "tools": [{"name": "gmail_list_emails", "doc": "List emails."},
                  {"name": "refuses", "doc": ""}, {"name": "broken", "doc": ""},
                  {"name": "huge", "doc": ""}], **extra})


def test_programmatic_tools_call_back_through_the_host(http, session, callback):
    _Callback.received.clear()
    response = register(http, session, callback, timeout_seconds=10)
    assert response.status_code == 200, response.text
    assert response.json() == {"stub_path": "_platform_tools", "tool_count": 4}
    result = exec_code(http, session, (
        "from _platform_tools import gmail_list_emails, refuses, broken, ToolError\n"
        "print(gmail_list_emails(folder='inbox', limit=2)['echo'])\n"
        "for tool in (refuses, broken):\n"
        "    try:\n        tool()\n    except ToolError as e:\n        print('ToolError', e)\n"))
    content = result.json()["result_block"]["content"]
    assert content["stdout"] == ("{'folder': 'inbox', 'limit': 2}\n"
                                 "ToolError no such mailbox\n"
                                 "ToolError tool 'broken' failed: HTTP 500\n"), content
    first = _Callback.received[0]
    assert first["auth"] == "Bearer cb-secret"
    assert first["body"]["name"] == "gmail_list_emails"
    assert first["body"]["input"] == {"folder": "inbox", "limit": 2}
    assert len(first["body"]["call_id"]) >= 16
    # The sandbox never sees the URL or the token: neither is anywhere in the
    # interpreter's objects (the needles are spelled in hex so the probe's own
    # source does not contain them; the source cache is skipped all the same).
    probe = (
        "def scan(needles):\n"
        "    import gc, linecache\n"
        "    found = set()\n"
        "    for o in gc.get_objects():\n"
        "        if o is linecache.cache:\n            continue\n"
        "        try:\n            text = repr(o)\n        except Exception:\n            continue\n"
        "        found |= {n for n in needles if bytes.fromhex(n).decode() in text}\n"
        "    return sorted(found)\n"
        f"print(scan([{'cb-secret'.encode().hex()!r}, {callback.encode().hex()!r}]))\n")
    leak = exec_code(http, session, probe)
    assert leak.json()["result_block"]["content"]["stdout"] == "[]\n", leak.json()
    # The probe can find a needle that is there: the control.
    control = exec_code(http, session, "marker = bytes.fromhex('6d61726b6572').decode() * 2\n"
                        + probe.replace("print(scan([", "print(scan(['6d61726b65726d61726b6572', "))
    assert "6d61726b65726d61726b6572" in control.json()["result_block"]["content"]["stdout"]


def test_a_callback_that_answers_too_much_fails_its_call_at_once(http, session, callback):
    # The host read the whole answer into memory (300 MB held 860 MB of the
    # server), and a result over a frame was then dropped: the code waited out
    # its limit. Now the read stops at the cap and the code hears why.
    assert register(http, session, callback, timeout_seconds=60).status_code == 200
    started = time.monotonic()
    result = exec_code(http, session, (
        "from _platform_tools import huge, ToolError\n"
        "try:\n    huge()\nexcept ToolError as e:\n    print('ToolError', e)\n"))
    assert time.monotonic() - started < 30
    stdout = result.json()["result_block"]["content"]["stdout"]
    assert stdout.startswith("ToolError tool 'huge' answered more than"), stdout


def test_a_callback_host_the_operator_did_not_allow_is_refused(http, session, callback):
    for url in ("http://127.0.0.1:1/tools", "http://example.com/tools",
                "http://169.254.169.254/latest/meta-data"):
        response = register(http, session, url)
        assert response.status_code == 403, response.text
        assert "not allowed" in response.json()["detail"]
    for bad in ("ftp://127.0.0.1/x", "", None, "not a url",
                # Each was a 500: urlsplit and its port raise on these.
                "http://127.0.0.1:99999/", "http://127.0.0.1:abc/", "http://[::1/",
                f"{callback} /", f"{callback}\n"):
        answer = register(http, session, bad)
        assert answer.status_code == 422, (bad, answer.text)
    assert http.post(f"/sessions/{session}/programmatic-tools/register", json={
        "callback_url": callback, "token": "t", "tools": [{"name": "import"}]}).status_code == 422
    assert http.post("/sessions/nope/programmatic-tools/register", json={
        "callback_url": callback, "token": "t", "tools": [{"name": "x"}]}).status_code == 404


def test_a_session_without_registration_has_no_platform_tools(http, session):
    result = exec_code(http, session, "import _platform_tools")
    content = result.json()["result_block"]["content"]
    assert content["return_code"] == 1 and "ModuleNotFoundError" in content["stderr"]
