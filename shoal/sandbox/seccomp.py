"""Seccomp deny-list for sandboxed code.

Why this exists
---------------
Untrusted code runs under bubblewrap, which already puts it in fresh
namespaces (mount, pid, net, ipc, uts, user) with a minimal filesystem.
Namespaces limit what the code can *see*; they do not shrink the kernel's
attack surface. Many historical container escapes and local privilege
escalations go through syscalls that a code-execution sandbox never needs:
creating nested user namespaces, io_uring, bpf, perf events, the keyring,
ptrace, the new mount API, and so on. This module adds a seccomp filter on
top of the namespaces that refuses those syscalls outright.

What it owns
------------
This module owns the policy and its encoding: it generates the classic-BPF
program (a raw array of ``struct sock_filter``) that bubblewrap reads from a
file descriptor given as ``bwrap --seccomp FD`` and installs in the sandboxed
process right before ``execve``. Nothing else in shoal should build or edit
seccomp programs; callers only use :func:`write_filter_fd` (or
:func:`build_filter` for inspection and tests).

Policy (default ALLOW; a deny-list):

* A syscall made with any ABI other than the native one is fatal
  (``SECCOMP_RET_KILL_PROCESS``). On x86_64 this stops ``int 0x80`` (i386),
  whose syscall numbers differ and would slip past the table below. The x32
  ABI (same audit arch, ``nr | 0x40000000``) fails with ``ENOSYS``.
* Everything in :data:`DENIED_SYSCALLS` fails with ``EPERM``.
* Everything in :data:`ABSENT_SYSCALLS` fails with ``ENOSYS``, as on a kernel
  built without it: software that can do without it (Linux AIO) falls back.
* ``clone3`` fails with ``ENOSYS``: its flags live in a struct in user memory
  that seccomp cannot read, so libc is made to fall back to ``clone``.
* ``clone`` with any namespace flag fails with ``EPERM``; plain
  ``fork``/thread creation is allowed.
* ``socket``/``socketpair`` are allowed only for ``AF_UNIX``; any other
  family fails with ``EAFNOSUPPORT`` (no network, netlink or packet sockets).
* ``personality`` is allowed only to query (``0xffffffff``) or to set
  ``PER_LINUX`` (0); anything else (e.g. ``ADDR_NO_RANDOMIZE``) is ``EPERM``.
* ``ioctl`` with ``TIOCSTI`` or ``TIOCLINUX`` (terminal input injection) or
  ``TIOCSETD`` (setting a line discipline asks the kernel to load its module)
  fails with ``EPERM``.

The syscall tables are written out per architecture below (x86_64 from
``arch/x86/entry/syscalls/syscall_64.tbl``, aarch64 from the generic
``include/uapi/asm-generic/unistd.h``). A wrong number is a hole in the
sandbox, so tests cross-check them against the installed kernel headers.
"""

from __future__ import annotations

import fcntl
import functools
import os
import platform
import struct

__all__ = [
    "CONDITIONAL_SYSCALLS",
    "ABSENT_SYSCALLS",
    "DENIED_SYSCALLS",
    "UnsupportedArchitecture",
    "build_filter",
    "write_filter_fd",
]


class UnsupportedArchitecture(ValueError):
    """Raised when no seccomp policy exists for the requested machine."""


# --------------------------------------------------------------------------
# Kernel ABI constants.
#
# Errno values are Linux's (asm-generic, shared by x86_64 and aarch64), not
# the host's ``errno`` module: the program is interpreted by a Linux kernel
# no matter where it was generated.
# --------------------------------------------------------------------------
_EPERM = 1
_ENOSYS = 38
_EAFNOSUPPORT = 97

# Classic BPF opcodes (linux/bpf_common.h).
_BPF_LD = 0x00
_BPF_JMP = 0x05
_BPF_RET = 0x06
_BPF_W = 0x00
_BPF_ABS = 0x20
_BPF_JEQ = 0x10
_BPF_JGE = 0x30
_BPF_JSET = 0x40
_BPF_K = 0x00
_BPF_MAXINSNS = 4096

# Seccomp return actions (linux/seccomp.h).
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000

# struct seccomp_data { int nr; __u32 arch; __u64 instruction_pointer;
#                       __u64 args[6]; }
# Both supported architectures are little-endian, so the low 32 bits of
# args[i] are at 16 + 8*i. Every argument we inspect is an int/unsigned int
# (or truncated to 32 bits) in the kernel, so the low word is exactly what
# the kernel acts on.
_OFF_NR = 0
_OFF_ARCH = 4


def _off_arg_lo(i: int) -> int:
    return 16 + 8 * i


# x32 syscalls on x86_64 carry this bit in nr (__X32_SYSCALL_BIT).
_X32_SYSCALL_BIT = 0x40000000

