"""How many ptys a sandbox may hold, on either launcher.

Every devpts instance but the host's draws from one host-wide count
(``kernel.pty.max`` less its reserve, 3,072 by default): one sandbox that opened
them all left none for any other, whatever its tenant. Each sandbox's own
devpts instance is capped at :data:`PTYS`. The zygote's builder mounts it with
the cap (``shoal_agent.zygote``); bubblewrap's ``--dev`` takes no options, so
the host adds the cap to the instance bubblewrap made, from outside, before
anything of the sandbox runs (:func:`cap_bwrap_ptys`).
"""

from __future__ import annotations

import subprocess
import sys

from ._mountinfo import mount_table

PTYS = 32

# Runs as host root in a process of its own (setns into a mount namespace
# refuses a threaded caller): the interpreter is the host's, loaded before it
# joins the sandbox's namespace, and afterwards it makes one system call, so
# nothing of the sandbox's files is ever executed or loaded as root. A remount
# resets every devpts option not given again, so the instance's own are given
# with the cap, and its mount flags (nosuid, noexec) are kept.
_REMOUNT = r"""
import ctypes, os, sys
pid, options = sys.argv[1], sys.argv[2].encode()
libc = ctypes.CDLL(None, use_errno=True)
namespace = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
if libc.setns(namespace, 0x20000) != 0:  # CLONE_NEWNS: also moves us to its root
    sys.exit(f"setns: {os.strerror(ctypes.get_errno())}")
kept = os.statvfs("/dev/pts").f_flag & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC | os.ST_RDONLY)
if libc.mount(b"devpts", b"/dev/pts", b"devpts", 0x20 | kept, options) != 0:  # MS_REMOUNT
    sys.exit(f"remount: {os.strerror(ctypes.get_errno())}")
"""


class PtyCapFailed(RuntimeError):
    """The sandbox's devpts could not be capped: it is not handed out."""


def _devpts_options(pid: int) -> str:
    """The options of the sandbox's /dev/pts, as its mount namespace shows them."""
    for point, fstype, options in mount_table(pid):
        if point == "/dev/pts" and fstype == "devpts":
            return ",".join(option for option in options
                            if option not in ("rw", "ro") and not option.startswith("max="))
    raise PtyCapFailed("the sandbox has no /dev/pts to cap")


def cap_bwrap_ptys(pid: int) -> None:
    """Cap the devpts instance of the sandbox whose init is ``pid`` (host pid)."""
    options = ",".join(filter(None, (_devpts_options(pid), f"max={PTYS}")))
    done = subprocess.run([sys.executable, "-I", "-S", "-c", _REMOUNT, str(pid), options],
                          capture_output=True, text=True, timeout=10, env={})
    if done.returncode != 0:
        raise PtyCapFailed(f"capping the sandbox's ptys failed: {done.stderr.strip()[-300:]}")
