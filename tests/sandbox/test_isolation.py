"""Isolation of real sandboxes: every test here fails if the attack it tries works.

Each probe runs inside a real sandbox (bubblewrap + cgroups + seccomp + its own
uid) and reports what the kernel answered (an errno, a listing, a byte count)
as one JSON line; the test asserts on that answer, and where it can, checks
the host side too (a listener that must have accepted nothing, a file that
must not exist). Probes that would change the prober's own state if the
kernel let them through (ptrace, namespaces, setuid) run in a child Python,
never in the session's interpreter.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import platform
import secrets
import shutil
import socket
import textwrap
from pathlib import Path

import pytest

from tests.egress_mode import EGRESS

from shoal.config import Settings
from shoal.sandbox import SandboxPool
from shoal.sandbox.mounts import OUTPUTS, SANDBOX_ENV, WORKSPACE

CHECKOUT = Path(__file__).resolve().parents[2]
PROBE_TAG = "SHOAL-PROBE:"
REFUSED = {errno.EROFS, errno.EACCES, errno.EPERM}


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _probe_source(body: str) -> str:
    """Wrap a probe body that fills ``res`` so it prints one tagged JSON line."""
    return ("import json as _json\nres = {}\n" + textwrap.dedent(body).strip("\n")
            + f"\nprint({PROBE_TAG!r} + _json.dumps(res))\n")


def _parse(result, what: str) -> dict:
    assert result.return_code == 0, (
        f"{what} probe failed: rc={result.return_code}\nstdout={result.stdout[-2000:]}\n"
        f"stderr={result.stderr[-2000:]}")
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(PROBE_TAG):
            return json.loads(line[len(PROBE_TAG):])
    raise AssertionError(f"{what} probe printed no result:\n{result.stdout[-2000:]}\n"
                         f"{result.stderr[-2000:]}")


async def probe(sandbox, body: str, timeout: float = 30) -> dict:
    """Run a probe in the session's interpreter."""
    return _parse(await sandbox.run_python(_probe_source(body), timeout=timeout), "python")


async def probe_child(sandbox, body: str, timeout: float = 30) -> dict:
    """Run a probe in a fresh python3 child (for probes that could harm the prober);
    the probe may use ``libc``, ``L`` and ``err`` (see ``_LIBC``)."""
    source = _probe_source(_LIBC + textwrap.dedent(body))
    script = "python3 - <<'SHOAL_PY_EOF'\n" + source + "SHOAL_PY_EOF\n"
    return _parse(await sandbox.run_bash(script, timeout=timeout), "child python")


def _host_procs() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _status(pid: int) -> dict[str, str]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                out[key] = value.strip()
    except OSError:
        pass
    return out


def _sandbox_host_processes(sandbox) -> dict[int, dict[str, str]]:
    """Host view of a sandbox's processes: every member of its cgroup (which the
    launcher joins before anything else runs), whichever launcher started it."""
    return {pid: _status(pid) for pid in sandbox._cgroup.pids()}


# ---------------------------------------------------------------------------
# network
# ---------------------------------------------------------------------------


async def test_inet_sockets_are_refused_by_the_kernel(sandbox):
    res = await probe(sandbox, """
        import socket
        def attempt(family, kind, proto=0):
            try:
                socket.socket(family, kind, proto).close()
                return 0
            except OSError as exc:
                return exc.errno
        res["inet_stream"] = attempt(socket.AF_INET, socket.SOCK_STREAM)
        res["inet_dgram"] = attempt(socket.AF_INET, socket.SOCK_DGRAM)
        res["inet_raw"] = attempt(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        res["inet6_stream"] = attempt(socket.AF_INET6, socket.SOCK_STREAM)
        res["inet6_dgram"] = attempt(socket.AF_INET6, socket.SOCK_DGRAM)
        res["packet"] = attempt(socket.AF_PACKET, socket.SOCK_RAW)
        res["netlink"] = attempt(socket.AF_NETLINK, socket.SOCK_RAW)
        res["unix"] = attempt(socket.AF_UNIX, socket.SOCK_STREAM)
    """)
    assert res.pop("unix") == 0, "control: AF_UNIX sockets must still work"
    if EGRESS:  # the relay's sockets: they exist, and reach only the sandbox's loopback
        for name in ("inet_stream", "inet_dgram", "inet6_stream", "inet6_dgram"):
            assert res.pop(name) == 0, name
        assert res.pop("inet_raw") == errno.EPERM  # no CAP_NET_RAW
    for name, err in res.items():
        assert err == errno.EAFNOSUPPORT, f"socket {name}: kernel answered errno {err}"


async def test_bash_dev_tcp_is_refused(sandbox):
    # Each redirection in a subshell: a failed ``exec`` ends a non-interactive shell.
    result = await sandbox.run_bash(
        "(exec 3<>/dev/tcp/127.0.0.1/80) && echo CONNECTED-TCP; "
        "(exec 3<>/dev/tcp/::1/80) && echo CONNECTED-TCP6; "
        "(exec 4<>/dev/udp/127.0.0.1/53) && echo CONNECTED-UDP; echo end")
    if EGRESS:  # the sandbox's own loopback, where nothing listens on these ports
        assert result.stdout == "CONNECTED-UDP\nend\n", result.stdout
        for target in ("/dev/tcp/127.0.0.1/80", "/dev/tcp/::1/80"):
            assert f"{target}: Connection refused" in result.stderr, result.stderr
        return
    assert result.stdout == "end\n", result.stdout
    assert result.stderr.count("Address family not supported") >= 3, result.stderr


