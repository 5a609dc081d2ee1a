"""Issue 10, gateway mode in OpenAI's dialect: ``/v1/responses`` with ``code_interpreter``
and ``caronte:code_execution``, proven with the official ``openai`` package.

Every test drives a real ``shoal serve`` (the ``gateway`` fixture) whose upstream model
is the scripted one: the script says what the model answers, the sandboxes are real,
and the upstream's record says what the model was sent. In front of the model, a
code tool is an ordinary function tool (``code_interpreter {code}`` for OpenAI's tool,
``code_execution {language, code, timeout_ms}`` for Caronte's marker), so a scripted
``function_call`` of it makes the gateway run that code, and the next scripted turn
(often a callable reading the result) is what the model says after seeing it.
"""

from __future__ import annotations

import base64
import json
import sqlite3
import time

import openai
import pytest

from tests.gateway.conftest import CLIENT_TOKEN, OPERATOR_KEY, OTHER_TOKEN
from tests.gateway.scripted_upstream import (OpenAITurn, function_call, message, openai_turn,
                                             reasoning)

MODEL = "gpt-4o-mini"
CI_AUTO = {"type": "code_interpreter", "container": {"type": "auto"}}
CARONTE = {"type": "caronte:code_execution"}
OUTPUTS = ["code_interpreter_call.outputs"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST_RETRY = {"retry-after-ms": "10"}

CHART_CODE = (
    "import matplotlib\n"
    "matplotlib.use('Agg')\n"
    "import matplotlib.pyplot as plt\n"
    "plt.plot([1, 2, 3, 4], [1, 4, 9, 16])\n"
    "plt.title('squares')\n"
    "plt.savefig('/mnt/data/chart.png')\n"
    "print('chart saved')\n"
)
CHART_TEXT = "Here is the chart of the squares: [chart.png](sandbox:/mnt/data/chart.png). It grows fast."
CHART_LINK = "sandbox:/mnt/data/chart.png"

PRICE_TOOL = {"type": "function", "name": "lookup_price", "strict": False,
              "description": "The price of a product.",
              "parameters": {"type": "object", "properties": {"sku": {"type": "string"}},
                             "required": ["sku"]}}
STOCK_TOOL = {"type": "function", "name": "lookup_stock", "strict": False,
              "description": "How many items of a product are in stock.",
              "parameters": {"type": "object", "properties": {"sku": {"type": "string"}},
                             "required": ["sku"]}}

SALES_CSV = (b"month,revenue\n"
             b"2024-01,100\n2024-01,50\n2024-02,120\n2024-03,90\n2024-03,110\n")


# --------------------------------------------------------------------------- helpers


def last_output(body: dict) -> str:
    """What the model was given back for its last tool call."""
    item = body["input"][-1]
    assert item["type"] == "function_call_output", item
    return item["output"]


def then_say(render):
    """A turn whose text is ``render(output of the last tool call)``."""
    return lambda body: openai_turn(message(render(last_output(body))))


def run_ci(code: str, text: str = "done"):
    """Two turns: the model calls code_interpreter with ``code``, then says ``text``."""
    return [openai_turn(function_call("code_interpreter", {"code": code})),
            openai_turn(message(text))]


def kinds(response) -> list[str]:
    return [item.type for item in response.output]


def only(response, kind: str):
    found = [item for item in response.output if item.type == kind]
    assert len(found) == 1, kinds(response)
    return found[0]


def cited(part, filename: str):
    """The one container_file_citation of ``filename`` on an output_text part."""
    assert all(a.type == "container_file_citation" for a in part.annotations), part.annotations
    found = [a for a in part.annotations if a.filename == filename]
    assert len(found) == 1, part.annotations
    return found[0]


def container_ids(client: openai.OpenAI) -> set[str]:
    return {container.id for container in client.containers.list(limit=100)}


def fed_back(upstream, request_index: int) -> str:
    """The function_call_output the model got in the given upstream request."""
    return last_output(upstream.requests[request_index].body)


def upstream_function(body: dict, name: str) -> dict:
    found = [tool for tool in body["tools"] if tool.get("name") == name]
    assert len(found) == 1, body["tools"]
    return found[0]


def assert_outputs_answered(body: dict) -> None:
    """The history sent upstream is one a real Responses API accepts: every
    function_call_output answers an earlier function_call, and every function_call
    has its output."""
    calls, outputs = [], []
    for item in body["input"]:
        if item.get("type") == "function_call":
            calls.append(item["call_id"])
        elif item.get("type") == "function_call_output":
            assert item["call_id"] in calls, ("an output without its call", item, body["input"])
            outputs.append(item["call_id"])
    assert sorted(calls) == sorted(outputs), ("calls without outputs", body["input"])


def caronte_result(upstream, request_index: int) -> dict:
    return json.loads(fed_back(upstream, request_index))


def assert_operator_auth(upstream) -> None:
    assert upstream.requests
    for recorded in upstream.requests:
        assert recorded.headers["authorization"] == f"Bearer {OPERATOR_KEY}"
        assert all(CLIENT_TOKEN not in value for value in recorded.headers.values())


@pytest.fixture
def other_client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=OTHER_TOKEN, max_retries=0)


@pytest.fixture
def http(gateway):
    with gateway.client(CLIENT_TOKEN) as client:
        yield client


# --------------------------------------------------------------------------- code_interpreter


def test_calculation(upstream, openai_client):
    upstream.script(openai_turn(function_call("code_interpreter", {"code": "print(6 * 7)"}, call_id="call_calc")),
                    then_say(lambda out: f"The answer is {out.strip()}."))

    response = openai_client.responses.create(model=MODEL, input="What is 6 times 7?", tools=[CI_AUTO])

    assert response.status == "completed"
    assert response.output_text == "The answer is 42."
    assert kinds(response) == ["code_interpreter_call", "message"]
    call = response.output[0]
    assert call.id.startswith("ci_")
    assert (call.status, call.code, call.outputs) == ("completed", "print(6 * 7)", None)
    assert call.container_id
    # The model saw a function tool, never OpenAI's hosted one, and got the stdout back.
    assert len(upstream.requests) == 2
    first, second = (r.body for r in upstream.requests)
    tool = upstream_function(first, "code_interpreter")
    assert tool["type"] == "function"
    assert set(tool["parameters"]["properties"]) == {"code"}
    assert all(t["type"] != "code_interpreter" for t in first["tools"])
    assert "include" not in first
    assert second["input"][-2]["type"] == "function_call"
    assert second["input"][-2]["call_id"] == "call_calc"
    assert second["input"][-1]["call_id"] == "call_calc"
    assert second["input"][-1]["output"].strip() == "42"
    assert_outputs_answered(second)
    assert_operator_auth(upstream)
    # The response's usage is that of both model calls.
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (20, 10, 30)


def test_a_reasoning_models_turns_continue(upstream, openai_client):
    # A reasoning model's turn begins with a reasoning item. The loop's own calls
    # are "store": false, so that item, sent back by id alone, was one the
    # upstream no longer had: its 404 ended every such request after one call.
    upstream.script(openai_turn(reasoning("need to compute"),
                                function_call("code_interpreter", {"code": "print(6 * 7)"})),
                    openai_turn(reasoning("thinking again"),
                                function_call("code_interpreter", {"code": "print(6 * 8)"})),
                    then_say(lambda output: f"The answer is {output.strip()}."))
    response = openai_client.responses.create(model=MODEL, input="6*7?", tools=[CI_AUTO],
                                              reasoning={"effort": "low"})
    assert response.output_text == "The answer is 48."
    assert kinds(response) == ["reasoning", "code_interpreter_call", "reasoning",
                               "code_interpreter_call", "message"]
    assert all(not recorded.error for recorded in upstream.requests)
    sent_back = [item for item in upstream.requests[2].body["input"] if item["type"] == "reasoning"]
    assert len(sent_back) == 2 and all(item["encrypted_content"] for item in sent_back)
    assert_outputs_answered(upstream.requests[2].body)

    # Without asking for reasoning, the model's reasoning is not kept, but the
    # loop goes on; and a continuation sends nothing the upstream cannot find.
    upstream.script(openai_turn(reasoning(), function_call("code_interpreter", {"code": "print(1)"})),
                    openai_turn(message("one")), openai_turn(message("again")))
    first = openai_client.responses.create(model=MODEL, input="1?", tools=[CI_AUTO])
    assert first.output_text == "one"
    follow = openai_client.responses.create(model=MODEL, input="again", tools=[CI_AUTO],
                                            previous_response_id=first.id)
    assert follow.output_text == "again"
    # A client that keeps the history itself sends the reasoning item back as it got it.
    upstream.script(openai_turn(message("by hand")))
    history = [item.model_dump(exclude_none=True) for item in first.output]
    by_hand = openai_client.responses.create(model=MODEL, tools=[CI_AUTO], input=[
        *history, {"role": "user", "content": "and by hand?"}])
    assert by_hand.output_text == "by hand"


def forced_model(body: dict) -> OpenAITurn:
    """A model bound by tool_choice, as the real API binds it: it must call a tool."""
    if body.get("tool_choice") not in (None, "auto", "none"):
        return openai_turn(function_call("code_interpreter", {"code": "print('computed')"}))
    return openai_turn(message("The code said: " + last_output(body).strip()))


@pytest.mark.parametrize("choice", [{"type": "code_interpreter"}, "required"],
                         ids=["code_interpreter", "required"])
def test_a_forced_tool_choice_binds_the_first_turn_only(upstream, openai_client, choice):
    # Held on every turn, the forced choice forbade the model's answer after its
    # code ran: ten calls of the model, and an incomplete response.
    upstream.script(*[forced_model] * 10)
    response = openai_client.responses.create(model=MODEL, input="go", tools=[CI_AUTO],
                                              tool_choice=choice)
    assert response.status == "completed"
    assert response.output_text == "The code said: computed"
    assert len(upstream.requests) == 2
    assert response.tool_choice == choice or response.tool_choice.type == "code_interpreter"


def test_items_keep_their_place(upstream, openai_client):
    upstream.script(openai_turn(message("Let me compute."), function_call("code_interpreter", {"code": "a = 20\nprint(a)"})),
                    openai_turn(function_call("code_interpreter", {"code": "print(a + 1)"})),
                    then_say(lambda out: f"Got {out.strip()}."))

    response = openai_client.responses.create(model=MODEL, input="Two steps.", tools=[CI_AUTO], include=OUTPUTS)

    assert kinds(response) == ["message", "code_interpreter_call", "code_interpreter_call", "message"]
    first, second = response.output[1], response.output[2]
    assert (first.code, second.code) == ("a = 20\nprint(a)", "print(a + 1)")
    assert [o.logs.strip() for o in first.outputs] == ["20"] and [o.logs.strip() for o in second.outputs] == ["21"]
    assert first.id != second.id and first.container_id == second.container_id
    assert response.output[0].content[0].text == "Let me compute."
    assert response.output_text.endswith("Got 21.")
    assert len(upstream.requests) == 3
    for recorded in upstream.requests[1:]:
        assert_outputs_answered(recorded.body)


