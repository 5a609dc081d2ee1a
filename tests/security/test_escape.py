"""Escape attempts from inside a real sandbox: each test fails if its attack works.

The code runs as hostile code would: in the session's interpreter or in a child
process of its own, against a real sandbox (bubblewrap namespaces, the seccomp
filter, cgroups, its own uid, a loop-mounted volume), and reports what the kernel
answered. Where the host can check too (a binary unchanged, a process alive, a
value not rewritten), it does.

Attacks tried, with what stops each (``isolation`` = tests/sandbox/test_isolation.py,
already covered there; everything else is here):

| attack | what stops it |
| --- | --- |
| AF_INET / AF_INET6 stream, dgram, raw; AF_PACKET; AF_NETLINK (isolation) | seccomp: EAFNOSUPPORT |
| every other family 0..45: AF_VSOCK, AF_BLUETOOTH, AF_ALG, AF_XDP, AF_CAN, AF_TIPC, AF_RDS, AF_KEY, AF_SMC, AF_QIPCRTR, AF_MCTP... in every socket type | seccomp: EAFNOSUPPORT |
| socketpair of a non-unix family; a family smuggled in the upper 32 bits of a raw ``socket`` | seccomp (the kernel reads the low word, so does the filter) |
| DNS: ``getaddrinfo`` of public names, ``getent hosts`` | no resolv.conf, no network namespace route, no sockets |
| bash ``/dev/tcp``, a host loopback listener, curl/wget/perl (isolation) | network namespace + seccomp |
| a host abstract unix socket (isolation); host unix sockets by path | network namespace (abstract), mount namespace (paths absent) |
| reading /etc/shadow, /root, the checkout, /run, /sys (isolation) | mount namespace: not there |
| /proc/kcore, /dev/core, /dev/mem, /dev/kmem, /dev/port, /dev/kmsg, /proc/kmsg | minimal /dev, non-root uid |
| writes to /proc/sys (kernel.core_pattern, modprobe, sysrq, hostname, vm, net, user), /proc/sysrq-trigger | read-only /proc/sys, non-root uid |
| /proc/1/environ of bwrap's init, host environment (isolation) | empty environment at launch |
| writing /usr, /etc, uploads, skills, the runtime (isolation) | read-only binds |
| rewriting the agent's code (open for writing, truncate, rename, unlink, chmod, utime, xattr, __pycache__) | read-only bind of a root-owned copy |
| poisoning the runtime (sitecustomize, .pth, numpy's ``__init__``), /etc/ld.so.preload, /etc/hosts | read-only binds |
| overwriting the host's bwrap or python through /proc/1/exe, /proc/self/exe | read-only binds, root-owned binaries |
| ptrace, process_vm_readv (isolation), process_vm_writev, pidfd_getfd, kcmp | seccomp: EPERM |
| mount, umount, chroot, fsopen, open_tree (isolation); pivot_root, move_mount, fsconfig, fsmount, fspick, mount_setattr | seccomp: EPERM |
| unshare of user/net/mnt (isolation) and ipc/uts/pid/cgroup/time namespaces | seccomp: EPERM |
| raw ``clone`` with each namespace flag; ``clone3`` | seccomp: EPERM / ENOSYS |
| ``setns`` into every namespace of pid 1 and of itself, by path and by pidfd | seccomp: EPERM |
| keyctl, add_key, bpf, io_uring_setup, perf_event_open, userfaultfd (isolation); request_key, io_uring_enter/register | seccomp: EPERM |
| kexec_load, kexec_file_load, init/finit/delete_module, reboot, swapon/off, acct, quotactl(_fd), open_by_handle_at, name_to_handle_at, iopl, ioperm, syslog, vhangup, settimeofday, clock_settime, adjtimex, clock_adjtime, lookup_dcookie | seccomp: EPERM (even where the kernel would allow an unprivileged caller) |
| personality(ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC, ...), setarch -R | seccomp: EPERM |
| TIOCSTI / TIOCLINUX keystroke injection on a pty, also with the request in the upper bits | seccomp: EPERM |
| raising RLIMIT_CORE (core_pattern pipes run as root), NOFILE, NPROC | hard rlimits set before the uid drop |
| oom_score_adj -1000 (unkillable by the OOM killer) | no CAP_SYS_RESOURCE |
| file capabilities (security.capability xattr), trusted.* xattrs, chown to root, uid_map | no capabilities, id 0 unmapped |
| kill(-1) in a sandbox (isolation; here over HTTP: the server and a bystander session live on); signals and pidfd_open to host pids (the server, the test runner, the outer bwrap) | pid namespace: ESRCH |
| SIGKILL/SIGSTOP/SIGTERM to pid 1 inside | pid-namespace init ignores signals from inside |
| a setuid copy made in the workspace and /tmp; the host's setuid-root su, passwd, mount... | nosuid on every mount, no_new_privs |
| hard links to /etc/passwd (same ext4 as the workspace!), /usr, the agent, /tmp, outputs; via /proc/self/fd and AT_EMPTY_PATH | EXDEV: hard links never cross a mount |
| mknod of mem, kmem, sda, vda (char and block) in the workspace, /tmp, /dev/shm, /dev | no CAP_MKNOD |
| device nodes beyond null, zero, full, random, urandom, tty | bwrap --dev |
| SysV shared memory / message queues shared with another sandbox | IPC namespace |
| /proc/1/mem of the sandbox's init opened for writing | not stopped, and gains nothing: pid 1 has the agent's uid, filter and no capability, and holds nothing of the host (test_pid_1_confers_nothing_the_agent_lacks) |
| a host file held open by a process in the sandbox | none: bwrap's stderr is a pipe the host holds, the zygote's init drops its fds (pid 1 held one: fixed) |
| FIFOs, a listening socket and a fed FIFO named like files, read and written through the API | O_NONBLOCK open, fstat: 400 at once |
"""

from __future__ import annotations

import errno
import hashlib
import os
import platform
import secrets
import socket
from base64 import urlsafe_b64encode
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.egress_mode import EGRESS, INET_FAMILIES, UNREACHABLE

from tests.security.helpers import execute, http_probe, new_session, probe, probe_child, run_ok

X86_64 = pytest.mark.skipif(platform.machine() != "x86_64",
                            reason=f"syscall numbers are x86_64's (this is {platform.machine()})")
REFUSED = {errno.EROFS, errno.EACCES, errno.EPERM}
ABSENT_OR_REFUSED = REFUSED | {errno.ENOENT}


def _refusals(res: dict, allowed: set[int]) -> list[str]:
    return [f"{name}: {outcome!r}" for name, outcome in res.items() if outcome not in allowed]


# ---------------------------------------------------------------------------
# the network
# ---------------------------------------------------------------------------