_CLONE_NEWTIME = 0x00000080
_CLONE_NEWNS = 0x00020000
_CLONE_NEWCGROUP = 0x02000000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_CLONE_NS_FLAGS = (
    _CLONE_NEWNS
    | _CLONE_NEWCGROUP
    | _CLONE_NEWUTS
    | _CLONE_NEWIPC
    | _CLONE_NEWUSER
    | _CLONE_NEWPID
    | _CLONE_NEWNET
    | _CLONE_NEWTIME
)

_AF_UNIX = 1
_AF_INET = 2
_AF_INET6 = 10
_PER_LINUX = 0x0
_PER_QUERY = 0xFFFFFFFF
_TIOCSTI = 0x5412
_TIOCLINUX = 0x541C
_TIOCSETD = 0x5423

# --------------------------------------------------------------------------
# Policy: which syscalls, by name.
# --------------------------------------------------------------------------

#: Syscalls refused with EPERM whatever their arguments. Names that do not
#: exist on an architecture (iopl/ioperm on aarch64) are skipped there.
DENIED_SYSCALLS: tuple[str, ...] = (
    # debugging / reading other processes' memory
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    # mounts, root and namespace changes
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "open_tree_attr",
    "mount_setattr",
    "open_by_handle_at",
    "name_to_handle_at",
    # kernel keyring
    "keyctl",
    "add_key",
    "request_key",
    # large, frequently exploited kernel surfaces
    "bpf",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "perf_event_open",
    "userfaultfd",
    # kernel / module / machine administration
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "quotactl_fd",
    "lookup_dcookie",
    "syslog",
    "vhangup",
    "iopl",
    "ioperm",
    # clocks
    "settimeofday",
    "clock_settime",
    "adjtimex",
    "clock_adjtime",
)

#: Syscalls refused with ENOSYS, as if this kernel had none: Linux AIO, whose
#: contexts come from one host-wide count (fs.aio-max-nr): one sandbox's
#: io_setup(65536) left none for anyone, host root included. Its users (libaio,
#: databases) fall back to threads on ENOSYS; POSIX aio_* in glibc is threads.
ABSENT_SYSCALLS: tuple[str, ...] = (
    "io_setup",
    "io_destroy",
    "io_submit",
    "io_cancel",
    "io_getevents",
    "io_pgetevents",
)

#: Syscalls whose verdict depends on arguments or that fail with ENOSYS;
#: see the module docstring.
CONDITIONAL_SYSCALLS: tuple[str, ...] = (
    "clone3",
    "clone",
    "socket",
    "socketpair",
    "personality",
    "ioctl",
)

# --------------------------------------------------------------------------
# Syscall numbers, written out per architecture. Only the names the policy
# uses are listed. Double-check any edit against the kernel tables.
# --------------------------------------------------------------------------

# arch/x86/entry/syscalls/syscall_64.tbl (common/64 entries).
_X86_64_SYSCALLS: dict[str, int] = {
    "ioctl": 16,
    "socket": 41,
    "socketpair": 53,
    "clone": 56,
    "ptrace": 101,
    "syslog": 103,
    "personality": 135,
    "io_setup": 206,
    "io_destroy": 207,
    "io_getevents": 208,
    "io_submit": 209,
    "io_cancel": 210,
    "io_pgetevents": 333,
    "vhangup": 153,
    "pivot_root": 155,
    "adjtimex": 159,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "iopl": 172,
    "ioperm": 173,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "lookup_dcookie": 212,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "clock_adjtime": 305,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "pidfd_getfd": 438,
    "mount_setattr": 442,
    "quotactl_fd": 443,
    "open_tree_attr": 467,
}

# include/uapi/asm-generic/unistd.h (the generic table aarch64 uses).
# No iopl/ioperm here: they are x86-only.
_AARCH64_SYSCALLS: dict[str, int] = {
    "io_setup": 0,
    "io_destroy": 1,
    "io_submit": 2,
    "io_cancel": 3,
    "io_getevents": 4,
    "lookup_dcookie": 18,
    "ioctl": 29,
    "umount2": 39,
    "mount": 40,
    "pivot_root": 41,
    "chroot": 51,
    "vhangup": 58,
    "quotactl": 60,
    "acct": 89,
    "personality": 92,
    "unshare": 97,
    "kexec_load": 104,
    "init_module": 105,
    "delete_module": 106,
    "clock_settime": 112,
    "syslog": 116,
    "ptrace": 117,
    "reboot": 142,
    "settimeofday": 170,
    "adjtimex": 171,
    "socket": 198,
    "socketpair": 199,
    "add_key": 217,
    "request_key": 218,
    "keyctl": 219,
    "clone": 220,
    "swapon": 224,
    "swapoff": 225,
    "perf_event_open": 241,
    "name_to_handle_at": 264,
    "open_by_handle_at": 265,
    "clock_adjtime": 266,
    "setns": 268,
    "process_vm_readv": 270,
    "process_vm_writev": 271,
    "kcmp": 272,
    "finit_module": 273,
    "bpf": 280,
    "userfaultfd": 282,
    "io_pgetevents": 292,
    "kexec_file_load": 294,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "pidfd_getfd": 438,
    "mount_setattr": 442,
    "quotactl_fd": 443,
    "open_tree_attr": 467,
}