def test_client_function_call_beside_code_interpreter(upstream, openai_client):
    upstream.script(openai_turn(function_call("lookup_price", {"sku": "B2"}, call_id="call_direct")))

    asked = openai_client.responses.create(model=MODEL, input="Price of B2?", tools=[PRICE_TOOL, CI_AUTO])

    assert kinds(asked) == ["function_call"]
    call = asked.output[0]
    assert (call.name, call.call_id, json.loads(call.arguments)) == ("lookup_price", "call_direct", {"sku": "B2"})
    upstream.script(then_say(lambda out: f"B2 costs {json.loads(out)['price']}."))
    answered = openai_client.responses.create(
        model=MODEL, tools=[PRICE_TOOL, CI_AUTO], previous_response_id=asked.id,
        input=[{"type": "function_call_output", "call_id": "call_direct", "output": json.dumps({"price": 3})}])
    assert answered.output_text == "B2 costs 3."
    assert_outputs_answered(upstream.requests[1].body)
    assert upstream_function(upstream.requests[1].body, "lookup_price") == PRICE_TOOL


def test_chart_is_cited_and_downloads(upstream, openai_client):
    upstream.script(openai_turn(function_call("code_interpreter", {"code": CHART_CODE})),
                    openai_turn(message(CHART_TEXT)))

    response = openai_client.responses.create(model=MODEL, input="Plot the squares.", tools=[CI_AUTO])

    assert kinds(response) == ["code_interpreter_call", "message"]
    call, reply = response.output
    assert call.status == "completed"
    assert "/mnt/data/chart.png" in fed_back(upstream, 1)  # the model is told the file is there
    part = reply.content[0]
    assert part.text == CHART_TEXT
    citation = cited(part, "chart.png")
    assert citation.container_id == call.container_id
    assert citation.file_id.startswith("cfile_")
    link = CHART_TEXT.index(CHART_LINK)
    assert link <= citation.start_index < citation.end_index <= link + len(CHART_LINK)
    assert CHART_TEXT[citation.start_index:citation.end_index].endswith("chart.png")

    content = openai_client.containers.files.content.retrieve(citation.file_id,
                                                              container_id=citation.container_id)
    assert content.content.startswith(PNG_MAGIC)
    meta = openai_client.containers.files.retrieve(citation.file_id, container_id=citation.container_id)
    assert (meta.id, meta.object, meta.container_id) == (citation.file_id, "container.file", call.container_id)
    assert meta.path == "/mnt/data/chart.png"
    assert meta.source == "assistant"
    assert meta.bytes == len(content.content)
    produced = {f.id: f.path for f in openai_client.containers.files.list(call.container_id)
                if f.source == "assistant"}
    assert produced[citation.file_id] == "/mnt/data/chart.png"
    assert all(path.startswith("/mnt/data/") for path in produced.values())
    # Every citation names a file of that container, and downloads.
    assert {a.file_id for a in part.annotations} <= set(produced)
    for annotation in part.annotations:
        assert annotation.container_id == call.container_id
        assert 0 <= annotation.start_index <= annotation.end_index <= len(part.text)
        assert openai_client.containers.files.content.retrieve(
            annotation.file_id, container_id=annotation.container_id).content.startswith(PNG_MAGIC)


def test_error_in_code_reaches_the_model(upstream, openai_client):
    upstream.script(openai_turn(function_call("code_interpreter", {"code": "x = 1\nprint(x / 0)"})),
                    then_say(lambda out: "It failed with " + ("ZeroDivisionError" if "ZeroDivisionError" in out
                                                               else "something else")))

    response = openai_client.responses.create(model=MODEL, input="Divide by zero.", tools=[CI_AUTO],
                                              include=OUTPUTS)

    traceback = fed_back(upstream, 1)
    assert "Traceback" in traceback and "ZeroDivisionError" in traceback
    call = only(response, "code_interpreter_call")
    assert call.status == "completed"
    assert any(o.type == "logs" and "ZeroDivisionError" in o.logs for o in call.outputs)
    assert response.output_text == "It failed with ZeroDivisionError"
    assert response.status == "completed"


def test_state_is_kept_across_calls(upstream, openai_client):
    upstream.script(*run_ci("secret = 1234 * 2\nprint('stored')", "Stored it."))
    first = openai_client.responses.create(model=MODEL, input="Remember 1234*2.", tools=[CI_AUTO])
    upstream.script(openai_turn(function_call("code_interpreter", {"code": "print(secret + 1)"})),
                    then_say(lambda out: f"It is {out.strip()}."))

    second = openai_client.responses.create(model=MODEL, input="Add one to it.", tools=[CI_AUTO],
                                            previous_response_id=first.id)

    assert second.output_text == "It is 2469."
    assert only(second, "code_interpreter_call").container_id == only(first, "code_interpreter_call").container_id
    assert second.previous_response_id == first.id
    # The model was sent the whole conversation: the first exchange, then the new question.
    history = upstream.requests[2].body["input"]
    texts = json.dumps(history)
    assert "Remember 1234*2." in texts and "Stored it." in texts and "Add one to it." in texts
    assert_outputs_answered(upstream.requests[3].body)


def test_include_outputs_logs_and_image(upstream, openai_client):
    upstream.script(*run_ci(CHART_CODE, "Plotted."))

    response = openai_client.responses.create(model=MODEL, input="Plot it.", tools=[CI_AUTO], include=OUTPUTS)

    call = only(response, "code_interpreter_call")
    logs = [o for o in call.outputs if o.type == "logs"]
    images = [o for o in call.outputs if o.type == "image"]
    assert [o.logs.strip() for o in logs] == ["chart saved"]
    assert images
    prefix = "data:image/png;base64,"
    pngs = []
    for image in images:
        assert image.url.startswith(prefix)
        pngs.append(base64.b64decode(image.url[len(prefix):], validate=True))
        assert pngs[-1].startswith(PNG_MAGIC)
    # The file the code saved is among the inline images.
    file_id = cited(response.output[1].content[0], "chart.png").file_id
    saved = openai_client.containers.files.content.retrieve(file_id, container_id=call.container_id)
    assert saved.content in pngs


def test_inline_images_are_bounded_per_response(upstream, openai_client):
    # 25 PNGs of 4 MB each came back inline: a 140 MB response, stored again whole.
    code = ("import os\n"
            "for n in range(12):\n"
            "    open(f'/mnt/data/big{n}.png', 'wb').write(b'\\x89PNG\\r\\n\\x1a\\n' + os.urandom(3 * 1024 * 1024))\n"
            "print('saved')")
    upstream.script(*run_ci(code, "Saved."))
    response = openai_client.responses.create(model=MODEL, input="Save them.", tools=[CI_AUTO],
                                              include=OUTPUTS)
    call = only(response, "code_interpreter_call")
    images = [o for o in call.outputs if o.type == "image"]
    inlined = sum(len(image.url) for image in images)
    assert 0 < len(images) <= 8 and inlined <= 16 * 1024 * 1024 * 4 // 3 + 1024, (len(images), inlined)
    files = [f for f in openai_client.containers.files.list(call.container_id) if "/big" in f.path]
    assert len(files) == 12  # the rest are there, only not inline


def test_include_off_means_no_outputs(upstream, openai_client):
    upstream.script(*run_ci(CHART_CODE, "Plotted."))

    response = openai_client.responses.create(model=MODEL, input="Plot it.", tools=[CI_AUTO])

    call = only(response, "code_interpreter_call")
    assert call.outputs is None
    assert call.status == "completed"
    assert "chart saved" in fed_back(upstream, 1)  # the model still saw the logs


def test_a_huge_output_is_whole_for_the_client_and_bounded_for_the_model(upstream, openai_client):
    upstream.script(*run_ci("print('a' * 3_000_000)", "long"),
                    openai_turn(function_call("code_execution", {"code": "print('b' * 3_000_000)"})),
                    openai_turn(message("long too")))
    response = openai_client.responses.create(model=MODEL, input="go", tools=[CI_AUTO],
                                              include=OUTPUTS)
    assert len(only(response, "code_interpreter_call").outputs[0].logs) > 1_000_000
    assert "characters omitted" in fed_back(upstream, 1)
    assert len(upstream.requests[1].raw) < 100_000

    openai_client.responses.create(model=MODEL, input="go", tools=[CARONTE])
    assert len(upstream.requests[3].raw) < 100_000
    assert "characters omitted" in caronte_result(upstream, 3)["stdout"]


def test_a_stream_keeps_alive_while_a_later_turn_waits_on_the_model(gateway_factory, upstream):
    """Once its code had run, a stream said nothing while the model thought over
    the result: a proxy cuts a stream that is silent for its read timeout."""
    import httpx

    server = gateway_factory(stream_ping_seconds=0.2)
    upstream.script(openai_turn(function_call("code_interpreter", {"code": "print(1)"})),
                    openai_turn(message("Thought it over."), delay=0.6))
    body = {"model": MODEL, "input": "go", "tools": [CI_AUTO], "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=60,
                      headers={"authorization": f"Bearer {CLIENT_TOKEN}"}) as response:
        assert response.status_code == 200
        lines = list(response.iter_lines())
    ran = next(i for i, line in enumerate(lines)
               if line == "event: response.code_interpreter_call.completed")
    answered = next(i for i, line in enumerate(lines) if line == "event: response.output_text.delta")
    assert ran < answered
    assert lines[ran:answered].count(": keep-alive") >= 2, lines[ran:answered]
    assert "event: response.completed" in lines


def test_last_expression_value_is_logged(upstream, openai_client):
    upstream.script(openai_turn(function_call("code_interpreter", {"code": "value = 6 * 7\nvalue"})),
                    then_say(lambda out: f"saw {out.strip()}"))

    response = openai_client.responses.create(model=MODEL, input="Show 6*7.", tools=[CI_AUTO], include=OUTPUTS)

    assert response.output_text == "saw 42"
    assert [o.logs.strip() for o in only(response, "code_interpreter_call").outputs if o.type == "logs"] == ["42"]


def test_auto_container_created_on_first_call_and_reused(upstream, openai_client):
    before = container_ids(openai_client)
    upstream.script(openai_turn(message("Hello! No code needed.")))
    first = openai_client.responses.create(model=MODEL, input="Hi", tools=[CI_AUTO])
    assert kinds(first) == ["message"]
    assert container_ids(openai_client) == before  # the model never called the tool

    upstream.script(*run_ci("counter = 1\nprint(counter)", "Set."))
    second = openai_client.responses.create(model=MODEL, input="Set a counter.", tools=[CI_AUTO],
                                            previous_response_id=first.id)
    created = container_ids(openai_client) - before
    container = only(second, "code_interpreter_call").container_id
    assert created == {container}

    upstream.script(openai_turn(function_call("code_interpreter", {"code": "counter += 1\nprint(counter)"})),
                    then_say(lambda out: f"Counter is {out.strip()}."))
    third = openai_client.responses.create(model=MODEL, input="Increment it.", tools=[CI_AUTO],
                                           previous_response_id=second.id)
    assert only(third, "code_interpreter_call").container_id == container
    assert third.output_text == "Counter is 2."
    assert container_ids(openai_client) - before == {container}
    assert openai_client.containers.retrieve(container).status in ("active", "running")


