"""Tenants' uploads in an S3-compatible object store (cluster mode).

With ``--object-store s3://bucket[/prefix]``, a Files API upload is written to
the bucket, its MD5 checked by the store, before the upload is acknowledged;
any front end sharing the bucket (and the metadata database) serves it. What
lives here is only the bytes: names, sizes and owners stay in the metadata
store, as for the embedded store.

Containers' files live on the local volumes (:class:`.filestore.LocalFileStore`):
a sandbox works on a mounted filesystem, not on objects. The bucket holds each
container's snapshot (:mod:`.snapshots`), written when its sandbox is shut
down, on a cadence while it runs, and before a Files API write to it is
acknowledged; a host that attaches a container whose local copy is missing or
older than the snapshot restores it first. So a container outlives the host
that ran it, and front ends sharing the bucket serve each other's containers.
One host at a time works on a container: nothing here arbitrates two hosts
writing the same container at once (routing a container to one host is the
placement layer's part).

Keys are hashes of the tenant and the upload id, as on disk: nothing a client
chose becomes part of a key as it is. boto3 is the client (imported only where
an object store is configured); its calls block, and the sessions layer runs
them in threads, as it does the local store's.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from shoal.sandbox import FileMissing, FileTooLarge, SandboxFiles
from shoal.sandbox.mounts import SandboxHome

from .filestore import FileStore, LocalFileStore, StoreUnavailable, _key
from .snapshots import Manifest, Snapshots, SnapshotTooLarge

log = logging.getLogger("shoal.storage")

_CHUNK = 1 << 20
# Uploads up to this size are spooled in memory before they are sent; larger
# ones on the data directory's disk (the store needs the whole body's MD5 first).
_SPOOL_BYTES = 8 << 20


@dataclass(frozen=True)
class ObjectStoreConfig:
    url: str  # s3://bucket[/prefix]
    endpoint: str = ""
    region: str = "us-east-1"
    access_key: str = field(default="", repr=False)
    secret_key: str = field(default="", repr=False)

    @property
    def bucket(self) -> str:
        return self.url[5:].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        rest = self.url[5:].partition("/")[2].strip("/")
        return f"{rest}/" if rest else ""

    def where(self) -> str:
        """The store, named for messages (never its keys)."""
        return f"{self.url} at {self.endpoint}" if self.endpoint else self.url

    def client(self):
        credentials = {}
        if self.access_key or self.secret_key:
            credentials = {"aws_access_key_id": self.access_key,
                           "aws_secret_access_key": self.secret_key}
        return boto3.client(
            "s3", endpoint_url=self.endpoint or None, region_name=self.region,
            # Content-MD5 is the integrity check every S3-compatible store knows;
            # botocore's newer default checksums are not (some stores refuse them).
            config=Config(retries={"max_attempts": 3, "mode": "standard"},
                          connect_timeout=5, read_timeout=60, max_pool_connections=32,
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required",
                          s3={"addressing_style": "path"}),
            **credentials)


def object_store_problem(config: ObjectStoreConfig) -> str | None:
    """Why the bucket cannot be used (checked before serving), or None."""
    try:
        config.client().head_bucket(Bucket=config.bucket)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        reason = {"404": "no such bucket", "NoSuchBucket": "no such bucket",
                  "403": "access denied (check the keys)"}.get(code, str(exc))
        return f"cannot use the object store {config.where()}: {reason}"
    except (BotoCoreError, ValueError) as exc:
        return f"cannot reach the object store {config.where()}: {exc}"
    return None


@contextlib.contextmanager
def _store_errors(what: str):
    """The store's failures as StoreUnavailable (a 503 for the client), logged for
    the operator; never with keys or credentials."""
    try:
        yield
    except ClientError as exc:
        error = exc.response.get("Error", {})
        log.warning("object store refused to %s: %s", what, error.get("Code", "?"))
        raise StoreUnavailable(f"the file store could not {what} ({error.get('Code', 'error')}); "
                               "retry later") from None
    except BotoCoreError as exc:
        log.warning("object store unreachable to %s: %s", what, type(exc).__name__)
        raise StoreUnavailable(f"the file store could not {what}; retry later") from None


_MARKER = ".snapshot"


def _read_marker(marker: Path) -> dict:
    """A local copy's marker: JSON, or (written by an older Shoal) the version alone."""
    text = marker.read_text()
    if text.startswith("{"):
        try:
            body = json.loads(text)
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}
    return {"version": text}


