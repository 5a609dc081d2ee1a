"""The zygote, the default launcher, is as safe as bubblewrap (issue 13).

Each fork runs in a user namespace of its own that maps only its uid, with an
empty bounding set and no capabilities; the zygote's own mount namespace is
built from nothing, so it pins no other server's volume; and the forks of one
zygote do not share their random state.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from shoal.config import Settings
from shoal.sandbox import SandboxPool
from shoal.sandbox.volumes import Volume
from tests.uid_slots import uid


async def test_the_default_launcher_is_the_zygote(pool):
    if os.environ.get("SHOAL_LAUNCHER", "zygote") != "zygote":
        pytest.skip("this run chose another launcher")
    assert pool.launcher == "zygote"


@pytest.fixture
def zygote_only(pool):
    if pool.launcher != "zygote":
        pytest.skip("about the zygote; this run's sandboxes start with bubblewrap")


async def test_a_sandbox_runs_in_a_user_namespace_that_maps_only_its_uid(zygote_only, sandbox):
    result = await sandbox.run_bash("cat /proc/self/uid_map /proc/self/gid_map; "
                                    "grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status; "
                                    "stat -c %u /usr/bin/python3")
    lines = result.stdout.splitlines()
    uid = str(sandbox.uid)
    # Not the identity map of the host's namespace ("0 0 4294967295"): one uid, its own.
    assert lines[0].split() == [uid, uid, "1"], lines
    assert lines[1].split() == [uid, uid, "1"], lines
    capabilities = dict(line.split(":\t") for line in lines[2:7])
    assert set(capabilities.values()) == {"0000000000000000"}, capabilities
    assert lines[7] == "65534", "host root must not be mapped inside (it shows as nobody)"


async def test_root_of_the_host_cannot_be_reached_inside(sandbox):
    result = await sandbox.run_python(
        "import errno, os\nfor call in (lambda: os.setuid(0), lambda: os.setgid(0),"
        " lambda: os.chown('/home/agent/workspace', 0, 0)):\n"
        "    try:\n        call(); print('allowed')\n    except OSError as exc:\n"
        "        print(errno.errorcode[exc.errno])")
    # EPERM: no capability; EINVAL: uid 0 does not exist in the namespace at all.
    assert all(answer in ("EPERM", "EINVAL") for answer in result.stdout.split()), result
    assert len(result.stdout.split()) == 3, result


def _zygote_pids() -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                command = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if b"shoal_agent.zygote" in command and b"serve(" in command:
                found.append(int(name))
    return found


async def test_a_volume_unmounted_elsewhere_is_not_held_by_a_zygote(tmp_path):
    """Another server's volume, mounted when our zygote starts, is released when
    that server unmounts it: the zygote's namespace copied none of the host's mounts."""
    run_dir = Path("/run/shoal-test") / f"zygote-{uuid.uuid4().hex[:8]}"
    image, mount_point = tmp_path / "other.img", run_dir / "other-volume"
    other = Volume(image, mount_point)
    other.create(64 * 1024 * 1024)
    settings = Settings(pool_size=0, data_dir=tmp_path / "data", run_dir=run_dir,
                        uid_base=uid(280_000), uid_count=16, launcher="zygote")
    pool = SandboxPool(settings)
    await pool.start()
    try:
        # This pool's zygote itself (its forks run the same command line, with
        # their own volumes mounted: they are not what this test is about).
        assert pool._zygote is not None, "no zygote started"
        zygote = pool._zygote._popen.pid
        assert zygote in _zygote_pids()
        mountinfo = Path(f"/proc/{zygote}/mountinfo").read_text()
        assert str(mount_point) not in mountinfo
        assert "/dev/loop" not in mountinfo, "the zygote holds a copy of a loop mount"
        other.destroy()
        attached = subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True)
        assert attached.stdout.strip() == "", f"still attached: {attached.stdout}"
    finally:
        await pool.close()
        if mount_point.is_mount():  # the test failed before its own unmount
            other.destroy()
        subprocess.run(["rm", "-rf", str(run_dir)], check=False)


async def test_the_preloaded_libraries_first_use_is_paid_by_the_zygote(tmp_path):
    """A first chart in a fresh sandbox costs what a later one does: the zygote
    drew and saved one before forking (the font, Agg, pandas' plotting backend),
    and left no figure or data behind for the sandbox to see."""
    run_dir = Path("/run/shoal-test") / f"zygote-{uuid.uuid4().hex[:8]}"
    settings = Settings(pool_size=1, data_dir=tmp_path / "data", run_dir=run_dir,
                        uid_base=uid(281_000), uid_count=16, launcher="zygote",
                        preload_modules="numpy,pandas,matplotlib.pyplot")
    pool = SandboxPool(settings)
    await pool.start()
    try:
        assert pool._zygote is not None, "no zygote started"
        sandbox = await pool.lease()
        try:
            result = await sandbox.run_python(
                "import sys, matplotlib.pyplot as plt\n"
                "print('pandas.plotting._matplotlib' in sys.modules,"
                " 'matplotlib.backends.backend_agg' in sys.modules)\n"
                "print(plt.get_fignums(), sorted(k for k in globals() if not k.startswith('_')))")
            assert result.stdout == ("True True\n[] ['ToolError', 'plt', 'sys']\n"), result.stderr
        finally:
            await sandbox.close()
    finally:
        await pool.close()
        subprocess.run(["rm", "-rf", str(run_dir)], check=False)