def test_explicit_container_and_its_files(upstream, openai_client):
    extra = openai_client.files.create(file=("extra.txt", b"30", "text/plain"), purpose="user_data")
    container = openai_client.containers.create(name="ci-explicit", file_ids=[extra.id])
    uploaded = openai_client.containers.files.create(container.id, file=("numbers.txt", b"3\n4\n5\n", "text/plain"))
    assert uploaded.id.startswith("cfile_")
    assert uploaded.container_id == container.id
    before = container_ids(openai_client)
    code = (f"nums = [int(x) for x in open({uploaded.path!r}).read().split()]\n"
            "open('/mnt/data/total.txt', 'w').write(str(sum(nums)))\n"
            "print('total', sum(nums))")
    upstream.script(openai_turn(function_call("code_interpreter", {"code": code})),
                    then_say(lambda out: f"{out.splitlines()[0]} (see total.txt)"))

    response = openai_client.responses.create(
        model=MODEL, input="Sum numbers.txt.",
        tools=[{"type": "code_interpreter", "container": container.id}])

    assert only(response, "code_interpreter_call").container_id == container.id
    assert response.output_text == "total 12 (see total.txt)"
    assert container_ids(openai_client) == before  # no other container was made
    files = {f.path: f for f in openai_client.containers.files.list(container.id)}
    assert uploaded.path in files
    assert [f.source for path, f in files.items() if path.endswith("/extra.txt")] == ["user"]
    total = files["/mnt/data/total.txt"]
    assert total.source == "assistant" and total.id.startswith("cfile_")
    body = openai_client.containers.files.content.retrieve(total.id, container_id=container.id)
    assert body.content == b"12"
    citation = cited(response.output[-1].content[0], "total.txt")
    assert (citation.file_id, citation.container_id) == (total.id, container.id)


def test_auto_container_with_file_ids(upstream, openai_client):
    file = openai_client.files.create(file=("facts.txt", b"water boils at 100", "text/plain"), purpose="user_data")
    code = ("import glob\n"
            "[path] = [p for p in glob.glob('/mnt/**/facts.txt', recursive=True)]\n"
            "print(open(path).read())")
    upstream.script(openai_turn(function_call("code_interpreter", {"code": code})),
                    then_say(lambda out: out.strip()))

    response = openai_client.responses.create(
        model=MODEL, input="What does facts.txt say?",
        tools=[{"type": "code_interpreter", "container": {"type": "auto", "file_ids": [file.id]}}])

    assert response.output_text == "water boils at 100"
    container = only(response, "code_interpreter_call").container_id
    listed = [f for f in openai_client.containers.files.list(container) if f.path.endswith("/facts.txt")]
    assert len(listed) == 1 and listed[0].source == "user" and listed[0].id.startswith("cfile_")
    assert openai_client.containers.files.content.retrieve(listed[0].id, container_id=container).content == (
        b"water boils at 100")


def test_a_follow_ups_file_ids_reach_the_conversations_container(upstream, openai_client):
    # The auto container got its file_ids when it was made: a file the user
    # added in a later turn of the conversation was silently not there.
    upstream.script(*run_ci("print(1)", "one"))
    first = openai_client.responses.create(model=MODEL, input="hi", tools=[CI_AUTO])
    early = openai_client.files.create(file=("early.txt", b"early", "text/plain"), purpose="user_data")
    late = openai_client.files.create(file=("late.txt", b"late data", "text/plain"), purpose="user_data")
    code = ("import glob\n"
            "print(sorted(open(p).read() for p in glob.glob('/mnt/**/*.txt', recursive=True)))")
    for ids, seen in (([early.id], "['early']"), ([early.id, late.id], "['early', 'late data']")):
        upstream.script(openai_turn(function_call("code_interpreter", {"code": code})),
                        then_say(lambda output: output.strip()))
        first = openai_client.responses.create(
            model=MODEL, input="read them", previous_response_id=first.id,
            tools=[{"type": "code_interpreter", "container": {"type": "auto", "file_ids": ids}}])
        assert first.output_text == seen


def test_file_ids_are_attached_once_each_and_at_most_fifty(upstream, openai_client):
    # Each id is a copy into the container: one id named 3,000 times was 3,000.
    file = openai_client.files.create(file=("once.txt", b"once", "text/plain"), purpose="user_data")
    upstream.script(openai_turn(function_call("code_interpreter", {"code": "print(1)"})),
                    openai_turn(message("ok")))
    response = openai_client.responses.create(model=MODEL, input="Go.", tools=[
        {"type": "code_interpreter", "container": {"type": "auto", "file_ids": [file.id] * 3000}}])
    container = only(response, "code_interpreter_call").container_id
    assert [f.path for f in openai_client.containers.files.list(container)
            if f.path.endswith("once.txt")] == ["/mnt/user-data/uploads/once.txt"]
    many = [f"file-{n:040d}" for n in range(51)]
    for tool in ({"type": "code_interpreter", "container": {"type": "auto", "file_ids": many}},
                 {"type": "caronte:code_execution", "file_ids": many}):
        with pytest.raises(openai.BadRequestError) as refused:
            openai_client.responses.create(model=MODEL, input="Go.", tools=[tool])
        assert refused.value.param == "tools" and "at most 50" in refused.value.body["message"]
    assert len(upstream.requests) == 2


# --------------------------------------------------------------------------- memory tiers

ALLOCATE = "data = b'x' * ({mib} * 1024 * 1024)\nprint('allocated', len(data) // (1024 * 1024))"


def allocate_in(openai_client, upstream, tool: dict, mib: int) -> str:
    upstream.script(*run_ci(ALLOCATE.format(mib=mib)))
    openai_client.responses.create(model=MODEL, input=f"Allocate {mib} MiB.", tools=[tool])
    return fed_back(upstream, -1)


def test_memory_limit_tier_is_enforced(upstream, openai_client):
    # The test servers' default sandbox limit is 512 MiB: 700 MiB does not fit...
    default = allocate_in(openai_client, upstream, CI_AUTO, 700)
    assert "allocated 700" not in default
    assert "MemoryError" in default or "memory" in default.lower()

    # ...but fits in a 4g container,
    upstream.reset()
    big = openai_client.containers.create(name="four-gig", memory_limit="4g")
    assert big.memory_limit == "4g"
    assert "allocated 700" in allocate_in(openai_client, upstream, {"type": "code_interpreter", "container": big.id}, 700)

    # ...and a 1g container is capped at its tier, not unlimited.
    upstream.reset()
    small = openai_client.containers.create(name="one-gig", memory_limit="1g")
    capped = allocate_in(openai_client, upstream, {"type": "code_interpreter", "container": small.id}, 1300)
    assert "allocated 1300" not in capped
    assert "MemoryError" in capped or "memory" in capped.lower()


@pytest.mark.parametrize("tier", ["16g", "64g"])
def test_memory_limit_above_the_ceiling_is_refused(upstream, openai_client, tier):
    with pytest.raises(openai.APIStatusError) as refused:
        openai_client.containers.create(name="too-big", memory_limit=tier)
    assert 400 <= refused.value.status_code < 500
    assert tier in refused.value.message and "ceiling" in refused.value.message
    assert set(refused.value.body) >= {"message", "type", "param", "code"}

    with pytest.raises(openai.APIStatusError) as refused:
        openai_client.responses.create(
            model=MODEL, input="hi",
            tools=[{"type": "code_interpreter", "container": {"type": "auto", "memory_limit": tier}}])
    assert 400 <= refused.value.status_code < 500
    assert tier in refused.value.message
    assert upstream.requests == []  # refused before the model was asked


@pytest.fixture(scope="module")
def tight_gateway(gateway_factory):
    """A server whose operator set a 1 GiB memory ceiling and a 1 s wait for inner tool results."""
    return gateway_factory(max_memory_limit_mib=1024, tool_wait_seconds=1)


def test_max_tool_calls_bounds_the_calls_run(upstream, openai_client):
    # The client's max_tool_calls was passed to the model, which does not run
    # these calls: every one the model made ran, up to the server's own budget.
    upstream.script(openai_turn(function_call("code_interpreter", {"code": "n = 1\nprint(n)"})),
                    openai_turn(function_call("code_interpreter", {"code": "n += 1\nprint(n)"})),
                    then_say(lambda output: f"Stopped: {output}"))
    response = openai_client.responses.create(model=MODEL, input="count", tools=[CI_AUTO],
                                              max_tool_calls=1)
    assert response.status == "completed"
    assert fed_back(upstream, 1).strip() == "1"
    assert "not run" in fed_back(upstream, 2)
    assert response.output_text.startswith("Stopped: error:")

    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.responses.create(model=MODEL, input="count", tools=[CI_AUTO],
                                       max_tool_calls="1")
    assert raised.value.param == "max_tool_calls"


def test_many_calls_in_one_turn_are_held_to_the_execution_budget(upstream, gateway_factory):
    server = gateway_factory(gateway_max_round_trips=3)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=CLIENT_TOKEN, max_retries=0)
    append = "open('/mnt/data/ran.txt', 'a').write('x')"
    upstream.script(openai_turn(*[function_call("code_interpreter", {"code": append}) for _ in range(6)]))
    paused = client.responses.create(model=MODEL, input="Go.", tools=[CI_AUTO])
    assert paused.status == "incomplete" and paused.incomplete_details.reason == "max_tool_calls"
    assert len(upstream.requests) == 1  # the model was not asked again within this request
    upstream.script(openai_turn(function_call("code_interpreter", {"code": "print(open('/mnt/data/ran.txt').read())"})),
                    then_say(lambda out: out))
    client.responses.create(model=MODEL, input="Again.", tools=[CI_AUTO], previous_response_id=paused.id)
    outputs = [item["output"] for item in upstream.requests[1].body["input"]
               if item.get("type") == "function_call_output"]
    assert sum("not run" in output for output in outputs) == 3, outputs
    assert fed_back(upstream, 2).startswith("xxx"), fed_back(upstream, 2)


def test_memory_ceiling_is_the_operators(upstream, tight_gateway):
    client = openai.OpenAI(base_url=tight_gateway.url + "/v1", api_key=CLIENT_TOKEN, max_retries=0)
    assert client.containers.create(name="fits", memory_limit="1g").memory_limit == "1g"
    with pytest.raises(openai.APIStatusError) as refused:
        client.containers.create(name="too-big-here", memory_limit="4g")
    assert 400 <= refused.value.status_code < 500
    assert "4g" in refused.value.message and "1024" in refused.value.message


