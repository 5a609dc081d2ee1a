"""One leased sandbox: the API the session layer calls.

A ``Sandbox`` owns its process tree, uid, cgroup and host directories, and
turns each call into the internal ``ExecResult``. Calls are serialized; a call
that outlives its timeout plus a short backstop, or a sandbox that dies under
a call, costs a restart (same files, fresh processes) rather than a hung session.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Callable

from .channel import ChannelClosed
from .files import MAX_PATH_BYTES, SandboxFiles
from .launcher import stop_process_tree
from .mounts import OUTPUTS, WORKSPACE, SandboxHome
from .result import ExecResult, Limit, ProducedFile
from .toolcalls import StubSpec, ToolExchange, ToolHandler

if TYPE_CHECKING:
    from .pool import SandboxPool

log = logging.getLogger("shoal.sandbox")

# How long past its own timeout a call may take before the host stops waiting
# for the agent and destroys the sandbox's processes.
BACKSTOP_SECONDS = 3.0
# How long a cancelled call may take to stop by itself before its processes are killed.
CANCEL_GRACE_SECONDS = 2.0
# A failed call on a volume with less room than this ran out of disk (the last
# few blocks are too fragmented to fill exactly).
_DISK_NEARLY_FULL = 256 * 1024
TRUNCATION_MARKER = "\n...[truncated]"
OutputCallback = Callable[[str, str], None]


class SandboxClosed(RuntimeError):
    """The sandbox was closed; it runs nothing more."""


class _Collector:
    """Accumulates one call's output, never more than the cap per stream."""

    def __init__(self, cap: int, forward: OutputCallback | None) -> None:
        self.cap = cap + len(TRUNCATION_MARKER)
        self.parts: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.sizes = {"stdout": 0, "stderr": 0}
        self.truncated = {"stdout": False, "stderr": False}
        self.forward = forward

    def add(self, stream: str, data: str) -> None:
        data = clean_text(data)
        room = self.cap - self.sizes[stream]
        if room <= 0:
            self.truncated[stream] = True
            return
        if len(data) > room:
            data = data[:room]
            self.truncated[stream] = True
        self.parts[stream].append(data)
        self.sizes[stream] += len(data)
        if self.forward is not None:
            self.forward(stream, data)

    def text(self, stream: str) -> str:
        text = "".join(self.parts[stream])
        if self.truncated[stream] and not text.endswith(TRUNCATION_MARKER):
            text += TRUNCATION_MARKER
        return text


class _Running:
    """The call in progress: its id on the channel, its tool traffic, whether it was cancelled."""

    __slots__ = ("call_id", "exchange", "cancelled", "reason", "caller")

    def __init__(self, call_id: int, exchange: ToolExchange, caller: object = None) -> None:
        self.call_id = call_id
        self.exchange = exchange
        self.caller = caller
        self.cancelled = False
        self.reason: str | None = None


