"""Caronte's direct run API (``/v1/code-execution/runs``) over real HTTP and SSE.

Every run here executes in a real sandbox of a real ``shoal serve``; the
streams are read with ``httpx-sse``, a real SSE client, so the event grammar
(``event:``, ``id:``, ``data:`` lines, the ``[DONE]`` sentinel) is checked as a
client parses it, not as the server meant it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from httpx_sse import EventSource, connect_sse

from shoal.runs.broker import Grant, InvalidTools, ToolSpec

OUTPUT_CAP = 64 * 1024
TOOL_WAIT_SECONDS = 3
PING_SECONDS = 0.5

QUERY_TOOL = {"type": "function", "name": "advanced_query", "description": "Run SQL.",
              "parameters": {"type": "object", "properties": {"sql": {"type": "string"}},
                             "required": ["sql"], "additionalProperties": False}}
SECRET_TOOL = {"type": "function", "name": "delete_everything", "description": "Not for code.",
               "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def runs_server(server_factory):
    return server_factory(output_cap_bytes=OUTPUT_CAP, tool_wait_seconds=TOOL_WAIT_SECONDS,
                          max_sessions=16, pool_size=2)


@pytest.fixture
def http(runs_server):
    with runs_server.client() as client:
        yield client


@contextmanager
def run_stream(http: httpx.Client, **body):
    with connect_sse(http, "POST", "/v1/code-execution/runs", json=body) as source:
        assert source.response.status_code == 200, source.response.read()
        assert source.response.headers["content-type"].startswith("text/event-stream")
        yield source


def collect(http: httpx.Client, answer=None, **body) -> list:
    """Every event of a run, answering tool calls with ``answer(call) -> output``."""
    events = []
    with run_stream(http, **body) as source:
        for sse in source.iter_sse():
            events.append(sse)
            if sse.event == "tool_call.required" and answer is not None:
                data = sse.json()
                results = [{"call_id": c["call_id"], "output": answer(c)} for c in data["calls"]]
                response = http.post(f"/v1/code-execution/runs/{data['runId']}/tool-results",
                                     json={"results": results})
                assert response.status_code == 200, response.text
    return events


def final(events: list) -> dict:
    ends = [e for e in events if e.event in ("run.completed", "run.failed")]
    assert len(ends) == 1, [e.event for e in events]
    return {"event": ends[0].event, **ends[0].json()}


def names(events: list) -> list[str]:
    return [e.event for e in events]


# -- the event grammar ------------------------------------------------------------------------
def test_a_python_run_streams_its_output_as_it_is_printed(http):
    stamps = {}
    with run_stream(http, language="python",
                    code="import time\nprint('a', flush=True)\ntime.sleep(1)\nprint('b')") as src:
        events = []
        for sse in src.iter_sse():
            events.append(sse)
            stamps.setdefault(sse.event, time.monotonic())
    assert events[0].event == "run.created"
    assert events[-1].data == "[DONE]" and events[-1].event == "message"  # no event: line
    assert names(events)[-2] == "run.completed"
    outputs = [e.json() for e in events if e.event == "run.output"]
    assert outputs[0] == {"runId": events[0].json()["runId"], "stream": "stdout", "text": "a\n"}
    # The first output left the sandbox while the code was still sleeping.
    assert stamps["run.completed"] - stamps["run.output"] >= 0.5
    end = final(events)
    assert end["stdout"] == "a\nb\n" and end["exit_code"] == 0 and end["stderr"] == ""
    assert end["inner_tool_calls"] == 0 and end["duration_ms"] >= 1000
    ids = [int(e.id) for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids), "every event has its own rising id"


def test_stderr_is_kept_apart_and_a_failing_program_still_completes(http):
    events = collect(http, code="import sys\nprint('out')\nprint('err', file=sys.stderr)\n1/0")
    streams = {e.json()["stream"] for e in events if e.event == "run.output"}
    assert streams == {"stdout", "stderr"}
    end = final(events)
    assert end["event"] == "run.completed" and end["exit_code"] == 1
    assert end["stdout"] == "out\n"
    assert end["stderr"].startswith("err\n") and "ZeroDivisionError" in end["stderr"]


def test_output_past_the_cap_is_cut_and_marked(http):
    events = collect(http, code=f"print('x' * {OUTPUT_CAP * 3})")
    end = final(events)
    assert end["stdout"].endswith("...[truncated]")
    assert len(end["stdout"]) <= OUTPUT_CAP + len("\n...[truncated]")
    streamed = "".join(e.json()["text"] for e in events if e.event == "run.output")
    assert len(streamed) <= OUTPUT_CAP + len("\n...[truncated]")


def test_a_timeout_fails_the_run_and_keeps_what_it_printed(http):
    events = collect(http, code="import time\nprint('before')\ntime.sleep(30)", timeout_ms=1000)
    end = final(events)
    assert end["event"] == "run.failed" and "timed out" in end["error"]
    assert end["stdout"] == "before\n"


def test_the_run_record_has_the_tool_result_shape(http):
    events = collect(http, code="print(sum(range(10)))")
    run_id = events[0].json()["runId"]
    record = http.get(f"/v1/code-execution/runs/{run_id}").json()
    assert run_id.startswith("cexrun_") and record["run_id"] == run_id
    assert record["status"] == "completed" and record["exit_code"] == 0
    assert record["stdout"] == "45\n" and record["files"] == [] and "container_id" not in record
    assert isinstance(record["duration_ms"], int) and record["inner_tool_calls"] == 0


def test_bad_requests_are_refused_in_the_openai_error_shape(http):
    for body, param in (({"language": "ruby", "code": "x"}, "language"),
                        ({"code": ""}, "code"),
                        ({"code": "1", "tools": [{"type": "function", "name": "bad name"}]}, "tools"),
                        ({"code": "1", "tools": [QUERY_TOOL], "allowed_tools": ["missing"]},
                         "allowed_tools"),
                        # Falsy but not absent: a mistake, which read as "none".
                        ({"code": "1", "tools": {}}, "tools"),
                        ({"code": "1", "tools": 0}, "tools"),
                        ({"code": "1", "allowed_tools": {}}, "allowed_tools"),
                        ({"code": "1", "file_ids": ""}, "file_ids"),
                        ({"code": "1", "timeout_ms": "soon"}, "timeout_ms")):
        response = http.post("/v1/code-execution/runs", json=body)
        assert response.status_code == 422, (body, response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
        assert error["param"] == param, (body, error)
    assert http.post("/v1/code-execution/runs", content=b"{nope").status_code == 422
    missing = http.post("/v1/code-execution/runs", json={"code": "1", "container": "cnt_nope"})
    assert missing.status_code == 404 and "cnt_nope" in missing.json()["error"]["message"]
    assert http.get("/v1/code-execution/runs/cexrun_nope").status_code == 404
    assert http.delete("/v1/code-execution/runs/cexrun_nope").status_code == 404


# -- inner tool calls ---------------------------------------------------------------------------
def test_python_calls_a_client_tool_and_gets_its_result(http):
    seen = []

    def answer(call):
        seen.append(call)
        return json.dumps({"rows": [[42]]})

    events = collect(http, answer=answer, tools=[QUERY_TOOL], allowed_tools=["advanced_query"],
                     code="rows = advanced_query(sql='select count(*) from generations')\n"
                          "print(rows['rows'][0][0])")
    assert [c["name"] for c in seen] == ["advanced_query"]
    assert seen[0]["arguments"] == {"sql": "select count(*) from generations"}
    assert seen[0]["call_id"].startswith("call_")
    end = final(events)
    assert end["stdout"] == "42\n" and end["inner_tool_calls"] == 1


def test_concurrent_python_calls_arrive_in_one_event(http):
    # Awaitable stubs gathered in one turn of the loop always travel together.
    # Blocking stubs from threads do when their calls start within the batch
    # window (2 ms): the threads leave a barrier together and each notes when it
    # called. On a busy machine one thread may be descheduled past the window;
    # such an attempt proves nothing, so it is repeated, never counted.
    code = ("import asyncio, threading, time\n"
            "async def main():\n"
            "    return await asyncio.gather(advanced_query_async(sql='a'), "
            "advanced_query_async(sql='b'))\n"
            "print(asyncio.run(main()))\n"
            "out, called = [], {}\n"
            "barrier = threading.Barrier(2)\n"
            "def call(s):\n"
            "    barrier.wait(); called[s] = time.monotonic(); out.append(advanced_query(sql=s))\n"
            "threads = [threading.Thread(target=call, args=(s,)) for s in 'cd']\n"
            "[t.start() for t in threads]; [t.join() for t in threads]\n"
            "print(sorted(out))\n"
            "print(abs(called['c'] - called['d']))")
    conclusive = 0
    for _ in range(10):
        events = collect(http, answer=lambda call: call["arguments"]["sql"].upper(),
                         tools=[QUERY_TOOL], allowed_tools=["advanced_query"], code=code)
        batches = [sorted(c["arguments"]["sql"] for c in e.json()["calls"])
                   for e in events if e.event == "tool_call.required"]
        first, second, gap = final(events)["stdout"].splitlines()
        assert (first, second) == ("['A', 'B']", "['C', 'D']")
        assert batches[0] == ["a", "b"], batches
        if float(gap) < 0.0005:
            assert batches[1:] == [["c", "d"]], f"calls {float(gap) * 1000:.2f} ms apart: {batches}"
            conclusive += 1
            if conclusive == 2:
                return
    pytest.fail(f"in 10 attempts the threads' calls started within 0.5 ms only {conclusive} times")


def test_awaitable_stubs_gathered_at_a_cells_top_level_travel_together(http):
    # As a model writes them in a notebook: no asyncio.run around the gather.
    # A top-level await was a SyntaxError, the run failing before any call.
    events = collect(http, answer=lambda call: call["arguments"]["sql"].upper(),
                     tools=[QUERY_TOOL], allowed_tools=["advanced_query"],
                     code="import asyncio\n"
                          "rows = await asyncio.gather(advanced_query_async(sql='a'), "
                          "advanced_query_async(sql='b'))\n"
                          "print(rows)\n"
                          "await advanced_query_async(sql='c')")
    batches = [sorted(c["arguments"]["sql"] for c in e.json()["calls"])
               for e in events if e.event == "tool_call.required"]
    assert batches == [["a", "b"], ["c"]]
    end = final(events)
    assert end["stdout"] == "['A', 'B']\n'C'\n" and end["exit_code"] == 0
    assert end["inner_tool_calls"] == 3


def test_a_tool_not_allowed_has_no_stub_and_a_forged_call_is_refused(http):
    # Declared, not allowed: no stub exists, and asking the host directly over
    # the channel (as code posing as the agent can) is refused by the host.
    code = ("try:\n    delete_everything()\nexcept NameError:\n    print('no stub')\n"
            "import gc\n"
            "relay = next(o for o in gc.get_objects() if type(o).__name__ == 'ToolRelay')\n"
            "try:\n    relay.call('delete_everything', {})\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    events = collect(http, answer=lambda call: pytest.fail(f"the client was asked: {call}"),
                     tools=[QUERY_TOOL, SECRET_TOOL], allowed_tools=["advanced_query"], code=code)
    assert "tool_call.required" not in names(events)
    end = final(events)
    assert end["stdout"] == ("no stub\nToolError tool 'delete_everything' is not allowed "
                             "in this run\n"), end
    assert end["inner_tool_calls"] == 0


def test_default_deny_without_allowed_tools(http):
    events = collect(http, tools=[QUERY_TOOL], code=(
        "import gc\nrelay = next(o for o in gc.get_objects() if type(o).__name__ == 'ToolRelay')\n"
        "try:\n    relay.call('advanced_query', {'sql': 'x'})\n"
        "except Exception as e:\n    print(e)\n"))
    assert "tool_call.required" not in names(events)
    assert "not allowed" in final(events)["stdout"]


def test_schema_invalid_arguments_fail_in_the_code_and_never_reach_the_client(http):
    events = collect(http, answer=lambda call: pytest.fail("the client was asked"),
                     tools=[QUERY_TOOL], allowed_tools=["advanced_query"],
                     code="try:\n    advanced_query(sql=7)\nexcept ToolError as e:\n    print(e)")
    assert "tool_call.required" not in names(events)
    assert "invalid arguments" in final(events)["stdout"]
    assert '7 is not of type "string"' in final(events)["stdout"]


@pytest.fixture
def schema_host():
    """A loopback HTTP server that serves a JSON schema and notes every request:
    a host that followed a tool schema's $ref out of the schema would show here."""
    requests: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requests.append(self.path)
            body = b'{"type": "string"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.requests = requests
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_a_tool_schema_that_refers_outside_itself_is_refused_and_never_fetched(
        http, schema_host, tmp_path):
    # jsonschema's default registry fetched any $ref or $schema it did not hold
    # (http, https, file://): a client's tool schema made the host call a URL of
    # the client's choosing, or read one of its files, at each call of the tool.
    url = f"http://127.0.0.1:{schema_host.server_port}/schema.json"
    on_the_host = tmp_path / "schema.json"
    on_the_host.write_text('{"type": "string"}')
    for reference, why in ((url, "retriev"), (f"{url}#/definitions/q", "retriev"),
                           (on_the_host.as_uri(), "retriev"), ("#/$defs/missing", "does not exist"),
                           ("#/type", "is not of type")):  # the last a keyword's value
        tool = {"type": "function", "name": "lookup",
                "parameters": {"type": "object", "properties": {"q": {"$ref": reference}}}}
        answer = http.post("/v1/code-execution/runs", json={
            "code": "print(1)", "tools": [tool], "allowed_tools": ["lookup"]})
        assert answer.status_code == 422, answer.text
        message = answer.json()["error"]["message"]
        assert "not a usable JSON schema" in message and why in message, message
    meta = {"type": "function", "name": "lookup",
            "parameters": {"$schema": f"{url}#", "type": "object"}}
    answer = http.post("/v1/code-execution/runs", json={
        "code": "print(1)", "tools": [meta], "allowed_tools": ["lookup"]})
    assert answer.status_code == 422 and "meta-schema" in answer.text, answer.text
    # A ToolSpec made in code, not from a request, is held to the same.
    with pytest.raises(InvalidTools):
        Grant([ToolSpec("lookup", "", {"$ref": url})], ["lookup"])
    assert schema_host.requests == []
    # References inside the schema resolve, and the host checks arguments against them.
    tool = {"type": "function", "name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"$ref": "#/$defs/query"}},
                           "required": ["q"], "$defs": {"query": {"type": "string"}}}}
    events = collect(http, answer=lambda call: f"found {call['arguments']['q']}",
                     tools=[tool], allowed_tools=["lookup"],
                     code=("try:\n    lookup(q=7)\nexcept ToolError as e:\n    print(e)\n"
                           "print(lookup(q='x'))"))
    stdout = final(events)["stdout"]
    assert '7 is not of type "string"' in stdout and "found x" in stdout, stdout


