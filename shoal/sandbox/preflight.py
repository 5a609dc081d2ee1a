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


def require_isolation() -> None:
    found = problems()
    if found:
        raise IsolationUnavailable("cannot isolate sandboxes on this host:\n  - "
                                   + "\n  - ".join(found))
