"""Which files a call produced.

A snapshot of outputs (recursively, bounded) and of the workspace's top level
is taken before and after each call; whatever is new or changed is reported,
newest first capped at the per-call limit. Looking from inside the sandbox means
the walk sees exactly what the code sees and never follows a link out of it.
"""

from __future__ import annotations

import os

WORKSPACE = "/home/agent/workspace"
OUTPUTS = "/mnt/user-data/outputs"
MAX_ENTRIES_SCANNED = 5000

Snapshot = dict[str, tuple[int, int, int]]


def snapshot() -> Snapshot:
    seen: Snapshot = {}
    _scan(OUTPUTS, seen, recursive=True)
    _scan(WORKSPACE, seen, recursive=False)
    return seen


def produced_since(before: Snapshot, limit: int) -> list[dict]:
    after = snapshot()
    changed = [(path, meta) for path, meta in after.items() if before.get(path) != meta]
    changed.sort(key=lambda item: item[1][0], reverse=True)
    return [{"path": path, "size": meta[1]} for path, meta in changed[:limit]]


def _scan(directory: str, seen: Snapshot, recursive: bool) -> None:
    pending = [directory]
    while pending and len(seen) < MAX_ENTRIES_SCANNED:
        current = pending.pop()
        try:
            entries = os.scandir(current)
        except OSError:
            continue
        with entries:
            for entry in entries:
                if not _utf8(entry.path):
                    continue  # no API could name it; the host never hears of it
                try:
                    if entry.is_file(follow_symlinks=False):
                        stat = entry.stat(follow_symlinks=False)
                        seen[entry.path] = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
                    elif recursive and entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
                except OSError:
                    continue
                if len(seen) >= MAX_ENTRIES_SCANNED:
                    return


def _utf8(path: str) -> bool:
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
