"""The host's side of the zygote: start it, ask it for sandboxes.

The zygote (:mod:`shoal.agent.zygote`) imports the heavy libraries once and
forks every sandbox from itself, building the same isolation bubblewrap builds.
This module starts it in a private mount namespace where the runtime and the
agent sit at the paths sandboxes see, and turns a launch into one request on a
SOCK_SEQPACKET socket carrying the sandbox's description and its channel fd.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import json
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from . import seccomp
from .ptys import PTYS
from .mounts import (AGENT_ROOT, EXTERNAL, OPENAI_DATA, OUTPUTS, RUNTIME, SANDBOX_ENV, SKILLS, UPLOADS,
                     WORKSPACE, SandboxHome)
from .mounts import EGRESS_DIR, MASKED_PROC, OOM_SCORE_ADJ, egress_env, etc_entries

READY_TIMEOUT_SECONDS = 120.0
# A spawn's answer, by default: the builder gives a sandbox's walls 10 s (and
# answers with an error past that), the fork is quick.
SPAWN_TIMEOUT_SECONDS = 30.0
# The zygote's own root, built from nothing in its private mount namespace: only
# what it and its forks read (/usr, the curated /etc, the runtime, the agent, a
# few devices) and the cgroup hierarchies its forks join. Then pivot_root and detach the host's tree, so the zygote holds
# no copy of any host mount: no other server's volume stays pinned by it.
_SCRIPT = r"""
set -eu
runtime=$1 agent=$2 fd=$3 preload=$4 etc=$5 devices=$6 egress=$7 root=$8
shift 8
mount -t tmpfs -o mode=0755,size=16m shoal-zygote "$root"
cd "$root"
mkdir -p usr etc dev proc tmp sys/fs/cgroup opt/shoal/runtime opt/shoal/agent
ro_bind() {
    mount --bind "$1" "$2"
    mount -o remount,bind,ro,nosuid,nodev "$2"
}
ro_bind /usr usr
ro_bind "$runtime" opt/shoal/runtime
ro_bind "$agent" opt/shoal/agent
for entry in $etc; do
    if [ -d "$entry" ]; then mkdir -p ".$entry"; else : > ".$entry"; fi
    ro_bind "$entry" ".$entry"
done
for name in $devices; do
    : > "dev/$name"
    mount --bind "/dev/$name" "dev/$name"
done
if [ "$egress" != - ]; then
    mkdir -p run/shoal-egress
    mount --bind "$egress" run/shoal-egress