# --------------------------------------------------------------------------- Caronte


def test_caronte_minimal_example(upstream, openai_client):
    code = ("import statistics\n"
            "data = [3, 7, 7, 19, 24]\n"
            "print(f'Mean: {statistics.mean(data)}')\n"
            "print(f'Stdev: {statistics.stdev(data):.2f}')\n")
    upstream.script(openai_turn(function_call("code_execution", {"language": "python", "code": code})),
                    then_say(lambda out: "Result: " + json.loads(out)["stdout"].replace("\n", "; ")))

    response = openai_client.responses.create(
        model=MODEL, input="Compute the mean and standard deviation of [3, 7, 7, 19, 24].",
        tools=[{"type": "caronte:code_execution"}])

    assert response.output_text == "Result: Mean: 12; Stdev: 9.00; "
    assert kinds(response) == ["message"]  # no inner round trip is shown
    tool = upstream_function(upstream.requests[0].body, "code_execution")
    assert tool["type"] == "function"
    assert set(tool["parameters"]["properties"]) == {"language", "code", "timeout_ms"}
    assert all(not t["type"].startswith("caronte") for t in upstream.requests[0].body["tools"])
    result = caronte_result(upstream, 1)
    assert result["run_id"].startswith("cexrun_")
    assert result["stdout"] == "Mean: 12\nStdev: 9.00\n"
    assert result["stderr"] == ""
    assert (result["exit_code"], result["status"]) == (0, "completed")
    assert isinstance(result["duration_ms"], int) and result["duration_ms"] >= 0
    assert result["inner_tool_calls"] == 0
    assert result["files"] == []
    assert "container_id" not in result or result["container_id"] is None  # no container used
    assert_outputs_answered(upstream.requests[1].body)


def test_caronte_model_cannot_choose_container_or_files(upstream, openai_client):
    elsewhere = openai_client.containers.create(name="not-granted")
    openai_client.containers.files.create(elsewhere.id, file=("secret.txt", b"hidden", "text/plain"))
    file = openai_client.files.create(file=("secret2.txt", b"hidden too", "text/plain"), purpose="user_data")
    code = ("import os\n"
            "print(any(os.path.exists(f'./external-files/{name}') for name in ('secret.txt', 'secret2.txt')))")
    upstream.script(openai_turn(function_call("code_execution", {"code": code, "container": elsewhere.id,
                                                                 "file_ids": [file.id]})),
                    openai_turn(message("looked")))

    openai_client.responses.create(model=MODEL, input="look around", tools=[CARONTE])

    result = caronte_result(upstream, 1)
    assert result["status"] == "completed"
    assert result["stdout"] == "False\n"
    assert result.get("container_id") != elsewhere.id
    assert {f.path.rsplit("/", 1)[-1] for f in openai_client.containers.files.list(elsewhere.id)} == {"secret.txt"}


def test_caronte_javascript_and_timeout(upstream, openai_client):
    upstream.script(openai_turn(function_call("code_execution", {"language": "javascript",
                                                                 "code": "console.log(6 * 7)"})),
                    openai_turn(function_call("code_execution", {"language": "python", "timeout_ms": 1000,
                                                                 "code": "import time\ntime.sleep(20)"})),
                    openai_turn(message("done")))

    openai_client.responses.create(model=MODEL, input="js then slow", tools=[CARONTE])

    js = caronte_result(upstream, 1)
    assert (js["stdout"], js["exit_code"], js["status"]) == ("42\n", 0, "completed")
    slow = caronte_result(upstream, 2)
    assert slow["status"] == "failed"
    assert slow["exit_code"] is None
    assert "timed out" in slow["error"]


def test_caronte_container_upload_and_run(upstream, openai_client, http):
    container = openai_client.containers.create(
        name="monthly-report", expires_after={"anchor": "last_active_at", "minutes": 60})
    file = openai_client.files.create(file=("sales.csv", SALES_CSV, "text/csv"), purpose="user_data")
    attached = http.post(f"/v1/containers/{container.id}/files", json={"file_id": file.id})
    assert attached.status_code == 200, attached.text
    code = ("import csv, collections\n"
            "import matplotlib.pyplot as plt\n"
            "totals = collections.OrderedDict()\n"
            "for row in csv.DictReader(open('./external-files/sales.csv')):\n"
            "    totals[row['month']] = totals.get(row['month'], 0) + int(row['revenue'])\n"
            "plt.bar(list(totals), list(totals.values()))\n"
            "plt.savefig('revenue.png')\n"
            "print(dict(totals))\n")
    upstream.script(openai_turn(function_call("code_execution", {"language": "python", "code": code})),
                    then_say(lambda out: f"Totals {json.loads(out)['stdout'].strip()}; see revenue.png."))

    response = openai_client.responses.create(
        model=MODEL, input="Plot total revenue by month from sales.csv and summarise the trend.",
        tools=[{"type": "caronte:code_execution", "container": container.id}])

    result = caronte_result(upstream, 1)
    assert result["status"] == "completed", result
    assert result["stdout"] == "{'2024-01': 150, '2024-02': 120, '2024-03': 200}\n"
    assert result["container_id"] == container.id
    by_name = {f["filename"]: f for f in result["files"]}
    assert all(f["file_id"].startswith("cfile_") and f["container_id"] == container.id for f in result["files"])
    produced = by_name["revenue.png"]
    assert produced["file_id"].startswith("cfile_")
    assert (produced["filename"], produced["mime_type"], produced["container_id"]) == (
        "revenue.png", "image/png", container.id)
    assert response.output_text == "Totals {'2024-01': 150, '2024-02': 120, '2024-03': 200}; see revenue.png."
    citation = cited(response.output[-1].content[0], "revenue.png")
    assert (citation.file_id, citation.container_id) == (produced["file_id"], container.id)
    assert response.output_text[citation.start_index:citation.end_index] == "revenue.png"
    png = openai_client.containers.files.content.retrieve(produced["file_id"], container_id=container.id).content
    assert png.startswith(PNG_MAGIC) and len(png) == produced["size_bytes"]


def test_caronte_file_ids_only_make_an_implicit_container(upstream, openai_client):
    file = openai_client.files.create(file=("notes.txt", b"alpha beta gamma", "text/plain"), purpose="user_data")
    marker = {"type": "caronte:code_execution", "file_ids": [file.id]}
    before = container_ids(openai_client)
    read = "print(open('./external-files/notes.txt').read().upper())"
    upstream.script(openai_turn(function_call("code_execution", {"code": read})),
                    openai_turn(message("read it")))

    first = openai_client.responses.create(model=MODEL, input="Shout notes.txt.", tools=[marker])

    result = caronte_result(upstream, 1)
    assert result["stdout"] == "ALPHA BETA GAMMA\n"
    implicit = result["container_id"]
    assert implicit and implicit in container_ids(openai_client) - before
    assert openai_client.containers.retrieve(implicit).model_extra.get("implicit") is True

    # A later turn of the conversation reuses that container: no new one, the file still there.
    upstream.reset()
    upstream.script(openai_turn(function_call("code_execution", {"code": read})),
                    openai_turn(message("again")))
    openai_client.responses.create(model=MODEL, input="Again.", tools=[marker], previous_response_id=first.id)
    again = caronte_result(upstream, 1)
    assert again["container_id"] == implicit
    assert again["stdout"] == "ALPHA BETA GAMMA\n"
    assert container_ids(openai_client) - before == {implicit}

    # A file added in a later turn is mounted too (it was given to the first run only).
    late = openai_client.files.create(file=("late.txt", b"delta", "text/plain"), purpose="user_data")
    upstream.reset()
    upstream.script(openai_turn(function_call("code_execution", {
                        "code": "print(open('./external-files/late.txt').read())"})),
                    openai_turn(message("late")))
    openai_client.responses.create(model=MODEL, input="And late.txt?", previous_response_id=first.id,
                                   tools=[{**marker, "file_ids": [file.id, late.id]}])
    assert caronte_result(upstream, 1)["stdout"] == "delta\n"
    assert caronte_result(upstream, 1)["container_id"] == implicit


def paused_turns():
    code = ("import json\n"
            "answer = lookup_price(sku='A1')\n"
            "if isinstance(answer, str):\n"
            "    answer = json.loads(answer)\n"
            "print('price', answer['price'])\n")
    return [openai_turn(function_call("code_execution", {"language": "python", "code": code},
                                      call_id="call_exec")),
            then_say(lambda out: f"The code printed: {json.loads(out)['stdout'].strip()}")]


def test_caronte_allowed_tools_pause_and_resume(upstream, openai_client):
    tools = [PRICE_TOOL, {"type": "caronte:code_execution", "allowed_tools": ["lookup_price"]}]
    turns = paused_turns()
    upstream.script(turns[0])

    paused = openai_client.responses.create(model=MODEL, input="What does A1 cost?", tools=tools)

    assert kinds(paused) == ["function_call"]  # the inner code_execution call stays hidden
    call = paused.output[0]
    assert call.name == "lookup_price"
    assert json.loads(call.arguments) == {"sku": "A1"}
    assert call.call_id != "call_exec"
    assert len(upstream.requests) == 1

    upstream.script(turns[1])
    final = openai_client.responses.create(
        model=MODEL, tools=tools, previous_response_id=paused.id,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"sku": "A1", "price": 42.5})}])

    assert final.output_text == "The code printed: price 42.5"
    assert kinds(final) == ["message"]
    result = caronte_result(upstream, 1)
    assert result["stdout"] == "price 42.5\n"
    assert result["inner_tool_calls"] == 1
    assert result["status"] == "completed"
    second = upstream.requests[1].body
    assert second["input"][-1]["call_id"] == "call_exec"
    assert_outputs_answered(second)
    assert len(upstream.requests) == 2


