"""Starting one sandbox process tree and opening the channel to its agent.

The command line is a short chain, each link doing one thing before it execs
the next, so the server never forks with Python code to run in the child:

    sh      writes its own pid into the sandbox's cgroups (charged from birth)
    prlimit sets rlimits, the second layer under the cgroup limits
    setpriv drops root for the sandbox's own uid, no groups, no new privileges
    bwrap   builds the namespaces and mounts and loads the seccomp filter
    python  the agent, talking over an inherited socket, never stdin/stdout

No shell ever parses untrusted text here: the script is a constant and every
value arrives as its own argument.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from . import seccomp
from .cgroups import Cgroup
from .channel import Channel, ChannelClosed
from .mounts import AGENT_ROOT, OOM_SCORE_ADJ, RUNTIME, SandboxHome, bwrap_arguments
from .ptys import PtyCapFailed, cap_bwrap_ptys
from .uids import sandbox_uid
from .zygote import Zygote, ZygoteFailed, spawn_spec

BWRAP = "/usr/bin/bwrap"
SETPRIV = "/usr/bin/setpriv"
PRLIMIT = "/usr/bin/prlimit"
# dash exports PWD on its own; bwrap's pid 1 would keep it, readable at /proc/1/environ.
# As root, before anything of the sandbox runs: into its cgroups, and its OOM
# standing (mounts.OOM_SCORE_ADJ).
_ATTACH_AND_EXEC = ('unset PWD OLDPWD; for f in $1; do echo $$ > "$f" || exit 97; done; '
                    'echo $2 > /proc/self/oom_score_adj || exit 96; shift 2; exec "$@"')
_BOOT = (f"import sys; sys.path.insert(0, {AGENT_ROOT!r}); "
         "from shoal_agent.main import main; main()")
READY_TIMEOUT_SECONDS = 15.0


class LaunchFailed(RuntimeError):
    """A sandbox did not come up; the message carries bubblewrap's own words."""


@dataclass(frozen=True)
class LaunchConfig:
    """What every launch needs, resolved once when the pool starts."""

    runtime: Path
    agent_root: Path
    tmp_size_bytes: int
    pids_limit: int
    max_open_files: int = 4096
    # When set, sandboxes are forked from the zygote instead of started by bwrap.
    zygote: Zygote | None = None
    # Where egress is granted: the broker's socket directory, bound into each sandbox.
    egress_dir: Path | None = None

    @property
    def open_files(self) -> int:
        """A sandbox's RLIMIT_NOFILE: never above the server's own hard limit, which
        a server without CAP_SYS_RESOURCE (systemd's LimitNOFILE, a container)
        could not raise for its sandboxes. Read at each launch: it may change."""
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        if hard == resource.RLIM_INFINITY:
            return self.max_open_files
        return min(self.max_open_files, hard)

    @property
    def nproc(self) -> int:
        # Above the cgroup's pids.max, so that the cgroup limit is the one that
        # fires (and is reported); the rlimit is the backstop.
        return self.pids_limit + 64


@dataclass
class SandboxProcess:
    """A sandbox's process tree: bwrap's (``popen``), or the zygote's forks: the
    sandbox's init (``outer_pid``, its one process the host's pid namespace
    does not hold) and the agent the zygote forked into its walls (``forked_agent``)."""

    popen: subprocess.Popen | None
    channel: Channel
    agent_pid: int
    outer_pid: int = 0
    forked_agent: int = 0
    errors_fd: int = -1  # our end of bwrap's stderr pipe, closed with the sandbox
    # The zygote that forked it (None: bwrap's): its forks die with it.
    zygote: Zygote | None = None

    def close_channel(self) -> None:
        self.channel.close()


def command_line(config: LaunchConfig, home: SandboxHome, uid: int, cgroup: Cgroup,
                 channel_fd: int, seccomp_fd: int) -> list[str]:
    return [
        "/bin/sh", "-c", _ATTACH_AND_EXEC, "sh", " ".join(cgroup.procs_files),
        str(OOM_SCORE_ADJ),
        PRLIMIT, f"--nofile={config.open_files}", "--core=0", f"--nproc={config.nproc}", "--",
        SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
        "--inh-caps=-all", "--",
        BWRAP, *bwrap_arguments(home, config.runtime, config.agent_root,
                                config.tmp_size_bytes, seccomp_fd, config.egress_dir),
        "--", f"{RUNTIME}/bin/python3", "-I", "-c", _BOOT, str(channel_fd),
    ]


