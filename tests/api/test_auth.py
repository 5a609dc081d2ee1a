"""Bearer tokens, tenants and failing closed, over real HTTP.

With tokens configured every route but ``/health`` needs ``Authorization:
Bearer <token>``, a token stands for a tenant, and a tenant sees only its own
sessions: another tenant's id answers exactly as an unknown one does (404, and
204 for DELETE, which then destroys nothing). A token setting that cannot be
read, or holds no token, stops the server instead of opening it.
"""

from __future__ import annotations

import base64
import http.client
import subprocess
from collections.abc import Iterator

import httpx
import pytest

from tests.serving import SHOAL, Server, free_port, start_server

TOKENS = "tok-a=tenant-a,tok-b=tenant-b,tok-a2=tenant-a"
OPERATOR_TOKEN = "tok-operator"
PRINT_ONE = {"tool": "code_execution", "input": {"code": "print(1)"}}
UNKNOWN_ID = "0123456789abcdef0123456789abcdef"
# uid bases for servers that must refuse to start: they never launch a sandbox,
# and these lie outside the range conftest hands out.
_NEVER_STARTED_UID_BASE = 590_000  # start_server moves it into this run's uid slot


def _refuse_server_errors(response: httpx.Response) -> None:
    response.read()
    assert response.status_code < 500, (
        f"{response.request.method} {response.request.url} answered "
        f"{response.status_code}: {response.text[:500]}")


def _client(server: Server, authorization: str | None = None) -> httpx.Client:
    headers = {"Authorization": authorization} if authorization is not None else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=60,
                        event_hooks={"response": [_refuse_server_errors]})


def _bearer(token: str) -> str:
    return f"Bearer {token}"


@pytest.fixture(scope="module")
def authed(server_factory) -> Server:
    return server_factory(tokens=TOKENS, operator_tokens=OPERATOR_TOKEN, max_sessions=8,
                          pool_size=2)


@pytest.fixture
def as_a(authed) -> Iterator[httpx.Client]:
    with _client(authed, _bearer("tok-a")) as http:
        yield http


@pytest.fixture
def as_a2(authed) -> Iterator[httpx.Client]:
    with _client(authed, _bearer("tok-a2")) as http:
        yield http


@pytest.fixture
def as_b(authed) -> Iterator[httpx.Client]:
    with _client(authed, _bearer("tok-b")) as http:
        yield http


@pytest.fixture(scope="module")
def session_of_a(authed) -> Iterator[str]:
    """A session of tenant-a, holding one file, that the 401 tests try to reach."""
    with _client(authed, _bearer("tok-a")) as http:
        response = http.post("/sessions", json={})
        assert response.status_code == 201, response.text
        session_id = response.json()["session_id"]
        upload = http.post(f"/sessions/{session_id}/files", files={"file": ("f.txt", b"secret\n")},
                           data={"path": "f.txt"})
        assert upload.status_code == 201, upload.text
        yield session_id
        http.delete(f"/sessions/{session_id}")


def _live_sessions(server: Server) -> int:
    # The counts are the operator's: anonymous callers and tenants see only "ok".
    return httpx.get(f"{server.url}/health", timeout=10,
                     headers={"Authorization": _bearer(OPERATOR_TOKEN)}).json()["sessions"]


# -- 401 on every route but /health ----------------------------------------------------------
ROUTES = {
    "create": lambda http, sid: http.post("/sessions", json={}),
    "get": lambda http, sid: http.get(f"/sessions/{sid}"),
    "exec": lambda http, sid: http.post(f"/sessions/{sid}/exec", json=PRINT_ONE),
    "list-files": lambda http, sid: http.get(f"/sessions/{sid}/files/list"),
    "get-file": lambda http, sid: http.get(f"/sessions/{sid}/files", params={"path": "f.txt"}),
    "put-file": lambda http, sid: http.post(f"/sessions/{sid}/files",
                                            files={"file": ("p.txt", b"pwned")},
                                            data={"path": "pwned.txt"}),
    "delete": lambda http, sid: http.delete(f"/sessions/{sid}"),
    "metrics": lambda http, sid: http.get("/metrics"),
}

