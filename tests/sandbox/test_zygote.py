"""The zygote, the default launcher, is as safe as bubblewrap (issue 13).

Each fork runs in a user namespace of its own that maps only its uid, with an
empty bounding set and no capabilities; the zygote's own mount namespace is
built from nothing, so it pins no other server's volume; and the forks of one
zygote do not share their random state. Only the agent is a fork of the zygote:
the sandbox's init comes from the small builder, and the agent joins exactly
the init's namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from shoal.config import Settings
from shoal.sandbox import SandboxPool
from shoal.sandbox.volumes import Volume
from tests.uid_slots import uid


async def test_the_default_launcher_is_the_zygote(pool):
    if os.environ.get("SHOAL_LAUNCHER", "zygote") != "zygote":
        pytest.skip("this run chose another launcher")
    assert pool.launcher == "zygote"


@pytest.fixture
def zygote_only(pool):
    if pool.launcher != "zygote":
        pytest.skip("about the zygote; this run's sandboxes start with bubblewrap")


async def test_a_sandbox_runs_in_a_user_namespace_that_maps_only_its_uid(zygote_only, sandbox):
    result = await sandbox.run_bash("cat /proc/self/uid_map /proc/self/gid_map; "
                                    "grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status; "
                                    "stat -c %u /usr/bin/python3")
    lines = result.stdout.splitlines()
    uid = str(sandbox.uid)
    # Not the identity map of the host's namespace ("0 0 4294967295"): one uid, its own.
    assert lines[0].split() == [uid, uid, "1"], lines
    assert lines[1].split() == [uid, uid, "1"], lines
    capabilities = dict(line.split(":\t") for line in lines[2:7])
    assert set(capabilities.values()) == {"0000000000000000"}, capabilities
    assert lines[7] == "65534", "host root must not be mapped inside (it shows as nobody)"


async def test_root_of_the_host_cannot_be_reached_inside(sandbox):
    result = await sandbox.run_python(
        "import errno, os\nfor call in (lambda: os.setuid(0), lambda: os.setgid(0),"
        " lambda: os.chown('/home/agent/workspace', 0, 0)):\n"
        "    try:\n        call(); print('allowed')\n    except OSError as exc:\n"
        "        print(errno.errorcode[exc.errno])")
    # EPERM: no capability; EINVAL: uid 0 does not exist in the namespace at all.
    assert all(answer in ("EPERM", "EINVAL") for answer in result.stdout.split()), result
    assert len(result.stdout.split()) == 3, result


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as handle:
        return dict(line.rstrip("\n").split(":\t", 1) for line in handle if ":\t" in line)


def _sandbox_tree(pool, sandbox) -> dict[str, int]:
    process = sandbox._process
    return {"init": process.outer_pid, "agent": process.forked_agent,
            "zygote": pool._zygote._popen.pid}


async def test_only_the_agent_is_a_fork_of_the_zygote(zygote_only, pool, sandbox):
    """The sandbox's init is the builder's child, a process a tenth of the zygote's
    size; the agent is the zygote's child; the sandbox has these two processes."""
    tree = _sandbox_tree(pool, sandbox)
    init, agent = _status(tree["init"]), _status(tree["agent"])
    builder = int(init["PPid"])
    assert int(_status(builder)["PPid"]) == tree["zygote"]
    assert _status(builder)["Uid"].split()[0] == "0"
    assert int(agent["PPid"]) == tree["zygote"]
    assert init["NSpid"].split()[-1] == "1" and agent["NSpid"].split()[-1] == "2"
    rss = {name: int(status["VmRSS"].split()[0]) for name, status in
           (("init", init), ("agent", agent))}
    assert rss["init"] * 4 < rss["agent"], rss
    mine = [int(p) for p in os.listdir("/proc") if p.isdigit()
            and _status(int(p)).get("Uid", "").split()[:1] == [str(sandbox.uid)]]
    assert sorted(mine) == sorted([tree["init"], tree["agent"]]), mine


