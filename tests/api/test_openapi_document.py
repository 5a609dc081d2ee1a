"""The served OpenAPI document describes what really goes over the wire.

The routers answer with ``Response`` objects and read their bodies by hand, so
FastAPI alone would document every answer as ``{}``; ``shoal/api/schemas.py``
says what they are. Checked here:

- the document itself: every success answer has a real schema (JSON, an event
  stream, bytes or text), every route that reads a body declares it, every
  error is declared in its dialect's shape (and that shape is the one
  ``errors.error_body`` renders), protected routes carry the bearer scheme and
  the probes do not;
- a real ``shoal serve``: the answers of the main routes, and the events of the
  streaming ones, validate against the schemas its own ``/openapi.json``
  declares for them, ``$ref``s resolved against its components;
- ``/docs`` serves the interactive page.
"""

from __future__ import annotations

import inspect
import json
import re
import secrets

import pytest
from jsonschema import Draft202012Validator

from shoal.api import containers, files, messages, observability, protocol_v1, responses, runs
from shoal.api.errors import ANTHROPIC, OPENAI, PROTOCOL, error_body
from shoal.app import create_app
from shoal.config import Settings

PROBES = {"/livez", "/readyz", "/health"}
HTTP_METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}
ROUTERS = (observability, protocol_v1, files, containers, runs, messages, responses)
# The error shape each path answers in (shoal.api.errors.dialect_of), as component names.
DIALECT_ERRORS = [
    ("/v1/files", {"ErrorBody", "OpenAIError", "AnthropicError"}),
    ("/v1/messages", {"AnthropicError"}),
    ("/v1/containers", {"OpenAIError"}),
    ("/v1/code-execution", {"OpenAIError"}),
    ("/v1/responses", {"OpenAIError"}),
    ("/", {"ErrorBody"}),
]
COMPONENT = "#/components/schemas/"


# -- reading the document -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def document(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("openapi")
    return create_app(Settings(data_dir=tmp / "data", run_dir=tmp / "run")).openapi()


def operations(document: dict):
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if method in HTTP_METHODS:
                yield method, path, operation


def component(document: dict, reference: str) -> dict:
    assert reference.startswith(COMPONENT), reference
    return document["components"]["schemas"][reference[len(COMPONENT):]]


def refs_of(schema: dict) -> set[str]:
    """The components a schema names at its top (directly or as anyOf/oneOf branches)."""
    if "$ref" in schema:
        return {schema["$ref"][len(COMPONENT):]}
    return {name for branch in schema.get("anyOf", schema.get("oneOf", []))
            for name in refs_of(branch)}


def describes_an_object(document: dict, schema: dict) -> bool:
    """Not ``{}``: an object with properties, through $refs and every union branch."""
    if "$ref" in schema:
        return describes_an_object(document, component(document, schema["$ref"]))
    branches = schema.get("anyOf") or schema.get("oneOf")
    if branches:
        return all(describes_an_object(document, branch) for branch in branches)
    return schema.get("type") == "object" and bool(schema.get("properties"))


def validator(document: dict, schema: dict) -> Draft202012Validator:
    return Draft202012Validator({**schema, "components": document["components"]},
                                format_checker=Draft202012Validator.FORMAT_CHECKER)


def violations(document: dict, schema: dict, instance: object) -> list[str]:
    return [f"{'.'.join(map(str, error.absolute_path)) or '(root)'}: {error.message}"
            for error in validator(document, schema).iter_errors(instance)]


def declared(document: dict, method: str, path: str, status: int | str,
             media: str = "application/json") -> dict:
    response = document["paths"][path][method]["responses"][str(status)]
    content = response["content"][media]
    return content["itemSchema"] if media == "text/event-stream" else content["schema"]


def template(path: str) -> str:
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", path)


