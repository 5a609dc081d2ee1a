"""Failing closed: without root, bubblewrap, user namespaces or cgroups, Shoal refuses.

``shoal check`` and ``shoal serve`` are run for real with one piece of isolation
taken away, each time in a way that leaves the host as it is:

- no root: the command runs as ``nobody`` (``setpriv``);
- no bubblewrap: an empty file is bind-mounted over ``/usr/bin/bwrap``, in a
  private mount namespace of the command's own;
- user namespaces disabled: a file holding ``0`` is bind-mounted over
  ``/proc/sys/user/max_user_namespaces``, the same way;
- no cgroups: every cgroup mount is unmounted, the same way.

Each must name what is missing and exit non-zero (``check`` 1, ``serve`` 2), and
nothing may have run: the command runs under ``strace``, which records every
program any of its processes executed, and after the ``shoal`` command itself
there must be none but the host's ``python3`` that ``find_runtime`` asks for its
version (no ``sh`` of the launcher, no ``prlimit``, no ``setpriv``, no ``bwrap``, no
zygote's ``unshare``, no sandbox interpreter), no cgroup may be named with its pid,
and the run and data directories it was given must not have been made. Controls show that the same harness passes a
healthy host (``shoal check`` exits 0) and does see a sandbox start (a healthy
``shoal serve`` under the same trace executes bubblewrap or the zygote).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.serving import free_port, launcher
from tests.uid_slots import uid

SHOAL = Path(sys.executable).parent / "shoal"
RUN_ROOT = Path("/run/shoal-test")
# Far from every other suite's uids (see tests/*/conftest.py); nothing here may use them.
UID_BASE = uid(1_500_000)

NOT_ROOT = "Shoal must run as root"
NO_BWRAP = "/usr/bin/bwrap is missing: apt-get install bubblewrap"
NO_USERNS = "user namespaces are disabled"
NO_CGROUPS = "no usable cgroup hierarchy"
NO_NAMESPACE = "bwrap: No permissions to create new namespace"
RUNTIME_CACHE = "/var/cache/shoal/runtime/"


def _cgroup_mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            left, _, right = line.partition(" - ")
            if right.split()[:1] in (["cgroup"], ["cgroup2"]):
                points.append(left.split()[4])
    return points


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    executed: list[tuple[int, str]]  # (pid, program) of every successful execve, in order
    run_dir: Path
    data_dir: Path

    @property
    def shoal_pid(self) -> int:
        pids = [pid for pid, program in self.executed if program == str(SHOAL)]
        assert pids, f"the trace never saw {SHOAL} start: {self.executed}"
        return pids[0]

    @property
    def after_shoal(self) -> list[str]:
        """Programs executed once the shoal command had started."""
        index = next(i for i, (_, program) in enumerate(self.executed) if program == str(SHOAL))
        return [program for _, program in self.executed[index + 1:]]


_EXECVE = re.compile(r'^(\d+)\s+execve\("([^"]*)"')


def _traced(tmp_path: Path, command: str, absence: str | None, wait: bool = True,
            extra: list[str] | None = None) -> tuple[subprocess.Popen, Path, Path, Path]:
    """Start ``shoal <command>`` under strace with ``absence`` simulated."""
    tag = secrets.token_hex(4)
    run_dir = RUN_ROOT / f"fail-closed-{os.getpid()}-{tag}"
    data_dir = tmp_path / f"data-{tag}"
    trace = tmp_path / f"trace-{tag}"
    shoal = [str(SHOAL), command, "--run-dir", str(run_dir), "--data-dir", str(data_dir),
             "--uid-base", str(UID_BASE), *(["--launcher", launcher()] if launcher() else []),
             *(extra or [])]
    if absence == "root":
        shoal = ["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                 *shoal]
    strace = ["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=execve",
              "-e", "status=successful", "-o", str(trace), *shoal]
    setup = {
        None: "true",
        "root": "true",
        # An empty, non-executable file where bubblewrap should be.
        "bwrap": f'mount --bind "{tmp_path / "empty"}" /usr/bin/bwrap',
        "userns": f'mount --bind "{tmp_path / "zero"}" /proc/sys/user/max_user_namespaces',
        # A bubblewrap that is there but cannot build a sandbox, as under a policy that
        # refuses it namespaces: no check before start-up can see that.
        "no-sandbox": f'mount --bind "{tmp_path / "failing-bwrap"}" /usr/bin/bwrap',
        # Deepest first: on a v1 host they sit on a tmpfs at /sys/fs/cgroup.
        "cgroups": " && ".join(f'umount "{point}"'
                               for point in sorted(_cgroup_mount_points(), key=len, reverse=True)),
    }[absence]
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "zero").write_text("0\n")
    (tmp_path / "failing-bwrap").write_text(f"#!/bin/sh\necho '{NO_NAMESPACE}' >&2\nexit 1\n")
    (tmp_path / "failing-bwrap").chmod(0o755)
    script = f'{setup} && exec "$@"'
    argv = ["unshare", "--mount", "--propagation", "private", "--",
            "/bin/sh", "-c", script, "sh", *strace]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")})
    return process, trace, run_dir, data_dir


def _executed(trace: Path) -> list[tuple[int, str]]:
    found = []
    for line in trace.read_text().splitlines():
        match = _EXECVE.match(line)
        if match:
            found.append((int(match.group(1)), match.group(2)))
    return found


def _stop_traced(process: subprocess.Popen) -> tuple[str, str]:
    """Stop a traced shoal command: SIGTERM to shoal itself, strace's child (SIGTERM to
    strace would only detach it), SIGKILL if it does not end."""
    try:
        with open(f"/proc/{process.pid}/task/{process.pid}/children") as handle:
            children = [int(pid) for pid in handle.read().split()]
    except OSError:
        children = []
    for child in children:
        os.kill(child, signal.SIGTERM)
    try:
        return process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.kill()
        return process.communicate()


def run_shoal(tmp_path: Path, command: str, absence: str | None,
              extra: list[str] | None = None) -> Outcome:
    process, trace, run_dir, data_dir = _traced(tmp_path, command, absence,
                                                extra=["--port", str(free_port()), *(extra or [])])
    try:
        stdout, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        _, stderr = _stop_traced(process)
        shutil.rmtree(run_dir, ignore_errors=True)
        pytest.fail(f"shoal {command} did not refuse, it kept running:\n{stderr[-3000:]}")
    return Outcome(process.returncode, stdout, stderr, _executed(trace), run_dir, data_dir)


def _sandbox_cgroups(pid: int) -> list[str]:
    """Cgroups named with ``pid`` (sandbox groups are ``<pid>.<hex>-...``) in any hierarchy."""
    found = []
    for root in _cgroup_mount_points():
        for directory, subdirectories, _ in os.walk(root):
            found += [os.path.join(directory, name) for name in subdirectories
                      if name.startswith(f"{pid}.")]
            if os.path.basename(directory) == "shoal":
                subdirectories[:] = []
    return found


# The only program shoal check / serve may run before it serves: the runtime's hash
# includes the host interpreter's version (shoal.sandbox.runtime).
MAY_RUN = {"/usr/bin/python3"}


def assert_nothing_ran(outcome: Outcome) -> None:
    assert set(outcome.after_shoal) <= MAY_RUN, \
        f"programs started after shoal itself: {outcome.after_shoal}"
    assert _sandbox_cgroups(outcome.shoal_pid) == []
    assert not outcome.run_dir.exists(), f"{outcome.run_dir} was made"
    assert not outcome.data_dir.exists() or not any(outcome.data_dir.iterdir()), \
        sorted(outcome.data_dir.iterdir())


ABSENCES = {"root": NOT_ROOT, "bwrap": NO_BWRAP, "userns": NO_USERNS, "cgroups": NO_CGROUPS}


@pytest.mark.parametrize("absence", ABSENCES)
def test_check_refuses(tmp_path, absence):
    outcome = run_shoal(tmp_path, "check", absence)
    assert outcome.returncode == 1, outcome
    assert outcome.stderr.startswith("Shoal cannot run here:"), outcome.stderr
    assert ABSENCES[absence] in outcome.stderr, outcome.stderr
    assert "isolation:" not in outcome.stdout
    assert_nothing_ran(outcome)


@pytest.mark.parametrize("absence", ABSENCES)
def test_serve_refuses_to_start(tmp_path, absence):
    outcome = run_shoal(tmp_path, "serve", absence)
    assert outcome.returncode == 2, outcome
    assert "shoal: refusing to start:" in outcome.stderr, outcome.stderr
    assert ABSENCES[absence] in outcome.stderr, outcome.stderr
    assert "serving on" not in outcome.stderr
    assert_nothing_ran(outcome)


def test_serve_fails_closed_when_no_sandbox_can_start(tmp_path):
    """bubblewrap is installed but cannot make a sandbox: the checks pass, and the first
    sandbox, launched before the server binds, fails. The server must say so and exit
    (it once logged the failure and then hung forever, never serving, never exiting)."""
    process_uids = range(UID_BASE, UID_BASE + 4096)
    outcome = run_shoal(tmp_path, "serve", "no-sandbox", extra=["--launcher", "bwrap"])
    try:
        assert outcome.returncode == 1, outcome
        assert "sandbox did not start" in outcome.stderr and NO_NAMESPACE in outcome.stderr, \
            outcome.stderr[-3000:]
        assert "shoal: refusing to serve: start-up failed" in outcome.stderr
        # The launch got as far as the (failing) bubblewrap, and no sandbox code ran.
        assert "/usr/bin/bwrap" in outcome.after_shoal, outcome.after_shoal
        assert not [p for p in outcome.after_shoal if p.startswith((RUNTIME_CACHE, "/opt/shoal"))]
        assert _sandbox_cgroups(outcome.shoal_pid) == []
        left = [p for p in os.listdir("/proc") if p.isdigit() and _uid_of(int(p)) in process_uids]
        assert left == [], left
    finally:
        shutil.rmtree(outcome.run_dir, ignore_errors=True)


def _uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as handle:
            return int(next(line for line in handle if line.startswith("Uid:")).split()[1])
    except (OSError, StopIteration, ValueError):
        return None


# -- controls: the harness passes a healthy host, and sees a sandbox start ----------------------------
def test_control_check_passes_on_this_host(tmp_path):
    outcome = run_shoal(tmp_path, "check", None)
    assert outcome.returncode == 0, outcome.stderr
    assert "isolation: bubblewrap, seccomp, cgroups and the runtime are all available" \
        in outcome.stdout
    assert_nothing_ran(outcome)


def test_control_the_trace_sees_a_healthy_server_start_sandboxes(tmp_path):
    port = free_port()
    process, trace, run_dir, _ = _traced(tmp_path, "serve", None,
                                         extra=["--port", str(port), "--pool-size", "1",
                                                "--preload-modules", ""])
    try:
        deadline = time.monotonic() + 120
        healthy = False
        while time.monotonic() < deadline and process.poll() is None and not healthy:
            try:
                healthy = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.2)
        assert healthy, f"the traced server did not become healthy: {process.poll()}"
    finally:
        _stop_traced(process)
    programs = [program for _, program in _executed(trace)]
    # bwrap starts each sandbox; the zygote is started by unshare and forks them.
    starters = {"bwrap": {"/usr/bin/bwrap"}, "zygote": {"/usr/bin/unshare"},
                None: {"/usr/bin/bwrap", "/usr/bin/unshare"}}[launcher()]
    assert starters & set(programs), programs
    assert set(programs) - MAY_RUN - {str(SHOAL)}, "control: a sandbox ran, the trace saw nothing"
    assert process.returncode in (0, -signal.SIGTERM), process.returncode  # uvicorn re-raises it
    assert not any(run_dir.glob("sandboxes-*")), "the server left its sandboxes"
    shutil.rmtree(run_dir)
