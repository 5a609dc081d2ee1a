"""The metadata store: what containers and files exist, whose they are, and when.

A small interface with plain records, so that the embedded SQLite store and a
later PostgreSQL one are interchangeable: nothing above this module writes SQL
or knows which database answers. Every method is scoped by tenant; there is no
way to ask for another tenant's rows.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class ContainerRecord:
    tenant: str
    id: str
    name: str | None
    created_at: float
    last_active_at: float
    expires_after_minutes: int
    status: str = "active"  # active | expired | deleted
    implicit: bool = False
    memory_limit: str | None = None
    # The container's network_policy as given (JSON text), domain secrets included;
    # None: the operator's egress allowlist as it is.
    network_policy: str | None = None

    @property
    def expires_at(self) -> float:
        return self.last_active_at + self.expires_after_minutes * 60

    def touched(self, now: float) -> "ContainerRecord":
        return replace(self, last_active_at=now)


@dataclass(frozen=True)
class FileRecord:
    """A file in a container, by its absolute sandbox path."""

    tenant: str
    container_id: str
    path: str
    created_at: float
    size: int
    source: str = "user"  # user | assistant
    etag: str | None = None
    # The file's mtime in ns when the row was written (0: before schema 6):
    # a file found with another was changed since, and its etag is unknown.
    modified_ns: int = 0


@dataclass(frozen=True)
class UploadRecord:
    """A file uploaded to a tenant's Files API, not (yet) in any container."""

    tenant: str
    id: str
    filename: str
    size: int
    created_at: float
    purpose: str | None = None
    mime_type: str = "application/octet-stream"
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RunRecord:
    """A finished (or running) run, as kept for later reads: the record is its
    dialect-neutral body, a JSON object."""

    tenant: str
    id: str
    container_id: str | None
    status: str
    created_at: float
    body: dict


@dataclass(frozen=True)
class ResponseRecord:
    """A stored /v1/responses object: what the client was sent, and the state a
    later request continues from (``previous_response_id``)."""

    tenant: str
    id: str
    created_at: float
    body: dict
    state: dict


@dataclass(frozen=True)
class PassedResponse:
    """A response the upstream model keeps, made by a request passed through
    here: whose it is. The operator's one upstream account keeps every
    tenant's, and answers anyone who names its id."""

    id: str
    tenant: str
    scope: str | None  # the sandbox whose code made it; None for a client
    created_at: float


