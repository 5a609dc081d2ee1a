"""The zygote: one process with the heavy libraries imported, forking sandboxes.

Importing numpy and pandas costs each sandbox ~300 ms and ~40 MiB of private
memory. The zygote pays that once; every sandbox is a fork of it, so the
imported modules' pages are shared copy-on-write between all of them (with
``gc.freeze()`` so the collector does not touch, and so copy, every object).

A sandbox must end up exactly as isolated as a bubblewrap sandbox, so each one
gets the same walls, built in this order before any untrusted code runs:

    init   forked by the builder into a new pid namespace, whose pid 1 it is:
           joins the sandbox's cgroups, unshares mount/net/ipc/uts/cgroup
           namespaces, builds private mounts on a fresh tmpfs root (the same
           manifest as bwrap's), pivot_root, hostname, rlimits, drops to the
           sandbox's uid with no groups, then makes a user namespace of its own
           (owned by that uid; the builder, root outside, maps the uid in it),
           drops every capability it has there, no_new_privs, the seccomp
           filter; then reaps orphans for as long as the agent lives
    agent  forked by the zygote into init's namespaces (pid, then cgroups, net,
           ipc, uts, mount and, last, the user namespace), it drops to exactly
           what init dropped to, then serves the channel it was handed

Only the agent is a fork of the zygote. The init is a fork of the builder, a
small process the zygote forks before it imports anything heavy: forking a
130 MiB interpreter costs ~4 ms of page-table copying and its exit ~5 ms more,
so one such fork per sandbox instead of three (an outer process, init and the
agent, as this was built before) halves what a sandbox costs to start and to
stop, and the init holds about a MiB instead of a copy of the zygote's page
tables.

The zygote itself runs as root in a private mount namespace that shows the
runtime at /opt/shoal/runtime, so the imported modules' paths are valid inside
every sandbox. It runs only our code; it never runs a line from a client.
Standard library only, like the rest of the agent.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import json
import os
import platform
import resource
import select
import signal
import socket
import struct
import sys
import time

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP = 0x20000000, 0x40000000, 0x02000000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 38, 22
PR_SET_CHILD_SUBREAPER, SECCOMP_MODE_FILTER, PR_CAPBSET_DROP, PR_SET_DUMPABLE = 36, 2, 24, 4
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}[platform.machine()]
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}[platform.machine()]
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
SYS_MOVE_MOUNT = 429  # the same number on x86_64 and aarch64
MOVE_MOUNT_F_EMPTY_PATH = 0x4
AT_FDCWD = -100
HOME_TOKEN = "@home"
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


_SIOCSIFFLAGS = 0x8914
_IFF_UP, _IFF_LOOPBACK, _IFF_RUNNING = 0x1, 0x8, 0x40

def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                       ctypes.c_ulong(flags), data and data.encode()), f"mount {target}")


def _prctl(option: int, value) -> None:
    _check(_libc.prctl(option, value, 0, 0, 0), f"prctl {option}")


# -- the sandbox's filesystem ----------------------------------------------------------------
def _bind(root: str, source: str, target: str, writable: bool) -> None:
    path = root + target
    if os.path.isdir(source):
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "a").close()
    _mount(source, path, None, MS_BIND | MS_REC)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (0 if writable else MS_RDONLY)
    _mount(None, path, None, flags)


def _tmpfs(path: str, size: int, mode: str = "1777", flags: int = MS_NOSUID | MS_NODEV) -> None:
    os.makedirs(path, exist_ok=True)
    _mount("tmpfs", path, "tmpfs", flags, f"size={size},mode={mode}")


def _build_root(spec: dict, home_tree_fd: int) -> None:
    """Mount the manifest on a fresh tmpfs and make it the root.

    The sandbox's own files arrive as a detached mount tree (``open_tree`` on
    the host): their volume was mounted after this namespace was copied, so no
    path would reach it. Attached at a staging point, its directories are bound
    into place like every other entry, and the staging point is dropped.
    """
    root = spec["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    os.makedirs(root, exist_ok=True)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1048576,mode=0755")
    staging = root + "/.home"
    os.makedirs(staging)
    _check(_libc.syscall(SYS_MOVE_MOUNT, home_tree_fd, b"", AT_FDCWD, staging.encode(),
                         MOVE_MOUNT_F_EMPTY_PATH), "move_mount")
    os.close(home_tree_fd)
    for source, target, writable in spec["binds"]:
        if source.startswith(HOME_TOKEN):
            source = staging + source[len(HOME_TOKEN):]
        _bind(root, source, target, writable)
    _check(_libc.umount2(staging.encode(), MNT_DETACH), "umount staging")
    os.rmdir(staging)
    for link, target in spec["symlinks"]:
        os.symlink(target, root + link)
    for directory in spec["directories"]:
        os.makedirs(root + directory, exist_ok=True)
    # /dev: a tmpfs with the harmless devices only, bound from the host.
    _tmpfs(root + "/dev", 65536, "0755", MS_NOSUID)
    for name in DEVICES:
        open(f"{root}/dev/{name}", "a").close()
        _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
        _mount(None, f"{root}/dev/{name}", None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    # A private devpts instance, as bubblewrap's --dev gives: ptys work, and
    # they are the sandbox's own, at most spec["ptys"] of them (shoal.sandbox.ptys).
    os.makedirs(root + "/dev/pts")
    _mount("devpts", root + "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
           f"newinstance,ptmxmode=0666,mode=620,max={int(spec['ptys'])}")
    os.symlink("pts/ptmx", root + "/dev/ptmx")
    _tmpfs(root + "/dev/shm", spec["tmp_size"])
    _tmpfs(root + "/tmp", spec["tmp_size"])
    os.makedirs(root + "/proc", exist_ok=True)
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in spec.get("masked", ()):  # host-wide block device statistics
        _mount("/dev/null", root + path, None, MS_BIND)
        _mount(None, root + path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.makedirs(root + "/.old-root")
    _check(_libc.syscall(SYS_PIVOT_ROOT, root.encode(), (root + "/.old-root").encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old-root", MNT_DETACH), "umount old root")
    os.rmdir("/.old-root")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _clear_capabilities() -> None:
    """Permitted, effective and inheritable sets emptied (capset(2))."""
    header = struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two __user_cap_data_struct {effective, permitted, inheritable}
    _check(_libc.syscall(SYS_CAPSET, header, data), "capset")


def _limit(spec: dict) -> None:
    """rlimits and no supplementary groups: set as root, before the user namespace."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (spec["nofile"], spec["nofile"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.setgroups([])


