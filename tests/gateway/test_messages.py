"""Gateway mode, Anthropic dialect: ``/v1/messages`` with a code-execution tool.

Driven with the official ``anthropic`` package against a real ``shoal serve``
whose upstream is the scripted Messages API server; every code call runs in a
real sandbox. The scripts play the model: they call the sub-tools, and read
what the loop fed back to them (``body["messages"][-1]``), so each test checks
both faces of the loop: what the client got, and what the model was told.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
import uuid
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.gateway.conftest import CLIENT_TOKEN, OPERATOR_KEY, OTHER_TOKEN
from tests.gateway.scripted_upstream import AnthropicTurn, anthropic_turn, text, tool_use

TOOL = {"type": "code_execution_20250825", "name": "code_execution"}
ZYLON = {"type": "code_execution_v1", "name": "code_execution"}
LEGACY = {"type": "code_execution_20250522", "name": "code_execution"}
PNG_CODE = ("import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
            "plt.plot([1, 2, 3], [3, 1, 2])\nplt.savefig('/mnt/user-data/outputs/chart.png')\n"
            "plt.close()\nprint('saved')")


def ask(client, content="go", tools=(TOOL,), streamed=False, **extra):
    """The message, whole or (``streamed``) as the SDK puts it together from the stream."""
    arguments = dict(model="claude-test", max_tokens=512, tools=list(tools),
                     messages=[{"role": "user", "content": content}], **extra)
    if streamed:
        with client.messages.stream(**arguments) as stream:
            return stream.get_final_message()
    return client.messages.create(**arguments)


def fed_back(body: dict) -> list[dict]:
    """The tool_result blocks the loop last sent the model."""
    return [b for b in body["messages"][-1]["content"] if b.get("type") == "tool_result"]


def last_result(body: dict) -> dict:
    return json.loads(fed_back(body)[-1]["content"])


def bash(command: str, **extra) -> dict:
    return tool_use("bash_code_execution", {"command": command, **extra})


def editor(**arguments) -> dict:
    return tool_use("text_editor_code_execution", arguments)


def a_container() -> str:
    return f"c-{uuid.uuid4().hex[:12]}"


# -- the loop ---------------------------------------------------------------------------------
def test_bash_then_text(anthropic_client, upstream):
    upstream.script(anthropic_turn(text("Let me run it."), bash("echo $((6 * 7)); echo oops >&2")),
                    lambda body: anthropic_turn(text(f"The answer is {last_result(body)['stdout'].strip()}.")))
    message = ask(anthropic_client, "what is 6*7?")
    assert [b.type for b in message.content] == [
        "text", "server_tool_use", "bash_code_execution_tool_result", "text"]
    call, result = message.content[1], message.content[2]
    assert call.id.startswith("srvtoolu_") and call.name == "bash_code_execution"
    assert call.input == {"command": "echo $((6 * 7)); echo oops >&2"}
    assert result.tool_use_id == call.id
    assert result.content.type == "bash_code_execution_result"
    assert (result.content.stdout, result.content.stderr, result.content.return_code) == (
        "42\n", "oops\n", 0)
    assert result.content.content == []
    assert message.content[-1].text == "The answer is 42."
    assert message.stop_reason == "end_turn"
    assert message.usage.server_tool_use.model_extra["code_execution_requests"] == 1
    assert message.usage.input_tokens == 20 and message.usage.output_tokens == 10
    assert message.container.id and message.container.expires_at.year >= 2026
    # What the upstream was sent: function tools instead of the server tool, the
    # operator's key instead of the client's token, and the result as a tool_result.
    first, second = upstream.requests
    assert {t["name"] for t in first.body["tools"]} == {"bash_code_execution",
                                                       "text_editor_code_execution"}
    assert all(t.get("type") != "code_execution_20250825" for t in first.body["tools"])
    assert "container" not in first.body
    assert first.headers["x-api-key"] == OPERATOR_KEY
    assert CLIENT_TOKEN not in json.dumps(first.headers)
    assert second.body["messages"][-2]["content"][-1]["type"] == "tool_use"
    assert second.body["messages"][-2]["content"][-1]["id"] == call.id
    assert fed_back(second.body)[0]["tool_use_id"] == call.id


def test_streaming_matches_anthropic_event_order(anthropic_client, upstream):
    upstream.script(anthropic_turn(text("Running it now, step by step."), bash("echo streamed"),
                                   chunk=4),
                    anthropic_turn(text("All done here."), chunk=3))
    with anthropic_client.messages.stream(model="claude-test", max_tokens=256, tools=[TOOL],
                                          messages=[{"role": "user", "content": "go"}]) as stream:
        events = [event for event in stream]
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type in ("message_start", "content_block_start",
                                                  "content_block_stop", "message_delta",
                                                  "message_stop")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.index for s in starts] == list(range(len(starts)))  # renumbered across turns
    assert [s.content_block.type for s in starts] == [
        "text", "server_tool_use", "bash_code_execution_tool_result", "text"]
    assert starts[1].content_block.input == {}  # then input_json_delta, as Anthropic streams it
    json_deltas = [e for e in events if e.type == "content_block_delta" and e.index == 1]
    assert len(json_deltas) >= 2 and all(d.delta.type == "input_json_delta" for d in json_deltas)
    text_deltas = [e for e in events if e.type == "content_block_delta" and e.index == 0]
    assert len(text_deltas) >= 5  # forwarded as the upstream sent them, not re-chunked
    result = starts[2].content_block
    assert result.content.stdout == "streamed\n"  # arrives whole, in one content_block_start
    assert not any(e.type == "content_block_delta" and e.index == 2 for e in events)
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.container.id == final.container.id
    assert final.stop_reason == "end_turn"
    assert [b.type for b in final.content][-1] == "text" and final.content[-1].text == "All done here."
    assert final.content[1].input == {"command": "echo streamed"}


def test_a_stream_keeps_alive_while_a_later_turn_waits_on_the_model(gateway_factory, upstream):
    """Once its code had run, a stream said nothing while the model thought over
    the result (its pings were dropped): a proxy cuts a stream that is silent
    for its read timeout (nginx's is 60 s), and reasoning models think longer."""
    from httpx_sse import EventSource

    server = gateway_factory(stream_ping_seconds=0.2)
    upstream.script(anthropic_turn(bash("echo hi")),
                    anthropic_turn(text("Thought it over."), delay=0.6))
    body = {"model": "claude-test", "max_tokens": 64, "tools": [TOOL], "stream": True,
            "messages": [{"role": "user", "content": "go"}]}
    headers = {"x-api-key": CLIENT_TOKEN, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers=headers,
                      timeout=60) as response:
        assert response.status_code == 200
        events = [(sse.event, sse.json()) for sse in EventSource(response).iter_sse()]
    starts = [i for i, (name, data) in enumerate(events) if name == "content_block_start"]
    kinds = [events[i][1]["content_block"]["type"] for i in starts]
    assert kinds == ["server_tool_use", "bash_code_execution_tool_result", "text"], kinds
    thinking = [name for name, _ in events[starts[1]:starts[2]]]
    assert thinking.count("ping") >= 2, thinking
    assert events[-1][0] == "message_stop"


def test_a_quota_met_mid_stream_is_named_in_the_stream(gateway_factory, upstream):
    # The tenant's one live slot is held by a session: the loop's first run, after
    # the stream began, is refused, and the stream says so in Anthropic's terms.
    server = gateway_factory(tenant_max_sessions=1)
    headers = {"Authorization": f"Bearer {CLIENT_TOKEN}"}
    assert httpx.post(f"{server.url}/sessions", json={}, headers=headers).status_code == 201
    client = anthropic.Anthropic(base_url=server.url, api_key=CLIENT_TOKEN, max_retries=0)
    upstream.script(anthropic_turn(text("Running it."), bash("echo hi")))
    with pytest.raises(anthropic.APIStatusError) as failure:
        with client.messages.stream(model="claude-test", max_tokens=64, tools=[TOOL],
                                    messages=[{"role": "user", "content": "go"}]) as stream:
            for _ in stream:
                pass
    body = failure.value.body
    assert body["error"]["type"] == "rate_limit_error", body
    assert "sessions" in body["error"]["message"], body
    assert "Traceback" not in server.log()


def test_every_editor_command(anthropic_client, upstream):
    path = "/home/agent/workspace/config.json"
    upstream.script(
        anthropic_turn(editor(command="create", path=path, file_text='{\n  "debug": true\n}\n')),
        anthropic_turn(editor(command="view", path=path)),
        anthropic_turn(editor(command="str_replace", path=path, old_str='"debug": true',
                              new_str='"debug": false')),
        anthropic_turn(editor(command="insert", path=path, insert_line=1, insert_text='  "a": 1,')),
        anthropic_turn(editor(command="view", path=path, view_range=[2, 3])),
        anthropic_turn(editor(command="undo_edit", path=path)),
        anthropic_turn(editor(command="create", path=path, file_text="{}\n")),
        anthropic_turn(text("edited")))
    message = ask(anthropic_client)
    results = [b.content for b in message.content if b.type == "text_editor_code_execution_tool_result"]
    create, view, replace, insert, ranged, undo, overwrite = results
    assert create.type == "text_editor_code_execution_create_result" and not create.is_file_update
    assert view.type == "text_editor_code_execution_view_result"
    assert view.file_type == "text" and '"debug": true' in view.content
    assert view.start_line == 1 and view.total_lines >= 3
    assert replace.type == "text_editor_code_execution_str_replace_result"
    assert replace.lines == ['-  "debug": true', '+  "debug": false']
    assert replace.old_start == 2 and replace.new_lines == 1
    assert insert.type == "text_editor_code_execution_str_replace_result"
    assert insert.lines == ['+  "a": 1,'] and insert.new_start == 2
    assert ranged.content == '  "a": 1,\n  "debug": false' and ranged.start_line == 2
    assert undo.type == "text_editor_code_execution_str_replace_result"
    assert overwrite.type == "text_editor_code_execution_create_result" and overwrite.is_file_update
    # The model was told each result in words it can use.
    view_fed = [r for r in upstream.requests[2].body["messages"][-1]["content"]
                if r["type"] == "tool_result"][0]
    assert '"debug": true' in view_fed["content"]


def test_error_blocks_strict_and_zylon(anthropic_client, upstream):
    for tool, zylon in ((TOOL, False), (ZYLON, True)):
        upstream.reset()
        upstream.script(
            anthropic_turn(editor(command="view", path="/home/agent/workspace/missing.txt")),
            anthropic_turn(editor(command="create", path="/mnt/user-data/uploads/x.txt", file_text="x")),
            anthropic_turn(editor(command="view", path="/etc/passwd")),
            anthropic_turn(bash("", timeout=5)),
            lambda body: anthropic_turn(text("saw: " + fed_back(body)[0]["content"])))
        message = ask(anthropic_client, tools=(tool,))
        missing, readonly, outside, invalid = [
            b.content for b in message.content if b.type.endswith("_tool_result")]
        assert missing.type == "text_editor_code_execution_tool_result_error"
        assert missing.error_code == "file_not_found" and "missing.txt" in missing.error_message
        assert readonly.error_code == "invalid_tool_input"
        assert readonly.error_message == "Path '/mnt/user-data/uploads/x.txt' is in a read-only mount"
        assert outside.error_message == "Path '/etc/passwd' does not match any session mount"
        assert invalid.type == "bash_code_execution_tool_result_error"
        assert invalid.error_code == "invalid_tool_input"
        detail = getattr(missing, "detail", None)
        if zylon:
            assert detail["code"] == "file_not_found" and "missing.txt" in detail["explanation"]
        else:
            assert detail is None and "detail" not in (missing.model_extra or {})
        assert message.content[-1].text.startswith("saw: error: invalid_tool_input")
        # The tool_result the model got for an error is marked as one.
        assert fed_back(upstream.requests[1].body)[0]["is_error"] is True


def test_a_huge_output_is_whole_for_the_client_and_bounded_for_the_model(anthropic_client, upstream):
    # A megabyte of log was sent to the model whole, in this turn and in every
    # later request that sent the result back: past a model's context, so the
    # upstream refused them all ("prompt is too long").
    command = "head -c 3000000 /dev/zero | tr '\\0' a; echo; echo THE-END"
    upstream.script(anthropic_turn(bash(command)), anthropic_turn(text("long")),
                    anthropic_turn(text("still here")))
    message = ask(anthropic_client)
    result = message.content[1].content
    assert len(result.stdout) > 1_000_000
    told = last_result(upstream.requests[1].body)
    assert len(upstream.requests[1].raw) < 100_000
    assert "characters omitted" in told["stdout"] and told["stdout"].startswith("aaaa")

    history = [{"role": "user", "content": "go"},
               {"role": "assistant", "content": [block.model_dump(exclude_none=True)
                                                 for block in message.content]},
               {"role": "user", "content": "and now?"}]
    again = anthropic_client.messages.create(model="claude-test", max_tokens=64, tools=[TOOL],
                                             messages=history, container=message.container.id)
    assert again.content[-1].text == "still here"
    assert len(upstream.requests[2].raw) < 100_000


def test_a_timeout_is_return_code_124(anthropic_client, upstream):
    upstream.script(anthropic_turn(bash("echo started; sleep 20", timeout=1)),
                    lambda body: anthropic_turn(text(str(last_result(body)["return_code"]))))
    message = ask(anthropic_client)
    result = message.content[1].content
    assert result.return_code == 124 and result.stdout == "started\n"
    assert result.stderr.endswith("Command timed out after 1s.")
    assert message.content[-1].text == "124"


def test_pause_turn_and_its_continuation(gateway_factory, upstream):
    server = gateway_factory(gateway_max_round_trips=2)
    client = anthropic.Anthropic(base_url=server.url, api_key=CLIENT_TOKEN, max_retries=0)
    container = a_container()
    upstream.script(anthropic_turn(bash("echo 1 > n.txt")), anthropic_turn(bash("echo 2 >> n.txt")))
    paused = ask(client, container=container)
    assert paused.stop_reason == "pause_turn"
    assert [b.type for b in paused.content] == ["server_tool_use", "bash_code_execution_tool_result"] * 2
    # The client sends the assistant content back as it came; the model continues.
    upstream.script(anthropic_turn(bash("cat n.txt")),
                    lambda body: anthropic_turn(text("n.txt holds " + last_result(body)["stdout"].replace("\n", ","))))
    follow = client.messages.create(
        model="claude-test", max_tokens=256, tools=[TOOL], container=container,
        messages=[{"role": "user", "content": "go"},
                  {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in paused.content]}])
    assert follow.stop_reason == "end_turn" and follow.content[-1].text == "n.txt holds 1,2,"
    # The upstream saw the earlier calls as tool_use and tool_result, paired up.
    history = upstream.requests[2].body["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant", "user"]
    assert history[1]["content"][0]["type"] == "tool_use"
    assert history[2]["content"][0]["type"] == "tool_result"
    assert history[2]["content"][0]["tool_use_id"] == history[1]["content"][0]["id"]
    assert json.loads(history[2]["content"][0]["content"])["return_code"] == 0


