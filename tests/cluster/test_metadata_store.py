"""The metadata store's contract, on both backends: embedded SQLite and PostgreSQL.

The same tests run against a real SQLite file and a real PostgreSQL server, so
the cluster store cannot drift from the embedded one: every record comes back
as written, scoped by tenant, and the guarantees the API rests on hold (an
acknowledged write is there for another connection, and of two front ends
creating one container exactly one succeeds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import asyncpg
import pytest

from shoal.storage import (ContainerRecord, FileRecord, PassedResponse, ResponseRecord,
                           RunRecord, SqliteMetadataStore, UploadRecord)
from shoal.storage.postgres import PostgresMetadataStore
from shoal.storage.sqlite import SCHEMA_VERSION, SchemaTooNew

pytestmark = pytest.mark.cluster


@pytest.fixture(params=["sqlite", "postgres"])
def make_store(request, tmp_path):
    """A factory of stores on one database: several are several front ends."""
    if request.param == "sqlite":
        # One server per data directory is SQLite's rule (a lock): one store.
        return lambda: SqliteMetadataStore(tmp_path / "shoal.sqlite3")
    url = request.getfixturevalue("postgres_url")
    return lambda: PostgresMetadataStore(url)


@pytest.fixture
async def store(make_store):
    opened = make_store()
    await opened.open()
    yield opened
    await opened.close()


def container(tenant="alpha", id="cnt_1", **extra) -> ContainerRecord:
    now = time.time()
    return ContainerRecord(**{"tenant": tenant, "id": id, "name": "box", "created_at": now,
                              "last_active_at": now, "expires_after_minutes": 20, **extra})


async def test_containers_round_trip_scoped_by_tenant(store):
    record = container(memory_limit="4g", network_policy='{"type": "disabled"}', implicit=True)
    await store.put_container(record)
    assert await store.get_container("alpha", "cnt_1") == record
    assert await store.get_container("beta", "cnt_1") is None
    # Full precision: a Unix time survives to the microsecond.
    assert (await store.get_container("alpha", "cnt_1")).created_at == record.created_at
    moved = record.touched(record.last_active_at + 90)
    await store.put_container(moved)
    assert await store.list_containers("alpha") == [moved]
    assert await store.list_containers("beta") == []
    assert await store.expired_containers(moved.expires_at - 1) == []
    assert await store.expired_containers(moved.expires_at) == [moved]
    # A sandbox host's: only those placed on it (of that tenant: ids are per tenant).
    await store.claim_placement("beta", "cnt_1", "n1")
    assert await store.expired_containers(moved.expires_at, "n1") == []
    await store.claim_placement("alpha", "cnt_1", "n2")
    assert await store.expired_containers(moved.expires_at, "n1") == []
    assert await store.expired_containers(moved.expires_at, "n2") == [moved]


async def test_create_container_refuses_an_existing_id(store):
    assert await store.create_container(container()) is True
    assert await store.create_container(container(name="other")) is False
    assert (await store.get_container("alpha", "cnt_1")).name == "box"
    assert await store.create_container(container(tenant="beta")) is True  # ids are per tenant


async def test_create_container_replaces_only_a_container_that_is_gone(store):
    await store.put_container(container(id="cnt_old", expires_after_minutes=1,
                                        last_active_at=time.time() - 120))
    deleted = container(id="cnt_gone", status="deleted")
    await store.put_container(deleted)
    live = container(id="cnt_live")
    await store.put_container(live)
    # Expired by the clock, or deleted: the id is free again, and the new row wins.
    assert await store.create_container(container(id="cnt_old", name="new")) is True
    assert await store.create_container(container(id="cnt_gone", name="new")) is True
    assert await store.create_container(container(id="cnt_live", name="new")) is False
    assert (await store.get_container("alpha", "cnt_old")).name == "new"
    assert (await store.get_container("alpha", "cnt_gone")).status == "active"
    assert (await store.get_container("alpha", "cnt_live")).name == "box"


async def test_a_tenants_oldest_run_records_are_trimmed_to_its_bound(store):
    now = time.time()
    sizes = {}
    for index in range(5):
        record = RunRecord("alpha", f"cexrun_{index}", None, "completed", now + index,
                           {"stdout": "x" * 1000})
        sizes[record.id] = await store.put_run(record)
    other = RunRecord("beta", "cexrun_b", None, "completed", now - 10, {"stdout": "y" * 5000})
    await store.put_run(other)
    assert all(size > 1000 for size in sizes.values())
    keep = sum(sizes.values()) - sizes["cexrun_0"] - 1  # the oldest and one more byte over
    assert await store.trim_runs("alpha", keep) == 2
    assert [await store.get_run("alpha", f"cexrun_{i}") is None for i in range(5)] == [
        True, True, False, False, False]
    assert await store.get_run("beta", "cexrun_b") == other  # another tenant's, untouched
    assert await store.trim_runs("alpha", keep) == 0


async def test_retired_containers_are_forgotten_after_their_grace(store):
    # Retired rows were kept for ever: creating and deleting containers in a
    # loop grew the table without end.
    day_ago = time.time() - 86400
    old = container(id="cnt_old_retired", last_active_at=day_ago - 10)
    recent = container(id="cnt_recent_retired")
    live = container(id="cnt_idle_live", last_active_at=day_ago - 10, expires_after_minutes=10**6)
    for record in (old, recent, live):
        await store.put_container(record)
    assert await store.retire_container(old, "deleted") is True
    assert await store.retire_container(recent, "expired") is True
    assert await store.forget_retired_containers(day_ago) == 1
    assert await store.get_container("alpha", "cnt_old_retired") is None
    assert (await store.get_container("alpha", "cnt_recent_retired")).status == "expired"
    assert (await store.get_container("alpha", "cnt_idle_live")).status == "active"
    assert await store.forget_retired_containers(day_ago) == 0
    # The id is free: a container made anew under it is an ordinary one.
    assert await store.create_container(container(id="cnt_old_retired")) is True


async def test_retire_container_retires_only_that_container(store):
    first = container(id="cnt_r")
    await store.put_container(first)
    assert await store.retire_container(first, "expired") is True
    assert await store.retire_container(first, "expired") is False  # not active any more
    anew = container(id="cnt_r", name="anew")
    assert await store.create_container(anew) is True
    # The first generation's retirement, late (a stale front end), changes nothing.
    assert await store.retire_container(first, "deleted") is False
    assert (await store.get_container("alpha", "cnt_r")).status == "active"
    assert await store.retire_container(anew, "deleted") is True


async def test_a_placement_is_claimed_once_and_moves_only_off_the_host_named(store):
    assert await store.placement("alpha", "cnt_p") is None
    assert await store.claim_placement("alpha", "cnt_p", "n1") == "n1"
    assert await store.claim_placement("alpha", "cnt_p", "n2") == "n1"  # held: it stays
    assert await store.claim_placement("beta", "cnt_p", "n2") == "n2"  # tenants apart
    # Moving off a host that is gone: only if it is still on that host.
    assert await store.claim_placement("alpha", "cnt_p", "n3", replacing="n2") == "n1"
    assert await store.claim_placement("alpha", "cnt_p", "n3", replacing="n1") == "n3"
    assert await store.claim_placement("alpha", "cnt_p", "n4", replacing="n1") == "n3"
    await store.drop_placement("alpha", "cnt_p")
    assert await store.placement("alpha", "cnt_p") is None
    assert await store.placement("beta", "cnt_p") == "n2"


async def test_touch_container_moves_only_that_live_containers_activity_forward(store):
    first = container(id="cnt_t")
    await store.put_container(first)
    later = dataclasses.replace(first, last_active_at=first.last_active_at + 30, name="stale")
    assert await store.touch_container(later) is True
    stored = await store.get_container("alpha", "cnt_t")
    assert (stored.last_active_at, stored.name) == (later.last_active_at, "box")  # nothing else
    # Never backwards: a front end whose copy is older does not undo a newer touch.
    assert await store.touch_container(first) is True
    assert (await store.get_container("alpha", "cnt_t")).last_active_at == later.last_active_at
    # Retired (by another front end): a stale copy's touch does not bring it back.
    assert await store.retire_container(first, "deleted") is True
    assert await store.touch_container(later) is False
    assert (await store.get_container("alpha", "cnt_t")).status == "deleted"
    # Made anew under the id: the first generation's touch leaves the new one alone.
    anew = container(id="cnt_t", name="anew")
    assert await store.create_container(anew) is True
    assert await store.touch_container(dataclasses.replace(later, last_active_at=time.time() + 60)) is False
    stored = await store.get_container("alpha", "cnt_t")
    assert (stored.created_at, stored.last_active_at) == (anew.created_at, anew.last_active_at)


async def test_files_uploads_runs_responses(store):
    await store.put_container(container())
    # A file's mtime in ns is past 2**60: a 4-byte column would not hold it.
    files = [FileRecord("alpha", "cnt_1", f"/mnt/data/{name}", time.time() + i, 3 + i, "user", None,
                        time.time_ns() + i) for i, name in enumerate(["a.txt", "b.txt", "c.txt"])]
    for record in files:
        await store.put_file(record)
    assert await store.list_files("alpha", "cnt_1") == files
    assert await store.get_file("alpha", "cnt_1", "/mnt/data/b.txt") == files[1]
    assert await store.list_files("beta", "cnt_1") == []
    await store.delete_files("alpha", "cnt_1", ["/mnt/data/a.txt", "/mnt/data/c.txt"])
    assert await store.list_files("alpha", "cnt_1") == [files[1]]
    await store.delete_container_files("alpha", "cnt_1")
    assert await store.list_files("alpha", "cnt_1") == []

    upload = UploadRecord("alpha", "file_1", "r\u00e9sum\u00e9.pdf", 10, time.time(), "assistants",
                          "application/pdf", {"k": [1, "two"]})
    await store.put_upload(upload)
    assert await store.get_upload("alpha", "file_1") == upload
    assert await store.list_uploads("alpha") == [upload] and await store.list_uploads("beta") == []
    await store.delete_upload("alpha", "file_1")
    assert await store.get_upload("alpha", "file_1") is None

    old, new = time.time() - 100, time.time()
    await store.put_run(RunRecord("alpha", "run_old", None, "completed", old, {"stdout": "\u2603"}))
    await store.put_run(RunRecord("alpha", "run_new", "cnt_1", "failed", new, {"error": "x"}))
    assert (await store.get_run("alpha", "run_old")).body == {"stdout": "\u2603"}
    assert await store.get_run("beta", "run_old") is None
    assert await store.delete_runs_before(old + 1) == 1
    assert await store.get_run("alpha", "run_old") is None
    assert (await store.get_run("alpha", "run_new")).container_id == "cnt_1"

    response = ResponseRecord("alpha", "resp_1", new, {"output": []}, {"input": ["\u2603"]})
    await store.put_response(response)
    assert await store.get_response("alpha", "resp_1") == response
    # As stored: the JSON texts' UTF-8 bytes ({"output": []} and {"input": ["☃"]}).
    assert await store.stored_response_bytes("alpha") == 14 + 18
    await store.put_response(response)  # stored again: replaced, not counted twice
    assert await store.stored_response_bytes("alpha") == 32
    assert await store.stored_response_bytes("beta") == 0
    assert await store.delete_response("beta", "resp_1") is False
    assert await store.delete_response("alpha", "resp_1") is True
    await store.put_response(ResponseRecord("alpha", "resp_2", old, {}, {}))
    assert await store.delete_responses_before(old + 1) == 1


async def test_a_passed_through_responses_first_owner_stands(store):
    old, new = time.time() - 100, time.time()
    mine = PassedResponse("resp_up_1", "alpha", None, new)
    await store.note_passed_response(mine)
    await store.note_passed_response(PassedResponse("resp_up_1", "beta", "cnt_x", new))
    assert await store.passed_response("resp_up_1") == mine
    coded = PassedResponse("resp_up_2", "alpha", "cnt_1", old)
    await store.note_passed_response(coded)
    assert await store.passed_response("resp_up_2") == coded
    assert await store.passed_response("resp_unknown") is None
    assert await store.delete_passed_responses_before(old + 1) == 1
    assert await store.passed_response("resp_up_2") is None
    assert await store.passed_response("resp_up_1") == mine


def upload(id: str, size: int, tenant: str = "alpha") -> UploadRecord:
    return UploadRecord(tenant, id, f"{id}.bin", size, time.time())


async def test_add_upload_keeps_a_tenant_within_its_bytes_and_files(store):
    assert await store.upload_usage("alpha") == (0, 0)
    assert await store.add_upload(upload("u1", 60), max_bytes=100, max_files=3)
    assert not await store.add_upload(upload("u2", 41), max_bytes=100, max_files=3)
    assert await store.add_upload(upload("u3", 40), max_bytes=100, max_files=3)
    assert not await store.add_upload(upload("u4", 0), max_bytes=100, max_files=2)
    assert await store.add_upload(upload("u5", 0), max_bytes=100, max_files=3)
    assert not await store.add_upload(upload("u6", 0), max_bytes=100, max_files=3)
    assert await store.upload_usage("alpha") == (3, 100)
    assert [u.id for u in await store.list_uploads("alpha")] == ["u1", "u3", "u5"]
    # Another tenant's uploads are not counted.
    assert await store.add_upload(upload("u1", 100, "beta"), max_bytes=100, max_files=1)
    assert await store.upload_usage("beta") == (1, 100)


async def test_front_ends_adding_uploads_at_once_stay_within_the_quota(make_store, request):
    # Each front end counts only its own uploads in flight: the store's check and
    # insert must be one step, or two front ends each add what only one may.
    stores = [make_store() for _ in range(
        1 if request.node.callspec.params["make_store"] == "sqlite" else 3)]
    for each in stores:
        await each.open()
    try:
        for round in range(10):
            tenant = f"racer{round}"
            added = await asyncio.gather(*(
                stores[i % len(stores)].add_upload(upload(f"u{i}", 30, tenant), max_bytes=100,
                                                   max_files=50)
                for i in range(12)))
            assert added.count(True) == 3, added
            assert await stores[0].upload_usage(tenant) == (3, 90)
            added = await asyncio.gather(*(
                stores[i % len(stores)].add_upload(upload(f"e{i}", 0, tenant), max_bytes=100,
                                                   max_files=5)
                for i in range(12)))
            assert added.count(True) == 2, added
    finally:
        for each in stores:
            await each.close()


async def test_front_ends_share_one_database(make_store, request):
    if request.node.callspec.params["make_store"] == "sqlite":
        pytest.skip("the embedded store serves one front end (a data-directory lock)")
    first, second = make_store(), make_store()
    await asyncio.gather(first.open(), second.open())  # both migrate: it runs once
    try:
        assert await first.schema_version() == SCHEMA_VERSION
        # An acknowledged write is visible to the other front end at once.
        await first.put_container(container())
        assert await second.get_container("alpha", "cnt_1") == container(
            created_at=(await first.get_container("alpha", "cnt_1")).created_at,
            last_active_at=(await first.get_container("alpha", "cnt_1")).last_active_at)
        # Two front ends racing to create one container: exactly one gets it, every time.
        for round in range(20):
            outcomes = await asyncio.gather(
                *(store.create_container(container(id=f"race_{round}", name=f"{i}"))
                  for i, store in enumerate((first, second) * 4)))
            assert sorted(outcomes) == [False] * 7 + [True], outcomes
        # Two front ends moving one container off a gone host: both end up agreeing.
        for round in range(10):
            await first.claim_placement("alpha", f"moving_{round}", "gone")
            moved = await asyncio.gather(
                *(store.claim_placement("alpha", f"moving_{round}", f"n{i}", replacing="gone")
                  for i, store in enumerate((first, second) * 3)))
            assert len(set(moved)) == 1 and moved[0] != "gone", moved
    finally:
        await first.close()
        await second.close()


async def test_a_database_from_a_newer_shoal_is_refused_untouched(postgres_url):
    db = await asyncpg.connect(postgres_url)
    try:
        await db.execute("CREATE TABLE shoal_schema (version INTEGER NOT NULL)")
        await db.execute("INSERT INTO shoal_schema VALUES ($1)", SCHEMA_VERSION + 1)
        store = PostgresMetadataStore(postgres_url)
        with pytest.raises(SchemaTooNew):
            await store.open()
        tables = {row[0] for row in await db.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
        assert tables == {"shoal_schema"}, tables
    finally:
        await db.close()


async def test_an_older_database_walks_forward_keeping_its_rows(postgres_url):
    from shoal.storage.postgres import _postgres_step
    from shoal.storage.sqlite import _MIGRATIONS
    db = await asyncpg.connect(postgres_url)
    try:  # the first release's schema and a row in it
        await db.execute("CREATE TABLE shoal_schema (version INTEGER NOT NULL)")
        await db.execute(_postgres_step(_MIGRATIONS[0]))
        await db.execute("INSERT INTO shoal_schema VALUES (1)")
        await db.execute("INSERT INTO containers (tenant, id, name, created_at, last_active_at, "
                         "expires_after_minutes, status, implicit) "
                         "VALUES ('alpha', 'cnt_old', 'kept', 1.5, 2.5, 20, 'active', 0)")
    finally:
        await db.close()
    store = PostgresMetadataStore(postgres_url)
    await store.open()
    try:
        assert await store.schema_version() == SCHEMA_VERSION
        kept = await store.get_container("alpha", "cnt_old")
        assert (kept.name, kept.created_at, kept.network_policy) == ("kept", 1.5, None)
    finally:
        await store.close()
