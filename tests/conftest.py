"""Shared fixtures: one real warm pool for the session, a fresh sandbox per test."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from shoal.config import Settings
from shoal.egress.broker import EgressBroker, Grant, new_socket_dir
from shoal.egress.policy import Allowlist
from shoal.egress.tokens import ModelTokens
from shoal.sandbox import SandboxPool
from tests.uid_slots import uid


@pytest.fixture(scope="session")
def settings(tmp_path_factory) -> Settings:
    return Settings(
        pool_size=2,
        uid_base=uid(int(os.environ.get("SHOAL_UID_BASE") or Settings.model_fields["uid_base"].default)),
        data_dir=tmp_path_factory.mktemp("data"),
        run_dir=Path("/run/shoal-test"),
        memory_limit_mib=256,
        pids_limit=128,
        # Small sandboxes, so limits fire fast. What a fork bomb's children cost in
        # page tables grows with what the interpreter has imported: with matplotlib
        # too (the server's default), 128 forks outgrow 256 MiB before the pids
        # limit stops them, and these suites test that the pids limit does.
        preload_modules="numpy,pandas",
        max_timeout_seconds=30,
        output_cap_bytes=1024 * 1024,
    )


@pytest.fixture(scope="session")
async def pool(settings):
    """A pool of real sandboxes. With ``SHOAL_TEST_EGRESS=1`` (a pass of the
    Makefile) every sandbox also has egress: the relay on its loopback, AF_INET
    sockets, and a real broker on the host that grants each live sandbox
    nothing (an empty allowlist), so the escape suites run with the way out that
    egress adds in place."""
    pool = SandboxPool(settings)
    broker = None
    if os.environ.get("SHOAL_TEST_EGRESS") == "1":
        broker = EgressBroker(
            new_socket_dir(settings.run_dir), Allowlist(""),
            lambda uid: ((box, Grant("tests", f"uid:{uid}"))
                         if (box := pool.sandbox_of_uid(uid)) is not None else None),
            ModelTokens(60, 1), None, secrets.token_urlsafe(16))
        await broker.start()
        pool.egress_dir = broker.socket_dir
    await pool.start()
    yield pool
    await pool.close()
    if broker is not None:
        await broker.close()


@pytest.fixture
async def sandbox(pool):
    sandbox = await pool.lease()
    yield sandbox
    await sandbox.close()
