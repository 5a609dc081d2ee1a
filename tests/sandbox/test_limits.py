"""Resource limits of real sandboxes: memory, processes, time and output.

Each test drives a real sandbox into a limit and checks three things: the call
comes back with the limit reported, the rest of the machine (another sandbox,
the host) did not notice, and the sandbox is usable afterwards.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import textwrap
from pathlib import Path

import pytest

from shoal.config import Settings
from shoal.sandbox import Limit, SandboxPool
from tests.processes import processes_in

TRUNCATED = "...[truncated]"
FORK_FAILURE = "Resource temporarily unavailable"


def _pids_of_uid(uid: int, live_only: bool = False) -> list[int]:
    """Host processes whose real uid is ``uid`` (without zombies if ``live_only``)."""
    return [p["pid"] for p in processes_in({uid})
            if not (live_only and p["state"] in ("Z", "X"))]


def _is_exiting(pid: int) -> bool:
    """Gone, or PF_EXITING set (never cleared once set)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return True
    return bool(int(fields[6]) & 0x4)  # field 9 of stat: flags; 0x4 is PF_EXITING


def _pids_cgroup(pid: int) -> str | None:
    """The path of a host process in the pids hierarchy (v1), or in v2."""
    try:
        with open(f"/proc/{pid}/cgroup") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    unified = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            return path
        if controllers == "":
            unified = path
    return unified


def _host_can_fork() -> bool:
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    _, status = os.waitpid(pid, 0)
    spawned = subprocess.run(["/bin/true"], timeout=10)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 7 and spawned.returncode == 0


# ---------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------


async def test_memory_hog_is_killed_while_a_neighbour_works(pool, sandbox):
    neighbour = await pool.lease()
    try:
        warm = await sandbox.run_python("before = 'set before the hog'")
        assert warm.return_code == 0
        # The hog waits a moment first, so the neighbour's calls overlap it for sure.
        hog = asyncio.create_task(sandbox.run_python(textwrap.dedent("""
            import time
            time.sleep(0.5)
            b = bytearray(1024 ** 3)
            for i in range(0, len(b), 4096):
                b[i] = 1
            print("survived", len(b))
        """), timeout=30))
        answered_during_hog = 0
        neighbour_results = []
        while not hog.done():
            result = await neighbour.run_python("print(1)", timeout=10)
            neighbour_results.append(result)
            if not hog.done():
                answered_during_hog += 1
            await asyncio.sleep(0.02)
        result = await hog
        for other in neighbour_results:
            assert other.return_code == 0 and other.stdout == "1\n", other
            assert other.limits == []
        assert answered_during_hog >= 1, "the neighbour never answered while the hog ran"

        assert "survived" not in result.stdout
        assert result.return_code != 0
        assert Limit.MEMORY in result.limits, result
        assert "memory" in result.stderr
        assert result.restarted is True  # the interpreter itself was the victim

        after = await sandbox.run_python("print(1)")
        assert after.return_code == 0 and after.stdout == "1\n", after
        assert after.limits == [] and after.restarted is False
        # A restart really happened: the old interpreter's variables are gone.
        gone = await sandbox.run_python("print('before' in globals())")
        assert gone.stdout == "False\n"
        still = await neighbour.run_python("print(2)")
        assert still.stdout == "2\n"
    finally:
        await neighbour.close()


async def test_memory_hog_string_is_killed(sandbox):
    result = await sandbox.run_python("x = ' ' * (600 * 1024 ** 2)\nprint('survived')",
                                      timeout=30)
    assert "survived" not in result.stdout
    assert result.return_code != 0
    assert Limit.MEMORY in result.limits, result
    assert result.restarted is True
    after = await sandbox.run_python("print(1)")
    assert after.stdout == "1\n", after


async def test_memory_hog_in_a_bash_child_spares_the_interpreter(sandbox):
    first = await sandbox.run_python("kept = 41 + 1")
    assert first.return_code == 0
    result = await sandbox.run_bash(
        "python3 -c \"x = ' ' * (600 * 1024 ** 2); print('survived')\"", timeout=30)
    assert "survived" not in result.stdout
    assert result.return_code != 0
    assert Limit.MEMORY in result.limits, result
    assert result.restarted is False
    back = await sandbox.run_python("print(kept)")
    assert back.return_code == 0 and back.stdout == "42\n", back
    assert back.restarted is False


# ---------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------