async def test_host_loopback_listener_is_unreachable(sandbox):
    accepted: list[str] = []

    async def on_connect(reader, writer):
        accepted.append(repr(writer.get_extra_info("peername")))
        writer.close()

    servers = [await asyncio.start_server(on_connect, "127.0.0.1", 0)]
    port = servers[0].sockets[0].getsockname()[1]
    try:
        servers.append(await asyncio.start_server(on_connect, "::1", port))
    except OSError:
        pass  # no IPv6 loopback on this host
    try:
        res = await probe(sandbox, f"""
            import socket, subprocess, shutil, urllib.request
            PORT = {port}
            def attempt(fn):
                try:
                    fn()
                    return "CONNECTED"
                except Exception as exc:
                    return type(exc).__name__ + ": " + str(exc)
            res["py_create_connection"] = attempt(
                lambda: socket.create_connection(("127.0.0.1", PORT), timeout=2).close())
            res["py_localhost"] = attempt(
                lambda: socket.create_connection(("localhost", PORT), timeout=2).close())
            res["py_inet6"] = attempt(
                lambda: socket.create_connection(("::1", PORT), timeout=2).close())
            res["py_urllib"] = attempt(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{{PORT}}/", timeout=2))
            def shell(argv):
                done = subprocess.run(argv, capture_output=True, timeout=10)
                return "CONNECTED" if done.returncode == 0 else f"rc={{done.returncode}}"
            res["bash_dev_tcp"] = shell(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{{PORT}}"])
            for tool, argv in (
                ("curl", ["curl", "-sS", "--max-time", "3", f"http://127.0.0.1:{{PORT}}/"]),
                ("wget", ["wget", "-q", "-T", "3", "-t", "1", "-O-", f"http://127.0.0.1:{{PORT}}/"]),
                ("perl", ["perl", "-MIO::Socket::INET", "-e",
                          f"IO::Socket::INET->new(PeerAddr=>'127.0.0.1:{{PORT}}',Timeout=>3) or exit 1"]),
            ):
                if shutil.which(tool):
                    res[tool] = shell(argv)
            res["proc_net_tcp"] = open("/proc/net/tcp").read() + open("/proc/net/tcp6").read()
        """)
        listing = res.pop("proc_net_tcp")
        assert f":{port:04X} " not in listing, "the host's listener shows in the sandbox"
        for way, outcome in res.items():
            assert outcome != "CONNECTED", f"{way} connected to the host listener"
        await asyncio.sleep(0.2)
        assert accepted == [], f"the host listener accepted {accepted}"
        # Control: the listener does accept from the host, so the check above can fail.
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        for _ in range(100):
            if accepted:
                break
            await asyncio.sleep(0.01)
        assert len(accepted) == 1
    finally:
        for server in servers:
            server.close()
            await server.wait_closed()


async def test_host_abstract_unix_socket_is_unreachable(sandbox):
    name = f"shoal-test-{secrets.token_hex(8)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(8)
    listener.setblocking(False)
    try:
        res = await probe(sandbox, f"""
            import socket
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect("\\0{name}")
                res["errno"] = 0
            except OSError as exc:
                res["errno"] = exc.errno
        """)
        assert res["errno"] != 0, "the sandbox reached a host abstract unix socket"
        with pytest.raises(BlockingIOError):
            listener.accept()
        # Control: from the host the socket is reachable.
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect("\0" + name)
        client.close()
    finally:
        listener.close()


async def test_only_loopback_interface_and_own_hostname(sandbox):
    res = await probe(sandbox, """
        import os, socket
        lines = open("/proc/net/dev").read().splitlines()[2:]
        res["interfaces"] = sorted(line.split(":", 1)[0].strip() for line in lines)
        res["hostname"] = socket.gethostname()
        res["uname"] = os.uname().nodename
        res["sys_class_net"] = os.path.exists("/sys/class/net")
    """)
    assert res["interfaces"] == ["lo"]
    assert not res["sys_class_net"]
    host = socket.gethostname()
    assert res["hostname"] != host
    assert res["uname"] != host
    assert res["uname"] != os.uname().nodename


# ---------------------------------------------------------------------------
# reading the host
# ---------------------------------------------------------------------------


async def test_cannot_read_shadow_root_or_checkout(sandbox):
    assert CHECKOUT.joinpath("pyproject.toml").exists()  # the host has them
    assert Path("/etc/shadow").exists()
    targets = {
        "shadow": "/etc/shadow",
        "gshadow": "/etc/gshadow",
        "root": "/root",
        "checkout": str(CHECKOUT),
        "checkout_file": str(CHECKOUT / "pyproject.toml"),
        "test_file": str(Path(__file__).resolve()),
        "run": "/run",
        "sys": "/sys",
        "host_data": "/var/lib/shoal",
        "host_runtime_cache": "/var/cache/shoal",
    }
    # The checkout's parent, unless the sandbox has a directory of its own there
    # (a clone in /tmp: the sandbox's /tmp is its own tmpfs, where "checkout" above
    # already shows the clone is absent).
    if not str(CHECKOUT.parent).startswith(("/tmp", "/home", "/mnt", "/opt/shoal")) \
            and CHECKOUT.parent != Path("/"):
        targets["checkout_parent"] = str(CHECKOUT.parent)
    res = await probe(sandbox, f"""
        import os
        targets = {targets!r}
        for name, path in targets.items():
            try:
                if os.path.isdir(path):
                    res[name] = "LISTED " + repr(os.listdir(path)[:5])
                else:
                    with open(path, "rb") as handle:
                        res[name] = "READ %d bytes" % len(handle.read())
            except OSError as exc:
                res[name] = exc.errno
    """)
    if EGRESS:  # /run holds the broker's socket directory, and nothing else
        assert res.pop("run") == "LISTED ['shoal-egress']"
    for name, outcome in res.items():
        assert outcome in (errno.ENOENT, errno.EACCES), f"{name} ({targets[name]}): {outcome}"
    bash = await sandbox.run_bash(f"cat /etc/shadow; ls /root; ls {CHECKOUT}; getent shadow")
    assert bash.stdout == "", bash.stdout[:500]


