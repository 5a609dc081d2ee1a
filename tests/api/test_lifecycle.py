"""Lifetimes, the reaper, concurrency and graceful shutdown, over real HTTP (metrics:
test_metrics_values.py)."""

from __future__ import annotations

import ast
import signal
import threading
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def short_lived(server_factory):
    """A server whose ceilings are low and whose reaper runs often."""
    return server_factory(idle_timeout_seconds=30, max_idle_timeout_seconds=60,
                          max_lifetime_seconds=120, max_lifetime_ceiling_seconds=300,
                          reaper_interval_seconds=0.2, pool_size=2)


def _create(client, **hints) -> dict:
    response = client.post("/sessions", json=hints)
    assert response.status_code == 201, response.text
    return response.json()


def test_hints_are_clamped_never_raised(short_lived):
    with short_lived.client() as client:
        clamped = _create(client, idle_timeout_seconds=99999, max_lifetime_seconds=99999)
        assert (clamped["idle_timeout_seconds"], clamped["max_lifetime_seconds"]) == (60, 300)
        honoured = _create(client, idle_timeout_seconds=5, max_lifetime_seconds=7)
        assert (honoured["idle_timeout_seconds"], honoured["max_lifetime_seconds"]) == (5, 7)
        defaults = _create(client)
        assert (defaults["idle_timeout_seconds"], defaults["max_lifetime_seconds"]) == (30, 120)
        for handle in (clamped, honoured, defaults):
            client.delete(f"/sessions/{handle['session_id']}")


# How long a test waits for the reaper to act on a session that is due: a reaper that
# never runs fails, a busy machine (the reaper runs every 0.2 s here) does not.
REAP_WAIT_SECONDS = 30


def _wait_until_gone(client, session_id: str) -> float:
    """Seconds until GET answers 404 (reads do not count as activity); fails after
    ``REAP_WAIT_SECONDS``."""
    started = time.monotonic()
    while client.get(f"/sessions/{session_id}").status_code == 200:
        assert time.monotonic() - started < REAP_WAIT_SECONDS, "the session was never reaped"
        time.sleep(0.1)
    return time.monotonic() - started


def test_idle_session_is_reaped(short_lived):
    with short_lived.client() as client:
        handle = _create(client, idle_timeout_seconds=1)
        assert client.get(f"/sessions/{handle['session_id']}").status_code == 200
        _wait_until_gone(client, handle["session_id"])
        assert client.get(f"/sessions/{handle['session_id']}").status_code == 404


def test_max_lifetime_is_enforced_even_when_active(short_lived):
    with short_lived.client() as client:
        handle = _create(client, max_lifetime_seconds=2)
        sid = handle["session_id"]
        deadline = time.monotonic() + REAP_WAIT_SECONDS
        while time.monotonic() < deadline:
            if client.get(f"/sessions/{sid}").status_code == 404:
                break
            client.post(f"/sessions/{sid}/exec", json={"tool": "code_execution", "input": {"code": "1"}})
            time.sleep(0.2)
        assert client.get(f"/sessions/{sid}").status_code == 404


def test_exec_in_progress_counts_as_activity(short_lived):
    with short_lived.client() as client:
        handle = _create(client, idle_timeout_seconds=1)
        sid = handle["session_id"]
        response = client.post(f"/sessions/{sid}/exec", json={
            "tool": "bash_code_execution", "input": {"command": "sleep 3; echo done"}})
        assert response.status_code == 200
        assert response.json()["result_block"]["content"]["stdout"] == "done\n"
        refreshed = client.get(f"/sessions/{sid}")
        assert refreshed.status_code == 200
        assert refreshed.json()["last_activity_at"] > handle["last_activity_at"]
        client.delete(f"/sessions/{sid}")