async def test_every_socket_family_but_unix_is_refused(sandbox):
    res = await probe(sandbox, """
        import socket
        kinds = {"stream": socket.SOCK_STREAM, "dgram": socket.SOCK_DGRAM,
                 "raw": socket.SOCK_RAW, "seqpacket": socket.SOCK_SEQPACKET}
        for family in range(0, 46):
            if family == socket.AF_UNIX:
                continue
            for kind_name, kind in kinds.items():
                try:
                    socket.socket(family, kind, 0).close()
                    res[f"{family}/{kind_name}"] = 0
                except OSError as exc:
                    res[f"{family}/{kind_name}"] = exc.errno
        for family in (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK, socket.AF_PACKET,
                       socket.AF_VSOCK, socket.AF_TIPC):
            try:
                socket.socketpair(family, socket.SOCK_STREAM)
                res[f"socketpair {family}"] = 0
            except OSError as exc:
                res[f"socketpair {family}"] = exc.errno
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        unix.close()
    """)
    named = {socket.AF_INET, socket.AF_INET6, socket.AF_PACKET, socket.AF_NETLINK,
             40, 31, 38, 44, 29, 30, 21, 15, 43, 42, 45}  # VSOCK BLUETOOTH ALG XDP CAN TIPC ...
    assert {int(key.split("/")[0]) for key in res if "/" in key} >= named
    if EGRESS:  # inet stream and datagram sockets exist (for the relay); nothing else new
        inet = {key: res.pop(key) for key in list(res)
                if key.split("/")[0] in {str(f) for f in INET_FAMILIES}}
        assert all(inet[f"{f}/{kind}"] == 0 for f in INET_FAMILIES for kind in ("stream", "dgram")), inet
        assert all(inet[f"{f}/{kind}"] != 0 for f in INET_FAMILIES for kind in ("raw", "seqpacket")), inet
        for family in INET_FAMILIES:  # socketpair has no inet kind at all
            assert res.pop(f"socketpair {family}") != 0
    wrong = _refusals(res, {errno.EAFNOSUPPORT})
    assert not wrong, wrong


@X86_64
async def test_socket_family_in_the_upper_bits_is_refused(sandbox):
    # The kernel takes the family as an int (the low 32 bits): the filter must too.
    res = await probe_child(sandbox, """
        res["inet_high_bits"] = sc(41, (1 << 32) | 2, 1, 0)
        res["inet6_high_bits"] = sc(41, (0xffff << 32) | 10, 2, 0)
        res["packet_high_bits"] = sc(41, (1 << 40) | 17, 3, 0)
        pair = (ctypes.c_int * 2)()
        res["socketpair_inet_high_bits"] = sc(53, (1 << 32) | 2, 1, 0, pair)
        res["control_unix"] = sc(41, 1, 1, 0)
    """)
    assert res.pop("control_unix")[0] == "ok", "control: AF_UNIX must work"
    if EGRESS:  # the kernel reads AF_INET there, which egress allows: so must the filter
        assert res.pop("inet_high_bits")[0] == "ok" and res.pop("inet6_high_bits")[0] == "ok"
        assert res.pop("socketpair_inet_high_bits") == errno.EAFNOSUPPORT  # AF_UNIX pairs only
    wrong = _refusals(res, {errno.EAFNOSUPPORT})
    assert not wrong, wrong


async def test_dns_resolution_of_public_names_fails(sandbox):
    res = await probe(sandbox, """
        import os, socket, subprocess
        for name in ("example.com", "pypi.org", "github.com"):
            try:
                res[name] = socket.getaddrinfo(name, 443)
            except socket.gaierror as exc:
                res[name] = "gaierror"
        try:
            res["gethostbyname"] = socket.gethostbyname("example.org")
        except OSError:
            res["gethostbyname"] = "gaierror"
        done = subprocess.run(["getent", "hosts", "example.com"], capture_output=True, text=True)
        res["getent"] = done.returncode
        res["resolv_conf"] = os.path.exists("/etc/resolv.conf")
        # A numeric address needs no resolver; connecting to it still needs a socket.
        try:
            socket.create_connection(("93.184.215.14", 80), timeout=2)
            res["connect_numeric"] = 0
        except OSError as exc:
            res["connect_numeric"] = exc.errno
        res["control_localhost"] = bool(socket.getaddrinfo("localhost", 80))
    """)
    assert res.pop("control_localhost") is True, "control: /etc/hosts must resolve"
    for name in ("example.com", "pypi.org", "github.com", "gethostbyname"):
        assert res[name] == "gaierror", f"{name} resolved: {res[name]}"
    assert res["getent"] != 0
    assert res["resolv_conf"] is False
    assert res["connect_numeric"] in (UNREACHABLE if EGRESS else {errno.EAFNOSUPPORT})