async def test_checkout_is_nowhere_in_the_sandbox(sandbox):
    result = await sandbox.run_bash(
        "find / -path /proc -prune -o \\( -path '*/shoal/sandbox/seccomp.py' "
        "-o -name DESIGN.md -o -name test_isolation.py \\) -print 2>/dev/null; true",
        timeout=60)
    assert result.return_code == 0
    assert result.stdout == "", result.stdout[:2000]


async def test_proc_shows_nothing_of_the_host(sandbox):
    res = await probe(sandbox, """
        import os
        res["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        res["cmdlines"] = {}
        res["environs"] = {}
        for pid in res["pids"]:
            try:
                res["cmdlines"][pid] = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            except OSError as exc:
                res["cmdlines"][pid] = exc.errno
            try:
                res["environs"][pid] = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
            except OSError as exc:
                res["environs"][pid] = exc.errno
        res["pid1_environ"] = open("/proc/1/environ", "rb").read().decode(errors="replace")
        res["own_env"] = dict(os.environ)
    """)
    # Our own test process and the host's other processes are invisible.
    assert len(res["pids"]) < 16, res["pids"]
    for pid, cmdline in res["cmdlines"].items():
        assert "pytest" not in str(cmdline), f"pid {pid} is a host process: {cmdline!r}"
    # pid 1 is bubblewrap's init: nothing but what a sandbox is meant to have.
    pid1 = [entry for entry in res["pid1_environ"].split("\0") if entry]
    pid1_keys = {entry.split("=", 1)[0] for entry in pid1}
    assert pid1_keys <= set(SANDBOX_ENV), f"/proc/1/environ holds {sorted(pid1_keys)}"
    # No KEY=VALUE pair of the host leaks into any process of the sandbox,
    # except those the sandbox is given on purpose with the same value.
    intended = {f"{k}={v}" for k, v in SANDBOX_ENV.items()}
    host_pairs = {f"{k}={v}" for k, v in os.environ.items()} - intended
    for pid, environ in res["environs"].items():
        if isinstance(environ, int):
            continue
        leaked = host_pairs.intersection(environ.split("\0"))
        assert not leaked, f"pid {pid} holds host variables {[p.split('=')[0] for p in leaked]}"
    for key in ("PATH", "HOME"):
        if key in os.environ and os.environ[key] != SANDBOX_ENV.get(key):
            assert res["own_env"].get(key) != os.environ[key], f"host {key} leaked"
            assert f"{key}={os.environ[key]}" not in res["pid1_environ"]
    own_pairs = {f"{k}={v}" for k, v in res["own_env"].items()}
    assert not own_pairs & host_pairs, "host variables in the interpreter's environment"
    shell_maintained = {"PWD", "OLDPWD", "SHLVL", "_"}
    leaked_keys = (set(res["own_env"]) & set(os.environ)) - set(SANDBOX_ENV) - shell_maintained
    assert not leaked_keys, f"host variables in the sandbox: {sorted(leaked_keys)}"


async def test_server_environment_never_reaches_a_new_sandbox(sandbox, monkeypatch):
    canary_key = f"SHOAL_TEST_CANARY_{secrets.token_hex(4).upper()}"
    canary_value = secrets.token_hex(16)
    monkeypatch.setenv(canary_key, canary_value)
    await sandbox.restart()  # fresh processes, launched while the canary is set
    result = await sandbox.run_bash(
        "env; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; echo END")
    assert result.return_code == 0, result.stderr
    assert result.stdout.endswith("END\n")
    assert "PATH=" in result.stdout  # control: environments were read
    assert canary_value not in result.stdout
    assert canary_key not in result.stdout


# ---------------------------------------------------------------------------
# the filesystem
# ---------------------------------------------------------------------------


READ_ONLY_TARGETS = {
    "usr_new": "/usr/shoal-attack",
    "usr_bin_new": "/usr/bin/shoal-attack",
    "usr_existing": "/usr/bin/env",
    "etc_new": "/etc/shoal-attack",
    "etc_passwd": "/etc/passwd",
    "etc_ld_so_cache": "/etc/ld.so.cache",
    "root_new": "/shoal-attack",
    "home_new": "/home/agent/shoal-attack",
    "uploads_new": "/mnt/user-data/uploads/shoal-attack",
    "skills_new": "/mnt/skills/shoal-attack",
    "runtime_new": "/opt/shoal/runtime/shoal-attack",
    "runtime_python": "/opt/shoal/runtime/bin/python3",
    "agent_new": "/opt/shoal/agent/shoal-attack",
}


