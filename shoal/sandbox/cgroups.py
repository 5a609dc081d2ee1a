"""Control groups: memory, pids and CPU limits per sandbox, and a clean kill.

Hosts differ: some mount cgroup v1 with one hierarchy per controller (as on the
machines this project was measured on), modern ones are v2-only. Both are
supported behind one small ``Cgroup`` handle. Where a v2 hierarchy exists next
to v1 (hybrid mode) it is used as well, for ``cgroup.kill``, which empties a
group in one write instead of a race against forks.

Processes are attached by writing their pid into each ``cgroup.procs`` file; the
launcher does that from the process itself before it execs bubblewrap, so every
process of the sandbox is charged from its first instruction.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ._mountinfo import mount_table

V1_CONTROLLERS = ("memory", "pids", "cpu")
_GROUP_PREFIX = "shoal"

log = logging.getLogger("shoal.pool")


class CgroupUnavailable(RuntimeError):
    """The host cannot give sandboxes the limits they need."""


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    pids: int
    cpu_cores: float


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(mount point, fs type, super options) for each cgroup mount."""
    return [mount for mount in mount_table() if mount[1] in ("cgroup", "cgroup2")]


_MS_REMOUNT = 32


def favor_dynamic_changes() -> str | None:
    """Have the kernel favour moving processes between cgroups over forks and
    exits: cgroup2's ``favordynmods`` (Linux 6.0). Without it, every move of a
    process into a group (each sandbox's first act) waits for an RCU grace period,
    8-20 ms here, and the moves of a burst of launches queue behind each other;
    with it, a move costs well under a millisecond, and forks and exits take a
    slightly slower path. It is one flag for the whole host, whatever hierarchy
    the groups are in, so it is set on the cgroup2 mount, keeping its other
    options. Returns why it could not be set, or None."""
    unified = [(point, options) for point, fstype, options in _mounts() if fstype == "cgroup2"]
    if not unified:
        return "no cgroup2 hierarchy is mounted"
    point, options = unified[0]
    if "favordynmods" in options:
        return None
    kept = [option for option in options if option not in ("rw", "ro")]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(None, point.encode(), None, ctypes.c_ulong(_MS_REMOUNT),
                  ",".join([*kept, "favordynmods"]).encode()) != 0:
        error = ctypes.get_errno()
        return f"remounting {point} with favordynmods: {os.strerror(error)}" + (
            " (Linux 6.0 or newer has it)" if error == 22 else "")
    return None


def dynamic_changes_favored() -> bool:
    return any("favordynmods" in options for _, fstype, options in _mounts()
               if fstype == "cgroup2")


def _own_path(controller: str | None) -> str:
    """Our process's cgroup path in a v1 controller's hierarchy, or in v2 (None)."""
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            names = controllers.split(",") if controllers else []
            if (controller is None and controllers == "") or (controller in names):
                return path
    return "/"


