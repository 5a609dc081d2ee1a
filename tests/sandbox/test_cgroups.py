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


def _set_favordynmods(on: bool) -> None:
    """Set or clear cgroup2's favordynmods by hand, keeping the mount's other options."""
    import ctypes

    from shoal.sandbox.cgroups import _mounts

    point, options = next((point, options) for point, fstype, options in _mounts()
                          if fstype == "cgroup2")
    kept = [o for o in options if o not in ("rw", "ro", "favordynmods")]
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mount(None, point.encode(), None, ctypes.c_ulong(32),
                      ",".join(kept + (["favordynmods"] if on else [])).encode()) == 0, \
        ctypes.get_errno()


def _cgroup2_options() -> list[str] | None:
    from shoal.sandbox.cgroups import _mounts

    return next((options for _, fstype, options in _mounts() if fstype == "cgroup2"), None)


@pytest.mark.parametrize("wanted", [True, False])
async def test_the_pool_sets_favordynmods_when_asked_and_keeps_the_mounts_options(
        tmp_path, wanted):
    """With favordynmods a process moves into a cgroup without waiting for an RCU
    grace period; the pool sets it at start (the default), on the cgroup2 mount,
    and leaves every other option of that mount as it was; asked not to, it
    leaves the host alone."""
    from pathlib import Path

    from shoal.config import Settings
    from shoal.sandbox import SandboxPool
    from shoal.sandbox.cgroups import dynamic_changes_favored
    from tests.uid_slots import uid

    if _cgroup2_options() is None:
        pytest.skip("no cgroup2 mount on this host")
    before = set(_cgroup2_options()) - {"favordynmods"}
    _set_favordynmods(False)
    pool = SandboxPool(Settings(pool_size=0, data_dir=tmp_path / "data",
                                run_dir=Path("/run/shoal-test") / f"fdm-{secrets.token_hex(3)}",
                                uid_base=uid(283_000), uid_count=8,
                                cgroup_favor_dynmods=wanted))
    try:
        await pool.start()
        assert dynamic_changes_favored() is wanted
        assert set(_cgroup2_options()) - {"favordynmods"} == before
    finally:
        await pool.close()
        _set_favordynmods(True)  # as the other servers of this run left it
        subprocess.run(["rm", "-rf", str(pool.settings.run_dir)], check=False)