async def test_read_only_paths_refuse_writes(sandbox):
    res = await probe(sandbox, f"""
        import os
        targets = {READ_ONLY_TARGETS!r}
        for name, path in targets.items():
            existed = os.path.exists(path)
            try:
                with open(path, "ab") as handle:
                    handle.write(b"")
                res[name] = "OPENED FOR WRITING"
            except OSError as exc:
                res[name] = exc.errno
            if not existed and os.path.exists(path):
                res[name] = "CREATED"
        for name, path in (("mkdir_root", "/shoal-dir"), ("mkdir_usr", "/usr/shoal-dir"),
                           ("mkdir_etc", "/etc/shoal-dir"), ("mkdir_mnt", "/mnt/shoal-dir"),
                           ("mkdir_uploads", "/mnt/user-data/uploads/shoal-dir"),
                           ("mkdir_skills", "/mnt/skills/shoal-dir")):
            try:
                os.mkdir(path)
                res[name] = "CREATED"
            except OSError as exc:
                res[name] = exc.errno
        for name, path in (("rename_etc_passwd", "/etc/passwd"), ("unlink_usr", "/usr/bin/env")):
            try:
                os.rename(path, path + ".x") if name.startswith("rename") else os.unlink(path)
                res[name] = "CHANGED"
            except OSError as exc:
                res[name] = exc.errno
        for name, path in (("chmod_usr", "/usr/bin/env"), ("chmod_uploads", "/mnt/user-data/uploads")):
            try:
                os.chmod(path, 0o777)
                res[name] = "CHANGED"
            except OSError as exc:
                res[name] = exc.errno
    """)
    for name, outcome in res.items():
        assert outcome in REFUSED, f"{name}: {outcome}"
    bash = await sandbox.run_bash(
        "touch /usr/x /etc/x /x /mnt/user-data/uploads/x /mnt/skills/x 2>&1; echo rc=$?")
    assert bash.stdout.rstrip().endswith("rc=1"), bash.stdout
    # Nothing landed on the host either.
    for path in ("/usr/shoal-attack", "/usr/bin/shoal-attack", "/etc/shoal-attack",
                 "/shoal-attack", "/usr/x", "/etc/x"):
        assert not os.path.exists(path), path
    assert list(sandbox.home.uploads.iterdir()) == []


async def test_writable_paths_accept_writes(sandbox):
    token = secrets.token_hex(8)
    res = await probe(sandbox, f"""
        import os
        for name, path in (("workspace", "{WORKSPACE}/w-{token}"), ("relative", "r-{token}"),
                           ("outputs", "{OUTPUTS}/o-{token}"), ("tmp", "/tmp/t-{token}"),
                           ("dev_shm", "/dev/shm/s-{token}")):
            with open(path, "w") as handle:
                handle.write(name + "-{token}")
            with open(path) as handle:
                res[name] = handle.read()
        res["cwd"] = os.getcwd()
    """)
    for name in ("workspace", "relative", "outputs", "tmp", "dev_shm"):
        assert res[name] == f"{name}-{token}"
    assert res["cwd"] == WORKSPACE
    workspace = sandbox.home.workspace
    outputs = sandbox.home.outputs
    for host_file, content in ((workspace / f"w-{token}", f"workspace-{token}"),
                               (workspace / f"r-{token}", f"relative-{token}"),
                               (outputs / f"o-{token}", f"outputs-{token}")):
        assert host_file.read_text() == content
        assert host_file.stat().st_uid == sandbox.uid  # written as the sandbox's uid
    bash = await sandbox.run_bash(
        f"echo b > bash-{token} && echo b > {OUTPUTS}/bash-{token} && echo b > /tmp/bash-{token} "
        "&& echo ok")
    assert bash.stdout == "ok\n", bash.stderr


# ---------------------------------------------------------------------------
# identity
# ---------------------------------------------------------------------------