async def test_bash_fork_bomb_is_capped(settings, sandbox):
    peak = 0
    escaped: set[str] = set()
    checked = 0
    call = asyncio.create_task(sandbox.run_bash(":(){ :|:& };:; sleep 10", timeout=3))
    while not call.done():
        pids = _pids_of_uid(sandbox.uid)
        peak = max(peak, len(pids))
        for pid in _pids_of_uid(sandbox.uid, live_only=True)[:64]:
            group = _pids_cgroup(pid)
            if group is None or _is_exiting(pid):
                continue  # v1 shows an exiting task in "/": not an escape
            checked += 1
            if not group.rstrip("/").endswith("/" + sandbox.name):
                escaped.add(f"pid {pid}: {group}")
        await asyncio.sleep(0.05)
    result = await call
    assert result.return_code == 124
    assert Limit.TIMEOUT in result.limits
    assert Limit.PIDS in result.limits or FORK_FAILURE in result.stderr, result.stderr[-500:]
    # The bomb did grow to the cap, and every process of it stayed in the
    # sandbox's own cgroup, where the cap applies.
    assert peak >= settings.pids_limit // 2, f"the bomb never grew (peak {peak})"
    assert checked > 0
    assert not escaped, f"processes of the sandbox's uid outside its cgroup: {escaped}"
    assert _host_can_fork()

    await sandbox.restart()
    assert len(_pids_of_uid(sandbox.uid)) < 16  # the bomb is gone
    bash = await sandbox.run_bash("echo ok")
    assert bash.return_code == 0 and bash.stdout == "ok\n", bash
    python = await sandbox.run_python("print(1)")
    assert python.stdout == "1\n"


async def test_python_fork_loop_is_capped(settings, sandbox):
    result = await sandbox.run_python(textwrap.dedent("""
        import os, time
        kids = []
        while True:
            pid = os.fork()
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            kids.append(pid)
    """), timeout=15)
    assert result.return_code == 1
    assert Limit.PIDS in result.limits or FORK_FAILURE in result.stderr, result.stderr[-500:]
    assert len(_pids_of_uid(sandbox.uid)) <= settings.pids_limit
    assert _host_can_fork()
    # The interpreter survived its own fork loop and kept its state.
    count = await sandbox.run_python("print(0 < len(kids) <= %d)" % settings.pids_limit)
    assert count.stdout == "True\n", count

    await sandbox.restart()
    bash = await sandbox.run_bash("echo ok")
    assert bash.return_code == 0 and bash.stdout == "ok\n", bash
    python = await sandbox.run_python("print(1)")
    assert python.stdout == "1\n"


# ---------------------------------------------------------------------------
# time
# ---------------------------------------------------------------------------


async def test_cpu_spin_in_bash_times_out(sandbox):
    result = await sandbox.run_bash("while :; do :; done", timeout=2)
    assert result.return_code == 124
    assert result.stderr.endswith("Command timed out after 2s."), result.stderr
    assert Limit.TIMEOUT in result.limits
    # Stopped at its timeout, not before; the upper bound only says it was stopped at all
    # (a loop nothing stopped would run until the host's backstop, or forever).
    assert 1500 <= result.execution_time_ms <= 30000, result.execution_time_ms
    after = await sandbox.run_bash("echo ok")
    assert after.stdout == "ok\n"


async def test_background_job_does_not_hold_the_call(sandbox):
    # A call that waited for the 100 s job would hit its 20 s timeout instead.
    result = await sandbox.run_bash("sleep 100 &", timeout=20)
    assert result.return_code == 0
    assert result.limits == [] and not result.timed_out
    # The job was left running, as bash would; it does not block the next call either.
    ps = await sandbox.run_bash("ps ax -o args | grep -c '^sleep 100$'", timeout=20)
    assert ps.stdout.strip() == "1", ps.stdout
    assert ps.limits == [] and not ps.timed_out


async def test_python_busy_loop_is_interrupted_and_state_survives(sandbox):
    first = await sandbox.run_python("x = 1")
    assert first.return_code == 0
    result = await sandbox.run_python("while True:\n    pass", timeout=2)
    assert result.return_code == 124
    assert result.stderr.endswith("Command timed out after 2s."), result.stderr
    assert Limit.TIMEOUT in result.limits
    assert result.restarted is False
    # Stopped at its timeout, not before; the upper bound only says it was stopped at all
    # (a loop nothing stopped would run until the host's backstop, or forever).
    assert 1500 <= result.execution_time_ms <= 30000, result.execution_time_ms
    after = await sandbox.run_python("print(x)")
    assert after.return_code == 0 and after.stdout == "1\n", after
    assert after.restarted is False


