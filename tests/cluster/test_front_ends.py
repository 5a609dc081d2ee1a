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

import asyncpg
import pytest

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