def test_a_tool_pattern_cannot_hold_the_server(http):
    # Python's re backtracks exponentially on this pattern: at 40 characters it
    # would take hours, holding the event loop, and so every tenant's requests.
    tool = {"type": "function", "name": "lookup",
            "parameters": {"type": "object", "properties": {
                "q": {"type": "string", "pattern": "^(a+)+(?=!)b$"}}}}
    done = []

    def call() -> None:
        done.append(collect(http, answer=lambda call: pytest.fail("the client was asked"),
                            tools=[tool], allowed_tools=["lookup"],
                            code=("try:\n    lookup(q='a' * 40 + '!')\n"
                                  "except ToolError as e:\n    print(e)")))

    caller = threading.Thread(target=call)
    caller.start()
    caller.join(30)
    assert done, "the call did not finish"
    assert "does not match" in final(done[0])["stdout"], final(done[0])
    assert http.get("/health").status_code == 200


def test_a_result_that_never_comes_fails_the_call_after_the_wait_ceiling(http):
    started = time.monotonic()
    events = collect(http, tools=[QUERY_TOOL], allowed_tools=["advanced_query"], timeout_ms=1000,
                     code="try:\n    advanced_query(sql='x')\nexcept ToolError as e:\n    print(e)")
    # The run's own 1 s timeout did not fire: waiting for the client is not the code's time.
    end = final(events)
    assert end["event"] == "run.completed", end
    assert f"no result arrived within {TOOL_WAIT_SECONDS}s" in end["stdout"]
    assert time.monotonic() - started >= TOOL_WAIT_SECONDS


