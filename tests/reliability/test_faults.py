"""Faults: pieces of a real server killed or crashing under a call, over HTTP.

The sandbox's interpreter killed with SIGKILL (by its own code and from the
host), the agent exiting or losing its channel, bubblewrap killed, the server
itself stopped with SIGTERM and SIGKILL mid-call and restarted on the same data
directory. A call hit by a fault answers 200 with a clear stderr and
``interpreter_restarted: true`` (or, for the server's own death, a clean end),
the session works again, durable files survive, and once each server stops
nothing of it is left on the host: no process of its uids, no cgroup named with
its pid, no mount, no held uid lease, no temporary directory
(``conftest.leftovers``).
"""

from __future__ import annotations

import base64
import hashlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from .conftest import (ShoalServer, assert_nothing_left, bash, cgroups_of, create_session,
                       host_processes, mounts_under, processes_in, python, sandbox_processes,
                       sandbox_uid, wait_for_no_processes)

WORKSPACE = "/home/agent/workspace"
OUTPUTS = "/mnt/user-data/outputs"
UPLOADS = "/mnt/user-data/uploads"
RESTARTED = "it was restarted with the same files"
# A server's default call timeout (``shoal serve``'s default_timeout_seconds): a fault the
# host failed to notice would leave the call waiting at least this long.
DEFAULT_TIMEOUT = 60
# How a call cut at the end of the shutdown grace ends its stderr (shoal.draining).
SHUTDOWN_NOTE = "the server is shutting down: the call was stopped; retry it"


@pytest.fixture
def fresh(shoal) -> Iterator[Callable[..., ShoalServer]]:
    """Servers of this test alone; each is stopped at the end and must leave nothing."""
    started: list[ShoalServer] = []

    def start(**settings) -> ShoalServer:
        server = shoal(**{"pool_size": 1, **settings})
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
    for server in started:
        assert_nothing_left(server)


class Background:
    """One HTTP call run in a thread; ``result()`` waits for it."""

    def __init__(self, call: Callable[[], object]) -> None:
        self.outcome: object = None
        self.elapsed = 0.0

        def run() -> None:
            started = time.monotonic()
            try:
                self.outcome = call()
            except Exception as exc:  # the transport's failure is an outcome too
                self.outcome = exc
            self.elapsed = time.monotonic() - started

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self, timeout: float = 120) -> object:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the call did not end within {timeout}s"
        return self.outcome


def _assert_restarted(answer: dict, took: float | None = None,
                      bound: float = DEFAULT_TIMEOUT / 2) -> None:
    """The call answered that the interpreter died and was restarted; with ``took``, it
    did so well before the wait a missed fault would cost (``bound``: half of it, so that
    only a fault the host did not notice fails the check, never a busy machine)."""
    content = answer["content"]
    assert content["return_code"] != 0, answer
    assert "stopped unexpectedly" in content["stderr"] and RESTARTED in content["stderr"], \
        content["stderr"]
    assert answer["interpreter_restarted"] is True, answer
    assert answer["limits"] == [], answer["limits"]
    if took is not None:
        assert took < bound, f"the call took {took:.1f}s to answer"


def _prepare(http: httpx.Client, session_id: str) -> None:
    """State in the interpreter and a file in the workspace, to see which one survives."""
    assert python(http, session_id, "x = 41\nopen('kept.txt', 'w').write('kept')")[
        "content"]["return_code"] == 0


def _assert_recovered(http: httpx.Client, session_id: str, uid: int) -> None:
    """The next calls work, on the same files, with fresh interpreter state, and one
    generation of the sandbox's processes runs (the killed one is gone)."""
    after = python(http, session_id, "print('x' in globals(), open('kept.txt').read())")
    assert after["content"]["stdout"] == "False kept\n", after
    assert after["interpreter_restarted"] is False and after["limits"] == []
    assert bash(http, session_id, "echo ok")["content"]["stdout"] == "ok\n"
    roles = sandbox_processes(uid)
    # bubblewrap's sandbox has an outer process; the zygote's is its init and agent.
    outer = 1 if launcher_of(http) == "bwrap" else 0
    assert [len(roles[r]) for r in ("outer", "inner", "agent")] == [outer, 1, 1], roles["all"]
    assert len(roles["all"]) == outer + 2, roles["all"]


