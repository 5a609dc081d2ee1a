"""Shared fixtures: one real warm pool for the session, a fresh sandbox per test."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.config import Settings
from shoal.sandbox import SandboxPool


@pytest.fixture(scope="session")
def settings(tmp_path_factory) -> Settings:
    return Settings(
        pool_size=2,
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
    pool = SandboxPool(settings)
    await pool.start()
    yield pool
    await pool.close()


@pytest.fixture
async def sandbox(pool):
    sandbox = await pool.lease()
    yield sandbox
    await sandbox.close()