def test_caronte_resume_with_the_full_input(upstream, openai_client):
    tools = [PRICE_TOOL, {"type": "caronte:code_execution", "allowed_tools": ["lookup_price"]}]
    turns = paused_turns()
    upstream.script(turns[0])
    question = {"role": "user", "content": "What does A1 cost?"}
    paused = openai_client.responses.create(model=MODEL, input=[question], tools=tools, store=False)
    call = only(paused, "function_call")

    upstream.script(turns[1])
    final = openai_client.responses.create(
        model=MODEL, tools=tools,
        input=[question, *[item.model_dump(exclude_none=True) for item in paused.output],
               {"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"price": 7})}])

    assert final.output_text == "The code printed: price 7"
    assert caronte_result(upstream, 1)["inner_tool_calls"] == 1
    assert_outputs_answered(upstream.requests[1].body)


def test_paused_responses_kept_for_full_input_answers_are_bounded_per_tenant(
        upstream, gateway_factory):
    # Each paused response was kept in memory with its conversation, never let go
    # but by count (1,024): tens of MiB each at most. Now their bytes are bounded,
    # and one tenant's hold half: its flood forgets its own, not another tenant's.
    server = gateway_factory(gateway_paused_bytes=400_000, max_sessions=8)
    tools = [PRICE_TOOL, {"type": "caronte:code_execution", "allowed_tools": ["lookup_price"]}]
    clients = {token: openai.OpenAI(base_url=server.url + "/v1", api_key=token, max_retries=0)
               for token in (CLIENT_TOKEN, OTHER_TOKEN)}

    def pause(token: str) -> tuple[dict, object]:
        upstream.reset()
        upstream.script(paused_turns()[0])
        question = {"role": "user", "content": "What does A1 cost? " + "x" * 120_000}
        paused = clients[token].responses.create(model=MODEL, input=[question], tools=tools,
                                                 store=False)
        return question, paused

    def answer(token: str, question: dict, paused, kept: bool = True) -> str:
        upstream.reset()
        upstream.script(paused_turns()[1] if kept else openai_turn(message("not kept")))
        call = only(paused, "function_call")
        return clients[token].responses.create(
            model=MODEL, tools=tools,
            input=[question, *[item.model_dump(exclude_none=True) for item in paused.output],
                   {"type": "function_call_output", "call_id": call.call_id,
                    "output": json.dumps({"price": 7})}]).output_text

    theirs = pause(OTHER_TOKEN)
    first, second = pause(CLIENT_TOKEN), pause(CLIENT_TOKEN)  # past one tenant's 200 kB
    # The other tenant's is still found with the full input: its run resumes.
    assert answer(OTHER_TOKEN, *theirs) == "The code printed: price 7"
    assert answer(CLIENT_TOKEN, *second) == "The code printed: price 7"
    # This tenant's oldest was forgotten: its answer reaches the model as it came.
    assert answer(CLIENT_TOKEN, *first, kept=False) == "not kept"
    assert upstream.requests[0].body["input"][-1]["call_id"] == only(first[1], "function_call").call_id


def test_paused_run_never_resumed_is_reclaimed_and_its_container_kept(upstream, tight_gateway):
    client = openai.OpenAI(base_url=tight_gateway.url + "/v1", api_key=CLIENT_TOKEN, max_retries=0)
    container = client.containers.create(name="reclaimed")
    tools = [PRICE_TOOL, {"type": "caronte:code_execution", "container": container.id,
                          "allowed_tools": ["lookup_price"]}]
    code = ("try:\n"
            "    lookup_price(sku='A1')\n"
            "except Exception as exc:\n"
            "    print('x' * 3_000_000)\n"
            "    open('after.txt', 'w').write('the call failed')\n")
    upstream.script(openai_turn(function_call("code_execution", {"code": code}, call_id="call_exec")))
    paused = client.responses.create(model=MODEL, input="Price of A1?", tools=tools)
    call = only(paused, "function_call")

    # Nobody answers: the call gives up after the operator's wait, the run ends, and what
    # it wrote afterwards lands in the container, which is still there.
    deadline = time.monotonic() + 60
    while "after.txt" not in {f.path.rsplit("/", 1)[-1] for f in client.containers.files.list(container.id)}:
        assert time.monotonic() < deadline, "the paused run was never reclaimed"
        time.sleep(0.2)
    assert client.containers.retrieve(container.id).id == container.id

    # A late answer cannot resume it; the model learns what became of its call.
    upstream.script(then_say(lambda out: f"the run {json.loads(out).get('status')}"))
    late = client.responses.create(
        model=MODEL, tools=tools, previous_response_id=paused.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "{}"}])
    history = upstream.requests[1].body["input"]
    assert_outputs_answered(upstream.requests[1].body)
    assert [item["call_id"] for item in history if item.get("type") == "function_call_output"][-1:] == ["call_exec"]
    assert late.output_text.startswith("the run ")
    # What it printed reaches the model bounded, as any output does (it went whole).
    told = [item["output"] for item in history if item.get("call_id") == "call_exec"
            and item.get("type") == "function_call_output"][-1]
    assert "characters omitted" in json.loads(told)["stdout"]
    assert len(upstream.requests[1].raw) < 100_000


def test_caronte_tool_not_allowed_has_no_stub(upstream, openai_client):
    tools = [PRICE_TOOL, STOCK_TOOL, {"type": "caronte:code_execution", "allowed_tools": ["lookup_price"]}]
    upstream.script(openai_turn(function_call("code_execution", {"code": "print(lookup_stock(sku='A1'))"})),
                    then_say(lambda out: "stub missing" if "NameError" in json.loads(out)["stderr"] else "?"))

    response = openai_client.responses.create(model=MODEL, input="Stock of A1?", tools=tools)

    result = caronte_result(upstream, 1)
    assert "NameError" in result["stderr"] and "lookup_stock" in result["stderr"]
    assert result["inner_tool_calls"] == 0
    assert kinds(response) == ["message"]  # the client was never asked
    assert response.output_text == "stub missing"


def test_caronte_default_deny_without_allowed_tools(upstream, openai_client):
    tools = [PRICE_TOOL, CARONTE]
    upstream.script(openai_turn(function_call("code_execution", {"code": "print(lookup_price(sku='A1'))"})),
                    openai_turn(message("ok")))

    response = openai_client.responses.create(model=MODEL, input="Price of A1?", tools=tools)

    assert "NameError" in caronte_result(upstream, 1)["stderr"]
    assert kinds(response) == ["message"]


# --------------------------------------------------------------------------- streaming

CI_GRAMMAR = ["response.output_item.added", "response.code_interpreter_call.in_progress",
              "response.code_interpreter_call_code.delta", "response.code_interpreter_call_code.done",
              "response.code_interpreter_call.interpreting", "response.code_interpreter_call.completed",
              "response.output_item.done"]
MESSAGE_GRAMMAR = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                   "response.output_text.done", "response.content_part.done", "response.output_item.done"]


def collapse(types: list[str]) -> list[str]:
    """Runs of the same delta event as one."""
    out: list[str] = []
    for kind in types:
        if not (kind.endswith(".delta") and out and out[-1] == kind):
            out.append(kind)
    return out