async def test_runs_as_unprivileged_uid_inside_and_outside(sandbox):
    res = await probe_child(sandbox, """
        import os
        res["ids"] = [os.getuid(), os.geteuid(), os.getgid(), os.getegid()]
        res["groups"] = os.getgroups()
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        res["cap_eff"] = int(status["CapEff"].strip(), 16)
        res["cap_prm"] = int(status["CapPrm"].strip(), 16)
        res["cap_bnd"] = int(status["CapBnd"].strip(), 16)
        res["no_new_privs"] = status["NoNewPrivs"].strip()
        res["seccomp"] = status["Seccomp"].strip()
        res["uid_map"] = [list(map(int, l.split())) for l in open("/proc/self/uid_map")]
        res["gid_map"] = [list(map(int, l.split())) for l in open("/proc/self/gid_map")]
        for name, fn in (("setuid0", lambda: os.setuid(0)), ("setgid0", lambda: os.setgid(0)),
                         ("setresuid0", lambda: os.setresuid(0, 0, 0))):
            try:
                fn()
                res[name] = 0
            except OSError as exc:
                res[name] = exc.errno
        res["ids_after"] = [os.getuid(), os.geteuid()]
    """)
    assert 0 not in res["ids"], res["ids"]
    assert 0 not in res["groups"]
    assert res["cap_eff"] == res["cap_prm"] == res["cap_bnd"] == 0
    assert res["no_new_privs"] == "1"
    assert res["seccomp"] == "2"
    if res["uid_map"] != [[0, 0, 4294967295]]:
        # bwrap: a user namespace that maps the sandbox's own id only.
        for inside, _outside, count in res["uid_map"] + res["gid_map"]:
            assert not inside <= 0 < inside + count, f"id 0 is mapped: {res['uid_map']}"
    else:
        # zygote: the host's user namespace, where root exists but cannot be
        # reached: no capabilities (asserted above), no_new_privs (setuid bits
        # are ignored), and every mount but the device binds is nosuid.
        mounts = [line.split() for line in (await sandbox.run_bash("cat /proc/self/mountinfo")).stdout.splitlines()]
        for fields in mounts:
            point, options = fields[4], fields[5]
            if not point.startswith("/dev/") or point == "/dev/shm":
                assert "nosuid" in options.split(","), f"{point} is not nosuid: {options}"
    for name in ("setuid0", "setgid0", "setresuid0"):
        # EINVAL: id 0 does not exist in the sandbox's user namespace.
        assert res[name] in (errno.EPERM, errno.EINVAL), f"{name}: {res[name]}"
    assert 0 not in res["ids_after"]
    bash = await sandbox.run_bash("id -u; id -g")
    assert "0" not in bash.stdout.split()
    # Host side: every process of the sandbox runs as the sandbox's uid, never root.
    processes = _sandbox_host_processes(sandbox)
    assert len(processes) >= 2, processes  # at least bwrap and the agent
    for pid, status in processes.items():
        if not status:
            continue  # exited meanwhile
        uids = set(status["Uid"].split())
        gids = set(status["Gid"].split())
        assert uids == {str(sandbox.uid)}, f"host pid {pid} runs with uids {uids}"
        assert gids == {str(sandbox.uid)}, f"host pid {pid} runs with gids {gids}"
        assert int(status["CapEff"], 16) == 0, f"host pid {pid} holds capabilities"


async def test_concurrent_sandboxes_have_distinct_uids(pool, sandbox):
    other = await pool.lease()
    try:
        assert sandbox.uid != other.uid
        assert 0 not in (sandbox.uid, other.uid)
        ids = []
        for box in (sandbox, other):
            res = await probe(box, """
                import os
                res["uid"] = os.getuid()
            """)
            assert res["uid"] != 0
            ids.append(res["uid"])
        assert ids[0] != ids[1]
        for box in (sandbox, other):
            assert box.home.workspace.stat().st_uid == box.uid
            assert box.home.workspace.stat().st_mode & 0o077 == 0
    finally:
        await other.close()


# ---------------------------------------------------------------------------
# other sandboxes
# ---------------------------------------------------------------------------


async def test_cannot_see_another_sandboxes_files_or_processes(pool, sandbox):
    marker = f"shoalmarker{secrets.token_hex(10)}"
    own_marker = f"shoalown{secrets.token_hex(10)}"
    other = await pool.lease()
    try:
        # A: a marker file in its workspace, outputs and /tmp, and a live process
        # whose argv holds the marker.
        setup = await sandbox.run_bash(
            f"echo {marker} > {marker}.txt && echo {marker} > {OUTPUTS}/{marker}.out && "
            f"echo {marker} > /tmp/{marker}.tmp && echo {marker} > /dev/shm/{marker}.shm && "
            # Braces: a bare "&" would send the whole && chain to the background,
            # and the files above would race the checks below.
            f"{{ (exec -a {marker} sleep 300) > /dev/null 2>&1 & }} && echo started")
        assert setup.stdout == "started\n", setup.stderr
        assert (sandbox.home.workspace / f"{marker}.txt").exists()
        seen_in_a = await probe(sandbox, f"""
            import subprocess
            res["ps"] = {marker!r} in subprocess.run(["ps", "ax"], capture_output=True, text=True).stdout
        """)
        assert seen_in_a["ps"], "control: A must see its own marker process"

        # B: a marker of its own (control: the searches can find something).
        await other.run_bash(f"echo {own_marker} > {own_marker}.txt")
        res = await probe(other, f"""
            import os, subprocess
            marker, own = {marker!r}, {own_marker!r}
            def find(args):
                done = subprocess.run(["find", "/", *args], capture_output=True, text=True)
                return done.stdout
            xdev = find(["-xdev", "-name", marker + "*", "-print"])
            full = find(["-path", "/proc", "-prune", "-o", "-name", marker + "*", "-print"])
            res["found_xdev"] = xdev.split()
            res["found"] = full.split()
            res["control_found"] = find(["-path", "/proc", "-prune", "-o",
                                         "-name", own + "*", "-print"]).split()
            grep = subprocess.run(["grep", "-rl", "--", marker, "/home", "/mnt", "/tmp", "/dev/shm"],
                                  capture_output=True, text=True)
            res["grep_files"] = grep.stdout.split()
            ps = subprocess.run(["ps", "axww", "-o", "pid,args"], capture_output=True, text=True)
            res["ps_lines"] = [l for l in ps.stdout.splitlines() if marker in l]
            res["ps_count"] = len(ps.stdout.splitlines()) - 1
            hits, me = [], str(os.getpid())
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                for leaf in ("cmdline", "environ", "comm", "mountinfo", "maps"):
                    try:
                        with open(f"/proc/{{pid}}/{{leaf}}", "rb") as handle:
                            data = handle.read()
                    except OSError:
                        continue
                    if marker.encode() in data and not (pid == me and leaf == "maps"):
                        hits.append(f"{{pid}}/{{leaf}}")
            res["proc_hits"] = hits
            res["proc_pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        """, timeout=60)
        assert res["control_found"], "control: B's own marker must be found"
        assert res["found_xdev"] == [], res["found_xdev"]
        assert res["found"] == [], res["found"]
        assert res["grep_files"] == [], res["grep_files"]
        assert res["ps_lines"] == [], res["ps_lines"]
        assert res["proc_hits"] == [], res["proc_hits"]
        assert res["ps_count"] < 16, "B sees more processes than its own"
        # A's process is still there (it was not just gone when B looked).
        still = await probe(sandbox, f"""
            import subprocess
            res["ps"] = {marker!r} in subprocess.run(["ps", "ax"], capture_output=True, text=True).stdout
        """)
        assert still["ps"]
    finally:
        await other.close()


