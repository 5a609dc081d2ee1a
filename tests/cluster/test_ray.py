"""Cluster mode on a real Ray cluster: front ends routing to one sandbox host per node.

Three ``ray start`` nodes on this machine, each a sandbox host with its own data
directory and uid range, on a real PostgreSQL and a real SeaweedFS; front ends
started with ``shoal serve --cluster``. What is shown, through the public API
only: sessions spread over the nodes and every call, stream and inner tool call
reaches the session's node through any front end; a container's files survive
``kill -9`` of its node and come back on another node, an upload acknowledged
just before included, and the next call says the interpreter restarted; a
session on the dead node is gone (404), never reported live.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from httpx_sse import connect_sse

from shoal.cluster.host import key_length
from shoal.config import Settings
from shoal.storage.snapshots import Snapshots
from tests.api.contract import load_contract, schema_checker
from tests.api.test_conformance import assert_conformant, run_checks
from tests.serving import start_server

from .conftest import RayCluster

pytestmark = pytest.mark.cluster

TOOL = {"type": "function", "name": "lookup", "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                       "required": ["word"]}}


@pytest.fixture
def cluster(postgres_url, seaweedfs, tmp_path):
    bucket = seaweedfs.new_bucket()
    ray = RayCluster(3, postgres_url, seaweedfs, bucket, uid_base=970_000)
    fronts = []

    def front_end(name: str, hosts: int = 3):
        secret = tmp_path / f"{name}.secret"
        secret.write_text(seaweedfs.secret_key)
        server = start_server(tmp_path / name, uid_base=976_000, cluster=ray.address,
                              database_url=postgres_url, object_store=f"s3://{bucket}/shoal",
                              object_store_endpoint=seaweedfs.endpoint,
                              object_store_access_key=seaweedfs.ACCESS_KEY,
                              object_store_secret_key=f"@{secret}")
        fronts.append(server)
        deadline = time.monotonic() + 180  # every node's host started and answering
        while httpx.get(f"{server.url}/health").json()["ready"] < hosts:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.5)
        return server

    ray.front_end = front_end
    ray.bucket, ray.database_url, ray.seaweedfs = bucket, postgres_url, seaweedfs
    try:
        yield ray
    finally:
        for server in fronts:
            server.stop()
        ray.stop()


def _exec(http, session_id: str, code: str) -> dict:
    answer = http.post(f"/sessions/{session_id}/exec",
                       json={"tool": "code_execution", "input": {"code": code}})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _host_of(identifier: str) -> str:
    return identifier[:key_length()]


def test_sessions_spread_over_the_nodes_and_every_call_reaches_its_node(cluster):
    front = cluster.front_end("front")
    with front.client() as http:
        sessions = [http.post("/sessions", json={}).json()["session_id"] for _ in range(3)]
        # Ray's scheduler placed them where most slots were free: one on each node.
        assert len({_host_of(s) for s in sessions}) == 3, sessions
        # And Ray's view of the room is the hosts': each holds one of its six slots
        # (the probe that placed it, adopted: never given back and taken again).
        _free_slots_become(cluster, 3 * 6 - 3)
        # The front end's /health says what Ray has left to place.
        deadline = time.monotonic() + 10
        while http.get("/health").json()["free_slots"] != 3 * 6 - 3:
            assert time.monotonic() < deadline, http.get("/health").text
            time.sleep(0.2)
        # Only a front end places: a client's own probe header goes nowhere.
        forged = http.post("/sessions", json={}, headers={"Shoal-Slot-Probe": "shoal-probe-x"})
        assert forged.status_code == 201 and "shoal-slot-probe" not in forged.headers
        assert http.delete(f"/sessions/{forged.json()['session_id']}").status_code == 204
        _free_slots_become(cluster, 3 * 6 - 3)
        for index, session in enumerate(sessions):
            _exec(http, session, f"n = {index}")
        # State stays on each session's node: every call found its interpreter.
        assert [_exec(http, s, "print(n)")["result_block"]["content"]["stdout"]
                for s in sessions] == ["0\n", "1\n", "2\n"]
        # A streamed call through the front end: output events, then the result.
        with connect_sse(http, "POST", f"/sessions/{sessions[1]}/exec",
                         json={"tool": "code_execution", "input": {
                             "code": "import time\nfor i in range(3):\n"
                                     "    print(i, flush=True); time.sleep(0.2)"}}) as events:
            names = [sse.event for sse in events.iter_sse()]
        assert "output" in " ".join(names) and names[-1] in ("result", "done"), names

        # A run whose code calls the client's tool: the tool call travels to the
        # client through the front end, and its answer back to the run's node.
        with connect_sse(http, "POST", "/v1/code-execution/runs", json={
                "code": "print(lookup(word='shoal'))", "tools": [TOOL],
                "allowed_tools": ["lookup"]}) as events:
            for sse in events.iter_sse():
                if sse.event == "tool_call.required":
                    data = sse.json()
                    answered = http.post(
                        f"/v1/code-execution/runs/{data['runId']}/tool-results",
                        json={"results": [{"call_id": data["calls"][0]["call_id"],
                                           "output": "a school of fish"}]})
                    assert answered.status_code == 200, answered.text
                elif sse.event == "run.completed":
                    completed = sse.json()
        assert completed["stdout"] == "a school of fish\n", completed
        record = http.get(f"/v1/code-execution/runs/{completed['runId']}").json()
        assert record["status"] == "completed" and record["inner_tool_calls"] == 1, record

        # The protocol owner's conformance checks, through the front end.
        assert_conformant(run_checks(http, schema_checker(load_contract())))

        # Admission control: once every host's session slots are taken (six each),
        # a new session is a 503 with Retry-After, never a queue.
        def fill() -> httpx.Response:
            for _ in range(3 * 6):
                made = http.post("/sessions", json={})
                if made.status_code != 201:
                    return made
            return made

        made = fill()
        assert made.status_code == 503 and made.headers["retry-after"], made.text
        assert made.json()["detail"], made.text  # the protocol's error shape, with a reason
        # The front end's own answers are in the dialect of the route, as a host's are.
        # (A slot an earlier step was still giving back may come free meanwhile, and
        # Ray's count of a host's slots converges on the host's within seconds: a
        # slot free by Ray's count is taken again, so the cluster is full when the
        # check is made.)
        deadline = time.monotonic() + 30
        while True:
            refused = http.post("/v1/messages",
                                json={"model": "m", "max_tokens": 8, "messages": []})
            if refused.status_code == 503 or time.monotonic() > deadline:
                break
            fill()
            time.sleep(0.5)
        assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
        assert refused.json()["type"] == "error" and refused.json()["error"]["message"], refused.text
        # A body over the cap is refused before the front end holds it, in the same way.
        huge = http.post("/v1/messages", content=b"{" + b" " * (70 << 20) + b"}",
                         headers={"content-type": "application/json"})
        assert huge.status_code == 413 and huge.json()["type"] == "error", huge.text[:300]


def test_a_container_comes_back_on_another_node_after_kill_9_of_its_node(cluster, tmp_path):
    first, second = cluster.front_end("a"), cluster.front_end("b")
    data = os.urandom(1 << 20)
    with first.client() as one, second.client() as two:
        container = one.post("/v1/containers", json={"name": "kept"}).json()["id"]
        session = one.post("/sessions", json={"container": container}).json()["session_id"]
        node = _host_of(session)
        wrote = _exec(one, session, "state = 1\nopen('notes.txt', 'w').write('kept\\n')")
        assert wrote["result_block"]["content"]["return_code"] == 0, wrote
        # The other front end reaches the same container, on the same node.
        other = two.post("/sessions", json={"container": container}).json()["session_id"]
        assert _host_of(other) == node
        uploaded = two.post(f"/v1/containers/{container}/files", files={"file": ("d.bin", data)})
        assert uploaded.status_code == 200, uploaded.text
        time.sleep(2)  # one snapshot cadence: the code's file is in the bucket too

        node_id, index = next((n, i) for n, i in _ray_nodes(cluster).items()
                              if n.startswith(node[1:]))
        cluster.kill_node(node_id)  # acknowledged, and then the node dies at once
        # Another container the dead host held, snapshotted, and idle an hour:
        # no one uses it again, so a live host reaps it, snapshot and all.
        orphan, home = "cnt_orphan", tmp_path / "orphan"
        (home / "workspace").mkdir(parents=True)
        (home / "workspace" / "o.txt").write_text("o")
        snapshots = Snapshots(cluster.seaweedfs.client(), cluster.bucket, "shoal/")
        snapshots.save("default", orphan, home, None, sandboxed=True)
        idle = time.time() - 3600  # past its TTL (20 minutes), not a day: kept retired
        _sql(cluster, "INSERT INTO containers (tenant, id, name, created_at, last_active_at, "
             "expires_after_minutes, status, implicit) VALUES ('default', $1, 'orphan', $2, $2, "
             "20, 'active', 0)", orphan, idle)
        _sql(cluster, "INSERT INTO placements (tenant, id, host, since) VALUES ('default', $1, "
             "$2, $3)", orphan, node, idle)

        # Until Ray declares the node dead the front end says to retry; then the
        # container moves to a live node, which restores it from its snapshot.
        deadline = time.monotonic() + 90
        while True:
            moved = two.post("/sessions", json={"container": container})
            if moved.status_code == 201:
                break
            assert moved.status_code == 503 and time.monotonic() < deadline, moved.text
            time.sleep(0.5)
        again = moved.json()["session_id"]
        assert _host_of(again) != node
        found = _exec(two, again, (
            "import hashlib\nprint(open('notes.txt').read(), end='')\n"
            "print(hashlib.sha256(open('/mnt/user-data/uploads/d.bin', 'rb').read()).hexdigest())\n"
            "print('state' in globals())"))
        assert found["result_block"]["content"]["stdout"].splitlines() == [
            "kept", hashlib.sha256(data).hexdigest(), "False"], found
        assert found["interpreter_restarted"] is True
        # The session on the dead node is gone, not reported live (and releasing
        # it is the desired state already). The first front end learns of the death
        # on its own next refresh (every second): until then its answer is a 503
        # to retry, never a success.
        deadline = time.monotonic() + 10
        while True:
            gone = one.post(f"/sessions/{session}/exec", json={
                "tool": "code_execution", "input": {"code": "1"}})
            if gone.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert gone.status_code == 404, gone.text
        assert one.delete(f"/sessions/{session}").status_code == 204
    deadline = time.monotonic() + 60
    while _sql(cluster, "SELECT status FROM containers WHERE id = $1", orphan) != [("expired",)]:
        assert time.monotonic() < deadline, "no host reaped the gone host's expired container"
        time.sleep(0.5)
    assert snapshots.manifest("default", orphan) is None
    assert _sql(cluster, "SELECT host FROM placements WHERE id = $1", orphan) == []
    # Nothing the dead host held stays reserved: Ray counts the live nodes' slots
    # less the one session they hold (a probe the dead host had adopted, which
    # Ray moves to a live node, is swept by that node's host).
    _free_slots_become(cluster, 2 * 6 - 1, seconds=60)
    _sweep_killed(cluster, index, tmp_path)


def _drained_during_a_call(cluster, front, http, seconds: int) -> tuple[str, str, str]:
    """A container's session, a call of ``seconds`` running in it, and its host
    drained (SIGTERM) a second into the call: the call finishes whole, and the
    front end drops the host. The call wrote late.txt as it ended. Returns the
    container, the session and the node it was on."""
    container = http.post("/v1/containers", json={"name": "draining"}).json()["id"]
    session = http.post("/sessions", json={"container": container}).json()["session_id"]
    node = _host_of(session)
    answers = []

    def long_call() -> None:
        with front.client() as own:
            answers.append(own.post(f"/sessions/{session}/exec", json={
                "tool": "code_execution", "input": {"code": (
                    f"import time\ntime.sleep({seconds})\n"
                    "open('late.txt', 'w').write('finished')\nprint('done')")}}))

    caller = threading.Thread(target=long_call)
    caller.start()
    time.sleep(1)  # the call is running on the host
    os.kill(cluster.host_server(node), signal.SIGTERM)  # the operator drains the node
    caller.join(60)
    # The call in flight finished, whole, before the host stopped.
    assert answers and answers[0].status_code == 200, answers
    assert answers[0].json()["result_block"]["content"]["stdout"] == "done\n"

    deadline = time.monotonic() + 60
    while http.get("/health").json()["hosts"] != 2:
        assert time.monotonic() < deadline, front.log()
        time.sleep(0.5)
    return container, session, node


def test_a_drained_host_finishes_its_calls_then_its_containers_move(cluster):
    front = cluster.front_end("front")
    with front.client() as http:
        container, session, node = _drained_during_a_call(cluster, front, http, seconds=3)
        # Ray sees the drained node full: only the other two nodes' slots are free.
        _free_slots_become(cluster, 2 * 6)
        # Drained: nothing new goes there, its session is gone, and the container
        # moves with everything the last call wrote (snapshotted as the host stopped).
        # The body that moves it has no content type, which hosts read as JSON too.
        moved = http.post("/sessions", content=json.dumps({"container": container}))
        assert moved.status_code == 201, moved.text
        again = moved.json()["session_id"]
        assert _host_of(again) != node
        found = _exec(http, again, "print(open('late.txt').read())")
        assert found["result_block"]["content"]["stdout"] == "finished\n", found
        assert found["interpreter_restarted"] is True
        assert http.post(f"/sessions/{session}/exec", json={
            "tool": "code_execution", "input": {"code": "1"}}).status_code == 404
        fresh = [http.post("/sessions", json={}).json()["session_id"] for _ in range(4)]
        assert node not in {_host_of(s) for s in fresh}
        # A front end started after the drain knows the drained host as drained
        # from its first answer: it took the actor (which outlives its server)
        # for a host that serves, counted it, and sent it what it held, until
        # three unanswered polls later.
        late = cluster.front_end("late", hosts=2)
        with late.client() as other:
            assert other.get("/health").json()["hosts"] == 2
            found = _exec(other, again, "print(open('late.txt').read())")
            assert found["result_block"]["content"]["stdout"] == "finished\n", found
        late.process.send_signal(signal.SIGTERM)
        assert late.process.wait(60) is not None

        # The front end drains too: at SIGTERM its /readyz fails at once, for the
        # balancer, while it goes on serving, and a call it relays finishes.
        answers = []
        relayed = threading.Thread(target=lambda: answers.append(http.post(
            f"/sessions/{again}/exec", json={"tool": "code_execution", "input": {
                "code": "import time\ntime.sleep(3)\nprint('relayed')"}})))
        relayed.start()
        time.sleep(1)
        front.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with front.client() as other:
            ready = other.get("/readyz")
            assert (ready.status_code, ready.json()) == (503, {"ready": False,
                                                               "reasons": ["draining"]})
            assert other.get("/v1/containers").status_code == 200  # still serving
        relayed.join(60)
        assert answers and answers[0].status_code == 200, answers
        assert answers[0].json()["result_block"]["content"]["stdout"] == "relayed\n"
        assert front.process.wait(60) is not None


def test_a_drain_longer_than_three_seconds_is_not_cut_short(cluster):
    """A host server and a front end are Ray drivers, and Ray's crash handler
    (abseil's) took their SIGTERM: it passed the signal on to the drain, but
    armed an alarm that aborted the process three seconds later. A drain that
    took longer (a call still running, containers to snapshot, a loaded
    machine) ended in SIGABRT: the call was cut, and the host, dead by a signal
    that is no drain, was replaced on the node it was leaving while its
    containers waited for it ("starting; retry"). A drain as long as the
    shutdown grace allows runs to its end."""
    front = cluster.front_end("front")
    with front.client() as http:
        container, _session, node = _drained_during_a_call(cluster, front, http, seconds=6)
        # Drained, not dead: the container moves at once, with what the call wrote.
        moved = http.post("/sessions", json={"container": container})
        assert moved.status_code == 201, moved.text
        again = moved.json()["session_id"]
        assert _host_of(again) != node
        found = _exec(http, again, "print(open('late.txt').read())")
        assert found["result_block"]["content"]["stdout"] == "finished\n", found
        # And no new host was started on the node that left.
        time.sleep(2)
        assert http.get("/health").json()["hosts"] == 2

        # The front end's own drain, as long: the call it relays finishes, and it
        # exits by the signal it was sent.
        answers = []
        relayed = threading.Thread(target=lambda: answers.append(http.post(
            f"/sessions/{again}/exec", json={"tool": "code_execution", "input": {
                "code": "import time\ntime.sleep(6)\nprint('relayed')"}})))
        relayed.start()
        time.sleep(1)
        front.process.send_signal(signal.SIGTERM)
        relayed.join(60)
        assert answers and answers[0].status_code == 200, answers
        assert answers[0].json()["result_block"]["content"]["stdout"] == "relayed\n"
        assert front.process.wait(60) == -signal.SIGTERM


def test_a_crashed_host_is_passed_over_at_once_then_replaced(cluster):
    """``kill -9`` of a host's server, its node alive. Ray still offers the node's
    slots (and once the server's Ray job is seen to end, all of them), so new
    sandboxes are placed there until the front end knows better: a refused
    connection places the request again elsewhere, and a host that missed a poll
    is passed over (its node closed) at once, not only once its actor is asked
    and it is replaced. So creating sessions works within a poll of the crash,
    no session handed out is on the dead server, its own sessions answer 404,
    and the node then gets a new host that takes sessions again."""
    front = cluster.front_end("front")
    with front.client() as http:
        held = [http.post("/sessions", json={}).json()["session_id"] for _ in range(3)]
        node = _host_of(held[0])
        os.kill(cluster.host_server(node), signal.SIGKILL)
        killed = time.monotonic()
        answers = []
        while time.monotonic() - killed < 6:
            created = http.post("/sessions", json={})
            elapsed = time.monotonic() - killed
            if created.status_code == 503:
                # Only in the first moment, before any poll saw the host silent,
                # and then in the protocol's shape, to retry.
                assert elapsed < 2.5, (elapsed, created.text)
                assert created.headers["retry-after"] and created.json()["detail"], created.text
            else:
                assert created.status_code == 201, (elapsed, created.text)
                session = created.json()["session_id"]
                assert _exec(http, session, "print(6 * 7)")["result_block"]["content"][
                    "stdout"] == "42\n"
                assert http.delete(f"/sessions/{session}").status_code == 204
            answers.append((elapsed, created.status_code))
        assert [code for elapsed, code in answers if elapsed > 2.5].count(201) >= 3, answers
        # Before that first poll, a create Ray placed on the dead server is placed
        # again on a live one: a 503 only when every try landed there. (Answering
        # each refused connection with a 503 instead gave some 18 in that second.)
        assert [code for _, code in answers].count(503) <= 6, answers
        # The session on the dead server is gone, not answered as live.
        deadline = time.monotonic() + 60
        while (gone := http.post(f"/sessions/{held[0]}/exec", json={
                "tool": "code_execution", "input": {"code": "1"}})).status_code == 503:
            assert time.monotonic() < deadline, gone.text
            time.sleep(0.5)
        assert gone.status_code == 404, gone.text
        # A new host on the node (same key: it is the node's) takes sessions again.
        deadline = time.monotonic() + 120
        landed = None
        while landed is None:
            assert time.monotonic() < deadline, front.log()
            created = http.post("/sessions", json={})
            if created.status_code == 201:
                session = created.json()["session_id"]
                if _host_of(session) == node:
                    landed = session
                else:
                    held.append(session)  # kept, so Ray's spread turns to the new host
            time.sleep(0.2)
        assert _exec(http, landed, "print('back')")["result_block"]["content"]["stdout"] == "back\n"
        for session in [*held, landed]:
            assert http.delete(f"/sessions/{session}").status_code == 204
    # Nothing stays reserved: not the dead server's, not a probe given back.
    _free_slots_become(cluster, 3 * 6, seconds=60)


def test_a_request_without_a_tenants_token_asks_ray_for_no_slot(postgres_url, seaweedfs,
                                                                tmp_path):
    """With tenants' tokens, a request that would start a sandbox but carries no
    tenant's token goes to a host, which refuses it (401), without a slot asked
    of Ray's scheduler first: on a full cluster it is still a 401 (it was a 503,
    to retry), and a flood of them does not queue on Ray before the tenants'
    placements."""
    bucket = seaweedfs.new_bucket()
    ray = RayCluster(1, postgres_url, seaweedfs, bucket, uid_base=980_000,
                     settings={"SHOAL_TOKENS": "tok-a=alpha"})
    front = None
    try:
        secret = tmp_path / "front.secret"
        secret.write_text(seaweedfs.secret_key)
        front = start_server(tmp_path / "front", uid_base=982_000, cluster=ray.address,
                             tokens="tok-a=alpha", database_url=postgres_url,
                             object_store=f"s3://{bucket}/shoal",
                             object_store_endpoint=seaweedfs.endpoint,
                             object_store_access_key=seaweedfs.ACCESS_KEY,
                             object_store_secret_key=f"@{secret}")
        deadline = time.monotonic() + 180
        while httpx.get(f"{front.url}/health").json()["ready"] < 1:
            assert time.monotonic() < deadline, front.log()
            time.sleep(0.5)
        with front.client("tok-a") as tenant, front.client() as anonymous, \
                front.client("not-a-token") as wrong:
            # The node's six slots taken (Ray's count converging on the host's).
            deadline = time.monotonic() + 30
            while (made := tenant.post("/sessions", json={})).status_code == 201:
                assert time.monotonic() < deadline, made.text
            assert made.status_code == 503, made.text
            for http in (anonymous, wrong):
                for path, body in (("/sessions", {}), ("/sessions", {"container": "c-1"}),
                                   ("/v1/code-execution/runs", {"code": "1"})):
                    refused = http.post(path, json=body)
                    assert refused.status_code == 401, (path, refused.status_code, refused.text)
    finally:
        if front is not None:
            front.stop()
        ray.stop()


def _sql(cluster, sql: str, *args) -> list[tuple]:
    import asyncio

    import asyncpg

    async def run() -> list[tuple]:
        db = await asyncpg.connect(cluster.database_url)
        try:
            return [tuple(row) for row in await db.fetch(sql, *args)]
        finally:
            await db.close()
    return asyncio.run(run())


def _free_slots_become(cluster, expected: int, seconds: float = 30) -> None:
    """Wait until Ray counts ``expected`` unreserved ``shoal_slot`` units."""
    import ray

    ray.init(address=cluster.address, logging_level="error", log_to_driver=False)
    try:
        deadline = time.monotonic() + seconds
        while (free := int(ray.available_resources().get("shoal_slot", 0))) != expected:
            assert time.monotonic() < deadline, f"{free} shoal_slot free, not {expected}"
            time.sleep(0.2)
    finally:
        ray.shutdown()


def _ray_nodes(cluster) -> dict[str, int]:
    """Alive nodes' ids, each with its index in the cluster (its ``node<i>`` resource)."""
    import ray

    ray.init(address=cluster.address, logging_level="error", log_to_driver=False)
    try:
        return {n["NodeID"]: next(int(r[4:]) for r in n["Resources"] if r[:4] == "node"
                                  and r[4:].isdigit())
                for n in ray.nodes() if n["Alive"] and "shoal_host" in n["Resources"]}
    finally:
        ray.shutdown()


def _sweep_killed(cluster, index: int, tmp_path) -> None:
    """The killed host's leftovers (sandboxes, mounts) go with a server's next
    start on its data directory."""
    node = cluster.nodes[index]
    env = node["env"]
    (tmp_path / "sweep").mkdir()
    # On the host's own run directory too, where its containers' volumes were mounted.
    run_dir = Path(env.get("SHOAL_RUN_DIR") or Settings.model_fields["run_dir"].default)
    start_server(tmp_path / "sweep", uid_base=node["uid_base"], data_dir=Path(node["data_dir"]),
                 run_dir=run_dir,
                 database_url=env["SHOAL_DATABASE_URL"], object_store=env["SHOAL_OBJECT_STORE"],
                 object_store_endpoint=env["SHOAL_OBJECT_STORE_ENDPOINT"],
                 object_store_access_key=env["SHOAL_OBJECT_STORE_ACCESS_KEY"],
                 object_store_secret_key=env["SHOAL_OBJECT_STORE_SECRET_KEY"]).stop()