async def test_the_agent_is_in_exactly_the_inits_namespaces(zygote_only, pool, sandbox):
    tree = _sandbox_tree(pool, sandbox)
    for kind in ("pid", "mnt", "net", "ipc", "uts", "cgroup", "user"):
        assert (os.readlink(f"/proc/{tree['agent']}/ns/{kind}")
                == os.readlink(f"/proc/{tree['init']}/ns/{kind}")), kind
        assert (os.readlink(f"/proc/{tree['agent']}/ns/{kind}")
                != os.readlink(f"/proc/{tree['zygote']}/ns/{kind}")), kind
    # Its children are born in the sandbox's namespace too; the zygote's next ones
    # in the zygote's own, whatever sandbox it forked last (between its setns and
    # its fork, while the pool refills, they would be a new sandbox's: it comes back).
    assert (os.readlink(f"/proc/{tree['agent']}/ns/pid_for_children")
            == os.readlink(f"/proc/{tree['init']}/ns/pid"))
    own = os.readlink(f"/proc/{tree['zygote']}/ns/pid")
    deadline = time.monotonic() + 10
    while (os.readlink(f"/proc/{tree['zygote']}/ns/pid_for_children") != own
           and time.monotonic() < deadline):
        await asyncio.sleep(0.001)
    assert os.readlink(f"/proc/{tree['zygote']}/ns/pid_for_children") == own
    result = await sandbox.run_bash("cat /proc/self/status | grep -E '^NSpid'; hostname")
    assert result.stdout.split("\n")[1] == "sandbox", result.stdout


async def test_sandboxes_never_share_a_pid_namespace(zygote_only, pool):
    leased = [await pool.lease() for _ in range(3)]
    try:
        namespaces = {os.readlink(f"/proc/{s._process.forked_agent}/ns/pid") for s in leased}
        assert len(namespaces) == 3
        listings = [(await s.run_python(
            "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")).stdout
            for s in leased]
        # Its init and its agent (which runs the code): nothing of another sandbox's.
        assert listings == ["[1, 2]\n"] * 3, listings
    finally:
        for s in leased:
            await s.close()