def test_a_tenants_stored_run_records_are_held_to_its_bound(server_factory):
    # Each stored record keeps the run's output; one tenant running code in a
    # loop stored 80 MiB in 5 s, for a day. Past its bound its oldest go.
    server = server_factory(tokens="tok-a=a,tok-b=b", tenant_max_stored_run_bytes=1 << 20,
                            run_logs_kept=0, pool_size=1)
    loud = "print('x' * 300_000)"

    def run(http) -> str:
        events = collect(http, code=loud)
        run_id = final(events)["runId"]
        deadline = time.monotonic() + 30  # stored once the stream has ended
        while http.get(f"/v1/code-execution/runs/{run_id}").status_code != 200:
            assert time.monotonic() < deadline, "the run was never stored"
            time.sleep(0.05)
        return run_id

    with server.client("tok-a") as mine, server.client("tok-b") as theirs:
        their_run = run(theirs)
        my_runs = [run(mine) for _ in range(5)]
        kept = [mine.get(f"/v1/code-execution/runs/{r}").status_code for r in my_runs]
        assert kept[-3:] == [200, 200, 200] and 404 in kept[:2], kept
        answer = theirs.get(f"/v1/code-execution/runs/{their_run}")
        assert answer.status_code == 200 and answer.json()["stdout"] == "x" * 300_000 + "\n"


def test_one_tenants_runs_do_not_push_out_anothers_kept_logs(server_factory):
    """Finished runs' logs were kept oldest out first across all tenants: one
    tenant running code in a loop pushed the others' out, and their replays
    lost every run.output and tool_call.required event (start and end only)."""
    server = server_factory(tokens="tok-a=a,tok-b=b", run_logs_kept=3, pool_size=1)
    with server.client("tok-a") as mine, server.client("tok-b") as theirs:
        their_run = final(collect(theirs, code="print('theirs', flush=True)"))["runId"]
        for n in range(6):
            final(collect(mine, code=f"print({n})"))
        with theirs.stream("GET", f"/v1/code-execution/runs/{their_run}/events",
                           headers={"Last-Event-ID": "0"}) as response:
            replayed = [sse.event for sse in EventSource(response).iter_sse()]
    assert "run.output" in replayed, replayed


def test_after_a_call_goes_unanswered_the_runs_later_calls_fail_at_once(http):
    # Code that caught each failure and called again waited out the ceiling
    # each time, up to 1,000 calls: 83 hours at the defaults of a sandbox and a
    # tenant's slots held for a client that had gone. Now one wait is all.
    code = ("for i in range(5):\n"
            "    try:\n        advanced_query(sql=str(i))\n"
            "    except ToolError as e:\n        print(e)")
    events = collect(http, tools=[QUERY_TOOL], allowed_tools=["advanced_query"], code=code)
    end = final(events)
    assert end["event"] == "run.completed", end
    lines = end["stdout"].splitlines()
    assert len(lines) == 5 and f"no result arrived within {TOOL_WAIT_SECONDS}s" in lines[0], lines
    assert all("an earlier call of 'advanced_query' went unanswered" in line
               for line in lines[1:]), lines
    assert names(events).count("tool_call.required") == 1  # the others were never asked
    assert end["inner_tool_calls"] == 1


def test_cancel_while_waiting_for_a_tool(http):
    with run_stream(http, tools=[QUERY_TOOL], allowed_tools=["advanced_query"],
                    code="advanced_query(sql='x')\nprint('never')") as source:
        events = []
        for sse in source.iter_sse():
            events.append(sse)
            if sse.event == "tool_call.required":
                run_id = sse.json()["runId"]
                cancelled = http.delete(f"/v1/code-execution/runs/{run_id}")
                assert cancelled.status_code == 200, cancelled.text
                assert cancelled.json()["status"] == "cancelled"
    end = final(events)
    assert end["event"] == "run.failed" and end["status"] == "cancelled"
    assert "cancelled" in end["error"] and "never" not in end["stdout"]
    record = http.get(f"/v1/code-execution/runs/{run_id}").json()
    assert record["status"] == "cancelled" and record["exit_code"] is None
    assert http.delete(f"/v1/code-execution/runs/{run_id}").status_code == 409


def test_a_cancel_while_waiting_leaves_no_task_error(runs_server, http):
    # The paused clock was restarted on a call already over: an error at each cancel.
    logged = len(runs_server.log())
    for language, code in (("python", "advanced_query(sql='x')"),
                           ("javascript", "await advanced_query({sql: 'x'})")):
        events = []
        with run_stream(http, language=language, tools=[QUERY_TOOL],
                        allowed_tools=["advanced_query"], code=code) as source:
            for sse in source.iter_sse():
                events.append(sse)
                if sse.event == "tool_call.required":
                    assert http.delete(f"/v1/code-execution/runs/{sse.json()['runId']}").status_code == 200
        # A run that never waited on its call cancelled nothing: the log below says nothing then.
        assert "tool_call.required" in names(events), (language, names(events))
        assert final(events)["status"] == "cancelled", (language, final(events))
    time.sleep(0.5)  # the answering tasks end after the cancel
    log = runs_server.log()[logged:]
    assert "Task exception was never retrieved" not in log and "Traceback" not in log, log


@pytest.mark.parametrize("language, code", [
    ("python", "import asyncio\n"
               "async def main():\n"
               "    return await asyncio.gather(*[advanced_query_async(sql=str(i)) for i in range(100)])\n"
               "print(len(asyncio.run(main())))"),
    ("javascript", "const all = await Promise.all(Array.from({length: 100}, (_, i) => "
                   "advanced_query({sql: String(i)})));\nconsole.log(all.length);"),
], ids=["python", "javascript"])
def test_a_hundred_calls_made_at_once_are_all_asked_and_answered(http, language, code):
    # Past 64 in one batch, calls were never announced nor refused: the code
    # waited for answers that could not come, and the run timed out.
    asked = []
    events = collect(http, answer=lambda call: (asked.append(call["arguments"]["sql"]) or "ok"),
                     language=language, tools=[QUERY_TOOL], allowed_tools=["advanced_query"],
                     code=code, timeout_ms=60_000)
    end = final(events)
    assert end["event"] == "run.completed" and end["stdout"] == "100\n", end
    assert sorted(asked, key=int) == [str(i) for i in range(100)]
    assert end["inner_tool_calls"] == 100


