"""Tests for shoal.sandbox.seccomp.

The kernel tests install the real filter in a forked child (no mocks) and
report what the kernel answered back to the parent as JSON over a pipe.
Syscall numbers used to probe are written out here independently of the
module's tables, and the tables themselves are cross-checked against the
installed kernel headers, so a typo in either place shows up.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import platform
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import pytest

from shoal.sandbox import seccomp
from shoal.sandbox.seccomp import (
    ABSENT_SYSCALLS,
    DENIED_SYSCALLS,
    UnsupportedArchitecture,
    build_filter,
    write_filter_fd,
)

MACHINE = platform.machine()

# Syscall numbers for the probes, per arch (independent of the module).
PROBE_NR = {
    "x86_64": {
        "seccomp": 317,
        "keyctl": 250,
        "bpf": 321,
        "io_uring_setup": 425,
        "perf_event_open": 298,
        "clone": 56,
        "clone3": 435,
        "getpid": 39,
        "userfaultfd": 323,
    },
    "aarch64": {
        "seccomp": 277,
        "keyctl": 219,
        "bpf": 280,
        "io_uring_setup": 425,
        "perf_event_open": 241,
        "clone": 220,
        "clone3": 435,
        "getpid": 172,
        "userfaultfd": 282,
    },
}

KERNEL_OK = sys.platform.startswith("linux") and MACHINE in PROBE_NR
kernel = pytest.mark.skipif(
    not KERNEL_OK,
    reason=f"seccomp kernel tests need Linux on x86_64/aarch64 "
    f"(have {sys.platform}/{MACHINE})",
)

PR_SET_NO_NEW_PRIVS = 38
SECCOMP_SET_MODE_FILTER = 1
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIGCHLD = 17
TIOCSTI = 0x5412
TIOCLINUX = 0x541C
TIOCSETD = 0x5423
FIONREAD = 0x541B
ADDR_NO_RANDOMIZE = 0x0040000

EPERM = errno.EPERM
EAFNOSUPPORT = errno.EAFNOSUPPORT
ENOSYS = errno.ENOSYS


# ---------------------------------------------------------------------------
# Pure unit tests (no kernel involved).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_program_shape(machine: str) -> None:
    prog = build_filter(machine)
    assert isinstance(prog, bytes)
    assert len(prog) % 8 == 0
    assert 0 < len(prog) // 8 <= 4096
    # Ends in RET ALLOW (default action) and starts by loading arch.
    assert struct.unpack("<HBBI", prog[-8:]) == (0x06, 0, 0, 0x7FFF0000)
    assert struct.unpack("<HBBI", prog[:8]) == (0x20, 0, 0, 4)


def test_arches_differ_and_default_is_cached() -> None:
    assert build_filter("x86_64") != build_filter("aarch64")
    if MACHINE in ("x86_64", "aarch64"):
        assert build_filter() == build_filter(MACHINE)
        assert build_filter() is build_filter()


@pytest.mark.parametrize("machine", ["i686", "armv7l", "riscv64", "ppc64le", ""])
def test_unknown_arch_raises(machine: str) -> None:
    with pytest.raises(UnsupportedArchitecture, match="no seccomp policy"):
        build_filter(machine)
    assert issubclass(UnsupportedArchitecture, ValueError)


def test_denied_syscalls_is_documented_tuple() -> None:
    assert isinstance(DENIED_SYSCALLS, tuple)
    for name in ("ptrace", "mount", "unshare", "bpf", "io_uring_setup", "keyctl"):
        assert name in DENIED_SYSCALLS
    assert len(set(DENIED_SYSCALLS)) == len(DENIED_SYSCALLS)


def _header_numbers(path: Path, pattern: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in re.finditer(pattern, path.read_text()):
        out[m.group(1)] = int(m.group(2))
    return out


# The kernel headers come with linux-libc-dev, which make test installs
# (runtime/test-packages.txt): a missing header fails these checks, it never skips them.
MISSING_HEADERS = "is missing: make test installs linux-libc-dev (runtime/test-packages.txt)"
# Syscalls newer than a distribution's headers may be (open_tree_attr: Linux
# 6.15; Debian 12's headers are 6.1). The same number on every architecture
# (new syscalls are numbered once for all); checked where a header has them.
NEWER_THAN_SOME_HEADERS = {"open_tree_attr": 467}


def _check_table(arch: str, table: dict[str, int], want: dict[str, int]) -> None:
    for name, nr in table.items():
        if name not in want and NEWER_THAN_SOME_HEADERS.get(name) == nr:
            continue
        assert want.get(name) == nr, f"{arch} {name}: table {nr}, header {want.get(name)}"


def _x86_64_header() -> Path | None:
    for p in (
        "/usr/include/x86_64-linux-gnu/asm/unistd_64.h",
        "/usr/include/asm/unistd_64.h",
        "/usr/x86_64-linux-gnu/include/asm/unistd_64.h",  # linux-libc-dev-amd64-cross
    ):
        if Path(p).exists():
            return Path(p)
    return None


def test_x86_64_numbers_match_kernel_headers() -> None:
    hdr = _x86_64_header()
    if hdr is None and MACHINE != "x86_64":
        # linux-libc-dev carries only the host's own asm headers.
        pytest.skip("x86_64 headers on a non-x86_64 host need linux-libc-dev-amd64-cross")
    assert hdr is not None, f"x86_64 asm/unistd_64.h {MISSING_HEADERS}"
    want = _header_numbers(hdr, r"#define __NR_(\w+)\s+(\d+)")
    table = seccomp._X86_64_SYSCALLS
    _check_table("x86_64", table, want)
    for name in DENIED_SYSCALLS + ABSENT_SYSCALLS:
        assert name in table, f"x86_64 table lacks {name}"
    for name, nr in PROBE_NR["x86_64"].items():
        assert want[name] == nr


def test_aarch64_numbers_match_kernel_headers() -> None:
    # The generic table (aarch64's) is in linux-libc-dev on every architecture.
    hdr = Path("/usr/include/asm-generic/unistd.h")
    assert hdr.exists(), f"{hdr} {MISSING_HEADERS}"
    want = _header_numbers(hdr, r"#define __NR(?:3264)?_(\w+)\s+(\d+)")
    table = seccomp._AARCH64_SYSCALLS
    _check_table("aarch64", table, want)
    # Everything in the policy that exists in the generic table is covered.
    for name in DENIED_SYSCALLS + ABSENT_SYSCALLS:
        if name in want or name in NEWER_THAN_SOME_HEADERS:
            assert name in table, f"aarch64 table lacks {name}"
        else:
            assert name in ("iopl", "ioperm"), name
    for name, nr in PROBE_NR["aarch64"].items():
        assert want[name] == nr


# A tiny classic-BPF interpreter, enough to check the aarch64 program (which
# this x86_64 kernel can't run) and the jump structure on both arches.
def _bpf_run(prog: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    args = tuple(args) + (0,) * (6 - len(args))
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args)
    insns = [struct.unpack_from("<HBBI", prog, i) for i in range(0, len(prog), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:  # LD W ABS
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x06:  # RET K
            return k
        elif code in (0x15, 0x35, 0x45):  # JEQ / JGE / JSET
            cond = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if cond else jf
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


ALLOW = 0x7FFF0000
KILL = 0x80000000


def _err(e: int) -> int:
    return 0x00050000 | e


@pytest.mark.parametrize(
    "machine,audit", [("x86_64", 0xC000003E), ("aarch64", 0xC00000B7)]
)
def test_policy_in_bpf_interpreter(machine: str, audit: int) -> None:
    prog = build_filter(machine)
    table = seccomp._ARCHES[machine].syscalls
    run = lambda name, *a: _bpf_run(prog, table[name], audit, a)  # noqa: E731

    # Foreign ABI is killed whatever the syscall.
    assert _bpf_run(prog, 0, 0x40000003) == KILL  # AUDIT_ARCH_I386
    assert _bpf_run(prog, table["ptrace"], 0xC000003E ^ audit ^ 0xC00000B7) == KILL
    for name in DENIED_SYSCALLS:
        if name in table:
            assert run(name) == _err(EPERM), name
    for name in ABSENT_SYSCALLS:
        assert run(name) == _err(ENOSYS), name
    assert run("clone3") == _err(ENOSYS)
    assert run("clone", SIGCHLD) == ALLOW
    assert run("clone", 0x3D0F00) == ALLOW  # pthread_create flags
    for flag in (0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000,
                 0x20000000, 0x40000000, 0x80):
        assert run("clone", flag | SIGCHLD) == _err(EPERM), hex(flag)
    assert run("socket", 1) == ALLOW
    assert run("socket", 1 | (1 << 32)) == ALLOW  # kernel uses int domain
    for fam in (2, 10, 16, 17, 0, 40):
        assert run("socket", fam) == _err(EAFNOSUPPORT)
        assert run("socketpair", fam) == _err(EAFNOSUPPORT)
    assert run("socketpair", 1) == ALLOW
    assert run("personality", 0) == ALLOW
    assert run("personality", 0xFFFFFFFF) == ALLOW
    assert run("personality", ADDR_NO_RANDOMIZE) == _err(EPERM)
    assert run("personality", 0x0008) == _err(EPERM)
    assert run("ioctl", 0, TIOCSTI) == _err(EPERM)
    assert run("ioctl", 0, TIOCLINUX) == _err(EPERM)
    assert run("ioctl", 0, TIOCSETD) == _err(EPERM)  # line disciplines autoload modules
    assert run("ioctl", 0, FIONREAD) == ALLOW
    assert _bpf_run(prog, 0 if machine == "x86_64" else 63, audit) == ALLOW  # read
    if machine == "x86_64":
        assert _bpf_run(prog, 0x40000000 | 39, audit) == _err(ENOSYS)
        assert run("iopl") == _err(EPERM)
    else:
        # On aarch64 nr 0x40000027 is just an unknown syscall: default allow.
        assert _bpf_run(prog, 0x40000000 | 39, audit) == ALLOW


# ---------------------------------------------------------------------------
# Real-kernel tests.
# ---------------------------------------------------------------------------


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _install(prog: bytes) -> None:
    libc = _libc()
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _SockFprog(len(prog) // 8, ctypes.addressof(buf))
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(
        ctypes.c_long(PROBE_NR[MACHINE]["seccomp"]),
        ctypes.c_long(SECCOMP_SET_MODE_FILTER),
        ctypes.c_long(0),
        ctypes.byref(fprog),
    )
    if rc != 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER)")


def _in_child(probe, prog: bytes | None, timeout: float = 60.0):
    """Fork; in the child install ``prog`` (if given), run ``probe()`` and
    send its JSON-able result back. Returns the result in the parent."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(r)
            try:
                if prog is not None:
                    _install(prog)
                payload = {"ok": True, "value": probe()}
            except BaseException:
                payload = {"ok": False, "error": traceback.format_exc()}
            data = json.dumps(payload).encode()
            while data:
                data = data[os.write(w, data):]
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                pytest.fail("seccomp probe child timed out")
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        f"probe child died: status {status:#x}"
    )
    payload = json.loads(b"".join(chunks))
    if not payload["ok"]:
        pytest.fail("probe child raised:\n" + payload["error"])
    return payload["value"]


