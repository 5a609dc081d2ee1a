"""The mount manifest: what a sandbox sees of the filesystem, as bwrap flags.

Everything not listed here does not exist inside the sandbox: the host's /etc
is replaced by a curated handful of files, /home holds only the agent's
workspace, and the checkout, /root, /sys and other sandboxes are simply absent.
Only the workspace, outputs and the size-capped tmpfs mounts are writable.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

WORKSPACE = "/home/agent/workspace"
UPLOADS = "/mnt/user-data/uploads"
OUTPUTS = "/mnt/user-data/outputs"
# A run's view of its container's files (``./external-files`` links here), read-only;
# beside the workspace rather than in /mnt/user-data, whose layout is Zylon's.
EXTERNAL = "/home/agent/.external-files"
# OpenAI's code interpreter writes to /mnt/data: there it is the outputs directory.
OPENAI_DATA = "/mnt/data"
SKILLS = "/mnt/skills"
RUNTIME = "/opt/shoal/runtime"
AGENT_ROOT = "/opt/shoal/agent"
# Where egress is granted: the host broker's socket, bound in read-only (shoal.egress),
# and the relay the agent runs on the sandbox's loopback.
EGRESS_DIR = "/run/shoal-egress"
RELAY = "http://127.0.0.1:3128"

# /proc files that describe the whole host's block devices: every loop volume's
# size and I/O, so one tenant could watch another's writes. Masked with /dev/null.
MASKED_PROC = ("/proc/diskstats", "/proc/partitions")
# Every sandbox process's standing with the kernel's OOM killer, set as root as
# the sandbox starts (a root holding CAP_SYS_RESOURCE makes it the floor code
# cannot go under; code may always raise it): past its cgroup's limit a
# sandbox's own processes die anyway, and if the machine as a whole runs out,
# sandboxes go before the server and the zygote, whose death is every
# sandbox's (a zygote holding every preloaded library was the biggest target).
OOM_SCORE_ADJ = 500

# Host /etc entries a sandbox may read; nothing with secrets or host identity.
_ETC_ENTRIES = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "alternatives",
    "nsswitch.conf", "mime.types", "os-release", "debian_version", "bash.bashrc",
    "inputrc", "protocols", "services", "magic", "magic.mime", "fonts",
    # The public CA bundle (curl, git and OpenSSL through the egress proxy), and
    # the JVM's configuration (tabula's Java needs java.security to start).
    "ssl/certs", "ca-certificates", "ca-certificates.conf", "java-*-openjdk",
)

SANDBOX_ENV = {
    "PATH": f"{RUNTIME}/bin:/usr/local/bin:/usr/bin:/bin",
    "HOME": "/home/agent",
    "USER": "agent",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TMPDIR": "/tmp",
    "MPLBACKEND": "Agg",
    "MPLCONFIGDIR": "/tmp/.config/matplotlib",
    "XDG_CACHE_HOME": "/tmp/.cache",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    "PIP_NO_INDEX": "1",
    "VIRTUAL_ENV": RUNTIME,
    "TERM": "dumb",
    # A sandbox has one core: one BLAS thread (and no thread pool to inherit).
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # One malloc arena: the agent's threads would each get their own, and every
    # arena's first pages are private memory in every sandbox.
    "MALLOC_ARENA_MAX": "1",
}


def egress_env() -> dict[str, str]:
    """What points the sandbox's clients (Python, curl, git, Node, Bun) at the relay."""
    env = {}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = RELAY
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env["NODE_OPTIONS"] = f"--require {AGENT_ROOT}/shoal_agent/node_egress.js"
    return env