class _CutOff(AnthropicTurn):
    """A turn whose tool input stops after its first pieces: a model cut off at max_tokens."""

    def events(self, request):
        pieces = 0
        for name, data in super().events(request):
            if name == "content_block_delta" and data["delta"]["type"] == "input_json_delta":
                pieces += 1
                if pieces > 2:
                    continue
            yield name, data


def cut_off(*blocks) -> AnthropicTurn:
    turn = anthropic_turn(*blocks, stop_reason="max_tokens")
    return _CutOff(turn.content, turn.stop_reason, turn.usage, turn.model, turn.pacing)


class _Overloaded(AnthropicTurn):
    """A turn whose stream breaks off with the error event of an overloaded model."""

    def events(self, request):
        for number, event in enumerate(super().events(request)):
            if number == 3:
                yield "error", {"type": "error", "error": {"type": "overloaded_error",
                                                           "message": "Overloaded"}}
                return
            yield event


class _WholeInput(AnthropicTurn):
    """A turn whose tool_use blocks carry their whole input at their start, with no
    input_json_delta (as some Messages-compatible servers stream them)."""

    def events(self, request):
        for name, data in super().events(request):
            if name == "content_block_start" and data["content_block"]["type"] == "tool_use":
                block = self.content[data["index"]]
                data = {**data, "content_block": dict(block)}
            elif name == "content_block_delta" and data["delta"]["type"] == "input_json_delta":
                continue
            yield name, data


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_tool_input_given_whole_at_the_block_start_is_shown(anthropic_client, upstream,
                                                               streamed):
    # The call ran, but the client was shown it with "input": {}.
    turn = anthropic_turn(bash("echo whole"))
    upstream.script(_WholeInput(turn.content, turn.stop_reason, turn.usage, turn.model,
                                turn.pacing), anthropic_turn(text("ok")))
    message = ask(anthropic_client, streamed=streamed)
    assert message.content[0].type == "server_tool_use"
    assert message.content[0].input == {"command": "echo whole"}
    assert message.content[1].content.stdout == "whole\n"


