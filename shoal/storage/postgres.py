"""The shared metadata store for cluster mode: PostgreSQL, through asyncpg.

Many front ends share one database, so what one acknowledges every other
sees, and the database's transactions are the only coordination between
them. The schema is the SQLite store's, step for step (:mod:`.sqlite`'s
``_MIGRATIONS``, one version number for both), with PostgreSQL's types: a
timestamp is ``DOUBLE PRECISION`` (PostgreSQL's ``REAL`` is 4 bytes and
would round a Unix time to minutes).

Each migration step runs in one transaction with its version under an
advisory lock, so front ends starting together migrate once; a database a
newer Shoal wrote is refused before anything is written.

``create_container`` is an insert that fails on a duplicate key: of two
front ends creating the same container, exactly one gets it.

A database that cannot answer now (down, restarting, failing over, out of
connections) is StoreUnavailable, as an object store that cannot: a 503 with
Retry-After in the route's dialect, never a 500 that says a bug. The pool
reconnects on its own once the database is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from urllib.parse import urlsplit

import asyncpg

from .filestore import StoreUnavailable
from .metadata import (ContainerRecord, FileRecord, MetadataStore, PassedResponse, ResponseRecord,
                       RunRecord, UploadRecord)
# One schema, one version sequence, one mapping of rows to records, for both stores.
from .sqlite import (_FILE_COLUMNS, _MIGRATIONS, _PLACED_ON, _TAKE_OVER, _TRIM_RUNS,
                     SCHEMA_VERSION, SchemaTooNew, _container, _file, _response_texts, _upload)

log = logging.getLogger("shoal.storage")

_LOCK_KEY = 0x5E0A1  # pg_advisory_xact_lock: one migrator at a time
# pg_advisory_xact_lock(_UPLOADS_LOCK, hashtext(tenant)): one upload of a tenant is
# counted against its quota at a time (the two-key form never meets _LOCK_KEY's).
_UPLOADS_LOCK = 0x5E0A2
_VERSION_TABLE = "CREATE TABLE IF NOT EXISTS shoal_schema (version INTEGER NOT NULL)"
_CONTAINER_COLUMNS = ("tenant, id, name, created_at, last_active_at, expires_after_minutes, "
                      "status, implicit, memory_limit, network_policy")
_UPLOAD_COLUMNS = "tenant, id, filename, size, created_at, purpose, mime_type, extra"


_UNPARSABLE = ("the database URL does not parse (percent-encode any of : / @ # ? in the "
               "user name or password)")


def _where(url: str) -> str:
    """host:port/database of a URL, never its password (for messages)."""
    try:
        parts = urlsplit(url)
        return f"{parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path or ''}"
    except ValueError:
        return "(unparsable URL)"


async def _check(url: str, timeout: float) -> str | None:
    try:
        db = await asyncpg.connect(url, timeout=timeout)
    except ValueError:  # the DSN parser's messages quote pieces of the password
        return _UNPARSABLE
    except (OSError, asyncio.TimeoutError, asyncpg.PostgresError,
            asyncpg.InterfaceError) as exc:
        reason = str(exc).strip() or type(exc).__name__
        return f"cannot reach the metadata database at {_where(url)}: {reason}"
    try:
        exists = await db.fetchval("SELECT to_regclass('shoal_schema') IS NOT NULL")
        version = await db.fetchval("SELECT max(version) FROM shoal_schema") if exists else 0
    except asyncpg.PostgresError as exc:
        return f"cannot read the metadata database at {_where(url)}: {exc}"
    finally:
        await db.close()
    if (version or 0) > SCHEMA_VERSION:
        return (f"the metadata database at {_where(url)} holds schema version {version}, "
                f"written by a newer Shoal; this one knows up to {SCHEMA_VERSION}: upgrade "
                "Shoal, or restore the backup taken before the upgrade")
    return None


def database_problem(url: str, timeout: float = 10.0) -> str | None:
    """Why this Shoal cannot serve from the database at ``url`` (checked before
    serving, so an unreachable database is one line, not a traceback)."""
    return asyncio.run(_check(url, timeout))


# What says the database cannot answer now, not that a statement is wrong:
# connections refused, reset or cut (class 08), a shutdown, a restart or a
# cancelled statement (57), no connection slot or no disk left (53), a standby
# that took the address in a failover (25006), a connect that timed out.
_UNAVAILABLE = (OSError, asyncio.TimeoutError, asyncpg.PostgresConnectionError,
                asyncpg.exceptions.OperatorInterventionError,
                asyncpg.exceptions.InsufficientResourcesError,
                asyncpg.exceptions.ReadOnlySQLTransactionError)


@contextlib.contextmanager
def _unavailable():
    try:
        yield
    except _UNAVAILABLE as exc:
        log.warning("the metadata database cannot answer: %s", type(exc).__name__)
        raise StoreUnavailable("the metadata database cannot answer now; retry later") from exc


class _Pool:
    """The asyncpg pool's calls this store makes, with the database's outages
    as StoreUnavailable."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def execute(self, *args):
        with _unavailable():
            return await self._pool.execute(*args)

    async def fetch(self, *args):
        with _unavailable():
            return await self._pool.fetch(*args)

    async def fetchrow(self, *args):
        with _unavailable():
            return await self._pool.fetchrow(*args)

    async def fetchval(self, *args):
        with _unavailable():
            return await self._pool.fetchval(*args)

    @contextlib.asynccontextmanager
    async def acquire(self):
        with _unavailable():
            async with self._pool.acquire() as db:
                yield db

    async def close(self) -> None:
        await self._pool.close()