def test_slow_call_does_not_delay_another_session(server):
    with server.client() as client:
        slow = _create(client)["session_id"]
        fast = _create(client)["session_id"]
        client.post(f"/sessions/{fast}/exec", json={"tool": "code_execution", "input": {"code": "1"}})
        slow_result = {}

        def run_slow():
            with server.client() as other:
                slow_result["response"] = other.post(f"/sessions/{slow}/exec", json={
                    "tool": "bash_code_execution", "input": {"command": "sleep 120"}})

        thread = threading.Thread(target=run_slow)
        thread.start()
        # The slow call is running once its sleep shows up in its sandbox (a host-side
        # look: a call to the slow session would queue behind it).
        uid_base = int(server.process.args[server.process.args.index("--uid-base") + 1])
        deadline = time.monotonic() + 60
        while not _sleeping_in(uid_base, "120"):
            assert time.monotonic() < deadline, "the slow call never started"
            time.sleep(0.05)
        # Not serialized behind it: the other session's call and /health answer while
        # the slow call still runs (it would run for two minutes).
        response = client.post(f"/sessions/{fast}/exec",
                               json={"tool": "code_execution", "input": {"code": "print('quick')"}})
        assert response.json()["result_block"]["content"]["stdout"] == "quick\n"
        assert client.get("/health").status_code == 200
        assert thread.is_alive(), "the slow call ended early: nothing was shown"
        assert _sleeping_in(uid_base, "120"), "the slow call ended early: nothing was shown"
        # Releasing the slow session ends its call.
        assert client.delete(f"/sessions/{slow}").status_code == 204
        thread.join(60)
        assert not thread.is_alive()
        assert slow_result["response"].status_code == 404, slow_result["response"].text
        client.delete(f"/sessions/{fast}")


def _sleeping_in(uid_base: int, seconds: str) -> bool:
    """Whether a process of the server's uid range runs ``sleep <seconds>``."""
    for pid in _processes_with_uids(uid_base, uid_base + 4096):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [
                    b"sleep", seconds.encode()]:
                return True
        except OSError:
            continue
    return False