def test_an_upstream_overloaded_mid_stream_keeps_its_status(anthropic_client, upstream):
    # The model overloaded after its stream began: the whole message was a 502,
    # where the upstream (and Anthropic) says 529, the status clients back off on.
    turn = anthropic_turn(text("a long answer that never ends"))
    upstream.script(_Overloaded(turn.content, turn.stop_reason, turn.usage, turn.model, turn.pacing))
    with pytest.raises(anthropic.APIStatusError) as failure:
        ask(anthropic_client)
    assert failure.value.status_code == 529
    assert failure.value.body["error"] == {"type": "overloaded_error", "message": "Overloaded"}


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_model_cut_off_at_max_tokens_ends_the_message(anthropic_client, upstream, streamed):
    # The half-written call was refused and the model asked again, cut off
    # again: ten paid calls, answered as pause_turn instead of max_tokens.
    upstream.script(*[cut_off(text("Let me write it."), bash("echo " + "x" * 200))] * 10)
    message = ask(anthropic_client, streamed=streamed)
    assert message.stop_reason == "max_tokens"
    assert [b.type for b in message.content] == ["text", "server_tool_use"]
    assert len(upstream.requests) == 1
    assert message.usage.server_tool_use.model_extra["code_execution_requests"] == 0


def forced_model(body: dict) -> AnthropicTurn:
    """A model bound by tool_choice, as the real API binds it: it must call a tool."""
    if (body.get("tool_choice") or {}).get("type") in ("any", "tool"):
        return anthropic_turn(bash("echo computed"))
    return anthropic_turn(text("The code said: " + last_result(body)["stdout"].strip()))


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "code_execution"}, {"type": "any"}],
                         ids=["code_execution", "any"])
def test_a_forced_tool_choice_binds_the_first_turn_only(anthropic_client, upstream, choice):
    # Held on every turn, the forced choice forbade the model's answer after its
    # code ran: ten calls of the model, and the message ended at pause_turn.
    upstream.script(*[forced_model] * 10)
    message = ask(anthropic_client, tool_choice=choice)
    assert message.stop_reason == "end_turn"
    assert message.content[-1].text == "The code said: computed"
    assert len(upstream.requests) == 2
    assert upstream.requests[0].body["tool_choice"]["type"] in ("any", "tool")


