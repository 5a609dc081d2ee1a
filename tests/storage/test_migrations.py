"""The metadata store walks an older database forward and loses nothing.

``fixtures/release-1.sql`` is the database of Shoal's first release. It has
no schema version, and was written by that release's own store, dumped with
sqlite3. Each test loads it into a real SQLite file and opens it with today's
store, exactly as an upgraded server does on its first start.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from shoal.storage import ContainerRecord, FileRecord, ResponseRecord, RunRecord, UploadRecord
from shoal.storage.sqlite import (SCHEMA_VERSION, SchemaTooNew, SqliteMetadataStore,
                                  schema_problem)

RELEASE_1 = Path(__file__).parent / "fixtures" / "release-1.sql"


def _load(path: Path, sql: Path = RELEASE_1) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as db:
        db.executescript(sql.read_text())
    return path


def _rows(path: Path) -> dict[str, list[tuple]]:
    with sqlite3.connect(path) as db:
        return {table: sorted(db.execute(f"SELECT * FROM {table}").fetchall())
                for table in ("containers", "container_files", "uploads")}


def _version(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return db.execute("PRAGMA user_version").fetchone()[0]


async def test_a_release_1_database_is_migrated_with_every_row_kept(tmp_path):
    path = _load(tmp_path / "data" / "shoal.sqlite3")
    before = _rows(path)
    assert _version(path) == 0 and sum(map(len, before.values())) == 7  # the fixture as dumped

    store = SqliteMetadataStore(path)
    await store.open()
    try:
        containers = await store.list_containers("acme")
        assert sorted(containers, key=lambda c: c.id) == [
            ContainerRecord("acme", "cnt_0123456789abcdef01234567", "quarterly", 1790000000.0,
                            1790000060.0, 240),
            ContainerRecord("acme", "reports", None, 1790000000.0, 1790000120.0, 60,
                            implicit=True, memory_limit="4g")]
        assert [c.id for c in await store.list_containers("globex", status="expired")] == [
            "cnt_fedcba9876543210fedcba98"]
        assert sorted(await store.list_files("acme", "reports"), key=lambda f: f.path) == [
            FileRecord("acme", "reports", "/mnt/user-data/outputs/chart.png", 1790000020.0,
                       18734, "assistant"),
            FileRecord("acme", "reports", "/mnt/user-data/uploads/data/sales.csv", 1790000010.0,
                       26, "user", "52fc49a5395aeb10ef2fddbe3176a671")]
        assert await store.list_uploads("globex") == [
            UploadRecord("globex", "file-a7a583e22e60a1f38d272341", "q3 report.pdf", 48213,
                         1790000040.0, None, "application/pdf")]
        # What the release did not have works on the migrated database.
        run = RunRecord("acme", "cexrun_1", "reports", "completed", time.time(), {"stdout": "1\n"})
        await store.put_run(run)
        assert await store.get_run("acme", "cexrun_1") == run
        response = ResponseRecord("acme", "resp_1", time.time(), {"id": "resp_1"}, {"turns": []})
        await store.put_response(response)
        assert await store.get_response("acme", "resp_1") == response
    finally:
        await store.close()
    assert _version(path) == SCHEMA_VERSION
    # Nothing of the release's was rewritten or dropped; the columns added since
    # (a container's network_policy) are empty on its rows.
    after = _rows(path)
    assert {table: [row[:len(rows[0])] for row in after[table]] if rows else after[table]
            for table, rows in before.items()} == before
    assert [row[len(before["containers"][0]):] for row in after["containers"]] == [(None,)] * 3


async def test_opening_a_current_database_again_changes_nothing(tmp_path):
    path = _load(tmp_path / "data" / "shoal.sqlite3")
    for _ in range(2):
        store = SqliteMetadataStore(path)
        await store.open()
        await store.close()
    assert _version(path) == SCHEMA_VERSION
    with sqlite3.connect(path) as db:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == {"containers", "container_files", "uploads", "runs", "responses", "placements",
                      "passed_responses"}


async def test_a_new_database_starts_at_the_current_version(tmp_path):
    path = tmp_path / "data" / "shoal.sqlite3"
    store = SqliteMetadataStore(path)
    await store.open()
    await store.close()
    assert _version(path) == SCHEMA_VERSION


async def test_a_database_from_a_newer_shoal_is_refused_untouched(tmp_path):
    path = _load(tmp_path / "data" / "shoal.sqlite3")
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    before = path.read_bytes()
    problem = schema_problem(path)
    assert problem is not None and f"schema version {SCHEMA_VERSION + 1}" in problem
    assert "newer Shoal" in problem
    store = SqliteMetadataStore(path)
    with pytest.raises(SchemaTooNew):
        await store.open()
    assert path.read_bytes() == before
    # The refusal let go of the data directory's lock: another store can take it.
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    again = SqliteMetadataStore(path)
    await again.open()
    await again.close()


def test_a_current_or_missing_database_has_no_problem(tmp_path):
    assert schema_problem(tmp_path / "absent.sqlite3") is None
    path = _load(tmp_path / "data" / "shoal.sqlite3")
    assert schema_problem(path) is None  # release 1 is walked forward, not refused
