"""A sandbox that cannot start says why, in bubblewrap's own words, and leaves nothing."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import pytest

from shoal.sandbox.cgroups import CgroupManager, Limits
from shoal.sandbox.launcher import LaunchConfig, LaunchFailed, launch
from shoal.sandbox.mounts import SandboxHome


async def test_a_launch_that_fails_names_the_reason_and_cleans_up(tmp_path):
    manager = CgroupManager()
    name = f"launch-failure-{secrets.token_hex(3)}"
    cgroup = manager.create(name, Limits(memory_bytes=256 << 20, pids=64, cpu_cores=1))
    home = SandboxHome(Path("/run/shoal-test") / name)
    home.create(uid=299_999)
    config = LaunchConfig(runtime=tmp_path / "no-such-runtime", agent_root=tmp_path,
                          tmp_size_bytes=1 << 20, pids_limit=64)
    try:
        with pytest.raises(LaunchFailed) as failure:
            await launch(config, home, 299_999, cgroup)
        assert "no-such-runtime" in str(failure.value)  # bubblewrap's words reach the caller
        assert cgroup.pids() == []  # nothing of the attempt runs on
    finally:
        cgroup.kill()
        cgroup.remove()
        shutil.rmtree(home.root, ignore_errors=True)