def dump(response) -> dict:
    """A response as data, without the SDK's own ``parsed`` helpers (streamed responses have them)."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("parsed", "parsed_arguments")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value
    return strip(response.model_dump())


def normalised(value, key=None):
    """A response dump with what differs between two runs of one script masked."""
    if key in ("id", "container_id", "file_id", "created_at", "completed_at", "call_id"):
        return "<varies>"
    if key == "url" and isinstance(value, str):
        return value.split(",", 1)[0]
    if isinstance(value, dict):
        return {k: normalised(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [normalised(v) for v in value]
    return value


def test_streaming_event_order(upstream, openai_client):
    upstream.script(openai_turn(function_call("code_interpreter", {"code": CHART_CODE}), chunk=5),
                    openai_turn(message(CHART_TEXT), chunk=4))

    with openai_client.responses.stream(model=MODEL, input="Plot the squares.", tools=[CI_AUTO],
                                        include=OUTPUTS) as stream:
        events = list(stream)
        final = stream.get_final_response()

    types = [event.type for event in events]
    assert types[0] == "response.created"
    assert events[0].response.output == [] and events[0].response.status == "in_progress"
    numbers = [event.sequence_number for event in events]
    assert all(a < b for a, b in zip(numbers, numbers[1:])), numbers
    body = [t for t in types[1:-1] if t not in ("response.in_progress", "response.output_text.annotation.added")]
    assert collapse(body) == CI_GRAMMAR + MESSAGE_GRAMMAR
    assert types[-1] == "response.completed"

    # The code streams as the client's code_interpreter_call, whole by the .done.
    code_deltas = [e.delta for e in events if e.type == "response.code_interpreter_call_code.delta"]
    code_done = next(e for e in events if e.type == "response.code_interpreter_call_code.done")
    assert "".join(code_deltas) == code_done.code == CHART_CODE
    added = next(e for e in events if e.type == "response.output_item.added")
    assert (added.item.type, added.item.status) == ("code_interpreter_call", "in_progress")
    ci_events = [e for e in events if e.type.startswith("response.code_interpreter_call")]
    assert {(e.output_index, e.item_id) for e in ci_events} == {(0, added.item.id)}

    # Text deltas are the upstream's own pieces.
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas == [CHART_TEXT[i:i + 4] for i in range(0, len(CHART_TEXT), 4)]
    assert all(e.output_index == 1 for e in events if e.type == "response.output_text.delta")

    # The citations are announced inside the message, before it is done.
    message_added = len(types) - 1 - types[::-1].index("response.output_item.added")
    message_done = len(types) - 1 - types[::-1].index("response.output_item.done")
    announced = [(n, e) for n, e in enumerate(events) if e.type == "response.output_text.annotation.added"]
    assert announced
    assert all(message_added < n < message_done for n, _ in announced)
    assert [e.annotation_index for _, e in announced] == list(range(len(announced)))
    chart = [e.annotation for _, e in announced if e.annotation.filename == "chart.png"]
    assert len(chart) == 1 and chart[0].type == "container_file_citation"

    # response.completed carries the full output, the same as get_final_response()...
    completed = events[-1].response
    assert completed.model_dump() == final.model_dump()
    assert kinds(final) == ["code_interpreter_call", "message"]
    assert [a.model_dump() for a in final.output[1].content[0].annotations] == [
        e.annotation.model_dump() for _, e in announced]
    assert final.output[0].outputs and final.output[0].outputs[0].type in ("logs", "image")

    # ...the same shape as the same script answered without streaming...
    upstream.script(openai_turn(function_call("code_interpreter", {"code": CHART_CODE})),
                    openai_turn(message(CHART_TEXT)))
    plain = openai_client.responses.create(model=MODEL, input="Plot the squares.", tools=[CI_AUTO], include=OUTPUTS)
    assert normalised(dump(final)) == normalised(dump(plain))
    # ...and the one stored.
    assert dump(openai_client.responses.retrieve(final.id)) == dump(final)


def test_a_quota_met_mid_stream_is_named_in_the_stream(upstream, gateway_factory):
    # The auto container is made when the model first calls the tool, after the
    # stream began: the tenant's container quota must read as one, not as a bug.
    server = gateway_factory(tenant_max_containers=1)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=CLIENT_TOKEN, max_retries=0)
    client.containers.create(name="the-only-one")
    upstream.script(openai_turn(function_call("code_interpreter", {"code": "print(1)"})))
    with client.responses.stream(model=MODEL, input="Run it.", tools=[CI_AUTO]) as stream:
        events = list(stream)
    error = next(e for e in events if e.type == "error")
    assert error.code == "rate_limit_exceeded" and "containers" in error.message, error
    failed = events[-1]
    assert failed.type == "response.failed"
    assert failed.response.error.code == "rate_limit_exceeded"
    assert "Traceback" not in server.log()


def test_streaming_hides_caronte_round_trips(upstream, openai_client):
    upstream.script(openai_turn(function_call("code_execution", {"code": "print(2 ** 10)"})),
                    then_say(lambda out: f"It is {json.loads(out)['stdout'].strip()}"))

    with openai_client.responses.stream(model=MODEL, input="2**10?", tools=[CARONTE]) as stream:
        events = list(stream)
        final = stream.get_final_response()

    assert final.output_text == "It is 1024"
    assert kinds(final) == ["message"]
    items = [e.item.type for e in events if e.type in ("response.output_item.added", "response.output_item.done")]
    assert items == ["message", "message"]
    assert not any("function_call" in e.type for e in events)


# --------------------------------------------------------------------------- pass-through and upstream errors


@pytest.mark.parametrize("tools", [None, [], [PRICE_TOOL]], ids=["no-tools", "empty", "function"])
def test_a_conversation_of_the_code_tool_continues_without_it(upstream, openai_client, tools):
    # The follow-up named a response only this server holds (its model calls are
    # store:false), but without a code tool it was passed through as it came:
    # the upstream answered 404 for the previous_response_id.
    upstream.script(*run_ci("secret = 41", "kept it"))
    first = openai_client.responses.create(model=MODEL, input="keep 41", tools=[CI_AUTO])
    upstream.script(lambda body: openai_turn(message(f"I see {len(body['input'])} items")))
    extra = {} if tools is None else {"tools": tools}
    follow = openai_client.responses.create(model=MODEL, input="what was it?",
                                            previous_response_id=first.id, **extra)
    assert follow.output_text == "I see 5 items"  # the question, call, output, answer, question
    assert follow.previous_response_id == first.id
    sent = upstream.requests[-1].body
    assert "previous_response_id" not in sent and sent["store"] is False
    assert_outputs_answered(sent)
    assert openai_client.responses.retrieve(follow.id).output_text == "I see 5 items"


def test_request_without_code_tool_passes_through(upstream, openai_client, http):
    upstream.script(openai_turn(message("plain answer")))
    tools = [PRICE_TOOL]

    response = openai_client.responses.create(model=MODEL, input="hello", tools=tools, temperature=0.25,
                                              metadata={"k": "v"})

    assert response.output_text == "plain answer"
    assert upstream.requests[0].body == {"model": MODEL, "input": "hello", "tools": tools,
                                         "temperature": 0.25, "metadata": {"k": "v"}}
    assert_operator_auth(upstream)

    # Byte for byte, whatever the client wrote.
    upstream.script(openai_turn(message("raw")))
    raw = b'{"input":  "hi", "model": "m",\n "x_unknown_field": [1, 2.50, null]}'
    answered = http.post("/v1/responses", content=raw, headers={"content-type": "application/json"})
    assert answered.status_code == 200
    assert upstream.requests[1].raw == raw
    assert answered.json()["output"][0]["content"][0]["text"] == "raw"


def test_streaming_without_code_tool_passes_through(upstream, openai_client):
    upstream.script(openai_turn(message("streamed plainly"), chunk=3))

    with openai_client.responses.stream(model=MODEL, input="hello") as stream:
        events = list(stream)
        final = stream.get_final_response()

    assert upstream.requests[0].body == {"model": MODEL, "input": "hello", "stream": True}
    assert final.output_text == "streamed plainly"
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == ["str", "eam", "ed ", "pla",
                                                                                   "inl", "y"]
    # The upstream's own events, numbered as it numbered them.
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert_operator_auth(upstream)


def test_a_passed_through_conversation_is_continued_by_its_own_tenant_only(
        upstream, openai_client, gateway):
    """The upstream keeps every tenant's passed-through responses in the operator's
    one account and continues whichever one a request names: another tenant's
    conversation, named by an id that leaked, went on as the caller's, its
    context sent to the model. Each one's tenant is noted as it passes (whole or
    streamed), and only that tenant continues it."""
    other = openai.OpenAI(base_url=gateway.url + "/v1", api_key=OTHER_TOKEN, max_retries=0)
    upstream.script(openai_turn(message("a private answer")))
    whole = openai_client.responses.create(model=MODEL, input="a private question")
    upstream.script(openai_turn(message("streamed privately"), chunk=4))
    with openai_client.responses.stream(model=MODEL, input="another") as stream:
        streamed = stream.get_final_response()
    upstream.stored_responses.add("resp_made_at_the_upstream_directly")
    asked = len(upstream.requests)
    for previous in (whole.id, streamed.id, "resp_made_at_the_upstream_directly"):
        with pytest.raises(openai.NotFoundError) as refused:
            other.responses.create(model=MODEL, input="and then?", previous_response_id=previous)
        assert refused.value.body["message"] == f"Previous response with id '{previous}' not found."
    with pytest.raises(openai.NotFoundError):  # no tenant's: the operator's, say
        openai_client.responses.create(model=MODEL, input="and then?",
                                       previous_response_id="resp_made_at_the_upstream_directly")
    with pytest.raises(openai.BadRequestError) as refused:  # the upstream's, whoever made it
        other.responses.create(model=MODEL, input="hi", conversation="conv_anyones")
    assert refused.value.body["param"] == "conversation"
    # Parsers differ on which of two values of one key counts: the check and the
    # upstream must read the same one.
    with gateway.client(OTHER_TOKEN) as raw:
        twice = raw.post("/v1/responses", content=(
            f'{{"model": "{MODEL}", "input": "hi", "previous_response_id": "{whole.id}", '
            f'"previous_response_id": "resp_mine"}}'), headers={"content-type": "application/json"})
    assert twice.status_code == 400, twice.text
    assert "previous_response_id" in twice.json()["error"]["message"]
    assert len(upstream.requests) == asked, "a refused request reached the model"

    for previous in (whole.id, streamed.id):
        upstream.script(openai_turn(message("carried on")))
        carried = openai_client.responses.create(model=MODEL, input="and then?",
                                                 previous_response_id=previous)
        assert carried.output_text == "carried on"
        assert upstream.requests[-1].body["previous_response_id"] == previous


def test_a_long_streamed_start_is_noted_too(upstream, openai_client):
    """A stream's response.created echoes the request's instructions and tools,
    and only its first 64 KiB were looked into for it: an agent's long
    instructions (or many tools) made a response that no one owned, and its own
    tenant's next turn was refused (404) as if it were another's."""
    instructions = "Follow these rules. " + "Be precise and kind. " * 12000  # ~250 KB
    upstream.script(openai_turn(message("streamed with long rules"), chunk=4))
    with openai_client.responses.stream(model=MODEL, input="hi",
                                        instructions=instructions) as stream:
        streamed = stream.get_final_response()
    upstream.script(openai_turn(message("carried on")))
    carried = openai_client.responses.create(model=MODEL, input="and then?",
                                             previous_response_id=streamed.id)
    assert carried.output_text == "carried on"
    assert upstream.requests[-1].body["previous_response_id"] == streamed.id


def test_a_passed_through_responses_items_are_named_by_its_own_tenant_only(
        upstream, openai_client, gateway):
    """The upstream keeps a stored response's items too, and resolves an input
    item that names one by its id (an item_reference, or a reasoning item sent
    back without its content): another tenant's message went to the model as
    the caller's context, the same as continuing its conversation. Each item of
    a passed-through response is noted as the response is, and only its tenant
    names it."""
    other = openai.OpenAI(base_url=gateway.url + "/v1", api_key=OTHER_TOKEN, max_retries=0)
    upstream.script(openai_turn(reasoning(), message("a private answer")))
    whole = openai_client.responses.create(model=MODEL, input="a private question")
    upstream.script(openai_turn(reasoning(), message("streamed privately"), chunk=4))
    with openai_client.responses.stream(model=MODEL, input="another") as stream:
        streamed = stream.get_final_response()

    def named(response) -> list[list[dict]]:
        return [[{"type": "item_reference", "id": item.id} if item.type == "message"
                 else {"type": "reasoning", "id": item.id, "summary": []}]
                for item in response.output] + [
                [{"id": item.id} for item in response.output if item.type == "message"]]

    asked = len(upstream.requests)
    for made in (whole, streamed):
        for items in named(made):
            with pytest.raises(openai.NotFoundError) as refused:
                other.responses.create(model=MODEL, input=[
                    *items, {"role": "user", "content": "say that again"}])
            assert refused.value.body["message"] == f"Item with id '{items[0]['id']}' not found."
    with pytest.raises(openai.NotFoundError):  # no tenant's: the operator's, say
        openai_client.responses.create(model=MODEL, input=[
            {"type": "item_reference", "id": "msg_made_at_the_upstream_directly"}])
    assert len(upstream.requests) == asked, "a refused request reached the model"

    for made in (whole, streamed):
        for items in named(made):
            upstream.script(openai_turn(message("carried on")))
            carried = openai_client.responses.create(model=MODEL, input=[
                *items, {"role": "user", "content": "say that again"}])
            assert carried.output_text == "carried on"
            assert upstream.requests[-1].body["input"][0] == items[0]


UPSTREAM_FAILURES = [
    (429, openai.RateLimitError, "Rate limit reached for scripted-model in organization org-x"),
    (500, openai.InternalServerError, "The upstream server had an error while processing your request"),
    (400, openai.BadRequestError, "Invalid value for 'temperature': must be at most 2"),
]


@pytest.mark.parametrize("with_code_tool", [True, False], ids=["tool-loop", "pass-through"])
@pytest.mark.parametrize("status,error,text", UPSTREAM_FAILURES, ids=["429", "500", "400"])
def test_upstream_errors_pass_through(upstream, openai_client, status, error, text, with_code_tool):
    upstream.fail(status, message=text, headers=FAST_RETRY)
    tools = [CI_AUTO] if with_code_tool else [PRICE_TOOL]

    with pytest.raises(error) as raised:
        openai_client.responses.create(model=MODEL, input="hi", tools=tools)

    assert raised.value.status_code == status
    assert text in str(raised.value)
    assert raised.value.body["message"] == text
    if status == 429:
        assert raised.value.code == "rate_limit_exceeded"
        assert raised.value.response.headers.get("retry-after-ms") == "10"
    assert len(upstream.requests) == 1
    assert_operator_auth(upstream)


@pytest.mark.parametrize("with_code_tool", [True, False], ids=["tool-loop", "pass-through"])
def test_an_upstream_refusing_the_operators_key_is_not_the_clients_auth_error(
        upstream, openai_client, with_code_tool):
    upstream.fail(401, message="Incorrect API key provided: sk-op****-key.")
    with pytest.raises(openai.APIStatusError) as raised:
        openai_client.responses.create(model=MODEL, input="hi",
                                       tools=[CI_AUTO] if with_code_tool else [PRICE_TOOL])
    assert raised.value.status_code == 502
    assert "sk-op" not in str(raised.value.body)


@pytest.mark.parametrize("with_code_tool", [True, False], ids=["tool-loop", "pass-through"])
def test_upstream_error_before_a_stream(upstream, openai_client, with_code_tool):
    upstream.fail(429, message="Slow down, scripted", headers=FAST_RETRY)
    tools = [CI_AUTO] if with_code_tool else [PRICE_TOOL]

    try:
        with openai_client.responses.stream(model=MODEL, input="hi", tools=tools) as stream:
            events = list(stream)
    except openai.RateLimitError as raised:
        assert "Slow down, scripted" in str(raised)
        assert raised.response.headers.get("retry-after-ms") == "10"
    else:
        pytest.fail("no RateLimitError; the stream was: "
                    + ", ".join(getattr(e, "message", None) or e.type for e in events))


def test_an_upstream_stream_cut_short_is_an_error_not_a_completed_response(upstream, openai_client):
    # created, the message item added, its part added, one delta: then the body ends.
    upstream.script(openai_turn(message("partial answer and then more"), chunk=7, end_after=4))
    with pytest.raises(openai.APIStatusError) as failure:
        openai_client.responses.create(model=MODEL, input="hi", tools=[CI_AUTO])
    assert failure.value.status_code == 502 and "incomplete" in str(failure.value)
    upstream.script(openai_turn(message("partial answer and then more"), chunk=7, end_after=4))
    with openai_client.responses.stream(model=MODEL, input="hi", tools=[CI_AUTO]) as stream:
        events = list(stream)
    assert events[-1].type == "response.failed", [e.type for e in events]
    assert events[-1].response.status == "failed"


def test_an_upstream_response_that_failed_is_a_failure_not_a_completed_response(
        upstream, openai_client):
    # The upstream's stream ended in response.failed (the model broke off): the
    # client was answered a "completed" response holding what it said before.
    upstream.script(openai_turn(message("half an ans"), status="failed"))
    with pytest.raises(openai.APIStatusError) as failure:
        openai_client.responses.create(model=MODEL, input="hi", tools=[CI_AUTO])
    assert failure.value.status_code == 502 and "scripted failure" in str(failure.value)

    upstream.script(openai_turn(function_call("code_interpreter", {"code": "print(1)"})),
                    openai_turn(message("half an ans"), status="failed"))
    with openai_client.responses.stream(model=MODEL, input="hi", tools=[CI_AUTO]) as stream:
        events = list(stream)
    assert events[-1].type == "response.failed", [e.type for e in events]
    assert events[-1].response.error.message == "scripted failure"
    assert "response.completed" not in [e.type for e in events]


def test_a_model_cut_off_at_its_output_limit_ends_the_response(upstream, openai_client):
    # The half-written call was refused and the model asked again, cut off again:
    # ten paid calls, answered as incomplete for max_tool_calls.
    cut = openai_turn(function_call("code_interpreter", '{"code": "print(1'), status="incomplete")
    upstream.script(*[cut] * 10)
    with openai_client.responses.stream(model=MODEL, input="hi", tools=[CI_AUTO]) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete", [e.type for e in events]
    response = events[-1].response
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [(item.type, item.status) for item in response.output] == [
        ("code_interpreter_call", "incomplete")]
    assert len(upstream.requests) == 1

    upstream.reset()
    upstream.script(openai_turn(message("shorter, then")))
    follow = openai_client.responses.create(model=MODEL, input="again, shorter", tools=[CI_AUTO],
                                            previous_response_id=response.id)
    assert follow.output_text == "shorter, then"
    assert_outputs_answered(upstream.requests[-1].body)


class _RateLimited(OpenAITurn):
    """A turn whose stream breaks off with a rate limit's error event."""

    def events(self, request):
        for number, event in enumerate(super().events(request)):
            if number == 3:
                yield "error", {"type": "error", "code": "rate_limit_exceeded", "param": None,
                                "message": "Rate limit reached", "sequence_number": number}
                return
            yield event


