"""The warm pool: leases come warm, the pool refills, and nothing is ever left behind.

"Nothing left behind" is checked from the host's point of view as well as the
pool's own ``leftovers()``: no process runs as a sandbox uid that is not leased,
no bubblewrap process outlives its sandbox, the host's mount table is untouched.
Sandbox uids are per pool range (``SHOAL_UID_BASE`` for the session pool, 410000
and up for the private pools made here), so other people's sandboxes on the same
host never count.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from shoal.config import Settings
from shoal.sandbox import SandboxPool
from tests.processes import host_processes, processes_in
from tests.uid_slots import uid

PRIVATE_UID_BASE = uid(410000)
# Host-side zombies of a sandbox's init are reaped by the host's pid 1, which may
# take a moment; live processes must be gone at once, zombies within this delay.
REAP_SECONDS = 30.0


# -- host-side observation -------------------------------------------------------------
async def wait_for_no_strays(base: int, count: int, allowed_uids) -> list[dict]:
    """Processes of the range whose uid is not allowed; waits for zombies to be reaped.

    A stray that is alive (not a zombie) fails at once: a killed sandbox has no
    running process.
    """
    allowed = set(allowed_uids)
    deadline = time.monotonic() + REAP_SECONDS
    while True:
        strays = [p for p in processes_in(range(base, base + count)) if p["uid"] not in allowed]
        alive = [p for p in strays if p["state"] != "Z"]
        if alive or not strays or time.monotonic() > deadline:
            return strays
        await asyncio.sleep(0.05)


def sandbox_roots(pool) -> list[dict]:
    """The top process of each live sandbox: our own bubblewrap children, or the
    inits the zygote's builder forks (the builder is the zygote's one child that
    runs as root; the zygote's other children are agents)."""
    zygote = pool._zygote
    processes = host_processes()
    if zygote is None:
        parents, name = {os.getpid()}, "bwrap"
    else:
        parents = {p["pid"] for p in processes if p["ppid"] == zygote._popen.pid and p["uid"] == 0}
        assert len(parents) == 1, f"the zygote has {len(parents)} builders"
        name = None
    return [p for p in processes
            if p["ppid"] in parents and p["state"] != "Z" and name in (None, p["name"])]


async def settle(pool, timeout: float = 60) -> None:
    """Wait until the pool holds what it aims to, with no launch under way: misses
    grow it for the next burst (up to pool_max), and a launch in flight has
    mounts that no listing names yet."""
    await pool.wait_warm()
    deadline = time.monotonic() + timeout
    while (pool.ready_count != pool.target or pool._warming) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def mount_count(excluding: set[str] = frozenset()) -> int:
    """Lines of the host's mount table, leaving out mounts other people's Shoal runs
    make on this host at the same time (any mount point with "shoal" in it that is
    not this process's) and those of the live sandboxes named in ``excluding`` (a
    warm pool's size changes with demand)."""
    mine = re.compile(rf"/sandboxes-{os.getpid()}[.-][0-9a-f]+/([^/]+)")
    count = 0
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            point = line.split()[4]
            ours = mine.search(point)
            if "shoal" in point and not ours:
                continue
            if ours and ours.group(1) in excluding:
                continue
            count += 1
    return count


def loop_backing_files() -> list[str]:
    """Files behind the host's loop devices (a sandbox's volume is one)."""
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            found.append(backing.read_text().strip())
        except OSError:
            continue
    return found


def prefix_of(sandbox) -> str:
    return sandbox.name.rsplit("-", 1)[0] + "-"


def stem(entry) -> str:
    """A sandbox's name from one leftover entry: a name, a directory, an image file."""
    name = Path(str(entry)).name
    return name.removesuffix(".img")


def own(leftovers: dict, prefix: str) -> dict:
    """The leftovers that carry this pool's name prefix (cgroup parents are shared)."""
    return {key: sorted(values) if key == "uids"
            else sorted((v for v in values if stem(v).startswith(prefix)), key=str)
            for key, values in leftovers.items()}


def all_empty(leftovers: dict) -> bool:
    return all(values == [] for values in leftovers.values())


async def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def private_settings(run_dir: Path, uid_base: int = PRIVATE_UID_BASE, **overrides) -> Settings:
    return Settings(run_dir=run_dir, uid_base=uid_base, **{"pool_size": 2, **overrides})


async def close_and_remove(private: SandboxPool, run_dir: Path) -> None:
    await private.close()
    shutil.rmtree(run_dir, ignore_errors=True)


