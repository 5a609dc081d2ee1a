"""One tenant can no longer hurt the others or the host (issue 12), through the API.

Each class of what a red-team pass reproduced gets its test here, against real
servers: a listing that leaked the server's fds, tenants without quotas or a
fair share of the session slots, uid leases that two servers on one host could
both hand out, disks promised twice over, shapes that crashed the host side,
and counters that told every tenant about the others.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.security.helpers import new_session
from tests.security.test_channel_abuse import FORGE
from tests.serving import start_server
from tests.uid_slots import uid

# An out frame of the call in flight whose data nests 200,000 lists deep.
FORGE_DEEP_FRAME = FORGE + r'''
body = ('{"id": %d, "type": "out", "stream": "stdout", "data": ' % CALL_ID
        + "[" * 200000 + "]" * 200000 + "}").encode()
send(struct.pack(">I", len(body)) + body)
'''


def fds_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def exec_code(http: httpx.Client, session: str, code: str, timeout: int = 60) -> dict:
    response = http.post(f"/sessions/{session}/exec", timeout=timeout + 30, json={
        "tool": "code_execution", "input": {"code": code}, "timeout_seconds": timeout})
    assert response.status_code == 200, response.text
    return response.json()["result_block"]["content"]


# -- 1. listings hold a bounded number of fds ---------------------------------------------------
def test_a_huge_listing_leaks_no_fd_under_systemds_default_limit(security_server_factory):
    server = security_server_factory(pool_size=1, max_sessions=8)
    pid = server.process.pid
    subprocess.run(["prlimit", f"--pid={pid}", "--nofile=1024:1024"], check=True)
    scope = f"fd-{uuid.uuid4().hex[:8]}"
    with server.client() as http:
        created = http.post("/sessions", json={"container": scope})
        assert created.status_code == 201, created.text
        session = created.json()["session_id"]
        filled = exec_code(http, session, (
            "import os\nbase = '/mnt/user-data/outputs'\n"
            "for i in range(25000):\n    os.mkdir(f'{base}/d{i}')\n"
            "for i in range(10000):\n    open(f'{base}/f{i}', 'w').close()\nprint('filled')"),
            timeout=120)
        assert filled["stdout"] == "filled\n", filled
        before = fds_of(pid)
        for _ in range(3):
            listing = http.get("/v1/files", params={"scope_id": scope, "limit": 5})
            assert listing.status_code == 200, listing.text
            assert http.get(f"/v1/containers/{scope}/files", params={"limit": 5}).status_code == 200
        deleted = http.delete("/v1/files", params={"scope_id": scope, "prefix": "outputs/f1"})
        assert deleted.status_code == 200 and deleted.json()["deleted_count"] > 0
        after = fds_of(pid)
        assert after <= before + 8, f"the server went from {before} to {after} open fds"
        # Everyone else is still served: uploads and new sandboxes.
        other = http.post("/v1/files", params={"scope_id": f"other-{uuid.uuid4().hex[:6]}"},
                          files={"file": ("a.txt", b"fine")})
        assert other.status_code == 201, other.text
        fresh = http.post("/sessions", json={})
        assert fresh.status_code == 201, fresh.text
        assert exec_code(http, fresh.json()["session_id"], "print(1)")["stdout"] == "1\n"
        http.delete(f"/sessions/{session}")


# -- 2. quotas and fair share -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tenants_server(security_server_factory):
    return security_server_factory(tokens="tok-a=alpha,tok-b=beta", operator_tokens="tok-op",
                                   max_sessions=4, tenant_max_containers=3, pool_size=1,
                                   tenant_max_upload_bytes=64 * 1024)


def client(server, token: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60,
                        headers={"Authorization": f"Bearer {token}"})


def test_one_tenant_cannot_take_every_session_slot(tenants_server):
    with client(tenants_server, "tok-a") as alpha, client(tenants_server, "tok-b") as beta:
        held = [alpha.post("/sessions", json={}) for _ in range(2)]
        assert all(r.status_code == 201 for r in held), [r.text for r in held]
        refused = alpha.post("/sessions", json={})
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] and "share" in refused.json()["detail"]
        # Runs count against the same share.
        run = alpha.post("/v1/code-execution/runs", json={"code": "print(1)"})
        assert run.status_code == 429 and run.json()["error"]["type"] == "rate_limit_error"
        theirs = [beta.post("/sessions", json={}) for _ in range(2)]
        assert all(r.status_code == 201 for r in theirs), [r.text for r in theirs]
        for response in (*held, *theirs):
            sid = response.json()["session_id"]
            (alpha if response in held else beta).delete(f"/sessions/{sid}")
        assert alpha.post("/sessions", json={}).status_code == 201  # freed again


def test_containers_per_tenant_are_capped_and_empty_ones_are_cheap(tenants_server):
    with client(tenants_server, "tok-a") as alpha, client(tenants_server, "tok-b") as beta:
        made = [alpha.post("/v1/containers", json={"name": f"c{i}"}) for i in range(3)]
        assert all(r.status_code == 200 for r in made), [r.text for r in made]
        over = alpha.post("/v1/containers", json={"name": "one too many"})
        assert over.status_code == 429 and "quota" in over.json()["error"]["message"]
        assert over.headers["retry-after"]
        implicit = alpha.put("/v1/files/x.txt", params={"scope_id": "implicit-one"}, content=b"x")
        assert implicit.status_code == 429, implicit.text
        assert beta.post("/v1/containers", json={"name": "theirs"}).status_code == 200
        # A container costs nothing until used, and well under a megabyte of real
        # disk with a small file in it (its ext4 journal used to cost 33 MB).
        stored = alpha.post(f"/v1/containers/{made[0].json()['id']}/files",
                            files={"file": ("small.txt", b"x" * 100)})
        assert stored.status_code == 200, stored.text
        images = list((tenants_server.data_dir / "containers").rglob("*.img"))
        assert len(images) == 1
        assert images[0].stat().st_blocks * 512 < 2 * 1024 * 1024, images[0].stat()
        for response in made:
            alpha.delete(f"/v1/containers/{response.json()['id']}")
        assert alpha.post("/v1/containers", json={"name": "after"}).status_code == 200


def test_upload_bytes_per_tenant_are_capped(tenants_server):
    with client(tenants_server, "tok-a") as alpha, client(tenants_server, "tok-b") as beta:
        first = alpha.post("/v1/files", files={"file": ("a.bin", b"x" * 40 * 1024)},
                           data={"purpose": "user_data"})
        assert first.status_code == 200, first.text
        second = alpha.post("/v1/files", files={"file": ("b.bin", b"x" * 40 * 1024)},
                            data={"purpose": "user_data"})
        assert second.status_code == 429 and "quota" in second.json()["error"]["message"]
        listed = [f["filename"] for f in alpha.get("/v1/files").json()["data"]]
        assert "b.bin" not in listed, "the refused upload was kept"
        assert beta.post("/v1/files", files={"file": ("c.bin", b"x" * 40 * 1024)},
                         data={"purpose": "user_data"}).status_code == 200
        alpha.delete(f"/v1/files/{first.json()['id']}")


@pytest.fixture(scope="module")
def uploads_server(security_server_factory):
    return security_server_factory(tokens="tok-a=alpha,tok-b=beta", pool_size=1, max_sessions=2,
                                   tenant_max_upload_bytes=100_000, tenant_max_upload_files=5)


def upload_at_once(server, token: str, sizes: list[int]) -> list[httpx.Response]:
    """The uploads, sent together: each waits at a barrier, then posts."""
    barrier = threading.Barrier(len(sizes))

    def send(number: int, size: int) -> httpx.Response:
        with client(server, token) as http:
            barrier.wait()
            return http.post("/v1/files", files={"file": (f"u{number}.bin", b"x" * size)},
                             data={"purpose": "user_data"})

    with ThreadPoolExecutor(len(sizes)) as pool:
        return list(pool.map(send, range(len(sizes)), sizes))


def stored_upload_bytes(server) -> int:
    return sum(path.stat().st_size for path in (server.data_dir / "uploads").rglob("*")
               if path.is_file())


def test_concurrent_uploads_never_store_past_the_byte_quota(uploads_server):
    # Each upload read the tenant's total, wrote, then compared with the stale
    # total: six concurrent 90,000-byte uploads stored 270,000 against 100,000.
    with client(uploads_server, "tok-a") as alpha:
        for _ in range(3):
            answers = upload_at_once(uploads_server, "tok-a", [40_000] * 12)
            statuses = sorted(answer.status_code for answer in answers)
            assert statuses == [200] * 2 + [429] * 10, [a.text for a in answers]
            refused = next(answer for answer in answers if answer.status_code == 429)
            assert refused.json()["error"]["type"] == "rate_limit_error"
            assert "quota" in refused.json()["error"]["message"] and refused.headers["retry-after"]
            listed = alpha.get("/v1/files").json()["data"]
            assert sum(item["bytes"] for item in listed) == 80_000
            assert stored_upload_bytes(uploads_server) == 80_000  # refused ones left nothing
            for item in listed:
                assert alpha.delete(f"/v1/files/{item['id']}").status_code == 200


def test_uploaded_files_per_tenant_are_capped(uploads_server):
    # Empty files cost no bytes, but each is a row and an inode: 4,000 were taken.
    with client(uploads_server, "tok-b") as beta, client(uploads_server, "tok-a") as alpha:
        answers = upload_at_once(uploads_server, "tok-b", [0] * 12)
        assert sorted(a.status_code for a in answers) == [200] * 5 + [429] * 7, \
            [a.text for a in answers]
        over = beta.post("/v1/files", files={"file": ("more.txt", b"")},
                         data={"purpose": "user_data"})
        assert over.status_code == 429 and over.headers["retry-after"]
        error = over.json()["error"]
        assert error["type"] == "rate_limit_error" and "5 uploaded files" in error["message"]
        anthropic = beta.post("/v1/files", files={"file": ("more.txt", b"")},
                              headers={"anthropic-version": "2023-06-01"})
        assert anthropic.status_code == 429 and anthropic.headers["retry-after"]
        assert anthropic.json()["type"] == "error"
        assert anthropic.json()["error"]["type"] == "rate_limit_error"
        listed = beta.get("/v1/files").json()["data"]
        assert len(listed) == 5
        # Another tenant's files are its own; a deleted file frees its place.
        assert alpha.post("/v1/files", files={"file": ("a.txt", b"")},
                          data={"purpose": "user_data"}).status_code == 200
        assert beta.delete(f"/v1/files/{listed[0]['id']}").status_code == 200
        assert beta.post("/v1/files", files={"file": ("again.txt", b"")},
                         data={"purpose": "user_data"}).status_code == 200


def test_health_and_metrics_tell_tenants_nothing_of_each_other(tenants_server):
    anonymous = httpx.get(f"{tenants_server.url}/health").json()
    assert anonymous == {"status": "ok"}
    with client(tenants_server, "tok-op") as operator, client(tenants_server, "tok-a") as alpha:
        assert set(operator.get("/health").json()) >= {"sessions", "max_sessions", "pool_ready"}
        assert alpha.get("/health").json() == {"status": "ok"}
        assert operator.get("/metrics").status_code == 200
        refused = alpha.get("/metrics")
        assert refused.status_code == 403 and "operator" in refused.json()["detail"]
        assert httpx.get(f"{tenants_server.url}/metrics").status_code == 401
        # An operator token is no tenant's.
        assert operator.post("/sessions", json={}).status_code == 401


# -- 3. uid leases are host-wide -----------------------------------------------------------------
def test_two_servers_with_their_own_run_dirs_never_share_a_uid(tmp_path, security_run_dir):
    # Leases were kept per run directory: two servers on one host ran sandboxes as
    # the same uid at once, sharing every per-uid kernel limit.
    base = 715_000_000 + (os.getpid() % 1000) * 1000
    servers = []
    try:
        for number in range(2):
            run_dir = security_run_dir / f"own-run-{number}"
            run_dir.mkdir(mode=0o711)
            servers.append(start_server(tmp_path / f"s{number}", base, run_dir=run_dir,
                                        uid_count=64, pool_size=3))
        for server in servers:
            with server.client() as http:
                http.post("/sessions", json={}).raise_for_status()
        # Each pool refills in the background (and a lease defers it): wait until
        # each server runs a leased sandbox and a warm one.
        deadline = time.monotonic() + 60
        while True:
            seen = [_sandbox_uids_of(server.process.pid, range(uid(base), uid(base) + 64))
                    for server in servers]
            if all(len(uids) >= 2 for uids in seen) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(seen[0]) >= 2 and len(seen[1]) >= 2, seen
        assert not seen[0] & seen[1], f"both servers run sandboxes as {seen[0] & seen[1]}"
    finally:
        for server in servers:
            server.stop()


def _sandbox_uids_of(server_pid: int, uids: range) -> set[int]:
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        uid = int(status.split("\nUid:\t", 1)[1].split()[0])
        if uid in uids and _descends_from(int(name), server_pid):
            found.add(uid)
    return found


def _descends_from(pid: int, ancestor: int) -> bool:
    for _ in range(64):
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            return False
    return False


# -- 4. volumes never promise more than the disk holds ------------------------------------------
def test_no_volume_is_promised_more_disk_than_exists(security_server_factory, tmp_path):
    disk = tmp_path / "disk.img"
    mount_point = tmp_path / "data"
    mount_point.mkdir()
    subprocess.run(["truncate", "-s", "320M", str(disk)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(disk)], check=True)
    subprocess.run(["mount", "-o", "loop", str(disk), str(mount_point)], check=True)
    try:
        server = security_server_factory(data_dir=mount_point / "shoal", pool_size=0,
                                         disk_limit_mib=64, max_sessions=16)
        with server.client() as http:
            sessions, refused = [], None
            for _ in range(8):
                response = http.post("/sessions", json={})
                if response.status_code != 201:
                    refused = response
                    break
                sessions.append(response.json()["session_id"])
            assert refused is not None, "every volume was created: the disk was promised twice"
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert "disk" in refused.json()["detail"]
            assert 2 <= len(sessions) <= 4, len(sessions)
            # Every volume that was made can fill its whole quota: no one's writes fail
            # because another filled the disk under them.
            for session in sessions:
                wrote = exec_code(http, session, (
                    "import os\nwith open('/home/agent/workspace/fill', 'wb') as f:\n"
                    "    for _ in range(48):\n        f.write(os.urandom(1 << 20))\n"
                    "    f.flush(); os.fsync(f.fileno())\nprint('ok')"))
                assert wrote["stdout"] == "ok\n", wrote
            for session in sessions:
                http.delete(f"/sessions/{session}")
        server.stop()
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=False)


# -- 5. shapes that crashed the host side -----------------------------------------------------------
def test_a_deeply_nested_forged_frame_is_no_500(security_server):
    with security_server.client() as http:
        session = new_session(http)
        exec_code(http, session, "kept = 1")
        response = http.post(f"/sessions/{session}/exec", json={
            "tool": "code_execution", "input": {"code": FORGE_DEEP_FRAME}, "timeout_seconds": 10})
        assert response.status_code == 200, response.text
        assert response.json()["interpreter_restarted"] is True  # a garbled channel: restarted
        assert exec_code(http, session, "print('alive')")["stdout"] == "alive\n"
        http.delete(f"/sessions/{session}")


def test_names_that_are_not_utf8_list_and_keep_the_session(security_server):
    scope = f"latin1-{uuid.uuid4().hex[:8]}"
    with security_server.client() as http:
        session = http.post("/sessions", json={"container": scope}).json()["session_id"]
        result = exec_code(http, session, (
            "import os, zipfile, io\nkept = 'state'\n"
            "os.close(os.open(b'/mnt/user-data/outputs/r\\xe9sum\\xe9.txt', os.O_CREAT | os.O_WRONLY))\n"
            "open('/mnt/user-data/outputs/plain.txt', 'w').write('p')\nprint('made')"))
        assert result["stdout"] == "made\n"
        listing = http.get("/v1/files", params={"scope_id": scope})
        assert listing.status_code == 200, listing.text
        assert [f["filename"] for f in listing.json()["data"]] == ["plain.txt"]
        assert exec_code(http, session, "print(kept)")["stdout"] == "state\n"
        http.delete(f"/sessions/{session}")