def test_many_calls_in_one_turn_are_held_to_the_execution_budget(gateway_factory, upstream):
    # The budget counted turns: one turn of 60 calls ran all 60, each up to its
    # own timeout. Past the budget a call is answered, not run, and the turn pauses.
    server = gateway_factory(gateway_max_round_trips=3)
    client = anthropic.Anthropic(base_url=server.url, api_key=CLIENT_TOKEN, max_retries=0)
    container = a_container()
    upstream.script(anthropic_turn(*[bash(f"echo {n} >> ran.txt") for n in range(6)]))
    paused = ask(client, container=container)
    assert paused.stop_reason == "pause_turn"
    results = [b for b in paused.content if b.type == "bash_code_execution_tool_result"]
    assert len(results) == 6
    assert [r.content.type for r in results] == (["bash_code_execution_result"] * 3
                                                 + ["bash_code_execution_tool_result_error"] * 3)
    assert {r.content.error_code for r in results[3:]} == {"too_many_requests"}
    assert paused.usage.server_tool_use.code_execution_requests == 3
    upstream.script(anthropic_turn(bash("cat ran.txt")), anthropic_turn(text("ok")))
    ask(client, container=container)
    assert last_result(upstream.requests[2].body)["stdout"] == "0\n1\n2\n", "a refused call ran"
    assert len(upstream.requests) == 3


def test_a_client_tool_ends_the_turn_and_the_next_request_continues(anthropic_client, upstream):
    weather = {"name": "get_weather", "description": "Weather for a city.",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    upstream.script(anthropic_turn(bash("echo Paris"), tool_use("get_weather", {"city": "Paris"},
                                                                id="toolu_weather")))
    message = ask(anthropic_client, tools=(TOOL, weather))
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == [
        "server_tool_use", "tool_use", "bash_code_execution_tool_result"]
    assert message.content[1].id == "toolu_weather" and message.content[1].name == "get_weather"
    upstream.script(lambda body: anthropic_turn(text("weather: " + body["messages"][-1]["content"][-1]["content"])))
    follow = anthropic_client.messages.create(
        model="claude-test", max_tokens=256, tools=[TOOL, weather], container=message.container.id,
        messages=[{"role": "user", "content": "go"},
                  {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_weather",
                                                "content": "sunny"}]}])
    assert follow.content[-1].text == "weather: sunny"
    history = upstream.requests[1].body["messages"]
    # Each call the model made has its result in the turn after it.
    uses = [b["id"] for m in history if m["role"] == "assistant" for b in m["content"]
            if b["type"] == "tool_use"]
    results = [b["tool_use_id"] for m in history if m["role"] == "user" for b in m["content"]
               if isinstance(b, dict) and b.get("type") == "tool_result"]
    assert sorted(uses) == sorted(results) and "toolu_weather" in results


def test_the_container_is_reused_across_requests_after_its_sandbox_stopped(anthropic_client, upstream, gateway):
    container = a_container()
    # /tmp is the sandbox's own (a tmpfs): the mark there goes when the sandbox does.
    upstream.script(anthropic_turn(tool_use("bash_code_execution",
                                            {"command": "echo $RANDOM > /home/agent/workspace/number.txt; "
                                                        "touch /tmp/first-sandbox; cat /home/agent/workspace/number.txt"})),
                    anthropic_turn(text("written")))
    first = ask(anthropic_client, container=container)
    assert first.container.id == container
    number = first.content[1].content.stdout.strip()
    # The gateway server stops a container's sandbox after 2 idle seconds.
    time.sleep(4)
    upstream.script(anthropic_turn(bash("cat /home/agent/workspace/number.txt; "
                                        "ls /tmp/first-sandbox 2>/dev/null || echo another-sandbox")),
                    lambda body: anthropic_turn(text(last_result(body)["stdout"])))
    second = ask(anthropic_client, container=container)
    # Without the mark gone, the files could have come from the sandbox that never stopped.
    assert second.content[-1].text == f"{number}\nanother-sandbox\n"
    # The same id from another tenant is another container altogether.
    other = anthropic.Anthropic(base_url=gateway.url, api_key=OTHER_TOKEN, max_retries=0)
    upstream.script(anthropic_turn(bash("cat /home/agent/workspace/number.txt")),
                    lambda body: anthropic_turn(text(str(last_result(body)["return_code"]))))
    assert ask(other, container=container).content[-1].text != "0"


def test_without_a_container_the_users_own_container_is_used(anthropic_client, upstream):
    upstream.script(anthropic_turn(bash("echo kept > mine.txt")), anthropic_turn(text("ok")))
    first = ask(anthropic_client)
    upstream.script(anthropic_turn(bash("cat mine.txt")),
                    lambda body: anthropic_turn(text(last_result(body)["stdout"])))
    second = ask(anthropic_client)
    assert second.container.id == first.container.id and second.content[-1].text == "kept\n"


def test_an_upload_named_again_is_not_copied_again(anthropic_client, upstream):
    """A client's history names its container_upload blocks on every turn, and the
    file was copied into the container each time (and, with an object store, the
    container snapshotted): unchanged, the copy stays; another upload under its
    name replaces it."""
    container = a_container()
    stat = bash("stat -c '%s %y' /mnt/user-data/uploads/big.bin; md5sum < /mnt/user-data/uploads/big.bin")

    def turn(file_id: str) -> str:
        upstream.script(anthropic_turn(stat), lambda body: anthropic_turn(text(last_result(body)["stdout"])))
        return anthropic_client.messages.create(
            model="claude-test", max_tokens=256, tools=[TOOL], container=container,
            messages=[{"role": "user", "content": [{"type": "container_upload", "file_id": file_id},
                                                   {"type": "text", "text": "how big?"}]}]).content[-1].text

    first = anthropic_client.beta.files.upload(file=("big.bin", b"a" * (4 << 20), "application/octet-stream"))
    seen = turn(first.id)
    assert seen.startswith(f"{4 << 20} "), seen
    time.sleep(0.05)  # a copy made now would have another mtime
    assert turn(first.id) == seen
    other = anthropic_client.beta.files.upload(file=("big.bin", b"b" * 10, "application/octet-stream"))
    replaced = turn(other.id)
    assert replaced.startswith("10 ") and replaced.split()[-2] != seen.split()[-2], replaced
    assert turn(first.id).split()[-2] == seen.split()[-2]  # and back


