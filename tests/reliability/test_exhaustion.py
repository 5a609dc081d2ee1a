"""Resource exhaustion through the HTTP API, while the server is watched from outside.

Each attack runs in one session of a real server; meanwhile a thread probes the
server: ``GET /health`` and a trivial exec in another session must answer
correctly every time, for as long as the attack runs, and within a generous bound
relative to what they took just before the attack (``conftest.Responsiveness``;
the latency figures themselves are bench/ material, not assertions). Each test then
checks that the attack was contained (stopped at the sandbox's own limit, the
host and other sessions untouched), that the limit that fired is reported in
the exec response's ``limits``, and that the attacked session is usable again.

(The sandbox-level behaviour of the same limits, without HTTP, is in
tests/sandbox/test_limits.py; these tests are about the server as a whole.)
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .conftest import (Responsiveness, bash, create_session, processes_in, python,
                       sandbox_uid, wait_for_no_processes)

MiB = 1024 * 1024
PIDS_LIMIT = 128
DISK_LIMIT_MIB = 64
OUTPUT_CAP = 1024 * 1024
CPU_LIMIT = 1.0


@pytest.fixture(scope="module")
def server(shoal):
    return shoal(pool_size=2, max_sessions=16, memory_limit_mib=512, pids_limit=PIDS_LIMIT,
                 disk_limit_mib=DISK_LIMIT_MIB, cpu_limit=CPU_LIMIT, max_timeout_seconds=60)


@pytest.fixture(scope="module")
def http(server):
    with server.client(timeout=120) as client:
        yield client


@pytest.fixture
def victim(http):
    session_id = create_session(http)
    yield session_id
    http.delete(f"/sessions/{session_id}")


def _server_stats(server) -> dict[str, int]:
    """RSS (bytes), open fds and threads of the server process, from /proc."""
    status = dict(line.split(":", 1) for line in
                  open(f"/proc/{server.pid}/status").read().splitlines() if ":" in line)
    return {"rss": int(status["VmRSS"].split()[0]) * 1024,
            "fds": len(os.listdir(f"/proc/{server.pid}/fd")),
            "threads": int(status["Threads"])}


def _assert_usable(http, session_id: str) -> None:
    after = python(http, session_id, "print('still here')")
    assert after["content"]["stdout"] == "still here\n", after
    assert after["limits"] == [] and after["interpreter_restarted"] is False, after
    shell = bash(http, session_id, "echo ok")
    assert shell["content"]["stdout"] == "ok\n", shell


# -- memory -----------------------------------------------------------------------------------------
def test_memory_hog_is_killed_and_reported(server, http, victim):
    python(http, victim, "before = 'state from before'")
    with Responsiveness(server) as probe:
        result = python(http, victim, (
            "import time\n"
            "time.sleep(1)\n"  # the probe is running for sure before the hog
            "b = bytearray(2 * 1024 ** 3)\n"
            "print('survived', len(b))"), timeout=60)
    print(f"\nmemory: {probe.summary()}")
    probe.check()
    content = result["content"]
    assert "survived" not in content["stdout"]
    assert content["return_code"] != 0
    assert "memory" in result["limits"], result
    assert "memory" in content["stderr"], content["stderr"]
    assert result["interpreter_restarted"] is True
    gone = python(http, victim, "print('before' in globals())")
    assert gone["content"]["stdout"] == "False\n", gone
    _assert_usable(http, victim)


# -- processes ------------------------------------------------------------------------------------------
class _ProcessSampler:
    """Counts the host processes of one sandbox uid from a thread; keeps the peak."""

    def __init__(self, uid: int) -> None:
        self.uid = uid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, len(processes_in({self.uid})))
            self._stop.wait(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()


def test_bash_fork_bomb_is_capped_and_reported(server, http, victim):
    uid = sandbox_uid(http, victim)
    with Responsiveness(server) as probe, _ProcessSampler(uid) as sampler:
        result = bash(http, victim, ":(){ :|:& };:; sleep 8", timeout=4)
    print(f"\nfork bomb: peak {sampler.peak} processes; {probe.summary()}")
    probe.check()
    assert result["content"]["return_code"] != 0
    assert "pids" in result["limits"], result["limits"]
    # The bomb grew to the cap and no further: every process of the sandbox (the
    # outer bubblewrap included) is in its pids cgroup.
    assert PIDS_LIMIT // 2 <= sampler.peak <= PIDS_LIMIT, sampler.peak
    _assert_usable(http, victim)


def test_a_bomb_left_running_after_its_call_is_contained_and_dies_with_the_session(
        server, http):
    """``:(){ :|:& };:`` returns at once and leaves the bomb running in the
    background, holding its sandbox at the cap; the server does not notice, and
    releasing the session ends every process of it."""
    session_id = create_session(http)
    uid = sandbox_uid(http, session_id)
    with Responsiveness(server) as probe, _ProcessSampler(uid) as sampler:
        started = bash(http, session_id, ":(){ :|:& };:")
        assert started["content"]["return_code"] == 0, started  # its stderr says why, if not
        time.sleep(4)  # the bomb runs unattended meanwhile
    print(f"\ndetached fork bomb: peak {sampler.peak} processes; {probe.summary()}")
    probe.check()
    assert PIDS_LIMIT // 2 <= sampler.peak <= PIDS_LIMIT, sampler.peak
    assert http.delete(f"/sessions/{session_id}").status_code == 204
    assert wait_for_no_processes({uid}) == []


def _sandbox_settles(uid: int, at_most: int = 3, timeout: float = 30.0) -> list[dict]:
    """Wait until a sandbox runs no more than its own processes (outer bwrap, its
    init, the agent); returns what still runs beyond that."""
    deadline = time.monotonic() + timeout
    while True:
        running = [p for p in processes_in({uid}) if p["state"] != "Z"]
        if len(running) <= at_most or time.monotonic() > deadline:
            return running if len(running) > at_most else []
        time.sleep(0.1)


def test_python_fork_bomb_is_capped_and_reported(server, http, victim):
    uid = sandbox_uid(http, victim)
    started = time.monotonic()
    with Responsiveness(server) as probe, _ProcessSampler(uid) as sampler:
        response = http.post(f"/sessions/{victim}/exec", json={
            "tool": "code_execution", "timeout_seconds": 5,
            "input": {"code": "import os\nwhile True:\n    os.fork()"}})
    elapsed = time.monotonic() - started
    print(f"\npython fork bomb: {response.status_code} after {elapsed:.1f}s, peak "
          f"{sampler.peak} processes; {probe.summary()}")
    probe.check()
    assert sampler.peak <= PIDS_LIMIT, sampler.peak
    assert response.status_code == 200, response.text[:500]
    result = response.json()
    assert result["result_block"]["content"]["return_code"] != 0
    assert {"pids", "memory"} & set(result["limits"]), result["limits"]
    left = _sandbox_settles(uid)
    assert not left, f"{len(left)} processes of the bomb outlived its call"
    _assert_usable(http, victim)


def test_python_fork_bomb_under_a_small_cpu_quota_is_not_a_500(shoal):
    starved = shoal(pool_size=1, memory_limit_mib=1024, pids_limit=256, cpu_limit=0.1)
    with starved.client() as http:
        session_id = create_session(http)
        # A spinner at a tenth of a core: any machine gives it more than that,
        # so the quota must throttle it, however busy the machine is.
        uid = sandbox_uid(http, session_id)
        throttled_before = _cpu_stat_of(uid)["nr_throttled"]
        spun = python(http, session_id, "import time\nend = time.monotonic() + 1\n"
                                        "while time.monotonic() < end: pass\nprint('spun')")
        assert spun["content"]["stdout"] == "spun\n", spun
        assert _cpu_stat_of(uid)["nr_throttled"] > throttled_before
        started = time.monotonic()
        response = http.post(f"/sessions/{session_id}/exec", json={
            "tool": "code_execution", "timeout_seconds": 3,
            "input": {"code": "import os\nwhile True:\n    os.fork()"}})
        print(f"\npython fork bomb at 0.1 core: {response.status_code} after "
              f"{time.monotonic() - started:.1f}s")
    with starved.client() as http:
        assert response.status_code == 200, response.text[:300]
        result = response.json()
        assert result["result_block"]["content"]["return_code"] != 0
        # At a tenth of a core the bomb may or may not reach pids.max in 3 s:
        # the timeout is what must be reported; pids as well when it fired.
        assert "timeout" in result["limits"], result["limits"]
        after = python(http, session_id, "print(1)")
        assert after["content"]["stdout"] == "1\n", after
        http.delete(f"/sessions/{session_id}")


# -- CPU ----------------------------------------------------------------------------------------------
def _cpu_stat_of(uid: int) -> dict[str, int]:
    """``cpu.stat`` of the sandbox's cpu cgroup (v1 cpu controller, or v2)."""
    for proc in processes_in({uid}):
        paths = {}
        try:
            for line in open(f"/proc/{proc['pid']}/cgroup").read().splitlines():
                _, controllers, path = line.split(":", 2)
                for controller in controllers.split(",") if controllers else ["unified"]:
                    paths[controller] = path.lstrip("/")
        except OSError:
            continue
        candidates = [Path("/sys/fs/cgroup/cpu") / paths.get("cpu", "-"),
                      Path("/sys/fs/cgroup/cpu,cpuacct") / paths.get("cpu", "-"),
                      Path("/sys/fs/cgroup") / paths.get("unified", "-")]
        for directory in candidates:
            try:
                return {k: int(v) for k, v in (line.split() for line in
                                               open(directory / "cpu.stat"))}
            except (OSError, ValueError):
                continue
    raise AssertionError(f"no cpu cgroup found for uid {uid}")


