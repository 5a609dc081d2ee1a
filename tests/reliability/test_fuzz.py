"""Schemathesis over every route of a real Shoal server, checked against real schemas.

Two fuzzers run against one server:

- the contract's (``code-execution-openapi.yaml``, the protocol Shoal implements):
  its operations are called with inputs generated from the contract's own request
  schemas, and every answer must conform to the contract's response schemas;
- the served document's (``/openapi.json``): every operation the server lists,
  which must be every route it serves (``test_the_served_document_lists_every_route``
  reads them from the app itself, and ``test_every_listed_operation_was_fuzzed``
  checks each was called). Its answers are held to the schemas of the dialect
  their clients parse, not only to what the server says about itself: an error
  must be in its dialect's shape (the protocol's ``{"detail"}``, OpenAI's error
  object, Anthropic's error response, each as strictly as its SDK parses it),
  with the request id the response's header carries; an OpenAI object (a
  container, a container file, a file, a deletion) must parse as the official
  ``openai`` package's model of it; and everything else must conform to the
  served document.

No response may be a 5xx. Each generated case is sent twice: once as generated
(ids that do not exist, so mostly the 404 paths), and once with its session,
container, scope and file ids replaced by live ones, so that the fuzzed
parameters reach the code behind the lookup.

Every answer is held to the served document, errors included (each dialect's
error shape is declared there), and to its dialect's real shape.

What had to be configured: ``MAX_EXAMPLES`` (``CONTRACT_EXAMPLES``) generated cases
per operation in the fuzzing phase, no deadline, Hypothesis' health checks off (they trip on a real
server's latency); schemathesis 4's lazy loader renames the running test through
``Node._nodeid``, which pytest 9 no longer has (an autouse fixture gives it back);
the server reaps idle sessions quickly and has room for many, because the fuzzer
creates sessions it never releases, and a full house (503) would be a server error.
"""

from __future__ import annotations

import base64
import re
from collections import Counter
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import anthropic.types
import httpx
import hypothesis
import openai.types
import openai.types.containers
import pydantic
import pytest
import schemathesis
import yaml
from fastapi.routing import APIRoute
from hypothesis import HealthCheck
from jsonschema import Draft202012Validator
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance
from starlette.routing import Route

from shoal.app import create_app
from shoal.config import Settings

MAX_EXAMPLES = 15
# The contract's operations are fuzzed by the served document's fuzzer too; here they
# are held to the contract's schemas, with fewer cases.
CONTRACT_EXAMPLES = 10

_SHARED_SPEC = Path(__file__).resolve().parents[3] / "shared" / "spec" / "code-execution-openapi.yaml"
_VENDORED_SPEC = Path(__file__).resolve().parents[1] / "api" / "spec" / "code-execution-openapi.yaml"
CONTRACT = yaml.safe_load((_SHARED_SPEC if _SHARED_SPEC.exists() else _VENDORED_SPEC).read_text())


# -- the real schemas ---------------------------------------------------------------------------------
PROTOCOL, OPENAI, ANTHROPIC = "protocol", "openai", "anthropic"
_OPENAI_PREFIXES = ("/v1/responses", "/v1/containers", "/v1/code-execution", "/v1/runtime")


def dialect_of(path: str, query: dict, headers: dict) -> str:
    """Whose clients an answer is for, by the rule Shoal documents (shoal.api.errors):
    OpenAI's routes and the tenant Files API, Anthropic's routes (and the Files API
    asked with ``anthropic-version``), else the protocol (Zylon's Files API included)."""
    if path.startswith("/api/gpt/"):
        path = path[len("/api/gpt"):]
    if path.startswith("/v1/messages"):
        return ANTHROPIC
    if path.startswith(_OPENAI_PREFIXES):
        return OPENAI
    if path.startswith("/v1/files"):
        if "scope_id" in query:
            return PROTOCOL
        return ANTHROPIC if "anthropic-version" in {k.lower() for k in headers} else OPENAI
    return PROTOCOL


