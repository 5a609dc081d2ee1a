"""Leases of unprivileged uids, one per live sandbox.

Two sandboxes never share a uid, so even a process that slipped out of its
namespaces could not signal, ptrace or read the files of another sandbox. The
uids come from a configured range that must not belong to any real account.
"""

from __future__ import annotations


class UidsExhausted(RuntimeError):
    """Every uid of the range is leased."""


class UidAllocator:
    def __init__(self, base: int, count: int) -> None:
        self._free = list(range(base + count - 1, base - 1, -1))
        self._leased: set[int] = set()

    def lease(self) -> int:
        if not self._free:
            raise UidsExhausted("no sandbox uid is free; raise SHOAL_UID_COUNT")
        uid = self._free.pop()
        self._leased.add(uid)
        return uid

    def release(self, uid: int) -> None:
        if uid in self._leased:
            self._leased.remove(uid)
            # Reuse the longest-free uid last, so a uid is not recycled while
            # anything of its previous holder could still be settling.
            self._free.insert(0, uid)

    @property
    def leased(self) -> frozenset[int]:
        return frozenset(self._leased)