def test_an_upstream_rate_limited_mid_stream_keeps_its_status(upstream, openai_client):
    turn = openai_turn(message("a long answer that never ends"))
    upstream.script(_RateLimited(turn.output, turn.status, turn.usage, turn.model, turn.pacing))
    with pytest.raises(openai.RateLimitError) as failure:
        openai_client.responses.create(model=MODEL, input="hi", tools=[CI_AUTO])
    assert failure.value.status_code == 429 and "Rate limit reached" in str(failure.value)


def test_sdk_retries_use_the_upstreams_retry_after(upstream, gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=CLIENT_TOKEN, max_retries=2)
    upstream.fail(429, message="busy", headers=FAST_RETRY, times=2)
    upstream.script(openai_turn(message("finally")))

    response = client.responses.create(model=MODEL, input="hi", tools=[CI_AUTO])

    assert response.output_text == "finally"
    assert len(upstream.requests) == 3


# --------------------------------------------------------------------------- dialect fidelity


@pytest.fixture
def strict_client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=CLIENT_TOKEN, max_retries=0,
                         _strict_response_validation=True)


def test_strict_sdk_validation_accepts_code_interpreter_responses(upstream, strict_client):
    upstream.script(*run_ci(CHART_CODE, CHART_TEXT))
    response = strict_client.responses.create(model=MODEL, input="Plot.", tools=[CI_AUTO], include=OUTPUTS)
    assert kinds(response) == ["code_interpreter_call", "message"]

    upstream.script(*run_ci("print(1)"))
    with strict_client.responses.stream(model=MODEL, input="Again.", tools=[CI_AUTO]) as stream:
        list(stream)
        assert kinds(stream.get_final_response()) == ["code_interpreter_call", "message"]
    assert strict_client.responses.retrieve(response.id).id == response.id


def test_strict_sdk_validation_accepts_caronte_responses(upstream, strict_client):
    upstream.script(openai_turn(function_call("code_execution", {"code": "print(1)"})), openai_turn(message("one")))
    response = strict_client.responses.create(model=MODEL, input="1?", tools=[CARONTE])
    assert response.output_text == "one"


def test_unknown_previous_response_is_not_found(upstream, openai_client):
    with pytest.raises(openai.NotFoundError) as raised:
        openai_client.responses.create(model=MODEL, input="hi", tools=[CI_AUTO],
                                       previous_response_id="resp_doesnotexist")

    assert "resp_doesnotexist" in str(raised.value)
    body = raised.value.body
    assert set(body) >= {"message", "type", "param", "code"}
    assert "resp_doesnotexist" in body["message"]
    assert raised.value.request_id
    assert upstream.requests == []


@pytest.mark.parametrize("tool", [
    # An allowlist is a container's to have (tests/gateway/test_egress.py); one
    # that names no domain is not an allowlist.
    {"type": "code_interpreter", "container": {"type": "auto", "network_policy": {
        "type": "allowlist", "allowed_domains": []}}},
    {"type": "code_interpreter", "container": {"type": "auto", "network_policy": {
        "type": "open"}}},
    {"type": "code_interpreter", "container": 42},
    {"type": "caronte:code_execution", "allowed_tools": "lookup_price"},
], ids=["network-allowlist-empty", "network-unknown-type", "container-not-an-id",
        "allowed-tools-not-a-list"])
def test_bad_tool_config_is_a_bad_request(upstream, openai_client, tool):
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.responses.create(model=MODEL, input="hi", tools=[PRICE_TOOL, tool])

    error = raised.value
    assert set(error.body) >= {"message", "type", "param", "code"}
    assert error.body["message"] and error.body["message"] in str(error)
    assert error.param == "tools"
    assert error.type == "invalid_request_error"
    assert upstream.requests == []


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"sku": {"$ref": "http://127.0.0.1:9/schema.json"}}},
    {"type": "object", "properties": {"sku": {"$ref": "#/$defs/missing"}}},
    {"$schema": "http://127.0.0.1:9/meta#", "type": "object"},
    {"type": "object", "properties": {"sku": {"type": "strin"}}},
], ids=["remote-ref", "missing-ref", "unknown-metaschema", "not-a-schema"])
def test_an_allowed_tool_with_an_unusable_schema_is_a_bad_request(upstream, openai_client, parameters):
    # The host checks each inner call's arguments against the tool's schema: one it
    # cannot use (or would have to fetch) is refused with the request, before the
    # model is asked, as the runs API refuses it (tests/api/test_runs.py).
    tool = {**PRICE_TOOL, "parameters": parameters}
    upstream.script(openai_turn(function_call("code_execution", {"code": "print(1)"})),
                    openai_turn(message("ok")))
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.responses.create(model=MODEL, input="hi", tools=[
            tool, {"type": "caronte:code_execution", "allowed_tools": ["lookup_price"]}])

    error = raised.value
    assert error.param == "tools" and error.type == "invalid_request_error", error.body
    assert "lookup_price" in error.body["message"], error.body
    assert upstream.requests == []


def test_a_tool_only_the_model_calls_keeps_its_schema_to_itself(upstream, openai_client):
    # Only allowed tools get stubs and a host-side check; another tool's schema is
    # between the client and the model, and does not stop the code from running.
    odd = {**STOCK_TOOL, "parameters": {"type": "object", "properties": {"sku": {"type": "strin"}}}}
    upstream.script(openai_turn(function_call("code_execution", {"code": "print('ran')"})),
                    openai_turn(message("ok")))
    openai_client.responses.create(model=MODEL, input="hi", tools=[
        odd, PRICE_TOOL, {"type": "caronte:code_execution", "allowed_tools": ["lookup_price"]}])
    result = caronte_result(upstream, 1)
    assert result["status"] == "completed" and result["stdout"] == "ran\n", result


def test_allowed_tools_naming_an_undeclared_tool_is_a_bad_request(upstream, openai_client):
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.responses.create(model=MODEL, input="hi", tools=[
            PRICE_TOOL, {"type": "caronte:code_execution", "allowed_tools": ["lookup_stock"]}])
    assert raised.value.param == "tools" and "lookup_stock" in raised.value.body["message"]
    assert upstream.requests == []


def test_a_conversation_the_loop_cannot_keep_is_a_bad_request(upstream, openai_client):
    # The loop dropped "conversation": the model answered without its context,
    # the answer was not added to it, and the client was not told.
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.responses.create(model=MODEL, input="and then?", tools=[CI_AUTO],
                                       conversation="conv_abc")
    assert raised.value.param == "conversation"
    assert "previous_response_id" in raised.value.body["message"]
    assert upstream.requests == []


