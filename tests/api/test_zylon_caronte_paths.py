"""What Zylon's and Caronte's documents promise over HTTP, beyond the core APIs.

- Zylon's Workspace thread endpoints: a thread is a container. They cover
  upload (with and without ``path``), a raw put, and a download by sandbox
  path, under the operator's download settings. Files sit under ``/api/gpt``
  as well as at the root.
- Caronte's limits: an upload over the cap is a 400 before the body is
  buffered, on ``POST /v1/files`` and the multipart ``POST
  /v1/containers/:id/files``. Zylon's scoped upload keeps its 413.
- Caronte's soft delete: the container goes, and its run history stays
  readable.

All of it runs against real ``shoal serve`` processes.
"""

from __future__ import annotations

import json
import socket
import time
import uuid

import httpx
import pytest

OUTPUTS = "/mnt/user-data/outputs"
UPLOADS = "/mnt/user-data/uploads"
CAP = 64 * 1024


@pytest.fixture(scope="module")
def zylon(server_factory):
    return server_factory(pool_size=1, max_file_bytes=CAP)


@pytest.fixture
def http(zylon):
    with zylon.client() as client:
        yield client


def _thread() -> str:
    return f"thread-{uuid.uuid4().hex[:12]}"


def _produce(http: httpx.Client, thread: str, name: str, text: str) -> None:
    session = http.post("/sessions", json={"container": thread})
    assert session.status_code == 201, session.text
    session_id = session.json()["session_id"]
    try:
        ran = http.post(f"/sessions/{session_id}/exec", json={"tool": "bash_code_execution", "input": {
            "command": f"printf '{text}' > {OUTPUTS}/{name} && cat {UPLOADS}/notes/todo.txt"}})
        assert ran.status_code == 200, ran.text
        assert ran.json()["result_block"]["content"]["stdout"] == "buy milk", ran.text
    finally:
        http.delete(f"/sessions/{session_id}")


# -- thread endpoints ------------------------------------------------------------------------------
def test_a_threads_files_go_in_and_out_by_the_documented_paths(http):
    thread = _thread()
    base = f"/api/v1/app/thread/{thread}"
    # Upload with a path: under uploads/ at that key.
    placed = http.post(f"{base}/upload-file", files={"file": ("ignored.txt", b"buy milk")},
                       data={"path": "notes/todo.txt"})
    assert placed.status_code == 201, placed.text
    assert placed.json()["path"] == f"{UPLOADS}/notes/todo.txt"
    assert placed.json()["scope"]["id"] == thread
    # Without one: at the file's own name.
    plain = http.post(f"{base}/upload-file", files={"file": ("data.csv", b"a,b\n1,2\n")})
    assert plain.status_code == 201 and plain.json()["path"] == f"{UPLOADS}/data.csv"
    # Raw bytes at a key.
    raw = http.put(f"{base}/put-file/raw/blob.bin", content=b"\x00\x01\x02")
    assert raw.status_code == 201 and raw.json()["path"] == f"{UPLOADS}/raw/blob.bin"
    # The thread's sandbox sees them, and makes a file of its own.
    _produce(http, thread, "answer.txt", "42")
    generated = http.get(f"{base}/download-file", params={"path": f"{OUTPUTS}/answer.txt"})
    assert generated.status_code == 200 and generated.content == b"42"
    uploaded = http.get(f"{base}/download-file", params={"path": f"{UPLOADS}/raw/blob.bin"})
    assert uploaded.status_code == 200 and uploaded.content == b"\x00\x01\x02"
    # The same files through Zylon's Files API, and under its /api/gpt prefix.
    listed = http.get("/api/gpt/v1/files", params={"scope_id": thread}).json()["data"]
    assert {item["path"] for item in listed} == {
        f"{UPLOADS}/notes/todo.txt", f"{UPLOADS}/data.csv", f"{UPLOADS}/raw/blob.bin",
        f"{OUTPUTS}/answer.txt"}


def test_thread_downloads_refuse_what_is_not_there(http):
    thread = _thread()
    base = f"/api/v1/app/thread/{thread}"
    assert http.get(f"{base}/download-file", params={"path": f"{OUTPUTS}/x"}).status_code == 404
    http.put(f"{base}/put-file/a.txt", content=b"a")
    missing = http.get(f"{base}/download-file", params={"path": f"{OUTPUTS}/none.txt"})
    assert missing.status_code == 404 and "detail" in missing.json()
    relative = http.get(f"{base}/download-file", params={"path": "a.txt"})
    assert relative.status_code == 400
    escaping = http.get(f"{base}/download-file", params={"path": "/etc/passwd"})
    assert escaping.status_code in (403, 404), escaping.text
    assert b"root:" not in escaping.content
    assert http.put(f"{base}/put-file/../../etc/x", content=b"x").status_code in (400, 404, 422)


