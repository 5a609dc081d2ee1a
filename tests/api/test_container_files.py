"""Zylon's container Files API (``/v1/files?scope_id=...``) over real HTTP.

Every route and parameter of "Work with files" in the Zylon code-execution
tool's documentation, checked against a real server: uploads land in
``/mnt/user-data/uploads/`` (read-only to code), ``outputs/`` keys and files
the code writes land in ``/mnt/user-data/outputs/`` (downloadable), ids are
the unpadded base64url of the sandbox path, listings page both ways, and a
container is visible to its tenant only. What the code sees is checked from a
session attached to the container (``POST /sessions {"container": ...}``).

The servers here run on a run directory of their own: container volumes are
mounted under ``<run_dir>/volumes`` keyed by tenant and container id only, and
a server that stops unmounts every volume there, so servers sharing a run
directory disturb each other (see test_container_durability.py).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving import Server

UPLOADS = "/mnt/user-data/uploads"
OUTPUTS = "/mnt/user-data/outputs"
MAX_FILE_BYTES = 1024 * 1024
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")
PNG = b"\x89PNG\r\n\x1a\n" + os.urandom(512)


# -- helpers ------------------------------------------------------------------------------------
def file_id(sandbox_path: str) -> str:
    return base64.urlsafe_b64encode(sandbox_path.encode()).decode().rstrip("=")


def new_scope() -> str:
    return f"zf-{uuid.uuid4().hex[:12]}"


def _no_server_errors(response: httpx.Response) -> None:
    # 507 (quota full) is a deliberate answer; any other 5xx is a bug.
    response.read()
    assert response.status_code < 500 or response.status_code == 507, (
        f"{response.request.method} {response.request.url} answered "
        f"{response.status_code}: {response.text[:500]}")


def make_client(server: Server, token: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=60,
                        event_hooks={"response": [_no_server_errors]})


def upload(http: httpx.Client, scope: str, name: str, data: bytes, path: str | None = None) -> dict:
    params = {"scope_id": scope}
    if path is not None:
        params["path"] = path
    response = http.post("/v1/files", params=params, files={"file": (name, data)})
    assert response.status_code == 201, response.text
    return response.json()


def put(http: httpx.Client, scope: str, key: str, data: bytes) -> dict:
    response = http.put(f"/v1/files/{key}", params={"scope_id": scope}, content=data)
    assert response.status_code == 201, response.text
    return response.json()


def listing(http: httpx.Client, scope: str, **params) -> dict:
    response = http.get("/v1/files", params={"scope_id": scope, **params})
    assert response.status_code == 200, response.text
    return response.json()


def listed_ids(http: httpx.Client, scope: str) -> list[str]:
    return [item["id"] for item in listing(http, scope, limit=1000)["data"]]


def content_of(http: httpx.Client, scope: str, fid: str) -> bytes:
    response = http.get(f"/v1/files/{fid}/content", params={"scope_id": scope})
    assert response.status_code == 200, response.text
    return response.content


def assert_error(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, (response.status_code, response.text)
    if response.request.method != "HEAD":
        body = response.json()
        # Zylon's Files API answers {"detail"}; the Containers API speaks OpenAI's {"error"}.
        detail = body["detail"] if "/v1/containers" not in response.request.url.path else (
            body["error"]["message"])
        assert detail, response.text


@contextmanager
def attached(http: httpx.Client, scope: str) -> Iterator[Callable[[str], dict]]:
    """A session attached to the container; yields ``bash(command) -> result content``."""
    response = http.post("/sessions", json={"container": scope})
    assert response.status_code == 201, response.text
    assert response.json()["container_id"] == scope
    session_id = response.json()["session_id"]

    def bash(command: str) -> dict:
        answer = http.post(f"/sessions/{session_id}/exec",
                           json={"tool": "bash_code_execution", "input": {"command": command}})
        assert answer.status_code == 200, answer.text
        return answer.json()["result_block"]["content"]

    try:
        yield bash
    finally:
        http.delete(f"/sessions/{session_id}")


def _unmount_under(directory: Path) -> None:
    with open("/proc/self/mountinfo") as handle:
        points = [line.split()[4] for line in handle]
    for point in sorted((p for p in points if p.startswith(f"{directory}/")), key=len, reverse=True):
        subprocess.run(["umount", point], capture_output=True)


# -- servers ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_dir() -> Iterator[Path]:
    path = Path("/run/shoal-test") / f"files-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    path.mkdir(mode=0o711, parents=True)
    yield path
    _unmount_under(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def files_server(server_factory, run_dir) -> Iterator[Server]:
    server = server_factory(run_dir=run_dir, max_file_bytes=MAX_FILE_BYTES, max_sessions=8,
                            pool_size=1)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tenants_server(server_factory, run_dir) -> Iterator[Server]:
    server = server_factory(run_dir=run_dir, tokens="a=tenant-a,b=tenant-b", max_sessions=8,
                            pool_size=1)
    yield server
    server.stop()


@pytest.fixture
def http(files_server) -> Iterator[httpx.Client]:
    with make_client(files_server) as client:
        yield client


@pytest.fixture
def scope() -> str:
    return new_scope()


# -- upload ------------------------------------------------------------------------------------
def test_upload_answers_the_zylon_file_object(http, scope):
    data = b"month,revenue\n2026-07,100\n2026-08,120\n"
    before = time.time()
    body = upload(http, scope, "sales.csv", data)

    # The documentation's own example id, and the rule behind it.
    assert body["id"] == "L21udC91c2VyLWRhdGEvdXBsb2Fkcy9zYWxlcy5jc3Y"
    assert body["id"] == file_id(f"{UPLOADS}/sales.csv")
    assert "=" not in body["id"]
    assert body["type"] == "file"
    assert body["filename"] == "sales.csv"
    assert body["mime_type"] == "text/csv"
    assert body["size_bytes"] == len(data)
    assert body["downloadable"] is False
    assert body["etag"] == hashlib.md5(data).hexdigest()
    assert body["scope"] == {"id": scope, "type": "session"}
    assert body["namespace"] == "session"
    assert RFC3339.match(body["created_at"]), body["created_at"]
    created = datetime.fromisoformat(body["created_at"]).timestamp()
    assert before - 5 <= created <= time.time() + 5

    with attached(http, scope) as bash:
        result = bash(f"cat {UPLOADS}/sales.csv")
        assert result["return_code"] == 0, result
        assert result["stdout"].encode() == data


def test_upload_with_path_creates_parent_folders(http, scope):
    data = os.urandom(3000)
    body = upload(http, scope, "q3.xlsx", data, path="data/2026/q3.xlsx")
    assert body["id"] == file_id(f"{UPLOADS}/data/2026/q3.xlsx")
    assert body["filename"] == "q3.xlsx"
    assert body["size_bytes"] == 3000
    assert body["downloadable"] is False

    with attached(http, scope) as bash:
        result = bash(f"ls {UPLOADS}/data/2026 && md5sum {UPLOADS}/data/2026/q3.xlsx")
        assert result["return_code"] == 0, result
        assert result["stdout"].splitlines()[0] == "q3.xlsx"
        assert result["stdout"].splitlines()[1].split()[0] == hashlib.md5(data).hexdigest()
    assert content_of(http, scope, body["id"]) == data


def test_upload_to_an_existing_key_overwrites_it(http, scope):
    first = upload(http, scope, "notes.txt", b"first version\n", path="docs/notes.txt")
    second = upload(http, scope, "whatever-name.txt", b"second, longer version\n",
                    path="docs/notes.txt")
    assert second["id"] == first["id"] == file_id(f"{UPLOADS}/docs/notes.txt")
    assert second["size_bytes"] == len(b"second, longer version\n")
    assert second["etag"] == hashlib.md5(b"second, longer version\n").hexdigest() != first["etag"]

    assert listed_ids(http, scope) == [first["id"]]  # one file, not two
    assert content_of(http, scope, first["id"]) == b"second, longer version\n"
    with attached(http, scope) as bash:
        assert bash(f"cat {UPLOADS}/docs/notes.txt")["stdout"] == "second, longer version\n"


def test_outputs_key_lands_in_outputs_and_is_downloadable(http, scope):
    body = upload(http, scope, "chart.png", PNG, path="outputs/charts/chart.png")
    assert body["id"] == file_id(f"{OUTPUTS}/charts/chart.png")
    assert body["downloadable"] is True
    assert body["mime_type"] == "image/png"

    with attached(http, scope) as bash:
        result = bash(f"md5sum < {OUTPUTS}/charts/chart.png")
        assert result["stdout"].split()[0] == hashlib.md5(PNG).hexdigest()
        assert bash(f"ls -A {UPLOADS}")["stdout"] == ""  # nothing in uploads
    assert content_of(http, scope, body["id"]) == PNG


def test_put_raw_body_at_a_key(http, scope):
    settings = b'{"currency": "EUR", "quarters": [1, 2, 3]}'
    response = http.put("/v1/files/config/settings.json", params={"scope_id": scope},
                        content=settings, headers={"Content-Type": "application/json"})
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["id"] == file_id(f"{UPLOADS}/config/settings.json")
    assert body["filename"] == "settings.json"
    assert body["mime_type"] == "application/json"
    assert body["size_bytes"] == len(settings)
    assert body["etag"] == hashlib.md5(settings).hexdigest()
    assert body["downloadable"] is False
    assert body["scope"] == {"id": scope, "type": "session"}

    report = put(http, scope, "outputs/report.txt", b"done\n")
    assert report["id"] == file_id(f"{OUTPUTS}/report.txt")
    assert report["downloadable"] is True

    with attached(http, scope) as bash:
        result = bash(f"cat {UPLOADS}/config/settings.json; echo; cat {OUTPUTS}/report.txt")
        assert result["stdout"] == settings.decode() + "\ndone\n"


def _raw_put_answers(http: httpx.Client) -> dict[str, float]:
    """How many raw puts the server has answered, by status, as /metrics counts them."""
    answers = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if (sample.name == "shoal_http_requests_total"
                    and sample.labels.get("method") == "PUT"
                    and sample.labels.get("route") == "/v1/files/{key:path}"):
                answers[sample.labels["status"]] = sample.value
    return answers


def test_a_put_whose_client_hangs_up_mid_body_stores_nothing(files_server, http, scope):
    kept = put(http, scope, "kept.txt", b"kept\n")
    logged = len(files_server.log())
    before = _raw_put_answers(http)
    address = urlsplit(files_server.url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(f"PUT /v1/files/half.bin?scope_id={scope} HTTP/1.1\r\n"
                     f"Host: {address.netloc}\r\nTransfer-Encoding: chunked\r\n"
                     "Content-Type: application/octet-stream\r\n\r\n".encode()
                     + b"10000\r\n" + b"h" * 0x10000 + b"\r\n")
    # The server answers the abandoned put once it sees the hang-up; wait for that.
    deadline = time.monotonic() + 30
    while (answers := _raw_put_answers(http)) == before:
        assert time.monotonic() < deadline, "the abandoned put was never answered"
        time.sleep(0.05)
    new = {status: count - before.get(status, 0) for status, count in answers.items()
           if count != before.get(status, 0)}
    assert list(new.values()) == [1] and int(next(iter(new))) < 500, new
    log = files_server.log()[logged:]
    assert "unhandled error" not in log and "ClientDisconnect" not in log, log
    assert listed_ids(http, scope) == [kept["id"]]
    assert not [p for p in _files_on_disk(http, scope) if "half" in p or ".shoal-" in p]


# -- key validation ------------------------------------------------------------------------
# The deepest key a listing reaches (64 levels under uploads) and the longest
# whose sandbox path an id can name (4096 bytes).
DEEPEST_KEY = "/".join(["d"] * 63 + ["f"])
LONGEST_KEY = "/".join(["x" * 254] * 15 + ["x" * (4096 - len(UPLOADS) - 1 - 15 * 255)])
# Keys as the client means them, and how each is spelled in a PUT URL (httpx would
# resolve a literal '..' segment before sending, so it is percent-encoded).
BAD_KEYS = {
    "../x": "%2E%2E/x",
    "/abs": "/abs",
    "a/../b": "a/%2E%2E/b",
    "dir/": "dir/",
    "a//b": "a//b",
    "outputs": "outputs",
    "outputs/": "outputs/",
    "./x": "%2E/x",
    "": "",
    # Deeper than a listing walks, or a path longer than an id may name: the API
    # would write a file it could then neither list nor find by its id.
    DEEPEST_KEY + "/f": DEEPEST_KEY + "/f",
    LONGEST_KEY + "y": LONGEST_KEY + "y",
}


def _files_on_disk(http: httpx.Client, scope: str) -> list[str]:
    with attached(http, scope) as bash:
        result = bash("find /mnt/user-data /home/agent/workspace -mindepth 1 | sort")
        assert result["return_code"] == 0, result
        return result["stdout"].split()


@pytest.mark.parametrize("key", list(BAD_KEYS),
                         ids=[repr(k) if len(k) < 20 else f"{len(k)}-byte" for k in BAD_KEYS])
def test_invalid_keys_are_refused_and_nothing_is_written(http, scope, key):
    keep = upload(http, scope, "keep.txt", b"keep")
    before = _files_on_disk(http, scope)

    if key:  # POST with an empty path= falls back to the part's file name
        response = http.post("/v1/files", params={"scope_id": scope, "path": key},
                             files={"file": ("x", b"payload")})
        assert_error(response, 400)
    response = http.put(f"/v1/files/{BAD_KEYS[key]}", params={"scope_id": scope},
                        content=b"payload")
    assert_error(response, 400)

    assert listed_ids(http, scope) == [keep["id"]]
    assert _files_on_disk(http, scope) == before


def test_a_key_below_a_file_is_400_not_404(http, scope):
    """A 404 says the container is gone; a key that goes through a file is the
    key's fault, as one onto a directory is."""
    kept = put(http, scope, "a.txt", b"a")
    assert_error(http.put("/v1/files/a.txt/b.txt", params={"scope_id": scope}, content=b"b"), 400)
    assert_error(http.post("/v1/files", params={"scope_id": scope, "path": "a.txt/c/d"},
                           files={"file": ("d", b"d")}), 400)
    assert listed_ids(http, scope) == [kept["id"]]


