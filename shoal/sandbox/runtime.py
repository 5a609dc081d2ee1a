"""The sandbox's runtime environment: a pinned Python venv, built once, cached.

The venv is built on Debian's ``/usr/bin/python3`` because the sandbox uid must
be able to read the interpreter: a pyenv Python under root's 0700 home cannot be
bound into a sandbox. It lives outside the checkout, under a key derived from
the pinned lists and the interpreter's version, so a new checkout reuses it and
a changed list builds a new one beside the old.

Bun (the JavaScript runtime) is part of the same build: the pinned npm package
for this CPU, fetched with ``npm pack``, checked against the pinned digests and
installed as ``bin/bun`` of the venv. A build that cannot verify it fails; the
server never runs an unverified binary.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

PROJECT_ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = PROJECT_ROOT / "runtime" / "requirements.txt"
BUN_PINS = PROJECT_ROOT / "runtime" / "bun.txt"
NODE_PINS = PROJECT_ROOT / "runtime" / "node-packages.txt"
BASE_PYTHON = Path("/usr/bin/python3")
_COMPLETE_MARKER = ".shoal-runtime-complete"


class RuntimeMissing(RuntimeError):
    """No built runtime environment matches the pinned list."""


def _base_python_version() -> str:
    if not BASE_PYTHON.exists():
        raise RuntimeMissing(f"{BASE_PYTHON} is missing: install Debian's python3 and python3-venv")
    return subprocess.run([str(BASE_PYTHON), "-c", "import sys; print(sys.version)"],
                          capture_output=True, text=True, check=True).stdout.strip()


# What the build does besides installing the pins; a change to the steps is a new
# recipe, and so a new build.
_RECIPE = "2: pins, Bun, command links"
# Commands the documents name that Debian installs under other names: linked into
# the runtime's bin (first on the sandbox's PATH).
COMMAND_LINKS = {"fd": "/usr/bin/fdfind", "7zip": "/usr/bin/7zz"}


def _pins(path: Path) -> list[str]:
    return [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()
            if line.split("#", 1)[0].strip()]


def python_version() -> str:
    """The sandbox Python's version, e.g. ``3.11.2``."""
    return _base_python_version().split()[0]


def runtime_key(requirements: Path = REQUIREMENTS) -> str:
    """The build's name: a hash of what it is made of (comments do not count)."""
    digest = hashlib.sha256("\n".join(_pins(requirements)).encode())
    digest.update("\n".join(_pins(BUN_PINS)).encode())
    digest.update("\n".join(_pins(NODE_PINS)).encode())
    digest.update(_RECIPE.encode())
    digest.update(_base_python_version().encode())
    return digest.hexdigest()[:16]


class BunPin:
    """The pinned Bun package for one CPU, and the digests it must match."""

    def __init__(self, package: str, integrity: str, binary_sha256: str) -> None:
        self.package = package
        self.integrity = integrity
        self.binary_sha256 = binary_sha256


def bun_pin(machine: str | None = None, pins: Path = BUN_PINS) -> BunPin:
    machine = machine or platform.machine()
    for line in pins.read_text().splitlines():
        fields = line.split()
        if len(fields) == 4 and not line.startswith("#") and fields[0] == machine:
            return BunPin(*fields[1:])
    raise RuntimeError(f"runtime: no Bun is pinned for this CPU ({machine}) in {pins}")


