"""A session: one live sandbox leased to one tenant, with its lifetime bounds.

The session is the unit clients address. It remembers who owns it and when it
was last used, counts calls in flight so the reaper never reclaims a session
that is working, and is the only way the layers above reach a sandbox.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from shoal.sandbox import (ExecResult, FileEntry, OutputCallback, Sandbox, SandboxPath, StubSpec,
                           ToolHandler, parse_path)
from shoal.storage import ContainerRecord

from .containers import TenantQuotaExceeded

TOOLS = ("python", "bash", "edit", "javascript")
# Calls of one session running or waiting their turn: the sandbox runs them one
# after another, and each waiting one holds its code (up to the frame cap). A
# streamed exec runs whoever listens, so its client may leave at once: nothing
# else bounded them (150 such took 300 MiB of the server's memory in 3 s).
MAX_CALLS_WAITING = 8


class SessionBusy(TenantQuotaExceeded):
    """The session has as many calls running or waiting as one may (a 429)."""


@dataclass(eq=False)
class Session:
    id: str
    tenant: str
    sandbox: Sandbox
    idle_timeout_seconds: int
    max_lifetime_seconds: int
    image: str | None = None
    # The durable container the session is attached to; None for an ephemeral one.
    container: ContainerRecord | None = None
    # Set when the session's sandbox is a fresh one on a container used before:
    # the first call's result says so, since earlier interpreter state is gone.
    interpreter_restarted: bool = False
    on_activity: Callable[["Session"], Awaitable[None]] | None = None
    created_at: float = field(default_factory=time.time)
    last_activity_at: float = 0.0
    active_calls: int = 0

    def __post_init__(self) -> None:
        self.last_activity_at = self.last_activity_at or self.created_at

    def touch(self) -> None:
        self.last_activity_at = time.time()

    def expired(self, now: float) -> bool:
        if now - self.created_at >= self.max_lifetime_seconds:
            return True
        return self.active_calls == 0 and now - self.last_activity_at >= self.idle_timeout_seconds

    # Inner tool stubs registered for every call of this session (the reference
    # backend's programmatic tools), and who answers them.
    stubs: StubSpec | None = None
    tools: ToolHandler | None = None

    async def run(self, tool: str, payload: dict, timeout: float | None,
                  on_output: OutputCallback | None = None) -> ExecResult:
        """Run one call: ``tool`` is python, bash, javascript or edit; output is
        streamed to ``on_output`` as it is produced."""
        self.check_room()
        self.active_calls += 1
        self.touch()
        try:
            result = await self._dispatch(tool, payload, timeout, on_output)
        finally:
            self.active_calls -= 1
            self.touch()
        if self.interpreter_restarted:
            result.restarted = True
            self.interpreter_restarted = False
        if self.on_activity is not None:
            await self.on_activity(self)
        return result

    def check_room(self) -> None:
        """SessionBusy if one more call may not wait its turn on this session."""
        if self.active_calls >= MAX_CALLS_WAITING:
            raise SessionBusy(f"this session already has {self.active_calls} calls running or "
                              f"waiting, at most {MAX_CALLS_WAITING}; wait for one to finish")

    async def _dispatch(self, tool: str, payload: dict, timeout: float | None,
                        on_output: OutputCallback | None) -> ExecResult:
        if tool == "python":
            return await self.sandbox.run_python(payload["code"], timeout, on_output,
                                                 stubs=self.stubs, tools=self.tools)
        if tool == "bash":
            return await self.sandbox.run_bash(payload["command"], timeout, on_output)
        if tool == "javascript":
            return await self.sandbox.run_javascript(payload["code"], timeout, on_output)
        if tool == "edit":
            return await self.sandbox.edit(payload, timeout)
        raise ValueError(f"unknown tool {tool!r}")

    # -- files: blocking, call from a worker thread -------------------------------
    def list_files(self, raw_path: str) -> list[FileEntry]:
        self.touch()
        return self.sandbox.files.list(parse_path(raw_path, allow_file_id=False))

    def open_file(self, raw_path: str):
        self.touch()
        path = parse_path(raw_path)
        handle, size = self.sandbox.files.open_for_reading(path)
        return path, handle, size

    def write_file(self, raw_path: str, source) -> tuple[SandboxPath, int]:
        self.touch()
        path = parse_path(raw_path, allow_file_id=False)
        return path, self.sandbox.files.write(path, source).size