def test_a_container_upload_lands_in_uploads(anthropic_client, upstream):
    uploaded = anthropic_client.beta.files.upload(file=("sales.csv", b"month,revenue\njan,3\nfeb,4\n",
                                                        "text/csv"))
    upstream.script(anthropic_turn(bash("cat /mnt/user-data/uploads/sales.csv; touch /mnt/user-data/uploads/x")),
                    lambda body: anthropic_turn(text(last_result(body)["stdout"])))
    message = anthropic_client.messages.create(
        model="claude-test", max_tokens=256, tools=[TOOL], container=a_container(),
        messages=[{"role": "user", "content": [
            {"type": "container_upload", "file_id": uploaded.id},
            {"type": "text", "text": "total revenue?"}]}])
    result = message.content[1].content
    assert result.stdout == "month,revenue\njan,3\nfeb,4\n" and "Read-only" in result.stderr
    # The upstream got a note of where the file is, not a block it does not know.
    sent = upstream.requests[0].body["messages"][0]["content"]
    assert sent[0] == {"type": "text", "text": "[The user uploaded sales.csv: it is at "
                                                "/mnt/user-data/uploads/sales.csv]"}
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.messages.create(
            model="claude-test", max_tokens=256, tools=[TOOL],
            messages=[{"role": "user", "content": [{"type": "container_upload", "file_id": "file-nope"}]}])


def test_a_produced_png_downloads_with_the_sdk(anthropic_client, upstream):
    upstream.script(anthropic_turn(bash("cat > /tmp/chart.py <<'EOF'\n" + PNG_CODE + "\nEOF\npython3 /tmp/chart.py")),
                    anthropic_turn(text("chart saved")))
    message = ask(anthropic_client, container=a_container())
    result = message.content[1].content
    assert result.stdout == "saved\n", result
    assert len(result.content) == 1 and result.content[0].type == "bash_code_execution_output"
    file_id = result.content[0].file_id
    metadata = anthropic_client.beta.files.retrieve_metadata(file_id)
    assert metadata.filename == "chart.png" and metadata.mime_type == "image/png"
    data = anthropic_client.beta.files.download(file_id).read()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) == metadata.size_bytes
    # The model was told where the file is.
    assert last_result(upstream.requests[1].body)["files"] == ["/mnt/user-data/outputs/chart.png"]
    # Another tenant cannot fetch it.
    other = anthropic.Anthropic(base_url=str(anthropic_client.base_url), api_key=OTHER_TOKEN)
    with pytest.raises(anthropic.NotFoundError):
        other.beta.files.download(file_id)


def test_skills_are_mounted_read_only(gateway_factory, upstream, tmp_path_factory):
    skills = tmp_path_factory.mktemp("skills")
    for name, body in (("pdf", "# PDF skill\nUse pypdf.\n"), ("xlsx", "# Spreadsheets\n")):
        (skills / name).mkdir()
        (skills / name / "SKILL.md").write_text(body)
    server = gateway_factory(skills_dir=str(skills))
    client = anthropic.Anthropic(base_url=server.url, api_key=CLIENT_TOKEN, max_retries=0)
    container = {"id": a_container(), "skills": [{"type": "custom", "skill_id": "pdf", "version": "latest"}]}
    upstream.script(anthropic_turn(bash("ls /mnt/skills; cat /mnt/skills/pdf/SKILL.md; touch /mnt/skills/pdf/x")),
                    anthropic_turn(text("ok")))
    message = client.beta.messages.create(model="claude-test", max_tokens=128, tools=[TOOL],
                                          container=container, betas=["skills-2025-10-02"],
                                          messages=[{"role": "user", "content": "go"}])
    result = message.content[1].content
    assert result.stdout == "pdf\n# PDF skill\nUse pypdf.\n"
    assert "Read-only" in result.stderr
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.beta.messages.create(model="claude-test", max_tokens=128, tools=[TOOL],
                                    container={"id": a_container(), "skills": [{"type": "custom",
                                                                                "skill_id": "nope"}]},
                                    messages=[{"role": "user", "content": "go"}])
    assert "nope" in str(refused.value)


def test_the_legacy_tool_runs_python_with_state(anthropic_client, upstream):
    upstream.script(anthropic_turn(tool_use("code_execution", {"code": "x = 41"})),
                    anthropic_turn(tool_use("code_execution", {"code": "print(x + 1)"})),
                    lambda body: anthropic_turn(text(last_result(body)["stdout"])))
    message = ask(anthropic_client, tools=(LEGACY,), container=a_container())
    assert {t["name"] for t in upstream.requests[0].body["tools"]} == {"code_execution"}
    results = [b for b in message.content if b.type == "code_execution_tool_result"]
    assert len(results) == 2 and results[1].content.type == "code_execution_result"
    assert results[1].content.stdout == "42\n" and results[1].content.return_code == 0
    assert message.content[0].type == "server_tool_use" and message.content[0].name == "code_execution"
    assert message.content[-1].text == "42\n"


# -- errors and edges ---------------------------------------------------------------------------
@pytest.mark.parametrize("status, error", [(429, anthropic.RateLimitError),
                                           (500, anthropic.InternalServerError),
                                           (400, anthropic.BadRequestError)])
def test_upstream_errors_pass_through(anthropic_client, upstream, status, error):
    upstream.fail(status, headers={"retry-after-ms": "10"}, message=f"upstream says {status}")
    with pytest.raises(error) as failure:
        ask(anthropic_client)
    assert failure.value.status_code == status
    assert f"upstream says {status}" in str(failure.value)
    assert failure.value.request_id
    upstream.fail(status, message=f"upstream says {status}")
    with pytest.raises(error) as failure:
        ask(anthropic_client, streamed=True)
    assert failure.value.status_code == status
    assert f"upstream says {status}" in str(failure.value)


@pytest.mark.parametrize("with_code_tool", [True, False], ids=["tool-loop", "pass-through"])
@pytest.mark.parametrize("status", [401, 403])
def test_an_upstream_refusing_the_operators_key_is_not_the_clients_auth_error(
        anthropic_client, upstream, status, with_code_tool):
    # The upstream's 401 reached the client as its own: AuthenticationError,
    # "invalid x-api-key", for a client whose token was fine.
    upstream.fail(status, message="invalid x-api-key")
    with pytest.raises(anthropic.APIStatusError) as raised:
        ask(anthropic_client, tools=(TOOL,) if with_code_tool else ())
    assert raised.value.status_code == 502
    assert raised.value.body["error"]["type"] == "api_error"
    assert "operator" in raised.value.body["error"]["message"]