class _Arch:
    def __init__(self, audit_arch: int, syscalls: dict[str, int], has_x32: bool):
        self.audit_arch = audit_arch
        self.syscalls = syscalls
        self.has_x32 = has_x32


_ARCHES: dict[str, _Arch] = {
    # AUDIT_ARCH_X86_64 = EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
    "x86_64": _Arch(0xC000003E, _X86_64_SYSCALLS, has_x32=True),
    # AUDIT_ARCH_AARCH64 = EM_AARCH64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
    "aarch64": _Arch(0xC00000B7, _AARCH64_SYSCALLS, has_x32=False),
}

# --------------------------------------------------------------------------
# Instruction encoding.
# --------------------------------------------------------------------------

# struct sock_filter { __u16 code; __u8 jt; __u8 jf; __u32 k; }, 8 bytes.
# The kernel reads it in its own byte order; every supported target is
# little-endian, so this equals native order on the machines that load it.
_INSN = struct.Struct("<HBBI")
assert _INSN.size == 8

_Insn = tuple[int, int, int, int]


def _stmt(code: int, k: int) -> _Insn:
    """A non-jump instruction (load or return)."""
    return (code, 0, 0, k)


def _jump(code: int, k: int, jt: int, jf: int) -> _Insn:
    """A conditional jump; jt/jf count instructions to skip (u8)."""
    if not (0 <= jt <= 255 and 0 <= jf <= 255):
        raise ValueError(f"BPF jump offset out of range: jt={jt} jf={jf}")
    return (code, jt, jf, k)


def _load(offset: int) -> _Insn:
    return _stmt(_BPF_LD | _BPF_W | _BPF_ABS, offset)


def _ret(action: int) -> _Insn:
    return _stmt(_BPF_RET | _BPF_K, action)


def _errno(err: int) -> int:
    return _RET_ERRNO | (err & 0xFFFF)


def _if_nr(nr: int, body: list[_Insn]) -> list[_Insn]:
    """Run ``body`` when the syscall number equals ``nr``, else skip it.

    The accumulator must hold ``nr`` on entry. ``body`` must end in a RET on
    every path, because it may overwrite the accumulator with an argument.
    """
    return [_jump(_BPF_JMP | _BPF_JEQ | _BPF_K, nr, 0, len(body))] + body