# -- (a) the document ----------------------------------------------------------------------------
def test_every_success_answer_declares_its_body(document):
    bodiless = {("delete", "/sessions/{session_id}"), ("head", "/v1/files/{file_id}")}
    checked = 0
    for method, path, operation in operations(document):
        successes = {status: response for status, response in operation["responses"].items()
                     if status.startswith("2")}
        assert successes, f"{method.upper()} {path} declares no success"
        for status, response in successes.items():
            content = response.get("content")
            if not content:
                assert (method, path) in bodiless, f"{method.upper()} {path} {status}: no body"
                continue
            for media, entry in content.items():
                where = f"{method.upper()} {path} {status} {media}"
                if media == "application/json":
                    assert describes_an_object(document, entry["schema"]), (where, entry)
                    checked += 1
                elif media == "text/event-stream":
                    item = entry["itemSchema"]
                    assert item["properties"]["event"]["enum"], where
                    assert item["required"] == ["data"], where
                elif media in ("application/octet-stream", "text/plain"):
                    assert entry["schema"]["type"] == "string", where
                else:
                    raise AssertionError(f"{where}: an unexpected media type")
    assert checked >= 30  # the walk above saw the routes


def test_streaming_and_byte_routes_declare_no_json_they_never_send(document):
    only = {
        ("post", "/v1/code-execution/runs"): {"text/event-stream"},
        ("get", "/v1/code-execution/runs/{run_id}/events"): {"text/event-stream"},
        ("get", "/sessions/{session_id}/files"): {"application/octet-stream"},
        ("get", "/v1/files/{file_id}/content"): {"application/octet-stream"},
        ("get", "/v1/containers/{container_id}/files/{file_id}/content"):
            {"application/octet-stream"},
        ("get", "/metrics"): {"text/plain"},
        # JSON, or the event stream when asked for
        ("post", "/sessions/{session_id}/exec"): {"application/json", "text/event-stream"},
        ("post", "/v1/messages"): {"application/json", "text/event-stream"},
        ("post", "/v1/responses"): {"application/json", "text/event-stream"},
    }
    for (method, path), media in only.items():
        assert set(document["paths"][path][method]["responses"]["200"]["content"]) == media


def _reads_json(endpoint) -> bool:
    source = inspect.getsource(endpoint)
    return "read_json_object(" in source or "await _body(request)" in source


def test_every_body_a_route_reads_is_declared(document):
    json_routes = 0
    for module in ROUTERS:
        for route in module.router.routes:
            path = template(route.path)
            for method in route.methods & {"POST", "PUT", "PATCH"}:
                operation = document["paths"][path][method.lower()]
                where = f"{method} {path}"
                assert "requestBody" in operation, f"{where} declares no body"
                content = operation["requestBody"]["content"]
                assert content, where
                for media, entry in content.items():
                    if media == "application/octet-stream":
                        assert entry["schema"] == {"type": "string", "format": "binary"}, where
                    else:
                        assert describes_an_object(document, entry["schema"]), (where, media)
                if _reads_json(route.endpoint):
                    json_routes += 1
                    assert "application/json" in content, where
    assert json_routes >= 10  # sessions, exec, tools, containers, files, runs x2, gateway x3


def test_request_bodies_hold_the_real_requests(document):
    """The declared bodies accept what the clients really send (and refuse what the
    routes refuse), so a generated client can send them."""
    def body(method, path, media="application/json"):
        return document["paths"][path][method]["requestBody"]["content"][media]["schema"]

    exec_body = body("post", "/sessions/{session_id}/exec")
    assert violations(document, exec_body, {"tool": "code_execution",
                                            "input": {"code": "print(1)"}}) == []
    assert violations(document, exec_body, {"tool": "text_editor_code_execution", "input": {
        "command": "view", "path": "a.txt", "view_range": [1, 2]}}) == []
    assert violations(document, exec_body, {"tool": "bash_code_execution", "input": {}}) != []
    assert violations(document, exec_body, {"tool": "nope", "input": {"code": "1"}}) != []
    run = body("post", "/v1/code-execution/runs")
    assert violations(document, run, {"language": "python", "code": "print(1)"}) == []
    assert violations(document, run, {"language": "ruby", "code": "1"}) != []
    session = body("post", "/sessions")
    assert violations(document, session, {"idle_timeout_seconds": 0}) != []
    assert violations(document, session, {"idle_timeout_seconds": 5, "extra": True}) == []
    upload = body("post", "/sessions/{session_id}/files", "multipart/form-data")
    assert upload["properties"]["file"] == {"format": "binary", "title": "File",
                                            "type": "string"}
    assert upload["required"] == ["file"]


