"""The embedded metadata store: one SQLite file in the data directory.

WAL mode keeps readers off the writer's back, and every write is committed
before the call returns, so a server killed with SIGKILL loses nothing it
acknowledged. Only portable SQL is used, so a PostgreSQL store can follow the
same schema.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import time
from pathlib import Path

import aiosqlite

from .metadata import (ContainerRecord, FileRecord, MetadataStore, PassedResponse, ResponseRecord,
                       RunRecord, UploadRecord)

# The schema's history, oldest first: a database is at version N (SQLite's
# user_version) once the first N steps ran. A step is never edited once
# released; a change is a new step at the end, so every older database walks
# forward to the current schema with nothing lost.
_MIGRATIONS = (
    # 1: the first release: containers, their files, tenants' uploads.
    """
    CREATE TABLE IF NOT EXISTS containers (
        tenant TEXT NOT NULL,
        id TEXT NOT NULL,
        name TEXT,
        created_at REAL NOT NULL,
        last_active_at REAL NOT NULL,
        expires_after_minutes INTEGER NOT NULL,
        status TEXT NOT NULL,
        implicit INTEGER NOT NULL,
        memory_limit TEXT,
        PRIMARY KEY (tenant, id)
    );
    CREATE INDEX IF NOT EXISTS containers_expiry ON containers (status, last_active_at);
    CREATE TABLE IF NOT EXISTS container_files (
        tenant TEXT NOT NULL,
        container_id TEXT NOT NULL,
        path TEXT NOT NULL,
        created_at REAL NOT NULL,
        size INTEGER NOT NULL,
        source TEXT NOT NULL,
        etag TEXT,
        PRIMARY KEY (tenant, container_id, path)
    );
    CREATE TABLE IF NOT EXISTS uploads (
        tenant TEXT NOT NULL,
        id TEXT NOT NULL,
        filename TEXT NOT NULL,
        size INTEGER NOT NULL,
        created_at REAL NOT NULL,
        purpose TEXT,
        mime_type TEXT NOT NULL,
        extra TEXT NOT NULL,
        PRIMARY KEY (tenant, id)
    );
    """,
    # 2: run records and stored responses (the runs API, the responses gateway).
    """
    CREATE TABLE IF NOT EXISTS runs (
        tenant TEXT NOT NULL,
        id TEXT NOT NULL,
        container_id TEXT,
        status TEXT NOT NULL,
        created_at REAL NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (tenant, id)
    );
    CREATE INDEX IF NOT EXISTS runs_age ON runs (created_at);
    CREATE TABLE IF NOT EXISTS responses (
        tenant TEXT NOT NULL,
        id TEXT NOT NULL,
        created_at REAL NOT NULL,
        body TEXT NOT NULL,
        state TEXT NOT NULL,
        PRIMARY KEY (tenant, id)
    );
    CREATE INDEX IF NOT EXISTS responses_age ON responses (created_at);
    """,
    # 3: a container's network policy (egress allowlist, domain secrets), as JSON.
    """
    ALTER TABLE containers ADD COLUMN network_policy TEXT;
    """,
    # 4: which sandbox host holds each container (cluster mode; empty when embedded).
    """
    CREATE TABLE IF NOT EXISTS placements (
        tenant TEXT NOT NULL,
        id TEXT NOT NULL,
        host TEXT NOT NULL,
        since REAL NOT NULL,
        PRIMARY KEY (tenant, id)
    );
    """,
    # 5: each stored response's size, for its tenant's quota (older ones count 0),
    # and an index that sums a tenant's sizes without reading the rows: the
    # column comes after the large texts, and SQLite reads a row's overflow
    # pages to reach it (3 s for 1.2 GiB stored).
    """
    ALTER TABLE responses ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX IF NOT EXISTS responses_bytes ON responses (tenant, bytes);
    """,
    # 6: a container file's mtime as its row was written, so that a file code
    # rewrote at the same size is not listed with the etag of the bytes it had
    # (BIGINT: PostgreSQL's INTEGER is 4 bytes).
    """
    ALTER TABLE container_files ADD COLUMN modified_ns BIGINT NOT NULL DEFAULT 0;
    """,
    # 7: each run record's size, for its tenant's bound on stored records, and
    # an index that sums a tenant's and finds its oldest without reading bodies.
    """
    ALTER TABLE runs ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX IF NOT EXISTS runs_tenant_age ON runs (tenant, created_at, bytes);
    """,
    # 8: whose is each response the upstream keeps that a request passed through
    # made (the operator's one upstream account keeps every tenant's): the
    # tenant, and the sandbox whose code made it (scope; NULL for a client).
    """
    CREATE TABLE IF NOT EXISTS passed_responses (
        id TEXT NOT NULL PRIMARY KEY,
        tenant TEXT NOT NULL,
        scope TEXT,
        created_at REAL NOT NULL
    );
    CREATE INDEX IF NOT EXISTS passed_responses_age ON passed_responses (created_at);
    """,
)
SCHEMA_VERSION = len(_MIGRATIONS)
# A tenant's oldest run records, as many as add up to the excess (the last
# parameter): each row whose records before it fall short of it.
_TRIM_RUNS = """DELETE FROM runs WHERE tenant = {0} AND id IN (
    SELECT id FROM (SELECT id, bytes, SUM(bytes) OVER (ORDER BY created_at, id) AS running
                    FROM runs WHERE tenant = {0}) AS oldest
    WHERE running - bytes < {1})"""


class SchemaTooNew(RuntimeError):
    """The database was written by a newer Shoal: this one must not touch it."""


def schema_problem(path: Path) -> str | None:
    """Why this Shoal cannot open the database at ``path`` (checked before serving)."""
    try:
        if not path.exists():
            return None
    except OSError as exc:  # not root, say: the isolation checks say so too
        return f"cannot read the metadata database {path}: {exc.strerror}"
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.Error as exc:
        return f"cannot read the metadata database {path}: {exc}"
    if version > SCHEMA_VERSION:
        return (f"{path} holds schema version {version}, written by a newer Shoal; this one "
                f"knows up to {SCHEMA_VERSION}: upgrade Shoal, or restore the backup taken "
                "before the upgrade")
    return None


_FILE_COLUMNS = "tenant, container_id, path, created_at, size, source, etag, modified_ns"
_CONTAINER_COLUMNS = ("tenant, id, name, created_at, last_active_at, expires_after_minutes, "
                      "status, implicit, memory_limit, network_policy")
# Of the containers a query finds, those placed on one sandbox host (the last
# parameter): looked up by the placements' key, per container found.
_PLACED_ON = (" AND EXISTS (SELECT 1 FROM placements WHERE placements.tenant = containers.tenant"
              " AND placements.id = containers.id AND placements.host = ?)")
# create_container's upsert: a row that is no container any more (deleted, or
# expired by the clock, the last parameter) is replaced; a live one is kept.
_TAKE_OVER = (", ".join(f"{c} = excluded.{c}" for c in _CONTAINER_COLUMNS.split(", ")[2:])
              + " WHERE containers.status <> 'active' OR containers.last_active_at"
              " + containers.expires_after_minutes * 60 <= ?")


def _container(row) -> ContainerRecord:
    return ContainerRecord(tenant=row[0], id=row[1], name=row[2], created_at=row[3],
                           last_active_at=row[4], expires_after_minutes=row[5], status=row[6],
                           implicit=bool(row[7]), memory_limit=row[8],
                           network_policy=row[9])


def _file(row) -> FileRecord:
    return FileRecord(tenant=row[0], container_id=row[1], path=row[2], created_at=row[3],
                      size=row[4], source=row[5], etag=row[6], modified_ns=row[7])


def _upload(row) -> UploadRecord:
    return UploadRecord(tenant=row[0], id=row[1], filename=row[2], size=row[3], created_at=row[4],
                        purpose=row[5], mime_type=row[6], extra=json.loads(row[7]))


class DataDirInUse(RuntimeError):
    """Another server holds this data directory."""


def lock_path(data_dir: Path) -> Path:
    return data_dir / "shoal.lock"


def data_dir_holder(data_dir: Path) -> str | None:
    """The pid of the server holding ``data_dir``, or None if it is free."""
    path = lock_path(data_dir)
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        return None
    finally:
        os.close(fd)


class SqliteMetadataStore(MetadataStore):
    def __init__(self, path: Path) -> None:
        self._path = path
        self._db: aiosqlite.Connection | None = None
        self._lock: int | None = None

    def _take_lock(self) -> None:
        # Two servers on one data directory would mount the same volumes twice
        # and corrupt them: the second one refuses to start.
        fd = os.open(lock_path(self._path.parent), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DataDirInUse(f"another Shoal server is using {self._path.parent}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock = fd

    async def open(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        self._db = await aiosqlite.connect(self._path)
        # Read the version before anything writes: a newer Shoal's file is left as it is.
        version = (await self._rows("PRAGMA user_version"))[0][0]
        if version > SCHEMA_VERSION:
            await self.close()
            raise SchemaTooNew(f"{self._path} holds schema version {version}, written by a "
                               f"newer Shoal; this one knows up to {SCHEMA_VERSION}: upgrade "
                               "Shoal, or restore the backup taken before the upgrade")
        await self._db.execute("PRAGMA journal_mode=WAL")
        await self._db.execute("PRAGMA synchronous=FULL")
        await self._migrate(version)

    async def _migrate(self, version: int) -> None:
        """Walk the database forward to SCHEMA_VERSION, one committed step at a time."""
        if version == 0 and await self._rows(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'containers'"):
            version = 1  # the first release kept no version: its tables say which it is
        for step in range(version, SCHEMA_VERSION):
            # executescript commits what came before; BEGIN makes the step and its
            # version one transaction, so a crash mid-step leaves the old version.
            await self.db.executescript(f"BEGIN; {_MIGRATIONS[step]}; "
                                        f"PRAGMA user_version = {step + 1}; COMMIT;")

    @property
    def schema_version(self) -> int:
        return SCHEMA_VERSION

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    @property
    def db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise RuntimeError("the metadata store is not open")
        return self._db

    async def _write(self, sql: str, parameters=()) -> None:
        await self.db.execute(sql, parameters)
        await self.db.commit()

    async def _rows(self, sql: str, parameters=()) -> list:
        async with self.db.execute(sql, parameters) as cursor:
            return list(await cursor.fetchall())

    # -- containers ------------------------------------------------------------
    async def put_container(self, record: ContainerRecord) -> None:
        await self._write(
            f"INSERT OR REPLACE INTO containers ({_CONTAINER_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (record.tenant, record.id, record.name, record.created_at, record.last_active_at,
             record.expires_after_minutes, record.status, int(record.implicit), record.memory_limit,
             record.network_policy))

    async def touch_container(self, record: ContainerRecord) -> bool:
        cursor = await self.db.execute(
            "UPDATE containers SET last_active_at = MAX(last_active_at, ?) WHERE tenant = ? "
            "AND id = ? AND created_at = ? AND status = 'active'",
            (record.last_active_at, record.tenant, record.id, record.created_at))
        await self.db.commit()
        return cursor.rowcount == 1

    async def claim_placement(self, tenant: str, container_id: str, host: str,
                              replacing: str | None = None) -> str:
        if replacing is None:
            await self.db.execute("INSERT INTO placements (tenant, id, host, since) VALUES "
                                  "(?,?,?,?) ON CONFLICT (tenant, id) DO NOTHING",
                                  (tenant, container_id, host, time.time()))
        else:
            await self.db.execute("UPDATE placements SET host = ?, since = ? WHERE tenant = ? "
                                  "AND id = ? AND host = ?",
                                  (host, time.time(), tenant, container_id, replacing))
        await self.db.commit()
        return await self.placement(tenant, container_id) or host

    async def placement(self, tenant: str, container_id: str) -> str | None:
        async with self.db.execute("SELECT host FROM placements WHERE tenant = ? AND id = ?",
                                   (tenant, container_id)) as cursor:
            row = await cursor.fetchone()
        return row[0] if row else None

    async def drop_placement(self, tenant: str, container_id: str) -> None:
        await self.db.execute("DELETE FROM placements WHERE tenant = ? AND id = ?",
                              (tenant, container_id))
        await self.db.commit()

    async def forget_retired_containers(self, active_before: float) -> int:
        cursor = await self.db.execute(
            "DELETE FROM containers WHERE status <> 'active' AND last_active_at < ?",
            (active_before,))
        await self.db.commit()
        return cursor.rowcount

    async def retire_container(self, record: ContainerRecord, status: str) -> bool:
        cursor = await self.db.execute(
            "UPDATE containers SET status = ? WHERE tenant = ? AND id = ? AND created_at = ? "
            "AND status = 'active'", (status, record.tenant, record.id, record.created_at))
        await self.db.commit()
        return cursor.rowcount == 1

    async def create_container(self, record: ContainerRecord) -> bool:
        cursor = await self.db.execute(
            f"INSERT INTO containers ({_CONTAINER_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?) "
            f"ON CONFLICT (tenant, id) DO UPDATE SET {_TAKE_OVER}",
            (record.tenant, record.id, record.name, record.created_at, record.last_active_at,
             record.expires_after_minutes, record.status, int(record.implicit), record.memory_limit,
             record.network_policy, record.created_at))
        await self.db.commit()
        return cursor.rowcount == 1

    async def get_container(self, tenant: str, container_id: str) -> ContainerRecord | None:
        rows = await self._rows(f"SELECT {_CONTAINER_COLUMNS} FROM containers "
                                "WHERE tenant = ? AND id = ?", (tenant, container_id))
        return _container(rows[0]) if rows else None

    async def list_containers(self, tenant: str, status: str = "active") -> list[ContainerRecord]:
        rows = await self._rows(f"SELECT {_CONTAINER_COLUMNS} FROM containers WHERE tenant = ? "
                                "AND status = ? ORDER BY created_at, id", (tenant, status))
        return [_container(row) for row in rows]

    async def expired_containers(self, now: float,
                                 host: str | None = None) -> list[ContainerRecord]:
        rows = await self._rows(f"SELECT {_CONTAINER_COLUMNS} FROM containers WHERE status = "
                                "'active' AND last_active_at + expires_after_minutes * 60 <= ?"
                                + (_PLACED_ON if host else ""),
                                (now, host) if host else (now,))
        return [_container(row) for row in rows]

    # -- container files -----------------------------------------------------------
    async def put_file(self, record: FileRecord) -> None:
        await self._write(
            f"INSERT OR REPLACE INTO container_files ({_FILE_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)",
            (record.tenant, record.container_id, record.path, record.created_at, record.size,
             record.source, record.etag, record.modified_ns))

    async def get_file(self, tenant: str, container_id: str, path: str) -> FileRecord | None:
        rows = await self._rows(
            f"SELECT {_FILE_COLUMNS} FROM container_files "
            "WHERE tenant = ? AND container_id = ? AND path = ?", (tenant, container_id, path))
        return _file(rows[0]) if rows else None

    async def list_files(self, tenant: str, container_id: str) -> list[FileRecord]:
        rows = await self._rows(
            f"SELECT {_FILE_COLUMNS} FROM container_files "
            "WHERE tenant = ? AND container_id = ? ORDER BY created_at, path", (tenant, container_id))
        return [_file(row) for row in rows]

    async def delete_files(self, tenant: str, container_id: str, paths: list[str]) -> None:
        await self.db.executemany(
            "DELETE FROM container_files WHERE tenant = ? AND container_id = ? AND path = ?",
            [(tenant, container_id, path) for path in paths])
        await self.db.commit()

    async def delete_container_files(self, tenant: str, container_id: str) -> None:
        await self._write("DELETE FROM container_files WHERE tenant = ? AND container_id = ?",
                          (tenant, container_id))

    # -- tenant uploads --------------------------------------------------------------
    async def put_upload(self, record: UploadRecord) -> None:
        await self._write(
            "INSERT OR REPLACE INTO uploads (tenant, id, filename, size, created_at, purpose, "
            "mime_type, extra) VALUES (?,?,?,?,?,?,?,?)",
            (record.tenant, record.id, record.filename, record.size, record.created_at,
             record.purpose, record.mime_type, json.dumps(record.extra)))

    async def add_upload(self, record: UploadRecord, max_bytes: int, max_files: int) -> bool:
        # One statement: SQLite runs it whole, so no other write comes between
        # the tenant's totals and the insert they allow.
        cursor = await self.db.execute(
            "INSERT INTO uploads (tenant, id, filename, size, created_at, purpose, mime_type, "
            "extra) SELECT ?,?,?,?,?,?,?,? WHERE (SELECT COUNT(*) FROM uploads WHERE tenant = ?) "
            "< ? AND (SELECT COALESCE(SUM(size), 0) FROM uploads WHERE tenant = ?) + ? <= ?",
            (record.tenant, record.id, record.filename, record.size, record.created_at,
             record.purpose, record.mime_type, json.dumps(record.extra),
             record.tenant, max_files, record.tenant, record.size, max_bytes))
        await self.db.commit()
        return cursor.rowcount == 1

    async def upload_usage(self, tenant: str) -> tuple[int, int]:
        rows = await self._rows("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM uploads "
                                "WHERE tenant = ?", (tenant,))
        return rows[0][0], rows[0][1]

    async def get_upload(self, tenant: str, upload_id: str) -> UploadRecord | None:
        rows = await self._rows("SELECT tenant, id, filename, size, created_at, purpose, mime_type, "
                                "extra FROM uploads WHERE tenant = ? AND id = ?", (tenant, upload_id))
        return _upload(rows[0]) if rows else None

    async def list_uploads(self, tenant: str) -> list[UploadRecord]:
        rows = await self._rows("SELECT tenant, id, filename, size, created_at, purpose, mime_type, "
                                "extra FROM uploads WHERE tenant = ? ORDER BY created_at, id",
                                (tenant,))
        return [_upload(row) for row in rows]

    async def delete_upload(self, tenant: str, upload_id: str) -> None:
        await self._write("DELETE FROM uploads WHERE tenant = ? AND id = ?", (tenant, upload_id))

    # -- runs --------------------------------------------------------------------------
    async def put_run(self, record: RunRecord) -> int:
        body = json.dumps(record.body, ensure_ascii=False)
        size = len(body.encode())
        await self._write(
            "INSERT OR REPLACE INTO runs (tenant, id, container_id, status, created_at, body, "
            "bytes) VALUES (?,?,?,?,?,?,?)",
            (record.tenant, record.id, record.container_id, record.status, record.created_at,
             body, size))
        return size

    async def trim_runs(self, tenant: str, keep_bytes: int) -> int:
        total = (await self._rows("SELECT COALESCE(SUM(bytes), 0) FROM runs WHERE tenant = ?",
                                  (tenant,)))[0][0]
        if total <= keep_bytes:
            return 0
        cursor = await self.db.execute(_TRIM_RUNS.format("?", "?"),
                                       (tenant, tenant, total - keep_bytes))
        await self.db.commit()
        return cursor.rowcount

    async def get_run(self, tenant: str, run_id: str) -> RunRecord | None:
        rows = await self._rows("SELECT tenant, id, container_id, status, created_at, body "
                                "FROM runs WHERE tenant = ? AND id = ?", (tenant, run_id))
        if not rows:
            return None
        row = rows[0]
        return RunRecord(tenant=row[0], id=row[1], container_id=row[2], status=row[3],
                         created_at=row[4], body=json.loads(row[5]))

    async def delete_runs_before(self, created_before: float) -> int:
        cursor = await self.db.execute("DELETE FROM runs WHERE created_at < ?", (created_before,))
        await self.db.commit()
        return cursor.rowcount

    # -- stored responses ------------------------------------------------------------------
    async def put_response(self, record: ResponseRecord) -> None:
        body, state, size = _response_texts(record)
        await self._write(
            "INSERT OR REPLACE INTO responses (tenant, id, created_at, body, state, bytes) "
            "VALUES (?,?,?,?,?,?)", (record.tenant, record.id, record.created_at, body, state, size))

    async def stored_response_bytes(self, tenant: str) -> int:
        rows = await self._rows("SELECT COALESCE(SUM(bytes), 0) FROM responses WHERE tenant = ?",
                                (tenant,))
        return int(rows[0][0])

    async def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None:
        rows = await self._rows("SELECT tenant, id, created_at, body, state FROM responses "
                                "WHERE tenant = ? AND id = ?", (tenant, response_id))
        if not rows:
            return None
        row = rows[0]
        return ResponseRecord(tenant=row[0], id=row[1], created_at=row[2], body=json.loads(row[3]),
                              state=json.loads(row[4]))

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        cursor = await self.db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?",
                                       (tenant, response_id))
        await self.db.commit()
        return cursor.rowcount > 0

    async def delete_responses_before(self, created_before: float) -> int:
        cursor = await self.db.execute("DELETE FROM responses WHERE created_at < ?", (created_before,))
        await self.db.commit()
        return cursor.rowcount


    # -- responses passed through ----------------------------------------------------------
    async def note_passed_response(self, owner: PassedResponse) -> None:
        await self._write("INSERT OR IGNORE INTO passed_responses (id, tenant, scope, created_at) "
                          "VALUES (?,?,?,?)", (owner.id, owner.tenant, owner.scope,
                                               owner.created_at))

    async def passed_response(self, response_id: str) -> PassedResponse | None:
        rows = await self._rows("SELECT id, tenant, scope, created_at FROM passed_responses "
                                "WHERE id = ?", (response_id,))
        return PassedResponse(*rows[0]) if rows else None

    async def delete_passed_responses_before(self, created_before: float) -> int:
        cursor = await self.db.execute("DELETE FROM passed_responses WHERE created_at < ?",
                                       (created_before,))
        await self.db.commit()
        return cursor.rowcount


def _response_texts(record: ResponseRecord) -> tuple[str, str, int]:
    """A stored response's body and state as stored, and the bytes they take."""
    body = json.dumps(record.body, ensure_ascii=False)
    state = json.dumps(record.state, ensure_ascii=False)
    return body, state, len(body.encode()) + len(state.encode())