async def test_kill_all_in_one_sandbox_does_not_reach_another(pool, sandbox):
    marker = f"shoalkill{secrets.token_hex(8)}"
    other = await pool.lease()
    try:
        started = await sandbox.run_bash(
            f"(exec -a {marker} sleep 300) > /dev/null 2>&1 & echo started")
        assert started.stdout == "started\n"
        # B kills every process it can signal, its own agent included.
        killed = await other.run_bash("kill -KILL -1; kill -KILL -- -1; sleep 1")
        assert killed.restarted, "control: kill -1 in B must at least kill B's own agent"
        check = await probe(sandbox, f"""
            import subprocess
            res["alive"] = {marker!r} in subprocess.run(["ps", "ax"], capture_output=True, text=True).stdout
        """)
        assert check["alive"], "a process of sandbox A was killed from sandbox B"
        # B itself works again afterwards.
        again = await other.run_python("print(2 + 2)")
        assert again.stdout == "4\n", again.stderr
    finally:
        await other.close()


async def test_abstract_unix_sockets_are_private_to_a_sandbox(pool, sandbox):
    name = f"shoal-abstract-{secrets.token_hex(8)}"
    other = await pool.lease()
    try:
        listen = await sandbox.run_python(textwrap.dedent(f"""
            import socket
            _listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            _listener.bind("\\0{name}")
            _listener.listen(4)
            _listener.setblocking(False)
            print("listening")
        """))
        assert listen.stdout == "listening\n", listen.stderr
        res = await probe(other, f"""
            import socket
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect("\\0{name}")
                res["errno"] = 0
            except OSError as exc:
                res["errno"] = exc.errno
        """)
        assert res["errno"] == errno.ECONNREFUSED, res
        # Control: inside A the same name is reachable, so the check above can fail.
        own = await probe(sandbox, f"""
            import socket
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\\0{name}")
            res["connected"] = True
            try:
                _listener.accept()[0].close()
                res["b_connections"] = 0
                while True:
                    _listener.accept()[0].close()
                    res["b_connections"] += 1
            except BlockingIOError:
                pass
        """)
        assert own["connected"]
        assert own["b_connections"] == 0
    finally:
        await other.close()


async def test_a_per_user_kernel_limit_used_up_in_one_sandbox_is_still_anothers(pool, sandbox):
    """The kernel counts inotify instances (and watches, message queue bytes,
    queued signals) per user, charging a user namespace's processes to its
    owner too. A sandbox's namespace made by root charged every sandbox to host
    root's one count: sandbox A taking all of it stopped B, and the host."""
    other = await pool.lease()
    try:
        held = await probe(sandbox, """
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            _inotify = []
            while len(_inotify) < 4096:
                fd = libc.inotify_init()
                if fd < 0:
                    res["errno"] = ctypes.get_errno()
                    break
                _inotify.append(fd)
            res["held"] = len(_inotify)
        """)
        assert held.get("errno") == errno.EMFILE and held["held"] > 0, held
        res = await probe(other, """
            import ctypes, os
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init()
            res["errno"] = 0 if fd >= 0 else ctypes.get_errno()
            if fd >= 0:
                os.close(fd)
        """)
        assert res["errno"] == 0, f"sandbox B could not make an inotify instance: {res}"
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init()
        assert fd >= 0, f"host root could not make an inotify instance: errno {ctypes.get_errno()}"
        os.close(fd)
    finally:
        await other.close()


async def test_a_sandbox_holds_at_most_its_share_of_ptys(pool, sandbox):
    """Every devpts instance but the host's draws from one host-wide count: one
    sandbox opened 3,070 ptys and no other sandbox could open one. Each has 32,
    on both launchers (bubblewrap's --dev takes no limit: the host adds it)."""
    res = await probe(sandbox, """
        import os
        _ptys = []
        try:
            while len(_ptys) < 200:
                _ptys.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
        except OSError as exc:
            res["errno"] = exc.errno
        res["held"] = len(_ptys)
        for fd in _ptys:
            os.close(fd)
    """)
    assert res == {"errno": errno.ENOSPC, "held": 32}, res
    # Capped, its ptys still work (a remount resets every devpts option not
    # given again: bubblewrap's ptmxmode=666 lost, no one could open a pty).
    res = await probe(sandbox, """
        import os, pty
        pid, fd = pty.fork()
        if pid == 0:
            os.write(1, b"through the pty")
            os._exit(0)
        res["read"] = os.read(fd, 100).decode()
        res["mode"] = oct(os.stat("/dev/pts/ptmx").st_mode & 0o777)
        os.waitpid(pid, 0)
    """)
    assert res == {"read": "through the pty", "mode": "0o666"}, res