def test_protected_routes_need_the_bearer_and_probes_do_not(document):
    scheme = document["components"]["securitySchemes"]["HTTPBearer"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    for method, path, operation in operations(document):
        if path in PROBES:
            assert "security" not in operation, f"{method.upper()} {path} is a probe"
        else:
            assert operation.get("security") == [{"HTTPBearer": []}], f"{method.upper()} {path}"


def test_every_error_is_declared_in_its_dialects_shape(document):
    for method, path, operation in operations(document):
        expected = next(names for prefix, names in DIALECT_ERRORS if path.startswith(prefix))
        for status, response in operation["responses"].items():
            if status.startswith("2"):
                continue
            where = f"{method.upper()} {path} {status}"
            if (path, status) == ("/readyz", "503"):
                assert refs_of(response["content"]["application/json"]["schema"]) == {
                    "NotReady"}
                continue
            assert refs_of(response["content"]["application/json"]["schema"]) == expected, where
    assert "HTTPValidationError" not in document["components"]["schemas"]


@pytest.mark.parametrize("dialect, name", [(PROTOCOL, "ErrorBody"), (OPENAI, "OpenAIError"),
                                           (ANTHROPIC, "AnthropicError")])
@pytest.mark.parametrize("status", [400, 401, 404, 409, 422, 429, 503])
def test_the_declared_error_shapes_are_what_the_server_renders(document, dialect, name, status):
    for detail in ("no such thing", [{"loc": ["body", "code"], "msg": "required",
                                      "type": "missing"}]):
        for param in (None, "code"):
            rendered = error_body(dialect, status, detail, "req_0123", param=param)
            assert violations(document, {"$ref": COMPONENT + name}, rendered) == []
            # and the shapes tell the dialects apart
            for other in {"ErrorBody", "OpenAIError", "AnthropicError"} - {name}:
                assert violations(document, {"$ref": COMPONENT + other}, rendered), other


def test_every_schema_in_the_document_is_valid(document):
    for name, schema in document["components"]["schemas"].items():
        Draft202012Validator.check_schema(schema)
    for method, path, operation in operations(document):
        bodies = [*operation.get("requestBody", {}).get("content", {}).values(),
                  *(entry for response in operation["responses"].values()
                    for entry in response.get("content", {}).values())]
        for entry in bodies:
            Draft202012Validator.check_schema(entry.get("schema", entry.get("itemSchema")))


# -- (b) a real server's answers ----------------------------------------------------------------
@pytest.fixture(scope="module")
def served(server) -> dict:
    with server.client() as http:
        response = http.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def conforms(document: dict, method: str, path: str, response, status: int,
             media: str = "application/json") -> object:
    """The response has the status, the media type, and a body the document
    declares for them; its body, parsed."""
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].split(";")[0] == media
    body = response.json()
    assert violations(document, declared(document, method, path, status, media), body) == [], (
        f"{method.upper()} {path} {status}: {json.dumps(body)[:500]}")
    return body


def is_component(document: dict, name: str, body: object) -> bool:
    return not violations(document, {"$ref": COMPONENT + name}, body)


def sse_events(text: str) -> list[dict]:
    """Server-sent events as the WHATWG parser dispatches them (``event`` defaults
    to ``message``; comments and events without data are dropped)."""
    events, fields, data = [], {}, []
    for line in re.split(r"\r\n|\r|\n", text):
        if not line:
            if data:
                events.append({"event": fields.get("event", "message"), "data": "\n".join(data),
                               **({"id": fields["id"]} if "id" in fields else {})})
            fields, data = {}, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data.append(value)
        elif name in ("event", "id"):
            fields[name] = value
    return events


