"""One reading of a process's mount table (``/proc/<pid>/mountinfo``), for the
modules that look mounts up by their filesystem: the cgroup hierarchies on the
host, a sandbox's devpts."""

from __future__ import annotations


def mount_table(pid: int | str = "self") -> list[tuple[str, str, list[str]]]:
    """(mount point, fs type, super options) of each mount ``pid`` sees."""
    found = []
    with open(f"/proc/{pid}/mountinfo") as handle:
        for line in handle:
            left, _, right = line.partition(" - ")
            fstype, _source, options = right.split()[:3]
            found.append((left.split()[4], fstype, options.split(",")))
    return found