async def test_host_unix_sockets_are_unreachable(sandbox, tmp_path):
    # One listener of our own (so the test can fail), plus every path socket the host has.
    os.chmod(tmp_path, 0o755)
    own = tmp_path / "host.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(own))
    os.chmod(own, 0o777)
    listener.listen(8)
    listener.setblocking(False)
    paths = {str(own)}
    with open("/proc/net/unix") as handle:
        for line in list(handle)[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[7].startswith("/") and os.path.exists(fields[7]):
                paths.add(fields[7])
    for well_known in ("/run/dbus/system_bus_socket", "/var/run/docker.sock", "/run/systemd/private",
                       "/dev/log", "/run/postgresql/.s.PGSQL.5432"):
        paths.add(well_known)
    try:
        res = await probe(sandbox, f"""
            import socket
            for path in {sorted(paths)!r}:
                for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                    s = socket.socket(socket.AF_UNIX, kind)
                    try:
                        s.connect(path)
                        res[f"{{path}} {{kind}}"] = 0
                    except OSError as exc:
                        res[f"{{path}} {{kind}}"] = exc.errno
                    finally:
                        s.close()
        """)
        wrong = [f"{k}: {v}" for k, v in res.items() if v == 0]
        assert not wrong, wrong
        with pytest.raises(BlockingIOError):
            listener.accept()
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # control: reachable from the host
        client.connect(str(own))
        client.close()
    finally:
        listener.close()


async def test_the_sandbox_has_namespaces_of_its_own(sandbox, pool):
    res = await probe(sandbox, """
        import os
        for kind in ("mnt", "net", "pid", "ipc", "uts", "user", "cgroup"):
            res[kind] = os.readlink(f"/proc/self/ns/{kind}")
    """)
    if pool.settings.launcher == "zygote":
        # By design the zygote's sandboxes keep the host's user namespace, where
        # root cannot be reached (test_isolation checks that invariant).
        res.pop("user")
    for kind, inside in res.items():
        assert inside != os.readlink(f"/proc/self/ns/{kind}"), f"shares the host's {kind} namespace"


# ---------------------------------------------------------------------------
# kernel interfaces in /proc and /dev
# ---------------------------------------------------------------------------


async def test_kernel_memory_and_log_devices_are_unreadable(sandbox):
    res = await probe(sandbox, """
        import os
        for path in ("/proc/kcore", "/dev/core", "/dev/mem", "/dev/kmem", "/dev/port", "/dev/kmsg",
                     "/proc/kmsg", "/proc/vmcore", "/dev/vda", "/dev/sda", "/dev/loop-control",
                     "/sys/kernel/debug", "/sys/firmware/efi/efivars", "/sys/fs/cgroup",
                     "/proc/sys/kernel/random/../../../../sys/kernel/debug"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                try:
                    res[path] = "READ %d bytes" % len(os.read(fd, 64))
                except OSError as exc:
                    res[path] = "OPENED, read errno %d" % exc.errno
                finally:
                    os.close(fd)
            except OSError as exc:
                res[path] = exc.errno
    """)
    wrong = _refusals(res, ABSENT_OR_REFUSED)
    assert not wrong, wrong


SYSCTLS = {
    "kernel/core_pattern": b"|/tmp/shoal-pwn %p",
    "kernel/modprobe": b"/tmp/shoal-pwn",
    "kernel/sysrq": b"1",
    "kernel/hostname": b"pwned",
    "kernel/domainname": b"pwned",
    "kernel/panic": b"1",
    "kernel/randomize_va_space": b"0",
    "kernel/kptr_restrict": b"0",
    "kernel/dmesg_restrict": b"0",
    "kernel/unprivileged_bpf_disabled": b"0",
    "kernel/ns_last_pid": b"31337",
    "vm/drop_caches": b"3",
    "vm/overcommit_memory": b"1",
    "fs/protected_symlinks": b"0",
    "fs/protected_hardlinks": b"0",
    "net/ipv4/ip_forward": b"1",
    "net/core/bpf_jit_enable": b"1",
    "user/max_user_namespaces": b"100",
}


async def test_proc_sys_and_sysrq_refuse_writes(sandbox):
    host_before = {}
    for name in set(SYSCTLS) - {"kernel/ns_last_pid", "vm/drop_caches"}:  # these move on their own
        try:
            host_before[name] = Path("/proc/sys", name).read_bytes()
        except OSError:
            pass
    res = await probe(sandbox, f"""
        import os
        targets = {dict((f"/proc/sys/{k}", v) for k, v in SYSCTLS.items())!r}
        targets["/proc/sysrq-trigger"] = b"h"
        targets["/proc/sys/kernel/../../sysrq-trigger"] = b"h"
        for path, value in targets.items():
            try:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, value)
                    res[path] = "WRITTEN"
                except OSError as exc:
                    res[path] = exc.errno
                finally:
                    os.close(fd)
            except OSError as exc:
                res[path] = exc.errno
    """)
    wrong = _refusals(res, ABSENT_OR_REFUSED)
    assert not wrong, wrong
    for name, value in host_before.items():
        assert Path("/proc/sys", name).read_bytes() == value, f"host {name} changed"


async def test_own_proc_self_mem_is_writable_and_stays_in_the_process(sandbox):
    # Control for the test below: writing one's own memory is allowed (and harmless).
    res = await probe_child(sandbox, """
        buf = ctypes.create_string_buffer(b"before--")
        fd = os.open("/proc/self/mem", os.O_RDWR)
        os.pwrite(fd, b"after---", ctypes.addressof(buf))
        os.close(fd)
        res["value"] = buf.value.decode()
    """)
    assert res["value"] == "after---"


async def test_pid_1_confers_nothing_the_agent_lacks(sandbox):
    """The init of the sandbox's pid namespace runs as the sandbox's uid and is
    dumpable, so code can write its memory (/proc/1/mem) as it can the agent's.
    That must gain nothing: pid 1 has no capability, the same seccomp filter and
    no_new_privs, and (test below) no descriptor to anything outside."""
    res = await probe(sandbox, """
        mine = dict(line.split(":", 1) for line in open("/proc/self/status"))
        init = dict(line.split(":", 1) for line in open("/proc/1/status"))
        res["fields"] = {key: [mine[key].split(), init[key].split()]
                         for key in ("Uid", "Gid", "CapEff", "CapPrm", "CapBnd", "CapAmb",
                                     "NoNewPrivs", "Seccomp")}
    """)
    for key, (agent, init) in res["fields"].items():
        if key in ("Uid", "Gid", "NoNewPrivs", "Seccomp"):
            assert init == agent, (key, agent, init)
        else:
            assert int(init[0], 16) == 0, (key, init)
    assert res["fields"]["Seccomp"][1] == ["2"] and res["fields"]["NoNewPrivs"][1] == ["1"]


async def test_no_sandbox_process_holds_a_host_file(sandbox):
    res = await probe(sandbox, _HOST_FDS_PROBE)
    assert res["checked"] > 3, "control: descriptors were inspected"
    assert res["host_files"] == [], res["host_files"]


async def test_the_agent_holds_no_host_file(sandbox):
    res = await probe(sandbox, _HOST_FDS_PROBE.replace("PIDS = None", "PIDS = [os.getpid()]"))
    assert res["checked"] >= 3, "control: descriptors were inspected"
    assert res["host_files"] == [], res["host_files"]


_HOST_FDS_PROBE = """
    import os, stat
    PIDS = None
    pids = PIDS or [int(p) for p in os.listdir("/proc") if p.isdigit()]
    own_devices = set()
    for mount in ("/tmp", "/dev/shm", "/home/agent/workspace", "/mnt/user-data/outputs"):
        own_devices.add(os.stat(mount).st_dev)
    res["host_files"], res["checked"] = [], 0
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            link = f"/proc/{pid}/fd/{fd}"
            try:
                target = os.readlink(link)
                held = os.stat(link)
            except OSError:
                continue
            res["checked"] += 1
            if not target.startswith("/") or target.startswith("/memfd:"):
                continue  # pipes, sockets, anonymous inodes
            try:
                seen = os.stat(target.removesuffix(" (deleted)"))
                if (seen.st_dev, seen.st_ino) == (held.st_dev, held.st_ino):
                    continue  # the very file the sandbox sees at that path
            except OSError:
                pass
            if held.st_dev in own_devices:
                continue  # a deleted file of the sandbox's own
            res["host_files"].append(f"pid {pid} fd {fd} -> {target} (uid {held.st_uid}, "
                                     f"mode {stat.filemode(held.st_mode)})")
"""


async def test_dev_holds_only_the_safe_nodes(sandbox):
    res = await probe(sandbox, """
        import os, stat
        res["char"], res["block"] = [], []
        for root, dirs, files in os.walk("/dev"):
            for name in dirs + files:
                path = os.path.join(root, name)
                mode = os.lstat(path).st_mode
                if stat.S_ISCHR(mode):
                    res["char"].append(path)
                elif stat.S_ISBLK(mode):
                    res["block"].append(path)
        res["absent"] = {}
        for path in ("/dev/sda", "/dev/vda", "/dev/nvme0n1", "/dev/loop0", "/dev/loop-control",
                     "/dev/kvm", "/dev/fuse", "/dev/net/tun", "/dev/mem", "/dev/kmem", "/dev/port",
                     "/dev/kmsg", "/dev/console", "/dev/tty0", "/dev/mapper/control",
                     "/dev/cpu/0/msr", "/dev/vsock", "/dev/vhost-vsock", "/dev/dri", "/dev/hidraw0",
                     "/dev/input", "/dev/snd", "/dev/uinput", "/dev/userfaultfd", "/dev/btrfs-control"):
            res["absent"][path] = os.path.lexists(path)
    """)
    assert sorted(res["char"]) == ["/dev/full", "/dev/null", "/dev/pts/ptmx", "/dev/random",
                                   "/dev/tty", "/dev/urandom", "/dev/zero"], res["char"]
    assert res["block"] == []
    present = [path for path, exists in res["absent"].items() if exists]
    assert not present, present


async def test_device_nodes_cannot_be_created(sandbox):
    res = await probe_child(sandbox, """
        import stat
        nodes = {"mem": (stat.S_IFCHR, 1, 1), "kmem": (stat.S_IFCHR, 1, 2),
                 "sda": (stat.S_IFBLK, 8, 0), "vda": (stat.S_IFBLK, 254, 0),
                 "fuse": (stat.S_IFCHR, 10, 229), "kvm": (stat.S_IFCHR, 10, 232)}
        for directory in ("/home/agent/workspace", "/tmp", "/dev/shm", "/dev",
                          "/mnt/user-data/outputs"):
            for name, (kind, major, minor) in nodes.items():
                path = f"{directory}/shoal-{name}"
                try:
                    os.mknod(path, kind | 0o666, os.makedev(major, minor))
                    res[path] = "CREATED"
                except OSError as exc:
                    res[path] = exc.errno
        os.mkfifo("/tmp/shoal-fifo")  # control: a FIFO is a file, not a device
        res["control_fifo"] = stat.S_ISFIFO(os.stat("/tmp/shoal-fifo").st_mode)
    """)
    assert res.pop("control_fifo") is True
    wrong = _refusals(res, REFUSED)
    assert not wrong, wrong


# ---------------------------------------------------------------------------
# writing what must stay read-only
# ---------------------------------------------------------------------------


def _host_source_of(pool, sandbox_path: str) -> Path:
    """The host directory bound at ``sandbox_path``, from the pool's launch settings
    (the same for either launcher)."""
    return {"/opt/shoal/agent": pool._config.agent_root,
            "/opt/shoal/runtime": pool._config.runtime}[sandbox_path]


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


async def test_the_agent_code_cannot_be_modified(sandbox, pool):
    host_agent = _host_source_of(pool, "/opt/shoal/agent")
    before = _tree_digest(host_agent)
    assert "shoal_agent/main.py" in before
    res = await probe(sandbox, """
        import os
        root = "/opt/shoal/agent/shoal_agent"
        main = f"{root}/main.py"
        def attempt(name, fn):
            try:
                fn()
                res[name] = "DONE"
            except OSError as exc:
                res[name] = exc.errno
        attempt("open_rw", lambda: os.close(os.open(main, os.O_RDWR)))
        attempt("open_append", lambda: os.close(os.open(main, os.O_WRONLY | os.O_APPEND)))
        attempt("open_trunc", lambda: os.close(os.open(f"{root}/protocol.py", os.O_WRONLY | os.O_TRUNC)))
        attempt("truncate", lambda: os.truncate(f"{root}/capture.py", 0))
        attempt("create", lambda: os.close(os.open(f"{root}/evil.py", os.O_WRONLY | os.O_CREAT, 0o644)))
        attempt("rename", lambda: os.rename(main, f"{root}/main_old.py"))
        attempt("unlink", lambda: os.unlink(main))
        attempt("chmod", lambda: os.chmod(main, 0o777))
        attempt("utime", lambda: os.utime(main, (0, 0)))
        attempt("setxattr", lambda: os.setxattr(main, "user.shoal", b"x"))
        attempt("pycache", lambda: os.mkdir(f"{root}/__pycache__"))
        attempt("replace_dir", lambda: os.rename(root, "/opt/shoal/agent/old"))
        attempt("symlink", lambda: os.symlink("/tmp/evil.py", f"{root}/evil_link.py"))
    """)
    wrong = _refusals(res, REFUSED)
    assert not wrong, wrong
    assert _tree_digest(host_agent) == before, "the agent's code changed on the host"
    for path in host_agent.rglob("*"):
        info = path.stat()
        assert info.st_uid == 0 and not info.st_mode & 0o022, f"{path} is writable by others"
    # In-process tampering lives and dies with the sandbox's processes: a restart and
    # any other sandbox run the original agent.
    tampered = await sandbox.run_python(
        "import shoal_agent.main as m\nm.Agent._dispatch = lambda self, msg: "
        "{'return_code': 0, 'stdout': 'PWNED', 'files': []}\nprint('patched')")
    assert tampered.stdout == "patched\n"
    assert (await sandbox.run_python("print(6 * 7)")).stdout == "PWNED"  # it worked, in here
    other = await pool.lease()
    try:
        assert (await other.run_python("print(6 * 7)")).stdout == "42\n"
    finally:
        await other.close()
    await sandbox.restart()
    assert (await sandbox.run_python("print(6 * 7)")).stdout == "42\n"


async def test_the_runtime_and_etc_cannot_be_poisoned(sandbox, pool):
    host_runtime = _host_source_of(pool, "/opt/shoal/runtime")
    res = await probe(sandbox, """
        import os, site, numpy
        packages = [p for p in site.getsitepackages() if p.startswith("/opt/shoal/runtime")]
        assert packages, site.getsitepackages()
        res["site"] = packages[0]
        def attempt(name, path, flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC):
            try:
                fd = os.open(path, flags, 0o644)
                os.write(fd, b"import os; os.system('touch /tmp/pwned')\\n")
                os.close(fd)
                res[name] = "WRITTEN"
            except OSError as exc:
                res[name] = exc.errno
        attempt("sitecustomize", f"{packages[0]}/sitecustomize.py")
        attempt("usercustomize", f"{packages[0]}/usercustomize.py")
        attempt("pth", f"{packages[0]}/zzz-shoal-evil.pth")
        attempt("numpy_init", numpy.__file__, os.O_WRONLY | os.O_APPEND)
        attempt("pyvenv_cfg", "/opt/shoal/runtime/pyvenv.cfg", os.O_WRONLY | os.O_APPEND)
        attempt("ld_so_preload", "/etc/ld.so.preload")
        attempt("etc_hosts", "/etc/hosts", os.O_WRONLY | os.O_APPEND)
        attempt("etc_nsswitch", "/etc/nsswitch.conf", os.O_WRONLY | os.O_APPEND)
        attempt("etc_resolv", "/etc/resolv.conf")
        attempt("etc_profile_d", "/etc/profile.d/evil.sh")
        attempt("usr_sitecustomize", "/usr/lib/python3/dist-packages/sitecustomize.py")
        attempt("proc_self_exe", "/proc/self/exe", os.O_WRONLY)
        attempt("proc_1_exe", "/proc/1/exe", os.O_WRONLY)  # the host's /usr/bin/bwrap
    """)
    site_dir = res.pop("site")
    wrong = _refusals(res, ABSENT_OR_REFUSED | {errno.ETXTBSY})
    assert not wrong, wrong
    relative = Path(site_dir).relative_to("/opt/shoal/runtime")
    for name in ("sitecustomize.py", "usercustomize.py", "zzz-shoal-evil.pth"):
        assert not (host_runtime / relative / name).exists(), name
    assert not Path("/etc/ld.so.preload").exists() or b"pwned" not in Path("/etc/ld.so.preload").read_bytes()
    other = await pool.lease()
    try:
        check = await other.run_bash("python3 -c 'print(1)'; ls /tmp/pwned 2>&1; "
                                     f"ls {site_dir}/zzz-shoal-evil.pth 2>&1; true")
        assert check.stdout.startswith("1\n") and "No such file" in check.stdout, check.stdout
    finally:
        await other.close()


# ---------------------------------------------------------------------------
# system calls the seccomp filter refuses
# ---------------------------------------------------------------------------


@X86_64
async def test_personality_changes_are_refused(sandbox):
    res = await probe_child(sandbox, """
        flags = {"ADDR_NO_RANDOMIZE": 0x0040000, "READ_IMPLIES_EXEC": 0x0400000,
                 "ADDR_COMPAT_LAYOUT": 0x0200000, "MMAP_PAGE_ZERO": 0x0100000,
                 "UNAME26": 0x0020000, "PER_LINUX32": 0x0008, "ADDR_LIMIT_3GB": 0x8000000,
                 "SHORT_INODE": 0x1000000, "PER_SVR4": 0x0001 | 0x0100000 | 0x0400000,
                 "PER_BSD": 0x0006}
        for name, value in flags.items():
            res[name] = sc(135, value)
        res["control_query"] = sc(135, 0xFFFFFFFF)
        import shutil, subprocess
        if shutil.which("setarch"):
            done = subprocess.run(["setarch", os.uname().machine, "-R", "true"],
                                  capture_output=True)
            res["setarch_R"] = done.returncode
    """)
    assert res.pop("control_query")[0] == "ok"
    setarch = res.pop("setarch_R", 1)
    assert setarch != 0, "setarch -R turned ASLR off"
    wrong = _refusals(res, {errno.EPERM})
    assert not wrong, wrong




@X86_64
async def test_raw_clone_with_any_namespace_flag_is_refused(sandbox):
    res = await probe_child(sandbox, """
        SIGCHLD = 17
        flags = {"NEWNS": 0x00020000, "NEWCGROUP": 0x02000000, "NEWUTS": 0x04000000,
                 "NEWIPC": 0x08000000, "NEWPID": 0x20000000, "NEWNET": 0x40000000,
                 "NEWTIME": 0x00000080, "NEWUSER|NEWNS": 0x10020000,
                 "all": 0x6E020000}
        def raw_clone(value):
            def attempt():
                rc = libc.syscall(L(56), L(value | SIGCHLD), L(0), L(0), L(0), L(0))
                if rc == 0:
                    os._exit(0)  # a child in new namespaces: the attack worked
                if rc > 0:
                    os.waitpid(rc, 0)
                    return 0
                return ctypes.get_errno()
            return attempt
        for name, value in flags.items():
            res[name] = in_child(raw_clone(value))
        args = ctypes.create_string_buffer(88)  # struct clone_args
        res["clone3"] = sc(435, args, 88)
        res["control_fork"] = in_child(raw_clone(0))
    """)
    assert res.pop("control_fork") == 0, "control: a plain fork through clone works"
    assert res.pop("clone3") == errno.ENOSYS
    wrong = _refusals(res, {errno.EPERM})
    assert not wrong, wrong


@X86_64
async def test_unshare_of_the_other_namespaces_is_refused(sandbox):
    res = await probe_child(sandbox, """
        for name, flag in {"ipc": 0x08000000, "uts": 0x04000000, "pid": 0x20000000,
                           "cgroup": 0x02000000, "time": 0x00000080,
                           "sysvsem": 0x00040000, "fs_and_mnt": 0x00000200 | 0x00020000}.items():
            res[name] = in_child(lambda flag=flag: sc(272, flag))
    """)
    wrong = _refusals(res, {errno.EPERM})
    assert not wrong, wrong


@X86_64
async def test_setns_into_any_namespace_is_refused(sandbox):
    res = await probe_child(sandbox, """
        kinds = ("cgroup", "ipc", "mnt", "net", "pid", "pid_for_children", "time",
                 "time_for_children", "user", "uts")
        for owner in ("1", "self"):
            for kind in kinds:
                try:
                    fd = os.open(f"/proc/{owner}/ns/{kind}", os.O_RDONLY)
                except OSError as exc:
                    res[f"{owner}/{kind} open"] = exc.errno
                    continue
                res[f"{owner}/{kind}"] = in_child(lambda fd=fd: sc(308, fd, 0))
                os.close(fd)
        pidfd = sc(434, 1, 0)
        if isinstance(pidfd, list):
            res["pidfd_of_pid_1"] = in_child(lambda: sc(308, pidfd[1], 0x40000000 | 0x00020000))
    """)
    opened = {k: v for k, v in res.items() if not k.endswith(" open")}
    assert len(opened) >= 10, res
    wrong = _refusals(opened, {errno.EPERM})
    assert not wrong, wrong


@X86_64
async def test_kernel_administration_syscalls_are_refused(sandbox):
    # Arguments are harmless even if a call got through, and several (name_to_handle_at,
    # kcmp, adjtimex read, Q_SYNC, settimeofday(NULL), pidfd_getfd and process_vm_writev
    # on ourselves, lookup_dcookie) would succeed for an unprivileged caller without
    # the filter: an EPERM there is the filter's, not the kernel's.
    res = await probe_child(sandbox, """
        import struct
        open("/tmp/sweep-target", "w").write("x")
        buf = ctypes.create_string_buffer(4096)
        other = ctypes.create_string_buffer(4096)
        handle = ctypes.create_string_buffer(struct.pack("=Ii", 128, 0) + bytes(128))
        mount_id = ctypes.c_int(0)
        class iovec(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
        local = iovec(ctypes.cast(buf, ctypes.c_void_p), 8)
        remote = iovec(ctypes.cast(other, ctypes.c_void_p), 8)
        me = os.getpid()
        pidfd = sc(434, me, 0)
        pidfd = pidfd[1] if isinstance(pidfd, list) else -1
        calls = {
            "request_key": (249, b"user", b"shoal-sec", None, 0),
            "io_uring_enter": (426, -1, 0, 0, 0, None, 0),
            "io_uring_register": (427, -1, 0, None, 0),
            "kexec_load": (246, 0, 0, None, 0),
            "kexec_file_load": (320, -1, -1, 0, None, 0),
            "init_module": (175, buf, 0, b""),
            "finit_module": (313, -1, b"", 0),
            "delete_module": (176, b"shoal_sec_nonexistent", 0),
            "reboot_bad_magic": (169, 0, 0, 0, None),
            "swapon": (167, b"/tmp/sweep-target", 0),
            "swapoff": (168, b"/tmp/sweep-target"),
            "acct": (163, None),
            "quotactl_q_sync": (179, 0x800001, None, 0, None),
            "quotactl_fd": (443, -1, 0, 0, None),
            "name_to_handle_at": (303, -100, b"/tmp/sweep-target", handle, ctypes.byref(mount_id), 0),
            "open_by_handle_at": (304, -100, handle, 0),
            "iopl": (172, 3),
            "ioperm": (173, 0x80, 1, 1),
            "syslog_size_buffer": (103, 10, None, 0),
            "vhangup": (153,),
            "settimeofday_null": (164, None, None),
            "clock_settime": (227, 0, None),
            "adjtimex_read": (159, buf),
            "clock_adjtime_read": (305, 0, buf),
            "lookup_dcookie": (212, 0, buf, 16),
            "kcmp_self": (312, me, me, 0, 0, 0),
            "pidfd_getfd_self": (438, pidfd, 0, 0),
            "process_vm_writev_self": (311, me, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0),
            "pivot_root": (155, b"/tmp", b"/tmp"),
            "move_mount": (429, -1, b"", -1, b"", 0),
            "fsconfig": (431, -1, 0, None, None, 0),
            "fsmount": (432, -1, 0, 0),
            "fspick": (433, -100, b"/tmp", 0),
            "mount_setattr": (442, -100, b"/tmp", 0, None, 0),
        }
        for name, (nr, *args) in calls.items():
            res[name] = sc(nr, *args)
    """)
    assert len(res) == 34
    wrong = _refusals(res, {errno.EPERM})
    assert not wrong, wrong


@X86_64
async def test_terminal_injection_ioctls_are_refused(sandbox):
    res = await probe_child(sandbox, """
        import fcntl, pty, termios
        master, slave = pty.openpty()
        for name, request in (("TIOCSTI", termios.TIOCSTI), ("TIOCLINUX", 0x541C),
                              ("TIOCSTI_high_bits", (1 << 32) | termios.TIOCSTI)):
            res[name] = sc(16, slave, request, ctypes.c_char_p(b"\\x0c"))
        winsize = ctypes.create_string_buffer(8)
        res["control_winsize"] = sc(16, slave, termios.TIOCGWINSZ, winsize)
    """)
    assert res.pop("control_winsize")[0] == "ok", "control: ordinary tty ioctls work"
    wrong = _refusals(res, {errno.EPERM})
    assert not wrong, wrong


async def test_hard_limits_cannot_be_raised(sandbox):
    res = await probe_child(sandbox, """
        import resource
        res["core"] = resource.getrlimit(resource.RLIMIT_CORE)
        for name in ("RLIMIT_CORE", "RLIMIT_NOFILE", "RLIMIT_NPROC"):
            limit = getattr(resource, name)
            soft, hard = resource.getrlimit(limit)
            try:
                resource.setrlimit(limit, (hard + 1 if hard != resource.RLIM_INFINITY else hard,
                                           resource.RLIM_INFINITY))
                res[name] = "RAISED"
            except (ValueError, OSError) as exc:
                res[name] = "refused"
            res[name + "_after"] = resource.getrlimit(limit)[1] == hard
    """)
    assert res.pop("core") == [0, 0], "core dumps (and core_pattern pipes) are possible"
    for name, value in res.items():
        assert value in ("refused", True), f"{name}: {value}"


async def test_oom_score_cannot_be_lowered(sandbox):
    res = await probe_child(sandbox, """
        for path, value in (("/proc/self/oom_score_adj", b"-1000"), ("/proc/self/oom_adj", b"-17"),
                            ("/proc/1/oom_score_adj", b"-1000")):
            try:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, value)
                    res[path] = "WRITTEN"
                except OSError as exc:
                    res[path] = exc.errno
                finally:
                    os.close(fd)
            except OSError as exc:
                res[path] = exc.errno
        res["now"] = int(open("/proc/self/oom_score_adj").read())
    """)
    assert res.pop("now") >= 0
    wrong = _refusals(res, REFUSED)
    assert not wrong, wrong


async def test_capabilities_ownership_and_id_maps_cannot_be_forged(sandbox):
    res = await probe_child(sandbox, """
        import struct
        open("capfile", "w").write("x")
        # VFS_CAP_REVISION_2 granting every capability, effective.
        blob = struct.pack("<IIIII", 0x02000001, 0xFFFFFFFF, 0, 0xFFFFFFFF, 0)
        for name, attr, value in (("security.capability", "security.capability", blob),
                                  ("trusted", "trusted.shoal", b"x")):
            try:
                os.setxattr("capfile", attr, value)
                res[name] = "SET"
            except OSError as exc:
                res[name] = exc.errno
        for name, fn in (("chown_root", lambda: os.chown("capfile", 0, 0)),
                         ("chown_nobody", lambda: os.chown("capfile", 65534, 65534)),
                         ("chgrp_root", lambda: os.chown("capfile", -1, 0))):
            try:
                fn()
                res[name] = "CHANGED"
            except OSError as exc:
                res[name] = exc.errno
        for path, value in (("/proc/self/uid_map", b"0 0 1"), ("/proc/self/gid_map", b"0 0 1"),
                            ("/proc/self/setgroups", b"allow")):
            try:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, value)
                    res[path] = "WRITTEN"
                except OSError as exc:
                    res[path] = exc.errno
                finally:
                    os.close(fd)
            except OSError as exc:
                res[path] = exc.errno
        os.unlink("capfile")
    """)
    wrong = _refusals(res, REFUSED | {errno.EINVAL, errno.EOPNOTSUPP})
    assert not wrong, wrong


# ---------------------------------------------------------------------------
# signals and processes
# ---------------------------------------------------------------------------


async def test_signals_cannot_reach_host_processes(sandbox):
    process = sandbox._process
    outer_bwrap = process.popen.pid if process.popen is not None else process.outer_pid
    targets = sorted({os.getpid(), os.getppid(), outer_bwrap,
                      *[int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) > 1000][:20]})
    res = await probe_child(sandbox, f"""
        import signal
        inside = {{int(p) for p in os.listdir("/proc") if p.isdigit()}}
        for pid in {targets!r}:
            if pid in inside:
                continue  # the same number names a process of the sandbox
            res[f"kill {{pid}} 0"] = sc(62, pid, 0)
            res[f"kill {{pid}} SIGWINCH"] = sc(62, pid, signal.SIGWINCH)
            res[f"pidfd_open {{pid}}"] = sc(434, pid, 0)
            res[f"proc {{pid}}"] = errno.ENOENT if not os.path.exists(f"/proc/{{pid}}") else "VISIBLE"
            res[f"tgkill {{pid}}"] = sc(234, pid, pid, 0)
    """)
    assert len(res) >= 5 * 3, res
    wrong = _refusals(res, {errno.ESRCH, errno.ENOENT})
    assert not wrong, wrong
    os.kill(outer_bwrap, 0)  # the sandbox's own outer bwrap is still there


