"""A container expires on a running server, by a real TTL, and the reaper retires it.

The shortest TTL a container may have is one minute, so this test waits that
minute out (about 65 s, nearly all of it asleep), which puts it in the slow suite
(``make test-slow``); ``make test`` covers the reaper's retiring of an expired
container in ``test_container_durability.py`` without the wait. Two
containers are made together: one with a 1-minute TTL, with files written
through the Files API and by code whose sandbox is still up when the TTL runs
out, and one with a 2-minute TTL. The server's reaper runs every half second.

Every time bound is one the machine's load can only make easier to meet: the
doomed container must not expire before a minute has passed since its last
activity (a busy machine only makes the first 404 later), and must be retired
within a generous wait after that.
"""

from __future__ import annotations

import base64
import hashlib
import sqlite3
import time
from pathlib import Path

import pytest

UPLOADS = "/mnt/user-data/uploads"
WORKSPACE = "/home/agent/workspace"
TTL_SECONDS = 60
# How long past its expiry the reaper may take to retire a container (it runs every
# 0.5 s here): only a reaper that never runs misses this.
RETIRE_WAIT_SECONDS = 60


def _file_id(sandbox_path: str) -> str:
    return base64.urlsafe_b64encode(sandbox_path.encode()).decode().rstrip("=")


def _image_name(container_id: str) -> str:
    # shoal.storage.filestore: <data>/containers/<tenant key>/<sha256(id)[:24]>.img
    return hashlib.sha256(container_id.encode()).hexdigest()[:24] + ".img"


@pytest.fixture(scope="module")
def reaping(server_factory):
    return server_factory(pool_size=1, max_sessions=4, reaper_interval_seconds=0.5)


def _uids_running(uid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            for line in status.read_text().splitlines():
                if line.startswith("Uid:"):
                    if int(line.split()[1]) == uid:
                        found.append(int(status.parent.name))
                    break
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.slow
def test_a_container_expires_by_its_ttl_and_the_reaper_retires_it(reaping):
    database = reaping.data_dir / "shoal.sqlite3"

    def status_of(container_id: str) -> str:
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
            return db.execute("SELECT status FROM containers WHERE id = ?",
                              (container_id,)).fetchone()[0]

    def file_rows(container_id: str) -> int:
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
            return db.execute("SELECT COUNT(*) FROM container_files WHERE container_id = ?",
                              (container_id,)).fetchone()[0]

    def images() -> set[str]:
        return {path.name for path in (reaping.data_dir / "containers").rglob("*.img")}

    with reaping.client() as http:
        ids = {}
        for name, minutes in (("doomed", 1), ("kept", 2)):
            created = http.post("/v1/containers", json={
                "name": name, "expires_after": {"anchor": "last_active_at", "minutes": minutes}})
            assert created.status_code == 200, created.text
            ids[name] = created.json()["id"]
            put = http.put("/v1/files/data.txt", params={"scope_id": ids[name]},
                           content=name.encode())
            assert put.status_code == 201, put.text
        # Code writes into the doomed container; its sandbox stays up once the session
        # is released (it would idle for 5 minutes), so expiry must stop it.
        session = http.post("/sessions", json={"container": ids["doomed"]})
        assert session.status_code == 201, session.text
        session_id = session.json()["session_id"]
        last_activity = time.monotonic()  # the call below is the container's last activity
        ran = http.post(f"/sessions/{session_id}/exec", json={
            "tool": "bash_code_execution",
            "input": {"command": f"echo by-code > {WORKSPACE}/made.txt && id -u"}})
        assert ran.status_code == 200, ran.text
        uid = int(ran.json()["result_block"]["content"]["stdout"])
        assert http.delete(f"/sessions/{session_id}").status_code == 204
        assert _uids_running(uid), "the container's sandbox should still be up"
        assert {_image_name(ids["doomed"]), _image_name(ids["kept"])} <= images()

        # Reads are not activity: poll until the doomed container answers 404.
        while True:
            response = http.get(f"/v1/containers/{ids['doomed']}")
            answered = time.monotonic()
            if response.status_code == 404:
                break
            assert response.status_code == 200, response.text
            assert response.json()["status"] == "active"
            assert answered - last_activity < TTL_SECONDS + RETIRE_WAIT_SECONDS, \
                "the container never expired"
            time.sleep(0.5)
        # Not before its TTL: the server's last activity came after `last_activity`.
        assert answered - last_activity >= TTL_SECONDS, \
            f"expired {answered - last_activity:.1f}s after its last activity"

        # The reaper retires it: its sandbox stopped, its files, volume image and
        # file rows deleted, the container marked expired.
        deadline = time.monotonic() + RETIRE_WAIT_SECONDS
        while status_of(ids["doomed"]) != "expired":
            assert time.monotonic() < deadline, "the reaper never retired the container"
            time.sleep(0.2)
        assert _image_name(ids["doomed"]) not in images()
        assert file_rows(ids["doomed"]) == 0
        while _uids_running(uid):
            assert time.monotonic() < deadline, "the expired container's sandbox still runs"
            time.sleep(0.2)
        assert http.get("/v1/files", params={"scope_id": ids["doomed"]}).status_code == 404
        assert http.get(f"/v1/containers/{ids['doomed']}/files").status_code == 404
        listed = {c["id"] for c in http.get("/v1/containers", params={"limit": 100}).json()["data"]}
        assert ids["doomed"] not in listed

        # The 2-minute container, made at the same time, is untouched.
        assert time.monotonic() - last_activity < 2 * TTL_SECONDS, "too late to tell"
        assert ids["kept"] in listed
        assert status_of(ids["kept"]) == "active"
        assert _image_name(ids["kept"]) in images()
        kept = http.get(f"/v1/files/{_file_id(f'{UPLOADS}/data.txt')}/content",
                        params={"scope_id": ids["kept"]})
        assert kept.status_code == 200 and kept.content == b"kept"

        # Used again, the doomed id is a new, empty container (Zylon's "used, it exists").
        again = http.post("/sessions", json={"container": ids["doomed"]})
        assert again.status_code == 201, again.text
        again_id = again.json()["session_id"]
        seen = http.post(f"/sessions/{again_id}/exec", json={
            "tool": "bash_code_execution", "input": {"command": f"ls -A {WORKSPACE} {UPLOADS}"}})
        assert seen.json()["result_block"]["content"]["stdout"] == \
            f"{WORKSPACE}:\n\n{UPLOADS}:\n", seen.json()
        http.delete(f"/sessions/{again_id}")
        for container_id in ids.values():
            http.delete(f"/v1/containers/{container_id}")
