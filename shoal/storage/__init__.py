"""Durable state behind two small interfaces: metadata and files.

The sessions layer talks to :class:`MetadataStore` and :class:`FileStore` only;
the embedded defaults (SQLite, a local directory of quota-bounded volumes) are
chosen here, in one place, so other backends slot in without touching callers.
"""

from pathlib import Path

from .filestore import FileStore, LocalFileStore
from .metadata import (ContainerRecord, FileRecord, MetadataStore, ResponseRecord, RunRecord,
                       UploadRecord)
from .sqlite import SqliteMetadataStore, data_dir_holder, schema_problem

METADATA_FILE = "shoal.sqlite3"

__all__ = [
    "ContainerRecord", "FileRecord", "FileStore", "LocalFileStore", "MetadataStore",
    "ResponseRecord", "RunRecord", "SqliteMetadataStore", "UploadRecord", "data_dir_holder",
    "metadata_problem",
    "open_metadata", "open_files",
]


def open_metadata(data_dir: Path) -> MetadataStore:
    return SqliteMetadataStore(data_dir / METADATA_FILE)


def open_files(data_dir: Path, run_dir: Path, quota_bytes: int, max_file_bytes: int) -> FileStore:
    return LocalFileStore(data_dir, run_dir, quota_bytes, max_file_bytes)


def metadata_problem(data_dir: Path) -> str | None:
    """Why the metadata in ``data_dir`` cannot be served by this Shoal, or None."""
    return schema_problem(data_dir / METADATA_FILE)