def test_the_servers_pid_is_out_of_reach(security_server):
    server_pid = security_server.process.pid
    with httpx.Client(base_url=security_server.url, timeout=60) as http:
        attacker, bystander = new_session(http), new_session(http)
        try:
            run_ok(http, bystander, "kept = 'bystander'")
            res = http_probe(http, attacker, f"""
                import ctypes, os, signal
                libc = ctypes.CDLL(None, use_errno=True)
                inside = {{int(p) for p in os.listdir("/proc") if p.isdigit()}}
                res["inside"] = {server_pid} in inside
                for name, sig in (("probe", 0), ("SIGCONT", signal.SIGCONT), ("SIGWINCH", signal.SIGWINCH)):
                    try:
                        os.kill({server_pid}, sig)
                        res[name] = 0
                    except OSError as exc:
                        res[name] = exc.errno
                libc.syscall.restype = ctypes.c_long
                rc = libc.syscall(ctypes.c_long(434), ctypes.c_long({server_pid}), ctypes.c_long(0))
                res["pidfd_open"] = ctypes.get_errno() if rc == -1 else 0
            """)
            # The sandbox's pid namespace numbers its few processes from 1: the server's
            # (host) pid can only be among them if the namespace is not private.
            assert res.pop("inside") is False, f"pid {server_pid} is visible in the sandbox"
            assert res == {"probe": errno.ESRCH, "SIGCONT": errno.ESRCH, "SIGWINCH": errno.ESRCH,
                           "pidfd_open": errno.ESRCH}, res
            # kill -9 -1: everything the attacker may signal, which is its own sandbox only.
            killed = execute(http, attacker, "kill -KILL -1; sleep 1", tool="bash", timeout=10)
            assert killed.status == 200 and killed.body["interpreter_restarted"], killed.text
            assert security_server.process.poll() is None, "the server died"
            after = execute(http, bystander, "print(kept)")
            assert after.status == 200 and after.content["stdout"] == "bystander\n", after.text
            assert not after.body["interpreter_restarted"]
            assert run_ok(http, attacker, "print('back')")["stdout"] == "back\n"
        finally:
            http.delete(f"/sessions/{attacker}")
            http.delete(f"/sessions/{bystander}")


