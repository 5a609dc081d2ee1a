"""/metrics: every value moves with the events it counts, and only with them.

Each test reads the Prometheus text of a real server, makes events happen over
HTTP (calls of each tool kind, limits that fire, sessions leased and released,
warm sandboxes leased), reads again and checks the differences exactly. The
servers are this module's own, so no other test's calls are counted.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, tuple[tuple[str, str], ...]]
TOOLS = ("code_execution", "bash_code_execution", "text_editor_code_execution")
LIMITS = ("timeout", "output", "memory", "pids", "disk")
OUTPUT_CAP = 4096


def read_metrics(client) -> dict[Sample, float]:
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def value(values: dict[Sample, float], name: str, **labels: str) -> float:
    """A sample's value; a labelled series that never happened reads 0."""
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def changes(before: dict[Sample, float], after: dict[Sample, float], prefix: str) -> dict:
    """Samples named ``prefix...`` whose value differs, with the difference."""
    names = {key for key in (*before, *after)
             if key[0].startswith(prefix) and not key[0].endswith("_created")}
    return {key: after.get(key, 0.0) - before.get(key, 0.0) for key in names
            if after.get(key, 0.0) != before.get(key, 0.0)}


@pytest.fixture(scope="module")
def server(server_factory):
    """This module's server, in place of conftest's: its client and session_id use it."""
    return server_factory(pool_size=1, max_sessions=8, memory_limit_mib=128,
                          output_cap_bytes=OUTPUT_CAP, max_timeout_seconds=30)