def test_the_deepest_and_longest_keys_are_listed_and_found_by_id(http, scope):
    for key in (DEEPEST_KEY, LONGEST_KEY):
        stored = put(http, scope, key, b"far")
        assert stored["path"] == f"{UPLOADS}/{key}"
        assert len(stored["path"].encode()) <= 4096
        assert stored["id"] in listed_ids(http, scope)
        assert content_of(http, scope, stored["id"]) == b"far"
        response = http.delete(f"/v1/files/{stored['id']}", params={"scope_id": scope})
        assert response.status_code == 200, response.text


def test_invalid_container_id_is_refused(http):
    response = http.post("/v1/files", params={"scope_id": "../escape"},
                         files={"file": ("a.txt", b"a")})
    assert response.status_code in (400, 422), response.text
    assert response.json()["detail"]


# -- what the code sees ----------------------------------------------------------------------
def test_uploads_are_read_only_to_code_and_outputs_are_listed(http, scope):
    data = b"a,b\n1,2\n"
    uploaded = upload(http, scope, "data.csv", data)
    with attached(http, scope) as bash:
        touched = bash(f"touch {UPLOADS}/new.txt")
        assert touched["return_code"] != 0
        assert "Read-only file system" in touched["stderr"]
        for command in (f"echo tampered >> {UPLOADS}/data.csv",
                        f"echo tampered > {UPLOADS}/data.csv",
                        f"rm -f {UPLOADS}/data.csv",
                        f"mv {UPLOADS}/data.csv /home/agent/workspace/",
                        f"chmod 777 {UPLOADS}/data.csv",
                        f"mkdir {UPLOADS}/sub"):
            result = bash(command)
            assert result["return_code"] != 0, (command, result)
            # Read-only mount, and the uploads are root's besides: either refusal will do.
            assert re.search("Read-only file system|Permission denied", result["stderr"]), result
        python = bash(f"python3 -c \"open('{UPLOADS}/data.csv', 'w').write('x')\"")
        assert python["return_code"] != 0
        assert re.search("Read-only file system|Permission denied", python["stderr"]), python
        assert bash(f"cat {UPLOADS}/data.csv")["stdout"].encode() == data

        written = bash(
            "cd /mnt/user-data/outputs && printf 'month,total\\n' > summary.csv && "
            "mkdir -p plots && python3 -c \"import sys; sys.stdout.buffer.write("
            f"bytes.fromhex('{PNG.hex()}'))\" > plots/revenue.png && "
            "echo scratch > /home/agent/workspace/scratch.txt")
        assert written["return_code"] == 0, written

    assert content_of(http, scope, uploaded["id"]) == data
    files = {item["id"]: item for item in listing(http, scope)["data"]}
    assert set(files) == {uploaded["id"], file_id(f"{OUTPUTS}/summary.csv"),
                          file_id(f"{OUTPUTS}/plots/revenue.png")}  # workspace files are not listed
    assert files[uploaded["id"]]["downloadable"] is False
    png = files[file_id(f"{OUTPUTS}/plots/revenue.png")]
    assert png["downloadable"] is True
    assert (png["filename"], png["mime_type"], png["size_bytes"]) == ("revenue.png", "image/png", len(PNG))
    assert png["scope"] == {"id": scope, "type": "session"}
    assert RFC3339.match(png["created_at"])
    summary = files[file_id(f"{OUTPUTS}/summary.csv")]
    assert (summary["downloadable"], summary["mime_type"]) == (True, "text/csv")
    assert content_of(http, scope, png["id"]) == PNG


