"""Load and soak over real HTTP: many sessions at once, and sessions made and
destroyed for a long time, with zero errors and nothing growing.

The full runs are marked ``slow`` (``make test-slow``): 200 concurrent sessions
each running 20 mixed calls (Python, bash, the text editor), and a soak of
``SHOAL_SOAK_SECONDS`` (600 by default) that creates and destroys sessions and
compares the server's RSS, open fds and threads, and the host's processes in the
server's uid range, at its start and end. Small versions of both run in
``make test`` as smoke tests. Every run prints its figures (use ``-s``).

The 200-session server preloads no modules: 200 interpreters each importing
pandas would take ~17 GiB of this 24 GiB machine, and the load is about the
server's own concurrency, not import costs (which the smoke run keeps).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from .conftest import ShoalServer, mounts_under, processes_in

MiB = 1024 * 1024


# -- figures ---------------------------------------------------------------------------------------
def _percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def _latency_line(name: str, samples: list[float]) -> str:
    if not samples:
        return f"{name}: none"
    return (f"{name}: n={len(samples)} p50 {statistics.median(samples) * 1000:.1f} ms, "
            f"p95 {_percentile(samples, 0.95) * 1000:.1f} ms, "
            f"p99 {_percentile(samples, 0.99) * 1000:.1f} ms, "
            f"max {max(samples) * 1000:.1f} ms")


def _loop_devices_of(data_dir: Path) -> int:
    """Loop devices whose backing file is in ``data_dir`` (each volume holds one)."""
    prefix = str(data_dir.resolve()) + "/"
    count = 0
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            count += backing.read_text().strip().startswith(prefix)
        except OSError:
            pass
    return count


def _disk_bytes(directory: Path) -> int:
    """Real disk the files under ``directory`` use (volume images are sparse)."""
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def server_figures(server: ShoalServer) -> dict[str, int]:
    """RSS, open fds and threads of the server, live processes in its uid range, and
    its volumes: mounts, loop devices, real disk."""
    status = dict(line.split(":", 1) for line in
                  open(f"/proc/{server.pid}/status").read().splitlines() if ":" in line)
    return {"rss": int(status["VmRSS"].split()[0]) * 1024,
            "fds": len(os.listdir(f"/proc/{server.pid}/fd")),
            "threads": int(status["Threads"]),
            "processes": len([p for p in processes_in(server.uids) if p["state"] != "Z"]),
            "mounts": len(mounts_under(server.run_dir) + mounts_under(server.data_dir)),
            "loops": _loop_devices_of(server.data_dir),
            "disk": _disk_bytes(server.data_dir)}


def _figures_line(figures: dict[str, int]) -> str:
    return (f"RSS {figures['rss'] / MiB:.1f} MiB, {figures['fds']} fds, "
            f"{figures['threads']} threads, {figures['processes']} sandbox processes, "
            f"{figures['mounts']} mounts, {figures['loops']} loop devices, "
            f"{figures['disk'] / MiB:.1f} MiB of disk")


# -- one session's mixed calls -------------------------------------------------------------------
def _exec(http: httpx.Client, session_id: str, tool: str, **payload) -> dict:
    response = http.post(f"/sessions/{session_id}/exec", json={"tool": tool, "input": payload})
    if response.status_code != 200:
        raise AssertionError(f"{tool}: {response.status_code} {response.text[:300]}")
    return response.json()["result_block"]["content"]


def _expect(content: dict, stdout: str | None = None, contains: str | None = None) -> None:
    if content["return_code"] != 0:
        raise AssertionError(f"return code {content['return_code']}: {content['stderr'][:300]}")
    if stdout is not None and content["stdout"] != stdout:
        raise AssertionError(f"expected {stdout!r}, got {content['stdout'][:300]!r}")
    if contains is not None and contains not in content["stdout"]:
        raise AssertionError(f"{contains!r} not in {content['stdout'][:300]!r}")


def mixed_call(http: httpx.Client, session_id: str, key: int, step: int) -> None:
    """Call ``step`` of session ``key``: Python (with state kept across calls), bash,
    and the text editor's create, view and str_replace, each with its result checked."""
    kind = step % 5
    if kind == 0:
        _expect(_exec(http, session_id, "code_execution",
                      code=f"total = globals().get('total', 0) + {step}\nprint(total)"),
                f"{sum(range(0, step + 1, 5))}\n")
    elif kind == 1:
        _expect(_exec(http, session_id, "bash_code_execution",
                      command=f"echo {key}-{step} >> log.txt && wc -l < log.txt"),
                f"{step // 5 + 1}\n")
    elif kind == 2:
        _expect(_exec(http, session_id, "text_editor_code_execution", command="create",
                      path=f"notes_{step}.txt", file_text=f"session {key}\nstep {step}\n"))
    elif kind == 3:
        _expect(_exec(http, session_id, "text_editor_code_execution", command="view",
                      path=f"notes_{step - 1}.txt"), contains=f"step {step - 1}")
    else:
        _expect(_exec(http, session_id, "text_editor_code_execution", command="str_replace",
                      path=f"notes_{step - 2}.txt", old_str=f"session {key}",
                      new_str=f"session {key} edited"))