# -- leasing -----------------------------------------------------------------------------
async def test_leased_sandbox_is_warm(pool, settings):
    await pool.wait_warm()
    sandbox = await pool.lease()
    try:
        modules = settings.preload
        assert modules, "the pool preloads modules by default"
        result = await sandbox.run_python(
            f"import sys\nprint([m for m in {modules!r} if m not in sys.modules])")
        assert result.return_code == 0, result.stderr
        assert result.stdout == "[]\n"
    finally:
        await sandbox.close()


async def test_pool_refills_after_a_lease(pool, settings):
    await settle(pool)  # its size, or more if an earlier burst grew it
    target = pool.target
    assert target >= settings.pool_size and pool.ready_count == target
    sandbox = await pool.lease()
    try:
        assert pool.ready_count == target - 1
        refilled = await wait_for(lambda: pool.ready_count == pool.target, timeout=60)
        assert refilled, f"ready_count stayed at {pool.ready_count}"
    finally:
        await sandbox.close()


async def test_lease_from_an_empty_pool_launches_on_demand(pool, settings):
    await pool.wait_warm()
    sandboxes = [await pool.lease() for _ in range(settings.pool_size + 1)]
    try:
        assert len({s.name for s in sandboxes}) == len(sandboxes)
        for sandbox in sandboxes:
            result = await sandbox.run_python("print('up')")
            assert result.stdout == "up\n"
    finally:
        for sandbox in sandboxes:
            await sandbox.close()


async def test_sandboxes_launched_at_once_each_get_their_own(pool, settings):
    """Launches under way at the same time (the zygote takes a new one while
    another's walls are built) are answered each with its own sandbox: its channel
    reaches an agent running as its uid, in its own init's namespaces."""
    await settle(pool)
    sandboxes = await asyncio.gather(*(pool._launch_new() for _ in range(6)))
    try:
        assert len({s.uid for s in sandboxes}) == 6
        answers = await asyncio.gather(*(s.run_python("import os\nprint(os.getuid())")
                                         for s in sandboxes))
        assert [a.stdout for a in answers] == [f"{s.uid}\n" for s in sandboxes]
        if pool.launcher == "zygote":
            for sandbox in sandboxes:
                process = sandbox._process
                assert (os.readlink(f"/proc/{process.forked_agent}/ns/mnt")
                        == os.readlink(f"/proc/{process.outer_pid}/ns/mnt"))
    finally:
        await asyncio.gather(*(s.close() for s in sandboxes))


async def test_the_refill_waits_while_leases_wait_for_their_own(settings, tmp_path):
    """A lease that found the pool empty launches its own sandbox; while any such
    lease waits, the refill starts nothing (its launches would take CPU from the
    requests waiting now), and it refills once they are served."""
    private = SandboxPool(private_settings(settings.run_dir, pool_size=1, data_dir=tmp_path))
    await private.start()
    try:
        await private.wait_warm()
        launches = private.stats.launches
        first = await private.lease()  # the warm one: the refill would start now
        private._waiting += 1  # as a lease waiting for its own launch holds it
        try:
            private._wakeup.set()
            await asyncio.sleep(0.5)
            assert private.stats.launches == launches and not private._warming
        finally:
            private._waiting -= 1
        private._wakeup.set()
        refilled = await wait_for(lambda: private.ready_count == private.target, timeout=60)
        assert refilled and private.stats.launches == launches + 1
        await first.close()
    finally:
        await private.close()


async def test_two_sandboxes_are_isolated_from_each_other(pool, settings):
    first, second = await pool.lease(), await pool.lease()
    try:
        assert first.name != second.name
        assert first.uid != second.uid
        for sandbox in (first, second):
            assert settings.uid_base <= sandbox.uid < settings.uid_base + settings.uid_count
        ids = [await s.run_python("import os\nprint(os.getuid())") for s in (first, second)]
        assert [r.stdout for r in ids] == [f"{first.uid}\n", f"{second.uid}\n"]

        written = await first.run_bash("echo mine > ws.txt && echo mine > "
                                       "/mnt/user-data/outputs/out.txt && echo mine > /tmp/t.txt")
        assert written.return_code == 0, written.stderr
        looked = await second.run_bash("ls ws.txt /mnt/user-data/outputs/out.txt /tmp/t.txt")
        assert looked.return_code != 0
        assert looked.stdout == ""
        assert (await first.run_bash("cat ws.txt")).stdout == "mine\n"

        # Python state is not shared either.
        await first.run_python("secret = 1")
        assert "NameError" in (await second.run_python("secret")).stderr
        # Nor can one see the other's processes.
        procs = await second.run_bash("ls /proc | grep -c '^[0-9]'")
        assert int(procs.stdout) < 10
    finally:
        await first.close()
        await second.close()


