"""Leases of unprivileged uids, one per live sandbox, host-wide.

Two sandboxes never share a uid, so even a process that slipped out of its
namespaces could not signal, ptrace or read the files of another sandbox, and
RLIMIT_NPROC (counted per uid) is a per-sandbox limit. Leases are lock files
held with ``flock``, so the guarantee holds across pools and across servers
sharing a uid range, and a crashed server's leases vanish with it.

A uid is checked again where it is leased and where a launcher is about to
use it (:func:`sandbox_uid`): the settings keep the range valid, but uid 0 or
(uid_t)-1 (which setresuid and setpriv read as "unchanged") would leave the
sandbox root, so neither is ever run, whatever handed it over.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from shoal.config import LAST_UID


class UidsExhausted(RuntimeError):
    """Every uid of the range is leased."""


class UnsafeUid(RuntimeError):
    """A uid no sandbox may run as; nothing is launched with it."""


def sandbox_uid(uid: int) -> int:
    """``uid``, if a sandbox may run as it; UnsafeUid (fail closed) otherwise."""
    if not 0 < uid <= LAST_UID:
        raise UnsafeUid(f"refusing to run a sandbox as uid {uid}: a sandbox uid is 1 to "
                        f"{LAST_UID} (0 is root, and setresuid reads {LAST_UID + 1} as "
                        "'unchanged', which leaves root)")
    return uid


class UidAllocator:
    def __init__(self, base: int, count: int, lock_dir: Path) -> None:
        self._base = base
        self._count = count
        self._lock_dir = lock_dir
        self._next = 0
        self._leased: dict[int, int] = {}  # uid -> fd holding its lock
        # The last lease found no free uid, and none was released since.
        self.exhausted = False

    def lease(self) -> int:
        self._lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for step in range(self._count):
            # Round-robin: a uid released a moment ago is the last to be reused.
            uid = sandbox_uid(self._base + (self._next + step) % self._count)
            if uid in self._leased:
                continue
            fd = os.open(self._lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._next = (self._next + step + 1) % self._count
            self._leased[uid] = fd
            return uid
        self.exhausted = True
        raise UidsExhausted(f"every sandbox uid ({self._count} from {self._base}) is leased; "
                            "retry when a session ends (the operator can raise "
                            "SHOAL_UID_COUNT)")

    def release(self, uid: int) -> None:
        fd = self._leased.pop(uid, None)
        if fd is not None:
            os.close(fd)
            self.exhausted = False

    @property
    def free(self) -> int:
        """Uids of the range this server does not hold (another server on the same
        range may hold some of them)."""
        return self._count - len(self._leased)

    @property
    def leased(self) -> frozenset[int]:
        return frozenset(self._leased)