# -- concurrent sessions ------------------------------------------------------------------------------
def run_concurrent_sessions(server: ShoalServer, sessions: int, calls: int) -> None:
    errors: list[str] = []
    create_latencies: list[float] = []
    call_latencies: list[float] = []
    lock = threading.Lock()
    retried = [0]
    limits = httpx.Limits(max_connections=sessions + 16, max_keepalive_connections=sessions + 16)
    with httpx.Client(base_url=server.url, timeout=600, limits=limits) as http:
        figures_before = server_figures(server)
        barrier = threading.Barrier(sessions)

        def one_session(key: int) -> None:
            barrier.wait()  # every session starts at once
            session_id = None
            try:
                started = time.monotonic()
                response = http.post("/sessions", json={})
                # A burst past the launch queue is told to come back (503 with
                # Retry-After), as admission control should; a client does so.
                while response.status_code == 503 and response.headers.get("retry-after") \
                        and time.monotonic() - started < 300:
                    with lock:
                        retried[0] += 1
                    time.sleep(min(float(response.headers["retry-after"]), 1.0))
                    response = http.post("/sessions", json={})
                if response.status_code != 201:
                    raise AssertionError(f"create: {response.status_code} {response.text[:200]}")
                session_id = response.json()["session_id"]
                with lock:
                    create_latencies.append(time.monotonic() - started)
                for step in range(calls):
                    began = time.monotonic()
                    mixed_call(http, session_id, key, step)
                    with lock:
                        call_latencies.append(time.monotonic() - began)
            except Exception as exc:
                with lock:
                    errors.append(f"session {key}: {type(exc).__name__}: {exc}")
            finally:
                if session_id is not None:
                    deleted = http.delete(f"/sessions/{session_id}")
                    if deleted.status_code != 204:
                        with lock:
                            errors.append(f"session {key}: delete {deleted.status_code}")

        started = time.monotonic()
        with ThreadPoolExecutor(sessions) as workers:
            list(workers.map(one_session, range(sessions)))
        elapsed = time.monotonic() - started
        health = http.get("/health").json()
    figures_after = server_figures(server)
    total = sessions * calls
    print(f"\n{sessions} concurrent sessions x {calls} mixed calls: {len(call_latencies)}/{total} "
          f"calls in {elapsed:.1f}s, {len(call_latencies) / elapsed:.1f} calls/s overall, "
          f"{len(errors)} errors, {retried[0]} creates retried after a 503")
    print("  " + _latency_line("session create (retries included)", create_latencies))
    print("  " + _latency_line("call", call_latencies))
    print(f"  server before: {_figures_line(figures_before)}")
    print(f"  server after:  {_figures_line(figures_after)}")
    assert errors == [], errors[:10]
    assert len(call_latencies) == total
    assert health["sessions"] == 0, health
    # A burst this size promises more disk than the host has (every session's
    # volume is reserved whole), so warm launches failed and the pool backs off
    # (at most 30 s) before it warms again: it must, without help.
    print(f"  health at the end: {health['status']} {health.get('details')}")
    deadline = time.monotonic() + 120
    with httpx.Client(base_url=server.url, timeout=30) as http:
        while health["status"] != "ok" and time.monotonic() < deadline:
            time.sleep(0.5)
            health = http.get("/health").json()
    assert health["status"] == "ok", health.get("details")
    print(f"  healthy again {120 - (deadline - time.monotonic()):.1f} s after the burst")


@pytest.fixture(scope="module")
def smoke_server(shoal) -> ShoalServer:
    return shoal(pool_size=4, max_sessions=32, memory_limit_mib=256)


def test_concurrent_sessions_smoke(smoke_server):
    run_concurrent_sessions(smoke_server, sessions=20, calls=5)


@pytest.mark.slow
def test_200_concurrent_sessions_of_20_mixed_calls(shoal):
    server = shoal(pool_size=4, max_sessions=220, memory_limit_mib=128, preload_modules="")
    run_concurrent_sessions(server, sessions=200, calls=20)


# -- soak ---------------------------------------------------------------------------------------------
# What a warm sandbox holds open in the server: its channel, its stderr pipe, its
# uid's lease (measured: pools of 2 and 8 ready sandboxes, 29 and 47 fds).
FDS_PER_WARM_SANDBOX = 3