def launcher_of(http: httpx.Client) -> str:
    return http.get("/health").json()["launcher"]


# -- the interpreter and the agent ---------------------------------------------------------------
@pytest.mark.parametrize("code", [
    "import os\nos.kill(os.getpid(), 9)",
    "import os\nos._exit(3)",
    "import os, stat\n"
    "def is_socket(fd):\n"
    "    try:\n"
    "        return stat.S_ISSOCK(os.fstat(fd).st_mode)\n"
    "    except OSError:\n"
    "        return False\n"
    "for fd in [int(n) for n in os.listdir('/proc/self/fd')]:\n"
    "    if is_socket(fd):\n"
    "        os.close(fd)\n"
    "print('closed the channel')",
], ids=["sigkill-itself", "os-exit", "close-channel"])
def test_interpreter_dying_from_inside(fresh, code):
    server = fresh()
    with server.client() as http:
        session_id = create_session(http)
        uid = sandbox_uid(http, session_id)
        _prepare(http, session_id)
        started = time.monotonic()
        answer = python(http, session_id, code)
        _assert_restarted(answer, time.monotonic() - started)
        assert "closed the channel" not in answer["content"]["stdout"]
        _assert_recovered(http, session_id, uid)


@pytest.mark.parametrize("target", ["agent", "inner", "handle"],
                         ids=["agent", "sandbox-init", "handle"])
def test_sandbox_process_killed_from_the_host_during_a_call(fresh, target):
    """SIGKILL from the host, while a ``sleep`` runs: to the agent (the interpreter),
    to the init inside the sandbox, or to the process the server holds (the outer
    bubblewrap; the zygote's init)."""
    server = fresh()
    with server.client() as http:
        session_id = create_session(http)
        uid = sandbox_uid(http, session_id)
        _prepare(http, session_id)
        before = sandbox_processes(uid)
        call = Background(lambda: python(http, session_id, "import time\ntime.sleep(300)"))
        time.sleep(1)
        os.kill(before[target][0]["pid"], signal.SIGKILL)
        answer = call.result()
        assert isinstance(answer, dict), answer
        _assert_restarted(answer, call.elapsed)
        # The killed generation is gone, not merely abandoned.
        old = {p["pid"] for p in before["all"]}
        assert not old & {p["pid"] for p in processes_in({uid}) if p["state"] != "Z"}
        _assert_recovered(http, session_id, uid)