def _npm_pack(package: str, integrity: str, scratch: str) -> Path:
    """``npm pack`` one pinned package into ``scratch``, checked against npm's
    integrity string; the tarball's path."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"runtime: npm is needed to fetch {package}: apt-get install npm")
    packed = subprocess.run([npm, "pack", package, "--json", "--silent",
                             "--pack-destination", scratch],
                            capture_output=True, text=True, cwd=scratch)
    if packed.returncode != 0:
        raise RuntimeError(f"runtime: npm pack {package} failed: {packed.stderr.strip()[-2000:]}")
    tarball = Path(scratch) / json.loads(packed.stdout)[0]["filename"]
    algorithm, _, expected = integrity.partition("-")
    actual = base64.b64encode(hashlib.new(algorithm, tarball.read_bytes()).digest()).decode()
    if actual != expected:
        raise RuntimeError(f"runtime: {tarball.name} does not match its pinned {algorithm}")
    return tarball


def install_bun(target: Path, say: Callable[[str], None]) -> None:
    """Fetch, verify and install the pinned Bun as ``target/bin/bun``."""
    pin = bun_pin()
    say(f"runtime: fetching {pin.package} (JavaScript)")
    with tempfile.TemporaryDirectory() as scratch:
        tarball = _npm_pack(pin.package, pin.integrity, scratch)
        with tarfile.open(tarball) as archive:
            member = archive.getmember("package/bin/bun")
            source = archive.extractfile(member)
            assert source is not None
            binary = source.read()
        if hashlib.sha256(binary).hexdigest() != pin.binary_sha256:
            raise RuntimeError("runtime: bin/bun does not match its pinned sha256")
    destination = target / "bin" / "bun"
    destination.write_bytes(binary)
    os.chmod(destination, 0o755)
    say(f"runtime: Bun installed ({len(binary) // (1024 * 1024)} MiB)")


def install_node_packages(target: Path, say: Callable[[str], None],
                          pins: Path = NODE_PINS) -> None:
    """The pinned npm packages Node needs (``undici``, which points Node's own
    ``fetch`` at the egress proxy), as ``target/node_modules/<name>``."""
    for line in pins.read_text().splitlines():
        fields = line.split()
        if len(fields) != 2 or line.startswith("#"):
            continue
        package, integrity = fields
        name = package.rpartition("@")[0] or package
        with tempfile.TemporaryDirectory() as scratch:
            tarball = _npm_pack(package, integrity, scratch)
            destination = target / "node_modules" / name
            destination.mkdir(parents=True)
            with tarfile.open(tarball) as archive:
                for member in archive.getmembers():
                    if not member.name.startswith("package/") or not (member.isfile() or member.isdir()):
                        continue  # npm tarballs hold files and directories, nothing else
                    member.name = member.name[len("package/"):]
                    archive.extract(member, destination, filter="data")
        say(f"runtime: {package} installed (Node)")


def find_runtime(cache_dir: Path, requirements: Path = REQUIREMENTS) -> Path:
    path = cache_dir / runtime_key(requirements)
    if not (path / _COMPLETE_MARKER).exists():
        raise RuntimeMissing(f"the sandbox runtime is not built ({path} is missing); "
                             "run `make runtime` or `shoal runtime build`")
    return path


def _size(root: Path) -> int:
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                pass
    return total


def hold_runtime(runtime: Path) -> int:
    """Mark a build as in use for as long as the returned fd stays open: a server
    holds it while it serves, so pruning never removes a runtime under a sandbox."""
    fd = os.open(runtime.parent / f"{runtime.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def prune_runtimes(cache_dir: Path, keep: Path, say: Callable[[str], None]) -> list[Path]:
    """Remove the builds of older pins that no running server holds."""
    removed = []
    for entry in sorted(cache_dir.iterdir()) if cache_dir.is_dir() else []:
        if (entry == keep or not entry.is_dir() or len(entry.name) != len(keep.name)
                or not (entry / _COMPLETE_MARKER).exists()):
            continue
        lock = os.open(cache_dir / f"{entry.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                       0o600)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                say(f"runtime: keeping {entry} (a running server uses it)")
                continue
            # Not complete first: a half-removed build is never taken for a good one.
            (entry / _COMPLETE_MARKER).unlink()
            shutil.rmtree(entry)
            (cache_dir / f"{entry.name}.lock").unlink(missing_ok=True)
            removed.append(entry)
            say(f"runtime: removed the old build {entry}")
        finally:
            os.close(lock)
    return removed


def build_runtime(cache_dir: Path, requirements: Path = REQUIREMENTS,
                  progress: Callable[[str], None] | None = None) -> Path:
    """Build the runtime venv if it is missing; returns its path either way."""
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    target = cache_dir / runtime_key(requirements)
    if (target / _COMPLETE_MARKER).exists():
        say(f"runtime: up to date at {target}")
        prune_runtimes(cache_dir, target, say)
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(cache_dir, 0o755)
    building = cache_dir / f"{target.name}.building"
    shutil.rmtree(building, ignore_errors=True)
    started = time.monotonic()
    pins = _pins(requirements)
    say(f"runtime: building {len(pins)} pinned packages into {target}")
    subprocess.run([str(BASE_PYTHON), "-m", "venv", str(building)], check=True)
    pip = [str(building / "bin" / "python"), "-m", "pip", "--disable-pip-version-check",
           "--no-input"]
    process = subprocess.Popen(
        [*pip, "install", "--progress-bar", "off", "-r", str(requirements)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    collected = 0
    tail: list[str] = []
    for line in process.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        if line.startswith("Collecting "):
            collected += 1
            say(f"runtime: [{collected}/{len(pins)}] {line.split()[1]}")
        elif line.startswith("Installing collected packages"):
            say("runtime: installing (this takes a minute)")
    if process.wait() != 0:
        raise RuntimeError("runtime: pip failed:\n" + "\n".join(tail))
    install_bun(building, say)
    install_node_packages(building, say)
    for name, points_to in COMMAND_LINKS.items():
        # Dangling where the package is not installed: the sandbox then says
        # "command not found", as it would for any missing tool.
        os.symlink(points_to, building / "bin" / name)
    # The sandbox runs as an unprivileged uid: everything must be world-readable.
    subprocess.run(["chmod", "-R", "a+rX", str(building)], check=True)
    (building / _COMPLETE_MARKER).write_text(requirements.read_text())
    os.rename(building, target)
    say(f"runtime: ready at {target} ({_size(target) // 2**20} MiB, built in "
        f"{time.monotonic() - started:.0f} s)")
    prune_runtimes(cache_dir, target, say)
    return target
