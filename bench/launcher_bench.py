"""The launcher's figures over HTTP, in one run: prints them, asserts nothing.

    .venv/bin/python bench/launcher_bench.py [--launcher zygote|bwrap] [--density 1000]

Starts a real ``shoal serve`` and drives it with a raw keep-alive client
(bench/http_bench.py's), printing each latency as a ratio to ``/health`` p50
measured in the same run:

- create session p50/p99, with a warm sandbox waiting (the steady state);
- first exec in a fresh session, and a trivial exec (``x = 1``) p50/p99, with
  the CPU each trivial exec costs the server and the sandbox, beside the
  server's CPU per ``/health`` (what is left of the wall is wake-ups);
- ``import pandas`` plus a saved matplotlib figure in a fresh session, and the
  same chart again in that session (the fresh one's extra is the fork's
  copy-on-write faults; what both pay is the libraries' own cost);
- 32 concurrent creates, each followed by its first exec: p50, p99 and wall,
  on the pool at its size, then again once the first burst has grown it;
- idle PSS per session with pandas imported (from /proc/<pid>/smaps_rollup of
  every process of the sessions' uids);
- with ``--density N``: N idle sessions opened and held, with the machine's
  memory, the server's RSS and fds printed as they are reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.http_bench import Connection  # noqa: E402
from tests.uid_slots import uid  # noqa: E402
from tests.serving import start_server  # noqa: E402

UID_BASE = 950_000


def exec_body(code: str) -> bytes:
    return json.dumps({"tool": "code_execution", "input": {"code": code}}).encode()


def p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def line(name: str, samples_ms: list[float], health: float) -> None:
    p50 = statistics.median(samples_ms)
    print(f"{name:<44} p50 {p50:8.2f} ms ({p50 / health:5.1f}x)   p99 {p(samples_ms, 0.99):8.2f} ms"
          f"   (n={len(samples_ms)})", flush=True)


def mem_available() -> int:
    for row in Path("/proc/meminfo").read_text().splitlines():
        if row.startswith("MemAvailable:"):
            return int(row.split()[1]) * 1024
    return 0


def zygote_pss(server_pid: int) -> int:
    zygote = server_zygote(server_pid)
    return pss_of_pid(zygote) if zygote else 0


def pss_of_pid(pid: int) -> int:
    for row in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if row.startswith("Pss:"):
            return int(row.split()[1]) * 1024
    return 0


def server_zygote(server_pid: int) -> int:
    """The zygote: the server's child that runs shoal_agent.zygote (0 with bwrap)."""
    try:
        children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    except OSError:
        return 0
    for child in children:
        try:
            if b"shoal_agent.zygote" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
        except OSError:
            continue
    return 0


def pss_of_uids(uids) -> tuple[int, int]:
    """(total PSS in bytes, processes) of every process running as one of ``uids``."""
    total = count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
            uid = int(status.split("\nUid:\t", 1)[1].split()[0])
            if uid not in uids:
                continue
            for row in Path(f"/proc/{name}/smaps_rollup").read_text().splitlines():
                if row.startswith("Pss:"):
                    total += int(row.split()[1]) * 1024
                    count += 1
        except (OSError, IndexError, ValueError):
            continue
    return total, count