def _status_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as handle:
        return dict(line.rstrip("\n").split(":\t", 1) for line in handle if ":\t" in line)


def _launcher_of_sandbox(uid: int, server_pid: int) -> str:
    """Which launcher started the sandbox running as ``uid``, seen from the host, by
    the parent of the sandbox's init (pid 1 of its namespace): bwrap's init is the
    child of an outer bwrap, itself the server's child; a zygote's init is the
    child of a process of the server's that runs ``shoal_agent.zygote`` (its builder)."""
    mine = {int(p) for p in os.listdir("/proc") if p.isdigit()
            and _uid_of(int(p)) == uid}
    init = [pid for pid in mine if _status_of(pid)["NSpid"].split()[-1] == "1"]
    assert len(init) == 1, f"uid {uid} runs {len(init)} sandboxes: {sorted(mine)}"
    parent = int(_status_of(init[0])["PPid"])
    with open(f"/proc/{parent}/cmdline", "rb") as handle:
        parent_command = handle.read()
    parent_status = _status_of(parent)
    if parent_status["Name"] == "bwrap" and int(parent_status["PPid"]) == server_pid:
        return "bwrap"
    if b"shoal_agent.zygote" in parent_command:
        return "zygote"
    return f"unknown (init's parent {parent_status['Name']}, {parent_command!r})"