def _confine(spec: dict) -> None:
    """Inside the sandbox's user namespace (holding every capability of it): become
    its uid with no capability, no new privileges and the seccomp filter."""
    uid = spec["uid"]
    # A new user namespace starts with a full bounding set: empty it here, as
    # bubblewrap does (we still hold CAP_SETPCAP in the namespace).
    for capability in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            if ctypes.get_errno() == 22:
                break  # EINVAL: past the last capability this kernel knows
            _check(-1, "drop the bounding set")  # anything else: the walls are not up
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    # The uid was never root in this namespace (the init made it as that uid; the
    # agent joined it as host root, unmapped here), so setresuid kept the
    # namespace's capabilities: drop them all explicitly.
    _clear_capabilities()
    # Changing credentials made us non-dumpable, which hides /proc/self from the
    # code we run; inside one sandbox there is nothing to hide from itself.
    _prctl(PR_SET_DUMPABLE, 1)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    program = bytes.fromhex(spec["seccomp"])
    buffer = ctypes.create_string_buffer(program)
    fprog = struct.pack("HL", len(program) // 8, ctypes.addressof(buffer))
    fprog_buffer = ctypes.create_string_buffer(fprog)
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog_buffer, 0, 0), "seccomp")
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the credential change cleared it


def _drop_privileges(spec: dict, sync: socket.socket) -> None:
    """Limits, then a user namespace of the sandbox's own, then its uid and nothing more.

    The user namespace is made last, after every mount: it owns no other
    namespace (the mounts, pids and network were made by root outside it), so
    nothing inside can ever change them, and only the sandbox's uid exists in
    it. Host root is not mapped: a file of root's is nobody's in here.

    It is made by the sandbox's uid, not by root: the kernel charges what a user
    namespace's processes hold of the per-user limits (inotify instances and
    watches, message queue bytes, queued signals, user namespaces) to its
    owner's count as well. Made by root, every sandbox and host root shared one
    count, and one sandbox that took all of it stopped the others and the
    host's own inotify users; made by the sandbox's uid, each has its own, as
    under bubblewrap (which drops to the uid before it makes the namespace).
    """
    _limit(spec)
    uid = spec["uid"]
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # every capability outside is gone from here on
    _check(_libc.unshare(CLONE_NEWUSER), "unshare user namespace")
    sync.send(b"u")  # the builder (root, outside) writes our uid and gid maps
    if sync.recv(1) != b"m":
        raise OSError("the builder did not map the user namespace")
    _confine(spec)


