"""A sandbox's cgroup is killed and removed whole, in every hierarchy, on real cgroups.

A process can be in some of a group's hierarchies and not others (caught between
its writes to the procs files); a directory can stay busy past the first try. In
neither case may a group outlive its server.
"""

from __future__ import annotations

import secrets
import subprocess

import pytest

from shoal.sandbox.cgroups import CgroupManager, Limits

LIMITS = Limits(memory_bytes=64 << 20, pids=16, cpu_cores=0.5)


@pytest.fixture
def manager():
    manager = CgroupManager()
    made = []

    def create():
        group = manager.create(f"test-{secrets.token_hex(4)}", LIMITS)
        made.append(group)
        return group

    yield manager, create
    for group in made:  # whatever a failing test left
        for directory in group.directories.values():
            for child in directory.glob("child-*"):
                child.rmdir()
        group.kill(timeout=5)
        group.remove(timeout=5)


def test_a_process_in_one_hierarchy_only_is_killed_and_the_group_removed(manager):
    manager, create = manager
    group = create()
    if len(group.directories) < 2:
        pytest.skip("one cgroup hierarchy (v2 only): a process is in all or none")
    *_, last = group.directories.values()  # not the one a procs listing used to read
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        (last / "cgroup.procs").write_text(str(sleeper.pid))
        assert group.pids() == [sleeper.pid]
        manager.discard(group)
        assert sleeper.wait(5) == -9
        assert [d for d in group.directories.values() if d.exists()] == []
        assert manager.pending == 0
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_group_that_stays_busy_is_kept_and_removed_on_retry(manager):
    manager, create = manager
    group = create()
    first = next(iter(group.directories.values()))
    child = first / f"child-{secrets.token_hex(2)}"
    child.mkdir()  # a group with a child cannot be removed
    manager.discard(group, timeout=0.05)
    assert first.exists() and manager.pending == 1
    assert manager.retry() == 1  # still busy: still kept
    child.rmdir()
    assert manager.retry() == 0
    assert [d for d in group.directories.values() if d.exists()] == []