def _errno_of(fn) -> int:
    """0 if fn() succeeds, else the errno it failed with."""
    try:
        fn()
    except OSError as exc:
        return exc.errno
    return 0


def _c(rc: int) -> int:
    """errno of a libc call returning -1 on failure, else 0."""
    return ctypes.get_errno() if rc == -1 else 0


def _socket_errno(family: int, type_: int, proto: int = 0) -> int:
    def go() -> None:
        socket.socket(family, type_, proto).close()

    return _errno_of(go)


def _int80_getpid() -> int:
    """Run i386 getpid via int 0x80 from 64-bit code; return its result."""
    import mmap

    code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax,20; int 0x80; ret
    mem = mmap.mmap(-1, mmap.PAGESIZE,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    mem.write(code)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    return ctypes.CFUNCTYPE(ctypes.c_int)(addr)()


def _fork_status(fn) -> int:
    """Run fn in a forked grandchild, return its raw wait status."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


def _isolated_errno(fn) -> int:
    """Run fn() -> errno in a forked grandchild and return that errno.

    For probes that would change the prober's own state if the filter let
    them through (new namespaces, PTRACE_TRACEME, personality flags)."""
    st = _fork_status(lambda: os._exit(min(fn(), 255)))
    return os.WEXITSTATUS(st) if os.WIFEXITED(st) else -1


def _probe_all(workdir: str) -> dict:
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    nr = PROBE_NR[MACHINE]
    L = ctypes.c_long
    res: dict = {}

    # sockets
    res["sock_inet"] = _socket_errno(socket.AF_INET, socket.SOCK_STREAM)
    res["sock_inet_dgram"] = _socket_errno(socket.AF_INET, socket.SOCK_DGRAM)
    res["sock_inet6"] = _socket_errno(socket.AF_INET6, socket.SOCK_STREAM)
    res["sock_netlink"] = _socket_errno(socket.AF_NETLINK, socket.SOCK_RAW, 0)
    res["sock_packet"] = _socket_errno(socket.AF_PACKET, socket.SOCK_RAW, 0)
    res["sock_unix"] = _socket_errno(socket.AF_UNIX, socket.SOCK_STREAM)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.sendall(b"ping")
    res["socketpair_unix"] = b.recv(4).decode()
    a.close()
    b.close()
    fds = (ctypes.c_int * 2)()
    res["socketpair_inet"] = _c(libc.socketpair(socket.AF_INET, socket.SOCK_STREAM, 0, fds))

    # namespaces, ptrace, mounts
    res["unshare_user"] = _isolated_errno(lambda: _c(libc.unshare(CLONE_NEWUSER)))
    res["unshare_net"] = _isolated_errno(lambda: _c(libc.unshare(CLONE_NEWNET)))
    res["ptrace_traceme"] = _isolated_errno(
        lambda: _c(libc.ptrace(L(0), L(0), None, None))
    )
    target = os.path.join(workdir, "mnt")
    os.makedirs(target, exist_ok=True)

    def mount() -> int:
        rc = libc.mount(b"none", target.encode(), b"tmpfs", L(0), None)
        if rc == 0:  # filter broken: don't leave a mount behind
            libc.umount2(target.encode(), 0)
        return _c(rc)

    res["mount"] = _isolated_errno(mount)

    # syscalls without libc wrappers, by number
    res["keyctl"] = _c(libc.syscall(L(nr["keyctl"]), L(0), L(-3), L(0)))
    res["bpf"] = _c(libc.syscall(L(nr["bpf"]), L(0), None, L(0)))
    res["io_uring_setup"] = _c(libc.syscall(L(nr["io_uring_setup"]), L(1), None))
    res["perf_event_open"] = _c(
        libc.syscall(L(nr["perf_event_open"]), None, L(0), L(-1), L(-1), L(0))
    )
    res["userfaultfd"] = _c(libc.syscall(L(nr["userfaultfd"]), L(0)))
    res["clone3"] = _c(libc.syscall(L(nr["clone3"]), None, L(0)))
    # Raw clone with a namespace flag; if it ever succeeds, the copy exits.
    rc = libc.syscall(L(nr["clone"]), L(CLONE_NEWUSER | SIGCHLD), L(0), L(0), L(0), L(0))
    if rc == 0:
        os._exit(0)
    if rc > 0:
        os.waitpid(rc, 0)
    res["clone_newuser"] = _c(rc)

    # personality
    libc.personality.restype = ctypes.c_int
    res["personality_aslr"] = _isolated_errno(
        lambda: _c(libc.personality(ctypes.c_ulong(ADDR_NO_RANDOMIZE)))
    )
    res["personality_query"] = libc.personality(ctypes.c_ulong(0xFFFFFFFF))
    res["personality_query_errno"] = ctypes.get_errno()
    res["personality_linux"] = _c(libc.personality(ctypes.c_ulong(0)))

    # ioctl
    with open(os.devnull, "rb") as dn:
        ch = ctypes.c_char(b"x")
        res["tiocsti"] = _c(libc.ioctl(dn.fileno(), L(TIOCSTI), ctypes.byref(ch)))
        res["tioclinux"] = _c(libc.ioctl(dn.fileno(), L(TIOCLINUX), ctypes.byref(ch)))
    pr, pw = os.pipe()
    os.write(pw, b"abc")
    avail = ctypes.c_int(0)
    res["fionread"] = [_c(libc.ioctl(pr, L(FIONREAD), ctypes.byref(avail))), avail.value]
    os.close(pr)
    os.close(pw)

    # x32 ABI (x86_64 only)
    if MACHINE == "x86_64":
        res["x32_getpid"] = _c(libc.syscall(L(0x40000000 | nr["getpid"])))

    # things that must keep working
    st = _fork_status(lambda: os._exit(7))
    res["fork"] = os.WEXITSTATUS(st) if os.WIFEXITED(st) else -st
    box = []
    t = threading.Thread(target=lambda: box.append(threading.get_native_id()))
    t.start()
    t.join()
    res["thread"] = bool(box) and box[0] != threading.get_native_id()
    res["subprocess_true"] = subprocess.run(["true"]).returncode
    out = subprocess.run(["sh", "-c", "echo hi"], capture_output=True, text=True)
    res["subprocess_sh"] = [out.returncode, out.stdout]
    path = os.path.join(workdir, "f.txt")
    with open(path, "w") as f:
        f.write("hello")
    with open(path) as f:
        res["file_io"] = f.read()
    os.unlink(path)
    res["getpid_same"] = os.getpid() == libc.syscall(L(nr["getpid"]))
    return res


@pytest.fixture(scope="module")
def filtered() -> dict:
    if not KERNEL_OK:
        pytest.skip(f"needs Linux on x86_64/aarch64 (have {sys.platform}/{MACHINE})")
    # Load the program the way bwrap would: from write_filter_fd().
    fd = write_filter_fd()
    try:
        prog = b""
        while chunk := os.read(fd, 65536):
            prog += chunk
    finally:
        os.close(fd)
    with tempfile.TemporaryDirectory() as d:
        return _in_child(lambda: _probe_all(d), prog)


@kernel
def test_write_filter_fd() -> None:
    fd = write_filter_fd()
    try:
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0
        assert not os.get_inheritable(fd)
        data = os.read(fd, 1 << 20)
        assert data == build_filter()
        with pytest.raises(OSError) as ei:
            os.pwrite(fd, b"\0" * 8, 0)
        assert ei.value.errno == EPERM  # sealed
    finally:
        os.close(fd)


@kernel
def test_control_without_filter() -> None:
    """Sanity: the same probes behave differently without the filter."""
    res = _in_child(
        lambda: {
            "sock_inet": _socket_errno(socket.AF_INET, socket.SOCK_STREAM),
            "clone3": _c(_libc().syscall(ctypes.c_long(PROBE_NR[MACHINE]["clone3"]),
                                         None, ctypes.c_long(0))),
        },
        prog=None,
    )
    assert res["sock_inet"] == 0
    assert res["clone3"] != ENOSYS


@kernel
@pytest.mark.parametrize(
    "key", ["sock_inet", "sock_inet_dgram", "sock_inet6", "sock_netlink",
            "sock_packet", "socketpair_inet"]
)
def test_non_unix_sockets_refused(filtered: dict, key: str) -> None:
    assert filtered[key] == EAFNOSUPPORT


@kernel
def test_unix_sockets_work(filtered: dict) -> None:
    assert filtered["sock_unix"] == 0
    assert filtered["socketpair_unix"] == "ping"


@kernel
@pytest.mark.parametrize(
    "key", ["unshare_user", "unshare_net", "ptrace_traceme", "mount", "keyctl",
            "bpf", "io_uring_setup", "perf_event_open", "userfaultfd",
            "clone_newuser", "personality_aslr", "tiocsti", "tioclinux"]
)
def test_denied_with_eperm(filtered: dict, key: str) -> None:
    assert filtered[key] == EPERM


@kernel
def test_clone3_is_enosys(filtered: dict) -> None:
    assert filtered["clone3"] == ENOSYS


@kernel
def test_personality_query_allowed(filtered: dict) -> None:
    assert filtered["personality_query"] >= 0, filtered["personality_query_errno"]
    assert filtered["personality_linux"] == 0


@kernel
def test_ordinary_ioctl_allowed(filtered: dict) -> None:
    assert filtered["fionread"] == [0, 3]


@kernel
def test_process_creation_and_io_still_work(filtered: dict) -> None:
    assert filtered["fork"] == 7
    assert filtered["thread"] is True
    assert filtered["subprocess_true"] == 0
    assert filtered["subprocess_sh"] == [0, "hi\n"]
    assert filtered["file_io"] == "hello"
    assert filtered["getpid_same"] is True


@kernel
@pytest.mark.skipif(MACHINE != "x86_64", reason="x32 ABI exists only on x86_64")
def test_x32_abi_refused(filtered: dict) -> None:
    assert filtered["x32_getpid"] == ENOSYS


@kernel
@pytest.mark.skipif(MACHINE != "x86_64", reason="int 0x80 exists only on x86_64")
def test_i386_int80_kills_process() -> None:
    # Control: without the filter, does this kernel run i386 syscalls at all?
    control = _in_child(
        lambda: _fork_status(lambda: os._exit(0 if _int80_getpid() == os.getpid() else 3)),
        prog=None,
    )
    if not (os.WIFEXITED(control) and os.WEXITSTATUS(control) == 0):
        pytest.skip(f"kernel has no usable i386 emulation (status {control:#x})")
    status = _in_child(
        lambda: _fork_status(lambda: (_int80_getpid(), os._exit(3))),
        prog=build_filter(),
    )
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSYS, hex(status)


@kernel
def test_bwrap_loads_filter() -> None:
    """End to end: bubblewrap accepts the program via --seccomp FD."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bwrap not installed")
    base = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
            "--unshare-all", "--die-with-parent"]
    if subprocess.run(base + ["true"], capture_output=True).returncode != 0:
        pytest.skip("bwrap cannot create a sandbox here")
    script = (
        "import socket, errno\n"
        "try:\n"
        "    socket.socket(socket.AF_INET6, socket.SOCK_STREAM)\n"
        "    print('inet6 allowed')\n"
        "except OSError as e:\n"
        "    print(errno.errorcode[e.errno])\n"
        "socket.socket(socket.AF_UNIX).close()\n"
        "print('unix ok')\n"
    )
    fd = write_filter_fd()
    try:
        out = subprocess.run(
            base + ["--seccomp", str(fd), sys.executable, "-c", script],
            pass_fds=(fd,), capture_output=True, text=True, timeout=60,
        )
    finally:
        os.close(fd)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["EAFNOSUPPORT", "unix", "ok"]
