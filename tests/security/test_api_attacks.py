"""Attacks through the HTTP API that tests/api does not already cover.

tests/api/test_protocol_errors.py covers ``..``, absolute paths, percent- and
double-encoding, NUL, backslashes, look-alikes and long paths on the session file
routes, planted links, oversized uploads, malformed exec bodies and a huge
``timeout_seconds``; tests/api/test_auth.py covers missing and wrong tokens and
another tenant's sessions; tests/api/test_container_files.py covers bad keys,
oversized uploads and another tenant's scope ids. This module extends that to the
other dialects and to what those files leave out:

| attack | test | what contains it |
| --- | --- | --- |
| encoded / double-encoded / overlong-UTF-8 / look-alike / backslash / NUL traversal in the path segment of every container file route, and in ``path=`` / ``scope_id=`` | test_encoded_traversal_in_every_file_route | route matching on decoded segments, ``path_for_key``, ``parse_path``, O_NOFOLLOW walks |
| file ids that decode to host paths, ``..`` paths, links to /etc, /etc/shadow or a host canary | (same) | ids decode to sandbox paths that must lie in the mounts |
| a NUL byte inside a base64 file id | test_a_nul_byte_in_a_file_id_is_refused_on_the_session_route, ..._on_the_container_routes | 400 on the session route (it was a 500: fixed); 404 on the container routes |
| keys with a component over NAME_MAX, URLs and query strings of 100 KB | test_very_long_keys_paths_and_urls | ENAMETOOLONG (400), the HTTP parser (4xx or hang-up) |
| a 6 000-byte key of short components | test_a_key_longer_than_a_path_may_be_is_refused | 400 (it was accepted, 3 000 nested directories: fixed) |
| Unicode look-alikes and backslashes in keys and uploaded file names | test_lookalike_and_backslash_keys_stay_inside_the_container | literal names inside uploads; last component of a file name |
| a path flipped between a file and a link to /etc/shadow (or the host canary), a directory flipped with a link to /etc, while the test downloads, lists and uploads 200+ times | test_a_link_swapped_in_between_check_and_use | per-component ``openat`` with O_NOFOLLOW: never a host byte |
| hard links planted by code to host files, uploads, outputs | test_hard_links_planted_by_code | EXDEV in the kernel; only the session's own links are served |
| a 50 MB JSON body on exec, POST /sessions, POST /v1/containers | test_oversized_json_bodies_are_survived | answered, server healthy afterwards |
| a 5 MB ``code`` / ``command`` (over the channel's 4 MiB frame) | test_code_over_the_frame_cap_is_a_client_error | 413 (it was a 500: fixed) |
| malformed multipart on /v1/files and /v1/containers/{id}/files | test_malformed_multipart_on_the_file_apis | 4xx, nothing written |
| a NUL byte in an uploaded file's name: scoped upload | test_a_nul_in_an_uploaded_file_name_is_refused_for_a_scope | ``path_for_key``: 400 |
| the same on the Containers upload, and a tenant upload so named then attached (file_id, file_ids) or downloaded | test_a_nul_in_an_uploaded_file_name_is_refused_or_harmless | 422 at the door (it was a 500 or a dropped connection: fixed) |
| huge ``timeout_seconds`` on bash, huge lifetimes and TTLs | test_huge_timeouts_and_lifetimes_are_clamped | clamped to the ceilings, or 422 |
| guessing session, container and file ids; near-misses of a real id | test_guessed_ids_find_nothing | 128-bit random ids, exact lookup |
| another tenant's container and upload ids on every container route, attach by id, a session on its container id | test_another_tenants_containers_and_uploads_are_invisible | tenant in every lookup |
| 100 KB / 1 MB Authorization, NUL and 8-bit bytes in it, 2 000 headers | test_header_abuse_is_a_client_error | 401 / 4xx, never 500 |
| request smuggling: Content-Length and Transfer-Encoding (or two lengths, or an obfuscated Transfer-Encoding) disagreeing on where a request ends, a second request hidden behind | test_conflicting_framing_is_refused_and_smuggles_nothing | the HTTP parser: one 400, connection closed, nothing run |
| file names with control characters (CR LF, ESC, DEL) planted by code, then downloaded | test_control_characters_in_a_file_name_do_not_break_the_download | headers carry printable ASCII only (there was no response at all: fixed) |
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlsplit

import httpx
import pytest

from tests.security.helpers import execute, leaked, new_session, raw_request, run_ok

WS, OUT, UP = "/home/agent/workspace", "/mnt/user-data/outputs", "/mnt/user-data/uploads"
CLIENT_ERRORS = {400, 403, 404, 405, 413, 414, 422, 431}


def file_id(path: str) -> str:
    return base64.urlsafe_b64encode(path.encode("utf-8", "surrogateescape")).decode().rstrip("=")


def _digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def host_files(canary) -> Iterator[None]:
    """Host files that no request may change; checked when the module ends."""
    watched = ["/etc/shadow", "/etc/passwd", str(canary.path)]
    before = {path: _digest(path) for path in watched}
    yield
    assert {path: _digest(path) for path in watched} == before
    assert not Path("/etc/evil").exists()


@pytest.fixture(scope="module")
def traps(security_server, canary, host_files) -> Iterator[dict]:
    """A container (and a session on it) whose code planted links, a FIFO and real files."""
    scope = f"sec-traps-{secrets.token_hex(4)}"
    with httpx.Client(base_url=security_server.url, timeout=60) as http:
        assert http.put("/v1/files/keep.txt", params={"scope_id": scope},
                        content=b"upload-content\n").status_code == 201
        session = new_session(http, container=scope)
        run_ok(http, session, (
            f"cd {OUT} && echo container-content > real.txt && ln -s /etc/shadow link-shadow && "
            f"ln -s {canary.path} link-canary && ln -s /etc etcdir && ln -s / rootdir && mkfifo fifo && "
            f"cd {WS} && echo session-content > real.txt && ln -s /etc/shadow link-shadow && "
            f"ln -s {canary.path} link-canary && ln -s /etc etcdir"), tool="bash")
        yield {"scope": scope, "session": session}
        http.delete(f"/sessions/{session}")
        http.delete(f"/v1/containers/{scope}")


# -- traversal in every file route ------------------------------------------------------------------
def _segments(canary: str) -> list[str]:
    """Path segments as sent on the wire, nothing re-encoded on the way."""
    encoded = [
        "%2e%2e", "%2e%2e%2f%2e%2e%2fetc%2fpasswd", "..%2f..%2f..%2fetc%2fshadow",
        "%2e%2e/%2e%2e/etc/shadow", ".%2e/.%2e/etc/passwd", "%252e%252e%252fetc%252fpasswd",
        "%25252e%25252e%25252fetc", "..%5c..%5cetc%5cpasswd", "%5cetc%5cshadow",
        "%c0%ae%c0%ae%c0%afetc%c0%afpasswd", "%e0%80%ae%e0%80%ae/etc/passwd",
        "%e2%80%a5%2fetc%2fpasswd", "%ef%bc%8e%ef%bc%8e%2fetc%2fshadow", "%00", "a%00b",
        "keep.txt%00.png", "%2fetc%2fshadow", "%2f%2fetc%2fshadow", "~root%2f.bashrc",
        "%ff%fe", "%",
    ]
    paths = [
        "/etc/shadow", "/etc/passwd", canary, "/proc/self/environ", "/proc/1/root/etc/shadow",
        f"{UP}/../../../etc/shadow", f"{OUT}/../../../etc/passwd", f"{WS}/../../../etc/shadow",
        f"{UP}/../outputs/link-shadow", f"{OUT}/link-shadow", f"{OUT}/link-canary",
        f"{OUT}/etcdir/shadow", f"{OUT}/etcdir/passwd", f"{OUT}/rootdir/etc/shadow",
        f"{WS}/link-shadow", f"{WS}/link-canary", f"{WS}/etcdir/shadow", f"{OUT}/fifo",
        f"{OUT}/", f"{OUT}/.", f"{UP}", "/mnt/user-data", "/", f"{UP}/keep.txt/..",
        f"{OUT}/real.txt/../link-shadow", f"{OUT}//..//..//etc//shadow",
    ]
    ids = [file_id(path) for path in paths]
    ids += [quote(base64.b64encode(b"/etc/shadow").decode(), safe=""),  # padded, standard alphabet
            file_id("/etc/shadow") + "%3D%3D", "x" * 10_000]
    return encoded + ids


ROUTES = {
    "files-meta": ("GET", "/v1/files/{x}?scope_id={scope}"),
    "files-content": ("GET", "/v1/files/{x}/content?scope_id={scope}"),
    "files-head": ("HEAD", "/v1/files/{x}?scope_id={scope}"),
    "files-delete": ("DELETE", "/v1/files/{x}?scope_id={scope}"),
    "files-put-key": ("PUT", "/v1/files/{x}?scope_id={scope}"),
    "files-post-path": ("POST", "/v1/files?scope_id={scope}&path={x}"),
    "files-scope-id": ("GET", "/v1/files?scope_id={x}"),
    "containers-meta": ("GET", "/v1/containers/{scope}/files/{x}"),
    "containers-content": ("GET", "/v1/containers/{scope}/files/{x}/content"),
    "containers-delete": ("DELETE", "/v1/containers/{scope}/files/{x}"),
    "container-id": ("GET", "/v1/containers/{x}/files"),
    "session-file": ("GET", "/sessions/{session}/files?path={x}"),
    "session-list": ("GET", "/sessions/{session}/files/list?path={x}"),
}
_BOUNDARY = "sec-boundary-3f1c"


def _multipart(filename: str = "x.bin", data: bytes = b"EVIL\n") -> bytes:
    return (f"--{_BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"{filename}\"\r\nContent-Type: application/octet-stream\r\n\r\n").encode() \
        + data + f"\r\n--{_BOUNDARY}--\r\n".encode()


@pytest.mark.parametrize("route", ROUTES)
def test_encoded_traversal_in_every_file_route(security_server, traps, canary, host_secrets, route):
    method, template = ROUTES[route]
    failures, answered = [], 0
    for segment in _segments(str(canary.path)):
        target = template.format(x=segment, scope=traps["scope"], session=traps["session"])
        headers, body = {}, b""
        if method == "PUT":
            body = b"EVIL\n"
        elif method == "POST":
            headers = {"Content-Type": f"multipart/form-data; boundary={_BOUNDARY}"}
            body = _multipart()
        response = raw_request(security_server.url, method, target, headers, body)
        if response is None:
            failures.append(f"{segment[:60]}: connection closed without an answer")
            continue
        answered += 1
        if leaked(response.raw, host_secrets):
            failures.append(f"{segment[:60]}: HOST CONTENT {response.status}")
        elif response.status >= 500:
            failures.append(f"{segment[:60]}: {response.status} {response.body[:200]!r}")
        elif response.status in (200, 201):
            problem = _success_problem(route, response)
            if problem:
                failures.append(f"{segment[:60]}: {problem}")
        elif response.status not in CLIENT_ERRORS:
            failures.append(f"{segment[:60]}: unexpected {response.status}")
    assert answered >= 40
    assert not failures, failures
    # The container still holds exactly what it held (plus, for writes, names inside it).
    with httpx.Client(base_url=security_server.url, timeout=30) as http:
        keep = http.get(f"/v1/files/{file_id(UP + '/keep.txt')}/content",
                        params={"scope_id": traps["scope"]})
        assert keep.content == b"upload-content\n"
        real = http.get(f"/sessions/{traps['session']}/files", params={"path": f"{OUT}/real.txt"})
        assert real.content == b"container-content\n"


def _success_problem(route: str, response) -> str | None:
    """A 2xx is acceptable only for a write that landed inside the container, or an
    empty listing of a scope id that names no container of this tenant."""
    if route in ("files-put-key", "files-post-path"):
        written = json.loads(response.body)
        if not written["path"].startswith((UP + "/", OUT + "/")) or "/../" in written["path"]:
            return f"written at {written['path']}"
        return None
    if route == "files-scope-id":
        body = json.loads(response.body)
        return None if body.get("data") == [] or "object" in body else f"listed {body}"
    return f"answered {response.status}: {response.body[:200]!r}"


def test_a_nul_byte_in_a_file_id_is_refused_on_the_session_route(http, session_id):
    for path in (f"{WS}/a\x00b", f"{OUT}/x\x00/../../etc/shadow", f"{WS}/real.txt\x00.png"):
        response = http.get(f"/sessions/{session_id}/files", params={"path": file_id(path)})
        assert response.status_code in (400, 403, 404), (path, response.status_code, response.text)


def test_a_nul_byte_in_a_file_id_is_refused_on_the_container_routes(http, traps):
    scope = traps["scope"]
    for path in (f"{UP}/keep.txt\x00", f"{OUT}/real.txt\x00.png", f"{OUT}/\x00"):
        fid = file_id(path)
        for url, params in ((f"/v1/files/{fid}", {"scope_id": scope}),
                            (f"/v1/files/{fid}/content", {"scope_id": scope}),
                            (f"/v1/containers/{scope}/files/{fid}/content", {})):
            response = http.get(url, params=params)
            assert response.status_code in (400, 403, 404), (url, response.status_code, response.text)


def test_very_long_keys_paths_and_urls(security_server, http, traps, session_id):
    scope = traps["scope"]
    # Keys with one component over NAME_MAX.
    for key in ("k" * 5000, "d/" + "k" * 300, "d/e/" + "k" * 256):
        response = http.put(f"/v1/files/{key}", params={"scope_id": scope}, content=b"x")
        assert response.status_code in (400, 414), (len(key), response.status_code, response.text[:200])
    # URLs past what the HTTP parser takes: a clean 4xx or a closed connection, never a 5xx.
    for target in (f"/sessions/{session_id}/files?path=" + "a" * 100_000,
                   f"/v1/files/{'b' * 100_000}?scope_id={scope}",
                   "/v1/files?scope_id=" + "c" * 100_000,
                   f"/v1/containers/{'d' * 100_000}"):
        response = raw_request(security_server.url, "GET", target)
        assert response is None or response.status in CLIENT_ERRORS, response.status
    listing = http.get(f"/sessions/{session_id}/files/list")
    assert listing.status_code == 200 and listing.json()["files"] == []
    assert http.get("/health").status_code == 200


def test_a_key_longer_than_a_path_may_be_is_refused(http, security_server):
    scope = f"sec-deep-{secrets.token_hex(4)}"
    try:
        response = http.put(f"/v1/files/{'/'.join(['d'] * 3000)}", params={"scope_id": scope},
                            content=b"deep")
        assert response.status_code in (400, 414), (response.status_code, response.text[:200])
    finally:
        http.delete(f"/v1/containers/{scope}")


def test_lookalike_and_backslash_keys_stay_inside_the_container(http, traps):
    scope = traps["scope"]
    inside = {"\u2025/etc/passwd": f"{UP}/\u2025/etc/passwd",
              "\uff0e\uff0e/x.txt": f"{UP}/\uff0e\uff0e/x.txt",
              "%2e%2e/x.txt": f"{UP}/%2e%2e/x.txt",
              "outputs/\u2024\u2024/y.txt": f"{OUT}/\u2024\u2024/y.txt"}
    try:
        for key, expected in inside.items():
            response = http.put(f"/v1/files/{quote(key, safe='/')}", params={"scope_id": scope},
                                content=b"lookalike\n")
            assert response.status_code == 201, (key, response.text)
            assert response.json()["path"] == expected
        for key in ("..\\..\\etc\\passwd", "a\\b", "outputs\\..\\..\\x"):
            response = http.put(f"/v1/files/{quote(key)}", params={"scope_id": scope}, content=b"x")
            assert response.status_code == 400, (key, response.text)
        # A traversal in an uploaded file's *name* keeps its last component only.
        for name in ("..\\..\\etc\\evil", "../../../etc/evil", "C:\\Windows\\evil"):
            response = http.post("/v1/files", params={"scope_id": scope},
                                 files={"file": (name, b"named\n")})
            assert response.status_code == 201, (name, response.text)
            assert response.json()["path"] == f"{UP}/evil", response.json()
            response = http.post(f"/v1/containers/{scope}/files", files={"file": (name, b"named\n")})
            assert response.status_code == 200, (name, response.text)
            assert response.json()["path"] == f"{UP}/evil", response.json()
        keys = {item["key"] for item in http.get("/v1/files", params={"scope_id": scope,
                                                                      "limit": 1000}).json()["data"]}
        assert {"evil", "keep.txt", "\u2025/etc/passwd", "%2e%2e/x.txt"} <= keys, keys
    finally:
        for path in (*inside.values(), f"{UP}/evil"):
            http.delete(f"/v1/files/{file_id(path)}", params={"scope_id": scope})


# -- a link swapped in between check and use -------------------------------------------------------
FLIPPER = r'''
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
os.chdir(sys.argv[1])
canary = sys.argv[2]
for name, target, directory in (("x", "/etc/shadow", False), ("c", canary, False), ("d", "/etc", True)):
    if directory:
        os.mkdir(name)
        for leaf in ("shadow", "passwd", "gshadow"):
            open(f"{name}/{leaf}", "w").write("session-content\n")
    else:
        open(name, "w").write("session-content\n")
    os.symlink(target, name + ".link")
open("ready", "w").write("1")
end = time.monotonic() + 90
names = [(n.encode(), (n + ".link").encode()) for n in ("x", "c", "d")]
while time.monotonic() < end:
    for a, b in names:
        libc.renameat2(-100, a, -100, b, 2)  # RENAME_EXCHANGE: atomic swap of file and link
'''


def _start_flipper(http: httpx.Client, session: str, directory: str, canary: str) -> None:
    run_ok(http, session, f"mkdir -p {directory} && cat > /tmp/flip.py <<'EOF'\n{FLIPPER}\nEOF\n"
                          f"(python3 /tmp/flip.py {directory} {canary} >/dev/null 2>&1 &) ; "
                          f"for i in $(seq 600); do test -e {directory}/ready && break; sleep 0.05; done; "
                          f"test -e {directory}/ready", tool="bash")


def _check_read(response: httpx.Response, host_secrets, outcomes: dict, name: str) -> None:
    assert response.status_code < 500, response.text
    assert not leaked(response.content, host_secrets), f"{name}: HOST CONTENT served"
    if response.status_code == 200:
        assert response.content == b"session-content\n", response.content[:200]
    else:
        assert response.status_code in (400, 403, 404), (name, response.status_code, response.text)
    outcomes.setdefault(name, set()).add(response.status_code)


def test_a_link_swapped_in_between_check_and_use(security_server, http, canary, host_secrets):
    scope = f"sec-flip-{secrets.token_hex(4)}"
    session = new_session(http, container=scope)
    try:
        _start_flipper(http, session, f"{WS}/flip", str(canary.path))
        _start_flipper(http, session, f"{OUT}/flip", str(canary.path))
        outcomes: dict[str, set[int]] = {}
        for n in range(70):
            for name in ("x", "c", "d/shadow"):
                _check_read(http.get(f"/sessions/{session}/files", params={"path": f"flip/{name}"}),
                            host_secrets, outcomes, f"session {name}")
            for name in ("x", "d/passwd"):
                fid = file_id(f"{OUT}/flip/{name}")
                _check_read(http.get(f"/v1/files/{fid}/content", params={"scope_id": scope}),
                            host_secrets, outcomes, f"files {name}")
                _check_read(http.get(f"/v1/containers/{scope}/files/{fid}/content"),
                            host_secrets, outcomes, f"containers {name}")
            if n % 3 == 0:
                listed = http.get(f"/sessions/{session}/files/list", params={"path": "flip"})
                assert listed.status_code in (200, 403, 404), listed.text
                if listed.status_code == 200:
                    names = {entry["path"] for entry in listed.json()["files"]}
                    # The regular file and the real directory swap names with their links.
                    allowed = {f"flip/{n}" for n in ("x", "x.link", "c", "c.link", "ready")}
                    allowed |= {f"flip/{d}/{leaf}" for d in ("d", "d.link")
                                for leaf in ("shadow", "passwd", "gshadow")}
                    allowed |= {f"flip/{d}/evil-{k}" for d in ("d", "d.link") for k in range(n + 1)}
                    assert names <= allowed, names - allowed
                container = http.get("/v1/files", params={"scope_id": scope, "limit": 1000})
                assert container.status_code == 200 and not leaked(container.text, host_secrets)
                upload = http.post(f"/sessions/{session}/files", data={"path": f"flip/d/evil-{n}"},
                                   files={"file": ("e", b"EVIL\n")})
                assert upload.status_code in (201, 403, 404), upload.text
        # Control: the swaps really happened while we read, so the test could have failed.
        assert {200, 403} <= outcomes["session x"] | outcomes["session c"], outcomes
        assert len(set().union(*outcomes.values())) >= 2, outcomes
        assert not list(Path("/etc").glob("evil-*"))
    finally:
        http.delete(f"/sessions/{session}")
        http.delete(f"/v1/containers/{scope}")


# -- hard links ---------------------------------------------------------------------------------------
def test_hard_links_planted_by_code(http, traps, host_secrets):
    session, scope = traps["session"], traps["scope"]
    made = run_ok(http, session, (
        f"cd {WS} && for src in /etc/passwd /etc/hosts /usr/bin/python3 /opt/shoal/agent/shoal_agent/main.py "
        f"{UP}/keep.txt {OUT}/real.txt /tmp; do ln $src hl-$(basename $src) 2>&1; done; "
        f"ln {UP}/keep.txt {OUT}/hl-keep.txt 2>&1; ln real.txt hl-own.txt && echo own-linked; "
        f"ln {OUT}/real.txt {OUT}/hl-out.txt && echo out-linked; true"), tool="bash")
    assert "own-linked" in made["stdout"] and "out-linked" in made["stdout"], made
    assert made["stdout"].count("Invalid cross-device link") >= 6, made["stdout"]
    for name in ("hl-passwd", "hl-hosts", "hl-python3", "hl-main.py", "hl-keep.txt", "hl-real.txt"):
        response = http.get(f"/sessions/{session}/files", params={"path": name})
        assert response.status_code == 404, (name, response.status_code, response.text)
    keep = http.get(f"/v1/files/{file_id(OUT + '/hl-keep.txt')}/content", params={"scope_id": scope})
    assert keep.status_code == 404
    own = http.get(f"/sessions/{session}/files", params={"path": "hl-own.txt"})
    assert own.status_code == 200 and own.content == b"session-content\n"
    out = http.get(f"/v1/files/{file_id(OUT + '/hl-out.txt')}/content", params={"scope_id": scope})
    assert out.status_code == 200 and out.content == b"container-content\n"
    assert not leaked(own.content + out.content, host_secrets)


# -- bodies ------------------------------------------------------------------------------------------------
def _fifty_megabytes(body: dict) -> bytes:
    return json.dumps({**body, "padding": "p" * (50 * 1024 * 1024)}).encode()


def test_oversized_json_bodies_are_survived(security_server, http, session_id):
    cases = {
        f"/sessions/{session_id}/exec": {"tool": "code_execution", "input": {"code": "print(7)"}},
        "/sessions": {},
        "/v1/containers": {"name": "big"},
    }
    for url, body in cases.items():
        # A server that choked on the body would not answer in time (the client gives up
        # after 120 s) or would no longer answer /health; how fast it answers is bench/'s.
        with httpx.Client(base_url=security_server.url, timeout=120) as own:
            response = own.post(url, content=_fifty_megabytes(body),
                                headers={"content-type": "application/json"})
        assert response.status_code < 500, (url, response.status_code, response.text[:300])
        if response.status_code in (200, 201):
            created = response.json()
            if url == "/sessions":
                http.delete(f"/sessions/{created['session_id']}")
            elif url == "/v1/containers":
                http.delete(f"/v1/containers/{created['id']}")
            else:
                assert created["result_block"]["content"]["stdout"] == "7\n"
        else:
            assert response.status_code in (413, 422), response.status_code
        assert httpx.get(f"{security_server.url}/health", timeout=30).status_code == 200
    assert run_ok(http, session_id, "print('alive')")["stdout"] == "alive\n"


@pytest.mark.parametrize("tool", ["python", "bash"])
def test_code_over_the_frame_cap_is_a_client_error(http, session_id, tool):
    source = ("#" if tool == "python" else ": ") + "x" * (5 * 1024 * 1024)
    answer = execute(http, session_id, source, tool=tool)
    assert answer.status in (413, 422), (answer.status, answer.text[:200])


MALFORMED_MULTIPART = {
    "no-boundary": ("multipart/form-data", _multipart()),
    "empty-boundary": ("multipart/form-data; boundary=", _multipart()),
    "boundary-mismatch": ("multipart/form-data; boundary=other", _multipart()),
    "truncated": (f"multipart/form-data; boundary={_BOUNDARY}", _multipart()[:-20]),
    "headers-never-end": (f"multipart/form-data; boundary={_BOUNDARY}",
                          f"--{_BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"".encode()),
    "long-header-line": (f"multipart/form-data; boundary={_BOUNDARY}",
                         (f"--{_BOUNDARY}\r\nX-Long: " + "h" * 200_000 + "\r\n").encode() + _multipart()),
    "two-files": (f"multipart/form-data; boundary={_BOUNDARY}",
                  _multipart()[:-len(f"--{_BOUNDARY}--\r\n")] + _multipart()[0:]),
    "a-thousand-fields": (f"multipart/form-data; boundary={_BOUNDARY}",
                          b"".join(f"--{_BOUNDARY}\r\nContent-Disposition: form-data; name=\"f{n}\""
                                   f"\r\n\r\nv\r\n".encode() for n in range(1000)) + _multipart()),
    "no-name": (f"multipart/form-data; boundary={_BOUNDARY}",
                f"--{_BOUNDARY}\r\nContent-Disposition: form-data\r\n\r\nx\r\n--{_BOUNDARY}--\r\n".encode()),
    "lf-only": (f"multipart/form-data; boundary={_BOUNDARY}", _multipart().replace(b"\r\n", b"\n")),
    "dotdot-filename": (f"multipart/form-data; boundary={_BOUNDARY}", _multipart(filename="..")),
    "garbage": (f"multipart/form-data; boundary={_BOUNDARY}", b"\x00\xff" * 5000),
}


@pytest.mark.parametrize("route", ["files-scope", "files-tenant", "containers"])
def test_malformed_multipart_on_the_file_apis(security_server, http, traps, route):
    scope = traps["scope"]
    url = {"files-scope": f"/v1/files?scope_id={scope}", "files-tenant": "/v1/files",
           "containers": f"/v1/containers/{scope}/files"}[route]
    before = http.get("/v1/files", params={"scope_id": scope, "limit": 1000}).json()["data"]
    uploads_before = http.get("/v1/files", params={"limit": 10_000}).json()["data"]
    wrong = []
    for case, (content_type, body) in MALFORMED_MULTIPART.items():
        response = raw_request(security_server.url, "POST", url, {"Content-Type": content_type}, body)
        status = None if response is None else response.status
        if status is None or status >= 500 or (status < 400 and case not in ("two-files", "lf-only")):
            wrong.append(f"{case}: {status} {response.body[:200] if response else b''!r}")
    assert not wrong, wrong
    after = http.get("/v1/files", params={"scope_id": scope, "limit": 1000}).json()["data"]
    assert {item["key"] for item in after} - {item["key"] for item in before} <= {"x.bin"}
    uploads_after = http.get("/v1/files", params={"limit": 10_000}).json()["data"]
    for item in uploads_after:
        if item not in uploads_before:
            assert item["filename"] == "x.bin", item
            http.delete(f"/v1/files/{item['id']}")
    http.delete(f"/v1/files/{file_id(UP + '/x.bin')}", params={"scope_id": scope})


def _upload_raw(url: str, target: str, filename: str):
    return raw_request(url, "POST", target,
                       {"Content-Type": f"multipart/form-data; boundary={_BOUNDARY}"},
                       _multipart(filename=filename, data=b"nul\n"))


def test_a_nul_in_an_uploaded_file_name_is_refused_for_a_scope(security_server, traps):
    response = _upload_raw(security_server.url, f"/v1/files?scope_id={traps['scope']}", "a\x00b.txt")
    assert response is not None and response.status in (400, 422), response and response.body


NUL_NAME_ROUTES = ["containers-upload", "tenant-upload-then-download", "tenant-upload-then-attach",
                   "tenant-upload-then-create-with"]


@pytest.mark.parametrize("route", NUL_NAME_ROUTES)
def test_a_nul_in_an_uploaded_file_name_is_refused_or_harmless(security_server, http, route):
    url = security_server.url
    container = http.post("/v1/containers", json={"name": "nul"}).json()["id"]
    try:
        if route == "containers-upload":
            response = _upload_raw(url, f"/v1/containers/{container}/files", "a\x00b.txt")
            assert response is not None and response.status in (400, 422), response and response.status
            return
        response = _upload_raw(url, "/v1/files", "a\x00b.txt")
        assert response is not None and response.status < 500, response and response.status
        if response.status >= 400:
            return  # refused at the door: nothing more to try
        upload = json.loads(response.body)["id"]
        try:
            if route == "tenant-upload-then-download":
                answer = raw_request(url, "GET", f"/v1/files/{upload}/content")
                assert answer is not None, "the server hung up without answering"
                assert answer.status == 200
            elif route == "tenant-upload-then-attach":
                answer = http.post(f"/v1/containers/{container}/files", json={"file_id": upload})
                assert answer.status_code in (200, 400, 422), (answer.status_code, answer.text)
            else:
                answer = http.post("/v1/containers", json={"name": "attach", "file_ids": [upload]})
                assert answer.status_code in (200, 400, 422), (answer.status_code, answer.text)
                if answer.status_code == 200:
                    _quietly(url, "DELETE", f"/v1/containers/{answer.json()['id']}")
        finally:
            _quietly(url, "DELETE", f"/v1/files/{upload}")
    finally:
        _quietly(url, "DELETE", f"/v1/containers/{container}")


def _quietly(url: str, method: str, path: str) -> None:
    """Clean up on a fresh connection (after a 500 the server drops the test's own)."""
    try:
        with httpx.Client(base_url=url, timeout=30) as own:
            own.request(method, path)
    except httpx.HTTPError:
        pass


# -- timeouts and lifetimes --------------------------------------------------------------------------------
def test_huge_timeouts_and_lifetimes_are_clamped(http, session_id):
    for timeout in (2**63, 2**64, 10**18):
        answer = execute(http, session_id, "echo clamped", tool="bash", timeout=timeout)
        assert answer.status == 200, answer.text
        assert answer.content["stdout"] == "clamped\n"
    raw = http.post(f"/sessions/{session_id}/exec", content=(
        b'{"tool": "bash_code_execution", "input": {"command": "echo x"}, "timeout_seconds": 1'
        + b"0" * 5000 + b"}"), headers={"content-type": "application/json"})
    assert raw.status_code in (200, 422), raw.text[:300]
    for body in ({"idle_timeout_seconds": 10**400}, {"max_lifetime_seconds": 10**400},
                 {"idle_timeout_seconds": 2**64, "max_lifetime_seconds": 2**64}):
        response = http.post("/sessions", json=body)
        assert response.status_code in (201, 422), response.text
        if response.status_code == 201:
            handle = response.json()
            http.delete(f"/sessions/{handle['session_id']}")
            assert handle["idle_timeout_seconds"] <= 3600
            assert handle["max_lifetime_seconds"] <= 86400
            assert handle["expires_at"] < time.time() + 86400 + 60
    for minutes in (10**400, 2**64, -1, 0, 241):
        response = http.post("/v1/containers", json={"name": "ttl", "expires_after": {
            "anchor": "last_active_at", "minutes": minutes}})
        assert response.status_code in (400, 422), (minutes, response.status_code, response.text)


# -- id guessing and other tenants ------------------------------------------------------------------------
def test_guessed_ids_find_nothing(security_server, http, session_id):
    run_ok(http, session_id, "open('mine.txt', 'w').write('mine')")
    guesses = [secrets.token_hex(16) for _ in range(40)]
    near = [session_id.upper(), session_id[:-1], session_id + "0", session_id[1:] + session_id[0],
            session_id[:-1] + ("0" if session_id[-1] != "0" else "1"), f"{session_id}%00",
            f"{session_id}%0a", f"%20{session_id}", f"{session_id}%2f..", f"..%2f{session_id}"]
    wrong = []
    for guess in guesses + near:
        for method, target, body in (("GET", f"/sessions/{guess}", b""),
                                     ("POST", f"/sessions/{guess}/exec",
                                      b'{"tool": "code_execution", "input": {"code": "print(1)"}}'),
                                     ("GET", f"/sessions/{guess}/files/list", b""),
                                     ("GET", f"/sessions/{guess}/files?path=mine.txt", b"")):
            headers = {"Content-Type": "application/json"} if body else {}
            response = raw_request(security_server.url, method, target, headers, body)
            if response is None or response.status not in (404, 405, 400, 422):
                wrong.append(f"{method} {target}: {response and response.status}")
            elif b"mine" in response.body:
                wrong.append(f"{method} {target}: served the session's file")
    for guess in [f"cnt_{secrets.token_hex(12)}" for _ in range(20)]:
        for target in (f"/v1/containers/{guess}", f"/v1/containers/{guess}/files"):
            response = http.get(target)
            if response.status_code != 404:
                wrong.append(f"GET {target}: {response.status_code}")
    for guess in [f"file-{secrets.token_hex(12)}" for _ in range(20)]:
        for target in (f"/v1/files/{guess}", f"/v1/files/{guess}/content"):
            response = http.get(target)
            if response.status_code != 404:
                wrong.append(f"GET {target}: {response.status_code}")
    assert not wrong, wrong[:20]
    # The real id still works: the guesses changed nothing.
    assert http.get(f"/sessions/{session_id}/files", params={"path": "mine.txt"}).content == b"mine"


@pytest.fixture(scope="module")
def tenants(security_server_factory):
    server = security_server_factory(tokens="tok-a=tenant-a,tok-b=tenant-b", pool_size=1,
                                     max_sessions=8)
    with server.client("tok-a") as as_a, server.client("tok-b") as as_b:
        yield server, as_a, as_b


def test_another_tenants_containers_and_uploads_are_invisible(tenants):
    server, as_a, as_b = tenants
    container = as_a.post("/v1/containers", json={"name": "a-private"}).json()["id"]
    secret = as_a.post(f"/v1/containers/{container}/files",
                       files={"file": ("secret.txt", b"tenant-a secret\n")}).json()
    upload = as_a.post("/v1/files", files={"file": ("a.txt", b"tenant-a upload\n")},
                       data={"purpose": "user_data"}).json()
    mine = as_b.post("/v1/containers", json={"name": "b-own"}).json()["id"]
    attempts = {
        "get container": as_b.get(f"/v1/containers/{container}"),
        "list files": as_b.get(f"/v1/containers/{container}/files"),
        "get file": as_b.get(f"/v1/containers/{container}/files/{secret['id']}"),
        "content": as_b.get(f"/v1/containers/{container}/files/{secret['id']}/content"),
        "upload into": as_b.post(f"/v1/containers/{container}/files",
                                 files={"file": ("evil.txt", b"from b")}),
        "attach a's upload into it": as_b.post(f"/v1/containers/{container}/files",
                                               json={"file_id": upload["id"]}),
        "attach a's upload to b's own": as_b.post(f"/v1/containers/{mine}/files",
                                                  json={"file_id": upload["id"]}),
        "create with a's upload": as_b.post("/v1/containers", json={"name": "stolen",
                                                               "file_ids": [upload["id"]]}),
        "upload meta": as_b.get(f"/v1/files/{upload['id']}"),
        "upload content": as_b.get(f"/v1/files/{upload['id']}/content"),
        "delete file": as_b.delete(f"/v1/containers/{container}/files/{secret['id']}"),
        "delete upload": as_b.delete(f"/v1/files/{upload['id']}"),
        "delete container": as_b.delete(f"/v1/containers/{container}"),
        "scope files": as_b.get("/v1/files", params={"scope_id": container}),
    }
    wrong = {name: (r.status_code, r.text[:200]) for name, r in attempts.items()
             if r.status_code != 404 or b"tenant-a" in r.content}
    assert not wrong, wrong
    listed = as_b.get("/v1/containers", params={"limit": 100}).json()["data"]
    assert container not in {item["id"] for item in listed}
    assert upload["id"] not in {item["id"] for item in as_b.get("/v1/files").json()["data"]}
    # A session of b's on a's container id gets a container of b's own, empty.
    response = as_b.post("/sessions", json={"container": container})
    assert response.status_code in (201, 404, 422), response.text
    if response.status_code == 201:
        session = response.json()["session_id"]
        seen = run_ok(as_b, session, f"ls -A {UP} {OUT}; cat {UP}/secret.txt 2>&1; true", tool="bash")
        as_b.delete(f"/sessions/{session}")
        as_b.delete(f"/v1/containers/{container}")  # b's own container of that name
        assert "tenant-a" not in seen["stdout"] and "secret.txt\n" not in seen["stdout"], seen
    # a's things are all still there.
    assert as_a.get(f"/v1/containers/{container}/files/{secret['id']}/content").content \
        == b"tenant-a secret\n"
    assert as_a.get(f"/v1/files/{upload['id']}/content").content == b"tenant-a upload\n"
    for client, cid in ((as_a, container), (as_b, mine)):
        client.delete(f"/v1/containers/{cid}")
    as_a.delete(f"/v1/files/{upload['id']}")


def test_header_abuse_is_a_client_error(tenants):
    server, as_a, _ = tenants
    url = server.url
    target = "/v1/containers"
    cases = {
        "100KB-token": {"Authorization": "Bearer " + "a" * 100_000},
        "1MB-token": {"Authorization": "Bearer " + "a" * 1_000_000},
        "100KB-scheme": {"Authorization": "B" * 100_000 + " tok-a"},
        "valid-token-then-garbage": {"Authorization": "Bearer tok-a" + "\t" * 10 + "x"},
        "latin1-bytes": {"Authorization": "Bearer tok-\xe9"},
        "nul": {"Authorization": "Bearer tok-a\x00"},
        "control-chars": {"Authorization": "Bearer \x01\x02\x7f"},
        "100KB-cookie": {"Cookie": "c=" + "v" * 100_000},
        "2000-headers": {f"X-H{n}": "v" * 50 for n in range(2000)},
    }
    # Bytes the HTTP parser itself refuses may be a 400 (or a hang-up); everything else
    # reaches the token check and is exactly a 401.
    parser_may_refuse = {"nul", "control-chars", "2000-headers", "1MB-token"}
    wrong = []
    for name, headers in cases.items():
        response = raw_request(url, "GET", target, headers)
        if name in parser_may_refuse and (response is None or response.status in (400, 431)):
            continue
        if response is None or response.status != 401:
            wrong.append(f"{name}: {response and response.status} {response and response.body[:200]!r}")
        elif response.headers.get("www-authenticate") != "Bearer":
            wrong.append(f"{name}: 401 without WWW-Authenticate")
    assert not wrong, wrong
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    assert as_a.get("/v1/containers").status_code == 200  # the real token still works


# -- request smuggling: framing the server and a proxy could read differently ---------------------------
def _exchange(base_url: str, data: bytes, timeout: float = 30) -> bytes:
    """Send exactly ``data`` on one connection; everything the server sent until it closed."""
    parts = urlsplit(base_url)
    received = []
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(data)
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            received.append(chunk)
    return b"".join(received)


def _post_head(extra: str) -> bytes:
    return ("POST /v1/containers HTTP/1.1\r\nHost: shoal\r\nAuthorization: Bearer tok-a\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()


def _smuggled(name: str) -> bytes:
    """A complete second request, hidden in the first one's body by one reading of it
    (the last on its connection: the server closes once it has answered it)."""
    body = json.dumps({"name": name}).encode()
    return _post_head(f"Content-Length: {len(body)}\r\nConnection: close\r\n") + body


# Each first request is framed so that Content-Length and Transfer-Encoding (or two
# lengths) disagree on where it ends; read one way, the smuggled request follows it.
SMUGGLING = {
    "CL.TE": lambda hidden: _post_head(f"Content-Length: {5 + len(hidden)}\r\n"
                                       "Transfer-Encoding: chunked\r\n") + b"0\r\n\r\n" + hidden,
    "TE.CL": lambda hidden: _post_head("Transfer-Encoding: chunked\r\nContent-Length: 4\r\n")
    + b"%x\r\n" % len(hidden) + hidden + b"\r\n0\r\n\r\n",
    "TE with a space": lambda hidden: _post_head(f"Content-Length: {5 + len(hidden)}\r\n"
                                                 "Transfer-Encoding : chunked\r\n")
    + b"0\r\n\r\n" + hidden,
    "TE xchunked": lambda hidden: _post_head(f"Content-Length: {5 + len(hidden)}\r\n"
                                             "Transfer-Encoding: xchunked\r\n") + b"0\r\n\r\n" + hidden,
    "TE chunked, identity": lambda hidden: _post_head(
        f"Content-Length: {5 + len(hidden)}\r\nTransfer-Encoding: chunked, identity\r\n")
    + b"0\r\n\r\n" + hidden,
    "TE twice": lambda hidden: _post_head(
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n"
        f"Content-Length: {5 + len(hidden)}\r\n") + b"0\r\n\r\n" + hidden,
    "two lengths": lambda hidden: _post_head(
        f"Content-Length: 2\r\nContent-Length: {2 + len(hidden)}\r\n") + b"{}" + hidden,
}


def _container_names(client: httpx.Client) -> set[str]:
    return {item["name"] for item in client.get("/v1/containers", params={"limit": 100}).json()["data"]}


@pytest.mark.parametrize("framing", SMUGGLING)
def test_conflicting_framing_is_refused_and_smuggles_nothing(tenants, framing):
    """Either reading of the framing would let a proxy and the server disagree on where a
    request ends. The server refuses the request outright: exactly one answer, a 400,
    the connection closed; neither the request nor the one hidden in it ran."""
    server, as_a, _ = tenants
    name = f"smuggled-{secrets.token_hex(4)}"
    answer = _exchange(server.url, SMUGGLING[framing](_smuggled(name)))
    assert answer.count(b"HTTP/1.1 ") == 1, answer[:2000]
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split()[1] == b"400", answer[:500]
    assert b"\r\nconnection: close\r\n" in rest.lower(), answer[:500]
    assert name not in _container_names(as_a)


def test_control_a_pipelined_request_is_served(tenants):
    """Control for the test above: the same hidden request, framed honestly after a
    first one on a keep-alive connection, is answered and runs, so the answer count
    and the container listing would see a smuggled request that ran."""
    server, as_a, _ = tenants
    name = f"pipelined-{secrets.token_hex(4)}"
    before = _container_ids(as_a)
    answer = _exchange(server.url, _post_head("Content-Length: 2\r\n") + b"{}" + _smuggled(name))
    made = _container_ids(as_a) - before
    for container_id in made:
        as_a.delete(f"/v1/containers/{container_id}")
    assert answer.count(b"HTTP/1.1 200 ") == 2, answer[:2000]
    assert len(made) == 2, made


def _container_ids(client: httpx.Client) -> set[str]:
    return {item["id"] for item in client.get("/v1/containers", params={"limit": 100}).json()["data"]}


# -- control characters in names planted by code ---------------------------------------------------------
@pytest.fixture(scope="module")
def odd_names(security_server) -> Iterator[dict]:
    scope = f"sec-names-{secrets.token_hex(4)}"
    with httpx.Client(base_url=security_server.url, timeout=60) as http:
        session = new_session(http, container=scope)
        run_ok(http, session, "\n".join(
            f"open({f'{OUT}/{name}'!r}, 'w').write('named\\n')"
            for name in ("a\r\nX-Injected: yes\r\nb.txt", "c\x1bd.txt", "e\x7ff.txt", "g\nh.txt")))
        yield {"scope": scope, "session": session}
        http.delete(f"/sessions/{session}")
        http.delete(f"/v1/containers/{scope}")


ODD_NAME_ROUTES = {
    "session-crlf": ("GET", "/sessions/{session}/files?path={id}", "a\r\nX-Injected: yes\r\nb.txt"),
    "session-esc": ("GET", "/sessions/{session}/files?path={id}", "c\x1bd.txt"),
    "session-del": ("GET", "/sessions/{session}/files?path={id}", "e\x7ff.txt"),
    "session-lf": ("GET", "/sessions/{session}/files?path={id}", "g\nh.txt"),
    "files-content-crlf": ("GET", "/v1/files/{id}/content?scope_id={scope}", "a\r\nX-Injected: yes\r\nb.txt"),
    "files-head-crlf": ("HEAD", "/v1/files/{id}?scope_id={scope}", "a\r\nX-Injected: yes\r\nb.txt"),
    "containers-content-crlf": ("GET", "/v1/containers/{scope}/files/{id}/content",
                                "a\r\nX-Injected: yes\r\nb.txt"),
}


@pytest.mark.parametrize("route", ODD_NAME_ROUTES)
def test_control_characters_in_a_file_name_do_not_break_the_download(security_server, odd_names,
                                                                    route):
    method, template, name = ODD_NAME_ROUTES[route]
    target = template.format(session=odd_names["session"], scope=odd_names["scope"],
                             id=file_id(f"{OUT}/{name}"))
    response = raw_request(security_server.url, method, target)
    assert response is not None, "the server hung up without answering"
    assert response.status == 200, response.status
    assert "x-injected" not in response.headers
