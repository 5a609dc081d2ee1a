"""One uid slot per test process, so two suites on one host never meet.

Every suite audits the host by uid range (no process, lock or file of a
sandbox uid left behind), and a second ``make test`` in another clone uses the
same ranges: each would find the other's sandboxes and fail. So each pytest
process (and each benchmark run) claims a slot with ``flock``, held for its
lifetime, and every uid range it uses is offset by ``OFFSET``. A lone run gets
slot 0: the ranges written in the suites, unchanged. ``SHOAL_TEST_UID_SLOT``
picks a slot by hand.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

SLOTS = 4
# Larger than any range a suite uses (the gateway suites reach 900 million),
# and four of them stay below the largest uid Linux accepts (2**32 - 2).
SPAN = 1_000_000_000
_DIRECTORY = Path("/run/shoal-test-uid-slots")
_held: list[int] = []


def _claim() -> int:
    _DIRECTORY.mkdir(mode=0o700, parents=True, exist_ok=True)
    chosen = os.environ.get("SHOAL_TEST_UID_SLOT")
    slots = [int(chosen)] if chosen else range(SLOTS)
    if chosen and not 0 <= int(chosen) < SLOTS:
        # A slot past the last moves the suites' uids past 2**32 - 2.
        raise RuntimeError(f"SHOAL_TEST_UID_SLOT={chosen}: the slots are 0 to {SLOTS - 1}")
    for slot in slots:
        fd = os.open(_DIRECTORY / f"{slot}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _held.append(fd)  # released when this process exits
        return slot
    raise RuntimeError(f"no free test uid slot (of {list(slots)}): other test runs hold them")


SLOT = _claim()
OFFSET = SLOT * SPAN


def uid(base: int) -> int:
    """``base``, a uid written in a suite, moved into this process's slot."""
    return base + OFFSET