class Sandbox:
    def __init__(self, pool: "SandboxPool", name: str, uid: int, home: SandboxHome,
                 cgroup, process) -> None:
        self.name = name
        self.uid = uid
        self.home = home
        self._pool = pool
        self._cgroup = cgroup
        self._process = process
        self._lock = asyncio.Lock()
        self._closed = False
        # Called once the processes are gone; the pool sets it for files it owns.
        self.release_home: Callable[[], None] = lambda: None
        # Whether the files outlive the sandbox (a container's): what the API
        # writes into them is then on disk before it is acknowledged.
        self.durable_files = False
        # Limit events already counted: none, in the fresh group every sandbox
        # gets (reading them cost two cgroup files on the event loop per launch).
        self._oom_seen = 0
        self._pids_seen = 0
        self._running: _Running | None = None
        # Who uses the sandbox now, for logs and usage: tenant, session, container
        # (set by the layer that leased it).
        self.owner: dict[str, str] = {}
        # Where egress is granted: what the broker lets this sandbox reach
        # (shoal.egress.broker.Grant), and variables set for every call.
        self.egress_grant = None
        self.call_env: dict[str, str] = {}

    # -- the public calls -----------------------------------------------------
    async def run_python(self, code: str, timeout: float | None = None,
                         on_output: OutputCallback | None = None, *,
                         stubs: StubSpec | None = None, tools: ToolHandler | None = None,
                         external_files: bool = False, caller: object = None) -> ExecResult:
        """Run a cell in the persistent interpreter. ``stubs`` are tool stubs the
        code may call; ``tools`` decides and answers those calls. ``caller``
        names the call for ``cancel(caller=...)``."""
        return await self._call({"op": "python", "code": code}, timeout, on_output,
                                stubs, tools, external_files, caller)

    async def run_bash(self, command: str, timeout: float | None = None,
                       on_output: OutputCallback | None = None, *,
                       caller: object = None) -> ExecResult:
        return await self._call({"op": "bash", "command": command}, timeout, on_output,
                                caller=caller)

    async def run_javascript(self, code: str, timeout: float | None = None,
                             on_output: OutputCallback | None = None, *,
                             stubs: StubSpec | None = None, tools: ToolHandler | None = None,
                             external_files: bool = False, caller: object = None) -> ExecResult:
        """Run a script on Bun, in a process of its own (no state between calls)."""
        return await self._call({"op": "javascript", "code": code}, timeout, on_output,
                                stubs, tools, external_files, caller)

    async def edit(self, request: dict, timeout: float | None = None, *,
                   caller: object = None) -> ExecResult:
        """Run one text-editor command (``view``, ``create``, ``str_replace``, ``insert``,
        ``undo_edit``) with Anthropic's field names."""
        return await self._call({"op": "edit", "request": request}, timeout, None,
                                caller=caller)

    async def cancel(self, reason: str | None = None, *, caller: object = None) -> bool:
        """Stop the call in progress: interrupted at once, its processes killed if it
        does not stop within a grace period. ``reason`` ends the call's stderr.
        With ``caller``, only a call made with that ``caller``: a container's
        sandbox serves its runs one after another, and a run still queued must
        not stop the one ahead of it. False if no such call was running."""
        running = self._running
        if running is None or running.cancelled:
            return False
        if caller is not None and running.caller is not caller:
            return False
        running.cancelled = True
        running.reason = reason
        try:
            await self._process.channel.send({"op": "cancel", "id": running.call_id})
        except Exception:  # noqa: BLE001 - a dead channel ends the call anyway
            pass
        if running.exchange.scope is not None and not running.exchange.scope.expired():
            running.exchange.scope.reschedule(
                asyncio.get_running_loop().time() + CANCEL_GRACE_SECONDS)
        return True

    async def restart(self) -> None:
        """Fresh processes on the same files: interpreter state is gone, files stay."""
        async with self._lock:
            await self._restart_locked()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Kill first, so that a call in flight ends now rather than at its timeout.
        await asyncio.to_thread(self._stop_processes)
        async with self._lock:
            await self._pool._destroy(self)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- internals ----------------------------------------------------------------
    async def _call(self, message: dict, timeout: float | None,
                    on_output: OutputCallback | None, stubs: StubSpec | None = None,
                    tools: ToolHandler | None = None, external_files: bool = False,
                    caller: object = None) -> ExecResult:
        settings = self._pool.settings
        # min() before float(): an absurd integer timeout must clamp, not overflow.
        requested = float(min(timeout, 10**9)) if timeout is not None else float(
            settings.default_timeout_seconds)
        limit = min(requested, float(settings.max_timeout_seconds))
        message = {**message, "timeout": limit, "cap": settings.output_cap_bytes}
        if stubs is not None and stubs.tools:
            message.update(stubs.message_fields())
        if tools is not None:
            message["tool_wait"] = tools.wait_limit
        if external_files:
            message["external_files"] = True
        if self.call_env:
            message["env"] = dict(self.call_env)
        collector = _Collector(settings.output_cap_bytes, on_output)
        async with self._lock:
            if self._closed:
                raise SandboxClosed(f"sandbox {self.name} is closed")
            started = time.perf_counter()
            channel = self._process.channel
            call_id = channel.next_call_id()
            running = _Running(call_id, ToolExchange(channel.send, call_id, tools), caller)
            self._running = running
            try:
                async with asyncio.timeout(limit + BACKSTOP_SECONDS) as scope:
                    running.exchange.scope = scope
                    done = await channel.call(message, collector.add, running.exchange.on_batch,
                                              call_id=call_id)
            except TimeoutError:
                self._raise_if_closed()
                if running.cancelled:
                    result = self._result({"return_code": 137}, collector)
                else:
                    result = self._result({"return_code": 124, "timed_out": True}, collector)
                    self._notice_limits(result)
                result.restarted = True
                await self._restart_locked()
            except ChannelClosed:  # also ChannelCorrupt: a garbled channel is a dead one
                self._raise_if_closed()
                result = self._died(collector)
                await self._restart_locked()
            else:
                result = self._result(done, collector)
                if result.return_code != 0 and not running.cancelled:
                    self._notice_limits(result)
            finally:
                self._running = None
                running.exchange.close()
            result.cancelled = running.cancelled
            if running.reason:
                separator = "" if not result.stderr or result.stderr.endswith("\n") else "\n"
                result.stderr += f"{separator}{running.reason}"
            result.tool_calls = running.exchange.made
            elapsed = time.perf_counter() - started
            result.execution_time_ms = int(elapsed * 1000)
        self._pool.stats.ran(self.owner.get("tenant"), elapsed)
        if result.timed_out:
            note = ""
            if limit < requested:
                note = (f"[the requested timeout of {requested:g}s exceeds this server's "
                        f"ceiling; {limit:g}s was applied]\n")
            separator = "" if not result.stderr or result.stderr.endswith("\n") else "\n"
            result.stderr += f"{separator}{note}Command timed out after {limit:g}s."
        return result

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise SandboxClosed(f"sandbox {self.name} was closed during the call")

    def _result(self, done: dict, collector: _Collector) -> ExecResult:
        return_code = done.get("return_code")
        if (isinstance(return_code, bool) or not isinstance(return_code, int)
                or not -(2**31) <= return_code < 2**31):
            return_code = 1  # whatever the agent (or code posing as it) claimed
        cap = self._pool.settings.output_cap_bytes
        result = ExecResult(
            stdout=collector.text("stdout"),
            stderr=collector.text("stderr"),
            return_code=return_code,
            files=self._produced(done.get("files")),
        )
        if "stdout" in done and isinstance(done.get("stdout"), str):  # editor answers inline
            result.stdout = clean_text(done["stdout"][:cap])
            result.stderr = clean_text(str(done.get("stderr") or "")[:cap])
            editor = done.get("editor")
            result.editor = _clean_tree(editor) if isinstance(editor, dict) else None
        if isinstance(done.get("error"), str):
            result.stderr = clean_text((result.stderr + done["error"])[:cap + len(TRUNCATION_MARKER)])
        if done.get("timed_out") is True:
            result.limits.append(Limit.TIMEOUT)
        truncated = done.get("truncated")
        if (isinstance(truncated, dict) and any(truncated.values())) or any(
                collector.truncated.values()):
            result.limits.append(Limit.OUTPUT)
        return result

    def _died(self, collector: _Collector) -> ExecResult:
        result = ExecResult(stdout=collector.text("stdout"), stderr=collector.text("stderr"),
                            return_code=137, restarted=True)
        if self._notice_limits(result):
            detail = "killed: the sandbox exceeded its memory limit"
        else:
            detail = "the sandbox's interpreter stopped unexpectedly"
            self._pool.stats.crashes += 1
            log.warning("sandbox crashed under a call; restarting it on the same files",
                        extra={"sandbox": self.name, **self.owner})
        separator = "" if not result.stderr or result.stderr.endswith("\n") else "\n"
        result.stderr += (f"{separator}{detail}; it was restarted with the same files, "
                          "but variables and imports from earlier calls are gone.")
        return result

    def _notice_limits(self, result: ExecResult) -> bool:
        """Attribute a failure to the limits that fired since the last look: the
        cgroup's counters, and a files volume with no room or no inode left."""
        fired = False
        try:
            disk = os.statvfs(self.home.workspace)
            if disk.f_bavail * disk.f_frsize < _DISK_NEARLY_FULL or disk.f_favail == 0:
                result.limits.append(Limit.DISK)
        except OSError:
            pass
        oom = self._cgroup.oom_kills()
        if oom > self._oom_seen:
            self._pool.stats.oom_kills += oom - self._oom_seen
            self._oom_seen = oom
            result.limits.append(Limit.MEMORY)
            fired = True
            log.warning("sandbox hit its memory limit: the kernel killed a process (OOM)",
                        extra={"sandbox": self.name, "oom_kills": oom, **self.owner})
        pids = self._cgroup.pids_limit_hits()
        if pids > self._pids_seen:
            self._pids_seen = pids
            result.limits.append(Limit.PIDS)
        return fired

    def _produced(self, files: object) -> list[ProducedFile]:
        produced = []
        if not isinstance(files, list):
            return produced
        for entry in files[:50]:
            if not isinstance(entry, dict):
                continue
            path, size = entry.get("path"), entry.get("size")
            # No file has a longer path: past it, parse_path refused the forged one
            # where the run kept its files, and the run failed as a server bug.
            if (isinstance(path, str) and isinstance(size, int) and "\x00" not in path
                    and _utf8(path) and len(path.encode()) <= MAX_PATH_BYTES
                    and (path.startswith(OUTPUTS + "/") or path.startswith(WORKSPACE + "/"))
                    and not {".", "..", ""} & set(path[1:].split("/"))):
                produced.append(ProducedFile(path=path, size=size))
        return produced

    async def _restart_locked(self) -> None:
        self._process.close_channel()
        try:
            await asyncio.to_thread(self._stop_processes)
        except TimeoutError as exc:
            # Stragglers die on their own (SIGKILL is pending); the sandbox must not wait.
            log.warning("sandbox %s: %s; restarting anyway", self.name, exc)
        self._pool.stats.restarts += 1
        self._process = await self._pool._spawn(self)

    def _stop_processes(self) -> None:
        stop_process_tree(self._process, self._cgroup)

    def _remove(self) -> None:
        """Blocking teardown: processes, cgroup, directories. Called by the pool."""
        self._process.close_channel()
        try:
            self._stop_processes()
        except TimeoutError as exc:
            log.warning("sandbox %s: %s", self.name, exc)  # discard() keeps at them
        self._pool.discard_cgroup(self._cgroup)
        self.release_home()

    @property
    def files(self) -> SandboxFiles:
        """Host-side access to this sandbox's workspace, outputs and uploads."""
        return SandboxFiles(self.home, self.uid, self._pool.settings.max_file_bytes,
                            durable=self.durable_files)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def clean_text(text: str) -> str:
    """Text that can leave as UTF-8: code posing as the agent may send JSON
    escapes of lone surrogates, which no response could encode."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def _clean_tree(value: object, depth: int = 0) -> object:
    """The editor's structured answer, with clean text; nothing a real editor
    answer would hold is nested deeper than a few levels."""
    if depth > 8:
        return None
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict):
        return {clean_text(str(k)): _clean_tree(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean_tree(item, depth + 1) for item in value]
    return value