BAD_CREDENTIALS = {
    "none": None,
    "wrong-token": "Bearer not-a-token",
    "basic-scheme": "Basic " + base64.b64encode(b"tok-a:").decode(),
    "basic-with-a-valid-token": "Basic tok-a",
    "token-without-scheme": "tok-a",
    "bare-bearer": "Bearer",  # what "Bearer " is once the value's whitespace is trimmed
    "token-case-differs": "Bearer TOK-A",
    "token-prefix": "Bearer tok-",
    "token-with-tenant": "Bearer tok-a=tenant-a",
    "two-tokens": "Bearer tok-a tok-b",
    "tenant-name-as-token": "Bearer tenant-a",
}


@pytest.mark.parametrize("credential", BAD_CREDENTIALS)
@pytest.mark.parametrize("route", ROUTES)
def test_every_route_but_health_is_401_without_a_valid_bearer(authed, schema_errors, session_of_a,
                                                              route, credential):
    live_before = _live_sessions(authed)
    with _client(authed, BAD_CREDENTIALS[credential]) as http:
        response = ROUTES[route](http, session_of_a)
    assert response.status_code == 401, response.text
    assert response.headers.get("www-authenticate", "").lower().startswith("bearer")
    assert response.headers.get("content-type", "").startswith("application/json")
    body = response.json()
    assert isinstance(body, dict) and "detail" in body
    assert schema_errors("Error", body) == []
    assert "secret" not in response.text
    # Refused before anything happened: no session made or destroyed, nothing written.
    assert _live_sessions(authed) == live_before
    with _client(authed, _bearer("tok-a")) as owner:
        assert owner.get(f"/sessions/{session_of_a}").status_code == 200
        if route == "put-file":
            listed = owner.get(f"/sessions/{session_of_a}/files/list").json()["files"]
            assert [entry["path"] for entry in listed] == ["f.txt"]


@pytest.mark.parametrize("method,route", [("POST", "/sessions"), ("GET", "/sessions/{sid}"),
                                          ("DELETE", "/sessions/{sid}"), ("GET", "/metrics")])
@pytest.mark.parametrize("authorization", ["Bearer ", "Bearer    ", "Bearer \t"])
def test_an_empty_bearer_sent_verbatim_is_401(authed, session_of_a, method, route, authorization):
    # httpx refuses to send a header value with trailing whitespace; http.client sends it as is.
    url = httpx.URL(authed.url)
    connection = http.client.HTTPConnection(url.host, url.port, timeout=30)
    try:
        connection.request(method, route.format(sid=session_of_a),
                           headers={"Authorization": authorization, "Content-Length": "0"})
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    assert response.status == 401, body
    assert (response.getheader("WWW-Authenticate") or "").lower().startswith("bearer")
    assert b'"detail"' in body
    with _client(authed, _bearer("tok-a")) as owner:
        assert owner.get(f"/sessions/{session_of_a}").status_code == 200


@pytest.mark.parametrize("route", ["get", "exec", "delete"])
def test_an_unknown_session_is_401_not_404_without_a_token(authed, route):
    with _client(authed) as http:
        response = ROUTES[route](http, UNKNOWN_ID)
    assert response.status_code == 401, response.text


@pytest.mark.parametrize("credential", [None, "Bearer not-a-token", "Basic x"])
def test_health_answers_without_a_token(authed, credential):
    with _client(authed, credential) as http:
        response = http.get("/health")
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "ok"


def test_a_valid_token_is_accepted_on_every_route(as_a, session_of_a):
    assert as_a.get(f"/sessions/{session_of_a}").status_code == 200
    assert as_a.post(f"/sessions/{session_of_a}/exec", json=PRINT_ONE).status_code == 200
    assert as_a.get(f"/sessions/{session_of_a}/files",
                    params={"path": "f.txt"}).content == b"secret\n"
    assert as_a.get(f"/sessions/{session_of_a}/files/list").status_code == 200
    # A valid tenant token, but metrics describe every tenant: the operator's only.
    assert as_a.get("/metrics").status_code == 403


def test_the_bearer_scheme_is_case_insensitive(authed, session_of_a):
    # RFC 9110 section 11.1: the auth scheme is a case-insensitive token.
    with _client(authed, "bearer tok-a") as http:
        assert http.get(f"/sessions/{session_of_a}").status_code == 200