async def test_closed_sandbox_refuses_calls(pool):
    sandbox = await pool.lease()
    await sandbox.close()
    assert sandbox.closed
    with pytest.raises(RuntimeError):
        await sandbox.run_python("print(1)")
    await sandbox.close()  # closing twice is harmless


# -- nothing is left behind ------------------------------------------------------------------
@pytest.mark.parametrize("cycles", [20, pytest.param(200, marks=pytest.mark.slow)])
async def test_lease_close_cycles_leave_nothing_behind(pool, settings, cycles):
    await settle(pool)
    mounts_before = mount_count(excluding=set(pool.leftovers()["sandboxes"]))
    probe = await pool.lease()
    prefix = prefix_of(probe)
    await probe.close()

    started = time.monotonic()
    for _ in range(cycles):
        sandbox = await pool.lease()
        try:
            result = await sandbox.run_python("print(1)")
            assert result.stdout == "1\n", result.stderr
        finally:
            await sandbox.close()
    elapsed = time.monotonic() - started
    print(f"\n{cycles} lease/print(1)/close cycles took {elapsed:.1f}s "
          f"({elapsed / cycles * 1000:.0f} ms per cycle)")

    await settle(pool)
    leftovers = pool.leftovers()
    mine = own(leftovers, prefix)
    live = set(leftovers["sandboxes"])
    # Only the ready sandboxes remain.
    assert settings.pool_size <= pool.target <= settings.pool_max
    assert len(live) == pool.ready_count == pool.target, leftovers
    assert set(mine["sandboxes"]) == live
    assert len(leftovers["uids"]) == len(live), leftovers["uids"]
    cgroup_names = Counter(p.name for p in mine["cgroups"])
    assert set(cgroup_names) == live, mine["cgroups"]
    assert len(set(cgroup_names.values())) == 1, "every hierarchy holds the same groups"
    assert {stem(p) for p in leftovers["directories"]} == live, leftovers["directories"]
    if "mounts" in leftovers:
        assert {stem(p) for p in leftovers["mounts"]} <= live, leftovers["mounts"]
    loops = [f for f in loop_backing_files()
             if f.startswith(f"{settings.run_dir}/") and stem(f).startswith(prefix)]
    assert {stem(f) for f in loops} <= live, loops
    assert len(loops) == len(set(loops)), loops

    # The host agrees.
    strays = await wait_for_no_strays(settings.uid_base, settings.uid_count, leftovers["uids"])
    assert strays == [], strays
    live_uids = {p["uid"] for p in processes_in(range(settings.uid_base,
                                                      settings.uid_base + settings.uid_count))
                 if p["state"] != "Z"}
    assert live_uids == set(leftovers["uids"])
    assert len(sandbox_roots(pool)) == len(live), sandbox_roots(pool)
    assert mount_count(excluding=live) == mounts_before


async def test_restart_leaves_nothing_behind(pool, settings):
    sandbox = await pool.lease()
    try:
        await sandbox.run_bash("sleep 100 &")
        for _ in range(3):
            await sandbox.restart()
        assert (await sandbox.run_python("print('back')")).stdout == "back\n"
        mine = [p for p in processes_in({sandbox.uid}) if p["state"] != "Z"]
        # One generation: bwrap (outside), bwrap (the sandbox's init) and the agent;
        # or the zygote's init and agent.
        assert len(mine) == (2 if pool.launcher == "zygote" else 3), mine
        assert not any(p["name"] == "sleep" for p in mine)
    finally:
        await sandbox.close()
    strays = await wait_for_no_strays(sandbox.uid, 1, allowed_uids=())
    assert strays == []


async def test_closing_a_sandbox_kills_its_background_processes(pool, settings):
    sandbox = await pool.lease()
    uid = sandbox.uid
    await sandbox.run_bash("for i in 1 2 3; do sleep 300 & done; (sleep 300 &) ")

    def sleeps() -> list[dict]:
        return [p for p in processes_in({uid}) if p["name"] == "sleep"]

    assert await wait_for(lambda: len(sleeps()) == 4, timeout=30), sleeps()
    await sandbox.close()
    strays = await wait_for_no_strays(uid, 1, allowed_uids=())
    assert strays == [], strays
    assert uid not in pool.leftovers()["uids"]