def _program(arch: _Arch, inet: bool = False) -> list[_Insn]:
    nrs = arch.syscalls
    prog: list[_Insn] = []

    # 1. ABI check first: syscall numbers are only meaningful for the native
    #    ABI. Another audit arch (i386 via int 0x80 on x86_64) is killed.
    prog += [
        _load(_OFF_ARCH),
        _jump(_BPF_JMP | _BPF_JEQ | _BPF_K, arch.audit_arch, 1, 0),
        _ret(_RET_KILL_PROCESS),
        _load(_OFF_NR),
    ]

    # 2. x32 shares AUDIT_ARCH_X86_64 but sets bit 30 in nr; refuse it all so
    #    "x32 ptrace" cannot dodge the native-number checks below.
    if arch.has_x32:
        prog += [
            _jump(_BPF_JMP | _BPF_JGE | _BPF_K, _X32_SYSCALL_BIT, 0, 1),
            _ret(_errno(_ENOSYS)),
        ]

    # 3. Unconditional denials: a linear run of (JEQ nr; RET EPERM) pairs, so
    #    every jump is a skip of exactly one instruction.
    for name in DENIED_SYSCALLS:
        if name in nrs:
            prog += _if_nr(nrs[name], [_ret(_errno(_EPERM))])
    for name in ABSENT_SYSCALLS:
        prog += _if_nr(nrs[name], [_ret(_errno(_ENOSYS))])

    # 4. clone3 passes its flags in a user-memory struct seccomp cannot read:
    #    ENOSYS makes glibc fall back to clone, whose flags we can check.
    prog += _if_nr(nrs["clone3"], [_ret(_errno(_ENOSYS))])

    # 5. clone: fork and threads are fine, new namespaces are not. The flags
    #    are arg0 on both x86_64 and aarch64 (CLONE_BACKWARDS); the kernel
    #    only uses their low 32 bits.
    prog += _if_nr(nrs["clone"], [
        _load(_off_arg_lo(0)),
        _jump(_BPF_JMP | _BPF_JSET | _BPF_K, _CLONE_NS_FLAGS, 0, 1),
        _ret(_errno(_EPERM)),
        _ret(_RET_ALLOW),
    ])

    # 6. socket/socketpair: only AF_UNIX (domain is arg0). No network, no
    #    netlink, no packet sockets even if a namespace were misconfigured.
    #    Where egress is granted, socket() may also make AF_INET and AF_INET6
    #    sockets, for the relay on 127.0.0.1 and its clients: the network
    #    namespace still holds only its loopback, so they reach nothing else.
    for name in ("socket", "socketpair"):
        if inet and name == "socket":
            prog += _if_nr(nrs[name], [
                _load(_off_arg_lo(0)),
                _jump(_BPF_JMP | _BPF_JEQ | _BPF_K, _AF_UNIX, 2, 0),
                _jump(_BPF_JMP | _BPF_JEQ | _BPF_K, _AF_INET, 1, 0),
                _jump(_BPF_JMP | _BPF_JEQ | _BPF_K, _AF_INET6, 0, 1),
                _ret(_RET_ALLOW),
                _ret(_errno(_EAFNOSUPPORT)),
            ])
            continue
        prog += _if_nr(nrs[name], [
            _load(_off_arg_lo(0)),
            _jump(_BPF_JMP | _BPF_JEQ | _BPF_K, _AF_UNIX, 0, 1),
            _ret(_RET_ALLOW),
            _ret(_errno(_EAFNOSUPPORT)),
        ])

    # 7. personality: query or PER_LINUX only. Other flags such as
    #    ADDR_NO_RANDOMIZE or READ_IMPLIES_EXEC weaken exploit mitigations.
    prog += _if_nr(nrs["personality"], [
        _load(_off_arg_lo(0)),
        _jump(_BPF_JMP | _BPF_JEQ | _BPF_K, _PER_LINUX, 2, 0),
        _jump(_BPF_JMP | _BPF_JEQ | _BPF_K, _PER_QUERY, 1, 0),
        _ret(_errno(_EPERM)),
        _ret(_RET_ALLOW),
    ])

    # 8. ioctl: TIOCSTI/TIOCLINUX push keystrokes into a terminal, which can
    #    escape to whatever reads the controlling tty outside the sandbox;
    #    TIOCSETD picks a line discipline, which autoloads its kernel module
    #    (a rarely used driver's code, reachable by anyone with a pty).
    #    The request is arg1 (unsigned int in the kernel).
    prog += _if_nr(nrs["ioctl"], [
        _load(_off_arg_lo(1)),
        _jump(_BPF_JMP | _BPF_JEQ | _BPF_K, _TIOCSTI, 2, 0),
        _jump(_BPF_JMP | _BPF_JEQ | _BPF_K, _TIOCLINUX, 1, 0),
        _jump(_BPF_JMP | _BPF_JEQ | _BPF_K, _TIOCSETD, 0, 1),
        _ret(_errno(_EPERM)),
        _ret(_RET_ALLOW),
    ])

    # 9. Default: allow. Namespaces and the bwrap setup do the rest.
    prog.append(_ret(_RET_ALLOW))
    return prog


# --------------------------------------------------------------------------
# Public API.
# --------------------------------------------------------------------------


@functools.cache
def _build(machine: str, inet: bool = False) -> bytes:
    arch = _ARCHES.get(machine)
    if arch is None:
        supported = ", ".join(sorted(_ARCHES))
        raise UnsupportedArchitecture(
            f"no seccomp policy for machine {machine!r}; supported: {supported}"
        )
    prog = _program(arch, inet)
    if len(prog) > _BPF_MAXINSNS:  # pragma: no cover - policy is far smaller
        raise ValueError(f"seccomp program too long: {len(prog)} instructions")
    return b"".join(_INSN.pack(*insn) for insn in prog)


def build_filter(machine: str | None = None, inet: bool = False) -> bytes:
    """Return the seccomp program as a raw ``struct sock_filter`` array.

    ``machine`` is a ``platform.machine()`` value (default: this machine).
    Raises :class:`UnsupportedArchitecture` for anything but ``x86_64`` and
    ``aarch64``. The result is cached per machine.
    """
    return _build(platform.machine() if machine is None else machine, inet)


def write_filter_fd(inet: bool = False) -> int:
    """Write the program for this machine into a memfd and return its fd.

    The fd is close-on-exec, sealed against modification and positioned at
    offset 0; hand it to bubblewrap with ``subprocess`` ``pass_fds`` and
    ``--seccomp FD``. bwrap reads it to EOF, which moves the shared offset,
    so use a fresh fd for each launch and close it afterwards.
    """
    data = build_filter(inet=inet)
    fd = os.memfd_create("shoal-seccomp", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        fcntl.fcntl(
            fd,
            fcntl.F_ADD_SEALS,
            fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE,
        )
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