def test_calls_to_one_session_are_serialized(server):
    with server.client() as client:
        sid = _create(client)["session_id"]
        code = ("import os, time\n"
                "fd = os.open('log', os.O_WRONLY | os.O_CREAT | os.O_APPEND)\n"
                "os.write(fd, b'start\\n'); time.sleep(0.3); os.write(fd, b'end\\n')")
        threads = [threading.Thread(target=lambda: server.client().post(
            f"/sessions/{sid}/exec", json={"tool": "code_execution", "input": {"code": code}}))
            for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        log = client.post(f"/sessions/{sid}/exec", json={
            "tool": "bash_code_execution", "input": {"command": "cat log"}}).json()
        assert log["result_block"]["content"]["stdout"] == "start\nend\n" * 3
        client.delete(f"/sessions/{sid}")


def _processes_with_uids(low: int, high: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            for line in status.read_text().splitlines():
                if line.startswith("Uid:"):
                    if low <= int(line.split()[1]) < high:
                        found.append(int(status.parent.name))
                    break
        except (OSError, ValueError):
            continue
    return found


def test_sigterm_finishes_running_calls_then_cleans_up(server_factory):
    server = server_factory(pool_size=2, shutdown_grace_seconds=20)
    uid_base = int(server.process.args[server.process.args.index("--uid-base") + 1])
    with server.client() as client:
        sid = _create(client)["session_id"]
        outcome = {}

        def slow_call():
            outcome["response"] = client.post(f"/sessions/{sid}/exec", json={
                "tool": "bash_code_execution", "input": {"command": "sleep 2; echo finished"}})

        thread = threading.Thread(target=slow_call)
        thread.start()
        time.sleep(0.5)
        assert _processes_with_uids(uid_base, uid_base + 4096), "sandboxes should be running"
        server.process.send_signal(signal.SIGTERM)
        thread.join()
        assert outcome["response"].status_code == 200
        assert outcome["response"].json()["result_block"]["content"]["stdout"] == "finished\n"
    # uvicorn re-raises the signal once it has shut down cleanly: -SIGTERM is the clean exit.
    assert server.process.wait(30) in (0, -signal.SIGTERM)
    assert _processes_with_uids(uid_base, uid_base + 4096) == []
    pid = server.process.pid
    assert not list(Path("/run/shoal-test").glob(f"sandboxes-{pid}.*"))
    assert not list(Path("/run/shoal-test").glob(f"agent-{pid}.*"))


def test_a_zygote_server_serves_sessions_and_containers(server_factory):
    server = server_factory(launcher="zygote", pool_size=2)
    with server.client() as client:
        sid = _create(client)["session_id"]
        body = client.post(f"/sessions/{sid}/exec", json={
            "tool": "code_execution",
            "input": {"code": "import sys\n'pandas' in sys.modules, __import__('os').getuid()"}}).json()
        preloaded, uid = ast.literal_eval(body["result_block"]["content"]["stdout"])
        assert preloaded is True and uid >= 1000
        client.delete(f"/sessions/{sid}")
        attached = _create(client, container="zygote-box")["session_id"]
        wrote = client.post(f"/sessions/{attached}/exec", json={
            "tool": "bash_code_execution", "input": {"command": "echo kept > kept.txt && cat kept.txt"}})
        assert wrote.json()["result_block"]["content"]["stdout"] == "kept\n"
        client.delete(f"/sessions/{attached}")
        again = _create(client, container="zygote-box")["session_id"]
        read = client.post(f"/sessions/{again}/exec", json={
            "tool": "bash_code_execution", "input": {"command": "cat kept.txt"}})
        assert read.json()["result_block"]["content"]["stdout"] == "kept\n"
        client.delete(f"/sessions/{again}")


def test_deleting_a_container_ends_its_sessions_and_frees_their_slots(server_factory):
    # Two slots per tenant: a session left alive by its container's deletion would
    # hold one until its idle timeout, so after two deletions no session could start.
    server = server_factory(pool_size=1, tenant_max_sessions=2)
    uid_base = int(server.process.args[server.process.args.index("--uid-base") + 1])
    with server.client() as client:
        for _ in range(2):
            container = client.post("/v1/containers", json={"name": "doomed"}).json()["id"]
            sid = _create(client, container=container)["session_id"]
            running = {}

            def slow_call(sid=sid):
                with server.client() as other:
                    running["response"] = other.post(f"/sessions/{sid}/exec", json={
                        "tool": "bash_code_execution", "input": {"command": "sleep 97"}})

            thread = threading.Thread(target=slow_call)
            thread.start()
            deadline = time.monotonic() + 60
            while not _sleeping_in(uid_base, "97"):
                assert time.monotonic() < deadline, "the call never started"
                time.sleep(0.05)
            deleted = client.delete(f"/v1/containers/{container}")
            assert deleted.status_code == 200, deleted.text
            # The call running at that moment is cut off, and says why.
            thread.join(30)
            assert not thread.is_alive(), "the running call outlived its container"
            cut = running["response"]
            assert cut.status_code == 404, cut.text
            assert "container was deleted" in cut.json()["detail"], cut.text
            assert not _sleeping_in(uid_base, "97")
            # The session is gone like any released one, on every route.
            for answer in (
                    client.get(f"/sessions/{sid}"),
                    client.post(f"/sessions/{sid}/exec", json={
                        "tool": "bash_code_execution", "input": {"command": "echo hi"}}),
                    client.get(f"/sessions/{sid}/files/list"),
                    client.get(f"/sessions/{sid}/files", params={"path": "a.txt"}),
                    client.post(f"/sessions/{sid}/files", files={"file": ("a.txt", b"a")})):
                assert answer.status_code == 404, (answer.request.url, answer.text)
                assert answer.json()["detail"] == f"no session {sid!r}", answer.text
        # Both slots are free at once, not at the sessions' idle timeout.
        fresh = [_create(client)["session_id"] for _ in range(2)]
        for sid in fresh:
            client.delete(f"/sessions/{sid}")