async def test_python_loop_swallowing_interrupts_is_still_stopped(sandbox):
    await sandbox.run_python("y = 5")
    result = await sandbox.run_python(textwrap.dedent("""
        while True:
            try:
                while True:
                    pass
            except BaseException:
                pass
    """), timeout=1)
    assert result.return_code == 124
    assert result.stderr.endswith("Command timed out after 1s."), result.stderr
    assert Limit.TIMEOUT in result.limits
    assert result.execution_time_ms <= 30000  # stopped at all (see above)
    after = await sandbox.run_python("print(1)")
    assert after.stdout == "1\n", after


async def test_bash_timeout_kills_the_whole_process_group(sandbox):
    # Control: a job left behind on purpose shows up, so the check below can fail.
    control = await sandbox.run_bash("sleep 1001 > /dev/null 2>&1 &")
    assert control.return_code == 0
    result = await sandbox.run_bash("sleep 1000 & sleep 1000", timeout=1)
    assert result.return_code == 124
    assert result.stderr.endswith("Command timed out after 1s."), result.stderr
    assert Limit.TIMEOUT in result.limits
    # The killed group may take a moment to be reaped on a loaded host; a sleep
    # that was not killed would still be there in 1000 s.
    for _ in range(30):
        ps = await sandbox.run_bash("ps ax -o stat,args")
        assert "sleep 1001" in ps.stdout, ps.stdout
        if "sleep 1000" not in ps.stdout:
            break
        await asyncio.sleep(0.1)
    assert "sleep 1000" not in ps.stdout, ps.stdout


async def test_timeout_above_the_ceiling_is_clamped(settings):
    run_dir = settings.run_dir / f"clamp-{secrets.token_hex(4)}"
    clamped = Settings(
        pool_size=1,
        data_dir=settings.data_dir,
        run_dir=run_dir,
        memory_limit_mib=settings.memory_limit_mib,
        pids_limit=settings.pids_limit,
        output_cap_bytes=settings.output_cap_bytes,
        max_timeout_seconds=2,
        preload_modules="",
        # Uids of our own, at the far end of the session pool's range.
        uid_base=settings.uid_base + settings.uid_count - 64,
        uid_count=16,
    )
    own = SandboxPool(clamped)
    await own.start()
    names = []
    try:
        box = await own.lease()
        names.append(box.name)
        try:
            # Unclamped, the sleep would finish (return code 0) after 10 s.
            result = await box.run_bash("sleep 10", timeout=100)
            assert result.return_code == 124
            assert result.stderr.endswith("Command timed out after 2s."), result.stderr
            assert "ceiling" in result.stderr  # the clamp is said, because it mattered
            assert Limit.TIMEOUT in result.limits
            py = await box.run_python("import time\ntime.sleep(10)", timeout=10_000)
            assert py.return_code == 124
            assert py.stderr.endswith("Command timed out after 2s."), py.stderr
            quick = await box.run_bash("echo ok", timeout=10_000)
            assert quick.stdout == "ok\n" and "ceiling" not in quick.stderr
        finally:
            await box.close()
    finally:
        await own.close()
        leftovers = own.leftovers()
        try:
            run_dir.rmdir()
        except OSError:
            pass
    # Only this pool's own groups count: the cgroup parent is shared with every
    # other pool on the host (the session pool, other test runs).
    prefix = names[0].rsplit("-", 1)[0] + "-"
    leftovers["cgroups"] = [p for p in leftovers["cgroups"] if p.name.startswith(prefix)]
    assert all(not found for found in leftovers.values()), leftovers


# ---------------------------------------------------------------------------
# /tmp and /dev/shm
# ---------------------------------------------------------------------------

TMP_CAP_MIB = 16
TMP_CAP = TMP_CAP_MIB * 1024 * 1024
KiB = 1024


@pytest.fixture(scope="module")
async def small_tmp_pool(settings):
    """A pool whose sandboxes have a 16 MiB /tmp and /dev/shm (the session pool's are
    256 MiB, as large as its memory limit: filling them would hit that first)."""
    run_dir = settings.run_dir / f"tmpcap-{secrets.token_hex(4)}"
    own = SandboxPool(Settings(
        pool_size=2, data_dir=settings.data_dir, run_dir=run_dir,
        memory_limit_mib=settings.memory_limit_mib, pids_limit=settings.pids_limit,
        output_cap_bytes=settings.output_cap_bytes, tmp_size_mib=TMP_CAP_MIB,
        preload_modules="",
        # Uids of our own, below the clamp test's at the far end of the session pool's range.
        uid_base=settings.uid_base + settings.uid_count - 96, uid_count=16))
    await own.start()
    yield own
    await own.close()
    leftovers = own.leftovers()
    leftovers["cgroups"] = [p for p in leftovers["cgroups"] if p.name.startswith(own._prefix)]
    try:
        run_dir.rmdir()
    except OSError:
        pass
    assert all(not found for found in leftovers.values()), leftovers