def _postgres_step(sql: str) -> str:
    return sql.replace(" REAL ", " DOUBLE PRECISION ")


def _container_values(record: ContainerRecord) -> tuple:
    return (record.tenant, record.id, record.name, record.created_at, record.last_active_at,
            record.expires_after_minutes, record.status, int(record.implicit),
            record.memory_limit, record.network_policy)


class PostgresMetadataStore(MetadataStore):
    shared = True

    def __init__(self, url: str, min_size: int = 1, max_size: int = 10) -> None:
        self._url = url
        self._sizes = (min_size, max_size)
        self._pool: _Pool | None = None

    async def open(self) -> None:
        self._pool = _Pool(await asyncpg.create_pool(self._url, min_size=self._sizes[0],
                                                     max_size=self._sizes[1]))
        try:
            await self._migrate()
        except BaseException:
            await self.close()
            raise

    async def _migrate(self) -> None:
        async with self.pool.acquire() as db:
            async with db.transaction():
                await db.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_KEY)
                await db.execute(_VERSION_TABLE)
                version = await db.fetchval("SELECT max(version) FROM shoal_schema") or 0
            if version > SCHEMA_VERSION:
                raise SchemaTooNew(f"the database holds schema version {version}, written by a "
                                   f"newer Shoal; this one knows up to {SCHEMA_VERSION}")
            for step in range(version, SCHEMA_VERSION):
                async with db.transaction():
                    await db.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_KEY)
                    done = await db.fetchval("SELECT max(version) FROM shoal_schema") or 0
                    if done > step:
                        continue  # another front end ran it while we waited
                    await db.execute(_postgres_step(_MIGRATIONS[step]))
                    await db.execute("INSERT INTO shoal_schema (version) VALUES ($1)", step + 1)

    async def schema_version(self) -> int:
        return await self.pool.fetchval("SELECT max(version) FROM shoal_schema") or 0

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @property
    def pool(self) -> _Pool:
        if self._pool is None:
            raise RuntimeError("the metadata store is not open")
        return self._pool

    # -- containers ------------------------------------------------------------
    async def put_container(self, record: ContainerRecord) -> None:
        await self.pool.execute(
            f"INSERT INTO containers ({_CONTAINER_COLUMNS}) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10) "
            "ON CONFLICT (tenant, id) DO UPDATE SET name = EXCLUDED.name, "
            "created_at = EXCLUDED.created_at, last_active_at = EXCLUDED.last_active_at, "
            "expires_after_minutes = EXCLUDED.expires_after_minutes, status = EXCLUDED.status, "
            "implicit = EXCLUDED.implicit, memory_limit = EXCLUDED.memory_limit, "
            "network_policy = EXCLUDED.network_policy", *_container_values(record))

    async def touch_container(self, record: ContainerRecord) -> bool:
        done = await self.pool.execute(
            "UPDATE containers SET last_active_at = GREATEST(last_active_at, $1) WHERE tenant = $2 "
            "AND id = $3 AND created_at = $4 AND status = 'active'",
            record.last_active_at, record.tenant, record.id, record.created_at)
        return done == "UPDATE 1"

    async def claim_placement(self, tenant: str, container_id: str, host: str,
                              replacing: str | None = None) -> str:
        if replacing is None:
            holder = await self.pool.fetchval(
                "INSERT INTO placements (tenant, id, host, since) VALUES ($1,$2,$3,$4) "
                "ON CONFLICT (tenant, id) DO UPDATE SET host = placements.host RETURNING host",
                tenant, container_id, host, time.time())
        else:
            holder = await self.pool.fetchval(
                "UPDATE placements SET host = $1, since = $2 WHERE tenant = $3 AND id = $4 "
                "AND host = $5 RETURNING host", host, time.time(), tenant, container_id, replacing)
            if holder is None:  # moved by someone else first: theirs stands
                holder = await self.placement(tenant, container_id)
        return holder or host

    async def placement(self, tenant: str, container_id: str) -> str | None:
        return await self.pool.fetchval("SELECT host FROM placements WHERE tenant = $1 AND id = $2",
                                        tenant, container_id)

    async def drop_placement(self, tenant: str, container_id: str) -> None:
        await self.pool.execute("DELETE FROM placements WHERE tenant = $1 AND id = $2",
                                tenant, container_id)

    async def forget_retired_containers(self, active_before: float) -> int:
        status = await self.pool.execute(
            "DELETE FROM containers WHERE status <> 'active' AND last_active_at < $1",
            active_before)
        return int(status.split()[-1])

    async def retire_container(self, record: ContainerRecord, status: str) -> bool:
        done = await self.pool.execute(
            "UPDATE containers SET status = $1 WHERE tenant = $2 AND id = $3 AND created_at = $4 "
            "AND status = 'active'", status, record.tenant, record.id, record.created_at)
        return done == "UPDATE 1"

    async def create_container(self, record: ContainerRecord) -> bool:
        """Insert ``record`` unless a live container of that id exists: whether it did."""
        status = await self.pool.execute(
            f"INSERT INTO containers ({_CONTAINER_COLUMNS}) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10) "
            "ON CONFLICT (tenant, id) DO UPDATE SET "
            + _TAKE_OVER.replace("?", "$11"), *_container_values(record), record.created_at)
        return status == "INSERT 0 1"

    async def get_container(self, tenant: str, container_id: str) -> ContainerRecord | None:
        row = await self.pool.fetchrow(f"SELECT {_CONTAINER_COLUMNS} FROM containers "
                                       "WHERE tenant = $1 AND id = $2", tenant, container_id)
        return _container(row) if row else None

    async def list_containers(self, tenant: str, status: str = "active") -> list[ContainerRecord]:
        rows = await self.pool.fetch(f"SELECT {_CONTAINER_COLUMNS} FROM containers WHERE "
                                     "tenant = $1 AND status = $2 ORDER BY created_at, id",
                                     tenant, status)
        return [_container(row) for row in rows]

    async def expired_containers(self, now: float,
                                 host: str | None = None) -> list[ContainerRecord]:
        rows = await self.pool.fetch(f"SELECT {_CONTAINER_COLUMNS} FROM containers WHERE status = "
                                     "'active' AND last_active_at + expires_after_minutes * 60 <= $1"
                                     + (_PLACED_ON.replace("?", "$2") if host else ""),
                                     now, *([host] if host else []))
        return [_container(row) for row in rows]

    # -- container files -----------------------------------------------------------
    async def put_file(self, record: FileRecord) -> None:
        await self.pool.execute(
            f"INSERT INTO container_files ({_FILE_COLUMNS}) VALUES ($1,$2,$3,$4,$5,$6,$7,$8) "
            "ON CONFLICT (tenant, container_id, path) DO UPDATE SET created_at = EXCLUDED.created_at, "
            "size = EXCLUDED.size, source = EXCLUDED.source, etag = EXCLUDED.etag, "
            "modified_ns = EXCLUDED.modified_ns",
            record.tenant, record.container_id, record.path, record.created_at, record.size,
            record.source, record.etag, record.modified_ns)

    async def get_file(self, tenant: str, container_id: str, path: str) -> FileRecord | None:
        row = await self.pool.fetchrow(f"SELECT {_FILE_COLUMNS} FROM container_files WHERE "
                                       "tenant = $1 AND container_id = $2 AND path = $3",
                                       tenant, container_id, path)
        return _file(row) if row else None

    async def list_files(self, tenant: str, container_id: str) -> list[FileRecord]:
        rows = await self.pool.fetch(f"SELECT {_FILE_COLUMNS} FROM container_files WHERE "
                                     "tenant = $1 AND container_id = $2 ORDER BY created_at, path",
                                     tenant, container_id)
        return [_file(row) for row in rows]

    async def delete_files(self, tenant: str, container_id: str, paths: list[str]) -> None:
        await self.pool.execute("DELETE FROM container_files WHERE tenant = $1 AND "
                                "container_id = $2 AND path = ANY($3::text[])",
                                tenant, container_id, list(paths))

    async def delete_container_files(self, tenant: str, container_id: str) -> None:
        await self.pool.execute("DELETE FROM container_files WHERE tenant = $1 AND "
                                "container_id = $2", tenant, container_id)

    # -- tenant uploads --------------------------------------------------------------
    async def put_upload(self, record: UploadRecord) -> None:
        await self.pool.execute(
            f"INSERT INTO uploads ({_UPLOAD_COLUMNS}) VALUES ($1,$2,$3,$4,$5,$6,$7,$8) "
            "ON CONFLICT (tenant, id) DO UPDATE SET filename = EXCLUDED.filename, "
            "size = EXCLUDED.size, created_at = EXCLUDED.created_at, purpose = EXCLUDED.purpose, "
            "mime_type = EXCLUDED.mime_type, extra = EXCLUDED.extra",
            record.tenant, record.id, record.filename, record.size, record.created_at,
            record.purpose, record.mime_type, json.dumps(record.extra))

    async def add_upload(self, record: UploadRecord, max_bytes: int, max_files: int) -> bool:
        # Under READ COMMITTED, two front ends could each read totals without the
        # other's upload and both insert: the tenant's lock makes it one at a time.
        async with self.pool.acquire() as db, db.transaction():
            await db.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))",
                             _UPLOADS_LOCK, record.tenant)
            count, used = await db.fetchrow("SELECT count(*), COALESCE(sum(size), 0) FROM "
                                            "uploads WHERE tenant = $1", record.tenant)
            if count >= max_files or used + record.size > max_bytes:
                return False
            await db.execute(
                f"INSERT INTO uploads ({_UPLOAD_COLUMNS}) VALUES ($1,$2,$3,$4,$5,$6,$7,$8)",
                record.tenant, record.id, record.filename, record.size, record.created_at,
                record.purpose, record.mime_type, json.dumps(record.extra))
        return True

    async def upload_usage(self, tenant: str) -> tuple[int, int]:
        count, used = await self.pool.fetchrow("SELECT count(*), COALESCE(sum(size), 0) FROM "
                                               "uploads WHERE tenant = $1", tenant)
        return count, int(used)

    async def get_upload(self, tenant: str, upload_id: str) -> UploadRecord | None:
        row = await self.pool.fetchrow(f"SELECT {_UPLOAD_COLUMNS} FROM uploads WHERE "
                                       "tenant = $1 AND id = $2", tenant, upload_id)
        return _upload(row) if row else None

    async def list_uploads(self, tenant: str) -> list[UploadRecord]:
        rows = await self.pool.fetch(f"SELECT {_UPLOAD_COLUMNS} FROM uploads WHERE tenant = $1 "
                                     "ORDER BY created_at, id", tenant)
        return [_upload(row) for row in rows]

    async def delete_upload(self, tenant: str, upload_id: str) -> None:
        await self.pool.execute("DELETE FROM uploads WHERE tenant = $1 AND id = $2",
                                tenant, upload_id)

    # -- runs --------------------------------------------------------------------------
    async def put_run(self, record: RunRecord) -> int:
        body = json.dumps(record.body, ensure_ascii=False)
        size = len(body.encode())
        await self.pool.execute(
            "INSERT INTO runs (tenant, id, container_id, status, created_at, body, bytes) "
            "VALUES ($1,$2,$3,$4,$5,$6,$7) ON CONFLICT (tenant, id) DO UPDATE SET "
            "container_id = EXCLUDED.container_id, status = EXCLUDED.status, "
            "created_at = EXCLUDED.created_at, body = EXCLUDED.body, bytes = EXCLUDED.bytes",
            record.tenant, record.id, record.container_id, record.status, record.created_at,
            body, size)
        return size

    async def trim_runs(self, tenant: str, keep_bytes: int) -> int:
        total = await self.pool.fetchval(
            "SELECT COALESCE(SUM(bytes), 0) FROM runs WHERE tenant = $1", tenant)
        if total <= keep_bytes:
            return 0
        status = await self.pool.execute(_TRIM_RUNS.format("$1", "$2"), tenant,
                                         total - keep_bytes)
        return int(status.split()[-1])

    async def get_run(self, tenant: str, run_id: str) -> RunRecord | None:
        row = await self.pool.fetchrow("SELECT tenant, id, container_id, status, created_at, body "
                                       "FROM runs WHERE tenant = $1 AND id = $2", tenant, run_id)
        if row is None:
            return None
        return RunRecord(tenant=row[0], id=row[1], container_id=row[2], status=row[3],
                         created_at=row[4], body=json.loads(row[5]))

    async def delete_runs_before(self, created_before: float) -> int:
        status = await self.pool.execute("DELETE FROM runs WHERE created_at < $1", created_before)
        return int(status.split()[-1])

    # -- stored responses ------------------------------------------------------------------
    async def put_response(self, record: ResponseRecord) -> None:
        body, state, size = _response_texts(record)
        await self.pool.execute(
            "INSERT INTO responses (tenant, id, created_at, body, state, bytes) "
            "VALUES ($1,$2,$3,$4,$5,$6) "
            "ON CONFLICT (tenant, id) DO UPDATE SET created_at = EXCLUDED.created_at, "
            "body = EXCLUDED.body, state = EXCLUDED.state, bytes = EXCLUDED.bytes",
            record.tenant, record.id, record.created_at, body, state, size)

    async def stored_response_bytes(self, tenant: str) -> int:
        return int(await self.pool.fetchval(
            "SELECT COALESCE(SUM(bytes), 0) FROM responses WHERE tenant = $1", tenant))

    async def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None:
        row = await self.pool.fetchrow("SELECT tenant, id, created_at, body, state FROM responses "
                                       "WHERE tenant = $1 AND id = $2", tenant, response_id)
        if row is None:
            return None
        return ResponseRecord(tenant=row[0], id=row[1], created_at=row[2],
                              body=json.loads(row[3]), state=json.loads(row[4]))

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        status = await self.pool.execute("DELETE FROM responses WHERE tenant = $1 AND id = $2",
                                         tenant, response_id)
        return status != "DELETE 0"

    async def delete_responses_before(self, created_before: float) -> int:
        status = await self.pool.execute("DELETE FROM responses WHERE created_at < $1",
                                         created_before)
        return int(status.split()[-1])

    # -- responses passed through ----------------------------------------------------------
    async def note_passed_response(self, owner: PassedResponse) -> None:
        await self.pool.execute(
            "INSERT INTO passed_responses (id, tenant, scope, created_at) VALUES ($1,$2,$3,$4) "
            "ON CONFLICT (id) DO NOTHING", owner.id, owner.tenant, owner.scope, owner.created_at)

    async def passed_response(self, response_id: str) -> PassedResponse | None:
        row = await self.pool.fetchrow("SELECT id, tenant, scope, created_at FROM "
                                       "passed_responses WHERE id = $1", response_id)
        return PassedResponse(*row) if row is not None else None

    async def delete_passed_responses_before(self, created_before: float) -> int:
        status = await self.pool.execute("DELETE FROM passed_responses WHERE created_at < $1",
                                         created_before)
        return int(status.split()[-1])