def _close_fds_except(*keep: int) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


# -- the processes of a sandbox ---------------------------------------------------------------
# The namespaces the agent joins, in the order it joins them: its pid namespace
# is chosen at its fork; the cgroup namespace once it is in its cgroups; the
# mount namespace while it still has root's rights over it; the user namespace
# last, where it then drops every right it has.
NAMESPACES = ("pid", "cgroup", "net", "ipc", "uts", "mnt", "user")
_NS_FLAGS = {"pid": CLONE_NEWPID, "cgroup": CLONE_NEWCGROUP, "net": CLONE_NEWNET,
             "ipc": CLONE_NEWIPC, "uts": CLONE_NEWUTS, "mnt": CLONE_NEWNS, "user": CLONE_NEWUSER}


def _setns(fd: int, kind: str) -> None:
    _check(_libc.setns(fd, _NS_FLAGS[kind]), f"setns {kind}")


def _loopback_up() -> None:
    """Bring up the new network namespace's loopback, its only interface, as
    bubblewrap does: code may serve and call itself on 127.0.0.1, and the egress
    relay listens there. Nothing else is configured, so nothing leads out."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        flags = _IFF_UP | _IFF_LOOPBACK | _IFF_RUNNING
        fcntl.ioctl(probe, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags))


def _set_oom_score_adj(spec: dict) -> None:
    """The sandbox's standing with the OOM killer, written as root (holding
    CAP_SYS_RESOURCE, that makes it the least the code can set); every process
    the code starts inherits it."""
    with open("/proc/self/oom_score_adj", "w") as handle:
        handle.write(str(int(spec.get("oom_score_adj", 0))))


def _init(spec: dict, home_tree_fd: int, agent_alive_fd: int, sync: socket.socket) -> None:
    """pid 1 of the sandbox's pid namespace (the builder made it): the rest of the
    walls, made by itself as root outside them, then its uid and filter."""
    # pid 1 of a namespace ignores signals from inside it only where it has no
    # handler: drop the ones Python installed (SIGINT), so code cannot kill it.
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                   signal.SIGUSR2, signal.SIGPIPE, signal.SIGALRM):
        signal.signal(number, signal.SIG_DFL)
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.setsid()
        for procs in spec["cgroup_procs"]:
            with open(procs, "w") as handle:
                handle.write("0")  # the writer itself
        _set_oom_score_adj(spec)
        # Joined first, so that the new cgroup namespace's root is the sandbox's group.
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET
                             | CLONE_NEWCGROUP), "unshare")
        _loopback_up()
        _build_root(spec, home_tree_fd)
        _check(_libc.sethostname(b"sandbox", 7), "sethostname")
        _close_fds_except(agent_alive_fd, sync.fileno())
        _drop_privileges(spec, sync)
        # fd 2 was the zygote's diagnostics file on the host: nothing of the
        # host stays open in a sandbox.
        devnull = os.open("/dev/null", os.O_RDWR)
        for std in (0, 1, 2):
            os.dup2(devnull, std)
        os.close(devnull)
    except BaseException as exc:  # never let the agent join half-built walls
        os.write(2, f"zygote: isolation failed: {exc}\n".encode())
        os._exit(70)
    sync.send(b"r")  # walls up: the agent may join
    sync.close()
    _reap_while_open(agent_alive_fd)


def _reap_while_open(agent_alive_fd: int) -> None:
    """pid 1: reap every orphan; when the agent is gone (the write end of its
    pipe closed with it), so is the sandbox. The handler only wakes the poll:
    a SIGCHLD sent from inside costs one empty reaping round."""
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    poller = select.poll()
    poller.register(agent_alive_fd, select.POLLIN)
    poller.register(wake_read, select.POLLIN)
    while True:
        try:
            ready = dict(poller.poll())
        except InterruptedError:
            continue
        if ready.get(wake_read):
            _drain(wake_read)
        _reap()
        # The end of the pipe, not bytes in it: code in the agent can write those.
        if ready.get(agent_alive_fd) and not _drain(agent_alive_fd):
            os._exit(0)


def _enter(spec: dict, namespaces: list[int], channel_fd: int, agent_alive_fd: int) -> None:
    """In the agent, just forked into the sandbox's pid namespace: join the walls
    init built and drop to exactly what init dropped to (see NAMESPACES)."""
    fds = dict(zip(NAMESPACES, namespaces))
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setsid()
    for procs in spec["cgroup_procs"]:
        with open(procs, "w") as handle:
            handle.write("0")  # the writer itself, whatever namespace it counts pids in
    _set_oom_score_adj(spec)
    for kind in NAMESPACES[1:-1]:
        _setns(fds[kind], kind)
    _limit(spec)
    _setns(fds["user"], "user")
    _confine(spec)
    _close_fds_except(channel_fd, agent_alive_fd)
    devnull = os.open("/dev/null", os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(devnull, std)
    os.close(devnull)


def _reseed() -> None:
    """A fork starts with its zygote's random state: every sandbox would draw the
    same "random" numbers. Each gets fresh seeds from the kernel instead."""
    import random

    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()  # the legacy global RandomState pandas and np.random use


def _run_agent(spec: dict, channel_fd: int) -> None:
    # The agent is a Python like any other: SIGPIPE ignored, as CPython sets it at
    # start-up, so a write nobody reads raises BrokenPipeError instead of killing
    # the interpreter (and the session's state): a relay to a closed connection,
    # user code writing to a finished pipe. Said here, not inherited, so that no
    # change to the processes before it can undo it. Children it starts get the
    # default back from subprocess, as anywhere.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    _reseed()
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["cwd"])
    from shoal_agent.main import serve_channel

    serve_channel(channel_fd)


# -- the zygote's own loop ------------------------------------------------------------------------
def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _first_use(modules: dict) -> None:
    """Do once here what the preloaded libraries do on their first real use, so
    no sandbox pays it: a first matplotlib figure saved costs ~150 ms (the font
    manager, the font, Agg's pipeline), pandas builds lazily on first use too.
    Nothing of it is the sandbox's state: the figure is closed, the data dropped."""
    import io
    try:
        if "matplotlib.pyplot" in modules:
            pyplot = modules["matplotlib.pyplot"]
            figure, axes = pyplot.subplots()
            axes.plot([0, 1, 2], [0, 1, 4], label="warm")
            axes.set_title("warm")
            axes.set_xlabel("x")
            axes.legend()
            figure.savefig(io.BytesIO(), format="png")
            pyplot.close(figure)
        if "pandas" in modules:
            frame = modules["pandas"].DataFrame({"a": [1, 2, 3], "b": ["x", "y", "z"]})
            frame.describe()
            frame.groupby("b").sum()
            repr(frame)
            if "matplotlib.pyplot" in modules:  # pandas' own plotting backend
                axes = frame.plot(y="a")
                axes.figure.savefig(io.BytesIO(), format="png")
                modules["matplotlib.pyplot"].close(axes.figure)
    except Exception as exc:  # a faster first use is not worth failing a sandbox for
        print(f"zygote: warming the preloaded libraries failed: {exc!r}", file=sys.stderr)


_MADV_COLLAPSE = 25  # Linux 6.1
_HUGE = 2 << 20


def _collapse_anonymous_memory() -> None:
    """Back the zygote's heap and anonymous memory with huge pages where the
    kernel can (MADV_COLLAPSE), so that each sandbox's fork copies one page-table
    entry per 2 MiB instead of 512: about 80 MiB of imported modules' objects made
    the fork that starts every agent cost ~5 ms of page-table copying (and its
    exit as much again), in this one process, one sandbox after another. A child
    still copies only the 4 KiB pages it writes (the kernel splits the mapping on
    the first write), so the pages stay shared as before; the zygote itself holds
    a few MiB more (the holes of each collapsed range). Best effort: a kernel
    without it, or a range it refuses, leaves things as they were."""
    try:
        with open("/proc/self/maps") as handle:
            regions = handle.read().splitlines()
    except OSError:
        return
    for line in regions:
        fields = line.split()
        if not fields[1].startswith("rw") or (len(fields) > 5 and fields[5] != "[heap]"):
            continue  # only the heap and anonymous mappings
        low, high = (int(x, 16) for x in fields[0].split("-"))
        start, end = (low + _HUGE - 1) & ~(_HUGE - 1), high & ~(_HUGE - 1)
        if end > start:
            _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_COLLAPSE)


