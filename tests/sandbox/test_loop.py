"""Volumes on loop devices bound in-process (shoal.sandbox._loop), on the real kernel.

No mount(8) runs any more: these check what it used to guarantee. The device
goes with the filesystem (autoclear), the pre-5.8 way of binding works where
LOOP_CONFIGURE is unknown, an image whose filesystem is still alive after a
lazy unmount is mounted from its own device again (never from a second one,
which would corrupt it), and failures are VolumeErrors that say what failed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from shoal.sandbox import _loop
from shoal.sandbox.volumes import Volume, VolumeError, is_mounted, unmount

MiB = 1024 * 1024


def devices_of(image: Path) -> list[str]:
    target = os.path.realpath(image)
    found = []
    for name in os.listdir("/sys/block"):
        try:
            with open(f"/sys/block/{name}/loop/backing_file") as handle:
                if handle.read().rstrip("\n") == target:
                    found.append(name)
        except OSError:
            continue
    return found


def wait_unbound(image: Path, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while devices_of(image) and time.monotonic() < deadline:
        time.sleep(0.02)
    return devices_of(image)


@pytest.fixture
def volume(tmp_path):
    made = Volume(tmp_path / "images" / "v.img", tmp_path / "mnt" / "v")
    yield made
    if is_mounted(made.mount_point):
        unmount(made.mount_point)
    made.image.unlink(missing_ok=True)


def test_a_volume_mounts_and_its_loop_device_goes_with_it(volume):
    volume.create(32 * MiB, journal=False)
    assert is_mounted(volume.mount_point)
    (volume.mount_point / "f").write_text("x" * 1000)
    [device] = devices_of(volume.image)
    assert Path(f"/sys/block/{device}/loop/autoclear").read_text().strip() == "1"
    volume.destroy()
    assert wait_unbound(volume.image) == [] and not volume.image.exists()


def test_an_image_remounted_keeps_its_files(volume):
    volume.create(32 * MiB, journal=True)
    (volume.mount_point / "kept.txt").write_text("kept")
    volume.unmount()
    assert wait_unbound(volume.image) == []
    volume.mount()
    assert (volume.mount_point / "kept.txt").read_text() == "kept"


def test_binding_without_loop_configure_as_before_linux_5_8(volume, monkeypatch):
    # An ioctl number no kernel knows: ENOTTY, as LOOP_CONFIGURE gets before 5.8.
    monkeypatch.setattr(_loop, "_LOOP_CONFIGURE", 0x4CFF)
    volume.create(32 * MiB, journal=False)
    [device] = devices_of(volume.image)
    assert Path(f"/sys/block/{device}/loop/autoclear").read_text().strip() == "1"
    (volume.mount_point / "f").write_text("fallback")
    volume.unmount()
    assert wait_unbound(volume.image) == []


def test_a_lazily_unmounted_image_is_mounted_from_its_own_device_again(volume):
    volume.create(32 * MiB, journal=True)
    held = open(volume.mount_point / "held.txt", "w")  # keeps the filesystem alive
    try:
        [device] = devices_of(volume.image)
        _loop.unmount(str(volume.mount_point), lazy=True)
        assert not is_mounted(volume.mount_point) and devices_of(volume.image) == [device]
        volume.mount()
        # One filesystem on one device: a second device would be a second ext4 on the image.
        assert devices_of(volume.image) == [device]
        held.write("through the old mount")
        held.flush()
        assert (volume.mount_point / "held.txt").read_text() == "through the old mount"
    finally:
        held.close()
    volume.unmount()
    assert wait_unbound(volume.image) == []


def test_a_broken_image_is_a_volume_error_and_binds_nothing(volume):
    volume.image.parent.mkdir(parents=True)
    volume.image.write_bytes(b"not a filesystem" * 4096)
    with pytest.raises(VolumeError, match=r"mount .*v\.img"):
        volume.mount()
    assert wait_unbound(volume.image) == []
    with pytest.raises(_loop.LoopError, match="open image .*missing.img"):
        _loop.mount_image(str(volume.image.with_name("missing.img")), str(volume.mount_point),
                          "ext4", 0, "")
