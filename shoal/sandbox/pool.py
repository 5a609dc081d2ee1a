"""The warm pool: sandboxes started, attached and warmed before anyone asks.

Everything slow about a sandbox (namespaces, cgroup attach, interpreter start,
importing numpy and pandas) happens here, off the request path; ``lease()``
only pops a ready sandbox and schedules its replacement. Only when the pool is
empty does a lease launch one while the caller waits.

The pool also owns teardown, so that whatever it created (processes, cgroups,
uids, directories) it alone removes, and ``leftovers()`` can prove it did.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import itertools
import logging
import os
import shutil
import secrets
import time
from pathlib import Path

from shoal.config import MiB, Settings

from . import preflight
from .cgroups import CgroupManager, Limits, favor_dynamic_changes
from .launcher import LaunchConfig, LaunchFailed, SandboxProcess, launch, stop_process_tree
from .mounts import SandboxHome
from .volumes import Volume, mounts_under, unmount
from .zygote import Zygote, ZygoteFailed
from .runtime import find_runtime, hold_runtime
from .sandbox import Sandbox
from .stats import SandboxStats
from .uids import UidAllocator
from .volumes import DiskFull, check_room

log = logging.getLogger("shoal.pool")
AGENT_SOURCE = Path(__file__).resolve().parent.parent / "agent"
# A pool grown by a burst gives back one extra sandbox per this many idle seconds.
_SHRINK_SECONDS = 30.0
# A sandbox launched for the pool starts with this CPU weight (the kernel's
# default is 100) and gets the default when it is leased: a refill that a lease
# set off yields the CPU to the sandboxes serving calls, instead of taking half
# of it from the very call whose lease woke it. Uncontended, it runs at full speed.
_WARMING_CPU_WEIGHT = 10
_CPU_WEIGHT = 100
# But in a burst (a lease found the pool empty this recently) the sandboxes
# warming are what the waiting requests need, and holding launch slots at a
# tenth of the CPU they would only delay them: they warm at full weight.
_BURST_SECONDS = 2.0
# While warm sandboxes remain, a refill waits this long after the lease that
# woke it: the request that leased goes first, not the launch it set off
# (forking, mounts and a volume compete with its call for two cores). An empty
# pool, or one in a burst, refills at once.
_REFILL_DEFER_SECONDS = 0.05


class PoolBusy(RuntimeError):
    """No warm sandbox, and as many leases already wait for one as may: come back later."""


class SandboxPool:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._ready: list[Sandbox] = []
        # Every live sandbox, by its uid (each has its own): the egress broker asks
        # who a connecting uid is for every connection, and for every open one
        # each second.
        self._live: dict[int, Sandbox] = {}
        self._launch_slots = asyncio.Semaphore(settings.launch_concurrency)
        # Leases waiting for a sandbox to start, and how far demand grew the pool.
        self._waiting = 0
        self._extra = 0
        self._missed_at = 0.0
        # Warm launches that failed in a row: the refill backs off instead of
        # spinning on a full disk or an exhausted uid range.
        self.warm_failures = 0
        self.last_failure: str | None = None
        self.stats = SandboxStats()
        self._runtime_hold: int | None = None
        # Set before start() where egress is granted: the broker's socket directory.
        self.egress_dir: Path | None = None
        self._refill_task: asyncio.Task | None = None
        self._warming: set[asyncio.Task] = set()
        self._warming_groups: set = set()  # cgroups of pool launches under way
        self._wakeup = asyncio.Event()
        self._names = itertools.count(1)
        # "<pid>.<random>": unique per pool, and tells a later server whose
        # leftovers these are (a pid that no longer runs left them behind).
        self._prefix = f"{os.getpid()}.{secrets.token_hex(3)}"
        self._closing = False
        self._uids = UidAllocator(settings.uid_base, settings.uid_count, settings.uid_lock_dir)
        self._cgroups: CgroupManager | None = None
        self._config: LaunchConfig | None = None
        self._limits = Limits(memory_bytes=settings.memory_limit_mib * MiB,
                              pids=settings.pids_limit, cpu_cores=settings.cpu_limit)
        # Named by process and pool, so pools never touch each other's files.
        self._sandboxes_dir = settings.run_dir / f"sandboxes-{self._prefix}"
        # The images behind ephemeral sessions' volumes live on the data
        # directory's disk: the run directory is often a tmpfs, whose pages no
        # sandbox's memory limit would be charged for.
        self._scratch_dir = settings.data_dir / "scratch" / f"pool-{self._prefix}"
        self._zygote: Zygote | None = None
        self._zygote_lock = asyncio.Lock()
        self._agent_dir: Path | None = None
        self._agent_lock = -1

    # -- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        """Check isolation (fail closed), then warm the pool to its size."""
        preflight.require_isolation()
        self._cgroups = CgroupManager()
        if self.settings.cgroup_favor_dynmods:
            refused = favor_dynamic_changes()
            if refused:
                log.warning("sandboxes start slower here: %s", refused)
        await asyncio.to_thread(self._sweep_stale)
        runtime = find_runtime(self.settings.runtime_dir)
        self._runtime_hold = hold_runtime(runtime)
        agent_root = self._install_agent()
        self._config = LaunchConfig(runtime=runtime, agent_root=agent_root,
                                    tmp_size_bytes=self.settings.tmp_size_mib * MiB,
                                    pids_limit=self.settings.pids_limit,
                                    egress_dir=self.egress_dir)
        self._sandboxes_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        first = None
        if self.settings.launcher == "zygote":
            first = await self._start_zygote(runtime, agent_root)
        if first is None:
            # bubblewrap: the fallback, and the launcher of last resort. If it
            # cannot start a sandbox either, nothing runs (fail closed).
            self._config = dataclasses.replace(self._config, zygote=None)
            first = await self._launch_new(warm=True)
        self._ready.append(first)
        self._refill_task = asyncio.create_task(self._refill_forever())
        self._wakeup.set()

    @property
    def launcher(self) -> str:
        """The launcher in use: the zygote, or bubblewrap where the zygote cannot run."""
        return "zygote" if self._config is not None and self._config.zygote is not None else "bwrap"

    async def _start_zygote(self, runtime: Path, agent_root: Path) -> Sandbox | None:
        """Start the zygote and, to prove it isolates here, its first sandbox; None
        (after a warning naming why) where the fast path cannot run."""
        found = preflight.zygote_problems()
        if found:
            log.warning("the zygote launcher cannot run on this host (%s): sandboxes start with "
                        "bubblewrap", "; ".join(found))
            return None
        zygote = Zygote(runtime, agent_root, self.settings.preload, self.egress_dir,
                        self.settings.zygote_spawn_seconds)
        try:
            await zygote.start()
            self._zygote = zygote
            self._config = dataclasses.replace(self._config, zygote=zygote)
            return await self._launch_new(warm=True)
        except (ZygoteFailed, LaunchFailed) as exc:
            log.warning("the zygote launcher failed here (%s): sandboxes start with bubblewrap",
                        exc)
            zygote.close()
            self._zygote = None
            return None

    async def _live_zygote(self) -> None:
        """The zygote, started again if it died: every launch after its death
        failed (a broken pipe, a 500), and the pool never warmed again until the
        server restarted. Its sandboxes live on without it; one restart at a
        time, and a zygote that cannot start fails the launch (a 503)."""
        if self._zygote is None or self._zygote.alive:
            return
        async with self._zygote_lock:
            dead = self._zygote
            if dead is None or dead.alive:
                return  # another launch started it again meanwhile
            assert self._config is not None
            status, last_words = dead.exit_status(), dead.diagnostics()
            dead.close()
            log.error("the zygote stopped (exit status %s; last words: %s): starting another",
                      status, last_words[-500:] or "none")
            # Its forks died with it (a wedged one is killed here): a warm one left
            # in the pool went to the next lease as new, and its first call found
            # no interpreter (restarted, its code not run).
            stale = [sandbox for sandbox in self._ready if self._stale(sandbox)]
            for sandbox in stale:
                self._ready.remove(sandbox)
            await asyncio.gather(*(sandbox.close() for sandbox in stale), return_exceptions=True)
            zygote = Zygote(self._config.runtime, self._config.agent_root, self.settings.preload,
                            self.egress_dir, self.settings.zygote_spawn_seconds)
            try:
                await zygote.start()
            except ZygoteFailed as exc:
                # Kept as it is: the next launch tries again (the refill backs off).
                raise LaunchFailed(f"the zygote could not be started again: {exc}") from None
            self._zygote = zygote
            self._config = dataclasses.replace(self._config, zygote=zygote)
            self.stats.zygote_restarts += 1

    def _stale(self, sandbox: Sandbox) -> bool:
        """Whether ``sandbox`` was forked by a zygote no longer in use (and died with it)."""
        forked_by = sandbox._process.zygote
        return forked_by is not None and (forked_by is not self._zygote or not forked_by.alive)

    async def wait_warm(self, timeout: float = 120.0) -> None:
        """Wait until the pool holds its full size (benchmarks, tests)."""
        async def full() -> None:
            while len(self._ready) < self.settings.pool_size:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(full(), timeout)

    async def close(self) -> None:
        self._closing = True
        if self._refill_task is not None:
            self._refill_task.cancel()
            try:
                await self._refill_task
            except asyncio.CancelledError:
                pass
        for task in list(self._warming):
            task.cancel()
        await asyncio.gather(*self._warming, return_exceptions=True)
        await asyncio.gather(*(sandbox.close() for sandbox in self.live_sandboxes()),
                             return_exceptions=True)
        if self._zygote is not None:
            self._zygote.close()
        if self._cgroups is not None and self._cgroups.pending:
            left = await asyncio.to_thread(self._cgroups.retry, 10.0)
            if left:
                log.error("%d sandbox cgroups could not be removed; the next server's "
                          "sweep removes them", left)
        if self._runtime_hold is not None:
            os.close(self._runtime_hold)
            self._runtime_hold = None
        for mount_point in mounts_under(self._sandboxes_dir):
            unmount(mount_point)  # never rmtree through a volume still mounted
        shutil.rmtree(self._sandboxes_dir, ignore_errors=True)
        shutil.rmtree(self._scratch_dir, ignore_errors=True)
        if self._agent_dir is not None:
            shutil.rmtree(self._agent_dir, ignore_errors=True)
            self._agent_dir.with_name(self._agent_dir.name + ".lock").unlink(missing_ok=True)
            os.close(self._agent_lock)
            self._agent_dir = None

    # -- leasing -----------------------------------------------------------------
    async def lease(self) -> Sandbox:
        if self._closing:
            raise RuntimeError("the pool is closing")
        while self._ready:
            sandbox = self._ready.pop()
            self._wakeup.set()
            if self._stale(sandbox):
                # Its zygote died (an OOM kill) since it was forked, and it with it:
                # its first call would find no interpreter.
                await sandbox.close()
                continue
            _set_group_weight(sandbox._cgroup, _CPU_WEIGHT)
            return sandbox
        # A miss: demand outran the pool, which grows for the next burst.
        self._missed_at = time.monotonic()
        for group in list(self._warming_groups):
            _set_group_weight(group, _CPU_WEIGHT)
        self._extra = min(self._extra + 1, max(0, self.settings.pool_max - self.settings.pool_size))
        if self._waiting >= self.settings.launch_queue:
            raise PoolBusy(f"{self._waiting} requests already wait for a sandbox to start; "
                           "retry in a moment")
        self._waiting += 1
        try:
            return await self._launch_new()
        finally:
            self._waiting -= 1
            if not self._waiting:
                self._wakeup.set()  # the refill held back for the waiting leases

    async def launch_for(self, home: SandboxHome, name: str,
                         memory_bytes: int | None = None) -> Sandbox:
        """Start a sandbox on existing files (a durable container's), on demand,
        with its own memory limit if given.

        The files outlive the sandbox: closing it leaves ``home`` as it is.
        """
        assert self._cgroups is not None
        async with self._launch_slots:
            uid = self._uids.lease()
            sandbox_name = f"{self._prefix}-{name}-{next(self._names)}"
            cgroup = None
            try:
                cgroup = await asyncio.to_thread(self._adopt, sandbox_name, uid, home, memory_bytes)
                sandbox = Sandbox(self, sandbox_name, uid, home, cgroup, None)
                sandbox.durable_files = True
                sandbox._process = await self._spawn(sandbox, preload=False)
            except BaseException as exc:
                await asyncio.shield(asyncio.to_thread(self._discard, uid, home, cgroup))
                self._launch_failed(exc, name)
                raise
            self.stats.launches += 1
            self._live[uid] = sandbox
            return sandbox

    def _adopt(self, name: str, uid: int, home: SandboxHome, memory_bytes: int | None):
        home.create(uid)
        home.adopt(uid)
        limits = self._limits if memory_bytes is None else dataclasses.replace(
            self._limits, memory_bytes=memory_bytes)
        return self._cgroups.create(name, limits)

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    def live_sandboxes(self) -> list[Sandbox]:
        return list(self._live.values())

    def sandbox_of_uid(self, uid: int) -> Sandbox | None:
        """The live sandbox running as ``uid`` (each has a uid of its own)."""
        return self._live.get(uid)

    @property
    def free_uids(self) -> int:
        return self._uids.free

    def problems(self) -> list[str]:
        """Why a lease could not get a sandbox now; empty when it could."""
        found = []
        # Exhausted uids stop a lease only once no warm sandbox is left to hand out
        # (the refill keeps every uid it can get for the pool).
        if self._uids.exhausted and not self._ready:
            found.append("uids exhausted: every sandbox uid is leased")
        if self.warm_failures and not self._ready:
            found.append(f"pool cannot warm: {self.warm_failures} launches failed in a row "
                         f"({self.last_failure})")
        try:
            check_room(self._scratch_dir / "readiness-probe.img",
                       self.settings.disk_limit_mib * MiB)
        except DiskFull as exc:
            found.append(f"disk low: {exc}")
        except OSError:
            pass  # the scratch directory is made at start; not there yet is not a fault
        return found

    def leftovers(self) -> dict[str, list]:
        """What the pool created and still exists; all empty when idle and closed."""
        directories = sorted(self._sandboxes_dir.iterdir()) if self._sandboxes_dir.exists() else []
        return {
            "sandboxes": [s.name for s in self._live.values()],
            "uids": sorted(self._uids.leased),
            "cgroups": self._cgroups.leftovers(self._prefix + "-") if self._cgroups else [],
            "directories": directories,
            "mounts": mounts_under(self._sandboxes_dir) if self._sandboxes_dir.exists() else [],
        }

    # -- internals ------------------------------------------------------------------
    def _sweep_stale(self) -> None:
        """Reclaim what pools of dead processes left behind (a server killed with
        SIGKILL): their cgroups, volume mounts, images and directories."""
        assert self._cgroups is not None
        self._cgroups.sweep(_left_by_dead_process)
        run_dir = self.settings.run_dir
        for directory in run_dir.iterdir() if run_dir.is_dir() else ():
            kind, _, owner = directory.name.partition("-")
            stale = (kind == "sandboxes" and _left_by_dead_process(owner)) or (
                kind == "agent" and directory.is_dir() and _unlocked(directory))
            if stale:
                log.info("reclaiming %s, left by a process that is gone", directory)
                for mount_point in mounts_under(directory):
                    unmount(mount_point)
                shutil.rmtree(directory, ignore_errors=True)
                directory.with_name(directory.name + ".lock").unlink(missing_ok=True)
        # Images of dead pools' ephemeral volumes, unmounted above.
        scratch = self._scratch_dir.parent
        for directory in scratch.iterdir() if scratch.is_dir() else ():
            kind, _, owner = directory.name.partition("-")
            if kind == "pool" and _left_by_dead_process(owner):
                shutil.rmtree(directory, ignore_errors=True)

    def _install_agent(self) -> Path:
        """Copy the agent's source where any sandbox uid may read it.

        Sandboxes see this directory's host path in their mountinfo, so its name
        says nothing (no pid); a lock file beside it, out of the sandboxes'
        sight, is held while the pool lives and tells a later server whether the
        directory is a dead pool's leftover.
        """
        self.settings.run_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(self.settings.run_dir, 0o711)
        self._agent_dir = self.settings.run_dir / f"agent-{secrets.token_hex(8)}"
        lock = os.open(self._agent_dir.with_name(self._agent_dir.name + ".lock"),
                       os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        self._agent_lock = lock
        package = self._agent_dir / "shoal_agent"
        package.mkdir(parents=True, mode=0o755)
        os.chmod(self._agent_dir, 0o755)
        for source in (*AGENT_SOURCE.glob("*.py"), *AGENT_SOURCE.glob("*.js"),
                       *AGENT_SOURCE.glob("*.toml")):
            target = package / source.name
            shutil.copyfile(source, target)
            os.chmod(target, 0o644)
        return self._agent_dir

    async def cut_all(self, reason: str) -> int:
        """Stop every call running in any sandbox (the server is going away);
        each returns what it produced, ending with ``reason``. How many were cut."""
        cut = await asyncio.gather(*(sandbox.cancel(reason) for sandbox in self.live_sandboxes()),
                                   return_exceptions=True)
        return sum(1 for outcome in cut if outcome is True)

    @property
    def target(self) -> int:
        """How many warm sandboxes the pool keeps: its size, plus what a burst added."""
        return self.settings.pool_size + self._extra

    async def _refill_forever(self) -> None:
        while not self._closing:
            # asyncio.timeout, not wait_for: on 3.11 wait_for loses a cancellation that
            # arrives as the event is set, and close() would wait on this loop forever.
            try:
                async with asyncio.timeout(_SHRINK_SECONDS):
                    await self._wakeup.wait()
            except TimeoutError:
                pass
            self._wakeup.clear()
            if self._cgroups is not None and self._cgroups.pending:
                await asyncio.to_thread(self._cgroups.retry)
            if (self._ready and not self._closing
                    and time.monotonic() - self._missed_at > _BURST_SECONDS):
                await asyncio.sleep(_REFILL_DEFER_SECONDS)
                self._wakeup.clear()  # leases meanwhile are in the count below
            if self.warm_failures:
                await asyncio.sleep(min(0.25 * 2 ** self.warm_failures, _SHRINK_SECONDS))
            if self._extra and time.monotonic() - self._missed_at > _SHRINK_SECONDS:
                self._extra -= 1
                if len(self._ready) > self.target:
                    await self._ready.pop(0).close()
            # While leases wait for sandboxes of their own, the pool's refill
            # waits: its launches would take CPU from the requests waiting now.
            while (not self._waiting
                   and len(self._ready) + len(self._warming) < self.target
                   and len(self._live) < self.target + self.settings.max_sessions):
                task = asyncio.create_task(self._launch_into_pool())
                self._warming.add(task)
                task.add_done_callback(self._warming.discard)
                task.add_done_callback(_log_failure)

    async def _launch_into_pool(self) -> None:
        try:
            sandbox = await self._launch_new(warm=True)
        except Exception:
            self.warm_failures = min(self.warm_failures + 1, 16)
            self._wakeup.set()  # try again, after the back-off
            raise
        self.warm_failures = 0
        if self._closing or self._stale(sandbox):
            await sandbox.close()  # forked by a zygote replaced since: dead with it
        else:
            self._ready.append(sandbox)

    async def _launch_new(self, warm: bool = False) -> Sandbox:
        assert self._cgroups is not None
        async with self._launch_slots:
            name = f"{self._prefix}-{next(self._names)}"
            uid = self._uids.lease()
            home = SandboxHome(self._sandboxes_dir / name)
            cgroup = None
            # A cancelled await does not stop the worker thread: shield it, and
            # on cancellation wait for it, so the cleanup knows what it made.
            preparing = asyncio.ensure_future(asyncio.to_thread(self._prepare, name, uid, home,
                                                                warm))
            try:
                try:
                    cgroup = await asyncio.shield(preparing)
                except asyncio.CancelledError:
                    cgroup = await _outcome(preparing)
                    raise
                if warm:
                    self._warming_groups.add(cgroup)  # a burst lifts it (lease)
                sandbox = Sandbox(self, name, uid, home, cgroup, None)
                sandbox.release_home = lambda: self._volume_of(name).destroy()
                sandbox._process = await self._spawn(sandbox, warm=warm)
            except BaseException as exc:
                # Shielded: a cancelled launch must still give back what it took.
                await asyncio.shield(asyncio.to_thread(self._discard, uid, home, cgroup, name))
                self._launch_failed(exc, name)
                raise
            finally:
                self._warming_groups.discard(cgroup)
            self.stats.launches += 1
            self._live[uid] = sandbox
            return sandbox

    def discard_cgroup(self, cgroup) -> None:
        """Kill and remove a sandbox's cgroup (blocking); a group that will not go
        yet is retried by the refill loop and at close, never forgotten."""
        assert self._cgroups is not None
        self._cgroups.discard(cgroup)

    def _launch_failed(self, exc: BaseException, name: str) -> None:
        if isinstance(exc, Exception):  # not a cancellation
            self.stats.launch_failures += 1
            self.last_failure = f"{type(exc).__name__}: {exc}"
            log.warning("a sandbox launch failed: %s", exc, extra={"sandbox": name})

    def _volume_of(self, name: str) -> Volume:
        return Volume(self._scratch_dir / f"{name}.img", self._sandboxes_dir / name)

    def _prepare(self, name: str, uid: int, home: SandboxHome, warming: bool = False):
        # An ephemeral session's files get a volume of their own: the disk
        # quota holds against code, and teardown is one unmount.
        self._volume_of(name).create(self.settings.disk_limit_mib * MiB, journal=False)
        home.create(uid)
        group = self._cgroups.create(name, self._limits)
        if warming and time.monotonic() - self._missed_at > _BURST_SECONDS:
            _set_group_weight(group, _WARMING_CPU_WEIGHT)
        return group

    def _discard(self, uid: int, home: SandboxHome, cgroup, name: str | None = None) -> None:
        if cgroup is not None:
            self.discard_cgroup(cgroup)
        if name is not None:
            self._cgroups.sweep(lambda group: group == name)  # a half-made group, if any
            self._volume_of(name).destroy()
        self._uids.release(uid)

    async def _spawn(self, sandbox: Sandbox, preload: bool = True,
                     warm: bool = False) -> SandboxProcess:
        assert self._config is not None
        await self._live_zygote()
        try:
            process = await launch(self._config, sandbox.home, sandbox.uid, sandbox._cgroup)
        except LaunchFailed:
            if self._zygote is None or self._zygote.alive:
                raise
            # It died under this launch: once more, on another.
            await self._live_zygote()
            process = await launch(self._config, sandbox.home, sandbox.uid, sandbox._cgroup)
        try:
            # A zygote's forks have the modules imported already.
            if preload and self.settings.preload and self._zygote is None:
                await process.channel.call({"op": "preload", "modules": self.settings.preload},
                                           lambda stream, data: None)
            if warm:
                # What a first call pays for first touches, a warm sandbox pays
                # before its lease (shoal.agent.main.Agent._warm).
                await process.channel.call({"op": "warm"}, lambda stream, data: None)
        except BaseException:
            process.close_channel()
            await asyncio.shield(asyncio.to_thread(stop_process_tree, process, sandbox._cgroup))
            raise
        return process

    async def _destroy(self, sandbox: Sandbox) -> None:
        if self._live.get(sandbox.uid) is sandbox:
            del self._live[sandbox.uid]
        if sandbox in self._ready:
            self._ready.remove(sandbox)
        await asyncio.to_thread(sandbox._remove)
        self._uids.release(sandbox.uid)
        self._wakeup.set()


async def _outcome(future: asyncio.Future):
    """The result of a future once it is done, or None if it failed."""
    await asyncio.wait([future])
    return None if future.cancelled() or future.exception() else future.result()


def _left_by_dead_process(name: str) -> bool:
    """Whether a "<pid>.<random>..." name belongs to a process no longer running."""
    pid_text = name.split(".", 1)[0]
    if not pid_text.isdigit() or int(pid_text) == os.getpid():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _unlocked(directory: Path) -> bool:
    """Whether no live pool holds the lock beside a directory (or it has none)."""
    try:
        fd = os.open(directory.with_name(directory.name + ".lock"), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("warming a sandbox failed: %s", task.exception())


def _set_group_weight(group, weight: int) -> None:
    try:
        group.set_cpu_weight(weight)
    except (OSError, KeyError) as exc:
        # Only the refill's manners depend on it: the sandbox still runs.
        log.warning("could not set a sandbox's CPU weight: %s", exc)
