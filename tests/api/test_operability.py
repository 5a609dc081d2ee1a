"""What an operator sees: request ids, logs, probes, the SIGTERM drain, 503s, start-up.

Everything goes through real ``shoal serve`` processes: the logs are the JSON
lines the server wrote to stderr, the probes are what a kubelet would call,
and SIGTERM is a real signal with a real call in flight.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serving import DEFAULT_RUN_DIR, SHOAL, Server, free_port, start_server
from tests.uid_slots import uid

TOKEN, OPERATOR = "tok-acme-operability", "tok-operator-operability"
OUTPUTS = "/mnt/user-data/outputs"
RELEASE_1 = Path(__file__).resolve().parents[1] / "storage" / "fixtures" / "release-1.sql"


def log_lines(server: Server) -> list[dict]:
    """Every JSON line the server logged; a line that is not JSON fails the test
    (only the one `shoal: serving on` banner may be plain text)."""
    entries = []
    for line in server.log().splitlines():
        if line.startswith("shoal: "):
            continue
        entry = json.loads(line)
        assert isinstance(entry, dict) and {"time", "level", "logger", "message"} <= entry.keys()
        entries.append(entry)
    return entries


def wait_for_log(server: Server, predicate, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in log_lines(server):
            if predicate(entry):
                return entry
        time.sleep(0.1)
    raise AssertionError(f"no such log line:\n{server.log()[-3000:]}")


def exec_python(http: httpx.Client, session_id: str, code: str, **headers) -> httpx.Response:
    return http.post(f"/sessions/{session_id}/exec", headers=headers,
                     json={"tool": "code_execution", "input": {"code": code}})


def new_session(http: httpx.Client) -> str:
    response = http.post("/sessions", json={})
    assert response.status_code == 201, response.text
    return response.json()["session_id"]


@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tokens")
    (directory / "tokens").write_text(f"{TOKEN}=acme\n")
    (directory / "operators").write_text(f"{OPERATOR}\n")
    return directory


@pytest.fixture(scope="module")
def watched(server_factory, tokens_dir) -> Server:
    """A token-protected server at the default log level."""
    return server_factory(pool_size=1, max_sessions=8, memory_limit_mib=128,
                          tokens=f"@{tokens_dir / 'tokens'}",
                          operator_tokens=f"@{tokens_dir / 'operators'}")


@pytest.fixture
def acme(watched):
    with watched.client(TOKEN) as http:
        yield http


# -- request ids ---------------------------------------------------------------------------------
def test_a_request_id_is_echoed_logged_and_in_the_error_body(watched, acme):
    response = exec_python(acme, "no-such-session", "1", **{"X-Request-Id": "ops-4242"})
    assert response.status_code == 404
    assert response.headers["x-request-id"] == response.headers["request-id"] == "ops-4242"
    assert response.json()["request_id"] == "ops-4242"

    generated = acme.get("/sessions/no-such-session")
    request_id = generated.headers["x-request-id"]
    assert request_id.startswith("req_") and generated.json()["request_id"] == request_id
    # An id that is not a sane token is replaced, never echoed into headers or logs.
    odd = acme.get("/sessions/x", headers={"X-Request-Id": "two words\\n"})
    assert odd.headers["x-request-id"].startswith("req_")

    # The OOM warning of a call is logged with that call's id, tenant and session.
    session_id = new_session(acme)
    try:
        killed = exec_python(acme, session_id, "x = bytearray(1024 * 1024 * 1024)",
                             **{"X-Request-Id": "ops-oom-1"})
        assert killed.status_code == 200 and "memory" in killed.json()["limits"], killed.text
        entry = wait_for_log(watched, lambda e: e.get("request_id") == "ops-oom-1"
                             and e["level"] == "warning")
        assert "OOM" in entry["message"], entry
        assert entry["tenant"] == "acme" and entry["session"] == session_id, entry
    finally:
        acme.delete(f"/sessions/{session_id}")


def test_a_sandbox_crash_is_logged_at_the_default_level(watched, acme):
    session_id = new_session(acme)
    try:
        crashed = exec_python(acme, session_id, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
                              **{"X-Request-Id": "ops-crash-1"})
        assert crashed.status_code == 200, crashed.text
        assert crashed.json()["interpreter_restarted"] is True
        entry = wait_for_log(watched, lambda e: e.get("request_id") == "ops-crash-1"
                             and e["level"] == "warning")
        assert "crashed" in entry["message"] and entry["session"] == session_id, entry
        # The session works on, on a fresh interpreter.
        again = exec_python(acme, session_id, "print(6 * 7)")
        assert again.json()["result_block"]["content"]["stdout"] == "42\n"
    finally:
        acme.delete(f"/sessions/{session_id}")


def test_a_rejected_token_is_logged_without_the_token(watched):
    wrong = "tok-definitely-wrong-0001"
    with watched.client(wrong) as http:
        response = http.post("/sessions", json={}, headers={"X-Request-Id": "ops-reject-1"})
    assert response.status_code == 401
    entry = wait_for_log(watched, lambda e: e.get("request_id") == "ops-reject-1")
    assert entry["level"] == "warning" and "rejected" in entry["message"], entry
    assert len(entry["token_sha256"]) == 12
    assert wrong not in watched.log()


def test_a_client_error_costs_no_log_line_at_the_default_level(watched, acme):
    before = len(log_lines(watched))
    for _ in range(3):
        assert acme.get("/sessions/none-such").status_code == 404
    assert acme.get("/livez").status_code == 200
    # 404s are the client's business: at the default level they cost no line.
    assert len(log_lines(watched)) == before


def test_the_debug_level_logs_no_tenants_secret_or_data(server_factory):
    """aiosqlite logs each statement with its parameters at DEBUG: at the debug level
    the log held every container's domain secrets and every run's output."""
    server = server_factory(pool_size=1, log_level="debug", egress_allow="api.example.com")
    secret, printed = "dsv-hunter2-domain-secret", "run-output-4f1c9"
    with server.client() as http:
        created = http.post("/v1/containers", json={"name": "debug-log", "network_policy": {
            "type": "allowlist", "allowed_domains": ["api.example.com"],
            "domain_secrets": [{"domain": "api.example.com", "name": "API_KEY",
                                "value": secret}]}})
        assert created.status_code == 200, created.text
        container = created.json()["id"]
        with http.stream("POST", "/v1/code-execution/runs", json={
                "language": "python", "code": f"print({printed!r})",
                "container": container}) as answer:
            assert answer.status_code == 200
            assert printed in answer.read().decode()
        stored = wait_for_log(server, lambda e: e.get("route") == "/v1/code-execution/runs")
        assert stored["level"] == "info", stored  # the access log: the level is in force
        assert http.get(f"/v1/containers/{container}").status_code == 200
    time.sleep(1)  # the run's record is stored after its stream ends
    log = server.log()
    assert secret not in log and printed not in log


def test_a_streamed_calls_client_error_costs_no_log_line_either(watched, acme):
    # Each was a warning: a tenant's stream of calls too large to run wrote a line
    # apiece at the default level, where the same call unstreamed wrote none.
    session_id = new_session(acme)
    try:
        before = len(log_lines(watched))
        for _ in range(3):
            with acme.stream("POST", f"/sessions/{session_id}/exec",
                             headers={"accept": "text/event-stream"},
                             json={"tool": "code_execution",
                                   "input": {"code": "#" + "x" * (5 << 20)}}) as answer:
                assert answer.status_code == 200
                assert '"status": 413' in answer.read().decode()
        assert len(log_lines(watched)) == before, log_lines(watched)[before:]
    finally:
        acme.delete(f"/sessions/{session_id}")


# -- metrics --------------------------------------------------------------------------------------
def _scrape(http: httpx.Client) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    response = http.get("/metrics", headers={"Authorization": f"Bearer {OPERATOR}"})
    assert response.status_code == 200, response.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def test_the_operator_metrics_are_present_and_move(watched, acme):
    before = _scrape(acme)
    for name in ("shoal_sandbox_launches_total", "shoal_sandbox_launch_failures_total",
                 "shoal_sandbox_crashes_total", "shoal_sandbox_oom_kills_total",
                 "shoal_pool_ready", "shoal_pool_target", "shoal_uids_free", "shoal_ready",
                 "shoal_containers_active", "shoal_container_disk_bytes"):
        assert (name, ()) in before, name
    session_id = new_session(acme)
    try:
        assert exec_python(acme, session_id, "print(1)").status_code == 200
        assert exec_python(acme, session_id, "x = bytearray(1024 ** 3)").status_code == 200
    finally:
        acme.delete(f"/sessions/{session_id}")
    container = acme.post("/sessions", json={"container": "metered-container"})
    assert container.status_code == 201
    acme.delete(f"/sessions/{container.json()['session_id']}")
    acme.get("/no/such/route")
    after = _scrape(acme)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    exec_route = {"method": "POST", "route": "/sessions/{session_id}/exec", "status": "200"}
    assert moved("shoal_http_requests_total", **exec_route) == 2
    assert moved("shoal_http_request_seconds_count", method="POST",
                 route="/sessions/{session_id}/exec") == 2
    # A path that matched no route is one series, whatever the path was.
    assert moved("shoal_http_requests_total", method="GET", route="unmatched", status="404") == 1
    assert not any("/no/such/route" in str(key) for key in after)
    assert moved("shoal_sandbox_oom_kills_total") >= 1
    assert moved("shoal_sandbox_launches_total") >= 2  # the restart after the OOM, the refill
    assert moved("shoal_tenant_calls_total", tenant="acme") == 2
    assert moved("shoal_tenant_exec_seconds_total", tenant="acme") > 0
    assert after[("shoal_containers_active", ())] >= 1
    assert after[("shoal_container_disk_bytes", ())] > 0
    # The only tenant labels are the token table's.
    tenants = {dict(key[1]).get("tenant") for key in after if key[0].startswith("shoal_tenant_")}
    assert tenants == {"acme"}


def test_a_tenant_token_reads_no_metrics(acme):
    assert acme.get("/metrics").status_code == 403


# -- probes ---------------------------------------------------------------------------------------
def test_probes_answer_without_a_token_and_details_only_for_the_operator(watched):
    with watched.client() as anonymous:
        assert anonymous.get("/livez").json() == {"status": "ok"}
        ready = anonymous.get("/readyz")
        assert ready.status_code == 200 and ready.json() == {"status": "ready"}
        assert anonymous.get("/health").json() == {"status": "ok"}
    with watched.client(OPERATOR) as operator:
        health = operator.get("/health").json()
        assert health["status"] == "ok" and health["max_sessions"] == 8
        assert health["launcher"] in ("zygote", "bwrap")
        # What a cluster front end places by: room in memory for sandboxes at their limit.
        assert health["sandbox_memory_bytes"] == 128 << 20
        with open("/proc/meminfo") as meminfo:
            total = int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1])
        assert 0 < health["memory_available_bytes"] <= total * 1024


def test_readiness_fails_while_uids_are_exhausted_and_recovers(tmp_path):
    # A uid range of its own: no other server of the run can hold one of these three,
    # nor the same test of a suite running beside this one (uids are host-wide).
    base = 883_000 + (os.getpid() % 4096) * 4
    server = start_server(tmp_path, base, pool_size=1, uid_count=3, max_sessions=8)
    try:
        _uids_exhausted_and_recovered(server)
    finally:
        server.stop()


def _uids_exhausted_and_recovered(server: Server) -> None:
    with server.client() as http:
        # Every one of the server's three uids held by a session: none is left for
        # the pool, so nothing warm can be left either. (A create may find the last
        # uid held by a sandbox still warming: it is leased on a try after.)
        held: list[str] = []
        deadline = time.monotonic() + 30
        while len(held) < 3:
            created = http.post("/sessions", json={})
            if created.status_code == 201:
                held.append(created.json()["session_id"])
                continue
            assert created.status_code == 503 and "uid" in created.json()["detail"], created.text
            assert time.monotonic() < deadline, created.text
            time.sleep(0.05)
        third = http.post("/sessions", json={})
        assert third.status_code == 503, third.text
        assert third.headers["retry-after"] == "1"
        assert "uid" in third.json()["detail"]
        ready = http.get("/readyz")
        assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
        assert "uids_exhausted" in ready.json()["reasons"], ready.json()
        assert http.get("/health").json()["status"] == "degraded"
        entry = wait_for_log(server, lambda e: e.get("resource") == "UidsExhausted")
        assert entry["level"] == "warning" and entry["status"] == 503

        http.delete(f"/sessions/{held.pop()}")
        deadline = time.monotonic() + 60
        while http.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, http.get("/readyz").json()
            time.sleep(0.2)
        created = http.post("/sessions", json={})
        assert created.status_code == 201, created.text
        for session_id in [*held, created.json()["session_id"]]:
            http.delete(f"/sessions/{session_id}")


def test_at_capacity_every_dialect_answers_503_with_retry_after(server_factory):
    server = server_factory(pool_size=1, max_sessions=1)
    with server.client() as http:
        session_id = new_session(http)
        try:
            protocol = http.post("/sessions", json={})
            assert protocol.status_code == 503 and protocol.headers["retry-after"] == "1"
            assert "slots" in protocol.json()["detail"]
            run = http.post("/v1/code-execution/runs", json={"language": "python", "code": "1"})
            assert run.status_code == 503 and run.headers["retry-after"] == "1", run.text
            assert run.json()["error"]["code"] == "service_unavailable"
            ready = http.get("/readyz").json()
            assert ready["reasons"] == ["at_capacity"], ready
        finally:
            http.delete(f"/sessions/{session_id}")
        assert http.get("/readyz").status_code == 200


# -- SIGTERM -------------------------------------------------------------------------------------
class Call(threading.Thread):
    def __init__(self, send) -> None:
        super().__init__(daemon=True)
        self.send = send
        self.outcome: object = None
        self.start()

    def run(self) -> None:
        try:
            self.outcome = self.send()
        except Exception as exc:  # noqa: BLE001 - the test inspects what happened
            self.outcome = exc


def test_sigterm_fails_readiness_and_keeps_serving_until_calls_finish(tmp_path):
    server = start_server(tmp_path, 880_000, pool_size=2, drain_seconds=3,
                          shutdown_grace_seconds=30, log_level="info")
    http = server.client()
    session_id = new_session(http)
    call = Call(lambda: http.post(f"/sessions/{session_id}/exec", json={
        "tool": "bash_code_execution", "input": {"command": "sleep 4; echo finished"}}))
    time.sleep(0.5)
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with server.client() as late:
        ready = late.get("/readyz")
        assert ready.status_code == 503 and ready.json()["reasons"] == ["draining"]
        assert ready.headers["retry-after"] == "1"
        # The listener still serves: a balancer that has not noticed yet loses nothing.
        newcomer = new_session(late)
        ran = exec_python(late, newcomer, "print('still served')")
        assert ran.json()["result_block"]["content"]["stdout"] == "still served\n"
        late.delete(f"/sessions/{newcomer}")
    call.join(30)
    assert isinstance(call.outcome, httpx.Response), call.outcome
    assert call.outcome.status_code == 200
    assert call.outcome.json()["result_block"]["content"]["stdout"] == "finished\n"
    assert "retry-after" not in call.outcome.headers  # it finished: nothing to retry
    assert server.process.wait(30) in (0, -signal.SIGTERM)
    http.close()
    # Each access line is one flat object: no JSON document nested in a string.
    access = [e for e in log_lines(server) if e["logger"] == "shoal.access"]
    assert access and all(e["message"] == "request" and isinstance(e["status"], int)
                          and e["request_id"] for e in access)


def test_a_call_cut_by_the_grace_period_answers_with_its_output(tmp_path):
    server = start_server(tmp_path, 881_000, pool_size=1, drain_seconds=0,
                          shutdown_grace_seconds=2)
    http = server.client()
    session_id = new_session(http)
    call = Call(lambda: http.post(f"/sessions/{session_id}/exec", json={
        "tool": "bash_code_execution", "input": {"command": "echo produced; sleep 120"}}))
    time.sleep(1)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) in (0, -signal.SIGTERM)
    call.join(10)
    http.close()
    assert isinstance(call.outcome, httpx.Response), call.outcome
    answer = call.outcome
    assert answer.status_code == 200, answer.text
    assert answer.headers["retry-after"] == "1"
    content = answer.json()["result_block"]["content"]
    assert content["stdout"] == "produced\n"
    assert "shutting down" in content["stderr"] and content["return_code"] != 0


# -- start-up -----------------------------------------------------------------------------------
def _refused(tmp_path: Path, *flags: str, data_dir: Path | None = None,
             env: dict | None = None, command: str = "serve") -> subprocess.CompletedProcess:
    # Should a check regress and the server start, its sandboxes take uids of this
    # run's slot (below tests/api/conftest.py's ranges), never another suite's.
    args = [str(SHOAL), command, "--data-dir", str(data_dir or tmp_path / "data"),
            "--run-dir", str(tmp_path / "run"), "--uid-base", str(uid(591_000)), *flags]
    # PYTHONPATH kept: a run from another worktree tests its own code, not the venv's.
    kept = {name: os.environ[name] for name in ("PYTHONPATH",) if name in os.environ}
    return subprocess.run(args, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", **kept, **(env or {})})


def _one_clear_line(outcome: subprocess.CompletedProcess, *words: str) -> None:
    assert outcome.returncode == 2, (outcome.returncode, outcome.stderr[-2000:])
    lines = [line for line in outcome.stderr.splitlines()
             if not line.startswith("{")]  # JSON log lines (e.g. a warning) are not the error
    assert len(lines) == 1, outcome.stderr
    assert lines[0].startswith("shoal: "), lines[0]
    assert "Traceback" not in outcome.stderr and "serving on" not in outcome.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("flags, words", [
    (("--launcher", "docker"), ("--launcher=docker", "bwrap, zygote")),
    (("--log-level", "verbose"), ("--log-level=verbose", "debug, info")),
    (("--port", "70000"), ("--port=70000",)),
    (("--pool-size", "many"), ("--pool-size=many", "integer")),
    (("--egress-allow", "pypi.internal,a b"), ("--egress-allow=", "bad host 'a b'")),
    (("--egress-allow", "10.0.0.0/33"), ("bad network",)),
    # An IPv6 literal's port is checked as any other: this entry could never match.
    (("--egress-allow", "[::1]:99999"), ("--egress-allow=[::1]:99999", "bad port")),
    (("--egress-allow", "[fd00::1]:0"), ("bad port",)),
    # Callback hosts are the same kind of entries as the egress allowlist's.
    (("--callback-allow", "bad/host"), ("--callback-allow=bad/host", "bad network")),
    (("--callback-allow", "hooks.example,[::1]:70000"), ("bad port in '[::1]:70000'",)),
    # (uid_t)-1 is "unchanged" to setpriv and setresuid: a sandbox of that uid stays root.
    (("--uid-base", "4294967295", "--uid-count", "1"), ("--uid-base=4294967295", "4294967294")),
    (("--uid-base", "4294967290"), ("uid_base 4294967290, uid_count 4096", "past 4294967294")),
    (("--uid-base", "4294967200", "--uid-count", "96"), ("run to 4294967295",)),
    (("--uid-base", "0"), ("--uid-base=0", "1000")),
    # The server started, and every gateway call was a 502 with httpx's complaint.
    (("--upstream-anthropic-url", "api.anthropic.com"),
     ("--upstream-anthropic-url=api.anthropic.com", "http:// or https://")),
    (("--upstream-openai-url", "ftp://models.internal"), ("--upstream-openai-url=",)),
    (("--upstream-openai-url", "http://models.internal:99999"), ("http:// or https://",)),
])
def test_a_bad_setting_is_one_line_and_exit_2(tmp_path, flags, words):
    _one_clear_line(_refused(tmp_path, *flags), "invalid setting", *words)


def test_shoal_check_names_a_uid_range_that_runs_past_the_last_uid(tmp_path):
    outcome = _refused(tmp_path, "--uid-base", "4294967290", "--uid-count", "16",
                       command="check")
    _one_clear_line(outcome, "invalid setting", "past 4294967294")


@pytest.mark.parametrize("max_sessions", ["1", "100000"])
def test_shoal_check_says_whether_the_hosts_open_file_table_outlasts_the_sandboxes(
        tmp_path, max_sessions):
    """The open-file table is host-wide and a sandbox may hold its processes times
    their RLIMIT_NOFILE: check says, from this host's fs.file-max, whether the
    sandboxes it allows could leave the host none, and how to raise it."""
    table = int(Path("/proc/sys/fs/file-max").read_text())
    outcome = _refused(tmp_path, "--max-sessions", max_sessions, "--pids-limit", "256",
                       command="check")
    assert outcome.returncode == 0, outcome.stderr
    (line,) = [line for line in outcome.stdout.splitlines() if line.startswith("open files:")]
    wanted = int(max_sessions) * 256 * 4096
    if table >= wanted:
        assert f"fs.file-max {table} holds every sandbox's {256 * 4096} at once" in line, line
    else:
        assert f"sysctl -w fs.file-max={wanted}" in line, line


@pytest.mark.parametrize("url, words", [
    ("mysql://shoal:hunter2@127.0.0.1/db", ("--database-url=(not shown)", "postgresql://")),
    ("@/nonexistent/database-url", ("cannot read /nonexistent/database-url",)),
    # A password with a "/" not percent-encoded: the driver's parser would quote it.
    ("postgresql://shoal:hunter2/x@127.0.0.1/shoal", ("database URL does not parse",)),
    # Nothing listens there: the server says so before it serves, password unsaid.
    ("postgresql://shoal:hunter2@127.0.0.1:{port}/shoal",
     ("cannot reach the metadata database at 127.0.0.1:{port}/shoal",)),
])
def test_a_database_that_cannot_be_used_is_one_line_and_exit_2(tmp_path, url, words):
    port = str(free_port())
    outcome = _refused(tmp_path, "--database-url", url.replace("{port}", port))
    _one_clear_line(outcome, *(word.replace("{port}", port) for word in words))
    assert "hunter2" not in outcome.stderr


@pytest.mark.parametrize("command", ["serve", "check"])
@pytest.mark.parametrize("held, words", [
    # A key file with a comment line above the key: the server started, and every
    # gateway call failed with a 502 whose message quoted the header, key and all.
    ("# the production key\nsk-ant-hunter2\n", ("holds more than one line",)),
    ("sk-ant-hunter2\nsk-ant-older-hunter2\n", ("holds more than one line",)),
    # Every gateway call was a 500: httpx encodes a header as ASCII.
    ("\u201csk-ant-hunter2\u201d\n", ("past ASCII",)),
    (None, ("cannot read",)),
])
def test_an_upstream_key_that_cannot_be_sent_is_refused_at_start(tmp_path, command, held,
                                                                 words):
    key = tmp_path / "anthropic-key"
    if held is not None:
        key.write_text(held)
    outcome = _refused(tmp_path, "--upstream-anthropic-url", "http://127.0.0.1:9",
                       "--upstream-anthropic-key", f"@{key}", command=command)
    if command == "serve":
        _one_clear_line(outcome, "upstream_anthropic_key", str(key), *words)
    else:
        assert outcome.returncode == 1, outcome.stderr
        assert "upstream_anthropic_key" in outcome.stderr, outcome.stderr
    assert "hunter2" not in outcome.stdout + outcome.stderr


def test_an_upstream_key_variable_with_a_line_break_is_refused(tmp_path):
    outcome = _refused(tmp_path, env={"SHOAL_UPSTREAM_OPENAI_URL": "http://127.0.0.1:9",
                                      "SHOAL_UPSTREAM_OPENAI_KEY": "sk-hunter2\nsk-older"})
    _one_clear_line(outcome, "upstream_openai_key", "holds more than one line")
    assert "hunter2" not in outcome.stderr


def test_a_bad_environment_variable_is_named(tmp_path):
    outcome = _refused(tmp_path, env={"SHOAL_MAX_SESSIONS": "-3"})
    _one_clear_line(outcome, "SHOAL_MAX_SESSIONS=-3")


def test_a_port_in_use_is_one_line_before_anything_serves(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        outcome = _refused(tmp_path, "--port", str(port))
    _one_clear_line(outcome, f"127.0.0.1:{port}", "in use")


def test_the_banner_of_an_ipv6_listener_is_a_url_that_reaches_it(tmp_path):
    """``serving on`` is the URL a cluster's front ends use to reach a host: an
    IPv6 address needs its brackets there. The open server's warning names the
    same address, the port the kernel chose included, not the ``0`` asked for."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this host")
    process = subprocess.Popen(
        [str(SHOAL), "serve", "--host", "::1", "--port", "0", "--pool-size", "0",
         "--data-dir", str(tmp_path / "data"), "--run-dir", str(DEFAULT_RUN_DIR),
         "--uid-base", str(uid(884_000)), "--uid-count", "8"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={"PATH": "/usr/bin:/bin"})
    try:
        banner, lines = "", []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not banner:
            line = process.stderr.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("shoal: serving on "):
                banner = line.split("serving on ", 1)[1].strip()
        assert banner.startswith("http://[::1]:"), (banner, process.poll())
        assert httpx.get(f"{banner}/livez", timeout=10).status_code == 200
        warning = [line for line in lines if "no tokens configured" in line]
        assert len(warning) == 1 and f"reach {banner} may run code" in warning[0], lines
    finally:
        process.terminate()
        process.wait(30)


def test_a_second_server_on_a_data_dir_is_one_line(tmp_path, server_factory):
    first = server_factory(pool_size=0)
    outcome = _refused(tmp_path, "--port", "0", data_dir=first.data_dir)
    _one_clear_line(outcome, "another Shoal server", f"pid {first.process.pid}",
                    str(first.data_dir))


def test_a_database_from_a_newer_shoal_is_refused_in_one_line(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with sqlite3.connect(data_dir / "shoal.sqlite3") as db:
        db.execute("PRAGMA user_version = 999")
    _one_clear_line(_refused(tmp_path, "--port", "0"), "refusing to start", "newer Shoal")


# -- upgrades -----------------------------------------------------------------------------------
def test_a_server_upgraded_over_a_release_1_data_dir_serves_everything(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with sqlite3.connect(data_dir / "shoal.sqlite3") as db:
        db.executescript(RELEASE_1.read_text())
        # As if the old server had stopped a moment ago, not months ago.
        db.execute("UPDATE containers SET last_active_at = ? WHERE status = 'active'",
                   (time.time(),))
    (tmp_path / "tokens").write_text("tok-acme=acme\ntok-globex=globex\n")
    server = start_server(tmp_path, 882_000, data_dir=data_dir, pool_size=1,
                          tokens=f"@{tmp_path / 'tokens'}")
    try:
        with server.client("tok-acme") as acme:
            listed = acme.get("/v1/containers").json()["data"]
            assert {(c["id"], c["name"]) for c in listed} >= {
                ("cnt_0123456789abcdef01234567", "quarterly")}
            upload = acme.get("/v1/files/file-29d90e7bf41183f28f127e93").json()
            assert upload["filename"] == "notes.txt" and upload["bytes"] == 3
            # What the release could not do works on its data.
            run = acme.post("/v1/code-execution/runs",
                            json={"language": "python", "code": "print(2 + 2)"})
            assert run.status_code == 200, run.text
            created = next(json.loads(line[len("data: "):]) for line in run.text.splitlines()
                           if line.startswith("data: {"))
            record = acme.get(f"/v1/code-execution/runs/{created['runId']}")
            assert record.json()["stdout"] == "4\n", record.text
        with server.client("tok-globex") as globex:
            upload = globex.get("/v1/files/file-a7a583e22e60a1f38d272341",
                                headers={"anthropic-version": "2023-06-01"}).json()
            assert upload["filename"] == "q3 report.pdf" and upload["size_bytes"] == 48213
    finally:
        server.stop()
    with sqlite3.connect(data_dir / "shoal.sqlite3") as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] >= 2
        assert db.execute("SELECT count(*) FROM uploads").fetchone()[0] == 2
        assert db.execute("SELECT count(*) FROM container_files").fetchone()[0] == 2