def test_sandbox_handle_killed_while_idle(fresh):
    """The process the server holds (the outer bubblewrap; the zygote's init) dies
    while no call runs: the whole sandbox goes with it."""
    server = fresh()
    with server.client() as http:
        session_id = create_session(http)
        uid = sandbox_uid(http, session_id)
        _prepare(http, session_id)
        os.kill(sandbox_processes(uid)["handle"][0]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while sandbox_processes(uid)["all"] and time.monotonic() < deadline:
            time.sleep(0.05)  # the sandbox dies with its bubblewrap
        assert sandbox_processes(uid)["all"] == []
        # The next call finds the channel dead: the clear error (never a 500), and its
        # code did not run; the call after it runs in the restarted sandbox.
        response = http.post(f"/sessions/{session_id}/exec", json={
            "tool": "code_execution", "input": {"code": "print('ran')"}})
        assert response.status_code == 200, response.text[:500]
        answer = response.json()
        answer["content"] = answer["result_block"]["content"]
        _assert_restarted(answer)
        assert answer["content"]["stdout"] == "", answer
        _assert_recovered(http, session_id, uid)


def test_agent_deaf_to_its_deadline_is_stopped_by_the_backstop(fresh):
    """Code that blocks the timeout signals and sleeps: the agent never answers, the
    host gives up after the timeout plus its backstop and restarts the sandbox."""
    server = fresh()
    with server.client() as http:
        session_id = create_session(http)
        uid = sandbox_uid(http, session_id)
        _prepare(http, session_id)
        started = time.monotonic()
        answer = python(http, session_id, (
            "import signal, time\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGINT})\n"
            "time.sleep(1000)"), timeout=2)
        took = time.monotonic() - started
        content = answer["content"]
        assert content["return_code"] == 124, answer
        assert content["stderr"].endswith("Command timed out after 2s."), content["stderr"]
        assert answer["limits"] == ["timeout"]
        assert answer["interpreter_restarted"] is True
        # Without the backstop the call would wait out the 1000 s sleep.
        assert took < 60, f"answered after {took:.1f}s"
        _assert_recovered(http, session_id, uid)


def test_a_child_forked_by_user_code_never_answers_calls(fresh):
    server = fresh()
    with server.client() as http:
        session_id = create_session(http)
        forked = python(http, session_id, "import os\nchild = os.fork() == 0")
        assert forked["content"]["return_code"] == 0
        python(http, session_id, "x = 5")
        answers = [python(http, session_id, "print(x, os.getpid(), child)")["content"]
                   for _ in range(10)]
        assert {a["stdout"] for a in answers} == {answers[0]["stdout"]}, answers
        assert answers[0]["stdout"].startswith("5 ") and answers[0]["stdout"].endswith(
            " False\n"), answers[0]


# -- the server's own death --------------------------------------------------------------------------
def _container_session(http: httpx.Client, container: str) -> str:
    response = http.post("/sessions", json={"container": container})
    assert response.status_code == 201, response.text
    return response.json()["session_id"]


def _file_id(sandbox_path: str) -> str:
    return base64.urlsafe_b64encode(sandbox_path.encode()).decode().rstrip("=")


def test_sigterm_lets_a_short_call_finish_on_a_container(fresh):
    server = fresh(shutdown_grace_seconds=20)
    with server.client() as http:
        session_id = _container_session(http, "graceful")
        call = Background(lambda: bash(http, session_id, (
            f"sleep 2; echo finished > {WORKSPACE}/after.txt; echo done")))
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        answer = call.result()
    assert isinstance(answer, dict), answer
    assert answer["content"]["stdout"] == "done\n", answer
    assert server.process.wait(30) in (0, -signal.SIGTERM)
    assert_nothing_left(server)
    # The file the call wrote before it answered is durable.
    again = fresh(run_dir=server.run_dir, data_dir=server.data_dir)
    with again.client() as http:
        session_id = _container_session(http, "graceful")
        read = bash(http, session_id, f"cat {WORKSPACE}/after.txt")
        assert read["content"]["stdout"] == "finished\n", read


CALL_SECONDS = 60


def _sigterm_beyond_grace(fresh) -> tuple[ShoalServer, Background, float]:
    server = fresh(shutdown_grace_seconds=2)
    http = server.client()
    session_id = create_session(http)
    call = Background(lambda: http.post(f"/sessions/{session_id}/exec", json={
        "tool": "bash_code_execution", "input": {"command": f"sleep {CALL_SECONDS}; echo done"}}))
    time.sleep(1)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(30)
    took = time.monotonic() - started
    call.result()
    http.close()
    assert code in (0, -signal.SIGTERM), code
    return server, call, took


def _assert_cut_cleanly(outcome: object) -> None:
    """The call cut at the end of the grace answered with what it had produced and
    Retry-After: not a hang-up, a bare 500, or the result of a call allowed to finish."""
    assert isinstance(outcome, httpx.Response), f"the call got no answer: {outcome!r}"
    assert outcome.status_code == 200, (outcome.status_code, outcome.text[:200])
    assert outcome.headers.get("retry-after") == "1", outcome.headers
    content = outcome.json()["result_block"]["content"]
    assert "done" not in content["stdout"], content  # the sleep never finished
    assert content["stderr"].endswith(SHUTDOWN_NOTE), content
    assert content["return_code"] != 0, content


def test_sigterm_during_a_call_longer_than_the_grace(fresh):
    server, call, took = _sigterm_beyond_grace(fresh)
    print(f"\nSIGTERM beyond the grace: the server exited after {took:.1f}s; "
          f"the call got {call.outcome!r}")
    # A server that ignored its grace would wait for the call (CALL_SECONDS).
    assert took < CALL_SECONDS * 2 / 3, f"the server took {took:.1f}s to exit"
    _assert_cut_cleanly(call.outcome)
    assert_nothing_left(server)


def test_a_call_cut_by_shutdown_gets_a_clean_answer(fresh):
    _, call, _ = _sigterm_beyond_grace(fresh)
    _assert_cut_cleanly(call.outcome)


def _descends_from(pid: int, ancestor: int, parents: dict[int, int]) -> bool:
    while pid and pid != ancestor:
        pid = parents.get(pid, 0)
    return pid == ancestor


def test_sigkill_mid_call_then_restart_on_the_same_data_dir(fresh):
    first = fresh(pool_size=2)
    container = "survivor"
    payload = os.urandom(3_000_000)
    with first.client() as http:
        # Durable files, written through code and through the Files API.
        session_id = _container_session(http, container)
        wrote = bash(http, session_id, (
            f"head -c 2000000 /dev/urandom > {WORKSPACE}/blob.bin && "
            f"md5sum < {WORKSPACE}/blob.bin && echo result > {OUTPUTS}/result.txt"))
        blob_md5 = wrote["content"]["stdout"].split()[0]
        upload = http.post("/v1/files", params={"scope_id": container},
                           files={"file": ("upload.bin", payload)})
        assert upload.status_code == 201, upload.text
        ephemeral = create_session(http)
        python(http, ephemeral, "print(1)")
        # A call in flight at the kill: it appends to a file of the container.
        Background(lambda: http.post(f"/sessions/{session_id}/exec", json={
            "tool": "bash_code_execution", "input": {
                "command": f"while :; do date >> {WORKSPACE}/log.txt; sleep 0.01; done"}}))
        time.sleep(1)
        assert processes_in(first.uids), "the sandboxes should be running"
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(30)

    # What the killed server left: its sandboxes died with it (bubblewrap's
    # --die-with-parent), its cgroups and mounts are still there.
    assert wait_for_no_processes(first.uids) == []
    left_cgroups = cgroups_of(first.pid)
    sandboxes_dirs = [p for p in first.run_dir.iterdir()
                      if p.name.startswith(f"sandboxes-{first.pid}.")]
    print(f"\nthe killed server left {len(left_cgroups)} cgroups, "
          f"{len(mounts_under(first.run_dir))} mounts, dirs {[p.name for p in sandboxes_dirs]}")

    # Restarted as an operator would: same run directory, data directory and uids.
    second = fresh(run_dir=first.run_dir, data_dir=first.data_dir, uid_base=first.uid_base,
                   pool_size=2)
    # The new server reclaimed all of it before it served.
    assert cgroups_of(first.pid) == []
    for directory in sandboxes_dirs:
        assert mounts_under(directory) == [] and not directory.exists(), directory
    assert not [p for p in first.run_dir.iterdir() if p.name.startswith(
        (f"sandboxes-{first.pid}.", f"agent-{first.pid}."))]

    with second.client() as http:
        # The killed server's sessions are gone, its container is not.
        assert http.get(f"/sessions/{ephemeral}").status_code == 404
        assert http.get(f"/v1/containers/{container}").status_code == 200
        content = http.get(f"/v1/files/{_file_id(f'{UPLOADS}/upload.bin')}/content",
                           params={"scope_id": container})
        assert content.status_code == 200 and content.content == payload
        result = http.get(f"/v1/files/{_file_id(f'{OUTPUTS}/result.txt')}/content",
                          params={"scope_id": container})
        assert result.status_code == 200 and result.content == b"result\n"
        session_id = _container_session(http, container)
        read = bash(http, session_id, (
            f"md5sum < {WORKSPACE}/blob.bin; md5sum < {UPLOADS}/upload.bin; "
            f"test -s {WORKSPACE}/log.txt && echo logged"))
        assert read["interpreter_restarted"] is True
        assert read["content"]["stdout"].split() == [
            blob_md5, "-", hashlib.md5(payload).hexdigest(), "-", "logged"], read
        # And it is writable by the new sandbox.
        assert bash(http, session_id, f"echo more >> {WORKSPACE}/log.txt && echo ok")[
            "content"]["stdout"] == "ok\n"
        # Every process of the uid range now belongs to the new server.
        parents = {p["pid"]: p["ppid"] for p in host_processes()}
        strays = [p for p in processes_in(second.uids)
                  if not _descends_from(p["pid"], second.pid, parents)]
        assert strays == [], strays
    second.stop()
    assert_nothing_left(second)
    assert_nothing_left(first)  # by pid: the killed server's names are all gone too
