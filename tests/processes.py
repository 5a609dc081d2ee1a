"""The host's processes as /proc shows them, for suites that audit sandboxes by uid."""

from __future__ import annotations

import os


def host_processes() -> list[dict]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as handle:
                fields = dict(line.rstrip("\n").split(":\t", 1) for line in handle if ":\t" in line)
            found.append({"pid": int(name), "name": fields.get("Name", ""),
                          "state": fields.get("State", "?")[:1],
                          "ppid": int(fields.get("PPid", "0")),
                          "uid": int(fields["Uid"].split()[0]),
                          # The pid in each namespace, the host's first: one entry
                          # for a process of the host's pid namespace.
                          "nspid": [int(n) for n in fields.get("NSpid", name).split()]})
        except (OSError, ValueError, KeyError):
            continue  # gone meanwhile
    return found


def processes_in(uids: range | set[int]) -> list[dict]:
    return [p for p in host_processes() if p["uid"] in uids]