# How long the builder waits for a sandbox's walls (init, its mounts and user
# namespace) before it gives the attempt up.
_WALLS_SECONDS = 10.0


def _wakeup_on_children() -> int:
    """SIGCHLD wakes the caller's select/poll (on the fd returned) to reap."""
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    return wake_read


def _drain(fd: int) -> bool:
    """Read what waits on ``fd``; False once its other end is closed and it is empty."""
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return True


def _forget_wakeups() -> None:
    """In a fork: the parent's SIGCHLD handling is not the child's business."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)


class _Walls:
    """One sandbox's walls in the making: its init, and what the builder waits
    for it to say next ("u": map my user namespace; "r": the walls are up)."""

    def __init__(self, request: object, uid: int, init: int, sync: socket.socket) -> None:
        self.request = request
        self.uid = uid
        self.init = init
        self.sync = sync
        self.expecting = b"u"
        self.deadline = time.monotonic() + _WALLS_SECONDS

    def advance(self) -> list[int] | None:
        """Act on what the init said; its namespaces (as fds) once its walls are up,
        None while they are being built. Raises if the init stopped or strayed."""
        said = self.sync.recv(1)
        if said != self.expecting:
            raise OSError("the init stopped before its user namespace" if self.expecting == b"u"
                          else "the init stopped before its walls were up")
        if said == b"u":
            # The init's user namespace maps the sandbox's uid (and gid) to itself, only.
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{self.init}/{name}", "w") as handle:
                    handle.write(f"{self.uid} {self.uid} 1\n")
            self.sync.send(b"m")
            self.expecting = b"r"
            return None
        # Opened while it is our child and not yet reaped, so its pid names it
        # and no other process: the agent joins these.
        namespaces: list[int] = []
        try:
            for kind in NAMESPACES:
                namespaces.append(os.open(f"/proc/{self.init}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC))
        except BaseException:
            for fd in namespaces:
                os.close(fd)
            raise
        return namespaces

    def abandon(self) -> None:
        try:
            os.kill(self.init, signal.SIGKILL)  # not reaped yet: the pid is still its own
        except ProcessLookupError:
            pass
        self.sync.close()


def _build_walls(requests: socket.socket) -> None:
    """The builder: for each request (a spec, the files' mount tree, the read end
    of the agent's liveness pipe), make the sandbox's init and answer with its
    pid and namespaces as fds, or with why it failed. Many sandboxes' walls are
    built at once: each init does its own work, and the builder only forks it
    and maps its user namespace when it asks."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    wake = _wakeup_on_children()
    own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    building: dict[socket.socket, _Walls] = {}

    def answer(walls_request: object, body: dict, fds: list[int] = ()) -> None:
        socket.send_fds(requests, [json.dumps({"request": walls_request, **body}).encode()],
                        list(fds))

    def failed(walls: _Walls, reason: str) -> None:
        walls.abandon()
        del building[walls.sync]
        os.write(2, f"zygote: building a sandbox's walls failed: {reason}\n".encode())
        answer(walls.request, {"error": "the sandbox's walls could not be built"})

    while True:
        now = time.monotonic()
        wait = min((w.deadline for w in building.values()), default=now + 60) - now
        readable, _, _ = select.select([requests, wake, *building], [], [], max(0.0, wait))
        if wake in readable:
            _drain(wake)
        _reap()
        for walls in [w for w in building.values() if w.sync in readable]:
            try:
                namespaces = walls.advance()
            except Exception as exc:  # that sandbox failed; the others go on
                failed(walls, repr(exc))
                continue
            if namespaces is not None:
                del building[walls.sync]
                walls.sync.close()
                try:
                    answer(walls.request, {"pid": walls.init}, namespaces)
                finally:
                    for fd in namespaces:
                        os.close(fd)
        for walls in [w for w in building.values() if time.monotonic() > w.deadline]:
            failed(walls, "timed out")
        if requests not in readable:
            continue
        message, fds, _, _ = socket.recv_fds(requests, 1 << 20, 2)
        if not message:
            os._exit(0)
        spec: dict = {}
        try:
            spec = json.loads(message)
            if len(fds) != 2:
                raise ValueError("a walls request carries two fds")
            walls = _start_walls(spec, fds, own_pid_ns, (requests, wake, *building))
            building[walls.sync] = walls
        except Exception as exc:  # that sandbox failed; the builder serves the next
            os.write(2, f"zygote: building a sandbox's walls failed: {exc!r}\n".encode())
            answer(spec.get("request"), {"error": "the sandbox's walls could not be built"})
        finally:
            for fd in fds:
                os.close(fd)


def _start_walls(spec: dict, fds: list[int], own_pid_ns: int, closing: tuple) -> _Walls:
    """Fork the sandbox's init into a new pid namespace; it builds its walls."""
    sync, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        init = _fork_in_pid_namespace(
            lambda: _check(_libc.unshare(CLONE_NEWPID), "unshare pid namespace"), own_pid_ns)
    except BaseException:
        sync.close()
        theirs.close()
        raise
    if init == 0:
        try:
            _forget_wakeups()
            sync.close()
            for owned in closing:
                owned.close() if isinstance(owned, socket.socket) else os.close(owned)
            _init(spec, fds[0], fds[1], theirs)
        finally:
            os._exit(70)
    theirs.close()
    return _Walls(spec.get("request"), spec["uid"], init, sync)


def _start_builder(control: socket.socket) -> socket.socket:
    """Fork the builder now, while this process is still small."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if os.fork() == 0:
        try:
            control.close()
            ours.close()
            _build_walls(theirs)
        except BaseException as exc:
            os.write(2, f"zygote: the builder failed: {exc!r}\n".encode())
        finally:
            os._exit(73)
    theirs.close()
    return ours


def _fork_in_pid_namespace(enter, own_pid_ns: int) -> int:
    """fork(2), the child in the pid namespace ``enter()`` chose for our children
    (setns or unshare of CLONE_NEWPID: they move only the children to come),
    then back to our own for the forks after it. Failing to come back is fatal:
    a later sandbox must never be forked into an earlier one's namespace."""
    enter()
    try:
        child = os.fork()
    except BaseException:
        child = -1
    if child != 0 and _libc.setns(own_pid_ns, CLONE_NEWPID) != 0:
        os.write(2, b"zygote: could not return to its own pid namespace; stopping\n")
        os._exit(72)
    if child < 0:
        raise OSError("fork failed")
    return child


def _fork_agent(spec: dict, channel_fd: int, alive_write: int, namespaces: list[int],
                own_pid_ns: int, closing: tuple) -> int:
    """Fork the sandbox's agent into the namespaces its init made; its pid."""
    agent = _fork_in_pid_namespace(lambda: _setns(namespaces[0], "pid"), own_pid_ns)
    if agent == 0:
        try:
            _forget_wakeups()
            for owned in closing:
                owned.close()
            _enter(spec, namespaces, channel_fd, alive_write)
        except BaseException as exc:  # never run the agent half-isolated
            os.write(2, f"zygote: isolation failed: {exc!r}\n".encode())
            os._exit(70)
        try:
            _run_agent(spec, channel_fd)
        finally:
            os._exit(0)
    return agent


def serve(control_fd: int, preload: list[str]) -> None:
    """Answer spawn requests on a SOCK_SEQPACKET socket: one message with two fds,
    the sandbox's channel and the detached mount tree of its files; the message
    names the request, and so does its answer. A spawn is two steps, the walls
    (the builder's) and the agent (ours): the zygote takes new requests while
    walls are being built, so many sandboxes start at once."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the server's death is ours too
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    control = socket.socket(fileno=control_fd)
    builder = _start_builder(control)
    own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    failed = []
    for name in preload:
        try:
            __import__(name)
        except Exception:
            failed.append(name)
    _first_use(sys.modules)
    import shoal_agent.main  # noqa: F401  (so every sandbox shares its pages too)

    # A fork is reaped the moment it exits: the host waits for that when it
    # closes a sandbox, so nothing of a closed sandbox outlives the close.
    wake = _wakeup_on_children()
    gc.collect()
    gc.freeze()
    _collapse_anonymous_memory()
    control.send(json.dumps({"ready": True, "failed": failed}).encode())
    # request -> (its spec, the agent's channel, the agent's end of its liveness pipe)
    starting: dict[object, tuple[dict, int, int]] = {}

    def answer(request: object, body: dict) -> None:
        control.send(json.dumps({"request": request, **body}).encode())

    while True:
        readable, _, _ = select.select([control, wake, builder], [], [], 1.0)
        if wake in readable:
            _drain(wake)
        _reap()
        if builder in readable:
            message, namespaces, _, _ = socket.recv_fds(builder, 65536, len(NAMESPACES))
            if not message:
                # The builder is gone (its sandboxes' inits with it): no sandbox
                # can start any more. The zygote goes too, so that the host
                # starts another; staying, it refused every launch for good.
                for request in starting:
                    answer(request, {"error": "the zygote's builder is gone", "stopping": True})
                os.write(2, b"zygote: its builder is gone; stopping\n")
                return
            reply = json.loads(message)
            entry = starting.pop(reply.get("request"), None)
            try:
                if entry is None:
                    pass  # not ours (cannot happen): its fds are closed below
                elif "pid" not in reply or len(namespaces) != len(NAMESPACES):
                    answer(reply.get("request"), {"error": reply.get(
                        "error", "the builder answered without namespaces")})
                else:
                    spec, channel_fd, alive_write = entry
                    try:
                        agent = _fork_agent(spec, channel_fd, alive_write, namespaces,
                                            own_pid_ns, (control, builder))
                        answer(reply["request"], {"pid": reply["pid"], "agent": agent})
                    except Exception as exc:  # one failed sandbox; the others live on
                        answer(reply["request"], {"error": f"starting a sandbox failed: {exc!r}"})
            finally:
                if entry is not None:
                    os.close(entry[1])
                    os.close(entry[2])
                for fd in namespaces:
                    os.close(fd)
        if control not in readable:
            continue
        message, fds, _, _ = socket.recv_fds(control, 1 << 20, 2)
        if not message:
            return
        spec = {}
        try:
            spec = json.loads(message)
            if len(fds) != 2:
                raise ValueError("a spawn request carries two fds")
            alive_read, alive_write = os.pipe2(os.O_CLOEXEC)
            try:
                socket.send_fds(builder, [message], [fds[1], alive_read])
            except BaseException:
                os.close(alive_write)
                raise
            finally:
                os.close(alive_read)
            starting[spec.get("request")] = (spec, os.dup(fds[0]), alive_write)
        except Exception as exc:  # one failed sandbox; the zygote and the others live on
            answer(spec.get("request"), {"error": f"starting a sandbox failed: {exc!r}"})
        finally:
            for fd in fds:
                os.close(fd)


if __name__ == "__main__":
    serve(int(sys.argv[1]), [name for name in sys.argv[2].split(",") if name])
