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
