"""The scripted upstream speaks the providers' wire formats: proven with the official SDKs.

Every test here drives :class:`ScriptedUpstream` directly with the installed ``anthropic``
and ``openai`` packages (no Shoal involved), with ``_strict_response_validation=True`` so
that a missing or mistyped field fails here rather than in a gateway test. Raw-HTTP tests
cover what the SDKs hide: SSE framing, pacing, disconnects and concurrency.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.gateway.scripted_upstream import (
    ScriptedUpstream,
    anthropic_turn,
    function_call,
    message,
    openai_turn,
    text,
    tool_use,
)

FAST_RETRY = {"retry-after-ms": "10"}
USER_HI = [{"role": "user", "content": "hi"}]
WEATHER_TOOL = {"type": "function", "name": "weather", "strict": True,
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"], "additionalProperties": False}}


@pytest.fixture
def upstream():
    with ScriptedUpstream() as server:
        yield server


@pytest.fixture
def claude(upstream):
    with anthropic.Anthropic(base_url=upstream.url, api_key="k", _strict_response_validation=True) as client:
        yield client


@pytest.fixture
def gpt(upstream):
    with openai.OpenAI(base_url=upstream.url + "/v1", api_key="k", _strict_response_validation=True) as client:
        yield client


def create(client: anthropic.Anthropic, **kwargs):
    return client.messages.create(model="claude-x", max_tokens=100, messages=USER_HI, **kwargs)


def sse_events(response: httpx.Response) -> list[tuple[str | None, dict]]:
    """(event name, data) of each SSE frame of a raw response."""
    frames = []
    for frame in response.read().decode().split("\n\n"):
        if not frame.strip():
            continue
        fields = dict(line.split(": ", 1) for line in frame.splitlines())
        frames.append((fields.get("event"), json.loads(fields["data"])))
    return frames


# --------------------------------------------------------------------------- Anthropic


def test_anthropic_create_text(upstream, claude):
    upstream.script(anthropic_turn(text("Hello, world."), usage={"input_tokens": 7, "output_tokens": 3}))

    reply = create(claude)

    assert reply.id.startswith("msg_")
    assert [(b.type, b.text) for b in reply.content] == [("text", "Hello, world.")]
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (7, 3)
    assert reply.model == "scripted-model"
    assert reply._request_id.startswith("req_")
    [seen] = upstream.requests
    assert (seen.method, seen.path) == ("POST", "/v1/messages")
    assert seen.headers["authorization"] == "Bearer k"
    assert "anthropic-version" in seen.headers
    assert seen.body == {"model": "claude-x", "max_tokens": 100, "messages": USER_HI}


def test_anthropic_create_tool_use(upstream, claude):
    upstream.script(anthropic_turn(text("Let me look."), tool_use("weather", {"city": "Oslo"}, id="toolu_1")))

    reply = create(claude)

    assert reply.stop_reason == "tool_use"
    call = reply.content[1]
    assert (call.type, call.id, call.name, call.input) == ("tool_use", "toolu_1", "weather", {"city": "Oslo"})
    assert tool_use("x", {}).get("id").startswith("toolu_")


def test_anthropic_stream_final_message_equals_the_script(upstream, claude):
    words = "The weather in Oslo is grey, as usual."
    call = tool_use("weather", {"city": "Oslo", "units": "metric"})
    upstream.script(anthropic_turn(text(words), call, chunk=5, usage={"output_tokens": 42}))

    with claude.messages.stream(model="claude-x", max_tokens=100, messages=USER_HI) as stream:
        events = list(stream)
        final = stream.get_final_message()

    text_deltas = [e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
    json_deltas = [e.delta.partial_json for e in events
                   if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert text_deltas == [words[i:i + 5] for i in range(0, len(words), 5)]
    assert json_deltas[0] == "" and len(json_deltas) > 2
    assert [b.model_dump(exclude_none=True) for b in final.content] == [
        {"type": "text", "text": words}, call]
    assert (final.stop_reason, final.usage.output_tokens) == ("tool_use", 42)
    assert upstream.requests[0].body["stream"] is True


def test_anthropic_stream_framing_on_the_wire(upstream):
    upstream.script(anthropic_turn(text("abcdefghij"), tool_use("f", {"k": "v"}), chunk=4))

    with httpx.stream("POST", upstream.url + "/v1/messages", json={"stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["connection"] == "close"
        events = sse_events(response)

    assert all(name == data["type"] for name, data in events), "every event carries its event: line"
    assert [name for name, _ in events] == [
        "message_start", "ping",
        "content_block_start", *["content_block_delta"] * 3, "content_block_stop",
        "content_block_start", *["content_block_delta"] * 4, "content_block_stop",
        "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert (start["content"], start["stop_reason"], start["usage"]) == (
        [], None, {"input_tokens": 10, "output_tokens": 1})
    assert events[2][1]["content_block"] == {"type": "text", "text": ""}
    assert events[7][1]["content_block"]["input"] == {}
    assert "".join(e["delta"]["partial_json"] for n, e in events[8:12]) == '{"k":"v"}'
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2][1]["usage"] == {"output_tokens": 5}


def test_anthropic_rate_limit_is_retried_then_raised(upstream, claude):
    upstream.fail(429, headers={**FAST_RETRY, "request-id": "req_limited"}, times=3, message="slow down")
    upstream.script(anthropic_turn(text("after the storm")))

    with pytest.raises(anthropic.RateLimitError) as caught:
        create(claude.with_options(max_retries=2))

    assert (caught.value.request_id, caught.value.type, caught.value.api_message) == (
        "req_limited", "rate_limit_error", "slow down")
    assert [r.headers["x-stainless-retry-count"] for r in upstream.requests] == ["0", "1", "2"]
    assert upstream.turns_left == 1, "failures consume no turn"
    assert create(claude).content[0].text == "after the storm"


def test_anthropic_server_error_then_success_and_plain_500(upstream, claude):
    upstream.fail(500, headers=FAST_RETRY)
    upstream.script(anthropic_turn(text("recovered")))
    assert create(claude).content[0].text == "recovered"
    assert len(upstream.requests) == 2

    upstream.fail(500, headers=FAST_RETRY, times=2)
    with pytest.raises(anthropic.InternalServerError) as caught:
        create(claude.with_options(max_retries=1))
    assert caught.value.type == "api_error"
    assert len(upstream.requests) == 4


def test_anthropic_callable_turn_reads_the_tool_result(upstream, claude):
    def answer(body):
        result = body["messages"][-1]["content"][0]
        assert result["type"] == "tool_result"
        return anthropic_turn(text(f"the tool said {result['content']}"))

    upstream.script(anthropic_turn(tool_use("python", {"code": "6*7"})), answer)

    first = create(claude)
    call = first.content[0]
    history = [*USER_HI, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "42"}]}]
    second = claude.messages.create(model="claude-x", max_tokens=100, messages=history)

    assert second.content[0].text == "the tool said 42"
    assert upstream.requests[1].body["messages"][1]["content"][0]["id"] == call.id


def test_script_errors_are_a_visible_500(upstream, claude):
    with pytest.raises(anthropic.InternalServerError, match="scripted upstream: no turn left"):
        create(claude)
    assert len(upstream.requests) == 1, "x-should-retry: false stops the SDK retrying a script error"
    assert upstream.requests[0].error == "scripted upstream: no turn left"

    upstream.script(openai_turn(message("wrong dialect")))
    with pytest.raises(anthropic.InternalServerError, match="not an answer to an Anthropic request"):
        create(claude)

    upstream.script(lambda body: 1 / 0)
    with pytest.raises(anthropic.InternalServerError, match="ZeroDivisionError"):
        create(claude)


# --------------------------------------------------------------------------- OpenAI


def test_openai_create_message(upstream, gpt):
    upstream.script(openai_turn(message("Hello, world."), usage={"input_tokens": 7, "output_tokens": 3}))

    response = gpt.responses.create(model="gpt-x", input="hi", tools=[WEATHER_TOOL], instructions="be brief")

    assert response.id.startswith("resp_")
    assert (response.object, response.status, response.error) == ("response", "completed", None)
    assert response.output_text == "Hello, world."
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (7, 3, 10)
    assert [t.name for t in response.tools] == ["weather"]
    assert response.instructions == "be brief"
    assert response._request_id.startswith("req_")
    [seen] = upstream.requests
    assert (seen.path, seen.headers["authorization"]) == ("/v1/responses", "Bearer k")
    assert "stream" not in seen.body


def test_openai_create_function_call(upstream, gpt):
    upstream.script(openai_turn(function_call("weather", {"city": "Oslo"}, call_id="call_1")))

    response = gpt.responses.create(model="gpt-x", input="hi", tools=[WEATHER_TOOL])

    [call] = response.output
    assert (call.type, call.call_id, call.name, call.status) == ("function_call", "call_1", "weather", "completed")
    assert json.loads(call.arguments) == {"city": "Oslo"}
    assert response.output_text == ""


def test_openai_stream_final_response_equals_the_script(upstream, gpt):
    words = "Checking the weather for you."
    items = [message(words), function_call("weather", {"city": "Oslo"})]
    upstream.script(openai_turn(*items, chunk=6))

    with gpt.responses.stream(model="gpt-x", input="hi", tools=[WEATHER_TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()

    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers)) and numbers[0] == 0
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == [
        words[i:i + 6] for i in range(0, len(words), 6)]
    assert len([e for e in events if e.type == "response.function_call_arguments.delta"]) > 1
    assert [item.model_dump(exclude_none=True, exclude={"parsed_arguments"}) for item in final.output] == items
    assert final.output_text == words
    assert final.output[1].parsed_arguments == {"city": "Oslo"}
    assert final.usage.total_tokens == 15


def test_openai_error_status_raises_with_the_message(upstream, gpt):
    upstream.fail(400, message="bad input", headers={"x-request-id": "req_bad"})
    with pytest.raises(openai.BadRequestError) as caught:
        gpt.responses.create(model="gpt-x", input="hi")
    assert str(caught.value) == "Error code: 400 - bad input"
    assert (caught.value.request_id, caught.value.type, caught.value.body["param"]) == (
        "req_bad", "invalid_request_error", None)

    upstream.fail(429, headers=FAST_RETRY, times=3)
    with pytest.raises(openai.RateLimitError) as caught:
        gpt.responses.create(model="gpt-x", input="hi")
    assert caught.value.code == "rate_limit_exceeded"
    assert len(upstream.requests) == 1 + 3


# --------------------------------------------------------------------------- the server itself


def test_hang_after_flushes_each_event_and_sees_the_client_leave(upstream):
    upstream.script(openai_turn(message("x" * 40), hang_after=3))

    got = []
    with httpx.stream("POST", upstream.url + "/v1/responses", json={"stream": True}, timeout=5) as response:
        for line in response.iter_lines():  # a buffered server would make this time out
            if line.startswith("data: "):
                got.append(json.loads(line[len("data: "):])["type"])
                if len(got) == 3:
                    break
    assert got == ["response.created", "response.in_progress", "response.output_item.added"]
    assert upstream.requests[0].disconnected.wait(5)


def test_a_client_leaving_during_a_delay_is_seen(upstream):
    upstream.script(anthropic_turn(text("y" * 80), delay=0.05))

    with httpx.stream("POST", upstream.url + "/v1/messages", json={"stream": True}, timeout=5) as response:
        next(response.iter_lines())
    assert upstream.requests[0].disconnected.wait(5)


def test_non_streaming_hang_never_answers(upstream):
    upstream.script(anthropic_turn(text("never"), hang_after=0))

    with pytest.raises(httpx.ReadTimeout):
        httpx.post(upstream.url + "/v1/messages", json={}, timeout=0.3)
    assert upstream.requests[0].disconnected.wait(5)


def test_requests_are_served_concurrently(upstream):
    upstream.script(anthropic_turn(text("slow"), hang_after=1), openai_turn(message("fast")))

    with httpx.stream("POST", upstream.url + "/v1/messages", json={"stream": True}, timeout=5) as hanging:
        assert next(hanging.iter_lines()) == "event: message_start"
        other = httpx.post(upstream.url + "/v1/responses", json={"model": "m"}, timeout=5)
        assert other.json()["output"][0]["content"][0]["text"] == "fast"
    assert upstream.requests[0].disconnected.wait(5)
    assert not upstream.requests[1].disconnected.is_set()


def test_close_drops_open_streams_and_stops_listening():
    upstream = ScriptedUpstream()
    upstream.script(anthropic_turn(text("z"), hang_after=1))
    with httpx.stream("POST", upstream.url + "/v1/messages", json={"stream": True}, timeout=5) as hanging:
        lines = hanging.iter_lines()
        assert next(lines) == "event: message_start"
        upstream.close()
        with pytest.raises(httpx.RemoteProtocolError):
            list(lines)
    assert not upstream.requests[0].disconnected.is_set(), "the server left, not the client"
    with pytest.raises(httpx.ConnectError):
        httpx.post(upstream.url + "/v1/messages", json={})


def test_reset_unknown_routes_and_raw_failures(upstream):
    upstream.script(anthropic_turn(text("a")))
    upstream.fail(503, body="<html>upstream down</html>")
    response = httpx.post(upstream.url + "/v1/messages", json={})
    assert (response.status_code, response.text) == (503, "<html>upstream down</html>")
    assert httpx.post(upstream.url + "/v1/complete", json={}).status_code == 404
    assert upstream.requests[-1].error == "scripted upstream: no route for POST /v1/complete"

    upstream.reset()
    assert (upstream.requests, upstream.turns_left) == ([], 0)
    response = httpx.post(upstream.url + "/v1/messages", json={})
    assert response.status_code == 500 and "no turn left" in response.json()["error"]["message"]