def test_files_move_both_ways_while_a_session_is_attached(http, scope):
    with attached(http, scope) as bash:
        assert bash(f"printf 'v1' > {OUTPUTS}/summary.csv")["return_code"] == 0
        first = {item["id"]: item for item in listing(http, scope)["data"]}
        summary = first[file_id(f"{OUTPUTS}/summary.csv")]
        assert summary["size_bytes"] == 2

        # An upload is visible at once to the running code ...
        upload(http, scope, "live.txt", b"uploaded while attached")
        put(http, scope, "outputs/from-api.txt", b"api")
        assert bash(f"cat {UPLOADS}/live.txt")["stdout"] == "uploaded while attached"
        # ... and an output put through the API belongs to the code like its own files.
        changed = bash(f"echo more >> {OUTPUTS}/from-api.txt && cat {OUTPUTS}/from-api.txt")
        assert changed["stdout"] == "apimore\n", changed

        # What the code rewrites or removes, the listing follows.
        assert bash(f"printf 'version two' > {OUTPUTS}/summary.csv")["return_code"] == 0
        now = {item["id"]: item for item in listing(http, scope)["data"]}
        assert now[summary["id"]]["size_bytes"] == len("version two")
        assert now[summary["id"]]["created_at"] == summary["created_at"]
        assert content_of(http, scope, summary["id"]) == b"version two"
        assert content_of(http, scope, file_id(f"{OUTPUTS}/from-api.txt")) == b"apimore\n"
        assert bash(f"rm {OUTPUTS}/summary.csv")["return_code"] == 0
        assert summary["id"] not in listed_ids(http, scope)
        assert_error(http.get(f"/v1/files/{summary['id']}", params={"scope_id": scope}), 404)