# ---------------------------------------------------------------------------
# dangerous syscalls
# ---------------------------------------------------------------------------

_LIBC = """
import ctypes, ctypes.util, errno, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L = ctypes.c_long
def err(rc):
    return ctypes.get_errno() if rc == -1 else 0
"""


async def test_ptrace_is_refused(sandbox):
    res = await probe_child(sandbox, """
        libc.ptrace.restype = ctypes.c_long
        # PTRACE_TRACEME in a forked child, so a success cannot disturb us.
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            rc = libc.ptrace(L(0), L(0), None, None)
            os.write(w, str(err(rc)).encode())
            os._exit(0)
        os.close(w)
        res["traceme"] = int(os.read(r, 32))
        os.waitpid(pid, 0)
        # PTRACE_ATTACH and PTRACE_SEIZE to our own child (same uid: allowed by plain DAC).
        child = subprocess.Popen(["sleep", "30"])
        rc = libc.ptrace(L(16), L(child.pid), None, None)
        res["attach"] = err(rc)
        if rc == 0:
            libc.ptrace(L(17), L(child.pid), None, None)
        rc = libc.ptrace(L(0x4206), L(child.pid), None, None)
        res["seize"] = err(rc)
        # process_vm_readv (x86_64 310 / aarch64 270) reads another process's memory.
        import platform
        nr = {"x86_64": 310, "aarch64": 270}.get(platform.machine())
        if nr is not None:
            buf = ctypes.create_string_buffer(8)
            class iovec(ctypes.Structure):
                _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
            local = iovec(ctypes.cast(buf, ctypes.c_void_p), 8)
            remote = iovec(ctypes.cast(buf, ctypes.c_void_p), 8)
            rc = libc.syscall(L(nr), L(child.pid), ctypes.byref(local), L(1),
                              ctypes.byref(remote), L(1), L(0))
            res["process_vm_readv"] = err(rc)
        child.kill()
        child.wait()
    """)
    for name, value in res.items():
        assert value == errno.EPERM, f"{name}: errno {value}"
    # The same through a real tracer: the sandbox sees the host's /usr, where make test
    # installs strace (runtime/test-packages.txt).
    strace = await sandbox.run_bash("command -v strace")
    assert strace.return_code == 0 and strace.stdout.strip(), \
        "strace is not installed: make test installs runtime/test-packages.txt"
    run = await sandbox.run_bash("strace -f true; echo rc=$?")
    assert run.stdout.endswith("rc=1\n"), run
    assert "Operation not permitted" in run.stderr, run.stderr


async def test_mount_is_refused(sandbox):
    res = await probe_child(sandbox, """
        os.makedirs("/tmp/x", exist_ok=True)
        before = open("/proc/self/mountinfo").read()
        res["mount_tmpfs"] = err(libc.mount(b"x", b"/tmp/x", b"tmpfs", L(0), None))
        MS_REMOUNT, MS_BIND, MS_RDONLY = 32, 4096, 1
        res["remount_root_rw"] = err(libc.mount(None, b"/", None, L(MS_REMOUNT), None))
        res["remount_usr_rw"] = err(libc.mount(None, b"/usr", None, L(MS_REMOUNT | MS_BIND), None))
        res["bind_proc"] = err(libc.mount(b"/proc", b"/tmp/x", None, L(MS_BIND), None))
        res["umount_usr"] = err(libc.umount2(b"/usr", 0))
        res["umount_workspace"] = err(libc.umount2(b"/home/agent/workspace", 2))  # MNT_DETACH
        res["chroot"] = err(libc.chroot(b"/tmp"))
        import platform
        if platform.machine() == "x86_64":
            res["fsopen"] = err(libc.syscall(L(430), b"tmpfs", L(0)))
            res["open_tree"] = err(libc.syscall(L(428), L(-100), b"/usr", L(1)))
        res["mounts_changed"] = open("/proc/self/mountinfo").read() != before
    """)
    assert res.pop("mounts_changed") is False
    for name, value in res.items():
        assert value == errno.EPERM, f"{name}: errno {value}"
    bash = await sandbox.run_bash(
        "mkdir -p /tmp/x && mount -t tmpfs x /tmp/x; echo rc=$?; "
        "grep -c ' /tmp/x ' /proc/self/mountinfo; true")
    assert "rc=0" not in bash.stdout
    assert bash.stdout.rstrip().endswith("0"), bash.stdout
    still_ro = await sandbox.run_bash("touch /usr/shoal-after-mount 2>/dev/null; echo rc=$?")
    assert still_ro.stdout == "rc=1\n"