async def test_an_agent_gone_takes_its_sandbox_with_it(zygote_only, pool):
    """The agent is not the init's child: the init learns of its end from the pipe
    the agent held, and ends the sandbox (no init waits for an agent that is gone)."""
    sandbox = await pool.lease()
    try:
        tree = _sandbox_tree(pool, sandbox)
        os.kill(tree["agent"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{tree['init']}") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not os.path.exists(f"/proc/{tree['init']}"), "the init outlived its agent"
    finally:
        await sandbox.close()


def _zygote_pids() -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                command = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if b"shoal_agent.zygote" in command and b"serve(" in command:
                found.append(int(name))
    return found


@contextlib.asynccontextmanager
async def _own_pool(tmp_path, base: int, run_dir: Path | None = None, **given):
    """A pool with a zygote of its own, to kill, stop or inspect. Its run directory
    is under /run/shoal-test unless given: the zygote stages its root on /tmp."""
    run_dir = run_dir or Path("/run/shoal-test") / f"zygote-{uuid.uuid4().hex[:8]}"
    pool = SandboxPool(Settings(**{
        "pool_size": 0, "data_dir": tmp_path / "data", "run_dir": run_dir,
        "uid_base": uid(base), "uid_count": 16, "launcher": "zygote", **given}))
    await pool.start()
    try:
        assert pool._zygote is not None, "no zygote started"
        yield pool
    finally:
        await pool.close()
        subprocess.run(["rm", "-rf", str(run_dir)], check=False)


async def test_a_volume_unmounted_elsewhere_is_not_held_by_a_zygote(tmp_path):
    """Another server's volume, mounted when our zygote starts, is released when
    that server unmounts it: the zygote's namespace copied none of the host's mounts."""
    run_dir = Path("/run/shoal-test") / f"zygote-{uuid.uuid4().hex[:8]}"
    image, mount_point = tmp_path / "other.img", run_dir / "other-volume"
    other = Volume(image, mount_point)
    other.create(64 * 1024 * 1024)
    async with _own_pool(tmp_path, 280_000, run_dir=run_dir) as pool:
        try:
            # This pool's zygote itself (its forks run the same command line, with
            # their own volumes mounted: they are not what this test is about).
            zygote = pool._zygote._popen.pid
            assert zygote in _zygote_pids()
            mountinfo = Path(f"/proc/{zygote}/mountinfo").read_text()
            assert str(mount_point) not in mountinfo
            assert "/dev/loop" not in mountinfo, "the zygote holds a copy of a loop mount"
            other.destroy()
            attached = subprocess.run(["losetup", "-j", str(image)], capture_output=True,
                                      text=True)
            assert attached.stdout.strip() == "", f"still attached: {attached.stdout}"
        finally:
            if mount_point.is_mount():  # the test failed before its own unmount
                other.destroy()


async def test_the_preloaded_libraries_first_use_is_paid_by_the_zygote(tmp_path):
    """A first chart in a fresh sandbox costs what a later one does: the zygote
    drew and saved one before forking (the font, Agg, pandas' plotting backend),
    and left no figure or data behind for the sandbox to see."""
    async with _own_pool(tmp_path, 281_000, pool_size=1,
                         preload_modules="numpy,pandas,matplotlib.pyplot") as pool:
        # The warm-up itself ran through: a failure would leave part of it unpaid.
        assert "warming" not in pool._zygote.diagnostics(), pool._zygote.diagnostics()
        sandbox = await pool.lease()
        try:
            result = await sandbox.run_python(
                "import sys, matplotlib.pyplot as plt\n"
                "print('pandas.plotting._matplotlib' in sys.modules,"
                " 'matplotlib.backends.backend_agg' in sys.modules)\n"
                "print(plt.get_fignums(), sorted(k for k in globals() if not k.startswith('_')))")
            assert result.stdout == ("True True\n[] ['ToolError', 'plt', 'sys']\n"), result.stderr
        finally:
            await sandbox.close()


async def test_the_zygote_runs_with_its_run_directory_under_tmp(tmp_path):
    """The zygote builds its root on a staging point in its own mount namespace;
    one that holds the run directory (where the agent's copy lives) would hide it,
    and the server would fall back to bubblewrap."""
    async with _own_pool(tmp_path, 282_000, run_dir=tmp_path / "run", pool_size=1) as pool:
        assert pool.launcher == "zygote"
        sandbox = await pool.lease()
        try:
            assert (await sandbox.run_python("print('up')")).stdout == "up\n"
        finally:
            await sandbox.close()


async def test_a_zygote_that_dies_is_started_again(tmp_path):
    """Killed (the OOM killer picks a big process, and the zygote holds every
    preloaded library), the zygote took every later launch with it: each failed
    with a broken pipe (a 500), the pool never warmed again, and the server made
    no sandbox until it was restarted. Its forks die with it (as with the
    server: nothing it forked outlives it); their next call restarts them."""
    async with _own_pool(tmp_path, 282_000) as pool:
        before = await pool.lease()
        assert (await before.run_python("open('kept.txt', 'w').write('kept')")).return_code == 0
        dead = pool._zygote._popen.pid
        os.kill(dead, signal.SIGKILL)
        while Path(f"/proc/{dead}/stat").exists() and _status(dead).get("State", "")[:1] != "Z":
            await asyncio.sleep(0.01)
        after = await asyncio.wait_for(pool.lease(), 120)  # a launch: the pool was empty
        try:
            assert (await after.run_python("print('forked anew')")).stdout == "forked anew\n"
            assert pool.stats.zygote_restarts == 1 and pool._zygote._popen.pid != dead
            # A sandbox the dead zygote had forked comes back on the new one, its
            # files kept, its interpreter (as the call says) a new one.
            noticed = await before.run_python("print('not run: the interpreter was gone')")
            assert noticed.restarted and "restarted" in noticed.stderr, noticed
            again = await before.run_python("print(open('kept.txt').read())")
            assert again.stdout == "kept\n", again
        finally:
            await after.close()
        await before.close()


async def test_a_zygote_whose_builder_died_is_started_again(tmp_path):
    """The builder (the zygote's root child that makes every sandbox's walls)
    killed, the zygote lived on and refused every launch for good."""
    async with _own_pool(tmp_path, 283_000) as pool:
        first = await pool.lease()
        await first.close()
        zygote = pool._zygote._popen.pid
        (builder,) = [child for child in _children_of(zygote)
                      if _status(child)["Uid"].split()[0] == "0"]
        os.kill(builder, signal.SIGKILL)
        sandbox = await asyncio.wait_for(pool.lease(), 120)  # a launch: the pool was empty
        try:
            assert (await sandbox.run_python("print('walls anew')")).stdout == "walls anew\n"
        finally:
            await sandbox.close()
        assert pool.stats.zygote_restarts == 1 and pool._zygote._popen.pid != zygote


async def test_a_wedged_zygote_is_replaced(tmp_path):
    """Alive but silent (stopped, deadlocked, or its builder hung: it answers
    after the builder), the zygote kept its place: every launch waited a whole
    spawn's time for it, failed, and the next did the same, for good. Silent
    through a spawn's whole wait, it is replaced, as a dead one is."""
    async with _own_pool(tmp_path, 284_000, zygote_spawn_seconds=12) as pool:
        first = await pool.lease()  # it answers while it is not stopped
        await first.close()
        wedged = pool._zygote._popen.pid
        os.kill(wedged, signal.SIGSTOP)
        try:
            sandbox = await asyncio.wait_for(pool.lease(), 120)  # a launch: the pool was empty
        finally:
            if Path(f"/proc/{wedged}").exists():
                os.kill(wedged, signal.SIGCONT)  # not replaced: the test failed
        try:
            assert (await sandbox.run_python("print('forked anew')")).stdout == "forked anew\n"
        finally:
            await sandbox.close()
        assert pool.stats.zygote_restarts == 1 and pool._zygote._popen.pid != wedged
        assert wedged not in _zygote_pids(), "the wedged zygote was left behind"


async def test_the_warm_sandboxes_of_a_replaced_zygote_are_not_handed_out(tmp_path):
    """A zygote's forks die with it, and a wedged one is now killed to be
    replaced: the warm sandboxes it had forked stayed in the pool, and each went
    to a later lease as new, whose first call found no interpreter (restarted,
    its code not run). They leave the pool with their zygote."""
    async with _own_pool(tmp_path, 285_000, zygote_spawn_seconds=12, pool_size=2) as pool:
        await pool.wait_warm()
        wedged = pool._zygote._popen.pid
        os.kill(wedged, signal.SIGSTOP)
        taken = await pool.lease()  # the refill launches another in its place: a spawn
        try:
            deadline = time.monotonic() + 60
            while pool.stats.zygote_restarts == 0 or len(pool._ready) < 2:
                assert time.monotonic() < deadline, "the wedged zygote was not replaced"
                await asyncio.sleep(0.05)
        finally:
            if Path(f"/proc/{wedged}").exists():
                os.kill(wedged, signal.SIGCONT)  # not replaced: the test failed
        await taken.close()
        await _every_ready_one_runs(pool)


async def test_the_warm_sandboxes_of_a_zygote_killed_are_not_handed_out(tmp_path):
    """Killed outright (the OOM killer), the zygote took its warm forks with it,
    and the next lease was given one of them (before any launch noticed)."""
    async with _own_pool(tmp_path, 286_000, pool_size=2) as pool:
        await pool.wait_warm()
        dead = pool._zygote._popen.pid
        os.kill(dead, signal.SIGKILL)
        zygote = pool._zygote
        deadline = time.monotonic() + 10
        while zygote.alive:  # its socket closed, its threads gone (numpy's too)
            assert time.monotonic() < deadline, "the killed zygote still looks alive"
            await asyncio.sleep(0.01)
        await _every_ready_one_runs(pool, at_least=1)
        assert pool._zygote._popen.pid != dead


async def _every_ready_one_runs(pool, at_least: int = 0) -> None:
    """Lease what a new session would be given, until the pool has none left."""
    leased = 0
    while pool._ready or leased < at_least:
        sandbox = await asyncio.wait_for(pool.lease(), 120)
        leased += 1
        try:
            ran = await sandbox.run_python("print('ran')")
        finally:
            await sandbox.close()
        assert (ran.stdout, ran.restarted) == ("ran\n", False), ran


def _children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as handle:
        return [int(child) for child in handle.read().split()]