# -- a private pool, closed -----------------------------------------------------------------------
async def test_private_pool_close_leaves_nothing(pool, settings):
    """A private pool beside the session's, in the same run_dir, closed with a sandbox
    still leased and a background job running: nothing of it remains, and the
    session's pool is untouched."""
    await settle(pool)
    run_dir = settings.run_dir
    private_settings_ = private_settings(run_dir)
    private = SandboxPool(private_settings_)

    def session_pool() -> set[str]:  # its sandboxes come and go with its refills
        return set(pool.leftovers()["sandboxes"])

    mounts_before = mount_count(excluding=session_pool())
    await private.start()
    try:
        await private.wait_warm()
        leased = await private.lease()
        prefix = prefix_of(leased)
        result = await leased.run_bash("sleep 300 & echo ok")
        assert result.stdout == "ok\n"
        kept_open = await private.lease()  # leased and never closed by the test
        assert (await kept_open.run_python("print(2)")).stdout == "2\n"
        await leased.close()
        assert processes_in(range(private_settings_.uid_base,
                                    private_settings_.uid_base + private_settings_.uid_count))
    finally:
        await private.close()

    leftovers = private.leftovers()
    assert all_empty(leftovers), leftovers
    assert not [p for p in run_dir.iterdir() if prefix.rstrip("-") in p.name]
    assert not [f for f in loop_backing_files() if stem(f).startswith(prefix)]
    strays = await wait_for_no_strays(private_settings_.uid_base, private_settings_.uid_count,
                                      allowed_uids=())
    assert strays == [], strays
    await settle(pool)
    assert mount_count(excluding=session_pool()) == mounts_before
    with pytest.raises(RuntimeError):
        await private.lease()

    # The session's pool lives on: its sandboxes and launches still work.
    first, second = await pool.lease(), await pool.lease()
    try:
        for sandbox in (first, second):
            result = await sandbox.run_python("open('f.txt', 'w').write('x')\n"
                                              "print(open('f.txt').read())")
            assert result.stdout == "x\n", result.stderr
    finally:
        await first.close()
        await second.close()
    await pool.wait_warm(timeout=120)


def remove_private_remains(run_dir: Path, leftovers: dict, prefix: str) -> None:
    """Clean up after a pool that leaked: only what carries its run_dir or prefix."""
    for point in reversed([line.split()[4] for line in open("/proc/self/mountinfo")]):
        if point.startswith(str(run_dir) + "/"):
            subprocess.run(["umount", point], check=False)
    for group in own(leftovers, prefix).get("cgroups", []):
        try:
            Path(group).rmdir()
        except OSError:
            pass
    shutil.rmtree(run_dir, ignore_errors=True)


async def test_close_during_a_launch_leaves_nothing():
    """The pool is closed while a replacement sandbox is being prepared.

    The window is real (mkfs, mount and cgroup creation run in a thread; without any
    help this test's situation leaks now and then); a slower ``_prepare`` only makes
    it certain to be hit.
    """
    run_dir = Path("/run/shoal-test-private")
    private = SandboxPool(private_settings(run_dir, pool_size=1))
    await private.start()
    started, finished = threading.Event(), threading.Event()
    original = private._prepare

    def slow_prepare(*args):
        started.set()
        try:
            time.sleep(0.5)  # as a slow mkfs or a loaded host would
            return original(*args)
        finally:
            finished.set()

    prefix = ""
    try:
        await private.wait_warm()
        private._prepare = slow_prepare
        sandbox = await private.lease()  # the pool starts preparing a replacement
        prefix = prefix_of(sandbox)
        assert await wait_for(started.is_set, timeout=60)
    finally:
        await private.close()
        await asyncio.to_thread(finished.wait, 60)
        leftovers = private.leftovers()
        mounts = [line.split()[4] for line in open("/proc/self/mountinfo")
                  if line.split()[4].startswith(str(run_dir) + "/")]
        remove_private_remains(run_dir, leftovers, prefix)
    assert all_empty(own(leftovers, prefix)), leftovers
    assert mounts == []


async def test_two_pools_may_share_a_run_dir():
    run_dir = Path("/run/shoal-test-shared")
    first = SandboxPool(private_settings(run_dir, PRIVATE_UID_BASE, uid_count=512, pool_size=1))
    second = SandboxPool(private_settings(run_dir, PRIVATE_UID_BASE + 512, uid_count=512,
                                          pool_size=1))
    await first.start()
    try:
        await second.start()
        await second.wait_warm()
        await first.wait_warm()
        await second.close()
        # The first pool's warm sandbox still has its files...
        warm = await first.lease()
        result = await warm.run_python("open('x.txt', 'w').write('hi')\n"
                                       "print(open('x.txt').read())")
        await warm.close()
        assert result.return_code == 0, result.stderr
        assert result.stdout == "hi\n"
        # ...and the first pool can still launch sandboxes.
        fresh = await first.lease()
        try:
            assert (await fresh.run_python("print(1)")).stdout == "1\n"
        finally:
            await fresh.close()
    finally:
        await second.close()
        await close_and_remove(first, run_dir)