def stream_conforms(document: dict, method: str, path: str, response) -> list[dict]:
    assert response.status_code == 200, response.text[:500]
    assert response.headers["content-type"].split(";")[0] == "text/event-stream"
    item = declared(document, method, path, 200, "text/event-stream")
    events = sse_events(response.text)
    assert events
    for event in events:
        assert violations(document, item, event) == [], event
    return events


@pytest.fixture
def http(server):
    with server.client() as client:
        yield client


def test_sessions_exec_and_workspace_files(http, served):
    handle = conforms(served, "post", "/sessions", http.post("/sessions", json={
        "idle_timeout_seconds": 120}), 201)
    session = handle["session_id"]
    try:
        conforms(served, "get", "/sessions/{session_id}", http.get(f"/sessions/{session}"), 200)
        exec_path = "/sessions/{session_id}/exec"
        ran = conforms(served, "post", exec_path, http.post(f"/sessions/{session}/exec", json={
            "tool": "code_execution", "input": {"code": (
                "open('/mnt/user-data/outputs/report.csv', 'w').write('a,b\\n')\nprint('hi')")}}),
            200)
        assert ran["result_block"]["content"]["stdout"] == "hi\n"
        assert [f["filename"] for f in ran["result_block"]["content"]["content"]] == [
            "report.csv"]
        failed = conforms(served, "post", exec_path, http.post(f"/sessions/{session}/exec", json={
            "tool": "bash_code_execution", "input": {"command": "echo oops >&2; exit 3"}}), 200)
        assert failed["result_block"]["content"]["return_code"] == 3
        conforms(served, "post", exec_path, http.post(f"/sessions/{session}/exec", json={
            "tool": "text_editor_code_execution",
            "input": {"command": "create", "path": "notes.txt", "file_text": "one\n"}}), 200)

        streamed = stream_conforms(served, "post", exec_path, http.post(
            f"/sessions/{session}/exec", headers={"accept": "text/event-stream"},
            json={"tool": "code_execution", "input": {"code": "print('streamed')"}}))
        assert streamed[-1]["event"] == "result"
        result = json.loads(streamed[-1]["data"])
        assert violations(served, declared(served, "post", exec_path, 200), result) == []

        uploaded = conforms(served, "post", "/sessions/{session_id}/files", http.post(
            f"/sessions/{session}/files", data={"path": "data/input.txt"},
            files={"file": ("input.txt", b"payload\n")}), 201)
        assert uploaded["size_bytes"] == 8
        listed = conforms(served, "get", "/sessions/{session_id}/files/list",
                          http.get(f"/sessions/{session}/files/list", params={"path": "data"}),
                          200)
        assert [entry["size_bytes"] for entry in listed["files"]] == [8]
        download = http.get(f"/sessions/{session}/files", params={"path": "data/input.txt"})
        assert download.status_code == 200 and download.content == b"payload\n"
        assert "application/json" not in served["paths"]["/sessions/{session_id}/files"][
            "get"]["responses"]["200"]["content"]
    finally:
        deleted = http.delete(f"/sessions/{session}")
    assert deleted.status_code == 204 and deleted.content == b""
    missing = http.get(f"/sessions/{session}")
    conforms(served, "get", "/sessions/{session_id}", missing, 404)