def cpu_seconds(pids) -> float:
    """User and system CPU time of these processes (threads included), in seconds."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def pids_of_uid(uid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{name}/status").read_text() if name.isdigit() else ""
            if status and int(status.split("\nUid:\t", 1)[1].split()[0]) == uid:
                found.append(int(name))
        except (OSError, IndexError, ValueError):
            continue
    return found


async def cpu_per_request(connection: Connection, method: str, path: str, body: bytes,
                          server: int, sandbox: list[int], n: int) -> tuple[float, float]:
    """CPU microseconds per request, (the server's, the sandbox's), over ``n`` in a row."""
    before = cpu_seconds([server]), cpu_seconds(sandbox)
    for _ in range(n):
        await connection.request(method, path, body)
    return ((cpu_seconds([server]) - before[0]) / n * 1e6,
            (cpu_seconds(sandbox) - before[1]) / n * 1e6)


async def timed(connection: Connection, method: str, path: str, body: bytes = b"") -> tuple[float, bytes]:
    started = time.perf_counter()
    status, answer = await connection.request(method, path, body)
    if status >= 300:
        raise RuntimeError(f"{method} {path}: {status} {answer[:300]!r}")
    return (time.perf_counter() - started) * 1000, answer


async def wait_warm(connection: Connection, size: int) -> None:
    while True:
        _, body = await connection.request("GET", "/health")
        if json.loads(body).get("pool_ready", 0) >= size:
            return
        await asyncio.sleep(0.05)


async def figures(port: int, pool_size: int, pid: int) -> None:
    control = await Connection.open(port)
    await wait_warm(control, pool_size)
    for _ in range(200):
        await control.request("GET", "/health")
    health = [(await timed(control, "GET", "/health"))[0] for _ in range(2000)]
    h50 = statistics.median(health)
    print(f"{'/health':<44} p50 {h50:8.2f} ms   p99 {p(health, 0.99):8.2f} ms", flush=True)

    creates, firsts, sessions = [], [], []
    for _ in range(30):
        await wait_warm(control, 1)
        ms, body = await timed(control, "POST", "/sessions", b"{}")
        creates.append(ms)
        session = json.loads(body)["session_id"]
        ms, _ = await timed(control, "POST", f"/sessions/{session}/exec", exec_body("x = 1"))
        firsts.append(ms)
        sessions.append(session)
    line("create session (a warm sandbox waiting)", creates, h50)
    line("first exec in a fresh session", firsts, h50)
    for _ in range(200):
        await control.request("POST", f"/sessions/{sessions[0]}/exec", exec_body("x = 1"))
    trivial = [(await timed(control, "POST", f"/sessions/{sessions[0]}/exec", exec_body("x = 1")))[0]
               for _ in range(2000)]
    line("trivial exec (x = 1)", trivial, h50)
    # Where it goes: CPU per call of the server and of the session's processes,
    # beside the server's for /health (the rest of the wall is wake-ups).
    _, body = await timed(control, "POST", f"/sessions/{sessions[0]}/exec",
                          exec_body("import os\nprint(os.getuid())"))
    sandbox = pids_of_uid(int(json.loads(body)["result_block"]["content"]["stdout"]))
    exec_cpu = await cpu_per_request(control, "POST", f"/sessions/{sessions[0]}/exec",
                                     exec_body("x = 1"), pid, sandbox, 3000)
    health_cpu = await cpu_per_request(control, "GET", "/health", b"", pid, [], 3000)
    print(f"{'  CPU per trivial exec: server / sandbox':<44} {exec_cpu[0]:6.0f} / {exec_cpu[1]:.0f} us"
          f"   (/health: server {health_cpu[0]:.0f} us)", flush=True)
    chart = ("import pandas as pd\nimport matplotlib.pyplot as plt\n"
             "pd.DataFrame({'a': [1, 2, 3]}).plot()\nplt.savefig('/mnt/user-data/outputs/c.png')\n"
             "plt.close('all')")
    first_chart = []
    for session in sessions[1:11]:
        ms, _ = await timed(control, "POST", f"/sessions/{session}/exec", exec_body(chart))
        first_chart.append(ms)
    line("import pandas + a saved figure, fresh session", first_chart, h50)
    # For scale: the same chart again in those sessions, its copy-on-write
    # faults paid (what is left is matplotlib's and pandas' own cost here).
    again = [(await timed(control, "POST", f"/sessions/{session}/exec", exec_body(chart)))[0]
             for session in sessions[1:11]]
    line("  the same chart again, same session", again, h50)
    uids = {}
    for session in sessions:
        _, body = await timed(control, "POST", f"/sessions/{session}/exec",
                              exec_body("import pandas, os\nprint(os.getuid())"))
        uids[session] = int(json.loads(body)["result_block"]["content"]["stdout"])
    await asyncio.sleep(1)
    idle = [pss_of_uids({uids[s]}) for s in sessions[11:]]
    charted = [pss_of_uids({uids[s]}) for s in sessions[1:11]]
    everything, processes = pss_of_uids(range(uid(UID_BASE), uid(UID_BASE) + 4096))
    live = len(sessions) + pool_size
    for label, found in (("idle PSS per session, pandas imported", idle),
                         ("  a session that drew a chart, for scale", charted)):
        print(f"{label:<44} {statistics.median(t for t, _ in found) / 2**20:8.2f} MiB"
              f"   (median of {len(found)}; {found[0][1]} processes each)", flush=True)
    print(f"{'  every sandbox process, per live sandbox':<44} {everything / live / 2**20:8.2f} MiB"
          f"   ({processes} processes, {live} sandboxes incl. the warm pool; "
          f"the zygote's own PSS {zygote_pss(pid) / 2**20:.1f} MiB is shared by all)", flush=True)
    for session in sessions:
        await control.request("DELETE", f"/sessions/{session}")

    await wait_warm(control, pool_size)
    connections = [await Connection.open(port) for _ in range(32)]

    async def create_and_exec(connection: Connection) -> tuple[float, float, str]:
        started = time.perf_counter()
        _, body = await timed(connection, "POST", "/sessions", b"{}")
        session = json.loads(body)["session_id"]
        await timed(connection, "POST", f"/sessions/{session}/exec", exec_body("print(1)"))
        finished = time.perf_counter()
        return (finished - started) * 1000, finished, session

    # The first burst finds the pool at its size and starts the rest on demand; the
    # pool grows for the next (pool_max), which the second burst, 10 s on, finds.
    for label in ("32 concurrent creates + first exec", "  again, 10 s on (the pool grown)"):
        started = time.perf_counter()
        burst = await asyncio.gather(*(create_and_exec(c) for c in connections))
        # Until the last first exec answered; the releases come after.
        wall = (max(finished for _, finished, _ in burst) - started) * 1000
        line(label, [elapsed for elapsed, _, _ in burst], h50)
        print(f"{'  wall for all 32':<44} {wall:8.1f} ms", flush=True)
        for connection, (_, _, session) in zip(connections, burst):
            await connection.request("DELETE", f"/sessions/{session}")
        await asyncio.sleep(10)
    for connection in (*connections, control):
        connection.close()


async def density(port: int, count: int, pid: int) -> None:
    control = await Connection.open(port)
    before = mem_available()
    started = time.perf_counter()
    sessions = []
    for number in range(1, count + 1):
        _, body = await timed(control, "POST", "/sessions", b"{}")
        session = json.loads(body)["session_id"]
        await timed(control, "POST", f"/sessions/{session}/exec", exec_body("import pandas"))
        sessions.append(session)
        if number % 100 == 0 or number == count:
            used = (before - mem_available()) / 2**30
            rss = int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024
            fds = len(os.listdir(f"/proc/{pid}/fd"))
            print(f"{number:5d} idle sessions held: machine memory used {used:6.2f} GiB "
                  f"({used * 1024 / number:5.2f} MiB each), server RSS {rss:6.1f} MiB, "
                  f"server fds {fds}, {time.perf_counter() - started:6.1f} s", flush=True)
    total, processes = pss_of_uids(range(uid(UID_BASE), uid(UID_BASE) + count + 64))
    print(f"{'PSS of every sandbox process':<44} {total / 2**30:6.2f} GiB "
          f"({total / count / 2**20:.2f} MiB per session, {processes} processes)", flush=True)
    for session in sessions:
        await control.request("DELETE", f"/sessions/{session}")
    control.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launcher", default="zygote")
    parser.add_argument("--pool-size", type=int, default=4)
    parser.add_argument("--density", type=int, default=0,
                        help="also open and hold this many idle sessions")
    args = parser.parse_args()
    settings = {"launcher": args.launcher, "pool_size": args.pool_size, "max_sessions": 64,
                "uid_count": 4096}
    if args.density:
        settings.update(max_sessions=args.density + 16, disk_limit_mib=32, uid_count=args.density + 64,
                        memory_limit_mib=256, tmp_size_mib=16, pool_size=4)
    with tempfile.TemporaryDirectory() as scratch:
        server = start_server(Path(scratch), uid_base=UID_BASE, **settings)
        try:
            port = int(server.url.rsplit(":", 1)[1])
            if args.density:
                asyncio.run(density(port, args.density, server.process.pid))
            else:
                asyncio.run(figures(port, args.pool_size, server.process.pid))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