def test_arguments_that_are_not_json_are_refused_in_the_code(http):
    # NaN reached the client in tool_call.required, which no JSON parser reads.
    events = collect(http, answer=lambda call: pytest.fail(f"the client was asked: {call}"),
                     tools=[SECRET_TOOL], allowed_tools=["delete_everything"],
                     code=("try:\n    delete_everything(x=float('nan'))\n"
                           "except ToolError as e:\n    print(e)"))
    assert "NaN" in final(events)["stdout"], final(events)
    assert "tool_call.required" not in names(events)


def test_a_tool_result_too_large_for_the_code_is_refused_where_it_is_sent(http):
    # It was accepted (200) and then dropped: the code waited out its limit.
    with run_stream(http, tools=[QUERY_TOOL], allowed_tools=["advanced_query"],
                    code="print(len(advanced_query(sql='x')))") as source:
        events = []
        for sse in source.iter_sse():
            events.append(sse)
            if sse.event == "tool_call.required":
                data = sse.json()
                url = f"/v1/code-execution/runs/{data['runId']}/tool-results"
                call = data["calls"][0]["call_id"]
                big = http.post(url, json={"results": [{"call_id": call, "output": "x" * 5_000_000}]})
                assert big.status_code == 413, big.text
                assert big.json()["error"]["param"] == "results"
                ok = http.post(url, json={"results": [{"call_id": call, "output": "x" * 3_000_000}]})
                assert ok.status_code == 200, ok.text
    assert final(events)["stdout"] == "3000000\n"


def test_cancel_interrupts_running_code(http):
    events = []
    with run_stream(http, code="import time\nprint('started', flush=True)\ntime.sleep(60)") as src:
        for sse in src.iter_sse():
            events.append(sse)
            if sse.event == "run.output":
                started = time.monotonic()
                http.delete(f"/v1/code-execution/runs/{sse.json()['runId']}")
    # Checked after the stream, so that a stream that ends without its run's end fails.
    end = final(events)
    assert end["event"] == "run.failed" and end["status"] == "cancelled", end
    assert time.monotonic() - started < 30  # far below the 60 s sleep


def test_tool_results_answer_404_409_and_ignore_repeats(http):
    with run_stream(http, tools=[QUERY_TOOL], allowed_tools=["advanced_query"],
                    code="print(advanced_query(sql='x'))") as source:
        for sse in source.iter_sse():
            if sse.event != "tool_call.required":
                continue
            data = sse.json()
            url = f"/v1/code-execution/runs/{data['runId']}/tool-results"
            unknown = http.post(url, json={"results": [{"call_id": "call_nope", "output": "1"}]})
            assert unknown.status_code == 404, unknown.text
            call_id = data["calls"][0]["call_id"]
            first = http.post(url, json={"results": [{"call_id": call_id, "output": "ok"}]})
            assert first.json()["accepted"] == 1
            again = http.post(url, json={"results": [{"call_id": call_id, "output": "other"}]})
            assert again.status_code == 200 and again.json()["accepted"] == 0
    # Finished: it waits for nothing; an answer to a call it never made is a conflict.
    late = http.post(url, json={"results": [{"call_id": "call_nope", "output": "1"}]})
    assert late.status_code == 409, late.text
    record = http.get(f"/v1/code-execution/runs/{data['runId']}").json()
    assert record["stdout"] == "ok\n"
    assert http.post(url, json={"results": []}).status_code == 422


def test_a_tool_error_from_the_client_raises_tool_error(http):
    events = []
    with run_stream(http, tools=[QUERY_TOOL], allowed_tools=["advanced_query"],
                    code="try:\n    advanced_query(sql='x')\nexcept ToolError as e:\n    print(e)") as src:
        for sse in src.iter_sse():
            events.append(sse)
            if sse.event == "tool_call.required":
                data = sse.json()
                answered = http.post(f"/v1/code-execution/runs/{data['runId']}/tool-results",
                                     json={"results": [{"call_id": data["calls"][0]["call_id"],
                                                        "error": "permission denied"}]})
                assert answered.status_code == 200, answered.text
    # A run that failed, or ended without asking, printed nothing of the kind.
    end = final(events)
    assert end["event"] == "run.completed" and end["stdout"] == "permission denied\n", end


def test_a_lost_stream_is_replayed_from_last_event_id(http):
    code = "import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.3)"
    with run_stream(http, code=code) as source:
        events = source.iter_sse()
        first, second = next(events), next(events)
    # The connection is gone; the run is not.
    run_id = first.json()["runId"]
    with connect_sse(http, "GET", f"/v1/code-execution/runs/{run_id}/events",
                     headers={"Last-Event-ID": second.id}) as source:
        rest = list(source.iter_sse())
    assert int(rest[0].id) == int(second.id) + 1
    assert rest[-1].data == "[DONE]"
    text = second.json().get("text", "") + "".join(
        e.json()["text"] for e in rest if e.event == "run.output")
    assert text == "0\n1\n2\n"
    assert final(rest)["stdout"] == "0\n1\n2\n"
    # A replay from the start gives every event again, in order.
    with connect_sse(http, "GET", f"/v1/code-execution/runs/{run_id}/events") as source:
        again = list(source.iter_sse())
    assert [e.id for e in again[:2]] == [first.id, second.id]


