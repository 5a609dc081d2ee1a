"""Host-side access to a sandbox's files (shoal/sandbox/files.py) once the sandbox is gone.

A call that began before its session was released (an upload still streaming
in, a listing) reaches the files after the mounts were removed: that is the
session's absence, a 404, never an unmapped error and a 500.
"""

from __future__ import annotations

import io

import pytest

from shoal.sandbox.files import SandboxGone, SandboxPath

WORKSPACE = "/home/agent/workspace"


async def test_every_file_operation_on_a_released_sandbox_is_a_404(pool):
    sandbox = await pool.lease()
    files = sandbox.files
    assert (await sandbox.run_bash("echo kept > f")).return_code == 0
    await sandbox.close()
    operations = {
        "list": lambda: files.list(SandboxPath(WORKSPACE, ())),
        "read": lambda: files.open_for_reading(SandboxPath(WORKSPACE, ("f",))),
        "stat": lambda: files.stat(SandboxPath(WORKSPACE, ("f",))),
        "write": lambda: files.write(SandboxPath(WORKSPACE, ("g",)), io.BytesIO(b"late")),
        "delete": lambda: files.delete(SandboxPath(WORKSPACE, ("f",))),
    }
    for name, operation in operations.items():
        with pytest.raises(SandboxGone) as raised:
            operation()
        assert raised.value.status == 404, name
        assert str(raised.value) == "the session was released while the call ran", name