def _uid_of(pid: int) -> int | None:
    try:
        return int(_status_of(pid)["Uid"].split()[0])
    except (OSError, KeyError, ValueError):
        return None


def test_the_http_server_runs_on_the_launcher_of_this_run(security_server):
    """The server fixtures honour SHOAL_LAUNCHER (tests/serving.py), so that a pass of
    the Makefile that names a launcher runs its HTTP tests on it too; without one, the
    server's own choice is one of the two."""
    with httpx.Client(base_url=security_server.url, timeout=60) as http:
        session = new_session(http)
        try:
            uid = int(run_ok(http, session, "id -u", tool="bash")["stdout"])
            seen = _launcher_of_sandbox(uid, security_server.process.pid)
        finally:
            http.delete(f"/sessions/{session}")
    named = os.environ.get("SHOAL_LAUNCHER")
    expected = {named} if named else {"bwrap", "zygote"}
    assert seen in expected, f"SHOAL_LAUNCHER={os.environ.get('SHOAL_LAUNCHER')!r}: {seen}"


async def test_pid_1_ignores_signals_from_inside(sandbox):
    before = await sandbox.run_python("import os\nagent_pid = os.getpid()\nprint(agent_pid)")
    result = await sandbox.run_bash(
        "for s in KILL TERM INT HUP STOP USR1; do kill -$s 1; done; sleep 0.3; "
        "kill -0 1 && echo pid1-alive; grep State /proc/1/status")
    assert "pid1-alive" in result.stdout, result.stdout + result.stderr
    assert "(stopped)" not in result.stdout, result.stdout
    assert not result.restarted
    after = await sandbox.run_python("print(os.getpid() == agent_pid)")
    assert after.stdout == "True\n", after.stderr
    assert not after.restarted
    assert before.stdout.strip().isdigit()