class MetadataStore(abc.ABC):
    # Whether other front ends write this store too: what one front end caches
    # of it may then be stale, and the store is read where that matters.
    shared = False

    @abc.abstractmethod
    async def open(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    # -- containers ------------------------------------------------------------
    @abc.abstractmethod
    async def put_container(self, record: ContainerRecord) -> None:
        """Insert or replace."""

    @abc.abstractmethod
    async def touch_container(self, record: ContainerRecord) -> bool:
        """Move exactly this container's (id *and* creation time) last activity
        forward to ``record.last_active_at``, if it is still active; whether it
        is. Never writes anything else: a front end's cached copy cannot undo
        another's deletion, nor overwrite a container made anew under the id."""

    # -- placements (cluster mode): which sandbox host holds a container ------------------
    @abc.abstractmethod
    async def claim_placement(self, tenant: str, container_id: str, host: str,
                              replacing: str | None = None) -> str:
        """Place the container on ``host`` unless it is placed already (or, with
        ``replacing``, only if it is placed on that host, which is gone): the host
        that holds it after the call, atomically across front ends."""

    @abc.abstractmethod
    async def placement(self, tenant: str, container_id: str) -> str | None: ...

    @abc.abstractmethod
    async def drop_placement(self, tenant: str, container_id: str) -> None: ...

    @abc.abstractmethod
    async def forget_retired_containers(self, active_before: float) -> int:
        """Remove the rows of retired containers last active before a time (a
        missing row reads as a retired one: 404); how many were removed."""

    @abc.abstractmethod
    async def retire_container(self, record: ContainerRecord, status: str) -> bool:
        """Set the status of exactly this container (its id *and* creation time) if
        it is still active; whether it was. A container created anew under the
        same id, here or by another front end, is never retired by mistake."""

    @abc.abstractmethod
    async def create_container(self, record: ContainerRecord) -> bool:
        """Insert ``record`` unless a live container with its id exists (one that is
        active and not expired at ``record.created_at``: a deleted or expired one is
        replaced); whether it was. Of two callers creating the same container, one
        gets True."""

    @abc.abstractmethod
    async def get_container(self, tenant: str, container_id: str) -> ContainerRecord | None: ...

    @abc.abstractmethod
    async def list_containers(self, tenant: str, status: str = "active") -> list[ContainerRecord]:
        """Oldest first."""

    @abc.abstractmethod
    async def expired_containers(self, now: float,
                                 host: str | None = None) -> list[ContainerRecord]:
        """Active containers, of every tenant, whose idle TTL has run out by ``now``;
        with ``host``, only those placed on that sandbox host."""

    # -- container files -----------------------------------------------------------
    @abc.abstractmethod
    async def put_file(self, record: FileRecord) -> None:
        """Insert or replace (an overwrite keeps the path, updates the rest)."""

    @abc.abstractmethod
    async def get_file(self, tenant: str, container_id: str, path: str) -> FileRecord | None: ...

    @abc.abstractmethod
    async def list_files(self, tenant: str, container_id: str) -> list[FileRecord]:
        """Oldest first, ties broken by path."""

    @abc.abstractmethod
    async def delete_files(self, tenant: str, container_id: str, paths: list[str]) -> None: ...

    @abc.abstractmethod
    async def delete_container_files(self, tenant: str, container_id: str) -> None: ...

    # -- tenant uploads --------------------------------------------------------------
    @abc.abstractmethod
    async def put_upload(self, record: UploadRecord) -> None: ...

    @abc.abstractmethod
    async def add_upload(self, record: UploadRecord, max_bytes: int, max_files: int) -> bool:
        """Insert a new upload unless the tenant's uploads would then hold more than
        ``max_bytes`` or ``max_files``; whether it was. Atomic across front ends: of
        concurrent uploads that do not all fit, only those that fit are inserted."""

    @abc.abstractmethod
    async def upload_usage(self, tenant: str) -> tuple[int, int]:
        """How many uploads the tenant holds, and their bytes."""

    @abc.abstractmethod
    async def get_upload(self, tenant: str, upload_id: str) -> UploadRecord | None: ...

    @abc.abstractmethod
    async def list_uploads(self, tenant: str) -> list[UploadRecord]:
        """Oldest first."""

    @abc.abstractmethod
    async def delete_upload(self, tenant: str, upload_id: str) -> None: ...

    # -- runs --------------------------------------------------------------------------
    @abc.abstractmethod
    async def put_run(self, record: RunRecord) -> int:
        """Insert or replace; the bytes it takes, as stored."""

    @abc.abstractmethod
    async def trim_runs(self, tenant: str, keep_bytes: int) -> int:
        """Forget a tenant's oldest run records until the rest take at most
        ``keep_bytes``; how many were removed."""

    @abc.abstractmethod
    async def get_run(self, tenant: str, run_id: str) -> RunRecord | None: ...

    @abc.abstractmethod
    async def delete_runs_before(self, created_before: float) -> int:
        """Forget runs of every tenant created before a time; how many were removed."""

    # -- stored responses ------------------------------------------------------------------
    @abc.abstractmethod
    async def put_response(self, record: ResponseRecord) -> None: ...

    @abc.abstractmethod
    async def stored_response_bytes(self, tenant: str) -> int:
        """What a tenant's stored responses take, as stored."""

    @abc.abstractmethod
    async def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None: ...

    @abc.abstractmethod
    async def delete_response(self, tenant: str, response_id: str) -> bool: ...

    @abc.abstractmethod
    async def delete_responses_before(self, created_before: float) -> int: ...

    # -- responses passed through ----------------------------------------------------------
    @abc.abstractmethod
    async def note_passed_response(self, owner: PassedResponse) -> None:
        """Record whose it is (the first record of an id stands)."""

    @abc.abstractmethod
    async def passed_response(self, response_id: str) -> PassedResponse | None: ...

    @abc.abstractmethod
    async def delete_passed_responses_before(self, created_before: float) -> int: ...