async def test_new_namespaces_are_refused(sandbox):
    res = await probe_child(sandbox, """
        CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x20000, 0x10000000, 0x40000000, 0x20000000
        SIGCHLD = 17
        def in_child(fn):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.write(w, str(fn()).encode())
                finally:
                    os._exit(0)
            os.close(w)
            value = int(os.read(r, 32) or b"-1")
            os.waitpid(pid, 0)
            return value
        res["unshare_user"] = in_child(lambda: err(libc.unshare(CLONE_NEWUSER)))
        res["unshare_user_mnt"] = in_child(lambda: err(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS)))
        res["unshare_net"] = in_child(lambda: err(libc.unshare(CLONE_NEWNET)))
        res["unshare_mnt"] = in_child(lambda: err(libc.unshare(CLONE_NEWNS)))
        fd = os.open("/proc/1/ns/user", os.O_RDONLY)
        res["setns_user"] = in_child(lambda: err(libc.setns(fd, 0)))
        import platform
        clone_nr = {"x86_64": 56, "aarch64": 220}.get(platform.machine())
        if clone_nr is not None:
            def raw_clone():
                rc = libc.syscall(L(clone_nr), L(CLONE_NEWUSER | SIGCHLD), L(0), L(0), L(0), L(0))
                if rc == 0:
                    os._exit(0)  # we are a child in a new user namespace: the attack worked
                if rc > 0:
                    os.waitpid(rc, 0)
                    return 0
                return ctypes.get_errno()
            res["clone_newuser"] = in_child(raw_clone)
    """)
    for name, value in res.items():
        assert value == errno.EPERM, f"{name}: errno {value}"
    bash = await sandbox.run_bash(
        "unshare -U true; echo rc=$?; unshare -r id -u; echo rc=$?; "
        "unshare -n true; echo rc=$?")
    codes = [line for line in bash.stdout.split() if line.startswith("rc=")]
    assert codes and all(code != "rc=0" for code in codes), bash.stdout + bash.stderr
    assert "\n0\n" not in "\n" + bash.stdout


@pytest.mark.skipif(platform.machine() != "x86_64",
                    reason=f"syscall numbers are x86_64's (this is {platform.machine()})")
async def test_keyctl_bpf_io_uring_perf_are_refused(sandbox):
    res = await probe_child(sandbox, """
        KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING = 0, -3
        attr = ctypes.create_string_buffer(256)
        params = ctypes.create_string_buffer(256)
        res["keyctl"] = err(libc.syscall(L(250), L(KEYCTL_GET_KEYRING_ID),
                                         L(KEY_SPEC_SESSION_KEYRING), L(1)))
        res["add_key"] = err(libc.syscall(L(248), b"user", b"shoal", b"x", L(1), L(-3)))
        res["bpf"] = err(libc.syscall(L(321), L(0), attr, L(72)))  # BPF_MAP_CREATE
        res["io_uring_setup"] = err(libc.syscall(L(425), L(4), params))
        res["perf_event_open"] = err(libc.syscall(L(298), attr, L(0), L(-1), L(-1), L(0)))
        res["userfaultfd"] = err(libc.syscall(L(323), L(0)))
        # The new mount API's newest call (Linux 6.15): refused on any kernel.
        res["open_tree_attr"] = err(libc.syscall(L(467), L(-100), b"/", L(0), None, L(0)))
    """)
    for name, value in res.items():
        assert value == errno.EPERM, f"{name}: errno {value}"


async def test_linux_aio_is_absent(sandbox):
    # Linux AIO draws on a host-wide count: one io_setup(65536) took all of it.
    # ENOSYS, as on a kernel without it, so that its users fall back to threads.
    res = await probe_child(sandbox, """
        context = ctypes.c_ulong(0)
        res["io_setup"] = err(libc.syscall(L(206), L(65536), ctypes.byref(context)))
        res["io_submit"] = err(libc.syscall(L(209), L(0), L(0), L(0)))
        res["io_getevents"] = err(libc.syscall(L(208), L(0), L(0), L(0), None, None))
    """)
    assert res == {"io_setup": errno.ENOSYS, "io_submit": errno.ENOSYS,
                   "io_getevents": errno.ENOSYS}, res


# ---------------------------------------------------------------------------
# pools
# ---------------------------------------------------------------------------


async def test_a_second_pool_does_not_destroy_the_first_pools_sandboxes(settings):
    run_dir = settings.run_dir / f"twopools-{secrets.token_hex(4)}"
    top = settings.uid_base + settings.uid_count
    common = dict(data_dir=settings.data_dir, run_dir=run_dir, pool_size=1,
                  preload_modules="", memory_limit_mib=settings.memory_limit_mib,
                  pids_limit=settings.pids_limit, uid_count=8)
    # Both pools share one uid range: leases are host-wide, never duplicated.
    first = SandboxPool(Settings(uid_base=top - 32, **common))
    await first.start()
    try:
        box = await first.lease()
        written = await box.run_bash("echo kept > kept.txt && cat kept.txt")
        assert written.stdout == "kept\n"
        second = SandboxPool(Settings(uid_base=top - 32, **common))
        await second.start()
        other = await second.lease()
        assert other.uid != box.uid
        await other.close()
        await second.close()
        # The first pool's live sandbox still has its files ...
        assert (box.home.workspace / "kept.txt").exists(), "workspace deleted on the host"
        read = await box.run_bash("cat kept.txt")
        assert read.stdout == "kept\n", read.stderr
        await box.close()
        # ... and the first pool can still start sandboxes.
        fresh = await asyncio.wait_for(first.lease(), 30)
        await asyncio.sleep(0.5)
        again = await asyncio.wait_for(first.lease(), 30)
        try:
            assert (await again.run_python("print(1)")).stdout == "1\n"
        finally:
            await fresh.close()
            await again.close()
    finally:
        await first.close()
        shutil.rmtree(run_dir, ignore_errors=True)