async def launch(config: LaunchConfig, home: SandboxHome, uid: int, cgroup: Cgroup) -> SandboxProcess:
    # Checked here, before either launcher sees it: the last place a uid that
    # would leave the sandbox root can be stopped (UnsafeUid is no LaunchFailed,
    # so the pool does not retry it with bubblewrap).
    sandbox_uid(uid)
    host_end, sandbox_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # bwrap's stderr is a pipe the host holds: bubblewrap's pid 1 keeps it open
    # for the sandbox's life, and it must not be a host file it could fill.
    errors_read, errors_write = os.pipe()
    os.set_blocking(errors_read, False)
    popen = None
    outer_pid = forked_agent = 0
    try:
        if config.zygote is not None:
            spec = spawn_spec(home, uid, cgroup.procs_files, config.tmp_size_bytes,
                              config.open_files, config.nproc,
                              egress=config.egress_dir is not None)
            try:
                outer_pid, forked_agent = await config.zygote.spawn(spec, sandbox_end.fileno(),
                                                                     home.root)
            except ZygoteFailed as exc:
                # The walls could not be built: the zygote's diagnostics say why.
                host_end.close()
                os.close(errors_read)
                raise LaunchFailed(f"{exc}: {config.zygote.diagnostics() or 'no diagnostics'}"
                                   ) from None
        else:
            seccomp_fd = seccomp.write_filter_fd(inet=config.egress_dir is not None)
            try:
                os.set_inheritable(sandbox_end.fileno(), True)
                argv = command_line(config, home, uid, cgroup, sandbox_end.fileno(), seccomp_fd)
                popen = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors_write,
                    env={}, cwd="/", pass_fds=(sandbox_end.fileno(), seccomp_fd),
                    start_new_session=True)
            finally:
                os.close(seccomp_fd)
    finally:
        sandbox_end.close()
        os.close(errors_write)
    channel = None
    try:
        channel = await Channel.open(host_end)
        hello = await asyncio.wait_for(channel.receive(), READY_TIMEOUT_SECONDS)
        if popen is not None:
            # Its agent runs nothing until asked: capped before it is handed out.
            await asyncio.to_thread(_cap_ptys, popen.pid)
    except BaseException as exc:
        if channel is not None:
            channel.close()
        else:
            host_end.close()
        process = SandboxProcess(popen, channel, 0, outer_pid, forked_agent)  # type: ignore[arg-type]
        await asyncio.shield(asyncio.to_thread(stop_process_tree, process, cgroup))
        try:
            detail = os.read(errors_read, 4000).decode(errors="replace").strip()
        except BlockingIOError:
            detail = ""
        os.close(errors_read)
        if config.zygote is not None:
            detail = config.zygote.diagnostics()
        if isinstance(exc, (ChannelClosed, asyncio.TimeoutError)):
            status = popen.returncode if popen is not None else "unknown"
            raise LaunchFailed(f"sandbox did not start (exit status {status}): "
                               f"{detail or 'no diagnostics'}") from None
        raise
    agent_pid = hello.get("pid") if isinstance(hello.get("pid"), int) else 0
    return SandboxProcess(popen=popen, channel=channel, agent_pid=agent_pid, outer_pid=outer_pid,
                          forked_agent=forked_agent, errors_fd=errors_read, zygote=config.zygote)


def _cap_ptys(bwrap_pid: int) -> None:
    """bubblewrap's devpts takes no limit of its own (shoal.sandbox.ptys)."""
    inits = _children(bwrap_pid)
    if len(inits) != 1:
        raise LaunchFailed(f"bubblewrap has {len(inits)} children, not its sandbox's init")
    try:
        cap_bwrap_ptys(inits[0])
    except (PtyCapFailed, OSError, subprocess.SubprocessError) as exc:
        raise LaunchFailed(str(exc)) from None


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(child) for child in handle.read().split()]
    except OSError:
        return []


def _wait_reaped(pid: int, timeout: float = 5.0) -> None:
    """Wait until the zygote has reaped its fork ``pid``: a closed sandbox
    leaves no zombie behind (the zygote reaps on SIGCHLD)."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.002)


def stop_process_tree(process: SandboxProcess, cgroup: Cgroup) -> None:
    """Kill a sandbox's processes and reap the ones that are ours to reap.

    bubblewrap's init goes first: the kernel then ends its whole pid namespace,
    the outer bubblewrap reaps it and exits, and nothing is orphaned to the
    host's init as a zombie. The cgroup kill catches anything that got away,
    and is all a zygote's sandbox needs: its processes are the children of the
    zygote and its builder, which reap them (orphans go to them too), and we
    wait until they have.
    """
    if process.popen is not None:
        for child in _children(process.popen.pid):
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            process.popen.wait(2)
        except subprocess.TimeoutExpired:
            pass
    cgroup.kill()
    if process.popen is not None:
        process.popen.kill()
        process.popen.wait()
    else:
        for pid in (process.outer_pid, process.forked_agent):
            if pid:
                _wait_reaped(pid)
    if process.errors_fd >= 0:
        os.close(process.errors_fd)
        process.errors_fd = -1
