"""No sandbox ever runs as root: uid 0, or (uid_t)-1, which setresuid and setpriv
read as "leave the uid unchanged", are refused where a uid is leased and where a
launcher is about to use it, whatever the settings let through."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import pytest

from shoal.sandbox.cgroups import CgroupManager, Limits
from shoal.sandbox.launcher import LaunchConfig, launch
from shoal.sandbox.mounts import SandboxHome
from shoal.sandbox.uids import UidAllocator, UnsafeUid

NO_CHANGE = 2**32 - 1  # (uid_t)-1


@pytest.mark.parametrize("base", [0, NO_CHANGE])
def test_an_unsafe_uid_is_never_leased(tmp_path, base):
    with pytest.raises(UnsafeUid, match=f"uid {base}"):
        UidAllocator(base, 1, tmp_path).lease()
    assert list(tmp_path.iterdir()) == []  # not even its lock file


def test_a_range_running_into_the_no_change_uid_stops_short_of_it(tmp_path):
    uids = UidAllocator(NO_CHANGE - 1, 2, tmp_path)
    assert uids.lease() == NO_CHANGE - 1
    with pytest.raises(UnsafeUid):
        uids.lease()
    assert uids.leased == {NO_CHANGE - 1}


@pytest.mark.parametrize("uid", [0, NO_CHANGE])
async def test_a_launcher_refuses_an_unsafe_uid_and_starts_nothing(tmp_path, uid):
    # UnsafeUid, not LaunchFailed: the pool must not retry it with bubblewrap.
    cgroup = CgroupManager().create(f"unsafe-uid-{secrets.token_hex(3)}",
                                    Limits(memory_bytes=256 << 20, pids=64, cpu_cores=1))
    home = SandboxHome(Path("/run/shoal-test") / f"unsafe-uid-{secrets.token_hex(3)}")
    home.create(uid=299_998)
    config = LaunchConfig(runtime=tmp_path / "no-such-runtime", agent_root=tmp_path,
                          tmp_size_bytes=1 << 20, pids_limit=64)
    try:
        with pytest.raises(UnsafeUid):
            await launch(config, home, uid, cgroup)
        assert cgroup.pids() == []
    finally:
        cgroup.kill()
        cgroup.remove()
        shutil.rmtree(home.root, ignore_errors=True)