def test_a_client_that_disconnects_stops_the_loop(anthropic_client, upstream, gateway):
    container = a_container()
    upstream.script(anthropic_turn(bash("sleep 4; touch /mnt/user-data/outputs/late.txt")),
                    anthropic_turn(text("never asked")))
    with httpx.Client(base_url=gateway.url, timeout=30,
                      headers={"Authorization": f"Bearer {CLIENT_TOKEN}"}) as http:
        with http.stream("POST", "/v1/messages", json={
                "model": "claude-test", "max_tokens": 64, "stream": True, "tools": [TOOL],
                "container": container, "messages": [{"role": "user", "content": "go"}]}) as response:
            for line in response.iter_lines():
                if "server_tool_use" in line:
                    break  # the call is running: go away
            else:
                # Read to its end, the stream left nothing running to stop.
                pytest.fail("the stream ended before the call began")
    time.sleep(7)
    assert len(upstream.requests) == 1, "the loop asked the model again after the client left"
    listed = httpx.get(f"{gateway.url}/v1/files", params={"scope_id": container},
                       headers={"Authorization": f"Bearer {CLIENT_TOKEN}"}).json()
    assert "late.txt" not in [f["filename"] for f in listed["data"]], "the call outlived its client"


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_an_upstream_stream_cut_short_is_an_error_not_an_answer(anthropic_client, upstream, streamed):
    # message_start, the text block's start, one delta: then the body ends. Read
    # to its end, such a stream looked like a complete end_turn answer.
    upstream.script(anthropic_turn(text("partial answer and then more"), chunk=7, end_after=3))
    with pytest.raises(anthropic.APIStatusError) as failure:
        ask(anthropic_client, streamed=streamed)
    assert "incomplete" in failure.value.body["error"]["message"], failure.value.body
    if not streamed:
        assert failure.value.status_code == 502