fi
ln -s usr/lib lib
ln -s usr/lib64 lib64
ln -s usr/bin bin
ln -s usr/sbin sbin
mount -t proc -o nosuid,nodev,noexec proc proc
# The cgroup hierarchies: each fork joins its sandbox's groups before it unshares.
mount --rbind /sys/fs/cgroup sys/fs/cgroup
mount -t tmpfs -o mode=1777,size=16m,nosuid,nodev tmpfs tmp
mkdir .old-root
pivot_root . .old-root
cd /
umount -l /.old-root
rmdir /.old-root
# The sandbox environment from the start: it is what /proc/1/environ shows.
exec /usr/bin/env -i "$@" /opt/shoal/runtime/bin/python3 -I -c "import sys; \
sys.path.insert(0, '/opt/shoal/agent'); from shoal_agent.zygote import serve; \
serve(int(sys.argv[1]), sys.argv[2].split(','))" "$fd" "$preload"
"""
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# Where, in its new mount namespace, the zygote mounts its root before it moves
# in: the first of these that holds none of what it binds in (a run directory
# under /tmp would otherwise vanish under the new root, and the zygote with it).
_STAGING_POINTS = ("/tmp", "/mnt", "/media", "/srv")


def _staging_point(*sources: Path | None) -> str:
    shown = [os.path.realpath(source) for source in sources if source is not None]
    for point in _STAGING_POINTS:
        if os.path.isdir(point) and not any(
                path == point or path.startswith(point + "/") for path in shown):
            return point
    raise ZygoteFailed("no staging point for the zygote's root holds none of what it binds "
                       f"in ({', '.join(_STAGING_POINTS)})")


class ZygoteFailed(RuntimeError):
    """The zygote did not start or stopped answering."""


class Zygote:
    def __init__(self, runtime: Path, agent_root: Path, preload: list[str],
                 egress_dir: Path | None = None,
                 spawn_seconds: float = SPAWN_TIMEOUT_SECONDS) -> None:
        self._spawn_seconds = spawn_seconds
        self._egress_dir = egress_dir
        self._runtime = runtime
        self._agent_root = agent_root
        self._preload = preload
        self._socket: socket.socket | None = None
        self._popen: subprocess.Popen | None = None
        self._errors = None
        # Spawns under way, by request number: the zygote answers them as their
        # sandboxes come up, in whatever order.
        self._requests = itertools.count(1)
        self._answers: dict[int, asyncio.Future] = {}
        self._send_lock = asyncio.Lock()
        # It closed its socket: it died (an OOM kill picks a big process, and the
        # zygote holds every preloaded library). Its sandboxes live on; only new
        # ones need another zygote (SandboxPool._live_zygote). So does one
        # alive but wedged: a spawn met with silence, not even another's answer.
        self.stopped = False
        self._heard_at = time.monotonic()  # its last message of any kind

    @property
    def alive(self) -> bool:
        return (self._socket is not None and not self.stopped
                and self._popen is not None and self._popen.poll() is None)

    async def start(self) -> None:
        host_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Kept open: the zygote's forks report isolation failures here.
        self._errors = errors = tempfile.TemporaryFile()
        argv = ["/usr/bin/unshare", "--mount", "--propagation", "private", "--",
                "/bin/sh", "-c", _SCRIPT, "sh", str(self._runtime), str(self._agent_root),
                str(zygote_end.fileno()), ",".join(self._preload),
                " ".join(str(path) for path in etc_entries()), " ".join(DEVICES),
                str(self._egress_dir) if self._egress_dir is not None else "-",
                _staging_point(self._runtime, self._agent_root, self._egress_dir),
                *(f"{name}={value}" for name, value in SANDBOX_ENV.items())]
        self._popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, cwd="/",
            pass_fds=(zygote_end.fileno(),), start_new_session=True)
        zygote_end.close()
        self._socket = host_end
        try:
            ready = await asyncio.wait_for(asyncio.to_thread(self._receive), READY_TIMEOUT_SECONDS)
        except (asyncio.TimeoutError, ZygoteFailed):
            detail = self.diagnostics()
            self.close()
            raise ZygoteFailed("the zygote did not start: " + (detail or "no output"))
        if not ready.get("ready"):
            raise ZygoteFailed(f"the zygote answered {ready!r}")
        asyncio.get_running_loop().add_reader(self._socket, self._on_answer)

    def _on_answer(self) -> None:
        """The zygote answered a spawn (or went away: every spawn under way fails)."""
        assert self._socket is not None
        try:
            message = self._socket.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            message = b""
        self._heard_at = time.monotonic()
        if not message:
            self.stopped = True
            asyncio.get_running_loop().remove_reader(self._socket)
            for future in self._answers.values():
                if not future.done():
                    future.set_exception(ZygoteFailed("the zygote stopped answering"))
            self._answers.clear()
            return
        try:
            answer = json.loads(message)
            future = self._answers.pop(answer.get("request"), None)
        except (ValueError, AttributeError):
            return  # not an answer (cannot happen): the spawn waiting for one times out
        if future is not None and not future.done():
            future.set_result(answer)

    def _receive(self) -> dict:
        assert self._socket is not None
        message = self._socket.recv(65536)
        if not message:
            raise ZygoteFailed("the zygote closed its socket")
        return json.loads(message)

    def _request(self, spec: dict, channel_fd: int, home: Path) -> None:
        assert self._socket is not None
        tree = open_tree(home)
        try:
            socket.send_fds(self._socket, [json.dumps(spec).encode()], [channel_fd, tree])
        except (BrokenPipeError, ConnectionError) as exc:
            self.stopped = True
            raise ZygoteFailed(f"the zygote stopped answering ({exc.strerror})") from None
        finally:
            os.close(tree)

    async def spawn(self, spec: dict, channel_fd: int, home: Path) -> tuple[int, int]:
        """Fork a sandbox described by ``spec`` on the files under ``home``;
        returns the pids of its init and of its agent (both as the host sees
        them). Many spawns may be under way at once."""
        if self._socket is None:
            raise ZygoteFailed("the zygote is closed")
        if self.stopped:
            raise ZygoteFailed("the zygote stopped answering")
        request = next(self._requests)
        answer = self._answers[request] = asyncio.get_running_loop().create_future()
        asked_at = time.monotonic()
        try:
            async with self._send_lock:  # one message at a time on the socket
                await asyncio.to_thread(self._request, {**spec, "request": request},
                                        channel_fd, home)
            reply = await asyncio.wait_for(answer, self._spawn_seconds)
        except asyncio.TimeoutError:
            if self._heard_at < asked_at:
                # Nothing from it since: it is stopped (SIGSTOP), deadlocked, or
                # its builder hung (the zygote answers after the builder). Kept,
                # every launch waited this long and failed, for good; its own
                # forks (which die with it) are lost either way when it is.
                self.stopped = True
                raise ZygoteFailed(f"the zygote answered nothing in {self._spawn_seconds:g} s: "
                                   "it is replaced") from None
            raise ZygoteFailed("the zygote did not answer a spawn") from None
        finally:
            self._answers.pop(request, None)
        if "pid" not in reply or "agent" not in reply:
            if reply.get("stopping") is True:
                self.stopped = True  # it cannot start sandboxes any more, and exits
            raise ZygoteFailed(f"the zygote refused: {reply.get('error', reply)}")
        return int(reply["pid"]), int(reply["agent"])

    def diagnostics(self) -> str:
        """The last words the zygote or its forks wrote to stderr."""
        if self._errors is None:
            return ""
        self._errors.seek(0, 2)
        size = self._errors.tell()
        self._errors.seek(max(0, size - 2000))
        return self._errors.read().decode(errors="replace").strip()

    def close(self) -> None:
        for future in self._answers.values():
            if not future.done():
                future.set_exception(ZygoteFailed("the zygote was closed"))
        self._answers.clear()
        if self._errors is not None:
            self._errors.close()
            self._errors = None
        if self._socket is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._socket)
            except RuntimeError:
                pass  # no loop runs (the start failed before one read it)
            self._socket.close()
            self._socket = None
        if self._popen is not None:
            self._popen.kill()
            self._popen.wait()
            self._popen = None

    def exit_status(self) -> int | None:
        return self._popen.poll() if self._popen is not None else None


_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPEN_TREE = 428  # the same number on x86_64 and aarch64
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC, _AT_RECURSIVE = 1, 0o2000000, 0x8000
_AT_FDCWD = -100


def open_tree(path: Path) -> int:
    """A detached copy of the mount tree at ``path``, as an fd another mount
    namespace can attach (the zygote's forks cannot see mounts made after it)."""
    fd = _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, str(path).encode(),
                       _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | _AT_RECURSIVE)
    if fd < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"open_tree {path}: {os.strerror(error)}")
    return fd