@pytest.mark.parametrize("refused, allowed, env", [
    (OUTPUTS, UPLOADS, {"SHOAL_DOWNLOAD_GENERATED": "false"}),
    (UPLOADS, OUTPUTS, {"SHOAL_DOWNLOAD_UPLOADED": "false"}),
])
def test_the_operator_decides_which_downloads_a_thread_serves(server_factory, refused, allowed,
                                                               env):
    server = server_factory(pool_size=1, env=env)
    thread = _thread()
    base = f"/api/v1/app/thread/{thread}"
    with server.client() as http:
        assert http.post(f"{base}/upload-file", files={"file": ("t.txt", b"buy milk")},
                         data={"path": "notes/todo.txt"}).status_code == 201
        _produce(http, thread, "answer.txt", "42")
        paths = {OUTPUTS: f"{OUTPUTS}/answer.txt", UPLOADS: f"{UPLOADS}/notes/todo.txt"}
        no = http.get(f"{base}/download-file", params={"path": paths[refused]})
        assert no.status_code == 403 and "disabled" in no.json()["detail"], no.text
        yes = http.get(f"{base}/download-file", params={"path": paths[allowed]})
        assert yes.status_code == 200, yes.text
        assert yes.content == {OUTPUTS: b"42", UPLOADS: b"buy milk"}[allowed], yes.content


# -- Caronte's upload cap -------------------------------------------------------------------------
def _raw_post(url: str, path: str, headers: dict[str, str], first_bytes: bytes) -> tuple[int, dict]:
    """Send headers and only the first bytes of a body whose declared length is far
    larger: the answer must come without the rest (nothing buffered)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{head}\r\n".encode() + first_bytes)
        conn.settimeout(30)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                _header(data, b"content-length") or 0):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1] or b"{}")


def _header(data: bytes, name: bytes) -> bytes | None:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def test_caronte_uploads_over_the_cap_are_400_before_the_body_is_read(zylon, http):
    container = http.post("/v1/containers", json={"name": "capped"}).json()["id"]
    boundary = "capboundary"
    start = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
             f"filename=\"big.bin\"\r\n\r\n").encode()
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}",
               "Content-Length": str(50 * 1024 * 1024)}
    for path in ("/v1/files", f"/v1/containers/{container}/files"):
        status, body = _raw_post(zylon.url, path, headers, start + b"x" * 1024)
        assert status == 400, (path, body)
        assert "cap" in body["error"]["message"] and body["error"]["param"] == "file", body
    # Declared small but sent large (chunked): still a 400 in Caronte's dialect.
    big = b"x" * (CAP + 1)
    for path in ("/v1/files", f"/v1/containers/{container}/files"):
        answer = http.post(path, files={"file": ("big.bin", big)}, data={"purpose": "user_data"})
        assert answer.status_code == 400, (path, answer.text)
    # At the cap, both accept.
    fits = b"y" * CAP
    assert http.post("/v1/files", files={"file": ("fits.bin", fits)},
                     data={"purpose": "user_data"}).status_code == 200
    assert http.post(f"/v1/containers/{container}/files",
                     files={"file": ("fits.bin", fits)}).status_code == 200


def test_zylons_scoped_upload_over_the_cap_keeps_its_413(http):
    answer = http.post("/v1/files", params={"scope_id": _thread()},
                       files={"file": ("big.bin", b"x" * (CAP + 1))})
    assert answer.status_code == 413 and "detail" in answer.json()


# -- Caronte's soft delete ------------------------------------------------------------------------
def _run(http: httpx.Client, container: str, code: str) -> dict:
    response = http.post("/v1/code-execution/runs",
                         json={"language": "python", "code": code, "container": container})
    assert response.status_code == 200, response.text
    events = [json.loads(line[len("data: "):]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    return events[-1]


def test_deleting_a_container_keeps_its_run_history(http):
    container = http.post("/v1/containers", json={"name": "history"}).json()["id"]
    done = _run(http, container, "open('/mnt/data/out.txt', 'w').write('x'); print('kept')")
    run_id = done["runId"]
    deleted = http.delete(f"/v1/containers/{container}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert http.get(f"/v1/containers/{container}").status_code == 404
    assert container not in {c["id"] for c in http.get("/v1/containers").json()["data"]}
    # The run's record outlives its container.
    record = http.get(f"/v1/code-execution/runs/{run_id}")
    assert record.status_code == 200, record.text
    assert record.json()["stdout"] == "kept\n" and record.json()["container_id"] == container
    replay = http.get(f"/v1/code-execution/runs/{run_id}/events")
    assert replay.status_code == 200 and "run.completed" in replay.text
    # Its files went with it.
    assert http.get(f"/v1/containers/{container}/files").status_code == 404


# -- the runtime, as served -------------------------------------------------------------------------
def test_the_runtime_is_served_as_the_pinned_lists_say(http):
    from shoal.sandbox import catalog

    served = http.get("/v1/runtime")
    assert served.status_code == 200, served.text
    body = served.json()
    pinned = {library.name: library.version for library in catalog.libraries()}
    assert {lib["name"]: lib["version"] for lib in body["python"]["libraries"]} == pinned
    promised = {lib["name"] for lib in body["python"]["libraries"] if lib["promised"]}
    assert promised == set(catalog.PROMISED)
    assert {tool["command"] for tool in body["tools"]} >= {
        "unzip", "unrar", "7z", "7zip", "bc", "rg", "fd", "sqlite3", "jq", "pdftoppm",
        "wkhtmltopdf", "java"}
    assert all(tool["available"] for tool in body["tools"]), [
        tool["command"] for tool in body["tools"] if not tool["available"]]
    assert body["javascript"]["version"] == catalog.bun_version()
    assert body["network"] == {"egress": False, "model_api": False}