class ObjectStoreFiles(FileStore):
    """Uploads in the bucket; containers on the local volumes, snapshotted to it."""

    snapshots = True

    def __init__(self, local: LocalFileStore, config: ObjectStoreConfig, spool_dir: Path,
                 max_file_bytes: int) -> None:
        self._local = local
        self._config = config
        self._client = config.client()
        self._spool_dir = spool_dir
        self._max_file_bytes = max_file_bytes
        self._snapshots = Snapshots(self._client, config.bucket, config.prefix)
        # Containers a sandbox on this host works on: their local copy is the
        # truth while it does, and the bucket is not asked again.
        self._attached: set[tuple[str, str]] = set()
        # The manifest each local copy matches, once known here.
        self._known: dict[tuple[str, str], Manifest] = {}
        # Copies whose last save failed, retried until one succeeds. Their
        # markers say so too: a server restarted before its retry retries
        # still (its list was in memory only, and a copy newer than its
        # snapshot stayed so, on this host only, until its next change).
        self._unsaved: set[tuple[str, str]] = set(self._flagged_unsaved())
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_lock = threading.Lock()

    # -- containers: local volumes, snapshots in the bucket ----------------------------
    def _lock(self, key: tuple[str, str]) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(key, threading.Lock())

    def _marker(self, tenant: str, container_id: str) -> Path:
        """Beside the volume's image: the snapshot version the local copy matches,
        and whose copy it is (the image's name is a hash of the container's id)."""
        return self._local.volume(tenant, container_id).image.with_suffix(_MARKER)

    def _local_version(self, tenant: str, container_id: str) -> str | None:
        try:
            return _read_marker(self._marker(tenant, container_id)).get("version") or None
        except OSError:
            return None

    def _set_local_version(self, tenant: str, container_id: str, version: str,
                           unsaved: bool = False) -> None:
        marker = self._marker(tenant, container_id)
        partial = marker.with_suffix(".partial")
        body = {"version": str(version), "tenant": tenant, "container": container_id}
        if unsaved:
            body["unsaved"] = True
        partial.write_text(json.dumps(body))
        os.replace(partial, marker)

    def _markers(self) -> list[tuple[tuple[str, str], dict]]:
        found = []
        for marker in self._local.beside_images(_MARKER):
            try:
                named = _read_marker(marker)
            except OSError:
                continue
            key = (named.get("tenant"), named.get("container"))
            if all(isinstance(part, str) for part in key):
                found.append((key, named))
        return found

    def _flagged_unsaved(self) -> list[tuple[str, str]]:
        return [key for key, named in self._markers() if named.get("unsaved") is True]

    def local_copies(self) -> list[tuple[str, str]]:
        return [key for key, _ in self._markers() if key not in self._attached]

    def drop_idle_copy(self, tenant: str, container_id: str) -> bool:
        key = (tenant, container_id)
        with self._lock(key):
            if key in self._attached:
                return False
            self._local.destroy(tenant, container_id)
            self._marker(tenant, container_id).unlink(missing_ok=True)
            self._known.pop(key, None)
            self._unsaved.discard(key)
            return True

    def _up_to_date(self, tenant: str, container_id: str) -> tuple[SandboxHome, bool]:
        """The local copy made the bucket's snapshot if it is not that already;
        and whether that restore brought in a sandbox's work from elsewhere."""
        key = (tenant, container_id)
        with _store_errors("read the container's snapshot"):
            manifest = self._snapshots.manifest(tenant, container_id)
        volume = self._local.volume(tenant, container_id)
        local = self._local_version(tenant, container_id)
        if manifest is None:
            if local is not None and volume.exists:
                # Snapshotted once, and the snapshot is gone: the container was
                # deleted elsewhere; what is here is not the current one's.
                self._local.destroy(tenant, container_id)
                self._marker(tenant, container_id).unlink(missing_ok=True)
            self._known.pop(key, None)
            # VolumeMissing where none is left: whether the container still
            # exists (and so gets an empty volume) is the sessions layer's to say.
            return self._local.home(tenant, container_id), False
        if volume.exists and local == manifest.version:
            self._known[key] = manifest
            return self._local.home(tenant, container_id), False
        self._local.destroy(tenant, container_id)
        self._marker(tenant, container_id).unlink(missing_ok=True)
        home = self._local.create(tenant, container_id)  # a fresh one, for the snapshot
        try:
            with _store_errors("restore the container's files"):
                self._snapshots.restore(tenant, container_id, home.root, manifest)
        except BaseException:
            self._local.destroy(tenant, container_id)  # never half a container
            raise
        self._set_local_version(tenant, container_id, manifest.version)
        self._known[key] = manifest
        log.info("container restored from its snapshot (version %s, %d entries)",
                 manifest.version, len(manifest.entries))
        return home, manifest.sandboxed

    def attach(self, tenant: str, container_id: str) -> tuple[SandboxHome, bool]:
        key = (tenant, container_id)
        with self._lock(key):
            home, restored = self._up_to_date(tenant, container_id)
            self._attached.add(key)
            return home, restored

    def create(self, tenant: str, container_id: str) -> SandboxHome:
        with self._lock((tenant, container_id)):
            return self._local.create(tenant, container_id)

    def home(self, tenant: str, container_id: str) -> SandboxHome:
        key = (tenant, container_id)
        if key in self._attached:
            return self._local.home(tenant, container_id)
        with self._lock(key):
            return self._up_to_date(tenant, container_id)[0]

    def files(self, tenant: str, container_id: str, uid: int) -> SandboxFiles:
        return SandboxFiles(self.home(tenant, container_id), uid, self._max_file_bytes)

    def checkpoint(self, tenant: str, container_id: str, sandboxed: bool = False) -> None:
        key = (tenant, container_id)
        with self._lock(key):
            self._checkpoint_locked(key, sandboxed)

    def _checkpoint_locked(self, key: tuple[str, str], sandboxed: bool) -> None:
        tenant, container_id = key
        if not self._local.volume(tenant, container_id).exists:
            self._unsaved.discard(key)
            return
        home = self._local.home(tenant, container_id)
        try:
            with _store_errors("save the container's files"):
                previous = self._known.get(key)
                if previous is None:
                    previous = self._snapshots.manifest(tenant, container_id)
                self._spool_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                manifest, sent = self._snapshots.save(
                    tenant, container_id, home.root, previous, sandboxed or key in self._attached,
                    self._spool_dir)
        except SnapshotTooLarge as exc:
            # Retrying cannot help: the files stay on this host only, said loudly.
            self._unsaved.discard(key)
            log.error("container %s is not snapshotted (its files stay on this host only): "
                      "%s", container_id, exc)
            return
        except BaseException:
            if key not in self._unsaved:
                self._unsaved.add(key)
                try:
                    self._set_local_version(tenant, container_id,
                                            self._local_version(tenant, container_id) or "",
                                            unsaved=True)
                except OSError as exc:
                    log.error("container %s: could not note its failed snapshot beside its "
                              "volume (retried while this server runs): %s", container_id, exc)
            raise
        was_unsaved = key in self._unsaved
        self._unsaved.discard(key)
        if manifest is not previous or was_unsaved:
            self._set_local_version(tenant, container_id, manifest.version)
            log.debug("container %s snapshotted: version %s, %d bytes sent", container_id,
                      manifest.version, sent)
        self._known[key] = manifest

    def unsaved(self) -> list[tuple[str, str]]:
        return list(self._unsaved)

    def drop_local(self, tenant: str, container_id: str) -> None:
        key = (tenant, container_id)
        with self._lock(key):
            self._local.destroy(tenant, container_id)
            self._marker(tenant, container_id).unlink(missing_ok=True)
            self._attached.discard(key)
            self._known.pop(key, None)

    def detach(self, tenant: str, container_id: str) -> None:
        key = (tenant, container_id)
        with self._lock(key):
            try:
                self._checkpoint_locked(key, sandboxed=True)
            except StoreUnavailable:
                pass  # kept here, and tried again (unsaved); logged by _store_errors
            finally:
                self._attached.discard(key)
                self._local.detach(tenant, container_id)

    def destroy(self, tenant: str, container_id: str) -> None:
        key = (tenant, container_id)
        with self._lock(key):
            # The snapshot first: a container is gone once no host can restore it.
            with _store_errors("delete the container's files"):
                self._snapshots.delete(tenant, container_id)
            self._local.destroy(tenant, container_id)
            self._marker(tenant, container_id).unlink(missing_ok=True)
            self._attached.discard(key)
            self._known.pop(key, None)
            self._unsaved.discard(key)
        with self._locks_lock:
            self._locks.pop(key, None)

    def usage(self) -> tuple[int, int]:
        return self._local.usage()

    def close(self) -> None:
        self._local.close()

    # -- uploads: the bucket's ---------------------------------------------------------
    def _object_key(self, tenant: str, upload_id: str) -> str:
        return f"{self._config.prefix}uploads/{_key(tenant, 16)}/{_key(upload_id, 32)}"

    def write_upload(self, tenant: str, upload_id: str, source: BinaryIO) -> int:
        self._spool_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        digest = hashlib.md5(usedforsecurity=False)
        written = 0
        with tempfile.SpooledTemporaryFile(_SPOOL_BYTES, dir=self._spool_dir) as spool:
            while chunk := source.read(_CHUNK):
                written += len(chunk)
                if written > self._max_file_bytes:
                    raise FileTooLarge(f"file is larger than {self._max_file_bytes} bytes")
                digest.update(chunk)
                spool.write(chunk)
            spool.seek(0)
            # The store checks the MD5 and refuses a body that arrived otherwise:
            # what is acknowledged is what was sent.
            with _store_errors("store the upload"):
                self._client.put_object(
                    Bucket=self._config.bucket, Key=self._object_key(tenant, upload_id),
                    Body=spool, ContentLength=written,
                    ContentMD5=base64.b64encode(digest.digest()).decode())
        return written

    def open_upload(self, tenant: str, upload_id: str) -> tuple[BinaryIO, int]:
        with _store_errors("read the upload"):
            try:
                found = self._client.get_object(Bucket=self._config.bucket,
                                                Key=self._object_key(tenant, upload_id))
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    raise FileMissing(f"no such file: {upload_id}") from None
                raise
        return found["Body"], int(found["ContentLength"])

    def delete_upload(self, tenant: str, upload_id: str) -> None:
        with _store_errors("delete the upload"):
            self._client.delete_object(Bucket=self._config.bucket,
                                       Key=self._object_key(tenant, upload_id))