def _settled_figures(server: ShoalServer, http: httpx.Client, timeout: float = 120) -> dict:
    """The server's figures once no session is live and the warm pool holds what it
    aims to (its size, plus what a burst grew it by, which it gives back slowly)."""
    pool_size = int(server.settings["pool_size"])
    deadline = time.monotonic() + timeout
    while True:
        health = http.get("/health").json()
        figures = server_figures(server)
        each = PROCESSES_PER_SANDBOX[health["launcher"]]
        settled = (health["sessions"] == 0 and health["pool_ready"] == health["pool_target"]
                   and health["pool_target"] >= pool_size
                   and figures["processes"] == each * health["pool_ready"])
        if settled or time.monotonic() > deadline:
            return {**figures, "settled": settled, "pool_ready": health["pool_ready"],
                    "processes_each": each}
        time.sleep(0.2)


# A warm sandbox's processes: bubblewrap's outer process, its init and the agent;
# the zygote's sandbox init and the agent.
PROCESSES_PER_SANDBOX = {"bwrap": 3, "zygote": 2}


def run_soak(server: ShoalServer, seconds: float, workers: int = 4) -> None:
    errors: list[str] = []
    cycles = 0
    lock = threading.Lock()
    samples: list[dict] = []
    with httpx.Client(base_url=server.url, timeout=120) as http:
        # Warm up first, so that what is loaded once (imports, caches) is not counted.
        for key in range(10):
            session_id = http.post("/sessions", json={}).json()["session_id"]
            for step in range(3):
                mixed_call(http, session_id, key, step)
            http.delete(f"/sessions/{session_id}")
        start = _settled_figures(server, http)
        deadline = time.monotonic() + seconds

        def worker(index: int) -> None:
            nonlocal cycles
            key = 0
            while time.monotonic() < deadline:
                key += 1
                try:
                    created = http.post("/sessions", json={})
                    if created.status_code != 201:
                        raise AssertionError(f"create: {created.status_code} {created.text[:200]}")
                    session_id = created.json()["session_id"]
                    try:
                        for step in range(2 + key % 3):
                            mixed_call(http, session_id, key, step)
                    finally:
                        deleted = http.delete(f"/sessions/{session_id}")
                        if deleted.status_code != 204:
                            raise AssertionError(f"delete: {deleted.status_code}")
                    with lock:
                        cycles += 1
                except Exception as exc:
                    with lock:
                        errors.append(f"worker {index}: {type(exc).__name__}: {exc}")

        def sampler() -> None:
            while time.monotonic() < deadline:
                samples.append(server_figures(server))
                time.sleep(max(1.0, seconds / 60))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
        threads.append(threading.Thread(target=sampler))
        began = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - began
        end = _settled_figures(server, http)
    rss = [s["rss"] for s in samples] or [start["rss"]]
    print(f"\nsoak: {cycles} sessions created, used and destroyed in {elapsed:.0f}s "
          f"({cycles / elapsed:.1f}/s) by {workers} workers, {len(errors)} errors")
    print(f"  start: {_figures_line(start)}")
    print(f"  end:   {_figures_line(end)}")
    print(f"  RSS during the run: min {min(rss) / MiB:.1f} MiB, max {max(rss) / MiB:.1f} MiB")
    assert errors == [], errors[:10]
    assert cycles > 0
    assert end["settled"], f"the server did not settle: {end}"
    assert end["rss"] - start["rss"] < 50 * MiB, "RSS grew"
    # A busy machine's misses grow the warm pool (it gives the extra back slowly),
    # and each warm sandbox holds its own fds: the server's own count must not grow.
    grown = FDS_PER_WARM_SANDBOX * (end["pool_ready"] - start["pool_ready"])
    assert end["fds"] - start["fds"] - grown < 20, ("open fds grew", start, end)
    assert end["threads"] - start["threads"] < 10, "threads grew"
    # Nothing but the warm pool runs in the uid range: no sandbox outlived its session.
    assert end["processes"] == end["processes_each"] * end["pool_ready"]
    assert start["processes"] == start["processes_each"] * start["pool_ready"]
    # Each warm sandbox holds one scratch volume: one loop device, one mount; no
    # destroyed session's volume, device or disk stays behind.
    assert end["loops"] == end["pool_ready"] and start["loops"] == start["pool_ready"], (start, end)
    assert end["mounts"] - end["loops"] == start["mounts"] - start["loops"], (start, end)
    assert end["disk"] - start["disk"] < 64 * MiB, "disk use grew"


def test_soak_smoke(smoke_server):
    run_soak(smoke_server, seconds=20)


@pytest.mark.slow
def test_soak(shoal):
    seconds = float(os.environ.get("SHOAL_SOAK_SECONDS", "600"))
    server = shoal(pool_size=4, max_sessions=32, memory_limit_mib=256)
    run_soak(server, seconds=seconds)