def test_zylon_files_api(http, served):
    scope = {"scope_id": "openapi-" + secrets.token_hex(4)}
    uploaded = conforms(served, "post", "/v1/files", http.post(
        "/v1/files", params={**scope, "path": "data/q3.csv"},
        files={"file": ("q3.csv", b"a,b\n1,2\n")}), 201)
    assert is_component(served, "ScopedFile", uploaded)
    put = conforms(served, "put", "/v1/files/{key}", http.put(
        "/v1/files/config/settings.json", params=scope, content=b"{}"), 201)
    assert put["key"] == "config/settings.json"
    listed = conforms(served, "get", "/v1/files", http.get("/v1/files", params=scope), 200)
    assert is_component(served, "ScopedFileList", listed) and len(listed["data"]) == 2
    one = conforms(served, "get", "/v1/files/{file_id}",
                   http.get(f"/v1/files/{uploaded['id']}", params=scope), 200)
    assert is_component(served, "ScopedFile", one)
    head = http.head(f"/v1/files/{uploaded['id']}", params=scope)
    assert head.status_code == 200 and head.content == b""
    headers = served["paths"]["/v1/files/{file_id}"]["head"]["responses"]["200"]["headers"]
    assert len(headers) == 7 and all(name in head.headers for name in headers)
    assert head.headers["x-file-id"] == uploaded["id"]
    conforms(served, "delete", "/v1/files/{file_id}",
             http.delete(f"/v1/files/{put['id']}", params=scope), 200)
    gone = conforms(served, "delete", "/v1/files", http.delete(
        "/v1/files", params={**scope, "prefix": "data/"}), 200)
    assert gone["deleted_count"] == 1
    # Zylon's scope answers errors in the protocol's shape
    missing = conforms(served, "get", "/v1/files/{file_id}",
                       http.get("/v1/files/nosuchfile", params=scope), 404)
    assert set(missing) == {"detail", "request_id"}


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_tenant_files_api(http, served, dialect):
    headers = {"anthropic-version": "2023-06-01"} if dialect == "anthropic" else {}
    file_model, list_model = (("AnthropicFile", "AnthropicFileList") if headers
                              else ("OpenAIFile", "OpenAIFileList"))
    uploaded = conforms(served, "post", "/v1/files", http.post(
        "/v1/files", headers=headers, data={"purpose": "user_data"},
        files={"file": ("sales.csv", b"a,b\n1,2\n")}), 200)
    assert is_component(served, file_model, uploaded)
    try:
        listed = conforms(served, "get", "/v1/files",
                          http.get("/v1/files", headers=headers, params={"limit": 1}), 200)
        assert is_component(served, list_model, listed)
        one = conforms(served, "get", "/v1/files/{file_id}",
                       http.get(f"/v1/files/{uploaded['id']}", headers=headers), 200)
        assert is_component(served, file_model, one)
        missing = conforms(served, "get", "/v1/files/{file_id}",
                           http.get("/v1/files/file_nosuch", headers=headers), 404)
        assert is_component(served, "AnthropicError" if headers else "OpenAIError", missing)
    finally:
        deleted = http.delete(f"/v1/files/{uploaded['id']}", headers=headers)
    conforms(served, "delete", "/v1/files/{file_id}", deleted, 200)
    assert is_component(served, "FileDeleted" if headers else "OpenAIFileDeleted", deleted.json())


def test_containers_and_their_files(http, served):
    created = conforms(served, "post", "/v1/containers", http.post("/v1/containers", json={
        "name": "openapi", "expires_after": {"anchor": "last_active_at", "minutes": 5}}), 200)
    container = created["id"]
    try:
        listed = conforms(served, "get", "/v1/containers",
                          http.get("/v1/containers", params={"name": "openapi"}), 200)
        assert container in {item["id"] for item in listed["data"]}
        conforms(served, "get", "/v1/containers/{container_id}",
                 http.get(f"/v1/containers/{container}"), 200)
        files_path = "/v1/containers/{container_id}/files"
        uploaded = conforms(served, "post", files_path, http.post(
            f"/v1/containers/{container}/files", files={"file": ("in.txt", b"hello")}), 200)
        tenant_file = http.post("/v1/files", files={"file": ("attached.txt", b"attached")})
        assert tenant_file.status_code == 200, tenant_file.text
        attached = conforms(served, "post", files_path, http.post(
            f"/v1/containers/{container}/files", json={"file_id": tenant_file.json()["id"]}), 200)
        assert attached["path"].endswith("/attached.txt")
        http.delete(f"/v1/files/{tenant_file.json()['id']}")
        page = conforms(served, "get", files_path, http.get(f"/v1/containers/{container}/files"),
                        200)
        assert {item["id"] for item in page["data"]} == {uploaded["id"], attached["id"]}
        conforms(served, "get", files_path + "/{file_id}",
                 http.get(f"/v1/containers/{container}/files/{uploaded['id']}"), 200)
        conforms(served, "delete", files_path + "/{file_id}",
                 http.delete(f"/v1/containers/{container}/files/{uploaded['id']}"), 200)
    finally:
        deleted = http.delete(f"/v1/containers/{container}")
    conforms(served, "delete", "/v1/containers/{container_id}", deleted, 200)
    # The OpenAI dialect's errors are OpenAI's, as declared
    missing = conforms(served, "get", "/v1/containers/{container_id}",
                       http.get(f"/v1/containers/{container}"), 404)
    assert missing["error"]["code"] == "not_found"
    conforms(served, "get", "/v1/containers/{container_id}/files",
             http.get(f"/v1/containers/{container}/files"), 404)