def _cpu_seconds(uid: int) -> float:
    ticks = 0
    for proc in processes_in({uid}):
        try:
            fields = open(f"/proc/{proc['pid']}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def test_cpu_spinners_get_one_core_and_time_out(server, http, victim):
    uid = sandbox_uid(http, victim)
    throttled_before = _cpu_stat_of(uid)["nr_throttled"]
    rates = []

    def measure() -> None:
        time.sleep(1.5)  # the four spinners are up
        # Each reading is bracketed by the clock and the rate divides by the widest
        # window it may span: a delay of this thread (a busy machine) can only lower
        # the figure, never push it over the quota.
        window_opens = time.monotonic()
        first = _cpu_seconds(uid)
        time.sleep(2)
        second = _cpu_seconds(uid)
        rates.append((second - first) / (time.monotonic() - window_opens))

    meter = threading.Thread(target=measure)
    with Responsiveness(server) as probe:
        meter.start()
        result = bash(http, victim, "for i in 1 2 3 4; do (while :; do :; done) & done; wait",
                      timeout=5)
        meter.join()
    print(f"\ncpu: 4 spinners used {rates[0]:.2f} cores; {probe.summary()}")
    probe.check()
    assert result["content"]["return_code"] == 124
    assert result["limits"] == ["timeout"], result["limits"]
    assert result["content"]["stderr"].endswith("Command timed out after 5s.")
    assert rates[0] <= CPU_LIMIT * 1.25, f"the sandbox used {rates[0]:.2f} cores"
    # Four spinners want four cores: wherever the sandbox got as much as its
    # quota, the quota is what held it (throttled). On a machine too busy to
    # give it that much, the rate alone shows the cap; the spinning test at a
    # tenth of a core below shows throttling whatever the load.
    if rates[0] >= CPU_LIMIT * 0.9:
        assert _cpu_stat_of(uid)["nr_throttled"] > throttled_before
    _assert_usable(http, victim)
    # The spinners were stopped with the call.
    assert python(http, victim, "import os\nprint(len([p for p in os.listdir('/proc') "
                                "if p.isdigit()]))")["content"]["stdout"].strip() in ("2", "3")


# -- disk and inodes -----------------------------------------------------------------------------------
def _free_bytes(path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def _free_inodes(path) -> int:
    return os.statvfs(path).f_favail


def test_disk_fill_stops_at_the_quota(server, http, victim):
    free_before = _free_bytes(server.run_dir)
    with Responsiveness(server) as probe:
        result = bash(http, victim, "sleep 1; head -c 200000000 /dev/zero > big; echo exit=$?",
                      timeout=60)
    print(f"\ndisk: {probe.summary()}")
    probe.check()
    content = result["content"]
    assert "No space left on device" in content["stderr"], content
    assert content["stdout"] == "exit=1\n"
    size = int(bash(http, victim, "stat -c %s big")["content"]["stdout"])
    assert 0 < size <= DISK_LIMIT_MIB * MiB
    # The host paid for the quota at most.
    assert free_before - _free_bytes(server.run_dir) < (DISK_LIMIT_MIB + 32) * MiB
    # Another session writes as usual meanwhile.
    neighbour = create_session(http)
    try:
        wrote = bash(http, neighbour, "head -c 1000000 /dev/zero > f && stat -c %s f")
        assert wrote["content"]["stdout"] == "1000000\n", wrote
    finally:
        http.delete(f"/sessions/{neighbour}")
    freed = bash(http, victim, "rm big && echo x > small && cat small")
    assert freed["content"]["stdout"] == "x\n", freed
    _assert_usable(http, victim)


_MAKE_FILES = """
import os
os.makedirs('many', exist_ok=True)
made = 0
try:
    while True:
        open(f'many/{made}', 'w').close()
        made += 1
except OSError as exc:
    print(made, exc.errno)
"""


def test_inode_exhaustion_stops_at_the_quota(server, http, victim):
    host_inodes_before = _free_inodes(server.run_dir)
    with Responsiveness(server) as probe:
        result = python(http, victim, _MAKE_FILES, timeout=60)
    print(f"\ninodes: {result['content']['stdout'].strip()} (files, errno); {probe.summary()}")
    probe.check()
    made, errno = map(int, result["content"]["stdout"].split())
    assert errno == 28  # ENOSPC: the volume's inodes ran out, not the host's
    assert 1000 < made < 200_000, made
    assert host_inodes_before - _free_inodes(server.run_dir) < 1000
    df = bash(http, victim, "df --output=iavail . | tail -1")
    assert df["content"]["stdout"].strip() == "0", df
    neighbour = create_session(http)
    try:
        made_there = bash(http, neighbour, "touch a b c && ls | wc -l")
        assert made_there["content"]["stdout"] == "3\n", made_there
    finally:
        http.delete(f"/sessions/{neighbour}")
    cleaned = bash(http, victim, "rm -rf many && touch again && ls", timeout=60)
    assert cleaned["content"]["stdout"] == "again\n", cleaned
    _assert_usable(http, victim)


@pytest.mark.parametrize("attack", ["bytes", "inodes"])
def test_a_full_disk_is_reported_as_the_disk_limit(http, victim, attack):
    if attack == "bytes":
        result = bash(http, victim, "head -c 200000000 /dev/zero > big", timeout=60)
    else:
        result = python(http, victim, _MAKE_FILES + "raise SystemExit(1)", timeout=60)
    assert result["content"]["return_code"] != 0
    assert "disk" in result["limits"], result["limits"]


# -- open files ------------------------------------------------------------------------------------
def test_open_files_stop_at_the_rlimit(server, http, victim):
    fds_before = _server_stats(server)["fds"]
    with Responsiveness(server) as probe:
        result = python(http, victim, (
            "import time\n"
            "held = []\n"
            "try:\n"
            "    while True:\n"
            "        held.append(open('/dev/null'))\n"
            "except OSError as exc:\n"
            "    print(len(held), exc.errno)\n"
            "time.sleep(1)"))
        # While the interpreter holds every fd it may have, a shell cannot even
        # be started: the call says so, it does not fail the request.
        starved = bash(http, victim, "echo hi")
    print(f"\nopen files: {result['content']['stdout'].strip()} (held, errno); {probe.summary()}")
    probe.check()
    held, errno = map(int, result["content"]["stdout"].split())
    assert errno == 24  # EMFILE
    assert 1000 < held <= 4096
    # The agent cannot create the pipe it starts bash with: 127, and why.
    assert starved["content"]["return_code"] == 127, starved
    assert starved["content"]["stdout"] == "", starved
    assert "could not start /bin/bash" in starved["content"]["stderr"], starved
    assert "Too many open files" in starved["content"]["stderr"], starved
    assert starved["limits"] == [] and starved["interpreter_restarted"] is False, starved
    # The sandbox's fds are its own: the server's table did not fill.
    assert abs(_server_stats(server)["fds"] - fds_before) < 10
    freed = python(http, victim, "for f in held:\n    f.close()\ndel held\nprint('freed')")
    assert freed["content"]["stdout"] == "freed\n", freed
    _assert_usable(http, victim)


# -- output ------------------------------------------------------------------------------------------
def test_endless_output_is_capped(server, http, victim):
    rss_before = _server_stats(server)["rss"]
    with Responsiveness(server) as probe:
        started = time.monotonic()
        response = http.post(f"/sessions/{victim}/exec", json={
            "tool": "bash_code_execution", "input": {"command": "timeout 5 yes; true"}})
        elapsed = time.monotonic() - started
    rss_after = _server_stats(server)["rss"]
    print(f"\noutput: {len(response.content)} bytes in {elapsed:.1f}s, server RSS "
          f"{rss_before / MiB:.0f} -> {rss_after / MiB:.0f} MiB; {probe.summary()}")
    probe.check()
    assert response.status_code == 200
    result = response.json()
    content = result["result_block"]["content"]
    assert result["limits"] == ["output"], result["limits"]
    assert content["return_code"] == 0
    assert content["stdout"].startswith("y\ny\n")
    assert content["stdout"].endswith("...[truncated]")
    assert OUTPUT_CAP <= len(content["stdout"]) <= OUTPUT_CAP + 64
    assert len(response.content) < 2 * OUTPUT_CAP + 64 * 1024  # JSON escapes each "\\n"
    assert rss_after - rss_before < 50 * MiB
    _assert_usable(http, victim)


# -- a flood of tiny execs ------------------------------------------------------------------------------
def test_a_flood_of_tiny_execs(server, http, victim):
    stats_before = _server_stats(server)
    latencies = []
    with Responsiveness(server) as probe:
        started = time.monotonic()
        for i in range(500):
            began = time.monotonic()
            if i % 5 == 4:
                result = bash(http, victim, f"echo {i}")
            else:
                result = python(http, victim, f"print({i})")
            latencies.append(time.monotonic() - began)
            assert result["content"]["stdout"] == f"{i}\n", (i, result)
            assert result["content"]["return_code"] == 0 and result["limits"] == []
        elapsed = time.monotonic() - started
    stats_after = _server_stats(server)
    latencies.sort()
    print(f"\nflood: 500 execs in {elapsed:.1f}s ({500 / elapsed:.0f}/s), p50 "
          f"{statistics.median(latencies) * 1000:.1f} ms, p99 {latencies[494] * 1000:.1f} ms, "
          f"max {latencies[-1] * 1000:.1f} ms; server fds {stats_before['fds']} -> "
          f"{stats_after['fds']}, threads {stats_before['threads']} -> {stats_after['threads']}; "
          f"{probe.summary()}")
    probe.check()
    assert stats_after["fds"] - stats_before["fds"] < 10
    assert stats_after["threads"] - stats_before["threads"] < 10


# -- many sessions at once ----------------------------------------------------------------------------
def test_sessions_up_to_capacity_then_503_then_all_released(shoal):
    capacity = 12
    busy = shoal(pool_size=2, max_sessions=capacity)
    with busy.client(timeout=120) as http:
        # The probe holds one of the slots; a full house is "degraded: at_capacity".
        with Responsiveness(busy, expected_reasons=frozenset({"at_capacity"})) as probe:
            with ThreadPoolExecutor(capacity) as workers:
                answers = list(workers.map(lambda _: http.post("/sessions", json={}),
                                           range(capacity - 1)))
            assert [a.status_code for a in answers] == [201] * (capacity - 1), \
                [a.text for a in answers if a.status_code != 201]
            ids = [a.json()["session_id"] for a in answers]
            full = http.post("/sessions", json={})
            assert full.status_code == 503, full.text
            assert full.json()["detail"] and full.headers.get("retry-after")
            health = http.get("/health").json()
            assert (health["sessions"], health["max_sessions"]) == (capacity, capacity)
            assert (health["status"], health["reasons"]) == ("degraded", ["at_capacity"])
            with ThreadPoolExecutor(4) as workers:
                outputs = list(workers.map(
                    lambda sid: python(http, sid, "print('up')")["content"]["stdout"], ids))
            assert outputs == ["up\n"] * len(ids)
            with ThreadPoolExecutor(capacity) as workers:
                released = list(workers.map(lambda sid: http.delete(f"/sessions/{sid}"), ids))
            assert [r.status_code for r in released] == [204] * len(ids)
        print(f"\nmany sessions: {probe.summary()}")
        probe.check()
        health = http.get("/health").json()
        assert health["status"] == "ok" and health["sessions"] == 0, health
        # Only the warm pool's sandboxes still run, once it has refilled.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            running = {p["uid"] for p in processes_in(busy.uids) if p["state"] != "Z"}
            ready = http.get("/health").json()["pool_ready"]
            if len(running) == ready == 2:
                break
            time.sleep(0.2)
        assert len(running) == ready == 2, (running, ready)
        again = http.post("/sessions", json={})
        assert again.status_code == 201
        http.delete(f"/sessions/{again.json()['session_id']}")