_REQUEST_ID = {"type": "string", "minLength": 1}
# Exactly the keys each dialect's clients read (plus the request id Shoal adds), with
# the types they expect; the SDK models below are checked as well.
ERROR_SCHEMAS = {
    PROTOCOL: {
        "type": "object", "required": ["detail"], "additionalProperties": False,
        "properties": {"request_id": _REQUEST_ID, "detail": {"oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["loc", "msg", "type"],
                "properties": {"loc": {"type": "array"}, "msg": {"type": "string"},
                               "type": {"type": "string"}}}},
        ]}},
    },
    OPENAI: {
        "type": "object", "required": ["error"], "additionalProperties": False,
        "properties": {"request_id": _REQUEST_ID, "error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "additionalProperties": False,
            "properties": {"message": {"type": "string", "minLength": 1},
                           "type": {"type": "string", "minLength": 1},
                           "param": {"type": ["string", "null"]},
                           "code": {"type": ["string", "null"]}}}},
    },
    ANTHROPIC: {
        "type": "object", "required": ["type", "error"], "additionalProperties": False,
        "properties": {"request_id": _REQUEST_ID, "type": {"const": "error"}, "error": {
            "type": "object", "required": ["type", "message"], "additionalProperties": False,
            "properties": {"type": {"type": "string"},
                           "message": {"type": "string", "minLength": 1}}}},
    },
}
ERROR_VALIDATORS = {name: Draft202012Validator(schema) for name, schema in ERROR_SCHEMAS.items()}


def _sdk_error(dialect: str, body: dict) -> None:
    """The official SDKs' own models of an error."""
    if dialect == OPENAI:
        openai.types.shared.ErrorObject.model_validate(body["error"])
    elif dialect == ANTHROPIC:
        anthropic.types.ErrorResponse.model_validate(body)


class _Deleted(pydantic.BaseModel):
    """OpenAI's deletion status of a container or a container file (the SDK's delete
    returns None, so it has no model of it)."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    id: str
    object: str
    deleted: bool


class _ListOf:
    def __init__(self, model) -> None:
        self.model = model

    def validate(self, body: dict) -> None:
        assert body.get("object") == "list", body
        assert isinstance(body.get("has_more"), bool), body
        for item in body["data"]:
            self.model.model_validate(item)


# OpenAI objects, by operation: the official package's models of them.
OPENAI_OBJECTS = {
    ("POST", "/v1/containers"): openai.types.ContainerCreateResponse,
    ("GET", "/v1/containers"): _ListOf(openai.types.ContainerListResponse),
    ("GET", "/v1/containers/{container_id}"): openai.types.ContainerRetrieveResponse,
    ("DELETE", "/v1/containers/{container_id}"): _Deleted,
    ("POST", "/v1/containers/{container_id}/files"): openai.types.containers.FileCreateResponse,
    ("GET", "/v1/containers/{container_id}/files"): _ListOf(openai.types.containers.FileListResponse),
    ("GET", "/v1/containers/{container_id}/files/{file_id}"):
        openai.types.containers.FileRetrieveResponse,
    ("DELETE", "/v1/containers/{container_id}/files/{file_id}"): _Deleted,
    ("POST", "/v1/files"): openai.types.FileObject,
    ("GET", "/v1/files"): _ListOf(openai.types.FileObject),
    ("GET", "/v1/files/{file_id}"): openai.types.FileObject,
    ("DELETE", "/v1/files/{file_id}"): openai.types.FileDeleted,
}
_DELETED_OBJECTS = {("DELETE", "/v1/containers/{container_id}"): "container.deleted",
                    ("DELETE", "/v1/containers/{container_id}/files/{file_id}"):
                        "container.file.deleted"}


def _request_facts(response, case) -> tuple[str, dict, dict]:
    url = urlsplit(str(response.request.url))
    return url.path, parse_qs(url.query, keep_blank_values=True), dict(response.request.headers)


def _header(response, name: str) -> str | None:
    for key, value in response.headers.items():
        if key.lower() == name:
            return value[0] if isinstance(value, list) else value
    return None


@schemathesis.check
def errors_in_their_dialects_shape(ctx, response, case):
    """Every error is JSON in the shape its dialect's clients parse, carrying the
    request id of the response's header."""
    if response.status_code < 400 or case.method.upper() == "HEAD":
        return None  # (a HEAD answer has no body to check)
    path, query, headers = _request_facts(response, case)
    dialect = dialect_of(path, query, headers)
    content_type = _header(response, "content-type") or ""
    assert content_type.startswith("application/json"), \
        f"a {response.status_code} that is not JSON ({content_type!r}): {response.text[:300]}"
    body = response.json()
    problems = [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
                for e in ERROR_VALIDATORS[dialect].iter_errors(body)]
    assert not problems, f"not a {dialect} error body: {problems}: {response.text[:500]}"
    _sdk_error(dialect, body)
    assert body.get("request_id") == _header(response, "x-request-id"), \
        (body.get("request_id"), _header(response, "x-request-id"))
    return None