# ---------------------------------------------------------------------------
# setuid, links and special files
# ---------------------------------------------------------------------------


async def test_setuid_gives_no_privilege(sandbox):
    res = await probe_child(sandbox, """
        import shutil, stat, subprocess, time
        uid = os.getuid()
        res["uid"] = uid
        res["own_copies"] = {}
        for directory in ("/home/agent/workspace", "/tmp", "/dev/shm", "/mnt/user-data/outputs"):
            copy = f"{directory}/shoal-suid-id"
            shutil.copy("/usr/bin/id", copy)
            os.chmod(copy, 0o4755 | stat.S_ISGID)
            assert os.stat(copy).st_mode & stat.S_ISUID  # control: the bit is set
            done = subprocess.run([copy, "-u"], capture_output=True, text=True)
            res["own_copies"][directory] = done.stdout.strip()
            os.unlink(copy)
        res["setuid_root_binaries"] = {}
        for binary in ("/usr/bin/su", "/usr/bin/passwd", "/usr/bin/newgrp", "/usr/bin/chfn",
                       "/usr/bin/gpasswd", "/usr/bin/mount", "/usr/bin/umount", "/usr/bin/chsh"):
            info = os.stat(binary) if os.path.exists(binary) else None
            if info is None or not info.st_mode & stat.S_ISUID:
                continue  # (root shows as nobody here: id 0 is not mapped)
            # Most of them fail fast here; a busy machine may let one exit before
            # it is seen, so each gets a few tries (su and newgrp wait for a password).
            seen = set()
            for _ in range(5):
                process = subprocess.Popen([binary], stdin=subprocess.PIPE,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                deadline = time.monotonic() + 0.5
                while time.monotonic() < deadline and process.poll() is None:
                    try:
                        status = open(f"/proc/{process.pid}/status").read()
                        seen.add(next(l for l in status.splitlines() if l.startswith("Uid:")))
                    except (OSError, StopIteration):
                        pass
                process.kill()
                process.wait()
                if seen:
                    break
            res["setuid_root_binaries"][binary] = sorted(seen)
        res["mounts_without_nosuid"] = [line.split()[4] for line in open("/proc/self/mountinfo")
                                        if "nosuid" not in line.split()[5].split(",")]
        res["no_new_privs"] = next(line for line in open("/proc/self/status")
                                   if line.startswith("NoNewPrivs")).split()[1]
    """)
    uid = str(res["uid"])
    assert uid != "0"
    for directory, shown in res["own_copies"].items():
        assert shown == uid, f"setuid copy in {directory} ran as {shown}"
    observed = {b: lines for b, lines in res["setuid_root_binaries"].items() if lines}
    # Control: the check saw setuid-root binaries running (at least the two that
    # block on a password prompt, whatever the machine's load).
    waiting = {"/usr/bin/su", "/usr/bin/newgrp"} & set(res["setuid_root_binaries"])
    assert waiting <= set(observed) and len(observed) >= 2, \
        f"control: too few setuid-root binaries observed: {res}"
    for binary, lines in observed.items():
        for line in lines:
            assert line.split()[1:] == [uid] * 4, f"{binary} ran with {line}"
    assert res["mounts_without_nosuid"] == []
    assert res["no_new_privs"] == "1"