def test_one_tenant_holding_model_calls_leaves_the_others_theirs(gateway_factory, upstream):
    # A tenant whose requests hang on the model (a slow model, or many abandoned
    # clients) held the server's shared connections, and every other tenant's
    # request waited behind them; and a client that left a non-streaming request
    # left it running. Now each tenant has its share, and leaving ends a request.
    server = gateway_factory(tenant_max_gateway_requests=2)

    def answer(body):
        said = body["messages"][-1]["content"]
        hang = said == [{"type": "text", "text": "hang"}]
        return anthropic_turn(text("fine"), hang_after=0 if hang else None)

    upstream.script(*[answer] * 8)
    hanging = [threading.Thread(target=_abandoned, args=(server.url, CLIENT_TOKEN, path))
               for path in ("/v1/messages", "/api/gpt/v1/messages")]
    for thread in hanging:
        thread.start()
    deadline = time.monotonic() + 30
    while len(upstream.requests) < 2:
        assert time.monotonic() < deadline, "the hanging requests never reached the model"
        time.sleep(0.05)
    mine = anthropic.Anthropic(base_url=server.url, api_key=CLIENT_TOKEN, max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as refused:
        ask(mine, content="one more")
    assert "in flight" in refused.value.body["error"]["message"]
    theirs = anthropic.Anthropic(base_url=server.url, api_key=OTHER_TOKEN, max_retries=0, timeout=20)
    assert ask(theirs, content="other tenant").content[-1].text == "fine"
    for thread in hanging:
        thread.join()
    # The clients left: their model calls were dropped and their slots came back.
    for hung in upstream.requests[:2]:
        assert hung.disconnected.wait(20), "a request outlived its client"
    deadline = time.monotonic() + 20
    while True:
        try:
            assert ask(mine, content="again").content[-1].text == "fine"
            break
        except anthropic.RateLimitError:
            assert time.monotonic() < deadline, "a slot was never given back"
            time.sleep(0.1)


def _abandoned(url: str, token: str, path: str) -> None:
    try:
        answer = httpx.post(f"{url}{path}", timeout=httpx.Timeout(20, read=3),
                   headers={"Authorization": f"Bearer {token}"},
                   json={"model": "m", "max_tokens": 8, "tools": [TOOL],
                         "messages": [{"role": "user", "content": "hang"}]})
    except httpx.ReadTimeout:
        return
    raise AssertionError(f"a hanging request was answered: {answer.status_code} {answer.text}")


@pytest.mark.parametrize("tools", [[], [TOOL]], ids=["pass-through", "tool-loop"])
def test_a_stream_its_client_stops_reading_gives_its_model_connection_back(
        gateway_factory, upstream, tools):
    # A client that stayed connected and read nothing held its stream's model
    # connection (of a pool every tenant shares) until it hung up, even after
    # the model had finished: the other tenant's call waited 10 s for one and
    # was a 503. The stalled response is cut, and the connection goes back.
    server = gateway_factory(upstream_max_connections=1, response_stall_seconds=1)
    upstream.script(anthropic_turn(text("x" * (4 << 20)), chunk=16384),
                    anthropic_turn(text("fine")))
    body = json.dumps({"model": "m", "max_tokens": 8, "stream": True, "tools": tools,
                       "messages": [{"role": "user", "content": "a long answer"}]}).encode()
    address = server.url.removeprefix("http://").rsplit(":", 1)
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect((address[0], int(address[1])))
    try:
        stalled.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n"
                        b"Authorization: Bearer " + CLIENT_TOKEN.encode() + b"\r\n"
                        b"Content-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 30
        while not upstream.requests:
            assert time.monotonic() < deadline, "the stalled request never reached the model"
            time.sleep(0.05)
        time.sleep(3)  # reading nothing, still connected
        theirs = anthropic.Anthropic(base_url=server.url, api_key=OTHER_TOKEN, max_retries=0,
                                     timeout=30)
        assert ask(theirs, content="other tenant").content[-1].text == "fine"
        assert "cut a response: its client took none of it for 1s" in server.log()
    finally:
        stalled.close()


def test_requests_without_the_tool_pass_through_unchanged(anthropic_client, upstream):
    upstream.script(anthropic_turn(text("plain answer")), anthropic_turn(text("streamed answer")))
    body = {"model": "claude-test", "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"user_id": "u1"}, "top_k": 3, "unknown_future_field": {"kept": True}}
    fields = {k: v for k, v in body.items() if k in ("model", "max_tokens", "messages", "metadata")}
    extra = {k: v for k, v in body.items() if k not in fields}
    message = anthropic_client.messages.create(**fields, extra_body=extra)
    assert message.content[0].text == "plain answer"
    assert upstream.requests[0].body == body
    assert upstream.requests[0].headers["x-api-key"] == OPERATOR_KEY
    with anthropic_client.messages.stream(**fields, extra_body=extra) as stream:
        assert stream.get_final_message().content[0].text == "streamed answer"
    assert upstream.requests[1].body == {**body, "stream": True}


def test_no_upstream_is_a_clear_anthropic_error(gateway_factory):
    server = gateway_factory(upstream_anthropic_url="", upstream_openai_url="")
    client = anthropic.Anthropic(base_url=server.url, api_key=CLIENT_TOKEN, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as failure:
        ask(client)
    assert failure.value.status_code == 501
    assert "SHOAL_UPSTREAM_ANTHROPIC_URL" in str(failure.value)
    assert failure.value.body["type"] == "error"


def test_bad_requests_are_anthropic_errors(anthropic_client, gateway):
    with pytest.raises(anthropic.BadRequestError) as failure:
        anthropic_client.messages.create(model="m", max_tokens=8, messages=[],
                                         tools=[TOOL])
    assert failure.value.body["error"]["type"] == "invalid_request_error"
    raw = httpx.post(f"{gateway.url}/v1/messages", content=b"{not json",
                     headers={"Authorization": f"Bearer {CLIENT_TOKEN}"})
    assert raw.status_code == 400 and raw.json()["type"] == "error"
    assert raw.headers["request-id"] == raw.json()["request_id"]
    unauthenticated = httpx.post(f"{gateway.url}/v1/messages", json={})
    assert unauthenticated.status_code == 401
    assert unauthenticated.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError):
        ask(anthropic_client, tools=(TOOL, {"name": "bash_code_execution", "input_schema": {"type": "object"}}))


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("tools, messages", [
    ([TOOL, "x"], [USER]),
    ([TOOL, {"type": "custom", "name": []}], [USER]),
    ([TOOL], [{"role": "user", "content": [{"type": "container_upload", "file_id": []}]}]),
    ([TOOL], [USER, {"role": "assistant", "content": [{"type": []}]}]),
    ([TOOL], [USER, {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": [], "input": {}}]}]),
    ([TOOL], [USER, {"role": "assistant", "content": [
        {"type": "bash_code_execution_tool_result", "tool_use_id": [], "content": {}}]}]),
    ([TOOL], [{"role": "system", "content": "x"}]),
    ([TOOL], [{"role": "user", "content": 5}]),
    ([TOOL], [{"role": "user", "content": ["text"]}]),
], ids=["tool-not-an-object", "tool-name-a-list", "upload-id-a-list", "block-type-a-list",
        "tool-use-name-a-list", "result-id-a-list", "system-role", "content-a-number",
        "block-not-an-object"])
def test_malformed_requests_are_anthropic_400s(gateway, upstream, tools, messages):
    # Each was a 500 ("internal error") with a traceback: the loop read a field as
    # the type it expected. /validate and /v1/messages must agree.
    headers = {"Authorization": f"Bearer {CLIENT_TOKEN}"}
    body = {"model": "m", "max_tokens": 8, "tools": tools, "messages": messages}
    if messages == [USER]:  # a body otherwise fine: its stream flag is a string
        for path in ("/v1/messages", "/v1/messages/validate"):
            answer = httpx.post(f"{gateway.url}{path}", headers=headers,
                                json={**body, "tools": [TOOL], "stream": "true"})
            assert answer.status_code == 400 and "stream" in answer.text, answer.text
    for path in ("/v1/messages", "/v1/messages/validate", "/api/gpt/v1/messages"):
        answer = httpx.post(f"{gateway.url}{path}", json=body, headers=headers)
        assert answer.status_code == 400, (path, answer.text)
        error = answer.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
        assert error["error"]["message"] and error["request_id"], error
    assert upstream.requests == []


def test_a_tool_type_no_one_knows_still_passes_through(anthropic_client, upstream, gateway):
    # Without a code tool the request is the upstream's to judge, malformed or not.
    upstream.script(anthropic_turn(text("fine")))
    answer = httpx.post(f"{gateway.url}/v1/messages", headers={"Authorization": f"Bearer {CLIENT_TOKEN}"},
                        json={"model": "m", "max_tokens": 8, "tools": [{"type": []}],
                              "messages": [USER]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["content"] == [{"type": "text", "text": "fine"}], answer.text
    assert len(upstream.requests) == 1
    assert upstream.requests[0].body["tools"] == [{"type": []}]


def test_a_model_asking_for_an_endless_timeout_gets_the_ceiling(anthropic_client, upstream):
    upstream.script(anthropic_turn(bash("echo hi", timeout=1e308)),
                    anthropic_turn(text("done")))
    message = ask(anthropic_client)
    assert message.content[-1].text == "done"
    assert last_result(upstream.requests[1].body)["stdout"] == "hi\n"


def test_a_wrong_method_is_the_clients_error(gateway):
    for method in ("GET", "PUT"):
        answer = httpx.request(method, f"{gateway.url}/v1/messages",
                               headers={"Authorization": f"Bearer {CLIENT_TOKEN}",
                                        "anthropic-version": "2023-06-01"})
        assert answer.status_code == 405
        assert answer.json()["error"]["type"] == "invalid_request_error", answer.text


@pytest.mark.parametrize("path, header", [("/v1/messages", "anthropic-beta"),
                                          ("/v1/messages", "anthropic-version"),
                                          ("/v1/responses", "openai-beta")])
@pytest.mark.parametrize("with_tool", [True, False], ids=["loop", "pass-through"])
def test_a_header_for_the_upstream_that_is_not_ascii_is_a_400(gateway, upstream, path, header,
                                                              with_tool):
    # Passed on to the upstream, httpx could not encode it: a 500 with a traceback
    # logged at ERROR, for any tenant, as often as it liked.
    if path == "/v1/messages":
        body = {"model": "m", "max_tokens": 8, "messages": [USER]}
        tool = TOOL
    else:
        body = {"model": "m", "input": "hi"}
        tool = {"type": "code_interpreter", "container": {"type": "auto"}}
    if with_tool:
        body["tools"] = [tool]
    answer = httpx.post(f"{gateway.url}{path}", json=body, headers={
        "Authorization": f"Bearer {CLIENT_TOKEN}", header: b"\xe9t\xe9"})
    assert answer.status_code == 400, answer.text
    error = answer.json()
    if path == "/v1/messages":
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    else:
        assert error["error"]["type"] == "invalid_request_error", error
    assert header in answer.text, error
    assert upstream.requests == []
    assert "unhandled error" not in gateway.log()


def test_validate_runs_nothing(anthropic_client, upstream, gateway):
    headers = {"Authorization": f"Bearer {CLIENT_TOKEN}"}
    body = {"model": "default", "max_tokens": 64, "tools": [ZYLON],
            "messages": [{"role": "user", "content": "hi"}], "container": "validated-only"}
    answer = httpx.post(f"{gateway.url}/api/gpt/v1/messages/validate", json=body, headers=headers)
    assert answer.status_code == 200 and answer.json()["valid"] is True
    assert answer.json()["upstream_tools"] == ["bash_code_execution", "text_editor_code_execution"]
    assert upstream.requests == []
    assert httpx.get(f"{gateway.url}/v1/containers/validated-only", headers=headers).status_code == 404
    bad = httpx.post(f"{gateway.url}/v1/messages/validate", headers=headers,
                     json={**body, "messages": [{"role": "user", "content": [
                         {"type": "container_upload", "file_id": "file-missing"}]}]})
    assert bad.status_code == 404 and bad.json()["type"] == "error"


def test_the_beta_client_and_the_old_query_form(anthropic_client, upstream, gateway):
    upstream.script(anthropic_turn(bash("echo beta")), anthropic_turn(text("b")))
    message = anthropic_client.beta.messages.create(
        model="claude-test", max_tokens=64, tools=[TOOL], betas=["code-execution-2025-08-25"],
        messages=[{"role": "user", "content": "go"}])
    assert message.content[1].content.stdout == "beta\n"
    assert upstream.requests[0].headers["anthropic-beta"] == "code-execution-2025-08-25"
    upstream.script(anthropic_turn(text("old")))
    old = httpx.post(f"{gateway.url}/v1/messages?beta=true", headers={"x-api-key": CLIENT_TOKEN,
                                                                      "anthropic-version": "2023-06-01"},
                     json={"model": "m", "max_tokens": 8, "tools": [TOOL],
                           "messages": [{"role": "user", "content": "hi"}]})
    assert old.status_code == 200 and old.json()["content"][0]["text"] == "old"


def test_files_list_pages_the_way_the_sdk_iterates(anthropic_client):
    ids = [anthropic_client.beta.files.upload(file=(f"f{i}.txt", b"x")).id for i in range(5)]
    listed = [f.id for f in anthropic_client.beta.files.list(limit=1)]
    assert [i for i in listed if i in ids] == ids
    page = anthropic_client.beta.files.list(limit=2)
    assert len(page.data) == 2 and page.next_page is not None
    only = anthropic_client.get("/v1/files", cast_to=object, options={
        "params": {"ids": ids[1:3]}, "headers": {"anthropic-version": "2023-06-01"}})
    assert [f["id"] for f in only["data"]] == ids[1:3]
    for file_id in ids:
        assert anthropic_client.beta.files.delete(file_id).type == "file_deleted"


# -- Zylon's documentation, as written ------------------------------------------------------------
def test_zylon_quick_start(gateway, upstream):
    upstream.script(anthropic_turn(bash("python3 -c 'import statistics as s; d=list(range(1,11)); print(s.mean(d), round(s.pstdev(d), 4))'")),
                    lambda body: anthropic_turn(text("mean and sd: " + last_result(body)["stdout"])))
    response = httpx.post(f"{gateway.url}/api/gpt/v1/messages", headers={
        "Authorization": f"Bearer {CLIENT_TOKEN}", "Content-Type": "application/json"}, json={
        "model": "default", "max_tokens": 4096,
        "messages": [{"role": "user", "content": "Calculate the mean and standard deviation of [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"}],
        "tools": [{"name": "code_execution", "type": "code_execution_v1"}]}, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["content"][-1]["text"] == "mean and sd: 5.5 2.8723\n"
    assert body["container"]["id"] and body["container"]["expires_at"].endswith("Z")


def test_zylon_two_request_my_container_example(gateway, upstream):
    headers = {"Authorization": f"Bearer {CLIENT_TOKEN}", "Content-Type": "application/json"}
    container = f"my-container-{uuid.uuid4().hex[:6]}"

    def request(content):
        return httpx.post(f"{gateway.url}/api/gpt/v1/messages", headers=headers, timeout=60, json={
            "model": "default", "max_tokens": 4096, "container": container,
            "messages": [{"role": "user", "content": content}],
            "tools": [{"name": "code_execution", "type": "code_execution_v1"}]}).json()

    upstream.script(anthropic_turn(bash("echo 7 > /home/agent/workspace/number.txt")),
                    anthropic_turn(text("written")))
    first = request("Write a random number to /home/agent/workspace/number.txt")
    assert first["container"]["id"] == container
    upstream.script(anthropic_turn(bash("n=$(cat /home/agent/workspace/number.txt); echo $((n * n))")),
                    lambda body: anthropic_turn(text(last_result(body)["stdout"].strip())))
    second = request("Read /home/agent/workspace/number.txt and square the number")
    assert second["content"][-1]["text"] == "49"


def test_zylon_end_to_end_python_example(gateway, upstream, tmp_path):
    base = f"{gateway.url}/api/gpt/v1"
    headers = {"Authorization": f"Bearer {CLIENT_TOKEN}"}
    container = f"sales-analysis-{uuid.uuid4().hex[:6]}"
    sales = tmp_path / "sales.csv"
    sales.write_text("month,revenue\n2026-07,10\n2026-08,30\n2026-09,20\n")
    with open(sales, "rb") as f:
        httpx.post(f"{base}/files", params={"scope_id": container}, headers=headers,
                   files={"file": ("sales.csv", f)}).raise_for_status()
    chart = ("import pandas as pd, matplotlib.pyplot as plt\n"
             "df = pd.read_csv('/mnt/user-data/uploads/sales.csv')\n"
             "df.plot(x='month', y='revenue'); plt.savefig('/mnt/user-data/outputs/revenue.png')\n"
             "print(df.revenue.sum())")
    upstream.script(anthropic_turn(editor(command="create", path="/tmp/chart.py", file_text=chart)),
                    anthropic_turn(bash("python3 /tmp/chart.py")),
                    lambda body: anthropic_turn(text(f"Total revenue {last_result(body)['stdout'].strip()}; "
                                                     "chart at /mnt/user-data/outputs/revenue.png")))
    response = httpx.post(f"{base}/messages", headers=headers, timeout=60, json={
        "model": "default", "max_tokens": 4096, "container": container,
        "messages": [{"role": "user", "content": "Analyze /mnt/user-data/uploads/sales.csv and save a "
                                                 "revenue chart to /mnt/user-data/outputs/revenue.png"}],
        "tools": [{"name": "code_execution", "type": "code_execution_v1"}]}).json()
    assert response["content"][-1]["text"].startswith("Total revenue 60;")
    files = httpx.get(f"{base}/files", params={"scope_id": container}, headers=headers).json()
    downloaded = {}
    for item in files["data"]:
        if item["downloadable"]:
            content = httpx.get(f"{base}/files/{item['id']}/content", params={"scope_id": container},
                                headers=headers)
            downloaded[item["filename"]] = content.content
    assert list(downloaded) == ["revenue.png"] and downloaded["revenue.png"].startswith(b"\x89PNG")
    for item in files["data"]:
        httpx.delete(f"{base}/files/{item['id']}", params={"scope_id": container},
                     headers=headers).raise_for_status()
    assert httpx.get(f"{base}/files", params={"scope_id": container}, headers=headers).json()["data"] == []