@schemathesis.check
def openai_objects_as_the_sdk_parses_them(ctx, response, case):
    """An OpenAI object answered in OpenAI's dialect parses as the openai package's model."""
    key = (case.method.upper(), case.operation.path)
    model = OPENAI_OBJECTS.get(key)
    path, query, headers = _request_facts(response, case)
    if model is None or not 200 <= response.status_code < 300:
        return None
    if dialect_of(path, query, headers) != OPENAI:
        return None  # Zylon's Files API on the same routes (scope_id)
    body = response.json()
    model.validate(body) if isinstance(model, _ListOf) else model.model_validate(body)
    if key in _DELETED_OBJECTS:
        assert body["object"] == _DELETED_OBJECTS[key] and body["deleted"] is True, body
    return None


@schemathesis.check
def conforms_to_the_served_document(ctx, response, case):
    """``response_schema_conformance`` against /openapi.json: every answer, errors in
    each dialect's shape included, is what the served document declares."""
    return response_schema_conformance(ctx, response, case)


@schemathesis.check
def no_server_error(ctx, response, case):
    """No 5xx, but for the one 5xx that is the answer: the fuzzed server has no upstream
    model, so the gateway routes say 501 "no upstream model" (declared in the document)."""
    path = urlsplit(str(response.request.url)).path
    if (response.status_code == 501 and path in ("/v1/messages", "/v1/responses")
            and "no upstream model" in response.text):
        return None
    return not_a_server_error(ctx, response, case)


SERVED_CHECKS = [no_server_error, errors_in_their_dialects_shape,
                 openai_objects_as_the_sdk_parses_them, conforms_to_the_served_document]
CONTRACT_CHECKS = [no_server_error, response_schema_conformance, errors_in_their_dialects_shape]


# -- the server and live ids --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzzed_server(shoal):
    return shoal(pool_size=2, max_sessions=256, disk_limit_mib=32, idle_timeout_seconds=10,
                 reaper_interval_seconds=1, max_timeout_seconds=5, default_timeout_seconds=5,
                 max_file_bytes=1024 * 1024)


def _file_id(sandbox_path: str) -> str:
    return base64.urlsafe_b64encode(sandbox_path.encode()).decode().rstrip("=")