@X86_64
async def test_hard_links_never_reach_outside_the_mount(sandbox):
    res = await probe_child(sandbox, """
        open("/tmp/shoal-tmp-file", "w").write("tmp")
        open("/dev/shm/shoal-shm-file", "w").write("shm")
        open("/mnt/user-data/outputs/shoal-out-file", "w").write("out")
        open("own", "w").write("own")
        sources = {"etc_passwd_same_ext4": "/etc/passwd", "etc_hosts": "/etc/hosts",
                   "usr_python": "/usr/bin/python3", "runtime_python": "/opt/shoal/runtime/bin/python3",
                   "agent": "/opt/shoal/agent/shoal_agent/main.py", "tmp": "/tmp/shoal-tmp-file",
                   "dev_shm": "/dev/shm/shoal-shm-file", "outputs": "/mnt/user-data/outputs/shoal-out-file"}
        for name, source in sources.items():
            try:
                os.link(source, f"hl-{name}")
                res[name] = "LINKED"
            except OSError as exc:
                res[name] = exc.errno
        try:
            os.link("own", "/tmp/hl-from-workspace")
            res["workspace_to_tmp"] = "LINKED"
        except OSError as exc:
            res["workspace_to_tmp"] = exc.errno
        fd = os.open("/etc/passwd", os.O_RDONLY)
        res["via_proc_fd"] = sc(265, -100, f"/proc/self/fd/{fd}".encode(), -100, b"hl-procfd", 0x400)
        res["at_empty_path"] = sc(265, fd, b"", -100, b"hl-empty", 0x1000)
        os.symlink("/etc/passwd", "sl-passwd")
        res["follow_symlink"] = sc(265, -100, b"sl-passwd", -100, b"hl-follow", 0x400)
        os.link("own", "own-link")  # control: within the workspace, links work
        res["control"] = open("own-link").read()
        res["created"] = sorted(n for n in os.listdir(".") if n.startswith("hl-"))
    """)
    assert res.pop("control") == "own"
    assert res.pop("created") == []
    wrong = _refusals(res, {errno.EXDEV, errno.EPERM, errno.ENOENT})
    assert not wrong, wrong


async def test_sysv_ipc_is_private_to_each_sandbox(sandbox, pool):
    key = int.from_bytes(secrets.token_bytes(3), "big") + 1
    made = await probe(sandbox, f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        res["shm"] = libc.shmget({key}, 4096, 0o1000 | 0o666)
        res["msg"] = libc.msgget({key}, 0o1000 | 0o666)
        res["sem"] = libc.semget({key}, 1, 0o1000 | 0o666)
        res["control"] = libc.shmget({key}, 0, 0) == res["shm"]
    """)
    assert made["shm"] >= 0 and made["msg"] >= 0 and made["sem"] >= 0 and made["control"], made
    other = await pool.lease()
    try:
        seen = await probe(other, f"""
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            for name, fn in (("shm", lambda: libc.shmget({key}, 0, 0)),
                             ("msg", lambda: libc.msgget({key}, 0)),
                             ("sem", lambda: libc.semget({key}, 0, 0))):
                rc = fn()
                res[name] = ctypes.get_errno() if rc == -1 else "FOUND"
        """)
        assert seen == {"shm": errno.ENOENT, "msg": errno.ENOENT, "sem": errno.ENOENT}, seen
    finally:
        await other.close()
    # ... and none of it is on the host either.
    with open("/proc/sysvipc/shm") as handle:
        assert not any(line.split()[0] == str(key) for line in list(handle)[1:])


# ---------------------------------------------------------------------------
# special files read and written through the API
# ---------------------------------------------------------------------------

SPECIAL_FILES = ("mkfifo report.csv; mkfifo /mnt/user-data/outputs/data.json; "
                 "mkfifo fed.txt; (while :; do echo x; done > fed.txt) >/dev/null 2>&1 & "
                 "python3 -c 'import socket, time; s = socket.socket(socket.AF_UNIX); "
                 "s.bind(\"listening.txt\"); s.listen(); time.sleep(120)' >/dev/null 2>&1 & "
                 "for i in $(seq 600); do test -S listening.txt && break; sleep 0.05; done; "
                 "echo real > real.txt; ls -l")


def test_special_files_named_like_files_are_refused_at_once(security_server):
    # A read or write that blocked on a FIFO or socket would never answer: the client
    # gives up after 30 s and fails the test (how fast the refusal is, is bench/'s).
    scope = f"sec-special-{secrets.token_hex(4)}"
    with httpx.Client(base_url=security_server.url, timeout=30) as http:
        session = new_session(http, container=scope)
        try:
            made = run_ok(http, session, SPECIAL_FILES, tool="bash")
            assert "prw" in made["stdout"] and "srw" in made["stdout"], made["stdout"]
            names = ["report.csv", "fed.txt", "listening.txt", "/mnt/user-data/outputs/data.json"]
            for name in names:
                response = http.get(f"/sessions/{session}/files", params={"path": name})
                assert response.status_code == 400, (name, response.status_code, response.text)
                assert response.json()["detail"], response.text
            listed = http.get(f"/sessions/{session}/files/list").json()["files"]
            assert [entry["path"] for entry in listed] == ["real.txt"]
            # Through the container's Files APIs too: not listed, not served.
            data_id = urlsafe_b64encode(b"/mnt/user-data/outputs/data.json").decode().rstrip("=")
            listing = http.get("/v1/files", params={"scope_id": scope})
            assert listing.status_code == 200 and listing.json()["data"] == [], listing.text
            for url in (f"/v1/files/{data_id}/content?scope_id={scope}",
                        f"/v1/files/{data_id}?scope_id={scope}",
                        f"/v1/containers/{scope}/files/{data_id}/content"):
                response = http.get(url)
                assert response.status_code in (400, 404), (url, response.status_code, response.text)
            # Writing onto them replaces them, without blocking on a reader.
            for name in ("report.csv", "fed.txt", "listening.txt"):
                response = http.post(f"/sessions/{session}/files", data={"path": name},
                                     files={"file": ("x", b"replaced\n")})
                assert response.status_code == 201, response.text
                assert http.get(f"/sessions/{session}/files",
                                params={"path": name}).content == b"replaced\n"
            assert httpx.get(f"{security_server.url}/health", timeout=30).status_code == 200
        finally:
            http.delete(f"/sessions/{session}")
            http.delete(f"/v1/containers/{scope}")


def test_the_special_files_cost_the_server_no_thread(security_server):
    """Many concurrent reads of a FIFO all answer, so none of them parks a worker."""

    with httpx.Client(base_url=security_server.url, timeout=30) as http:
        session = new_session(http)
        try:
            run_ok(http, session, "mkfifo pipe.csv", tool="bash")

            def read(_):
                with httpx.Client(base_url=security_server.url, timeout=30) as own:
                    return own.get(f"/sessions/{session}/files", params={"path": "pipe.csv"}).status_code

            with ThreadPoolExecutor(16) as workers:
                statuses = list(workers.map(read, range(64)))
            assert statuses == [400] * 64
            answer = execute(http, session, "print('still here')")
            assert answer.status == 200 and answer.content["stdout"] == "still here\n"
        finally:
            http.delete(f"/sessions/{session}")
