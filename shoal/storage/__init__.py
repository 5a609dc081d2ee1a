"""Durable state behind two small interfaces: metadata and files.

The sessions layer talks to :class:`MetadataStore` and :class:`FileStore` only;
the embedded defaults (SQLite, a local directory of quota-bounded volumes) are
chosen here, in one place, so other backends slot in without touching callers.
"""

from pathlib import Path

from .filestore import FileStore, LocalFileStore, StoreUnavailable, VolumeMissing
from .metadata import (ContainerRecord, FileRecord, MetadataStore, PassedResponse, ResponseRecord,
                       RunRecord, UploadRecord)
from .sqlite import SqliteMetadataStore, data_dir_holder, schema_problem

METADATA_FILE = "shoal.sqlite3"

__all__ = [
    "ContainerRecord", "FileRecord", "FileStore", "LocalFileStore", "MetadataStore",
    "PassedResponse", "ResponseRecord", "RunRecord", "SqliteMetadataStore", "StoreUnavailable", "UploadRecord",
    "VolumeMissing",
    "data_dir_holder",
    "files_problem", "metadata_problem",
    "open_metadata", "open_files",
]


def open_metadata(data_dir: Path, database_url: str = "") -> MetadataStore:
    """PostgreSQL where a database URL is given (cluster mode, front ends sharing
    it), else the data directory's SQLite file."""
    if database_url:
        from .postgres import PostgresMetadataStore  # asyncpg only where it is used

        return PostgresMetadataStore(database_url)
    return SqliteMetadataStore(data_dir / METADATA_FILE)


def open_files(data_dir: Path, run_dir: Path, quota_bytes: int, max_file_bytes: int,
               object_store: dict | None = None) -> FileStore:
    """Containers on local volumes; uploads beside them, or in an S3-compatible
    object store where one is configured (cluster mode)."""
    local = LocalFileStore(data_dir, run_dir, quota_bytes, max_file_bytes)
    if not object_store:
        return local
    from .objectstore import ObjectStoreConfig, ObjectStoreFiles  # boto3 only where used

    return ObjectStoreFiles(local, ObjectStoreConfig(**object_store),
                            data_dir / "scratch" / "spool", max_file_bytes)


def files_problem(object_store: dict | None) -> str | None:
    """Why the configured object store cannot be used, or None."""
    if not object_store:
        return None
    try:
        from .objectstore import ObjectStoreConfig, object_store_problem
    except ImportError:
        return ("object_store needs the S3 client: install Shoal with its 'cluster' extra "
                "(pip install 'shoal[cluster]', which adds boto3)")
    return object_store_problem(ObjectStoreConfig(**object_store))


def metadata_problem(data_dir: Path, database_url: str = "") -> str | None:
    """Why the metadata (the database at ``database_url``, else the data
    directory's) cannot be served by this Shoal, or None."""
    if database_url:
        try:
            from .postgres import database_problem
        except ImportError:
            return ("database_url needs the PostgreSQL driver: install Shoal with its "
                    "'cluster' extra (pip install 'shoal[cluster]', which adds asyncpg)")
        return database_problem(database_url)
    return schema_problem(data_dir / METADATA_FILE)
