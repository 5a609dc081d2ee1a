"""Fixtures of the gateway suites: one scripted upstream, real servers in front of it.

Every test gets the same :class:`ScriptedUpstream` (reset before it), and a
real ``shoal serve`` whose upstreams point at it, with tokens configured so the
client's token is provably not the one the upstream sees. Tests that need other
settings start their own server with ``gateway_factory``.
"""

from __future__ import annotations

import itertools
import os

import anthropic
import openai
import pytest

from tests.gateway.scripted_upstream import ScriptedUpstream
from tests.serving import Server, start_server

CLIENT_TOKEN = "client-token-alpha"
OTHER_TOKEN = "client-token-beta"
OPERATOR_KEY = "operator-upstream-key"
TOKENS = f"{CLIENT_TOKEN}=alpha,{OTHER_TOKEN}=beta"

# Far from the other suites' uid ranges, per process.
_uid_bases = itertools.count(800_000_000 + (os.getpid() % 1000) * 100_000, 10_000)


@pytest.fixture(scope="session")
def upstream_server():
    with ScriptedUpstream() as upstream:
        yield upstream


@pytest.fixture
def upstream(upstream_server):
    upstream_server.reset()
    yield upstream_server
    upstream_server.reset()


@pytest.fixture(scope="session")
def gateway_factory(tmp_path_factory, upstream_server):
    """Start gateway servers with extra settings; all are stopped at the end."""
    started: list[Server] = []

    def start(uid_base: int | None = None, **settings) -> Server:
        defaults = {"upstream_anthropic_url": upstream_server.url,
                    "upstream_anthropic_key": OPERATOR_KEY,
                    "upstream_openai_url": upstream_server.url,
                    "upstream_openai_key": OPERATOR_KEY,
                    "tokens": TOKENS, "pool_size": 1}
        base = next(_uid_bases) if uid_base is None else uid_base
        server = start_server(tmp_path_factory.mktemp("gateway"), base,
                              **{**defaults, **settings})
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def gateway(gateway_factory) -> Server:
    return gateway_factory(container_sandbox_idle_seconds=2, reaper_interval_seconds=0.5)


@pytest.fixture
def anthropic_client(gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key=CLIENT_TOKEN, max_retries=0)


@pytest.fixture
def openai_client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=CLIENT_TOKEN, max_retries=0)
