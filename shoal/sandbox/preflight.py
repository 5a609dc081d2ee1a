"""Refuse to run untrusted code unless every layer of isolation is available.

Each check names what is missing and how to get it, all at once, so an
operator fixes the host in one pass instead of one error at a time.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from . import launcher, seccomp


class IsolationUnavailable(RuntimeError):
    """The host cannot isolate sandboxes; Shoal will not run code on it."""


def problems() -> list[str]:
    found = []
    if os.geteuid() != 0:
        found.append("Shoal must run as root: it gives each sandbox its own uid and manages "
                     "its cgroups (the sandboxed code itself never runs as root)")
    tools = {launcher.BWRAP: "bubblewrap", launcher.SETPRIV: "util-linux",
             launcher.PRLIMIT: "util-linux"}
    for path, package in tools.items():
        if not os.access(path, os.X_OK):
            found.append(f"{path} is missing: apt-get install {package}")
    max_userns = Path("/proc/sys/user/max_user_namespaces")
    if max_userns.exists() and max_userns.read_text().strip() == "0":
        found.append("user namespaces are disabled: sysctl -w user.max_user_namespaces=15000")
    try:
        seccomp.build_filter()
    except seccomp.UnsupportedArchitecture as exc:
        found.append(f"seccomp: {exc} ({platform.machine()})")
    return found


_UNSHARE, _PIVOT_ROOT = Path("/usr/bin/unshare"), Path("/usr/sbin/pivot_root")


def zygote_problems() -> list[str]:
    """Why the zygote (the fast launcher) cannot run here; empty if it can.

    It needs what bubblewrap needs, plus the new mount API (open_tree and
    move_mount, Linux 5.2) to hand each fork its files, and util-linux's unshare
    and pivot_root to build its own empty mount namespace.
    """
    from .zygote import open_tree

    found = []
    for tool in (_UNSHARE, _PIVOT_ROOT):
        if not os.access(tool, os.X_OK):
            found.append(f"{tool} is missing: apt-get install util-linux")
    try:
        os.close(open_tree(Path("/")))
    except OSError as exc:
        found.append(f"open_tree(2) is not available ({exc.strerror}): Linux 5.2 or newer is needed")
    return found


def require_isolation() -> None:
    found = problems()
    if found:
        raise IsolationUnavailable("cannot isolate sandboxes on this host:\n  - "
                                   + "\n  - ".join(found))