class LiveIds:
    """Ids of a live session, container and files; recreated when a case deletes them."""

    def __init__(self, server) -> None:
        self.http = httpx.Client(base_url=server.url, timeout=60)
        self.session_id = ""
        self.container_id = ""
        self.ensure()

    def ensure(self) -> None:
        if not self.session_id or self.http.get(f"/sessions/{self.session_id}").status_code != 200:
            response = self.http.post("/sessions", json={"idle_timeout_seconds": 600})
            assert response.status_code == 201, response.text
            self.session_id = response.json()["session_id"]
            files = self.http.post(f"/sessions/{self.session_id}/files", data={"path": "data.txt"},
                                   files={"file": ("data.txt", b"fuzz me\n")})
            assert files.status_code == 201, files.text
        if not self.container_id or self.http.get(
                f"/v1/containers/{self.container_id}").status_code != 200:
            response = self.http.post("/v1/containers", json={"name": "fuzzed"})
            assert response.status_code == 200, response.text
            self.container_id = response.json()["id"]
            upload = self.http.post("/v1/files", params={"scope_id": self.container_id},
                                    files={"file": ("input.csv", b"a,b\n1,2\n")})
            assert upload.status_code == 201, upload.text

    @property
    def values(self) -> dict[str, str]:
        return {
            "session_id": self.session_id,
            "container_id": self.container_id,
            "scope_id": self.container_id,
            "file_id": _file_id("/mnt/user-data/uploads/input.csv"),
        }

    def apply(self, case) -> bool:
        """Put live ids into the case; whether it had any id to replace."""
        self.ensure()
        replaced = False
        for container in (case.path_parameters, case.query):
            if not container:
                continue
            for name, value in self.values.items():
                if name in container:
                    container[name] = value
                    replaced = True
        return replaced


STATUSES: Counter = Counter()
FUZZED: set[tuple[str, str]] = set()


@pytest.fixture(scope="module")
def live(fuzzed_server):
    ids = LiveIds(fuzzed_server)
    yield ids
    ids.http.close()
    print(f"\nfuzzed responses by status: {dict(sorted(STATUSES.items()))}")


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json", timeout=30)


@pytest.fixture(scope="module")
def contract_schema():
    return schemathesis.openapi.from_dict(CONTRACT)


@pytest.fixture(autouse=True)
def _node_id_for_schemathesis(request):
    # schemathesis 4.x renames the running test through ``Node._nodeid``, which
    # pytest 9 no longer has (it became ``Node._id``); give it the attribute back.
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


served = schemathesis.pytest.from_fixture("api_schema")
contract = schemathesis.pytest.from_fixture("contract_schema")
SETTINGS = hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None,
                               suppress_health_check=list(HealthCheck))


@served.parametrize()
@SETTINGS
def test_every_served_route_answers_in_real_shapes(case, live):
    FUZZED.add((case.method.upper(), case.operation.path))
    STATUSES[case.call_and_validate(checks=SERVED_CHECKS, timeout=60).status_code] += 1
    if live.apply(case):
        STATUSES[case.call_and_validate(checks=SERVED_CHECKS, timeout=60).status_code] += 1


@contract.parametrize()
@hypothesis.settings(SETTINGS, max_examples=CONTRACT_EXAMPLES)
def test_the_contracts_routes_answer_as_the_contract_says(case, live, fuzzed_server):
    STATUSES[case.call_and_validate(base_url=fuzzed_server.url, checks=CONTRACT_CHECKS,
                                    timeout=60).status_code] += 1
    if live.apply(case):
        STATUSES[case.call_and_validate(base_url=fuzzed_server.url, checks=CONTRACT_CHECKS,
                                        timeout=60).status_code] += 1


# -- every route is listed, and every listed route was fuzzed -----------------------------------------
def _app_routes(routes, prefix: str = "", listed: bool = True):
    """(method, path, included in the schema) of every route the app serves."""
    for route in routes:
        if isinstance(route, APIRoute):
            for method in route.methods:
                yield method, prefix + route.path, listed and route.include_in_schema
        elif hasattr(route, "original_router"):  # an included router (FastAPI >= 0.120)
            context = route.include_context
            yield from _app_routes(route.original_router.routes, prefix + context.prefix,
                                   listed and context.include_in_schema)
        elif hasattr(route, "routes"):  # a mount
            yield from _app_routes(route.routes, prefix + route.path, listed)
        elif isinstance(route, Route):
            for method in route.methods or ():
                yield method, prefix + route.path, getattr(route, "include_in_schema", True)
        else:
            raise AssertionError(f"a route of an unknown kind: {route!r}")


