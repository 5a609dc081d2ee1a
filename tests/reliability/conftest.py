"""Real servers for the reliability suite, and the host-side view of what they leave.

Every server started here gets a uid range, a run directory and a ``TMPDIR`` of
its own, so that "nothing of this server is left" can be checked exactly, from
the host's point of view, without counting other servers (other tests of this
run, or other people's runs on the same machine):

- processes: none runs as a uid of the server's range;
- cgroups: none is named with the server's pid (names are ``<pid>.<hex>-...``,
  see ``shoal/sandbox/pool.py``);
- mounts: none under its run directory or data directory (loop devices are not
  counted: a process in a mount namespace of its own, such as another test run's
  zygote, keeps a copy of every mount that existed when it unshared, and with it
  the loop device, however cleanly the server unmounted);
- uid leases: every lock file under ``<run_dir>/uids`` can be locked again;
- temporary directories: no ``sandboxes-<pid>.*`` or ``agent-<pid>.*`` in the run
  directory, and the server's ``TMPDIR`` is empty.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.processes import host_processes, processes_in  # noqa: F401 (re-exported)
from tests.serving import DEFAULTS, Server, start_server
from tests.uid_slots import OFFSET, uid

RUN_ROOT = Path("/run/shoal-test")
UID_COUNT = 4096
# Far from the other suites' ranges (200000, 410000, 600000 + 10000 k), and per
# pytest process, so two runs of this suite at once never share a uid.
_RUN_UID_BASE = 2_000_000 + (os.getpid() % 2000) * 250_000
_slots = itertools.count()
# Zombies of a killed sandbox are reaped by the host's init, which may take a moment.
REAP_SECONDS = 20.0


@dataclass
class ShoalServer(Server):
    """A ``shoal serve`` process with everything needed to audit what it leaves."""

    run_dir: Path = Path()
    tmp_dir: Path = Path()
    uid_base: int = 0
    uid_count: int = UID_COUNT
    settings: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def uids(self) -> range:
        return range(self.uid_base, self.uid_base + self.uid_count)

    def client(self, token: str | None = None, timeout: float = 120,
               **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout, **kwargs)


def _start(tmp_path: Path, run_dir: Path, uid_base: int, data_dir: Path | None,
           settings: dict) -> ShoalServer:
    # A TMPDIR of its own, so the audit can tell the server's temporary files apart.
    tmp_dir = tmp_path / f"tmp-{len(list(tmp_path.glob('tmp-*')))}"
    tmp_dir.mkdir()
    server = start_server(
        tmp_path, uid_base, data_dir, run_dir=run_dir, env={"TMPDIR": str(tmp_dir)},
        server_type=ShoalServer, uid_count=UID_COUNT, **settings,
        fields={"run_dir": run_dir, "tmp_dir": tmp_dir, "uid_base": uid(uid_base),
                "settings": {**DEFAULTS, **settings}})
    return server


# -- the host's view -----------------------------------------------------------------------------
def wait_for_no_processes(uids: range | set[int], timeout: float = REAP_SECONDS) -> list[dict]:
    """Processes still running as one of ``uids`` once zombies had time to be reaped."""
    deadline = time.monotonic() + timeout
    while True:
        left = processes_in(uids)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def sandbox_processes(uid: int) -> dict[str, list[dict]]:
    """A sandbox's host processes by role, by their pid namespaces (so for either
    launcher): bubblewrap's outer process is in the host's pid namespace (a
    zygote's sandbox has none), the init is pid 1 of the sandbox's namespace,
    and the agent is the interpreter beside it (bwrap's init started it; the
    zygote forked it in). The handle is the one the server holds: the outer
    bubblewrap, or the zygote's init."""
    mine = [p for p in processes_in({uid}) if p["state"] != "Z"]
    outer = [p for p in mine if len(p["nspid"]) == 1]
    inner = [p for p in mine if len(p["nspid"]) > 1 and p["nspid"][-1] == 1]
    agents = [p for p in mine if len(p["nspid"]) > 1 and p["nspid"][-1] == 2
              and p["name"].startswith("python")]
    return {"outer": outer, "inner": inner, "agent": agents, "handle": outer or inner,
            "all": mine}


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as handle:
        return [line.split()[4] for line in handle]


def mounts_under(directory: Path) -> list[str]:
    prefix = str(directory.resolve()) + "/"
    return [point for point in _mount_points() if point.startswith(prefix)]


def _cgroup_roots() -> list[Path]:
    roots = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            left, _, right = line.partition(" - ")
            if right.split()[:1] in (["cgroup"], ["cgroup2"]):
                roots.append(Path(left.split()[4]))
    return roots


def cgroups_of(pid: int) -> list[str]:
    """Sandbox cgroups named with a server's pid (``<pid>.<hex>-...`` inside a
    ``shoal`` group), in every cgroup hierarchy of the host. Read-only."""
    found = []
    for root in _cgroup_roots():
        for directory, subdirectories, _ in os.walk(root):
            if os.path.basename(directory) == "shoal":
                found += [os.path.join(directory, name) for name in subdirectories
                          if name.startswith(f"{pid}.")]
                subdirectories[:] = []  # sandbox groups have no groups of their own
    return sorted(found)


def cgroup_detail(groups: list[str], server: ShoalServer) -> list[str]:
    """What keeps leftover groups (their tasks and children) and what the server
    logged about cgroups: a leak is only fixable with this in the report."""
    detail = []
    for group in groups:
        try:
            tasks = Path(group, "tasks").read_text().split()
            children = [p.name for p in Path(group).iterdir() if p.is_dir()]
        except OSError as exc:
            tasks, children = [f"unreadable: {exc}"], []
        detail.append(f"{group}: tasks {tasks}, children {children}")
    detail += [line for line in server.log().splitlines() if "cgroup" in line][-10:]
    return detail


def held_uid_locks(run_dir: Path) -> list[str]:
    """Uid lease lock files someone still holds (a lease never given back)."""
    held = []
    directory = run_dir / "uids"
    if not directory.is_dir():
        return held
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.append(path.name)
        finally:
            os.close(fd)
    return held


def leftovers(server: ShoalServer, pid: int | None = None) -> dict[str, list]:
    """What a stopped server (``pid``, by default the server's own) left on the host.

    The data directory's own files (the database, container images) are the
    durable state and not leftovers; everything else must be gone.
    """
    pid = pid or server.pid
    temporary = [p.name for p in server.run_dir.iterdir()
                 if p.name.startswith((f"sandboxes-{pid}.", f"agent-{pid}."))] \
        if server.run_dir.is_dir() else []
    groups = cgroups_of(pid)
    return {
        "processes": wait_for_no_processes(server.uids),
        "cgroups": groups,
        "cgroup_detail": cgroup_detail(groups, server) if groups else [],
        "mounts": mounts_under(server.run_dir) + mounts_under(server.data_dir),
        "uid_locks": held_uid_locks(server.run_dir),
        "run_dir_entries": temporary,
        "tmp_files": sorted(str(p) for p in server.tmp_dir.rglob("*")),
    }


def assert_nothing_left(server: ShoalServer, pid: int | None = None) -> None:
    assert server.process.poll() is not None, "the server is still running"
    found = leftovers(server, pid)
    assert all(not values for values in found.values()), \
        {key: values for key, values in found.items() if values}


def _force_clean(server: ShoalServer) -> None:
    """Last resort after a test that leaked: never leave the machine dirty."""
    for proc in processes_in(server.uids):
        try:
            os.kill(proc["pid"], signal.SIGKILL)
        except OSError:
            pass
    for point in sorted(mounts_under(server.run_dir) + mounts_under(server.data_dir),
                        key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True)
    for group in cgroups_of(server.pid):
        try:
            os.rmdir(group)
        except OSError:
            pass


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shoal(tmp_path_factory) -> Iterator[Callable[..., ShoalServer]]:
    """``shoal(**settings)`` starts a server (settings are ``shoal serve`` flags).

    ``run_dir=``, ``data_dir=`` and ``uid_base=`` let a test start a second server
    on what a first one left; by default each server has its own of all three. At the end every
    server is stopped and must have left nothing behind.
    """
    started: list[ShoalServer] = []

    def start(run_dir: Path | None = None, data_dir: Path | None = None,
              uid_base: int | None = None, **settings) -> ShoalServer:
        slot = next(_slots) % 48
        # An explicit base is another server's (already in this run's uid slot);
        # start_server puts the base it is given there.
        uid_base = uid_base - OFFSET if uid_base else _RUN_UID_BASE + slot * 5000
        if run_dir is None:
            run_dir = RUN_ROOT / f"reliability-{os.getpid()}-{slot}-{time.monotonic_ns() % 10**6}"
        server = _start(tmp_path_factory.mktemp("shoal"), run_dir, uid_base, data_dir, settings)
        started.append(server)
        return server

    yield start
    problems = {}
    for server in started:
        server.stop()
    for server in started:
        found = leftovers(server)
        if any(found.values()):
            problems[server.url] = {key: values for key, values in found.items() if values}
            _force_clean(server)
    for run_dir in {server.run_dir for server in started}:
        if not mounts_under(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
    assert not problems, f"servers left things behind: {problems}"


# -- HTTP helpers ------------------------------------------------------------------------------------
def create_session(http: httpx.Client, **body) -> str:
    response = http.post("/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()["session_id"]


def run(http: httpx.Client, session_id: str, tool: str, timeout: int | None = None,
        **payload) -> dict:
    """One exec; asserts 200 and returns the body, with the content at ``["content"]``."""
    body = {"tool": tool, "input": payload}
    if timeout is not None:
        body["timeout_seconds"] = timeout
    response = http.post(f"/sessions/{session_id}/exec", json=body)
    assert response.status_code == 200, f"{response.status_code}: {response.text[:2000]}"
    answer = response.json()
    answer["content"] = answer["result_block"]["content"]
    return answer


def python(http: httpx.Client, session_id: str, code: str, timeout: int | None = None) -> dict:
    return run(http, session_id, "code_execution", timeout, code=code)


def bash(http: httpx.Client, session_id: str, command: str, timeout: int | None = None) -> dict:
    return run(http, session_id, "bash_code_execution", timeout, command=command)


def sandbox_uid(http: httpx.Client, session_id: str) -> int:
    return int(bash(http, session_id, "id -u")["content"]["stdout"])


class Responsiveness:
    """Probes the server from a thread while an attack runs elsewhere.

    Each round times ``GET /health`` and a trivial exec in a session of its own (not
    the attacked one). Before the attack, ``BASELINE_ROUNDS`` rounds measure what the
    probes take on this machine at this moment; during the attack every probe must
    answer correctly and within a bound relative to that baseline: ``SLOWDOWN`` times
    the slowest baseline probe, and never less than a floor of a few seconds. A
    server that stalls (a blocked event loop, a starved worker) fails; a machine
    that is merely busy does not. (The latency figures themselves belong to bench/.)

    The probe is sure to overlap the attack: ``__enter__`` returns once its first
    round is under way, and ``__exit__`` waits for the round in progress to end, so
    a server that hangs during the attack leaves a probe that never comes back.
    """

    BASELINE_ROUNDS = 5
    SLOWDOWN = 20.0
    HEALTH_FLOOR = 5.0
    EXEC_FLOOR = 10.0
    JOIN_SECONDS = 90.0

    def __init__(self, server: Server, pause: float = 0.1,
                 expected_reasons: frozenset[str] = frozenset()) -> None:
        """``expected_reasons``: the readiness reasons the attack is meant to cause
        (filling every session slot makes the server ``at_capacity``); ``/health``
        may report those, and only those, as ``degraded``."""
        self.server = server
        self.pause = pause
        self.expected_reasons = expected_reasons
        self.health: list[float] = []
        self.execs: list[float] = []
        self.rounds: list[tuple[float, float]] = []  # (started, ended), monotonic
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._entered = self._exited = 0.0
        self._http = server.client(timeout=60)
        self.session_id = create_session(self._http)
        python(self._http, self.session_id, "print(1)")  # warm
        baseline_health: list[float] = []
        baseline_execs: list[float] = []
        for _ in range(self.BASELINE_ROUNDS):
            health, execution = self._round()
            baseline_health.append(health)
            baseline_execs.append(execution)
        assert not self.failures, f"the probes failed before the attack: {self.failures[:5]}"
        self.baseline = {"health": max(baseline_health), "exec": max(baseline_execs)}
        self.health_bound = max(self.HEALTH_FLOOR, self.SLOWDOWN * self.baseline["health"])
        self.exec_bound = max(self.EXEC_FLOOR, self.SLOWDOWN * self.baseline["exec"])

    def _healthy(self, body: dict) -> bool:
        if body.get("status") == "ok":
            return True
        reasons = set(body.get("reasons") or ())
        return body.get("status") == "degraded" and bool(reasons) \
            and reasons <= self.expected_reasons

    def _round(self) -> tuple[float, float]:
        """One health probe and one neighbour exec; their latencies (a failure is
        recorded in ``failures``)."""
        health = execution = float("nan")
        try:
            started = time.monotonic()
            response = self._http.get("/health")
            health = time.monotonic() - started
            if response.status_code != 200 or not self._healthy(response.json()):
                self.failures.append(f"health: {response.status_code} {response.text[:200]}")
            started = time.monotonic()
            response = self._http.post(f"/sessions/{self.session_id}/exec", json={
                "tool": "code_execution", "input": {"code": "print(6 * 7)"}})
            execution = time.monotonic() - started
            if response.status_code != 200:
                self.failures.append(f"exec: {response.status_code} {response.text[:200]}")
            else:
                content = response.json()["result_block"]["content"]
                if content["stdout"] != "42\n" or content["return_code"] != 0:
                    self.failures.append(f"exec answered wrongly: {content}")
        except Exception as exc:  # any transport failure is a failure of the probe
            self.failures.append(f"{type(exc).__name__}: {exc}")
        return health, execution

    def _probe(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self._started.set()
            health, execution = self._round()
            self.health.append(health)
            self.execs.append(execution)
            self.rounds.append((started, time.monotonic()))
            self._stop.wait(self.pause)

    def __enter__(self) -> "Responsiveness":
        self._thread = threading.Thread(target=self._probe, name="responsiveness", daemon=True)
        self._thread.start()
        self._started.wait()
        self._entered = time.monotonic()
        return self

    def __exit__(self, *exc_info) -> None:
        self._exited = time.monotonic()
        self._stop.set()
        assert self._thread is not None
        self._thread.join(self.JOIN_SECONDS)
        if not self._thread.is_alive():
            try:
                self._http.delete(f"/sessions/{self.session_id}")
            finally:
                self._http.close()

    def summary(self) -> str:
        def worst(samples: list[float]) -> str:
            return f"{max(samples) * 1000:.0f} ms" if samples else "none"
        return (f"{len(self.health)} health probes (worst {worst(self.health)}, baseline "
                f"{self.baseline['health'] * 1000:.0f} ms, bound {self.health_bound:.1f} s), "
                f"{len(self.execs)} neighbour execs (worst {worst(self.execs)}, baseline "
                f"{self.baseline['exec'] * 1000:.0f} ms, bound {self.exec_bound:.1f} s)")

    def check(self) -> None:
        assert self._thread is not None and not self._thread.is_alive(), \
            f"a probe did not come back within {self.JOIN_SECONDS:.0f}s of the attack's end"
        assert not self.failures, f"probes failed during the attack: {self.failures[:5]}"
        overlapping = [r for r in self.rounds if r[0] <= self._exited and r[1] >= self._entered]
        assert overlapping, f"no probe ran during the attack: {self.summary()}"
        slow_health = [t for t in self.health if t >= self.health_bound]
        slow_execs = [t for t in self.execs if t >= self.exec_bound]
        assert not slow_health, f"health slower than {self.health_bound:.1f}s: {self.summary()}"
        assert not slow_execs, \
            f"neighbour exec slower than {self.exec_bound:.1f}s: {self.summary()}"
