"""Fixtures for HTTP tests: real ``shoal serve`` processes and the contract's schemas."""

from __future__ import annotations

import itertools

import pytest

from tests.serving import Server, start_server

from .contract import load_contract, schema_checker

# Each server gets its own uid range, so servers alive at once never share a uid.
_uid_bases = itertools.count(600_000, 10_000)


@pytest.fixture(scope="session")
def contract() -> dict:
    return load_contract()


@pytest.fixture(scope="session")
def schema_errors(contract):
    """``schema_errors("ExecResponse", body)`` lists where ``body`` breaks the contract."""
    return schema_checker(contract)


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory):
    """Start extra servers with their own settings; all are stopped at the end."""
    started: list[Server] = []

    def start(**settings) -> Server:
        server = start_server(tmp_path_factory.mktemp("server"), next(_uid_bases), **settings)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(server_factory) -> Server:
    """An open server (no tokens) with small caps, shared by the contract tests."""
    return server_factory(max_file_bytes=1024 * 1024, max_sessions=16, pool_size=3)


@pytest.fixture
def client(server):
    with server.client() as http:
        yield http


@pytest.fixture
def session_id(client):
    response = client.post("/sessions", json={})
    assert response.status_code == 201, response.text
    session_id = response.json()["session_id"]
    yield session_id
    client.delete(f"/sessions/{session_id}")