def test_a_runs_events_and_record(http, served):
    started = http.post("/v1/code-execution/runs", json={"language": "python",
                                                         "code": "print(6 * 7)"})
    events = stream_conforms(served, "post", "/v1/code-execution/runs", started)
    assert [event["event"] for event in events][0] == "run.created"
    assert events[-1] == {"event": "message", "data": "[DONE]", "id": events[-1]["id"]}
    assert events[-2]["event"] == "run.completed"
    run_id = json.loads(events[0]["data"])["runId"]

    record = conforms(served, "get", "/v1/code-execution/runs/{run_id}",
                      http.get(f"/v1/code-execution/runs/{run_id}"), 200)
    assert (record["run_id"], record["status"], record["stdout"]) == (run_id, "completed", "42\n")
    replayed = stream_conforms(served, "get", "/v1/code-execution/runs/{run_id}/events",
                               http.get(f"/v1/code-execution/runs/{run_id}/events",
                                        headers={"last-event-id": events[0]["id"]}))
    assert replayed[0]["event"] != "run.created" and replayed[-1]["data"] == "[DONE]"
    # A finished run waits for no tool result, and says so in OpenAI's shape
    conforms(served, "post", "/v1/code-execution/runs/{run_id}/tool-results", http.post(
        f"/v1/code-execution/runs/{run_id}/tool-results",
        json={"results": [{"call_id": "call_nosuch", "output": "1"}]}), 409)
    conforms(served, "get", "/v1/code-execution/runs/{run_id}",
             http.get("/v1/code-execution/runs/cexrun_nosuch"), 404)


def test_the_gateway_routes_answer_in_their_declared_errors(http, served):
    """No upstream is configured here: the gateway answers 400 and 501, as declared."""
    conforms(served, "post", "/v1/messages", http.post(
        "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}),
        400)
    conforms(served, "post", "/v1/messages", http.post("/v1/messages", json={
        "model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}), 501)
    validation = conforms(served, "post", "/v1/messages/validate", http.post(
        "/v1/messages/validate", json={
            "model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "code_execution_20250825", "name": "code_execution"}]}), 200)
    assert validation["code_execution"] is True and validation["upstream_configured"] is False
    conforms(served, "post", "/v1/responses", http.post("/v1/responses", json={
        "model": "m", "input": "hi", "tools": [{"type": "code_interpreter"}]}), 501)
    conforms(served, "get", "/v1/responses/{response_id}",
             http.get("/v1/responses/resp_nosuch"), 404)


def test_probes(http, served):
    health = conforms(served, "get", "/health", http.get("/health"), 200)
    assert health["status"] == "ok" and "max_sessions" in health  # an open server's operator
    conforms(served, "get", "/readyz", http.get("/readyz"), 200)
    conforms(served, "get", "/livez", http.get("/livez"), 200)
    metrics = http.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    assert set(served["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {
        "text/plain"}
    assert "shoal_sessions_live" in metrics.text


def test_the_document_served_is_the_apps(served, document):
    assert served["paths"] == document["paths"]
    assert served["components"] == document["components"]


# -- (c) the interactive page ------------------------------------------------------------------
def test_docs_page(http):
    page = http.get("/docs")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "swagger-ui" in page.text.lower() and "/openapi.json" in page.text