# -- tenancy -----------------------------------------------------------------------------------
def test_another_tenant_cannot_see_touch_or_destroy_a_session(as_a, as_a2, as_b, schema_errors):
    created = as_a.post("/sessions", json={})
    assert created.status_code == 201, created.text
    session_id = created.json()["session_id"]
    base = f"/sessions/{session_id}"
    try:
        assert as_a.post(f"{base}/exec", json={"tool": "code_execution",
                                               "input": {"code": "x = 41"}}).status_code == 200
        assert as_a.post(f"{base}/files", files={"file": ("s.txt", b"tenant-a secret\n")},
                         data={"path": "s.txt"}).status_code == 201

        attempts = {
            "get": as_b.get(base),
            "exec": as_b.post(f"{base}/exec", json={"tool": "code_execution",
                                                    "input": {"code": "x = 0"}}),
            "list-files": as_b.get(f"{base}/files/list"),
            "get-file": as_b.get(f"{base}/files", params={"path": "s.txt"}),
            "put-file": as_b.post(f"{base}/files", files={"file": ("b.txt", b"from b")},
                                  data={"path": "b.txt"}),
        }
        for name, response in attempts.items():
            assert response.status_code == 404, (name, response.text)
            body = response.json()
            assert "detail" in body and schema_errors("Error", body) == [], name
            assert "secret" not in response.text and "tenant-a" not in response.text, name

        # Someone else's id reads exactly like an id that never existed.
        unknown = as_b.get(f"/sessions/{UNKNOWN_ID}")
        assert unknown.status_code == 404
        assert (attempts["get"].json()["detail"].replace(session_id, "ID")
                == unknown.json()["detail"].replace(UNKNOWN_ID, "ID"))

        deleted = as_b.delete(base)
        assert deleted.status_code == 204 and deleted.content == b""

        # Nothing tenant-b did reached the session: it lives, its state and files are intact.
        assert as_a.get(base).status_code == 200
        ran = as_a.post(f"{base}/exec", json={"tool": "code_execution",
                                              "input": {"code": "print(x + 1)"}})
        assert ran.status_code == 200
        assert ran.json()["result_block"]["content"]["stdout"] == "42\n"
        listed = as_a.get(f"{base}/files/list").json()["files"]
        assert [entry["path"] for entry in listed] == ["s.txt"]

        # A second token of the same tenant sees and uses the same session.
        handle = as_a2.get(base)
        assert handle.status_code == 200 and handle.json()["session_id"] == session_id
        ran = as_a2.post(f"{base}/exec", json={"tool": "code_execution",
                                               "input": {"code": "x += 1; print(x)"}})
        assert ran.json()["result_block"]["content"]["stdout"] == "42\n"
        assert as_a2.get(f"{base}/files", params={"path": "s.txt"}).content \
            == b"tenant-a secret\n"
        assert as_a2.delete(base).status_code == 204
        assert as_a.get(base).status_code == 404
    finally:
        as_a.delete(base)


def test_tenants_are_isolated_both_ways(as_a, as_b):
    of_b = as_b.post("/sessions", json={})
    assert of_b.status_code == 201
    session_id = of_b.json()["session_id"]
    try:
        assert as_a.get(f"/sessions/{session_id}").status_code == 404
        assert as_a.post(f"/sessions/{session_id}/exec", json=PRINT_ONE).status_code == 404
        assert as_b.post(f"/sessions/{session_id}/exec", json=PRINT_ONE).status_code == 200
    finally:
        as_b.delete(f"/sessions/{session_id}")


# -- a tokens file, and failing closed ----------------------------------------------------------
@pytest.fixture(scope="module")
def file_authed(server_factory, tmp_path_factory) -> Server:
    path = tmp_path_factory.mktemp("tokens") / "tokens"
    path.write_text("# Shoal tokens, one 'token=tenant' per line\n"
                    "\n"
                    "file-tok=tenant-x\n"
                    "   file-tok2 = tenant-y   \n"
                    "# disabled-tok=tenant-x\n")
    return server_factory(tokens=f"@{path}", pool_size=1)


