"""Front ends on one PostgreSQL database: ``shoal serve --database-url``.

Real servers on a real PostgreSQL. What is shown: the metadata lives in the
database (it survives the front end, and is what another front end reads), two
front ends racing to create one client-named container both answer with it
(that exactly one creation wins is the store's and the manager's tests), and a
database that cannot be used stops the server at start-up in one line
(tests/api/test_operability.py, which needs no database).
Container files move between front ends through the object store's snapshots
(test_container_snapshots.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import time

import asyncpg
import pytest

from shoal.cluster.host import key_length
from tests.serving import start_server

pytestmark = pytest.mark.cluster


def rows(url: str, sql: str) -> list:
    async def fetch():
        db = await asyncpg.connect(url)
        try:
            return [tuple(row) for row in await db.fetch(sql)]
        finally:
            await db.close()
    return asyncio.run(fetch())


def test_metadata_lives_in_the_database_and_outlives_the_front_end(postgres_url, tmp_path):
    server = start_server(tmp_path, uid_base=960_000, database_url=postgres_url, pool_size=1)
    try:
        with server.client() as http:
            made = http.post("/v1/containers", json={"name": "kept"})
            assert made.status_code == 200, made.text
            container_id = made.json()["id"]
    finally:
        server.stop()
    # In the database, not in the data directory's SQLite file.
    assert rows(postgres_url, "SELECT id, name, status FROM containers") == [
        (container_id, "kept", "active")]
    assert not (server.data_dir / "shoal.sqlite3").exists()
    again = start_server(tmp_path, uid_base=960_000, data_dir=server.data_dir,
                         database_url=postgres_url, pool_size=1)
    try:
        with again.client() as http:
            listed = http.get("/v1/containers").json()["data"]
            assert [c["id"] for c in listed] == [container_id]
    finally:
        again.stop()


def test_two_front_ends_share_containers_and_take_racing_writes_to_a_new_thread(postgres_url, tmp_path):
    first = start_server(tmp_path / "a", uid_base=961_000, database_url=postgres_url, pool_size=1)
    second = start_server(tmp_path / "b", uid_base=962_000, database_url=postgres_url, pool_size=1)
    try:
        with first.client() as one, second.client() as two:
            made = one.post("/v1/containers", json={"name": "shared"}).json()
            seen = two.get(f"/v1/containers/{made['id']}")
            assert seen.status_code == 200 and seen.json()["name"] == "shared", seen.text
            # Zylon's threads name their container: both front ends, at once, on
            # ids no container has yet. Each id ends up one container, and every
            # write is acknowledged.
            for round in range(5):
                thread = f"thread-{round}"
                with concurrent.futures.ThreadPoolExecutor(8) as workers:
                    answers = list(workers.map(
                        lambda i: (one, two)[i % 2].put(
                            f"/api/v1/app/thread/{thread}/put-file/f{i}.txt", content=b"x"),
                        range(8)))
                assert [a.status_code for a in answers] == [201] * 8, [a.text for a in answers]
                # Every write answered (the loser of the creation race takes the
                # winner's container rather than failing), and one row, active.
                assert rows(postgres_url, "SELECT status FROM containers WHERE id = "
                            f"'{thread}'") == [("active",)]
                for http in (one, two):
                    assert http.get(f"/v1/containers/{thread}").status_code == 200
    finally:
        first.stop()
        second.stop()


def test_a_database_that_cannot_answer_is_a_503_then_serves_again(tmp_path):
    """PostgreSQL stops (a restart, a failover): what needs it is a 503 with
    Retry-After in the route's dialect, on a server and on a cluster front end
    (which looks up where a container is placed), never a 500 that says a bug;
    once the database is back, the same server serves again, its pool
    reconnected."""
    import httpx

    from shoal.cluster.frontend import create_front_end
    from shoal.config import Settings

    from .conftest import Postgres

    database = Postgres()
    try:
        url = database.new_database()
        server = start_server(tmp_path / "plain", uid_base=978_000, database_url=url)
        app = create_front_end(Settings(data_dir=tmp_path / "front", run_dir=tmp_path / "run",
                                        database_url=url, cluster="127.0.0.1:1"))
        front = app.state.front_end

        async def through_the_front_end_with_the_database_stopped(path: str) -> httpx.Response:
            # Ray is not needed on this path: a container's request asks the
            # database where the container is before it asks Ray anything.
            await front.metadata.open()
            try:
                database.halt()
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://front") as http:
                    return await http.get(path)
            finally:
                await front.metadata.close()

        try:
            with server.client() as http:
                container = http.post("/v1/containers", json={"name": "c"}).json()["id"]
                answer = asyncio.run(through_the_front_end_with_the_database_stopped(
                    f"/v1/containers/{container}"))
                assert answer.status_code == 503 and answer.headers["retry-after"], answer.text
                assert answer.json()["error"]["type"] == "server_error", answer.text
                for method, path, shape in (
                        ("GET", f"/v1/containers/{container}", "error"),
                        ("GET", "/v1/containers", "error"),
                        ("POST", "/sessions", "detail"),  # on a container
                        ("PUT", "/api/v1/app/thread/t-1/put-file/a.txt", "detail")):
                    answer = http.request(method, path, json={"container": "t-2"}
                                          if method == "POST" else None)
                    assert answer.status_code == 503, (path, answer.status_code, answer.text)
                    assert answer.headers["retry-after"] and shape in answer.json(), answer.text
                database.start()
                assert http.get(f"/v1/containers/{container}").status_code == 200
        finally:
            server.stop()
    finally:
        database.stop()


# -- the relay: a cluster front end between real clients and a real host --------------------
# One node, one front end, an upstream model the node's gateway calls. The
# front end waits RELAY_IDLE seconds on a host that sends nothing (its
# host_idle_seconds): short here, so a hung host is seen quickly.
RELAY_IDLE = 10


@pytest.fixture(scope="module")
def relay(postgres, seaweedfs, tmp_path_factory):
    import types

    import httpx

    from tests.gateway.scripted_upstream import ScriptedUpstream

    from .conftest import RayCluster

    tmp_path = tmp_path_factory.mktemp("relay")
    database_url = postgres.new_database()
    bucket = seaweedfs.new_bucket()
    with ScriptedUpstream() as upstream:
        ray = RayCluster(1, database_url, seaweedfs, bucket, uid_base=984_000, settings={
            "SHOAL_UPSTREAM_ANTHROPIC_URL": upstream.url,
            "SHOAL_UPSTREAM_ANTHROPIC_KEY": "operator-upstream-key"})
        front = None
        try:
            secret = tmp_path / "front.secret"
            secret.write_text(seaweedfs.secret_key)
            front = start_server(tmp_path / "front", uid_base=986_000, cluster=ray.address,
                                 database_url=database_url, object_store=f"s3://{bucket}/shoal",
                                 object_store_endpoint=seaweedfs.endpoint,
                                 object_store_access_key=seaweedfs.ACCESS_KEY,
                                 object_store_secret_key=f"@{secret}",
                                 host_idle_seconds=RELAY_IDLE)
            deadline = time.monotonic() + 180
            while httpx.get(f"{front.url}/health").json()["ready"] < 1:
                assert time.monotonic() < deadline, front.log()
                time.sleep(0.5)
            with front.client() as http:
                made = http.post("/sessions", json={})
                assert made.status_code == 201, made.text
                key = made.json()["session_id"][:key_length()]
                assert http.delete(f"/sessions/{made.json()['session_id']}").status_code == 204
            yield types.SimpleNamespace(front=front, ray=ray, upstream=upstream, key=key,
                                        server=lambda: ray.host_server(key))
        finally:
            if front is not None:
                front.stop()
            ray.stop()


@contextlib.contextmanager
def _stopped(relay):
    """The host's server SIGSTOPped: it holds its connections and answers
    nothing. Then it goes on, and the front end counts it ready again."""
    import httpx

    pid = relay.server()
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while httpx.get(f"{relay.front.url}/health", timeout=10).json()["ready"] < 1:
            assert time.monotonic() < deadline, "the host is not ready again"
            time.sleep(0.2)


def _code(code: str) -> dict:
    return {"tool": "code_execution", "input": {"code": code}}


def test_a_host_that_stops_answering_is_a_504_after_the_idle_bound(relay):
    """A host that holds its connections but answers nothing (stopped, wedged)
    held each client for ever. Now the front end waits host_idle_seconds, then
    answers 504 with Retry-After in the route's own shape, and closes its
    connection to that host: the host's late answer never reaches the next
    call."""
    import httpx

    with httpx.Client(base_url=relay.front.url, timeout=60) as http:
        session = http.post("/sessions", json={}).json()["session_id"]
        try:
            assert http.post(f"/sessions/{session}/exec",
                             json=_code("n = 1")).status_code == 200

            def timed(method: str, path: str, **kwargs) -> tuple[float, httpx.Response]:
                started = time.monotonic()
                with httpx.Client(base_url=relay.front.url, timeout=60) as own:
                    answer = own.request(method, path, **kwargs)
                return time.monotonic() - started, answer

            with _stopped(relay):
                with concurrent.futures.ThreadPoolExecutor(2) as workers:
                    protocol = workers.submit(timed, "POST", f"/sessions/{session}/exec",
                                              json=_code("n += 1; print('late')"))
                    openai = workers.submit(timed, "GET",
                                            f"/v1/code-execution/runs/cexrun_{relay.key}x")
                    (waited, answer), (waited_too, run) = protocol.result(), openai.result()
            for took, got, shape in ((waited, answer, "detail"), (waited_too, run, "error")):
                assert got.status_code == 504, (got.status_code, got.text)
                assert got.headers["retry-after"] and shape in got.json(), got.text
                assert RELAY_IDLE - 1 <= took <= RELAY_IDLE + 8, took
            # The host resumed: the next call is answered with its own result.
            answer = http.post(f"/sessions/{session}/exec", json=_code("print('own')"))
            assert answer.status_code == 200, answer.text
            assert answer.json()["result_block"]["content"]["stdout"] == "own\n", answer.text
        finally:
            http.delete(f"/sessions/{session}")


def test_a_stream_whose_host_goes_silent_is_cut_after_the_idle_bound(relay):
    """A streamed answer whose host stops sending (no output, no keep-alive):
    the client's stream is cut after host_idle_seconds, as a broken stream
    (never a clean end a client would take for the whole answer)."""
    import httpx
    from httpx_sse import connect_sse

    with httpx.Client(base_url=relay.front.url, timeout=60) as http:
        session = http.post("/sessions", json={}).json()["session_id"]
        try:
            code = "import time\nprint('a', flush=True)\ntime.sleep(60)\nprint('b')"
            with connect_sse(http, "POST", f"/sessions/{session}/exec",
                             json=_code(code)) as events:
                stream = events.iter_sse()
                while "output" not in next(stream).event:
                    pass
                with _stopped(relay):
                    started = time.monotonic()
                    with pytest.raises(httpx.RemoteProtocolError):
                        for sse in stream:
                            assert sse.event not in ("result", "done"), sse.data
                    took = time.monotonic() - started
            assert took <= RELAY_IDLE + 8, took
        finally:
            http.delete(f"/sessions/{session}")


def test_hop_by_hop_headers_stop_at_the_front_end_and_lengths_pass(relay):
    """A header the client's Connection names is for the front end only (RFC
    9110 7.6.1): it reached the host, which took the client's X-Request-Id
    so named as its own. The front end's server stamps Date and Server: the
    host's came too, each twice. The host's Content-Length was dropped: every
    answer came chunked, and a HEAD said nothing of the length."""
    with relay.front.client() as http:
        kept = http.get("/v1/containers", headers={"X-Request-Id": "client-chosen-1"})
        assert kept.headers["x-request-id"] == "client-chosen-1", kept.headers
        hop = http.get("/v1/containers", headers={
            "Connection": "keep-alive, X-Request-Id", "X-Request-Id": "client-chosen-2",
            "Keep-Alive": "timeout=5", "TE": "trailers", "Proxy-Connection": "keep-alive"})
        assert hop.status_code == 200, hop.text
        assert hop.headers["x-request-id"] not in ("client-chosen-2", ""), hop.headers
        for name in ("date", "server"):
            assert len(hop.headers.get_list(name)) == 1, hop.headers.raw
        assert hop.headers.get("content-length") == str(len(hop.content)), hop.headers.raw
        assert "transfer-encoding" not in hop.headers, hop.headers.raw
        got, head = http.get("/no-such-route"), http.head("/no-such-route")
        assert got.status_code == head.status_code == 404
        assert head.headers.get("content-length") == str(len(got.content)), head.headers.raw


def test_the_front_ends_own_answers_carry_the_calls_request_id(relay):
    """A host's answers carry the call's request id; the front end's own (a 404
    for a session no host holds, its 503s and 504s) carried none, in neither
    header nor body, so a client had no id to quote for them."""
    with relay.front.client() as http:
        lost = "/sessions/" + "z" * 48
        quoted = http.get(lost, headers={"X-Request-Id": "trace-42"})
        assert quoted.status_code == 404, quoted.text
        assert quoted.headers["x-request-id"] == "trace-42" == quoted.json()["request_id"]
        made = http.get(lost)
        assert made.headers["x-request-id"].startswith("req_"), made.headers
        assert made.json()["request_id"] == made.headers["x-request-id"]
        relayed = http.get("/v1/containers")
        assert relayed.status_code == 200, relayed.text
        assert len(relayed.headers.get_list("x-request-id")) == 1, relayed.headers.raw


def test_relayed_headers_keep_repeated_fields_and_drop_hop_by_hop_ones():
    """Either way through the relay: a field sent several times stays several
    fields (Set-Cookie cannot be joined with commas), in order; a hop-by-hop
    field, or one the Connection field names, goes no further."""
    import httpx

    from shoal.cluster.frontend import end_to_end

    raw = httpx.Headers([
        ("Set-Cookie", "a=1; Path=/"), ("Connection", "close, X-Hop"), ("Link", "<a>; rel=next"),
        ("Set-Cookie", "b=2, with a comma"), ("Vary", "Accept"), ("Vary", "Origin"),
        ("X-Hop", "1"), ("Keep-Alive", "timeout=5"), ("Transfer-Encoding", "chunked"),
        ("TE", "trailers"), ("Trailer", "X-T"), ("Upgrade", "h2c"),
        ("Proxy-Connection", "keep-alive"), ("Connection", "x-other"), ("X-Other", "2"),
        ("Link", "<b>; rel=prev"), ("Content-Length", "12")]).raw
    assert end_to_end(raw, dropped=(b"date",)) == [
        (b"Set-Cookie", b"a=1; Path=/"), (b"Link", b"<a>; rel=next"),
        (b"Set-Cookie", b"b=2, with a comma"), (b"Vary", b"Accept"), (b"Vary", b"Origin"),
        (b"Link", b"<b>; rel=prev"), (b"Content-Length", b"12")]


def test_a_client_that_hangs_up_ends_its_call_on_the_host(relay):
    """A client gone before its answer began: the front end went on waiting on
    the host, so the host never saw it leave and went on with the call (here a
    model turn, its upstream connection held) until it ended."""
    import httpx

    from tests.gateway.scripted_upstream import anthropic_turn, text

    relay.upstream.reset()
    relay.upstream.script(anthropic_turn(text("never sent"), hang_after=0))
    with httpx.Client(base_url=relay.front.url, timeout=3) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": [
                {"role": "user", "content": "hi"}]})
    assert len(relay.upstream.requests) == 1
    # Well before the front end's own bound on the host (RELAY_IDLE) would end it.
    assert relay.upstream.requests[0].disconnected.wait(RELAY_IDLE - 3 - 2)


def _memory(pid: int, field: str) -> int:
    """A /proc/<pid>/status figure (VmRSS, VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def test_an_upload_is_held_once_on_the_front_end(relay):
    """The front end keeps a body to resend it (a host's 421), its size bounded
    by request_buffer_mib. It held it three times over at its peak: the chunks
    as they came, joined into one piece, and that piece copied whole into the
    socket's buffer on its way to the host."""
    import httpx

    size = 48 << 20
    piece = os.urandom(1 << 20)

    def body():
        for _ in range(size // len(piece)):
            yield piece

    pid = relay.front.process.pid
    with httpx.Client(base_url=relay.front.url, timeout=60) as http:
        warm = http.put("/api/v1/app/thread/upload/put-file/small.bin", content=piece)
        assert warm.status_code == 201, warm.text
        with open(f"/proc/{pid}/clear_refs", "w") as clear:
            clear.write("5")  # the peak (VmHWM) starts again from what it holds now
        before = _memory(pid, "VmHWM")
        put = http.put("/api/v1/app/thread/upload/put-file/big.bin", content=body())
        assert put.status_code == 201, put.text
        assert put.json()["size_bytes"] == size, put.text
    grew = _memory(pid, "VmHWM") - before
    assert grew < 1.5 * size, f"the front end's peak grew by {grew >> 20} MiB"


def test_a_hosts_redirect_names_the_front_end(relay):
    """A host makes absolute URLs (a redirect's Location, here to the path
    without its trailing slash) from the Host the request names. The front end
    named the host's own address, so a client was sent past the front end to
    an address that may not be reachable from where it is."""
    import httpx

    with httpx.Client(base_url=relay.front.url, timeout=30) as http:
        moved = http.get("/v1/containers/", params={"limit": 1})
        assert moved.status_code == 307, moved.text
        assert moved.headers["location"] == f"{relay.front.url}/v1/containers?limit=1"
        assert http.get(moved.headers["location"]).status_code == 200


def test_a_call_to_a_host_known_to_be_silent_is_a_503_at_once(relay):
    """Once the front end's polls have found a host silent (its /health
    unanswered three times in a row), a new call to it is a 503 with
    Retry-After at once: each waited the whole host_idle_seconds (eleven
    minutes by default) for the 504."""
    import httpx

    with httpx.Client(base_url=relay.front.url, timeout=60) as http:
        session = http.post("/sessions", json={}).json()["session_id"]
        try:
            with _stopped(relay):
                time.sleep(25)  # three polls of 5 s each, and the refreshes between
                started = time.monotonic()
                answer = http.post(f"/sessions/{session}/exec", json=_code("1"))
                took = time.monotonic() - started
            assert answer.status_code == 503, (answer.status_code, answer.text)
            assert answer.headers["retry-after"] and answer.json()["detail"], answer.text
            assert took < 3, took
            again = http.post(f"/sessions/{session}/exec", json=_code("print(2)"))
            assert again.status_code == 200, again.text
        finally:
            http.delete(f"/sessions/{session}")
