"""Containers that outlive their host: snapshots in the object store.

Real front ends on a real PostgreSQL and a real SeaweedFS S3 gateway. What is
shown: a container's files (written by code, and uploaded through the Files
API just before the end) survive ``kill -9`` of the front end whose sandbox
worked on them, and come back on another front end, whose first call says the
interpreter restarted; snapshots are incremental and checked, so a damaged one
fails the restore instead of giving a container with a file missing; and a
front end's stale copy of a container deleted and made anew elsewhere is never
served as the new one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from shoal.storage.filestore import StoreUnavailable
from shoal.storage.snapshots import Snapshots

from .conftest import object_store_front_end

pytestmark = pytest.mark.cluster

OUTPUTS = "/mnt/user-data/outputs"


def _front_end(tmp_path, name, uid_base, postgres_url, seaweedfs, bucket, **settings):
    return object_store_front_end(tmp_path, name, uid_base, postgres_url, seaweedfs, bucket,
                                  pool_size=1, **settings)


def _manifests(seaweedfs, bucket) -> list[dict]:
    """The manifests in the bucket now; one deleted between the listing and its
    read (a reaper at work while a test waits for it) is not there."""
    s3 = seaweedfs.client()
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="shoal/containers/").get("Contents", [])
    found = []
    for item in listed:
        if item["Key"].endswith("/manifest.json"):
            try:
                found.append(json.loads(s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()))
            except s3.exceptions.NoSuchKey:
                continue
    return found


def _move(postgres_url: str, container: str, host: str) -> None:
    """Place ``container`` on ``host``, as a front end moves one off a host the
    cluster reported gone."""
    import asyncio

    import asyncpg

    async def move() -> None:
        db = await asyncpg.connect(postgres_url)
        try:
            await db.execute("UPDATE placements SET host = $1 WHERE id = $2", host, container)
        finally:
            await db.close()
    asyncio.run(move())


@contextlib.contextmanager
def _two_front_ends(tmp_path, uid_bases: tuple[int, int], postgres_url, seaweedfs):
    """Clients of front ends "a" and "b" on one database and a new bucket of their
    own; both front ends stopped after."""
    bucket = seaweedfs.new_bucket()
    first = _front_end(tmp_path, "a", uid_bases[0], postgres_url, seaweedfs, bucket)
    try:
        second = _front_end(tmp_path, "b", uid_bases[1], postgres_url, seaweedfs, bucket)
        try:
            with first.client() as one, second.client() as two:
                yield one, two
        finally:
            second.stop()
    finally:
        first.stop()


def _exec(http, session_id: str, code: str) -> dict:
    answer = http.post(f"/sessions/{session_id}/exec",
                       json={"tool": "code_execution", "input": {"code": code}})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_container_survives_kill_9_of_its_front_end_and_comes_back_on_another(
        postgres_url, seaweedfs, tmp_path):
    bucket = seaweedfs.new_bucket()
    # Snapshots of live containers every second, looked for every half second.
    first = _front_end(tmp_path, "a", 965_000, postgres_url, seaweedfs, bucket,
                       snapshot_interval_seconds=1, reaper_interval_seconds=0.5)
    second = _front_end(tmp_path, "b", 966_000, postgres_url, seaweedfs, bucket)
    data = os.urandom(3 << 20)  # 3 MiB the client uploads just before the end
    try:
        with first.client() as one, second.client() as two:
            container = one.post("/v1/containers", json={"name": "kept"}).json()["id"]
            session = one.post("/sessions", json={"container": container}).json()["session_id"]
            wrote = _exec(one, session, (
                "import os\nstate = 42\n"
                f"open('{OUTPUTS}/report.txt', 'w').write('revenue up\\n')\n"
                "os.makedirs('notes/deep', exist_ok=True)\n"
                "open('notes/deep/todo.md', 'w').write('- ship\\n')\n"
                "os.symlink('deep/todo.md', 'notes/link')\n"))
            assert wrote["result_block"]["content"]["return_code"] == 0, wrote
            # The running container's files reach the bucket on the cadence.
            deadline = time.monotonic() + 30
            while not any("workspace/notes/deep/todo.md" in m["entries"]
                          for m in _manifests(seaweedfs, bucket)):
                assert time.monotonic() < deadline, _manifests(seaweedfs, bucket)
                time.sleep(0.2)
            uploaded = one.post(f"/v1/containers/{container}/files",
                                files={"file": ("big.bin", data)})
            assert uploaded.status_code == 200, uploaded.text
            # Acknowledged, and then the front end dies at once.
            first.stop(signal.SIGKILL)

            again = two.post("/sessions", json={"container": container}).json()["session_id"]
            found = _exec(two, again, (
                "import hashlib, os\n"
                "print(open('notes/deep/todo.md').read(), end='')\n"
                "print(os.readlink('notes/link'))\n"
                f"print(open('{OUTPUTS}/report.txt').read(), end='')\n"
                "print(hashlib.sha256(open('/mnt/user-data/uploads/big.bin', 'rb').read())"
                ".hexdigest())\n"
                "print('state' in globals())\n"))
            content = found["result_block"]["content"]
            assert content["return_code"] == 0, found
            assert content["stdout"].splitlines() == [
                "- ship", "deep/todo.md", "revenue up", hashlib.sha256(data).hexdigest(), "False"]
            # A fresh interpreter on someone's files: the first call says so, once.
            assert found["interpreter_restarted"] is True
            assert _exec(two, again, "print(1)")["interpreter_restarted"] is False
            listed = two.get(f"/v1/containers/{container}/files").json()["data"]
            assert {Path(item["path"]).name: item["bytes"] for item in listed} == {
                "big.bin": len(data), "report.txt": len("revenue up\n")}, listed
    finally:
        second.stop()
        first.stop()  # killed already, unless the test failed before it got there
        # The killed server's leftovers (sandboxes, mounts) go with its next start.
        _front_end(tmp_path, "a", 965_000, postgres_url, seaweedfs, bucket,
                   data_dir=first.data_dir).stop()


def test_a_deleted_container_made_anew_elsewhere_is_not_served_from_a_stale_copy(
        postgres_url, seaweedfs, tmp_path):
    with _two_front_ends(tmp_path, (967_000, 968_000), postgres_url, seaweedfs) as (one, two):
        # Zylon's threads name their container: used, it exists.
        put = one.put("/api/v1/app/thread/t-1/put-file/old.txt", content=b"old")
        assert put.status_code == 201, put.text
        assert two.delete("/v1/containers/t-1").status_code in (200, 204)
        put = two.put("/api/v1/app/thread/t-1/put-file/new.txt", content=b"new")
        assert put.status_code == 201, put.text
        # The first front end still has the old container's volume; it must
        # restore the new one's snapshot, not serve what it has.
        listed = one.get("/v1/containers/t-1/files").json()["data"]
        assert [Path(item["path"]).name for item in listed] == ["new.txt"], listed
        session = one.post("/sessions", json={"container": "t-1"}).json()["session_id"]
        seen = _exec(one, session, "import os; print(sorted(os.listdir('/mnt/user-data/uploads')))")
        assert seen["result_block"]["content"]["stdout"] == "['new.txt']\n", seen


def _tree(root: Path) -> dict[str, tuple]:
    found = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        if path.is_symlink():
            found[str(path.relative_to(root))] = ("link", os.readlink(path))
        elif path.is_file():
            found[str(path.relative_to(root))] = ("file", path.read_bytes(), info.st_mode & 0o7777,
                                                  info.st_mtime_ns)
        else:
            found[str(path.relative_to(root))] = ("dir", info.st_mode & 0o7777)
    return found


def test_snapshots_are_incremental_exact_and_checked(seaweedfs, tmp_path):
    bucket = seaweedfs.new_bucket()
    s3 = seaweedfs.client()
    snapshots = Snapshots(s3, bucket, "p/")
    root = tmp_path / "home"
    (root / "workspace" / "sub").mkdir(parents=True)
    (root / "outputs").mkdir()
    (root / "etc").mkdir()  # not saved: laid out anew for every sandbox
    (root / "etc" / "passwd").write_text("agent:x:1:1::/:/bin/sh\n")
    big = os.urandom(2 << 20)
    (root / "workspace" / "big.bin").write_bytes(big)
    (root / "workspace" / "copy.bin").write_bytes(big)  # the same content: stored once
    (root / "workspace" / "sub" / "small.txt").write_text("small")
    os.chmod(root / "workspace" / "sub" / "small.txt", 0o640)
    os.symlink("../big.bin", root / "workspace" / "sub" / "link")
    os.mkfifo(root / "workspace" / "fifo")  # not a file a container keeps

    first, sent = snapshots.save("t", "c", root, None, sandboxed=True)
    assert sent == len(big) + len("small")
    assert "workspace/fifo" not in first.entries and not any(p.startswith("etc") for p in first.entries)
    again, sent = snapshots.save("t", "c", root, first, sandboxed=True)
    assert again is first and sent == 0  # nothing changed: nothing sent, no new version
    (root / "workspace" / "sub" / "small.txt").write_text("changed")
    second, sent = snapshots.save("t", "c", root, first, sandboxed=False)
    assert sent == len("changed") and second.version != first.version
    assert second.sandboxed  # once a sandbox worked on it, always
    blobs = [item["Key"] for item in s3.list_objects_v2(Bucket=bucket, Prefix="p/").get("Contents", [])
             if "/blobs/" in item["Key"]]
    assert len(blobs) == 2  # big (once), and the new small; the old small is gone

    restored = tmp_path / "restored"
    restored.mkdir()
    snapshots.restore("t", "c", restored, snapshots.manifest("t", "c"))
    saved = {k: v for k, v in _tree(root).items() if not k.startswith("etc") and k != "workspace/fifo"}
    mine = _tree(restored)
    # Directories' times move as the test reads; files, modes and links are exact.
    assert {k: v for k, v in mine.items() if v[0] != "dir"} == {
        k: v for k, v in saved.items() if v[0] != "dir"}
    assert {k for k, v in mine.items() if v[0] == "dir"} == {k for k, v in saved.items() if v[0] == "dir"}

    # One flipped byte in the store: the restore fails, it does not hand back a damaged file.
    key = next(k for k in blobs if k.endswith(hashlib.sha256(big).hexdigest()))
    s3.put_object(Bucket=bucket, Key=key, Body=b"x" + big[1:])
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    with pytest.raises(StoreUnavailable, match="checksum"):
        snapshots.restore("t", "c", damaged, snapshots.manifest("t", "c"))

    snapshots.delete("t", "c")
    assert s3.list_objects_v2(Bucket=bucket, Prefix="p/").get("KeyCount", 0) == 0
    assert snapshots.manifest("t", "c") is None


def test_a_snapshot_walk_swapped_onto_a_link_mid_way_reads_only_the_containers_files(tmp_path):
    """A snapshot runs beside the sandbox: code can swap a directory the walk has
    listed for a link to a host directory. The walk goes on from the directory
    it opened, never through the link (it runs as root)."""
    from shoal.storage.snapshots import walk

    root = tmp_path / "home"
    inner = root / "workspace" / "d"
    inner.mkdir(parents=True)
    (inner / "mine.txt").write_text("mine")
    seen = []
    for path, entry, directory, name in walk(root):
        seen.append(path)
        if path == "workspace/d":
            os.rename(inner, root / "workspace" / "moved")
            os.symlink("/etc", inner)  # the host's /etc where the walk is going
        if entry[0] == "f":
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=directory)
            with os.fdopen(fd, "rb") as handle:
                assert handle.read() == b"mine", path
    assert "workspace/d/mine.txt" in seen, seen
    assert not any(p.startswith("workspace/d/") and p != "workspace/d/mine.txt" for p in seen), seen


def test_a_host_the_container_was_moved_from_never_writes_over_the_holders_snapshot(
        postgres_url, seaweedfs, tmp_path):
    """Hosts with node keys (as a cluster runs them), no Ray: the container is moved
    off host A the way a front end moves it off a host the cluster reported gone.
    A comes back and takes a write for it: it does not snapshot its stale copy over
    the holder's (which would lose the holder's acknowledged upload); it answers 421
    naming the holder, so the front end sends the write there."""
    bucket = seaweedfs.new_bucket()
    first = _front_end(tmp_path, "a", 969_000, postgres_url, seaweedfs, bucket, node_key="nhostaaaa")
    second = _front_end(tmp_path, "b", 969_500, postgres_url, seaweedfs, bucket, node_key="nhostbbbb")
    try:
        with first.client() as one, second.client() as two:
            container = one.post("/v1/containers", json={"name": "moved"}).json()["id"]
            assert one.post(f"/v1/containers/{container}/files",
                            files={"file": ("f1.txt", b"one")}).status_code == 200

            _move(postgres_url, container, "nhostbbbb")

            assert two.post(f"/v1/containers/{container}/files",
                            files={"file": ("f2.txt", b"two")}).status_code == 200
            stale = one.post(f"/v1/containers/{container}/files", files={"file": ("f3.txt", b"3")})
            assert stale.status_code == 421, stale.text
            assert stale.headers["shoal-placement"] == "nhostbbbb"
            names = sorted(Path(item["path"]).name for item in
                           two.get(f"/v1/containers/{container}/files").json()["data"])
            assert names == ["f1.txt", "f2.txt"], names
            (manifest,) = _manifests(seaweedfs, bucket)
            assert sorted(p.rsplit("/", 1)[-1] for p in manifest["entries"]
                          if p.startswith("uploads/")) == ["f1.txt", "f2.txt"]
    finally:
        first.stop()
        second.stop()


def test_a_run_that_keeps_many_files_snapshots_its_container_once(postgres_url, seaweedfs,
                                                                   tmp_path):
    """The files a run leaves at the top of its workspace are copied into the
    container one by one, and made durable together: one snapshot, not one each
    (each walks the whole container and writes a manifest)."""
    bucket = seaweedfs.new_bucket()
    server = _front_end(tmp_path, "many", 967_000, postgres_url, seaweedfs, bucket,
                        log_level="debug", snapshot_interval_seconds=3600)
    try:
        with server.client() as http:
            container = http.post("/v1/containers", json={"name": "many"}).json()["id"]
            before = _snapshot_lines(server, container)
            code = "for i in range(6):\n    open(f'part-{i}.csv', 'w').write(str(i))\n"
            with http.stream("POST", "/v1/code-execution/runs",
                             json={"code": code, "container": container}) as events:
                finished = [line for line in events.iter_lines() if "run.completed" in line]
            assert finished, "the run did not complete"
            listed = http.get(f"/v1/containers/{container}/files").json()["data"]
            assert sorted(Path(item["path"]).name for item in listed) == [
                f"part-{i}.csv" for i in range(6)], listed
            assert _snapshot_lines(server, container) - before == 1
            (manifest,) = _manifests(seaweedfs, bucket)
            assert sum(path.endswith(".csv") and "outputs/" in path
                       for path in manifest["entries"]) == 6, manifest["entries"]
    finally:
        server.stop()


def _snapshot_lines(server, container: str) -> int:
    """The snapshots of ``container`` the server has written (its debug log says each)."""
    count = 0
    for line in server.log().splitlines():
        if line.startswith("{"):
            message = json.loads(line).get("message", "")
            if message.startswith(f"container {container} snapshotted"):
                count += 1
    return count


def test_a_host_drops_its_copy_of_a_container_another_host_holds(postgres_url, seaweedfs,
                                                                  tmp_path):
    """Host A's copy of a container moved to host B (as a front end moves one off a
    host the cluster reported gone) is dropped by A's reaper: B restores from the
    bucket, never from A, so the copy would hold A's disk forever. A copy A still
    holds stays."""
    bucket = seaweedfs.new_bucket()
    first = _front_end(tmp_path, "a", 969_700, postgres_url, seaweedfs, bucket,
                       node_key="nhostcccc", reaper_interval_seconds=0.5)
    second = _front_end(tmp_path, "b", 969_800, postgres_url, seaweedfs, bucket,
                        node_key="nhostdddd")
    try:
        with first.client() as one, second.client() as two:
            moved, kept = (one.post("/v1/containers", json={"name": name}).json()["id"]
                           for name in ("moved", "kept"))
            for container in (moved, kept):
                assert one.post(f"/v1/containers/{container}/files",
                                files={"file": ("f.txt", b"one")}).status_code == 200
            images = sorted((first.data_dir / "containers").glob("*/*.img"))
            assert len(images) == 2, images

            _move(postgres_url, moved, "nhostdddd")

            deadline = time.monotonic() + 30
            while len(list((first.data_dir / "containers").glob("*/*.img"))) != 1:
                assert time.monotonic() < deadline, "host A kept its copy of the moved container"
                time.sleep(0.2)
            # The holder serves it from the bucket; A's other container is untouched.
            names = [Path(item["path"]).name for item in
                     two.get(f"/v1/containers/{moved}/files").json()["data"]]
            assert names == ["f.txt"], names
            assert [Path(item["path"]).name for item in
                    one.get(f"/v1/containers/{kept}/files").json()["data"]] == ["f.txt"]
    finally:
        first.stop()
        second.stop()


def test_sessions_on_a_container_made_anew_elsewhere_end_with_its_old_sandbox(
        postgres_url, seaweedfs, tmp_path):
    """A session on front end A works in container t-3; B deletes t-3 and makes it
    anew. The next use of t-3 on A stops the old generation's sandbox there: the
    session on it ends with it (404, its slot free), never left answering with a
    stopped sandbox."""
    with _two_front_ends(tmp_path, (970_000, 970_500), postgres_url, seaweedfs) as (one, two):
        old = one.post("/sessions", json={"container": "t-3"}).json()["session_id"]
        _exec(one, old, "x = 1")
        assert two.delete("/v1/containers/t-3").status_code in (200, 204)
        put = two.put("/api/v1/app/thread/t-3/put-file/new.txt", content=b"new")
        assert put.status_code == 201, put.text

        new = one.post("/sessions", json={"container": "t-3"})
        assert new.status_code == 201, new.text
        seen = _exec(one, new.json()["session_id"],
                     "import os; print(sorted(os.listdir('/mnt/user-data/uploads')))")
        assert seen["result_block"]["content"]["stdout"] == "['new.txt']\n", seen
        assert one.get(f"/sessions/{old}").status_code == 404
        gone = one.post(f"/sessions/{old}/exec",
                        json={"tool": "code_execution", "input": {"code": "x"}})
        assert gone.status_code == 404, gone.text


def test_sessions_on_a_container_moved_off_their_host_end_with_its_sandbox(
        postgres_url, seaweedfs, tmp_path):
    """Host A holds a container with a session on it; the container is moved to B
    (as off a host the cluster reported gone). A finds out at its next snapshot,
    drops its copy and stops the sandbox: the session ends with it (404), and a
    write for the container through A is sent on to the holder (421)."""
    bucket = seaweedfs.new_bucket()
    first = _front_end(tmp_path, "a", 971_000, postgres_url, seaweedfs, bucket, node_key="nhostcccc",
                       snapshot_interval_seconds=0.5, reaper_interval_seconds=0.5)
    second = _front_end(tmp_path, "b", 971_500, postgres_url, seaweedfs, bucket, node_key="nhostdddd")
    try:
        with first.client() as one:
            container = one.post("/v1/containers", json={"name": "moving"}).json()["id"]
            session = one.post("/sessions", json={"container": container}).json()["session_id"]
            _exec(one, session, "open('/mnt/user-data/outputs/a.txt', 'w').write('a')")

            _move(postgres_url, container, "nhostdddd")

            deadline = time.monotonic() + 30
            while one.get(f"/sessions/{session}").status_code != 404:
                assert time.monotonic() < deadline, "the session outlived its container's move"
                time.sleep(0.2)
            gone = one.post(f"/sessions/{session}/exec",
                            json={"tool": "code_execution", "input": {"code": "1"}})
            assert gone.status_code == 404, gone.text
            stale = one.post(f"/v1/containers/{container}/files", files={"file": ("b.txt", b"b")})
            assert stale.status_code == 421, stale.text
    finally:
        first.stop()
        second.stop()


def test_sessions_on_a_container_deleted_elsewhere_end_at_their_next_call(
        postgres_url, seaweedfs, tmp_path):
    """B deletes the container a session on A works in. A learns it at the session's
    next write-through of its activity (at most every few seconds): that call keeps
    its answer, and the session ends with the sandbox (404 from then on)."""
    with _two_front_ends(tmp_path, (972_000, 972_500), postgres_url, seaweedfs) as (one, two):
        session = one.post("/sessions", json={"container": "t-4"}).json()["session_id"]
        _exec(one, session, "x = 1")
        assert two.delete("/v1/containers/t-4").status_code in (200, 204)
        deadline = time.monotonic() + 30
        while True:
            answer = one.post(f"/sessions/{session}/exec",
                              json={"tool": "code_execution", "input": {"code": "x"}})
            if answer.status_code == 404:
                break
            assert answer.status_code == 200, answer.text
            assert answer.json()["result_block"]["content"]["stdout"] == "1\n", answer.text
            assert time.monotonic() < deadline, "the session outlived its container"
            time.sleep(0.5)
        assert one.get(f"/sessions/{session}").status_code == 404


def _query(postgres_url: str, sql: str, *args) -> list[tuple]:
    import asyncio

    import asyncpg

    async def query() -> list[tuple]:
        db = await asyncpg.connect(postgres_url)
        try:
            return [tuple(row) for row in await db.fetch(sql, *args)]
        finally:
            await db.close()
    return asyncio.run(query())


def test_a_host_that_restarted_reaps_the_expired_containers_placed_on_it(
        postgres_url, seaweedfs, tmp_path):
    """A host's server that restarts on its node (it crashed, and the cluster
    started another there, under the same key) still holds the containers placed
    on it, and those that expire are its to reap: no other host reaps them, so
    otherwise their rows and their snapshots stayed in the bucket for ever."""
    bucket = seaweedfs.new_bucket()

    def host():
        return _front_end(tmp_path, "a", 978_500, postgres_url, seaweedfs, bucket,
                          node_key="nhostffff", reaper_interval_seconds=0.5)

    first = host()
    try:
        with first.client() as http:
            idle, used = (http.post("/v1/containers", json={"name": name}).json()["id"]
                          for name in ("idle", "used"))
            for container in (idle, used):
                assert http.post(f"/v1/containers/{container}/files",
                                 files={"file": ("f.txt", b"one")}).status_code == 200
    finally:
        first.stop()
    assert len(_manifests(seaweedfs, bucket)) == 2
    # Idle for two hours (its TTL is one), as if its host had been down since.
    _query(postgres_url, "UPDATE containers SET last_active_at = last_active_at - 7200 "
           "WHERE id = $1", idle)

    again = host()
    try:
        with again.client() as http:
            deadline = time.monotonic() + 30
            # Its snapshot deleted, then its row retired and its placement dropped.
            while (len(_manifests(seaweedfs, bucket)) != 1
                   or _query(postgres_url, "SELECT id FROM placements") != [(used,)]):
                assert time.monotonic() < deadline, "the expired container was not reaped"
                time.sleep(0.2)
            assert http.get(f"/v1/containers/{idle}").status_code == 404
            assert http.get(f"/v1/containers/{used}").status_code == 200
        assert _query(postgres_url, "SELECT status FROM containers WHERE id = $1",
                      idle) == [("expired",)]
    finally:
        again.stop()


def test_a_snapshot_stands_once_its_manifest_is_in_place_though_cleaning_up_fails(
        seaweedfs, tmp_path):
    """The store takes the new manifest, then its connection drops as the replaced
    snapshot's content is deleted (one object gone, the next not). The save
    stands: its caller goes on from the new manifest. (It failed, and the caller
    went on from the replaced one: content that came back, a file written as it
    was before, was taken for stored and named without being sent, though it had
    just been deleted, and the snapshot no longer restored.)"""
    from botocore.exceptions import ConnectionClosedError

    bucket = seaweedfs.new_bucket()
    s3 = seaweedfs.client()
    snapshots = Snapshots(s3, bucket, "p/")
    root = tmp_path / "home"
    (root / "workspace").mkdir(parents=True)
    (root / "workspace" / "a.txt").write_text("one")
    (root / "workspace" / "b.txt").write_text("two")
    first, _ = snapshots.save("t", "c", root, None, sandboxed=True)

    deleted = []

    def cut_after_one_deletion(request, **_):
        if deleted:
            raise ConnectionClosedError(endpoint_url=request.url)
        deleted.append(request.url)

    s3.meta.events.register("before-send.s3.DeleteObject", cut_after_one_deletion)
    (root / "workspace" / "a.txt").write_text("three")
    (root / "workspace" / "b.txt").write_text("four")
    second, _ = snapshots.save("t", "c", root, first, sandboxed=True)
    assert len(deleted) == 1 and snapshots.manifest("t", "c").version == second.version
    s3.meta.events.unregister("before-send.s3.DeleteObject", cut_after_one_deletion)

    (root / "workspace" / "a.txt").write_text("one")
    (root / "workspace" / "b.txt").write_text("two")
    third, _ = snapshots.save("t", "c", root, second, sandboxed=True)
    restored = tmp_path / "restored"
    restored.mkdir()
    snapshots.restore("t", "c", restored, snapshots.manifest("t", "c"))
    assert (restored / "workspace" / "a.txt").read_text() == "one"
    assert (restored / "workspace" / "b.txt").read_text() == "two"


def test_a_copy_whose_snapshot_failed_is_saved_once_its_server_restarts(seaweedfs, tmp_path):
    """A failed save was retried from a list kept in memory only: a server that
    restarted before the retry left the copy, newer than its snapshot, on this
    host alone until its next change, and a container moved to another host
    then came back as it was at the older snapshot."""
    from botocore.exceptions import ConnectionClosedError

    from shoal.config import MiB
    from shoal.storage import open_files

    bucket = seaweedfs.new_bucket()
    store = {"url": f"s3://{bucket}/p", "endpoint": seaweedfs.endpoint,
             "access_key": seaweedfs.ACCESS_KEY, "secret_key": seaweedfs.secret_key}

    def server_files():
        return open_files(tmp_path / "data", tmp_path / "run", 64 * MiB, MiB, store)

    def refuse(request, **_):
        raise ConnectionClosedError(endpoint_url=request.url)

    files = server_files()
    try:
        home = files.create("alpha", "kept")
        (home.workspace / "a.txt").write_text("saved")
        files.checkpoint("alpha", "kept")
        (home.workspace / "b.txt").write_text("written as the store went away")
        files._client.meta.events.register("before-send.s3.PutObject", refuse)
        with pytest.raises(StoreUnavailable):
            files.checkpoint("alpha", "kept")
        assert files.unsaved() == [("alpha", "kept")]
    finally:
        files.close()  # the server stops (or is killed) before its retry

    files = server_files()
    try:
        assert files.unsaved() == [("alpha", "kept")]
        files.checkpoint("alpha", "kept")  # its retry, the store back
        assert files.unsaved() == []
    finally:
        files.close()
    manifest = Snapshots(seaweedfs.client(), bucket, "p/").manifest("alpha", "kept")
    assert {"workspace/a.txt", "workspace/b.txt"} <= set(manifest.entries)
    files = server_files()  # saved: nothing is retried any more
    try:
        assert files.unsaved() == []
        files.destroy("alpha", "kept")
    finally:
        files.close()