def spawn_spec(home: SandboxHome, uid: int, cgroup_procs: list[str], tmp_size_bytes: int,
               open_files: int, nproc: int, egress: bool = False) -> dict:
    """The same manifest bwrap is given (see :mod:`.mounts`), for the zygote."""
    binds = [("/usr", "/usr", False)]
    binds += [(str(path), str(path), False) for path in etc_entries()]
    # "@home" is the sandbox's own files, handed over as a mount tree.
    binds += [(f"@home/etc/{name}", f"/etc/{name}", False) for name in ("passwd", "group", "hosts")]
    binds += [
        (RUNTIME, RUNTIME, False),
        (AGENT_ROOT, AGENT_ROOT, False),
        ("@home/workspace", WORKSPACE, True),
        ("@home/uploads", UPLOADS, False),
        ("@home/outputs", OUTPUTS, True),
        ("@home/external", EXTERNAL, False),
        ("@home/skills", SKILLS, False),
    ]
    env = dict(SANDBOX_ENV)
    if egress:
        binds.append((EGRESS_DIR, EGRESS_DIR, False))  # in the zygote's root (see _SCRIPT)
        env.update(egress_env())
    directories: list[str] = []
    return {
        "root": "/opt/shoal/root",
        "uid": uid,
        "binds": binds,
        "symlinks": [("/lib", "usr/lib"), ("/lib64", "usr/lib64"), ("/bin", "usr/bin"),
                     ("/sbin", "usr/sbin"), (OPENAI_DATA, OUTPUTS)],
        "directories": directories,
        "cgroup_procs": cgroup_procs,
        "tmp_size": tmp_size_bytes,
        "ptys": PTYS,
        "nofile": open_files,
        "nproc": nproc,
        "env": env,
        "cwd": WORKSPACE,
        "masked": list(MASKED_PROC),
        "oom_score_adj": OOM_SCORE_ADJ,
        "seccomp": seccomp.build_filter(inet=egress).hex(),
    }