def test_an_etag_never_names_bytes_the_file_no_longer_holds(http, scope):
    """Code that rewrites an uploaded file in place, at the same size, leaves it
    with other bytes: its etag (the upload's md5) must not stay. The listing
    then says it does not know it, as for any file code wrote."""
    put(http, scope, "outputs/same.txt", b"aaaa")
    with attached(http, scope) as bash:
        assert bash(f"sleep 0.05; printf 'bbbb' > {OUTPUTS}/same.txt")["return_code"] == 0
        item = {i["id"]: i for i in listing(http, scope)["data"]}[file_id(f"{OUTPUTS}/same.txt")]
        assert item["size_bytes"] == 4
        assert item["etag"] in (None, hashlib.md5(b"bbbb").hexdigest()), item
        head = http.head(f"/v1/files/{item['id']}", params={"scope_id": scope})
        assert head.headers["x-file-etag"] in ("", hashlib.md5(b"bbbb").hexdigest())
        # A file no one touched keeps its etag; a new upload gets its own again.
        again = put(http, scope, "outputs/same.txt", b"cccc")
        assert again["etag"] == hashlib.md5(b"cccc").hexdigest()
        item = {i["id"]: i for i in listing(http, scope)["data"]}[file_id(f"{OUTPUTS}/same.txt")]
        assert item["etag"] == hashlib.md5(b"cccc").hexdigest()
        assert bash(f"cat {OUTPUTS}/same.txt")["stdout"] == "cccc"


def test_concurrent_puts_of_one_key_leave_the_etag_of_the_bytes_kept(http, scope):
    from concurrent.futures import ThreadPoolExecutor

    key = "outputs/raced.bin"
    fid = file_id(f"{OUTPUTS}/raced.bin")
    with ThreadPoolExecutor(2) as pool:
        for round_ in range(15):
            bodies = [bytes([65 + round_ % 26]) * 200_000, bytes([97 + round_ % 26]) * 200_000]
            answers = list(pool.map(lambda body: put(http, scope, key, body), bodies))
            assert {a["etag"] for a in answers} == {hashlib.md5(b).hexdigest() for b in bodies}
            kept = content_of(http, scope, fid)
            assert kept in bodies
            item = {i["id"]: i for i in listing(http, scope)["data"]}[fid]
            assert item["etag"] == hashlib.md5(kept).hexdigest(), round_


def test_a_file_code_wrote_past_the_cap_is_listed_described_and_deletable(http, scope):
    """The cap bounds what is uploaded and served, not what the code may write:
    such a file is listed, so its metadata is served and it can be deleted, by
    either API; only its bytes are refused (413)."""
    size = 2 * MAX_FILE_BYTES
    with attached(http, scope) as bash:
        assert bash(f"head -c {size} /dev/zero > {OUTPUTS}/big.bin")["return_code"] == 0
    fid = file_id(f"{OUTPUTS}/big.bin")
    assert {i["id"]: i for i in listing(http, scope)["data"]}[fid]["size_bytes"] == size
    params = {"scope_id": scope}
    response = http.get(f"/v1/files/{fid}", params=params)
    assert response.status_code == 200, response.text
    assert response.json()["size_bytes"] == size
    head = http.head(f"/v1/files/{fid}", params=params)
    assert (head.status_code, head.headers["x-file-size"]) == (200, str(size))
    assert_error(http.get(f"/v1/files/{fid}/content", params=params), 413)
    response = http.get(f"/v1/containers/{scope}/files/cfile_{fid}")
    assert response.status_code == 200, response.text
    assert response.json()["bytes"] == size
    assert_error(http.get(f"/v1/containers/{scope}/files/cfile_{fid}/content"), 413)

    response = http.delete(f"/v1/containers/{scope}/files/cfile_{fid}")
    assert response.status_code == 200, response.text
    assert fid not in listed_ids(http, scope)
    with attached(http, scope) as bash:
        assert bash(f"head -c {size} /dev/zero > {OUTPUTS}/big.bin")["return_code"] == 0
    response = http.delete(f"/v1/files/{fid}", params=params)
    assert response.status_code == 200, response.text
    with attached(http, scope) as bash:
        assert bash(f"ls -A {OUTPUTS}")["stdout"] == ""


@pytest.fixture(scope="module")
def large_files_server(server_factory, run_dir) -> Iterator[Server]:
    """Files past the 1 MiB that a download reads at once, which stream."""
    server = server_factory(run_dir=run_dir, max_file_bytes=64 * MAX_FILE_BYTES, max_sessions=4,
                            pool_size=1)
    yield server
    server.stop()


def test_a_file_being_written_is_never_listed_half_written(large_files_server, scope):
    """An upload's bytes are written under no name until they are whole: listed
    halfway (a temporary name, a partial size), they were recorded as a file of
    the container that vanished a moment later."""
    from concurrent.futures import ThreadPoolExecutor

    body = b"u" * (48 * MAX_FILE_BYTES)
    with make_client(large_files_server) as http, ThreadPoolExecutor(1) as pool:
        put(http, scope, "first.txt", b"1")
        for _ in range(4):
            writing = pool.submit(put, http, scope, "outputs/big.bin", body)
            seen = []
            while not writing.done():
                seen += [(item["key"], item["size_bytes"]) for item in listing(http, scope)["data"]]
            assert writing.result()["size_bytes"] == len(body)
            assert {key for key, _ in seen} <= {"first.txt", "outputs/big.bin"}, seen
            assert {size for key, size in seen if key == "outputs/big.bin"} <= {len(body)}, seen