class Cgroup:
    """One sandbox's cgroup, present in every hierarchy Shoal uses."""

    def __init__(self, directories: dict[str, Path], version: int) -> None:
        self.directories = directories  # controller (or "unified") -> directory
        self.version = version

    @property
    def name(self) -> str:
        return next(iter(self.directories.values())).name

    @property
    def procs_files(self) -> list[str]:
        return [str(directory / "cgroup.procs") for directory in self.directories.values()]

    def _file(self, controller: str, name: str) -> Path:
        key = controller if self.version == 1 else "unified"
        return self.directories[key] / name

    def pids(self) -> list[int]:
        """Every process in the group, in any of its hierarchies. A process is
        normally in all of them; one caught between its writes to the procs
        files is in some only, and must not escape a kill for it."""
        found: set[int] = set()
        for directory in self.directories.values():
            found.update(_members(directory))
        return sorted(found)

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        return _read_counter(self._file("memory", name), "oom_kill")

    def pids_limit_hits(self) -> int:
        return _read_counter(self._file("pids", "pids.events"), "max")

    def memory_bytes(self) -> int:
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        try:
            return int(self._file("memory", name).read_text())
        except (OSError, ValueError):
            return 0

    def set_cpu_weight(self, weight: int) -> None:
        """The group's share of contended CPU against its siblings (100 is the
        kernel's default; cgroup v1 scales it to cpu.shares)."""
        # os-level, not pathlib's text layer: a lease sets it on the way to the
        # client's call, and a server that sat idle pays for every layer it touches.
        if self.version == 1:
            _write_value(self.directories["cpu"] / "cpu.shares", str(max(2, weight * 1024 // 100)))
        else:
            _write_value(self.directories["unified"] / "cpu.weight", str(weight))

    def _unthrottle(self) -> None:
        """Lift the CPU quota: a killed process still needs CPU time to exit, and
        a starved group (a fork bomb under a small quota) would take ages to die."""
        try:
            if self.version == 1:
                (self.directories["cpu"] / "cpu.cfs_quota_us").write_text("-1")
            else:
                (self.directories["unified"] / "cpu.max").write_text("max")
        except (OSError, KeyError):
            pass

    def kill(self, timeout: float = 20.0) -> None:
        """Kill every process in the group and wait until it is empty.

        Runs on every teardown, so it reads the membership lists directly (no
        path objects) and waits for the kernel with a growing pause rather than
        re-reading them every millisecond."""
        pids = self.pids()
        if not pids:
            return
        self._unthrottle()
        unified = self.directories.get("unified")
        kill_file = os.path.join(unified, "cgroup.kill") if unified is not None else None
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while pids:
            unreached = pids
            if kill_file is not None:
                try:
                    with open(kill_file, "w") as handle:
                        handle.write("1")
                    # cgroup.kill reaches the unified group's members only: a
                    # process in another hierarchy alone gets SIGKILL by pid.
                    unreached = sorted(set(pids) - set(_members(unified)))
                except OSError:
                    kill_file = None  # no cgroup.kill here (Linux < 5.14)
            for pid in unreached:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"processes {pids} survived SIGKILL")
            time.sleep(pause)
            pause = min(pause * 2, 0.008)
            pids = self.pids()

    def remove(self, timeout: float = 1.0) -> list[Path]:
        """Remove the group's directories; the ones still there after ``timeout``
        are returned (empty when all are gone).

        A directory that will not go is emptied again first: whatever is still
        in it (a straggler of the kill, a zombie's last moment) is killed, so a
        group is never kept by a process the kill did not see.
        """
        deadline = time.monotonic() + timeout
        left = []
        for directory in self.directories.values():
            while True:
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        left.append(directory)
                        break
                    for pid in _members(directory):
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    time.sleep(0.005)
        return left

    def describe(self, directories: list[Path]) -> str:
        """What is in ``directories`` (for the log line of a group that stayed)."""
        parts = []
        for directory in directories:
            tasks = _members(directory, "tasks")
            parts.append(f"{directory} (tasks {tasks or 'none'})")
        return "; ".join(parts)


class CgroupManager:
    """Creates sandbox cgroups in whichever hierarchy this host offers."""

    def __init__(self) -> None:
        mounts = _mounts()
        v1 = {}
        unified = None
        for point, fstype, options in mounts:
            if fstype == "cgroup2":
                unified = Path(point)
            else:
                for controller in V1_CONTROLLERS:
                    if controller in options:
                        v1[controller] = Path(point)
        self._parents: dict[str, Path] = {}
        self._pending: list[Cgroup] = []  # groups discard() could not remove yet
        self._pending_lock = threading.Lock()  # discard() runs in worker threads
        if all(controller in v1 for controller in V1_CONTROLLERS):
            self.version = 1
            for controller, point in v1.items():
                self._parents[controller] = _join(point, _own_path(controller)) / _GROUP_PREFIX
            if unified is not None:
                self._parents["unified"] = _join(unified, _own_path(None)) / _GROUP_PREFIX
        elif unified is not None:
            self.version = 2
            self._parents["unified"] = self._prepare_v2(unified)
        else:
            raise CgroupUnavailable(
                "no usable cgroup hierarchy: need cgroup v1 memory, pids and cpu controllers "
                "or cgroup v2 with them (mount cgroup2 on /sys/fs/cgroup)")
        for parent in self._parents.values():
            try:
                parent.mkdir(exist_ok=True)
            except OSError as exc:
                raise CgroupUnavailable(f"cannot create {parent}: {exc.strerror}; "
                                        "Shoal must run as root to manage cgroups") from None
        if self.version == 2:
            _enable_v2_controllers(self._parents["unified"])
        elif "unified" in self._parents and not (self._parents["unified"] / "cgroup.kill").exists():
            # A hybrid v2 hierarchy is only worth joining for cgroup.kill (kernel >= 5.14).
            del self._parents["unified"]

    @staticmethod
    def _prepare_v2(unified: Path) -> Path:
        own = _join(unified, _own_path(None))
        available = set((own / "cgroup.controllers").read_text().split())
        missing = {"memory", "pids", "cpu"} - available
        if missing:
            raise CgroupUnavailable(
                f"cgroup v2 at {own} lacks the {', '.join(sorted(missing))} controller(s); "
                "delegate them to Shoal's cgroup (e.g. systemd Delegate=yes)")
        # v2 forbids processes in a group whose children get controllers, so
        # the server moves itself into a leaf beside the sandboxes.
        if not (own / "cgroup.subtree_control").read_text().split():
            leaf = own / "shoal-server"
            leaf.mkdir(exist_ok=True)
            for pid in (own / "cgroup.procs").read_text().split():
                try:
                    (leaf / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            _enable_v2_controllers(own)
        return own / _GROUP_PREFIX

    def create(self, name: str, limits: Limits) -> Cgroup:
        directories = {key: parent / name for key, parent in self._parents.items()}
        for directory in directories.values():
            directory.mkdir(exist_ok=True)
        group = Cgroup(directories, self.version)
        period = 100_000
        quota = max(1000, int(limits.cpu_cores * period))
        if self.version == 1:
            memory = directories["memory"]
            (memory / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
            swap = memory / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limits.memory_bytes))
            (directories["pids"] / "pids.max").write_text(str(limits.pids))
            (directories["cpu"] / "cpu.cfs_period_us").write_text(str(period))
            (directories["cpu"] / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            unified = directories["unified"]
            (unified / "memory.max").write_text(str(limits.memory_bytes))
            swap = unified / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
            (unified / "pids.max").write_text(str(limits.pids))
            (unified / "cpu.max").write_text(f"{quota} {period}")
        return group

    def sweep(self, is_stale) -> None:
        """Remove groups whose name ``is_stale`` says were left by a dead owner."""
        stale: dict[str, dict[str, Path]] = {}
        for key, parent in self._parents.items():
            if parent.is_dir():
                for child in parent.iterdir():
                    if child.is_dir() and is_stale(child.name):
                        stale.setdefault(child.name, {})[key] = child
        for directories in stale.values():
            group = Cgroup(directories, self.version)
            try:
                group.kill()
            except TimeoutError:
                continue
            group.remove()

    def discard(self, group: Cgroup, timeout: float = 1.0) -> None:
        """Kill and remove ``group``; if some of it stays (a hierarchy busy past
        ``timeout``), keep it to try again from ``retry``, never forget it."""
        try:
            group.kill()
        except TimeoutError as exc:
            log.warning("cgroup %s: %s", group.name, exc)
        left = group.remove(timeout)
        if left:
            log.warning("cgroup %s could not be removed yet: %s; trying again later",
                        group.name, group.describe(left))
            with self._pending_lock:
                self._pending.append(group)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def retry(self, timeout: float = 0.0) -> int:
        """Try again to remove the groups ``discard`` could not; how many remain."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        still = []
        for group in pending:
            try:
                group.kill(timeout=max(timeout, 0.1))
            except TimeoutError:
                pass
            if group.remove(timeout):
                still.append(group)
        with self._pending_lock:
            self._pending.extend(still)
            return len(self._pending)

    def leftovers(self, prefix: str) -> list[Path]:
        """Groups named with ``prefix`` that still exist; empty once all were removed."""
        found = []
        for parent in self._parents.values():
            if parent.is_dir():
                found.extend(p for p in parent.iterdir() if p.is_dir() and p.name.startswith(prefix))
        return found


def _members(directory: Path, listing: str = "cgroup.procs") -> list[int]:
    try:
        fd = os.open(os.path.join(directory, listing), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError:
        return []
    finally:
        os.close(fd)
    return [int(pid) for pid in b"".join(chunks).split()]


def _join(mount_point: Path, cgroup_path: str) -> Path:
    return mount_point / cgroup_path.lstrip("/")


def _enable_v2_controllers(directory: Path) -> None:
    control = directory / "cgroup.subtree_control"
    try:
        control.write_text("+memory +pids +cpu")
    except OSError as exc:
        raise CgroupUnavailable(f"cannot enable controllers in {directory}: {exc.strerror}") from None


def _write_value(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read_counter(path: Path, key: str) -> int:
    try:
        text = path.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0