@pytest.mark.parametrize("tools, items", [
    ([CI_AUTO, "x"], None),
    ([CI_AUTO, {"type": "function", "name": []}], None),
    ([{"type": "code_interpreter", "container": {"type": "auto", "file_ids": 5}}], None),
    ([{"type": "code_interpreter", "container": {"type": "auto", "file_ids": [{}]}}], None),
], ids=["tool-not-an-object", "function-name-a-list", "file-ids-a-number", "file-id-an-object"])
def test_malformed_requests_are_openai_400s(upstream, http, tools, items):
    # Each was a 500 ("internal error") with a traceback.
    answer = http.post("/v1/responses", json={"model": MODEL, "input": items or "hi", "tools": tools})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "tools", error
    # And what was silently read as "no": a string for stream, for include.
    for field, value in (("stream", "true"), ("include", OUTPUTS[0])):
        answer = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "tools": [CI_AUTO],
                                                  field: value})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
    assert upstream.requests == []


@pytest.mark.parametrize("body", [b"{nope", b"[1, 2]", b"", b'{"a": "\\udc80"}'],
                         ids=["not-json", "not-an-object", "empty", "lone-surrogate"])
def test_a_body_that_is_not_a_json_object_is_an_openai_400(upstream, http, body):
    # OpenAI answers it with a 400; it was a 422, which the SDK raises as another error.
    answer = http.post("/v1/responses", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error", answer.text
    assert upstream.requests == []


def test_sent_back_interpreter_calls_of_odd_shapes_are_read_as_far_as_they_go(upstream, openai_client):
    # A client's history is replayed to the model: outputs that are not a list of
    # logs are left out rather than failing the request.
    upstream.script(openai_turn(message("ok")))
    odd = [{"type": "code_interpreter_call", "id": "ci_1", "code": "1", "outputs": 5},
           {"type": "code_interpreter_call", "id": "ci_2", "code": "2",
            "outputs": [{"type": "logs", "logs": 5}, "x"]},
           {"role": "user", "content": "hi"}]
    response = openai_client.responses.create(model=MODEL, input=odd, tools=[CI_AUTO])
    assert response.output_text == "ok"
    sent = [item for item in upstream.requests[0].body["input"] if item.get("type") == "function_call_output"]
    assert [item["output"] for item in sent] == ["(the call's output was not sent back)"] * 2


def test_a_wrong_method_is_the_clients_error_in_openai_shape(http):
    for method in ("GET", "PATCH"):
        answer = http.request(method, "/v1/responses")
        assert answer.status_code == 405
        assert answer.json()["error"]["type"] == "invalid_request_error", answer.text


def test_missing_container_is_not_found(upstream, openai_client):
    with pytest.raises(openai.NotFoundError) as raised:
        openai_client.responses.create(model=MODEL, input="hi",
                                       tools=[{"type": "code_interpreter", "container": "cnt_nosuchcontainer"}])
    assert "cnt_nosuchcontainer" in str(raised.value)
    assert upstream.requests == []


def test_request_id_is_echoed(upstream, openai_client):
    upstream.script(*run_ci("print(1)"))
    raw = openai_client.responses.with_raw_response.create(
        model=MODEL, input="hi", tools=[CI_AUTO], extra_headers={"x-request-id": "trace-42-abc"})
    assert raw.headers["x-request-id"] == "trace-42-abc"
    assert raw.parse()._request_id == "trace-42-abc"

    upstream.script(openai_turn(message("plain")))
    generated = openai_client.responses.with_raw_response.create(model=MODEL, input="hi")
    assert generated.headers.get("x-request-id")

    with pytest.raises(openai.NotFoundError) as raised:
        openai_client.responses.retrieve("resp_missing", extra_headers={"x-request-id": "trace-err-1"})
    assert raised.value.request_id == "trace-err-1"


def test_other_tenant_cannot_continue_or_read(upstream, openai_client, other_client):
    upstream.script(*run_ci("open('/mnt/data/mine.txt', 'w').write('private')", "saved mine.txt"))
    mine = openai_client.responses.create(model=MODEL, input="save", tools=[CI_AUTO])
    container = only(mine, "code_interpreter_call").container_id
    file_id = cited(mine.output[-1].content[0], "mine.txt").file_id
    upstream.reset()

    with pytest.raises(openai.NotFoundError):
        other_client.responses.create(model=MODEL, input="continue", tools=[CI_AUTO],
                                      previous_response_id=mine.id)
    with pytest.raises(openai.NotFoundError):
        other_client.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other_client.containers.retrieve(container)
    with pytest.raises(openai.NotFoundError):
        other_client.containers.files.list(container)
    with pytest.raises(openai.NotFoundError):
        other_client.containers.files.content.retrieve(file_id, container_id=container)
    with pytest.raises(openai.NotFoundError):
        other_client.responses.create(model=MODEL, input="use it",
                                      tools=[{"type": "code_interpreter", "container": container}])
    assert container not in container_ids(other_client)
    assert upstream.requests == []
    # The owner still reads it.
    assert openai_client.containers.files.content.retrieve(file_id, container_id=container).content == b"private"


def test_files_list_honours_purpose_and_order(openai_client):
    made = [openai_client.files.create(file=(f"f{n}.txt", b"x" * (n + 1), "text/plain"), purpose=purpose)
            for n, purpose in enumerate(["user_data", "assistants", "user_data", "assistants", "user_data"])]
    user_data = [f.id for f in made if f.purpose == "user_data"]
    assert len(user_data) == 3 and all(f.object == "file" for f in made)

    ours = {f.id for f in made}
    asc = [f.id for f in openai_client.files.list(purpose="user_data", order="asc") if f.id in ours]
    desc = [f.id for f in openai_client.files.list(purpose="user_data", order="desc") if f.id in ours]
    assert asc == user_data
    assert desc == user_data[::-1]
    assistants = list(openai_client.files.list(purpose="assistants"))
    assert all(f.purpose == "assistants" for f in assistants)
    assert {f.id for f in assistants} & ours == {f.id for f in made if f.purpose == "assistants"}
    # Paging in small pages keeps the order.
    paged = [f.id for f in openai_client.files.list(purpose="user_data", order="asc", limit=1) if f.id in ours]
    assert paged == user_data


def test_stored_response_is_retrievable_unless_store_false(upstream, openai_client):
    upstream.script(*run_ci("print('kept')", "kept it"))
    kept = openai_client.responses.create(model=MODEL, input="keep", tools=[CI_AUTO])
    again = openai_client.responses.retrieve(kept.id)
    assert again.model_dump() == kept.model_dump()
    assert again.output_text == "kept it"

    upstream.script(*run_ci("print('gone')", "not kept"))
    unstored = openai_client.responses.create(model=MODEL, input="forget", tools=[CI_AUTO], store=False)
    assert unstored.output_text == "not kept"
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.create(model=MODEL, input="again", tools=[CI_AUTO],
                                       previous_response_id=unstored.id)


def test_a_stored_response_past_its_retention_is_gone_at_once(upstream, gateway_factory):
    """response_retention_seconds was read by nothing: every stored response
    stayed readable and continuable for good. Past it, one is gone at once
    (retrieve, continue, delete: 404), whether or not the sweep has come by: here
    it has not (it comes at the start, then every minute), and the row, aged in
    the server's own database, is still there."""
    server = gateway_factory(response_retention_seconds=600)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=CLIENT_TOKEN, max_retries=0)
    upstream.script(openai_turn(message("Noted.")))
    kept = client.responses.create(model=MODEL, input="Remember", tools=[CI_AUTO])
    assert client.responses.retrieve(kept.id).output_text == "Noted."
    with sqlite3.connect(server.data_dir / "shoal.sqlite3", timeout=30) as db:
        aged = db.execute("UPDATE responses SET created_at = created_at - 601 WHERE id = ?",
                          (kept.id,)).rowcount
    assert aged == 1

    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="And?", tools=[CI_AUTO],
                                previous_response_id=kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)
    assert upstream.requests == [upstream.requests[0]]  # the model was asked once only
    with sqlite3.connect(server.data_dir / "shoal.sqlite3", timeout=30) as db:
        assert db.execute("SELECT count(*) FROM responses WHERE id = ?", (kept.id,)).fetchone() == (1,)


def test_the_sweep_forgets_stored_responses_past_their_retention(upstream, gateway_factory):
    """Swept (every 1.5 s with a 3 s retention), an expired response no longer
    counts against its tenant's quota: it counted for good."""
    server = gateway_factory(response_retention_seconds=3, tenant_max_stored_response_bytes=1_000)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=CLIENT_TOKEN, max_retries=0)
    upstream.script(openai_turn(message("Noted.")))
    client.responses.create(model=MODEL, input="Remember " + "p" * 2_000, tools=[CI_AUTO])
    with pytest.raises(openai.RateLimitError):  # it counts against the quota
        client.responses.create(model=MODEL, input="Hi", tools=[CI_AUTO])
    upstream.script(openai_turn(message("Room again.")))
    deadline = time.monotonic() + 15
    while True:
        try:
            answer = client.responses.create(model=MODEL, input="Hi", tools=[CI_AUTO])
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the expired response was never swept"
            time.sleep(0.2)
    assert answer.output_text == "Room again."


def test_stored_responses_are_held_to_the_tenants_quota(upstream, gateway_factory):
    """Every stored response keeps the conversation so far: a tenant continuing one
    chain again and again stored without bound. Past its quota a request that
    would store is a 429 in OpenAI's shape, before the model is asked; one with
    "store": false still runs, another tenant is not affected, and deleting
    stored responses makes room."""
    server = gateway_factory(tenant_max_stored_response_bytes=30_000)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=CLIENT_TOKEN, max_retries=0)
    padding = "p" * 4_000
    previous, stored = None, []
    while True:
        asked = len(upstream.requests)
        upstream.script(openai_turn(message("Noted.")))
        try:
            answer = client.responses.create(model=MODEL, input=f"Remember {padding}",
                                             tools=[CI_AUTO], previous_response_id=previous)
        except openai.RateLimitError as exc:
            assert exc.status_code == 429
            assert "stored responses" in exc.message and "quota" in exc.message, exc.message
            assert len(upstream.requests) == asked  # refused before the model was asked
            assert upstream.turns_left == 1
            upstream.reset()  # the turn that was not used
            break
        previous = answer.id
        stored.append(answer.id)
        assert len(stored) < 10, "the quota never applied"
    # The chain grows: its stored sizes add up past 30,000 bytes in a few turns.
    assert 2 <= len(stored) <= 6, len(stored)

    upstream.script(openai_turn(message("Not kept.")))
    unstored = client.responses.create(model=MODEL, input="Hi", tools=[CI_AUTO], store=False)
    assert unstored.output_text == "Not kept."

    other = openai.OpenAI(base_url=server.url + "/v1", api_key=OTHER_TOKEN, max_retries=0)
    upstream.script(openai_turn(message("Yours.")))
    assert other.responses.create(model=MODEL, input="Hi", tools=[CI_AUTO]).output_text == "Yours."

    for response_id in stored:
        client.responses.delete(response_id)
    upstream.script(openai_turn(message("Room again.")))
    assert client.responses.create(model=MODEL, input="Hi", tools=[CI_AUTO]).output_text == "Room again."