def test_a_download_is_the_file_as_it_was_opened_while_code_appends(large_files_server, scope):
    """A download serves the bytes the file held when it was opened, as many as
    it declares: code appending meanwhile made it read on past its
    Content-Length, and the response was cut off (and past the cap, had the
    file been at it)."""
    size = 32 * MAX_FILE_BYTES + 12345  # not whole chunks: its last one is read after the append
    with make_client(large_files_server) as http, attached(http, scope) as bash:
        assert bash(f"head -c {size} /dev/zero > {OUTPUTS}/log.bin")["return_code"] == 0
        fid = file_id(f"{OUTPUTS}/log.bin")
        with large_files_server.client() as reader, reader.stream(
                "GET", f"/v1/files/{fid}/content", params={"scope_id": scope}) as response:
            assert response.status_code == 200
            assert response.headers["content-length"] == str(size)
            chunks = response.iter_bytes()
            body = next(chunks)
            # The server has sent what the socket holds, and waits for the reader.
            appended = bash(f"head -c {8 * MAX_FILE_BYTES} /dev/urandom >> {OUTPUTS}/log.bin")
            assert appended["return_code"] == 0
            body += b"".join(chunks)
        assert body == bytes(size)


def test_uploads_racing_listings_keep_their_etags(http, scope):
    """A listing that scanned the disk before an upload landed, and read the
    rows after, took the upload's row for a file gone (a new key's row was
    deleted) or rewrote it with the size and time it scanned (an overwritten
    key's): either way the etag its PUT answered was lost."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    with attached(http, scope) as bash:  # a listing long enough to be overlapped
        made = bash(f"mkdir {OUTPUTS}/many && cd {OUTPUTS}/many && seq 3000 | xargs touch")
        assert made["return_code"] == 0, made
    for i in range(30):
        put(http, scope, f"rewritten/{i}.txt", b"before")
    listing(http, scope)
    done = threading.Event()

    def keep_listing() -> None:
        while not done.is_set():
            listing(http, scope, limit=1)

    stored = {}
    with ThreadPoolExecutor(2) as pool:
        listers = [pool.submit(keep_listing) for _ in range(2)]
        try:
            for i in range(30):
                for key in (f"new/{i}.txt", f"rewritten/{i}.txt"):
                    body = f"{key} {i}".encode()
                    stored[put(http, scope, key, body)["id"]] = key, body
        finally:
            done.set()
        for lister in listers:
            lister.result()
    lost = {}
    for fid, (key, body) in stored.items():
        head = http.head(f"/v1/files/{fid}", params={"scope_id": scope})
        if head.headers["x-file-etag"] != hashlib.md5(body).hexdigest():
            lost[key] = head.headers["x-file-etag"]
        assert content_of(http, scope, fid) == body
    assert not lost, lost


# -- list ---------------------------------------------------------------------------------------
def test_list_is_sorted_by_creation_and_pages_both_ways(http, scope):
    ids = [upload(http, scope, f"f{i}.txt", f"file {i}".encode(), path=f"page/f{i}.txt")["id"]
           for i in range(7)]

    everything = listing(http, scope)
    assert [item["id"] for item in everything["data"]] == ids
    assert (everything["first_id"], everything["last_id"], everything["has_more"]) == (ids[0], ids[-1], False)
    stamps = [datetime.fromisoformat(item["created_at"]) for item in everything["data"]]
    assert stamps == sorted(stamps)

    # Forward, with after_id, to the end.
    seen, pages, after = [], [], None
    while True:
        params = {"limit": 3, **({"after_id": after} if after else {})}
        page = listing(http, scope, **params)
        page_ids = [item["id"] for item in page["data"]]
        assert (page["first_id"], page["last_id"]) == (page_ids[0], page_ids[-1])
        seen += page_ids
        pages.append(page_ids)
        if not page["has_more"]:
            break
        after = page["last_id"]
        assert len(pages) < 10, "pagination does not end"
    assert seen == ids
    assert pages == [ids[0:3], ids[3:6], ids[6:7]]

    # Backward, with before_id, from the last id.
    back = listing(http, scope, limit=3, before_id=ids[-1])
    assert [item["id"] for item in back["data"]] == ids[3:6]
    assert (back["first_id"], back["last_id"], back["has_more"]) == (ids[3], ids[5], True)
    back = listing(http, scope, limit=3, before_id=back["first_id"])
    assert [item["id"] for item in back["data"]] == ids[0:3]
    assert back["has_more"] is False

    # Past either end: an empty page.
    end = listing(http, scope, limit=3, after_id=ids[-1])
    assert (end["data"], end["first_id"], end["last_id"], end["has_more"]) == ([], None, None, False)
    start = listing(http, scope, limit=3, before_id=ids[0])
    assert (start["data"], start["has_more"]) == ([], False)


def test_a_page_after_a_deleted_item_goes_on_where_it_stood(http, scope):
    ids = [put(http, scope, f"p/{i}.txt", b"p")["id"] for i in range(6)]
    first = listing(http, scope, limit=2)
    for item in first["data"]:
        assert http.delete(f"/v1/files/{item['id']}", params={"scope_id": scope}).status_code == 200
    following = listing(http, scope, limit=2, after_id=first["last_id"])
    assert [item["id"] for item in following["data"]] == ids[2:4] and following["has_more"]
    http.delete(f"/v1/files/{ids[4]}", params={"scope_id": scope})
    back = listing(http, scope, limit=5, before_id=ids[4])
    assert [item["id"] for item in back["data"]] == ids[2:4] and not back["has_more"]
    # An id never handed out is still refused.
    never = file_id(f"{UPLOADS}/never")
    assert_error(http.get("/v1/files", params={"scope_id": scope, "after_id": never}), 400)


def test_list_limit_defaults_to_20_and_must_be_1_to_1000(http, scope):
    ids = [put(http, scope, f"many/{i:02d}.txt", b"x")["id"] for i in range(21)]
    page = listing(http, scope)
    assert [item["id"] for item in page["data"]] == ids[:20]
    assert page["has_more"] is True
    assert listing(http, scope, limit=1000)["has_more"] is False
    assert [item["id"] for item in listing(http, scope, limit=1)["data"]] == ids[:1]
    for bad in (0, 1001, -1):
        response = http.get("/v1/files", params={"scope_id": scope, "limit": bad})
        assert_error(response, 400)


def test_list_prefix_filters_by_key(http, scope):
    upload(http, scope, "a.csv", b"a", path="data/a.csv")
    q3 = upload(http, scope, "q3.xlsx", b"q3", path="data/2026/q3.xlsx")
    upload(http, scope, "database.txt", b"db", path="database.txt")
    upload(http, scope, "other.txt", b"o")
    upload(http, scope, "x.csv", b"x", path="outputs/data/x.csv")

    page = listing(http, scope, prefix="data/")
    assert [item["filename"] for item in page["data"]] == ["a.csv", "q3.xlsx"]
    assert listing(http, scope, prefix="data/2026/")["data"] == [q3]
    assert [i["filename"] for i in listing(http, scope, prefix="outputs/")["data"]] == ["x.csv"]
    assert listing(http, scope, prefix="nothing/")["data"] == []
    limited = listing(http, scope, prefix="data/", limit=1)
    assert [item["filename"] for item in limited["data"]] == ["a.csv"]
    assert limited["has_more"] is True


# -- one file -----------------------------------------------------------------------------------
def test_metadata_and_head(http, scope):
    data = b"id,name\n1,ada\n"
    uploaded = upload(http, scope, "people.csv", data)

    response = http.get(f"/v1/files/{uploaded['id']}", params={"scope_id": scope})
    assert response.status_code == 200, response.text
    assert response.json() == uploaded

    head = http.head(f"/v1/files/{uploaded['id']}", params={"scope_id": scope})
    assert head.status_code == 200
    assert head.content == b""
    assert head.headers["X-File-Id"] == uploaded["id"]
    assert head.headers["X-File-Name"] == "people.csv"
    assert head.headers["X-File-Size"] == str(len(data))
    assert head.headers["X-File-Mime-Type"] == "text/csv"
    assert head.headers["X-File-Downloadable"] == "false"

    output = put(http, scope, "outputs/out.bin", b"\x00\x01")
    head = http.head(f"/v1/files/{output['id']}", params={"scope_id": scope})
    assert head.headers["X-File-Downloadable"] == "true"
    assert head.headers["X-File-Mime-Type"] == "application/octet-stream"

    missing = file_id(f"{UPLOADS}/nope.csv")
    assert_error(http.head(f"/v1/files/{missing}", params={"scope_id": scope}), 404)
    assert http.head(f"/v1/files/{missing}", params={"scope_id": scope}).content == b""
    assert_error(http.get(f"/v1/files/{missing}", params={"scope_id": scope}), 404)
    # Ids that name nothing a container may serve: never a host file, never a 500.
    for bogus in (file_id("/etc/passwd"), file_id(f"{UPLOADS}/../../../etc/passwd"),
                  file_id("/home/agent/workspace/../../../etc/passwd"), "not-a-file-id", "AAAA"):
        assert_error(http.get(f"/v1/files/{bogus}", params={"scope_id": scope}), 404)
        assert_error(http.get(f"/v1/files/{bogus}/content", params={"scope_id": scope}), 404)


def test_download_content(http, scope):
    csv = b"month,revenue\n" + b"2026-01,1\n" * 500
    blob = os.urandom(300_000)
    csv_id = upload(http, scope, "sales.csv", csv)["id"]
    png_id = put(http, scope, "outputs/revenue.png", PNG)["id"]
    blob_id = upload(http, scope, "blob.bin", blob)["id"]
    accented_id = upload(http, scope, "résumé.txt", "ça va\n".encode())["id"]

    response = http.get(f"/v1/files/{csv_id}/content", params={"scope_id": scope})
    assert response.status_code == 200
    assert response.content == csv
    assert response.headers["content-type"].split(";")[0] == "text/csv"
    assert response.headers["content-disposition"].startswith("attachment")
    assert 'filename="sales.csv"' in response.headers["content-disposition"]

    response = http.get(f"/v1/files/{png_id}/content", params={"scope_id": scope})
    assert (response.content, response.headers["content-type"]) == (PNG, "image/png")
    assert 'filename="revenue.png"' in response.headers["content-disposition"]

    response = http.get(f"/v1/files/{blob_id}/content", params={"scope_id": scope})
    assert response.content == blob
    assert response.headers["content-type"] == "application/octet-stream"

    response = http.get(f"/v1/files/{accented_id}/content", params={"scope_id": scope})
    assert response.content == "ça va\n".encode()
    assert "filename*=utf-8''r%C3%A9sum%C3%A9.txt" in response.headers["content-disposition"]

    inline = http.get(f"/v1/files/{png_id}/content",
                      params={"scope_id": scope, "disposition": "inline"})
    assert inline.status_code == 200 and inline.content == PNG
    assert inline.headers["content-disposition"].startswith("inline")
    # Code's HTML (the blob too, however its bytes look), opened inline from the
    # API's origin: typed as named, and a sandboxed document if a browser opens it.
    page_id = put(http, scope, "outputs/report.html", b"<script>fetch('/v1/files')</script>")["id"]
    for fid in (page_id, blob_id, png_id):
        served = http.get(f"/v1/files/{fid}/content",
                          params={"scope_id": scope, "disposition": "inline"})
        assert served.headers["x-content-type-options"] == "nosniff", served.headers
        policy = served.headers["content-security-policy"].split("; ")
        assert "sandbox" in policy and "default-src 'none'" in policy, policy
    explicit = http.get(f"/v1/files/{png_id}/content",
                        params={"scope_id": scope, "disposition": "attachment"})
    assert explicit.headers["content-disposition"].startswith("attachment")
    bad = http.get(f"/v1/files/{png_id}/content", params={"scope_id": scope, "disposition": "x"})
    assert bad.status_code in (400, 422), bad.text

    missing = file_id(f"{UPLOADS}/missing.csv")
    assert_error(http.get(f"/v1/files/{missing}/content", params={"scope_id": scope}), 404)


# -- delete -------------------------------------------------------------------------------------
def test_delete_one_file(http, scope):
    doomed = upload(http, scope, "doomed.csv", b"bye")
    kept = upload(http, scope, "kept.csv", b"stay")
    with attached(http, scope) as bash:
        assert bash(f"echo out > {OUTPUTS}/generated.txt")["return_code"] == 0
    generated = file_id(f"{OUTPUTS}/generated.txt")
    assert generated in listed_ids(http, scope)

    for fid in (doomed["id"], generated):
        response = http.delete(f"/v1/files/{fid}", params={"scope_id": scope})
        assert response.status_code == 200, response.text
        assert response.json() == {"id": fid, "type": "file_deleted"}
        assert_error(http.get(f"/v1/files/{fid}", params={"scope_id": scope}), 404)
        assert_error(http.get(f"/v1/files/{fid}/content", params={"scope_id": scope}), 404)
        assert_error(http.head(f"/v1/files/{fid}", params={"scope_id": scope}), 404)
        assert_error(http.delete(f"/v1/files/{fid}", params={"scope_id": scope}), 404)

    assert listed_ids(http, scope) == [kept["id"]]
    with attached(http, scope) as bash:
        result = bash(f"ls -A {UPLOADS} {OUTPUTS}")
        assert "doomed.csv" not in result["stdout"] and "generated.txt" not in result["stdout"]
        assert "kept.csv" in result["stdout"]


def test_delete_a_workspace_file(http, scope):
    with attached(http, scope) as bash:
        assert bash("echo tmp > /home/agent/workspace/scratch.txt")["return_code"] == 0
    fid = file_id("/home/agent/workspace/scratch.txt")
    response = http.delete(f"/v1/files/{fid}", params={"scope_id": scope})
    assert response.status_code == 200, response.text
    assert response.json() == {"id": fid, "type": "file_deleted"}
    with attached(http, scope) as bash:
        assert bash("ls -A /home/agent/workspace")["stdout"] == ""


def test_delete_by_prefix(http, scope):
    doomed = [upload(http, scope, n, b"d", path=f"data/2026/{n}")["id"] for n in ("a.csv", "b.csv")]
    doomed.append(upload(http, scope, "c.csv", b"d", path="data/2026/q3/c.csv")["id"])
    survivors = [upload(http, scope, "s.csv", b"s", path="data/2026x/s.csv")["id"],
                 upload(http, scope, "t.csv", b"t", path="data/2025/t.csv")["id"],
                 upload(http, scope, "top.csv", b"t")["id"],
                 put(http, scope, "outputs/data/2026/o.csv", b"o")["id"]]

    response = http.delete("/v1/files", params={"scope_id": scope, "prefix": "data/2026/"})
    assert response.status_code == 200, response.text
    assert response.json() == {"prefix": "data/2026/", "deleted_count": 3, "type": "prefix_deleted"}
    assert listed_ids(http, scope) == survivors
    for fid in doomed:
        assert_error(http.get(f"/v1/files/{fid}", params={"scope_id": scope}), 404)
    with attached(http, scope) as bash:
        assert bash(f"find {UPLOADS}/data/2026 -type f")["stdout"] == ""
        assert bash(f"cat {UPLOADS}/data/2026x/s.csv")["stdout"] == "s"

    again = http.delete("/v1/files", params={"scope_id": scope, "prefix": "data/2026/"})
    assert again.json() == {"prefix": "data/2026/", "deleted_count": 0, "type": "prefix_deleted"}
    assert_error(http.delete("/v1/files", params={"scope_id": scope, "prefix": ""}), 400)
    assert listed_ids(http, scope) == survivors


# -- unknown and deleted containers ---------------------------------------------------------------
def test_unknown_scope_answers_404_and_creates_nothing(http):
    scope = new_scope()
    some_id = file_id(f"{UPLOADS}/a.csv")
    params = {"scope_id": scope}
    assert_error(http.get("/v1/files", params=params), 404)
    assert_error(http.get(f"/v1/files/{some_id}", params=params), 404)
    assert_error(http.head(f"/v1/files/{some_id}", params=params), 404)
    assert_error(http.get(f"/v1/files/{some_id}/content", params=params), 404)
    assert_error(http.delete(f"/v1/files/{some_id}", params=params), 404)
    assert_error(http.delete("/v1/files", params={**params, "prefix": "data/"}), 404)
    # Reading never brings a container into being.
    assert_error(http.get(f"/v1/containers/{scope}"), 404)
    assert_error(http.get("/v1/files", params=params), 404)


def test_files_of_a_deleted_container_are_gone(http, scope):
    old = upload(http, scope, "old.csv", b"old")
    assert http.get(f"/v1/containers/{scope}").status_code == 200
    response = http.delete(f"/v1/containers/{scope}")
    assert response.status_code == 200, response.text
    assert response.json() == {"id": scope, "object": "container.deleted", "deleted": True}

    params = {"scope_id": scope}
    assert_error(http.get("/v1/files", params=params), 404)
    assert_error(http.get(f"/v1/files/{old['id']}", params=params), 404)
    assert_error(http.head(f"/v1/files/{old['id']}", params=params), 404)
    assert_error(http.get(f"/v1/files/{old['id']}/content", params=params), 404)
    assert_error(http.delete(f"/v1/files/{old['id']}", params=params), 404)
    assert_error(http.delete("/v1/files", params={**params, "prefix": "o"}), 404)
    assert_error(http.get(f"/v1/containers/{scope}"), 404)

    # What Shoal does: a container id names its container on use (Zylon's model), so a
    # write to a deleted id implicitly creates a new, empty container under that id.
    new = upload(http, scope, "new.csv", b"new")
    assert listed_ids(http, scope) == [new["id"]]
    assert_error(http.get(f"/v1/files/{old['id']}", params=params), 404)
    container = http.get(f"/v1/containers/{scope}")
    assert container.status_code == 200 and container.json()["implicit"] is True
    with attached(http, scope) as bash:
        assert bash(f"ls -A {UPLOADS}")["stdout"] == "new.csv\n"



def _images_of(server: Server, container_id: str) -> list[Path]:
    # shoal.storage.filestore: <data>/containers/<tenant key>/<sha256(id)[:24]>.img
    name = hashlib.sha256(container_id.encode()).hexdigest()[:24] + ".img"
    return sorted((server.data_dir / "containers").rglob(name))


def test_an_upload_racing_its_containers_deletion_fails_and_leaves_no_volume(files_server, http):
    made = http.post("/v1/containers", json={"name": "raced"})
    assert made.status_code == 200, made.text
    container = made.json()["id"]
    boundary = uuid.uuid4().hex
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"late.bin\"\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
    deleted = {}

    def body():
        # The server looks the container up as the request starts, then reads the
        # body: the container is deleted while the body is still on its way.
        yield head + b"x" * 65536
        time.sleep(1)
        with make_client(files_server) as other:
            deleted["response"] = other.delete(f"/v1/containers/{container}")
        for _ in range(4):
            yield b"x" * 65536
            time.sleep(0.2)
        yield f"\r\n--{boundary}--\r\n".encode()

    response = http.post(f"/v1/containers/{container}/files", content=body(),
                         headers={"content-type": f"multipart/form-data; boundary={boundary}"})
    assert deleted["response"].status_code == 200, deleted["response"].text
    assert_error(response, 404)
    assert response.json()["error"]["code"] == "not_found", response.text
    assert_error(http.get(f"/v1/containers/{container}"), 404)
    assert_error(http.get(f"/v1/containers/{container}/files"), 404)
    # Nothing made the deleted container's volume anew: no image of it is left.
    assert _images_of(files_server, container) == []


# -- tenancy ------------------------------------------------------------------------------------
def test_tenants_never_see_each_others_containers(tenants_server):
    scope = new_scope()
    with make_client(tenants_server, "a") as as_a, make_client(tenants_server, "b") as as_b, \
            make_client(tenants_server) as anonymous:
        secret = upload(as_a, scope, "secret.txt", b"tenant-a secret")
        a_only = upload(as_a, scope, "a-only.txt", b"only a")

        assert anonymous.get("/v1/files", params={"scope_id": scope}).status_code == 401
        with make_client(tenants_server, "wrong") as wrong:
            assert wrong.get("/v1/files", params={"scope_id": scope}).status_code == 401

        # tenant-b has no container by that name: its reads find nothing of tenant-a's.
        params = {"scope_id": scope}
        assert_error(as_b.get("/v1/files", params=params), 404)
        for fid in (secret["id"], a_only["id"]):
            assert_error(as_b.get(f"/v1/files/{fid}", params=params), 404)
            assert_error(as_b.head(f"/v1/files/{fid}", params=params), 404)
            assert_error(as_b.get(f"/v1/files/{fid}/content", params=params), 404)
            assert_error(as_b.delete(f"/v1/files/{fid}", params=params), 404)
        assert_error(as_b.delete("/v1/files", params={**params, "prefix": "a"}), 404)

        # Using the same scope_id, tenant-b gets a container of its own.
        mine = upload(as_b, scope, "secret.txt", b"tenant-b data")
        assert mine["id"] == secret["id"]  # ids are paths: same key, same id, other container
        assert listed_ids(as_b, scope) == [mine["id"]]
        assert content_of(as_b, scope, mine["id"]) == b"tenant-b data"
        assert_error(as_b.get(f"/v1/files/{a_only['id']}", params=params), 404)
        with attached(as_b, scope) as bash:
            result = bash(f"ls -A {UPLOADS}; cat {UPLOADS}/secret.txt")
            assert result["stdout"] == "secret.txt\ntenant-b data"
        assert as_b.delete(f"/v1/containers/{scope}").status_code == 200

        # tenant-a's container is untouched by all of it.
        assert listed_ids(as_a, scope) == [secret["id"], a_only["id"]]
        assert content_of(as_a, scope, secret["id"]) == b"tenant-a secret"
        with attached(as_a, scope) as bash:
            assert bash(f"cat {UPLOADS}/secret.txt")["stdout"] == "tenant-a secret"


# -- size cap -----------------------------------------------------------------------------------
def test_oversized_uploads_answer_413_and_write_nothing(http, scope):
    keep = put(http, scope, "exactly-the-cap.bin", b"k" * MAX_FILE_BYTES)  # the cap itself is fine
    params = {"scope_id": scope}

    attempts = [
        # Declared too large by Content-Length: refused before the body is read.
        lambda: http.post("/v1/files", params={**params, "path": "big1.bin"},
                          files={"file": ("big1.bin", b"x" * (2 * MAX_FILE_BYTES))}),
        # Within the multipart allowance, but the file itself is one byte over.
        lambda: http.post("/v1/files", params={**params, "path": "big2.bin"},
                          files={"file": ("big2.bin", b"x" * (MAX_FILE_BYTES + 1))}),
        lambda: http.put("/v1/files/big3.bin", params=params, content=b"x" * (MAX_FILE_BYTES + 1)),
        # Chunked, no Content-Length: counted as it arrives.
        lambda: http.put("/v1/files/big4.bin", params=params,
                         content=iter([b"x" * 65536] * (MAX_FILE_BYTES // 65536 + 2))),
    ]
    for attempt in attempts:
        response = attempt()
        assert_error(response, 413)

    assert listed_ids(http, scope) == [keep["id"]]
    with attached(http, scope) as bash:
        result = bash("find /mnt/user-data -mindepth 1 | sort")
        assert result["stdout"].split() == sorted([UPLOADS, OUTPUTS, f"{UPLOADS}/exactly-the-cap.bin"])


def test_oversized_upload_to_a_new_scope_creates_no_file(http, scope):
    response = http.put("/v1/files/big.bin", params={"scope_id": scope},
                        content=b"x" * (2 * MAX_FILE_BYTES))
    assert_error(response, 413)
    listed = http.get("/v1/files", params={"scope_id": scope})
    assert listed.status_code == 404 or listed.json()["data"] == []


def test_one_tenants_deletions_never_push_out_anothers_places():
    from shoal.sessions.container_files import DeletedPlaces
    places = DeletedPlaces(size=2)
    places.remember(("acme", "c1", "/a"), (1.0, "/a"))
    for n in range(5):  # another tenant deletes past the size
        places.remember(("other", "c2", f"/{n}"), (float(n), f"/{n}"))
    assert places.place(("acme", "c1", "/a")) == (1.0, "/a")
    assert places.place(("other", "c2", "/0")) is None  # its own oldest went
    assert places.place(("other", "c2", "/4")) == (4.0, "/4")