def _listed(document: dict) -> set[tuple[str, str]]:
    methods = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}
    return {(method.upper(), path) for path, item in document["paths"].items()
            for method in item if method in methods}


def test_the_served_document_lists_every_route(fuzzed_server, tmp_path):
    """Fuzzing covers what the document lists: it must be every route the app serves,
    read from the app itself (a route missing from the document is never fuzzed)."""
    app = create_app(Settings(data_dir=tmp_path / "data", run_dir=tmp_path / "run"))
    served_routes = {(method, re.sub(r"\{(\w+):\w+\}", r"{\1}", path))
                     for method, path, _ in _app_routes(app.routes)}
    # The document itself and its browser (Swagger UI's page and its OAuth2 helper).
    served_routes -= {(method, path) for method in ("GET", "HEAD")
                      for path in ("/openapi.json", "/docs", "/docs/oauth2-redirect")}
    document = httpx.get(f"{fuzzed_server.url}/openapi.json", timeout=30).json()
    listed = _listed(document)
    assert served_routes - listed == set(), "served but not listed, so never fuzzed"
    assert listed - served_routes == set(), "listed but not served"
    assert len(listed) >= 30, sorted(listed)  # the sanity of the walk above


def test_every_listed_operation_was_fuzzed(fuzzed_server):
    if not FUZZED:
        pytest.skip("the served-route fuzzer was not selected in this run")
    document = httpx.get(f"{fuzzed_server.url}/openapi.json", timeout=30).json()
    assert _listed(document) - FUZZED == set()


# -- the served document declares each dialect's errors -------------------------------------------
def _declared_schema(document: dict, method: str, path: str, status: int) -> dict:
    response = document["paths"][path][method]["responses"][str(status)]
    schema = response["content"]["application/json"]["schema"]
    return {**schema, "components": document["components"]}


@pytest.mark.parametrize("method, path, url, status", [
    ("get", "/v1/containers/{container_id}", "/v1/containers/cnt_nosuch", 404),
    ("get", "/v1/containers/{container_id}/files", "/v1/containers/cnt_nosuch/files", 404),
])
def test_the_served_document_declares_the_dialect_error_shapes(fuzzed_server, method, path, url,
                                                              status):
    with httpx.Client(base_url=fuzzed_server.url, timeout=30) as http:
        document = http.get("/openapi.json").json()
        response = http.request(method.upper(), url)
    assert response.status_code == status, response.text
    validator = Draft202012Validator(_declared_schema(document, method, path, status))
    errors = [error.message for error in validator.iter_errors(response.json())]
    assert errors == [], f"{response.text[:300]} breaks the declared schema: {errors}"


def test_a_container_without_a_name_is_answered_as_openai_does(fuzzed_server):
    """Caronte's API makes the name optional; OpenAI's container object always has a
    string name (openai.types.ContainerCreateResponse): a nameless one goes by its id."""
    with httpx.Client(base_url=fuzzed_server.url, timeout=30) as http:
        response = http.post("/v1/containers", json={})
        assert response.status_code == 200, response.text
        http.delete(f"/v1/containers/{response.json()['id']}")
    created = openai.types.ContainerCreateResponse.model_validate(response.json())
    assert created.name == created.id


# -- what the fuzzer found, kept as regression tests ------------------------------------------------
@pytest.mark.parametrize("method, path, url", [
    ("put", "/v1/files/{key}", "/v1/files/0?scope_id="),
    ("post", "/v1/files", "/v1/files?scope_id=null"),
])
def test_422_answers_match_the_served_document(fuzzed_server, method, path, url):
    with httpx.Client(base_url=fuzzed_server.url, timeout=30) as http:
        document = http.get("/openapi.json").json()
        response = http.request(method.upper(), url)
    assert response.status_code == 422, response.text
    validator = Draft202012Validator(_declared_schema(document, method, path, 422))
    errors = [error.message for error in validator.iter_errors(response.json())]
    assert errors == [], f"{response.text[:300]} breaks the declared schema: {errors}"