def test_a_tokens_file_is_read(file_authed):
    with _client(file_authed, _bearer("file-tok")) as x, \
            _client(file_authed, _bearer("file-tok2")) as y:
        created = x.post("/sessions", json={})
        assert created.status_code == 201, created.text
        session_id = created.json()["session_id"]
        try:
            assert x.post(f"/sessions/{session_id}/exec", json=PRINT_ONE).status_code == 200
            # The second line (padded with spaces) is a token of another tenant.
            assert y.get(f"/sessions/{session_id}").status_code == 404
            assert y.get("/metrics").status_code == 403  # a valid token, not the operator's
        finally:
            x.delete(f"/sessions/{session_id}")


@pytest.mark.parametrize("credential", [None, "Bearer disabled-tok", "Bearer # disabled-tok",
                                        "Bearer tok-a", "Bearer tenant-x"])
def test_a_tokens_file_admits_nobody_else(file_authed, credential):
    with _client(file_authed, credential) as http:
        response = http.post("/sessions", json={})
    assert response.status_code == 401, response.text
    assert response.headers.get("www-authenticate", "").lower().startswith("bearer")


def test_a_missing_tokens_file_stops_the_server(tmp_path):
    port = free_port()
    process = subprocess.run(
        [str(SHOAL), "serve", "--tokens", "@/nonexistent", "--port", str(port),
         "--data-dir", str(tmp_path / "data"), "--run-dir", "/run/shoal-test",
         "--uid-base", str(_NEVER_STARTED_UID_BASE)],
        capture_output=True, text=True, timeout=60)
    assert process.returncode != 0
    assert "/nonexistent" in process.stderr, process.stderr
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


@pytest.mark.parametrize("setting,message", [
    ("@{tmp}", "cannot read tokens file"),  # a directory, not a file
    ("@{tmp}/only-comments", "holds no token"),
    ("@{tmp}/malformed", "line 2 of {tmp}/malformed: each token must be written 'token=tenant'"),
    ("just-a-token", "token=tenant"),
    # base64 padding: "dG9rZW4tYQ" for "=tenant-a", or "dG9rZW4tYQ=" for "tenant-a"?
    ("dG9rZW4tYQ==tenant-a", "entry 1 of the tokens setting: each token must be written "
                             "'token=tenant', with one '='"),
    ("tok-a=tenant-a,tok-b=tenant=b", "entry 2 of the tokens setting: each token"),
    # Which tenant abc stands for would be the last entry's, silently.
    ("abc=tenant-a,abc=tenant-b", "entry 2 of the tokens setting repeats the token of entry 1"),
    ("abc=tenant-a,abc=tenant-a", "repeats the token"),
    ("@{tmp}/repeated", "line 3 of {tmp}/repeated repeats the token of line 1"),
], ids=["directory", "no-token-in-file", "malformed-file", "no-tenant", "base64-padding",
        "two-separators", "repeated-token", "repeated-entry", "repeated-in-file"])
def test_an_unusable_token_setting_fails_closed(tmp_path, setting, message):
    (tmp_path / "only-comments").write_text("# nobody\n\n   \n# tok=tenant\n")
    (tmp_path / "malformed").write_text("good=tenant\nno-separator-here\n")
    (tmp_path / "repeated").write_text("abc=tenant-a\n\nabc=tenant-b\n")
    with pytest.raises(RuntimeError) as refused:
        start_server(tmp_path, _NEVER_STARTED_UID_BASE, tokens=setting.format(tmp=tmp_path))
    assert "exited with 2" in str(refused.value)
    assert message.format(tmp=tmp_path) in str(refused.value)
    for token in ("abc", "dG9rZW4tYQ", "no-separator-here"):  # the error never shows a token
        assert token not in str(refused.value)


# -- an open server -----------------------------------------------------------------------------
def test_an_open_server_needs_no_token(server):
    with _client(server) as http:
        created = http.post("/sessions", json={})
        assert created.status_code == 201, created.text
        session_id = created.json()["session_id"]
        try:
            assert http.get(f"/sessions/{session_id}").status_code == 200
            assert http.post(f"/sessions/{session_id}/exec", json=PRINT_ONE).status_code == 200
            assert http.get(f"/sessions/{session_id}/files/list").status_code == 200
            assert http.get("/metrics").status_code == 200
            assert "www-authenticate" not in created.headers
        finally:
            assert http.delete(f"/sessions/{session_id}").status_code == 204