def _exec(client, session_id: str, tool: str, timeout: int | None = None, **tool_input) -> dict:
    body: dict = {"tool": tool, "input": tool_input}
    if timeout is not None:
        body["timeout_seconds"] = timeout
    response = client.post(f"/sessions/{session_id}/exec", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_every_metric_is_served(client):
    types = {family.name: family.type
             for family in text_string_to_metric_families(client.get("/metrics").text)}
    assert types == {
        "shoal_http_requests": "counter", "shoal_http_request_seconds": "histogram",
        "shoal_exec_seconds": "histogram", "shoal_limits_fired": "counter",
        "shoal_sandbox_launches": "counter", "shoal_sandbox_launch_failures": "counter",
        "shoal_sandbox_crashes": "counter", "shoal_sandbox_oom_kills": "counter",
        "shoal_sandbox_restarts": "counter", "shoal_zygote_restarts": "counter",
        "shoal_sessions_live": "gauge", "shoal_sessions_max": "gauge",
        "shoal_pool_ready": "gauge", "shoal_pool_target": "gauge", "shoal_uids_free": "gauge",
        "shoal_ready": "gauge", "shoal_containers_active": "gauge",
        "shoal_container_disk_bytes": "gauge", "shoal_tenant_sessions": "gauge",
        "shoal_tenant_exec_seconds": "counter", "shoal_tenant_calls": "counter"}, types


def test_exec_counts_move_per_tool_and_only_for_calls_that_ran(client, session_id):
    before = read_metrics(client)
    for n in range(3):
        assert _exec(client, session_id, "code_execution", code=f"print({n})")[
            "result_block"]["content"]["stdout"] == f"{n}\n"
    _exec(client, session_id, "bash_code_execution", command="echo one")
    _exec(client, session_id, "bash_code_execution", command="sleep 0.3")
    _exec(client, session_id, "text_editor_code_execution", command="create", path="m.txt",
          file_text="x")
    # Refused requests run nothing and count nothing.
    assert client.post(f"/sessions/{session_id}/exec", json={
        "tool": "code_execution", "input": {}}).status_code == 422
    assert client.post(f"/sessions/{session_id}/exec", json={
        "tool": "no_such_tool", "input": {}}).status_code == 400
    after = read_metrics(client)
    counts = {tool: value(after, "shoal_exec_seconds_count", tool=tool)
              - value(before, "shoal_exec_seconds_count", tool=tool) for tool in TOOLS}
    assert counts == {"code_execution": 3, "bash_code_execution": 2,
                      "text_editor_code_execution": 1}, counts
    # The time the calls took is summed per tool: the bash calls include a 0.3 s sleep.
    bash_seconds = (value(after, "shoal_exec_seconds_sum", tool="bash_code_execution")
                    - value(before, "shoal_exec_seconds_sum", tool="bash_code_execution"))
    assert 0.3 <= bash_seconds, bash_seconds
    # Every call lands in the +Inf bucket; the 0.3 s sleep is not under 0.25 s.
    assert (value(after, "shoal_exec_seconds_bucket", tool="bash_code_execution", le="+Inf")
            - value(before, "shoal_exec_seconds_bucket", tool="bash_code_execution",
                    le="+Inf")) == 2
    assert (value(after, "shoal_exec_seconds_bucket", tool="bash_code_execution", le="0.25")
            - value(before, "shoal_exec_seconds_bucket", tool="bash_code_execution",
                    le="0.25")) <= 1
    # No limit fired for any of them.
    assert changes(before, after, "shoal_limits_fired") == {}


def test_limits_fired_count_each_limit_that_stopped_or_cut_a_call(client, session_id):
    before = read_metrics(client)
    timed_out = _exec(client, session_id, "bash_code_execution", timeout=1, command="sleep 30")
    assert timed_out["limits"] == ["timeout"], timed_out["limits"]
    middle = read_metrics(client)
    assert changes(before, middle, "shoal_limits_fired") == {
        ("shoal_limits_fired_total", (("limit", "timeout"),)): 1.0}
    cut = _exec(client, session_id, "bash_code_execution", command=f"head -c {4 * OUTPUT_CAP} /dev/zero | tr '\\0' x")
    assert cut["limits"] == ["output"], cut["limits"]
    killed = _exec(client, session_id, "code_execution",
                   code="b = bytearray(512 * 1024 * 1024)\nprint(len(b))")
    assert "memory" in killed["limits"], killed["limits"]
    fine = _exec(client, session_id, "code_execution", code="print('fine')")
    assert fine["limits"] == []
    after = read_metrics(client)
    fired = {limit: value(after, "shoal_limits_fired_total", limit=limit)
             - value(before, "shoal_limits_fired_total", limit=limit) for limit in LIMITS}
    assert fired == {"timeout": 1, "output": 1, "memory": 1, "pids": 0, "disk": 0}, fired


def test_sessions_live_follows_leases_and_releases(client):
    def live() -> float:
        values = read_metrics(client)
        assert value(values, "shoal_sessions_live") == client.get("/health").json()["sessions"]
        return value(values, "shoal_sessions_live")

    start = live()
    ids = []
    for n in range(1, 4):
        response = client.post("/sessions", json={})
        assert response.status_code == 201, response.text
        ids.append(response.json()["session_id"])
        assert live() == start + n
    assert client.delete(f"/sessions/{ids.pop()}").status_code == 204
    assert live() == start + 2
    # Releasing an id that is not live changes nothing.
    assert client.delete("/sessions/" + "0" * 32).status_code == 204
    assert live() == start + 2
    for session_id in ids:
        client.delete(f"/sessions/{session_id}")
    assert live() == start


def _pool_ready(client) -> float:
    """The pool's ready count as /metrics says it, checked against /health. A pool
    that refills between the two reads moves on: the pair must agree once it is
    still (metrics, health, metrics all equal)."""
    seen = None
    for _ in range(200):
        before = value(read_metrics(client), "shoal_pool_ready")
        health = client.get("/health").json()["pool_ready"]
        after = value(read_metrics(client), "shoal_pool_ready")
        if before == health == after:
            return before
        seen = (before, health, after)
        time.sleep(0.05)
    raise AssertionError(f"/metrics and /health never agreed on pool_ready: {seen}")


def _wait_for_pool(client, expected: float, timeout: float = 120) -> float:
    deadline = time.monotonic() + timeout
    ready = _pool_ready(client)
    while ready != expected and time.monotonic() < deadline:
        time.sleep(0.1)
        ready = _pool_ready(client)
    return ready


def test_pool_ready_counts_warm_sandboxes_down_on_a_lease(server_factory):
    """A pool of size 0 keeps only the sandbox its start launched to prove isolation
    works: the gauge reads 1, a lease takes it (0), and nothing refills it."""
    empty = server_factory(pool_size=0, max_sessions=2)
    with empty.client() as http:
        assert _pool_ready(http) == 1
        session_id = http.post("/sessions", json={}).json()["session_id"]
        assert _pool_ready(http) == 0
        assert http.delete(f"/sessions/{session_id}").status_code == 204
        time.sleep(1)  # a refill, if there were one, is under way by now
        assert _pool_ready(http) == 0


def test_pool_ready_reports_the_refilled_pool(server_factory):
    warm = server_factory(pool_size=2, max_sessions=4)
    with warm.client() as http:
        assert _wait_for_pool(http, 2) == 2
        ids = [http.post("/sessions", json={}).json()["session_id"] for _ in range(2)]
        # Both warm sandboxes were leased; the pool refills to its size, never beyond.
        assert _wait_for_pool(http, 2) == 2
        for session_id in ids:
            http.delete(f"/sessions/{session_id}")
        time.sleep(1)
        assert _pool_ready(http) == 2