@dataclass(frozen=True)
class SandboxHome:
    """The host directories behind one sandbox's writable and per-sandbox mounts."""

    root: Path

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def outputs(self) -> Path:
        return self.root / "outputs"

    @property
    def uploads(self) -> Path:
        return self.root / "uploads"

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def external(self) -> Path:
        return self.root / "external"

    @property
    def skills(self) -> Path:
        """The skills chosen for the container, copied here by the host, read-only inside."""
        return self.root / "skills"

    def host_path_of(self, sandbox_dir: str) -> Path | None:
        """The host directory mounted at a sandbox directory, if it is one of ours."""
        return {WORKSPACE: self.workspace, OUTPUTS: self.outputs,
                UPLOADS: self.uploads, EXTERNAL: self.external}.get(sandbox_dir)

    def create(self, uid: int) -> None:
        """Lay out the directories for a sandbox running as ``uid``; idempotent."""
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)
        for directory in (self.workspace, self.outputs):
            directory.mkdir(mode=0o700, exist_ok=True)
            os.chown(directory, uid, uid)
        self.uploads.mkdir(mode=0o755, exist_ok=True)
        self.external.mkdir(mode=0o755, exist_ok=True)
        self.skills.mkdir(mode=0o755, exist_ok=True)
        self.etc.mkdir(mode=0o755, exist_ok=True)
        (self.etc / "passwd").write_text(
            "root:x:0:0:root:/root:/usr/sbin/nologin\n"
            f"agent:x:{uid}:{uid}:agent:/home/agent:/bin/bash\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        (self.etc / "group").write_text(f"root:x:0:\nagent:x:{uid}:\nnogroup:x:65534:\n")
        (self.etc / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")

    def adopt(self, uid: int) -> None:
        """Give everything in the writable directories to a new sandbox uid.

        Run only while no sandbox is attached (nothing changes the tree under
        us), and never through a link, so nothing planted by earlier code can
        turn this into a chown of a host file. coreutils' ``chown -R -P`` walks
        trees of any depth with a bounded number of fds, where a walk of our
        own would need one per level (code can nest thousands).
        """
        result = subprocess.run(
            ["/bin/chown", "-R", "-P", "--no-dereference", f"{uid}:{uid}",
             str(self.workspace), str(self.outputs)], capture_output=True, text=True)
        if result.returncode != 0:
            raise OSError(f"could not hand the files to uid {uid}: {result.stderr.strip()[:500]}")


_etc_cache: tuple[float, list[Path]] = (float("-inf"), [])
_etc_present: tuple[float, list[Path]] = (float("-inf"), [])


def etc_entries() -> list[Path]:
    """The host /etc entries every sandbox sees, read-only.

    Globbing /etc is a few milliseconds on the event loop for every launch;
    the answer is kept for a minute (a package installed meanwhile shows up in
    sandboxes started after that)."""
    global _etc_cache, _etc_present
    now = time.monotonic()
    if now - _etc_cache[0] > 60:
        _etc_cache = (now, sorted({path for entry in _ETC_ENTRIES
                                   for path in Path("/etc").glob(entry)}))
        _etc_present = (float("-inf"), [])
    # A cached entry a package removal took away would fail every launch: the
    # entries are checked again, at most once a second (a stat each, per launch,
    # was a measurable share of the event loop during refills).
    if now - _etc_present[0] > 1:
        _etc_present = (now, [path for path in _etc_cache[1] if os.path.lexists(path)])
    return _etc_present[1]


def bwrap_arguments(home: SandboxHome, runtime: Path, agent_root: Path,
                    tmp_size_bytes: int, seccomp_fd: int,
                    egress_dir: Path | None = None) -> list[str]:
    args = [
        "--unshare-all", "--unshare-user", "--disable-userns",
        "--die-with-parent", "--new-session",
        "--hostname", "sandbox",
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64",
        "--symlink", "usr/bin", "/bin",
        "--symlink", "usr/sbin", "/sbin",
        "--symlink", OUTPUTS, OPENAI_DATA,
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(tmp_size_bytes), "--tmpfs", "/tmp",
        "--size", str(tmp_size_bytes), "--tmpfs", "/dev/shm",
        # bwrap's /dev is a tmpfs owned by the sandbox uid, sized by nothing:
        # read-only once laid out (/dev/shm and /dev/pts are mounts of their own).
        "--remount-ro", "/dev",
        "--dir", "/etc",
    ]
    for path in MASKED_PROC:
        args += ["--ro-bind", "/dev/null", path]
    for source in etc_entries():
        args += ["--ro-bind", str(source), str(source)]
    for name in ("passwd", "group", "hosts"):
        args += ["--ro-bind", str(home.etc / name), f"/etc/{name}"]
    args += [
        "--ro-bind", str(runtime), RUNTIME,
        "--ro-bind", str(agent_root), AGENT_ROOT,
        "--bind", str(home.workspace), WORKSPACE,
        "--ro-bind", str(home.uploads), UPLOADS,
        "--bind", str(home.outputs), OUTPUTS,
        "--ro-bind", str(home.external), EXTERNAL,
    ]
    args += ["--ro-bind", str(home.skills), SKILLS]
    env = dict(SANDBOX_ENV)
    if egress_dir is not None:
        args += ["--ro-bind", str(egress_dir), EGRESS_DIR]
        env.update(egress_env())
    args += [
        "--remount-ro", "/",
        "--chdir", WORKSPACE,
        "--clearenv",
    ]
    for name, value in env.items():
        args += ["--setenv", name, value]
    args += ["--seccomp", str(seccomp_fd)]
    return args