def _fields(result) -> list[str]:
    assert result.return_code == 0, result
    return result.stdout.split()


@pytest.mark.parametrize("mount", ["/tmp", "/dev/shm"])
async def test_tmpfs_fills_to_its_cap_and_no_further(small_tmp_pool, mount):
    other_mount = "/dev/shm" if mount == "/tmp" else "/tmp"
    box, neighbour = await small_tmp_pool.lease(), await small_tmp_pool.lease()
    try:
        # Four times the cap: the write stops with ENOSPC at the cap.
        fill = await box.run_bash(f"head -c {4 * TMP_CAP} /dev/zero > {mount}/fill; echo rc=$?",
                                  timeout=30)
        assert fill.stdout == "rc=1\n", fill
        assert "No space left on device" in fill.stderr, fill.stderr
        size, total, available = map(int, _fields(await box.run_bash(
            f"stat -c %s {mount}/fill; df -B1 --output=size,avail {mount} | tail -1")))
        assert total == TMP_CAP, total  # the mount is exactly the configured size
        assert TMP_CAP - 256 * KiB <= size <= TMP_CAP, size  # at the cap, not beyond
        assert available == 0, available
        # The same sandbox's other tmpfs has a cap of its own, untouched.
        other_total, other_available = map(int, _fields(await box.run_bash(
            f"df -B1 --output=size,avail {other_mount} | tail -1")))
        assert other_total == TMP_CAP and other_available >= TMP_CAP - 256 * KiB, \
            (other_total, other_available)
        # Another sandbox's is its own too: empty, and it writes as usual.
        half = TMP_CAP // 2
        written, neighbour_available = map(int, _fields(await neighbour.run_bash(
            f"test ! -e {mount}/fill && head -c {half} /dev/zero > {mount}/half && "
            f"stat -c %s {mount}/half && df -B1 --output=avail {mount} | tail -1")))
        assert written == half
        assert TMP_CAP - half - 256 * KiB <= neighbour_available <= TMP_CAP - half
        # Nothing of it is on the host.
        assert not Path(mount, "fill").exists() and not Path(mount, "half").exists()
        # Freed, the full sandbox writes again.
        again = await box.run_bash(f"rm {mount}/fill && echo x > {mount}/small && cat {mount}/small")
        assert again.stdout == "x\n", again
    finally:
        await box.close()
        await neighbour.close()


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------


def _assert_capped(text: str, cap: int) -> None:
    assert text.endswith(TRUNCATED), text[-100:]
    assert cap <= len(text) <= cap + 64, len(text)


async def test_yes_is_truncated_at_the_cap(settings, sandbox):
    result = await sandbox.run_bash("yes | head -c 3000000", timeout=30)
    assert result.return_code == 0
    _assert_capped(result.stdout, settings.output_cap_bytes)
    assert result.stdout.startswith("y\ny\n")
    assert Limit.OUTPUT in result.limits
    after = await sandbox.run_bash("echo small")
    assert after.stdout == "small\n" and Limit.OUTPUT not in after.limits


async def test_python_print_loop_is_truncated_at_the_cap(settings, sandbox):
    result = await sandbox.run_python(
        "for _ in range(30000):\n    print('x' * 99)", timeout=30)
    assert result.return_code == 0
    _assert_capped(result.stdout, settings.output_cap_bytes)
    assert Limit.OUTPUT in result.limits
    after = await sandbox.run_python("print('small')")
    assert after.stdout == "small\n" and Limit.OUTPUT not in after.limits


async def test_stderr_is_truncated_at_the_cap(settings, sandbox):
    result = await sandbox.run_bash("yes e | head -c 3000000 >&2; echo out", timeout=30)
    assert result.return_code == 0
    assert result.stdout == "out\n"
    _assert_capped(result.stderr, settings.output_cap_bytes)
    assert Limit.OUTPUT in result.limits


async def test_endless_output_is_capped_and_stopped_by_timeout(settings, sandbox):
    result = await sandbox.run_bash("yes", timeout=2)
    assert result.return_code == 124
    assert Limit.TIMEOUT in result.limits and Limit.OUTPUT in result.limits
    assert len(result.stdout) <= settings.output_cap_bytes + 64
    assert result.stderr.endswith("Command timed out after 2s."), result.stderr[-200:]


async def test_fork_bomb_reports_the_pids_limit(sandbox):
    result = await sandbox.run_python(textwrap.dedent("""
        import os, time
        while True:
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
    """), timeout=15)
    try:
        assert result.return_code == 1
        assert FORK_FAILURE in result.stderr  # the process cap did stop the loop
        assert Limit.PIDS in result.limits, result.limits
    finally:
        await sandbox.restart()