def test_an_event_id_past_the_end_means_the_end_and_a_malformed_one_is_refused(http):
    """Last-Event-ID went through int() when it was digits: 4301 of them were a
    500, other digits (superscripts) a 500 too, and anything else replayed the
    whole run. after=10**30 on a live run kept the stream silent and then sent
    [DONE] with id 10**30 + 1. No event has an id past the end, so such an id is
    the end: a live run's stream goes on from there, a finished one's gives
    [DONE]; what is not an id at all is a 422 in the OpenAI shape."""
    with run_stream(http, code="import time\ntime.sleep(2)\nprint('late')") as source:
        stream = source.iter_sse()
        created = next(stream)
        run_id = created.json()["runId"]
        started = time.monotonic()
        url = f"/v1/code-execution/runs/{run_id}/events"
        with connect_sse(http, "GET", url, headers={"Last-Event-ID": "9" * 5000}) as one, \
                connect_sse(http, "GET", url, params={"after": str(10**30)}) as other:
            live, after = list(one.iter_sse()), list(other.iter_sse())
        everything = [created, *stream]
    for rest in (live, after):
        assert names(rest)[-2:] == ["run.completed", "message"], names(rest)
        assert final(rest)["stdout"] == "late\n"
        assert [e.id for e in rest] == [e.id for e in everything[-len(rest):]]
    assert time.monotonic() - started < 30
    end = everything[-1].id
    for last in ("9" * 5000, str(10**30), "0" * 30 + end):
        done = replay(http, run_id, **{"Last-Event-ID": last})
        assert [(e.id, e.data) for e in done] == [(end, "[DONE]")], last[:40]
    for after in (str(10**30), "9" * 5000):
        with connect_sse(http, "GET", f"/v1/code-execution/runs/{run_id}/events",
                         params={"after": after}) as source:
            assert [(e.id, e.data) for e in source.iter_sse()] == [(end, "[DONE]")]
    for last in ("abc", "-1", "\u00b2", "1.5", "+3"):  # ² is a digit to str.isdigit
        response = http.get(f"/v1/code-execution/runs/{run_id}/events",
                            headers={"Last-Event-ID": last.encode("latin-1")})
        assert response.status_code == 422, (last, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "Last-Event-ID"
    for value in ("-1", "x", "1.5"):
        response = http.get(f"/v1/code-execution/runs/{run_id}/events", params={"after": value})
        assert response.status_code == 422, (value[:40], response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_finished_run_replays_from_its_record_after_a_restart(server_factory, tmp_path):
    """Once its in-memory log is gone (here, with the server that ran it), a
    run's stream is its start and its end, read from the stored record, with
    the ids they had."""
    data_dir = tmp_path / "data"
    first = server_factory(data_dir=data_dir, pool_size=1)
    with first.client() as http:
        run_id = final(collect(http, code="print('kept')"))["runId"]
    first.stop()
    second = server_factory(data_dir=data_dir, pool_size=1)
    url = f"/v1/code-execution/runs/{run_id}/events"
    with second.client() as http:
        with connect_sse(http, "GET", url) as source:
            events = list(source.iter_sse())
        with connect_sse(http, "GET", url, headers={"Last-Event-ID": "1"}) as source:
            rest = list(source.iter_sse())
    assert names(events) == ["run.created", "run.completed", "message"]
    assert [e.id for e in events] == ["1", "3", "4"] and events[-1].data == "[DONE]"
    assert final(events)["stdout"] == "kept\n" and final(events)["exit_code"] == 0
    assert names(rest) == ["run.completed", "message"] and [e.id for e in rest] == ["3", "4"]


def test_ids_stay_the_same_once_a_finished_runs_log_is_no_longer_kept(server_factory):
    """Replay from the record numbered its events anew (1, 2, [DONE] 3), so a
    client that had read up to run.output (id 3) and resumed from it got
    [DONE] alone, never the run's end; and any tenant's newer runs push a log
    out. The end keeps its id: resuming before it gives it, at it or past it
    gives what is left."""
    server = server_factory(run_logs_kept=1, pool_size=1)
    with server.client() as http:
        events = collect(http, answer=lambda call: "rows", tools=[QUERY_TOOL],
                         allowed_tools=["advanced_query"],
                         code="print(advanced_query(sql='x'))")
        assert names(events) == ["run.created", "tool_call.required", "run.output",
                                 "run.completed", "message"]
        assert [e.id for e in events] == ["1", "2", "3", "4", "5"]
        run_id = events[0].json()["runId"]
        collect(http, code="print('another run')")  # the first one's log goes
        whole = replay(http, run_id)
        resumed = {last: replay(http, run_id, **{"Last-Event-ID": last})
                   for last in ("2", "3", "4", "5", "9")}
        record = http.get(f"/v1/code-execution/runs/{run_id}").json()
    assert [(e.id, e.event) for e in whole] == [("1", "run.created"), ("4", "run.completed"),
                                                ("5", "message")]
    assert final(whole) == final(events)
    for last in ("2", "3"):
        assert [(e.id, e.event) for e in resumed[last]] == [("4", "run.completed"),
                                                            ("5", "message")]
        assert final(resumed[last])["stdout"] == "rows\n"
    for last in ("4", "5", "9"):
        assert [(e.id, e.data) for e in resumed[last]] == [("5", "[DONE]")], last
    assert "_last_event_id" not in record and record["stdout"] == "rows\n"


# -- what a run's event log may hold ----------------------------------------------------------
LOG_BUDGET = 16 * 1024 * 1024
KEPT_BUDGET = 24 * 1024 * 1024
ECHO_TOOL = {"type": "function", "name": "echo", "parameters": {"type": "object"}}
# Thirty calls of 3 MiB each: some 90 MiB of arguments, where the log holds 16.
BIG_CALLS_CODE = ("blob = 'y' * (3 * 1024 * 1024)\n"
                  "made, refused = 0, []\n"
                  "for i in range(30):\n"
                  "    try:\n"
                  "        echo(i=i, blob=blob)\n"
                  "        made += 1\n"
                  "    except ToolError as e:\n"
                  "        refused.append(str(e))\n"
                  "print(made, len(refused))\n"
                  "print(refused[0] if refused else '')\n")


@pytest.fixture(scope="module")
def log_server(server_factory):
    return server_factory(run_log_bytes=LOG_BUDGET, run_logs_kept_bytes=KEPT_BUDGET,
                          max_sessions=16, pool_size=2)


def rss(server) -> int:
    """The server's resident memory, in bytes."""
    with open(f"/proc/{server.process.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_runs_event_log_holds_its_budget_and_a_call_past_it_fails_in_the_code(log_server):
    """A run's tool calls may carry some 4 MiB of arguments each, a thousand
    times: announcing every one kept them all in the log (and 256 finished logs
    were kept for replay). Past the log's budget a call fails in the code, with
    a ToolError that says why, and is never announced; the server does not hold
    what the code tried to send, and the stream replays what it kept."""
    with log_server.client() as http:
        before = rss(log_server)
        events = collect(http, answer=lambda call: "ok", tools=[ECHO_TOOL],
                         allowed_tools=["echo"], code=BIG_CALLS_CODE)
        grown = rss(log_server) - before
        announced = [e for e in events if e.event == "tool_call.required"]
        counts, reason = final(events)["stdout"].splitlines()
        assert final(events)["inner_tool_calls"] == len(announced)
        assert counts == f"{len(announced)} {30 - len(announced)}", counts
        assert 3 <= len(announced) <= 5, [e.event for e in events]
        assert "event log is full" in reason and "16 MiB" in reason, reason
        # The log holds at most its budget; 90 MiB went through the server.
        assert grown < 48 * 1024 * 1024, f"the server grew by {grown / 2**20:.0f} MiB"
        run_id = events[0].json()["runId"]
        with connect_sse(http, "GET", f"/v1/code-execution/runs/{run_id}/events") as source:
            replayed = list(source.iter_sse())
    assert [(e.id, e.event, e.data) for e in replayed] == [(e.id, e.event, e.data) for e in events]
    assert announced[0].json()["calls"][0]["arguments"]["blob"] == "y" * 3 * 1024 * 1024


def replay(http: httpx.Client, run_id: str, **headers) -> list:
    with connect_sse(http, "GET", f"/v1/code-execution/runs/{run_id}/events",
                     headers=headers) as source:
        return list(source.iter_sse())


def test_finished_logs_are_kept_for_replay_within_a_total_of_bytes(log_server):
    """256 finished logs of up to run_log_bytes each were kept whatever their
    size; past run_logs_kept_bytes the oldest goes, and is replayed from its
    record: its start and its end."""
    with log_server.client() as http:
        big = collect(http, answer=lambda call: "ok", tools=[ECHO_TOOL], allowed_tools=["echo"],
                      code=BIG_CALLS_CODE)
        small = collect(http, code="print('small')")
        assert names(replay(http, big[0].json()["runId"])) == names(big)
        collect(http, answer=lambda call: "ok", tools=[ECHO_TOOL], allowed_tools=["echo"],
                code=BIG_CALLS_CODE)
        gone = replay(http, big[0].json()["runId"])
        kept = replay(http, small[0].json()["runId"])
    assert names(gone) == ["run.created", "run.completed", "message"]
    assert final(gone)["stdout"] == final(big)["stdout"]
    assert [(e.id, e.data) for e in kept] == [(e.id, e.data) for e in small]


def test_readers_that_never_read_do_not_each_hold_a_copy_of_the_log(log_server):
    """A replay was one write of the whole backlog: a copy per reader, held by
    the connection until the client read it, so six that never read held over
    a gigabyte. Chunks are written as the connection drains, so such a reader
    holds about one chunk."""
    with log_server.client() as http:
        run_id = collect(http, answer=lambda call: "ok", tools=[ECHO_TOOL],
                         allowed_tools=["echo"], code=BIG_CALLS_CODE)[0].json()["runId"]
        before = rss(log_server)
        readers = []
        try:
            for _ in range(4):
                reader = socket.socket()
                reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                reader.connect(("127.0.0.1", int(log_server.url.rsplit(":", 1)[1])))
                reader.sendall(f"GET /v1/code-execution/runs/{run_id}/events HTTP/1.1\r\n"
                               "Host: shoal\r\n\r\n".encode())
                readers.append(reader)
            time.sleep(2)  # each is answered as far as its connection takes
            grown = rss(log_server) - before
            assert readers[0].recv(64).startswith(b"HTTP/1.1 200")
        finally:
            for reader in readers:
                reader.close()
        # The log is some 15 MiB: each reader held one copy of it, or more.
        assert grown < 8 * 1024 * 1024, f"4 readers grew the server by {grown / 2**20:.0f} MiB"
        assert names(replay(http, run_id))[-1] == "message"  # and the server serves on


def test_a_tenant_running_one_run_at_a_time_is_never_refused(server_factory):
    """A run's stream ended before its ephemeral sandbox was closed, and only
    then did the run give back its tenant's slot: a client that waited for
    [DONE] before starting the next run was told it held its share (60 runs in
    a row: 15 answered 429). The share is given back when the stream ends; the
    closing sandbox still counts against the server's slots."""
    server = server_factory(tenant_max_sessions=2, max_sessions=16, pool_size=2)
    with server.client() as http:
        statuses = []
        for i in range(20):
            with http.stream("POST", "/v1/code-execution/runs",
                             json={"code": f"print({i})"}) as response:
                statuses.append((response.status_code, response.read()[-40:]))
        assert [status for status, _ in statuses] == [200] * 20, statuses
        assert all(tail.rstrip().endswith(b"data: [DONE]") for _, tail in statuses)


# -- containers ---------------------------------------------------------------------------------
def _upload(http: httpx.Client, name: str, data: bytes) -> str:
    response = http.post("/v1/files", files={"file": (name, data)}, data={"purpose": "user_data"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def test_file_ids_without_a_container_make_an_implicit_one(http):
    file_id = _upload(http, "sales.csv", b"month,revenue\njan,10\nfeb,32\n")
    events = collect(http, file_ids=[file_id], code=(
        "import pandas as pd\n"
        "df = pd.read_csv('external-files/sales.csv')\n"
        "print(df.revenue.sum())\n"
        "open('external-files/sales.csv', 'a')"))
    end = final(events)
    assert end["stdout"] == "42\n"
    assert "PermissionError" in end["stderr"] or "Read-only" in end["stderr"], end["stderr"]
    container_id = end["container_id"]
    assert container_id.startswith("cnt_")
    container = http.get(f"/v1/containers/{container_id}").json()
    assert container["implicit"] is True


def test_file_ids_are_attached_once_each_and_at_most_fifty(http):
    file_id = _upload(http, "once.txt", b"1\n")
    events = collect(http, file_ids=[file_id] * 500,
                     code="import os\nprint(sorted(os.listdir('external-files')))")
    assert final(events)["stdout"] == "['once.txt']\n"
    refused = http.post("/v1/code-execution/runs", json={
        "code": "print(1)", "file_ids": [f"file-{i}" for i in range(51)]})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "file_ids" and error["type"] == "invalid_request_error"
    assert "at most 50" in error["message"]


def test_a_run_on_a_container_reads_its_files_and_adds_what_it_produces(http):
    container = http.post("/v1/containers", json={"name": "report"}).json()
    cid = container["id"]
    attached = http.post(f"/v1/containers/{cid}/files", files={"file": ("data.txt", b"7\n")})
    assert attached.status_code == 200, attached.text
    events = collect(http, container=cid, code=(
        "n = int(open('external-files/data.txt').read())\n"
        "open('result.txt', 'w').write(str(n * 6))\n"
        "import matplotlib.pyplot as plt\nplt.plot([1, 2], [3, 4])\nplt.savefig('plot.png')\nplt.close()\n"
        "print('done')"))
    end = final(events)
    assert end["stdout"] == "done\n" and end["container_id"] == cid
    files = {f["filename"]: f for f in end["files"]}
    assert set(files) == {"result.txt", "plot.png"}
    assert files["plot.png"]["mime_type"] == "image/png" and files["plot.png"]["size_bytes"] > 100
    assert all(f["file_id"].startswith("cfile_") and f["container_id"] == cid for f in files.values())
    content = http.get(f"/v1/containers/{cid}/files/{files['result.txt']['file_id']}/content")
    assert content.status_code == 200 and content.content == b"42"
    listed = {f["path"].rsplit("/", 1)[-1] for f in http.get(f"/v1/containers/{cid}/files").json()["data"]}
    assert {"data.txt", "result.txt", "plot.png"} <= listed
    # A later run sees what the earlier one produced, read-only, among external-files.
    events = collect(http, container=cid, code="print(open('external-files/outputs/result.txt').read())")
    assert final(events)["stdout"] == "42\n"


def test_a_container_run_keeps_its_newest_file_for_each_place_in_outputs(http):
    """./y.txt is copied into outputs/y.txt: it overwrote the outputs/y.txt the
    same run wrote after it, and the run listed the one file twice."""
    cid = http.post("/v1/containers", json={"name": "places"}).json()["id"]
    end = final(collect(http, container=cid, code=(
        "import time\n"
        "open('/mnt/user-data/outputs/x.txt', 'w').write('x old')\n"
        "open('y.txt', 'w').write('y old')\n"
        "time.sleep(0.01)\n"
        "open('x.txt', 'w').write('x new')\n"
        "open('/mnt/user-data/outputs/y.txt', 'w').write('y new')\n")))
    files = {f["path"]: f for f in end["files"]}
    assert len(end["files"]) == 2, end["files"]
    for name in ("x.txt", "y.txt"):
        item = files[f"/mnt/user-data/outputs/{name}"]
        content = http.get(f"/v1/containers/{cid}/files/{item['file_id']}/content")
        assert content.content == f"{name[0]} new".encode(), name
        assert item["size_bytes"] == 5


def test_at_most_fifty_generated_files_per_run(http):
    container = http.post("/v1/containers", json={"name": "many"}).json()
    events = collect(http, container=container["id"],
                     code="for i in range(60):\n    open(f'f{i:02}.txt', 'w').write(str(i))")
    end = final(events)
    assert len(end["files"]) == 50
    listed = http.get(f"/v1/containers/{container['id']}/files", params={"limit": 100}).json()
    assert len([f for f in listed["data"] if f["source"] == "assistant"]) == 50


def test_at_most_fifty_external_files_per_run(http):
    container = http.post("/v1/containers", json={"name": "inputs"}).json()
    for index in range(55):
        response = http.post(f"/v1/containers/{container['id']}/files",
                             files={"file": (f"in{index:02}.txt", b"x")})
        assert response.status_code == 200
    events = collect(http, container=container["id"],
                     code="import os\nprint(len(os.listdir('external-files')))")
    assert final(events)["stdout"] == "50\n"


# -- tenancy ------------------------------------------------------------------------------------
def test_another_tenant_cannot_see_or_answer_a_run(server_factory):
    server = server_factory(tokens="tok-a=alpha,tok-b=beta", pool_size=1)
    with server.client("tok-a") as alpha, server.client("tok-b") as beta:
        with run_stream(alpha, tools=[QUERY_TOOL], allowed_tools=["advanced_query"],
                        code="print(advanced_query(sql='x'))") as source:
            events = []
            for sse in source.iter_sse():
                events.append(sse)
                if sse.event == "tool_call.required":
                    data = sse.json()
                    url = f"/v1/code-execution/runs/{data['runId']}"
                    call = data["calls"][0]["call_id"]
                    assert beta.get(url).status_code == 404
                    assert beta.post(f"{url}/tool-results", json={"results": [
                        {"call_id": call, "output": "beta"}]}).status_code == 404
                    assert beta.delete(url).status_code == 404
                    assert alpha.post(f"{url}/tool-results", json={"results": [
                        {"call_id": call, "output": "alpha"}]}).status_code == 200
        # Without the call, beta was never tried; without the end, alpha's answer never seen.
        assert names(events).count("tool_call.required") == 1, names(events)
        end = final(events)
        assert end["event"] == "run.completed" and end["stdout"] == "alpha\n", end
        assert httpx.post(f"{server.url}/v1/code-execution/runs", json={"code": "1"}).status_code == 401


def test_a_client_that_disconnects_does_not_stop_the_run(http):
    with run_stream(http, code="import time\ntime.sleep(1)\nprint('finished anyway')") as source:
        run_id = next(source.iter_sse()).json()["runId"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        record = http.get(f"/v1/code-execution/runs/{run_id}").json()
        if record["status"] != "running":
            break
        time.sleep(0.2)
    assert record["status"] == "completed" and record["stdout"] == "finished anyway\n"


def _answered_runs_posts(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if (line.startswith("shoal_http_requests_total{")
                and 'route="/v1/code-execution/runs"' in line and 'method="POST"' in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_stream_ends_when_its_client_leaves_not_when_its_run_does(http):
    """The server stops writing to a client that left (its request is over at
    once), while the run goes on; a stream that lasts longer than its
    connection would hold the server's drain until the run ended."""
    before = _answered_runs_posts(http)
    with run_stream(http, code="import time\ntime.sleep(60)") as source:
        run_id = next(source.iter_sse()).json()["runId"]
    try:
        deadline = time.monotonic() + 30
        while _answered_runs_posts(http) == before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _answered_runs_posts(http) == before + 1
        assert http.get(f"/v1/code-execution/runs/{run_id}").json()["status"] == "running"
    finally:
        http.delete(f"/v1/code-execution/runs/{run_id}")


def test_a_quiet_stream_is_pinged(server_factory):
    """While a run waits for a tool result, its stream sends comments (which SSE
    clients skip) every stream_ping_seconds, so that proxies keep it open."""
    server = server_factory(tool_wait_seconds=TOOL_WAIT_SECONDS, stream_ping_seconds=PING_SECONDS)
    lines = []
    with server.client() as http, http.stream("POST", "/v1/code-execution/runs", json={
            "code": "try:\n    advanced_query(sql='x')\nexcept Exception as e:\n    print(type(e).__name__)",
            "tools": [QUERY_TOOL], "allowed_tools": ["advanced_query"]}) as response:
        for line in response.iter_lines():
            lines.append(line)
            if line == "data: [DONE]":
                break
    waited = lines[lines.index("event: tool_call.required"):]
    # The call waits TOOL_WAIT_SECONDS for a result that never comes.
    assert sum(line == ": ping" for line in waited) >= TOOL_WAIT_SECONDS, lines
    assert "event: run.completed" in waited


def test_concurrent_runs_do_not_wait_for_each_other(http, runs_server):
    results = {}

    def run(name, code):
        with runs_server.client() as own:
            started = time.monotonic()
            end = final(collect(own, code=code))
            results[name] = (end, time.monotonic() - started)

    slow = threading.Thread(target=run, args=("slow", "import time\ntime.sleep(3)\nprint('slow')"))
    slow.start()
    time.sleep(0.3)
    run("fast", "print('fast')")
    slow.join()
    assert results["fast"][0]["stdout"] == "fast\n" and results["slow"][0]["stdout"] == "slow\n"
    assert results["fast"][1] < results["slow"][1]


# -- JavaScript on Bun --------------------------------------------------------------------------
def test_a_javascript_run_reads_an_external_file_with_bun_file_and_fs(http):
    container = http.post("/v1/containers", json={"name": "js"}).json()
    attached = http.post(f"/v1/containers/{container['id']}/files",
                         files={"file": ("numbers.json", b"[3, 7, 7, 19, 24]")})
    assert attached.status_code == 200
    events = collect(http, language="javascript", container=container["id"], code=(
        "import fs from 'fs';\n"
        "const viaBun = await Bun.file('external-files/numbers.json').json();\n"
        "const viaFs = JSON.parse(fs.readFileSync('external-files/numbers.json', 'utf8'));\n"
        "const mean = viaBun.reduce((a, b) => a + b) / viaBun.length;\n"
        "console.log(`mean ${mean} same ${viaFs.length === viaBun.length}`);\n"
        "console.error('to stderr');\n"
        "try { fs.writeFileSync('external-files/numbers.json', 'x'); }\n"
        "catch (e) { console.log('read-only', e.code); }\n"))
    end = final(events)
    # Root's file (EACCES) on a read-only mount (EROFS): either refusal is the kernel's.
    assert end["stdout"] in ("mean 12 same true\nread-only EACCES\n",
                             "mean 12 same true\nread-only EROFS\n"), end
    assert end["stderr"] == "to stderr\n" and end["exit_code"] == 0


def test_javascript_stubs_batch_promise_all_and_refuse_what_is_not_allowed(http):
    seen = []

    def answer(call):
        seen.append(call["arguments"]["sql"])
        return json.dumps({"n": len(call["arguments"]["sql"])})

    events = collect(http, language="javascript", answer=answer,
                     tools=[QUERY_TOOL, SECRET_TOOL], allowed_tools=["advanced_query"], code=(
                         "const [a, b] = await Promise.all([advanced_query({sql: 'ab'}), "
                         "advanced_query({sql: 'abcd'})]);\n"
                         "console.log(a.n + b.n, typeof delete_everything);\n"))
    batches = [e.json()["calls"] for e in events if e.event == "tool_call.required"]
    assert len(batches) == 1 and sorted(c["arguments"]["sql"] for c in batches[0]) == ["ab", "abcd"]
    end = final(events)
    assert end["stdout"] == "6 undefined\n" and end["inner_tool_calls"] == 2


def test_a_javascript_exit_code_and_no_package_installs(http):
    end = final(collect(http, language="javascript", code="import x from 'left-pad';\nconsole.log(x)"))
    assert end["exit_code"] != 0 and "left-pad" in end["stderr"]
    end = final(collect(http, language="javascript",
                        code="process.stdout.write('y'.repeat(200000)); process.exit(4)"))
    assert end["exit_code"] == 4 and end["stdout"].startswith("y" * 1000)


def test_cancelling_a_run_queued_on_a_container_stops_it_and_not_the_run_ahead(http, runs_server):
    """Runs on one container share its sandbox, one after another. A DELETE of
    the run still waiting stopped the call in progress, the other run's (which
    ended "completed" with exit code 130), while the cancelled run's code ran
    anyway and answered "cancelled" with its output."""
    cid = http.post("/v1/containers", json={"name": "queue"}).json()["id"]
    ahead: list = []
    running = threading.Event()

    def run_ahead() -> None:
        with runs_server.client() as own, run_stream(own, container=cid, code=(
                "import time\nprint('ahead started', flush=True)\ntime.sleep(3)\n"
                "print('ahead done')")) as source:
            for sse in source.iter_sse():
                ahead.append(sse)
                if sse.event == "run.output":
                    running.set()

    thread = threading.Thread(target=run_ahead)
    thread.start()
    try:
        assert running.wait(30), "the first run never printed"
        with run_stream(http, container=cid, code="print('queued ran')") as source:
            stream = source.iter_sse()
            run_id = next(stream).json()["runId"]
            cancelled = http.delete(f"/v1/code-execution/runs/{run_id}")
            assert cancelled.status_code == 200, cancelled.text
            queued = final(list(stream))
    finally:
        thread.join(60)
    assert queued["event"] == "run.failed" and queued["status"] == "cancelled"
    assert "queued ran" not in queued["stdout"], queued
    first = final(ahead)
    assert first["event"] == "run.completed" and first["exit_code"] == 0, first
    assert first["stdout"] == "ahead started\nahead done\n"


@pytest.mark.parametrize("arguments, why", [
    ("v=object()", "must be JSON"),
    ("v='y' * 5_000_000", "too large to send"),
], ids=["not-json", "too-large"])
def test_a_call_that_cannot_be_sent_raises_tool_error_and_the_timeout_still_holds(
        http, arguments, why):
    """Arguments json cannot write, or past a frame, raised TypeError or
    FrameError from the stub (no ``except ToolError`` caught it), an awaitable
    stub waited 305 s, and the call's clock stayed stopped as if the call were
    waiting: the code after it ran past its timeout until the host's backstop
    destroyed the interpreter, and the container's variables with it."""
    cid = http.post("/v1/containers", json={"name": "unsent"}).json()["id"]
    assert final(collect(http, container=cid, code="kept = 41"))["event"] == "run.completed"
    started = time.monotonic()
    end = final(collect(http, container=cid, tools=[ECHO_TOOL], allowed_tools=["echo"],
                        timeout_ms=1500, code=(
                            "import asyncio, time\n"
                            "for call in (lambda: echo(%s),\n"
                            "             lambda: asyncio.run(echo_async(%s))):\n"
                            "    try:\n        call()\n"
                            "    except ToolError as e:\n        print('ToolError', e)\n"
                            "time.sleep(20)\n" % (arguments, arguments))))
    assert time.monotonic() - started < 10
    assert end["event"] == "run.failed" and "timed out after 1.5s" in end["error"], end
    lines = end["stdout"].splitlines()
    assert len(lines) == 2 and all(line.startswith("ToolError") and why in line
                                   for line in lines), lines
    after = final(collect(http, container=cid, code="print(kept + 1)"))
    assert after["stdout"] == "42\n", after


def test_javascript_arguments_that_cannot_be_sent_reject_with_tool_error(http):
    """A BigInt or a cycle threw in the microtask that sent the batch, uncaught:
    the script hung until its timeout. Arguments past what one line to the
    bridge holds cut the connection (``read ECONNRESET``), and with it every
    call made beside them, even calls that fit when sent apart."""
    end = final(collect(http, language="javascript", answer=lambda call: "ok",
                        tools=[ECHO_TOOL], allowed_tools=["echo"], timeout_ms=20_000, code=(
        "const cycle = {}; cycle.self = cycle;\n"
        "for (const args of [{n: 1n}, cycle, {blob: 'y'.repeat(5_000_000)}]) {\n"
        "  try { await echo(args); console.log('sent'); }\n"
        "  catch (e) { console.log(e.name, e.message.split(':')[0]); }\n"
        "}\n"
        "const blob = 'z'.repeat(1_500_000);\n"
        "const all = await Promise.all([1, 2, 3].map((i) => echo({i, blob})));\n"
        "console.log(all.join(','));\n")))
    # A script hung by the throw ran to its 20 s timeout: run.failed, not this.
    assert end["event"] == "run.completed", end
    assert end["stdout"].splitlines() == [
        "ToolError the tool call's arguments must be JSON",
        "ToolError the tool call's arguments must be JSON",
        "ToolError the tool call is too large to send",
        "ok,ok,ok"], end
    assert end["inner_tool_calls"] == 3


def test_files_a_run_without_a_container_produces_in_subdirectories_stay_apart(http):
    """Copied into the implicit container by their last name alone, outputs/a/r.txt,
    outputs/b/r.txt and ./r.txt became one outputs/r.txt: two of the three
    were lost, and the run listed the survivor three times under one id, each
    time with another size. They are kept where a container's run keeps them."""
    end = final(collect(http, code=(
        "import os\n"
        "for d in 'ab':\n"
        "    os.makedirs(f'/mnt/user-data/outputs/{d}', exist_ok=True)\n"
        "    open(f'/mnt/user-data/outputs/{d}/r.txt', 'w').write(d * 2)\n"
        "open('r.txt', 'w').write('top')\n"
        "open('/mnt/user-data/outputs/x.txt', 'w').write('old')\n"
        "import time; time.sleep(0.01)\n"
        "open('x.txt', 'w').write('new')\n")))
    cid = end["container_id"]
    files = {f["path"]: f for f in end["files"]}
    assert len(files) == len(end["files"]) == 4, end["files"]  # x.txt once: the newer
    assert set(files) == {"/mnt/user-data/outputs/a/r.txt", "/mnt/user-data/outputs/b/r.txt",
                          "/mnt/user-data/outputs/r.txt", "/mnt/user-data/outputs/x.txt"}
    assert len({f["file_id"] for f in files.values()}) == 4
    for path, body in (("a/r.txt", b"aa"), ("b/r.txt", b"bb"), ("r.txt", b"top"),
                       ("x.txt", b"new")):
        item = files[f"/mnt/user-data/outputs/{path}"]
        content = http.get(f"/v1/containers/{cid}/files/{item['file_id']}/content")
        assert content.content == body and item["size_bytes"] == len(body), path


def test_a_finished_run_no_longer_in_memory_answers_409_not_404(server_factory):
    """Once a finished run's log was pushed out of memory (run_logs_kept, its
    bytes, a restart), GET still showed it, but DELETE and tool-results said
    there was no such run (404), where a run kept in memory answers 409."""
    server = server_factory(run_logs_kept=1, pool_size=1)
    with server.client() as http:
        events = collect(http, answer=lambda call: "rows", tools=[QUERY_TOOL],
                         allowed_tools=["advanced_query"], code="print(advanced_query(sql='x'))")
        run_id = final(events)["runId"]
        call_id = next(e for e in events if e.event == "tool_call.required").json()["calls"][0]
        collect(http, code="print('another run')")  # the first one's log goes
        url = f"/v1/code-execution/runs/{run_id}"
        assert http.get(url).json()["status"] == "completed"
        cancelled = http.delete(url)
        assert cancelled.status_code == 409, cancelled.text
        assert "completed" in cancelled.json()["error"]["message"]
        for call in (call_id["call_id"], "call_nope"):
            late = http.post(f"{url}/tool-results", json={"results": [{"call_id": call,
                                                                       "output": "1"}]})
            assert late.status_code == 409, late.text
        assert http.delete("/v1/code-execution/runs/cexrun_nope").status_code == 404


def test_a_run_past_its_retention_is_gone_from_memory_and_store_alike(server_factory):
    """Finished logs in memory went only as newer runs pushed them out, and the
    stored record at the reaper's next pass (a minute or more apart): on a
    quiet server a run's output and events were read back long after its
    retention had ended. Past it a run is unknown, wherever it is kept."""
    server = server_factory(run_retention_seconds=3, run_logs_kept=1, pool_size=1)
    with server.client() as http:
        started = time.time()
        in_memory = final(collect(http, code="print('in memory')"))["runId"]
        stored = final(collect(http, code="print('stored')"))["runId"]
        in_memory, stored = stored, in_memory  # the later one is the one still in memory
        for run_id in (in_memory, stored):
            assert http.get(f"/v1/code-execution/runs/{run_id}").status_code == 200
        time.sleep(max(0.0, started + 4 - time.time()))
        for run_id in (in_memory, stored):
            url = f"/v1/code-execution/runs/{run_id}"
            assert http.get(url).status_code == 404, run_id
            assert http.get(f"{url}/events").status_code == 404, run_id
            assert http.delete(url).status_code == 404, run_id
