"""Runs: one piece of code executed to completion, observable while it runs.

A run is what Caronte's ``/v1/code-execution/runs`` starts and what the gateway
loops execute for a model: Python or JavaScript, optionally attached to a
container, optionally with client tools its code may call. A run belongs to no
connection: it executes in a task of its own and writes everything it does
into its event log, so a client that drops the stream loses nothing and can
replay it, and the gateway can pause a run across HTTP requests while its code
waits for a tool result.

The manager owns run records: live ones in memory, finished ones in the
metadata store for the retention period.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
import time
from dataclasses import dataclass, field

from shoal.config import MiB, Settings
from shoal.sandbox import (CallTooLarge, DiskFull, ExecResult, FileAccessError, Limit, PoolBusy,
                           Sandbox, SandboxPath, StubSpec, UidsExhausted, parse_path)
from shoal.sandbox.launcher import LaunchFailed
from shoal.sandbox.mounts import OUTPUTS, WORKSPACE
from shoal.sessions import (AtCapacity, ContainerFile, SandboxClosed, SessionManager, Slot,
                            UnknownContainer)
from shoal.sessions.container_files import log_left_out
from shoal.storage import ContainerRecord, RunRecord

from shoal.egress.tokens import ModelAccess, model_env

from .broker import ClientTools, Grant, PendingCall, ToolSpec
from .events import Event, EventLog

log = logging.getLogger("shoal.runs")

LANGUAGES = ("python", "javascript")  # what the runs API offers; the gateway adds bash and edit
DEFAULT_TIMEOUT_MS = 30_000
MAX_TIMEOUT_MS = 300_000
GENERATED_FILES_PER_RUN = 50
# Files one request may attach: Caronte's spec materialises at most 50 external
# files per run, and each attached file is a copy into the container (a 1 MiB
# upload named 3,000 times took 13 s). More go in one at a time, by
# POST /v1/containers/{id}/files.
MAX_FILE_IDS = 50
# In a stored record's body, not in what GET shows: the id of the run's last
# event, so that a replay from the record keeps the ids the stream had.
_LAST_EVENT_ID = "_last_event_id"


class TooManyFiles(ValueError):
    """A request names more files to attach than one request may."""


def distinct_file_ids(file_ids: list[str]) -> list[str]:
    """The ids in their order, each once; TooManyFiles past MAX_FILE_IDS of them
    (its words follow the field's name: "file_ids names 51 files; …")."""
    distinct = list(dict.fromkeys(file_ids))
    if len(distinct) > MAX_FILE_IDS:
        raise TooManyFiles(f"names {len(distinct)} files; at most {MAX_FILE_IDS} may be "
                           "attached by one request")
    return distinct


_NO_TOOLS = Grant([], [])


class UnknownRun(LookupError):
    """No run with that id exists for this tenant."""


class RunConflict(RuntimeError):
    """The run is not in a state that allows the request (finished, or waiting for nothing)."""


class UnknownToolCall(LookupError):
    """A tool result names a call the run never made."""


@dataclass
class RunRequest:
    """What to run. ``language`` is python or javascript (``code``), bash
    (``code`` is the command) or edit (``edit`` is the text editor's request).

    ``caronte_files`` gives the run Caronte's view of its container: its files
    laid out under ``./external-files`` and new files at the top of the
    workspace copied into the container; without it (the gateway tools), files
    are reported where the code left them."""

    language: str
    code: str = ""
    tools: list[ToolSpec] = field(default_factory=list)
    allowed_tools: list[str] = field(default_factory=list)
    container_id: str | None = None
    file_ids: list[str] = field(default_factory=list)
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    edit: dict | None = None
    caronte_files: bool = True
    restart: bool = False
    # The gateway request this code runs for (dialect, model, user): its code may
    # call the model API with a token of the request's tenant (shoal.egress.tokens).
    model: ModelAccess | None = None


@dataclass(eq=False)
class Run:
    id: str
    tenant: str
    request: RunRequest
    grant: Grant
    log: EventLog = field(default_factory=EventLog)
    status: str = "running"  # running | completed | failed | cancelled
    container: ContainerRecord | None = None
    implicit_container: bool = False
    created_at: float = field(default_factory=time.time)
    started: float = field(default_factory=time.perf_counter)
    result: ExecResult | None = None
    error: str | None = None
    duration_ms: int = 0
    files: list[ContainerFile] = field(default_factory=list)
    tools: ClientTools | None = None
    sandbox: Sandbox | None = None
    task: asyncio.Task | None = None
    cancel_requested: bool = False
    # Set once the run's result is final: the record to read, and what waiters wait on.
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    finished_callbacks: list = field(default_factory=list)
    kept_bytes: int = 0  # what it counts against the finished logs kept for replay

    @property
    def container_id(self) -> str | None:
        return self.container.id if self.container is not None else None

    @property
    def inner_tool_calls(self) -> int:
        return self.tools.calls if self.tools is not None else 0

    @property
    def waiting(self) -> list[PendingCall]:
        return self.tools.waiting if self.tools is not None else []

    def emit(self, name: str, data: dict, bounded: bool = False) -> Event | None:
        return self.log.append(name, {"runId": self.id, **data}, bounded=bounded)

    def held_bytes(self) -> int:
        """About what a finished run keeps in memory: its log, its code and its
        output (the log's last event carries a copy of that)."""
        size = self.log.size + sys.getsizeof(self.request.code)
        if self.request.edit:
            size += sum(sys.getsizeof(value) for value in self.request.edit.values())
        if self.result is not None:
            size += sys.getsizeof(self.result.stdout) + sys.getsizeof(self.result.stderr)
        return size

    def record(self) -> dict:
        """The run in the spec's "Tool result shape"."""
        result = self.result
        body = {
            "run_id": self.id,
            "stdout": result.stdout if result else "",
            "stderr": result.stderr if result else "",
            "exit_code": result.return_code if result and self.status == "completed" else None,
            "status": self.status,
            "duration_ms": self.duration_ms if self.status != "running" else int(
                (time.perf_counter() - self.started) * 1000),
            "inner_tool_calls": self.inner_tool_calls,
            "files": [render_generated(item, self.container_id) for item in self.files],
            "language": self.request.language,
            "created_at": int(self.created_at),
        }
        if self.container_id is not None:
            body["container_id"] = self.container_id
            body["implicit"] = self.implicit_container
        if self.error is not None:
            body["error"] = self.error
        if self.status == "running" and self.waiting:
            body["pending_tool_calls"] = [p.public() for p in self.waiting]
        return body


def public_file_id(item: ContainerFile) -> str:
    return "cfile_" + item.id


def render_generated(item: ContainerFile, container_id: str | None) -> dict:
    return {"file_id": public_file_id(item), "filename": item.filename,
            "mime_type": item.mime_type, "size_bytes": item.record.size,
            "container_id": container_id, "path": item.path}


class RunManager:
    def __init__(self, settings: Settings, sessions: SessionManager) -> None:
        self.settings = settings
        self.sessions = sessions
        self._live: dict[str, Run] = {}
        self._finished_logs: dict[str, Run] = {}
        self._finished_bytes = 0
        self._reaper: asyncio.Task | None = None
        # Bytes each tenant stored since its records were last trimmed: the sum
        # is read from the store once per a sixteenth of the bound, not per run.
        self._stored_since_trim: dict[str, int] = {}

    # -- lifecycle -----------------------------------------------------------------------------
    async def start_reaper(self) -> None:
        self._reaper = asyncio.create_task(self._reap_forever())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        runs = list(self._live.values())
        for run in runs:
            await self._request_cancel(run, "the server is shutting down")
        tasks = [run.task for run in runs if run.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(max(60.0, self.settings.reaper_interval_seconds))
            try:
                cutoff = time.time() - self.settings.run_retention_seconds
                for run in [r for r in self._finished_logs.values() if r.created_at < cutoff]:
                    self._forget_log(run)
                removed = await self.sessions.metadata.delete_runs_before(cutoff)
                if removed:
                    log.info("forgot %d runs older than the retention period", removed)
            except Exception:
                log.exception("run reaper failed; retrying next interval")

    # -- starting -----------------------------------------------------------------------------
    async def start(self, tenant: str, request: RunRequest) -> Run:
        """Check what the run needs, then start it in the background; the returned
        run's log already holds ``run.created``."""
        grant = Grant(request.tools, request.allowed_tools)
        slot = self.sessions.claim_slot(tenant)
        try:
            return await self._start(tenant, request, grant, slot)
        except BaseException:
            slot()
            raise

    async def _start(self, tenant: str, request: RunRequest, grant: Grant, slot: Slot) -> Run:
        container = None
        implicit = False
        if request.container_id is not None:
            container = await self.sessions.containers.get(tenant, request.container_id)
        uploads = [await self.sessions.uploads.get(tenant, file_id) for file_id in request.file_ids]
        if uploads and container is None:
            container = await self.sessions.containers.create(tenant, implicit=True)
            implicit = True
        run = Run(id="cexrun_" + self.settings.node_key + secrets.token_hex(12), tenant=tenant,
                  request=request, grant=grant, log=EventLog(self.settings.run_log_bytes),
                  container=container, implicit_container=implicit)
        run.tools = ClientTools(grant, self.settings.tool_wait_seconds,
                                lambda calls: _announce(run, calls))
        for upload in uploads:
            _, handle, _ = await self.sessions.uploads.open(tenant, upload.id)
            await self.sessions.container_files.attach_upload(container, upload, handle,
                                                              checkpoint=False)
        if uploads:  # one snapshot for all of them
            await self.sessions.container_files.checkpoint(container)
        run.emit("run.created", {"status": "running", "container_id": run.container_id})
        self._live[run.id] = run
        run.task = asyncio.create_task(self._execute(run, slot))
        # Let the run take its sandbox and send its code before the caller builds
        # and writes its response: the sandbox works while the server does.
        await asyncio.sleep(0)
        return run

    # -- reading ----------------------------------------------------------------------------------
    def live(self, tenant: str, run_id: str) -> Run:
        run = self._live.get(run_id)
        if run is None:
            run = self._finished_logs.get(run_id)
            if run is not None and self._expired(run.created_at):
                self._forget_log(run)
                run = None
        if run is None or run.tenant != tenant:
            raise UnknownRun(f"no run {run_id!r}")
        return run

    def _expired(self, created_at: float) -> bool:
        """Past the retention period, as the reaper judges it (by its start). The
        reaper passes once a minute or more, and finished logs in memory went
        only as newer runs pushed them out: a run's output was read back for
        as long as the server was quiet, after its retention had ended."""
        return created_at < time.time() - self.settings.run_retention_seconds

    def _forget_log(self, run: Run) -> None:
        if self._finished_logs.pop(run.id, None) is not None:
            self._finished_bytes -= run.kept_bytes

    async def _stored(self, tenant: str, run_id: str) -> RunRecord | None:
        stored = await self.sessions.metadata.get_run(tenant, run_id)
        if stored is None or self._expired(stored.created_at):
            return None
        return stored

    async def record(self, tenant: str, run_id: str) -> dict:
        try:
            return self.live(tenant, run_id).record()
        except UnknownRun:
            stored = await self._stored(tenant, run_id)
            if stored is None:
                raise
            return {key: value for key, value in stored.body.items() if key != _LAST_EVENT_ID}

    async def events(self, tenant: str, run_id: str) -> EventLog:
        """The run's event log; once it is no longer kept, its start and its end
        rebuilt from the stored record, with the ids they had."""
        try:
            return self.live(tenant, run_id).log
        except UnknownRun:
            stored = await self._stored(tenant, run_id)
            if stored is None:
                raise
            return _replayed(stored.body)

    # -- the client's answers --------------------------------------------------------------------
    async def _live_or_conflict(self, tenant: str, run_id: str) -> Run:
        """The run in memory; RunConflict for one that is only stored (finished,
        its log no longer kept): it exists, as GET says, and is over."""
        try:
            return self.live(tenant, run_id)
        except UnknownRun:
            stored = await self._stored(tenant, run_id)
            if stored is None:
                raise
            raise RunConflict(f"run {run_id} has already {stored.status}") from None

    async def submit(self, tenant: str, run_id: str, results: list[dict]) -> int:
        """Resume waiting calls with the client's results; how many were new."""
        run = await self._live_or_conflict(tenant, run_id)
        tools = run.tools
        assert tools is not None
        unknown = [r["call_id"] for r in results if not tools.knows(r["call_id"])]
        if unknown:
            if not run.waiting:
                raise RunConflict(f"run {run_id} is {run.status} and waits for no tool result")
            raise UnknownToolCall(f"run {run_id} made no tool call {unknown[0]!r}")
        # A result for a call answered before is a no-op, as a retried POST should be.
        return sum(tools.resolve(r["call_id"], r.get("output"), r.get("error")) for r in results)

    async def cancel(self, tenant: str, run_id: str) -> dict:
        run = await self._live_or_conflict(tenant, run_id)
        if run.status != "running":
            raise RunConflict(f"run {run_id} has already {run.status}")
        await self._request_cancel(run, "cancelled by the client")
        await run.finished.wait()
        return run.record()

    async def _request_cancel(self, run: Run, reason: str) -> None:
        if run.cancel_requested:
            return
        run.cancel_requested = True
        run.error = reason
        if run.tools is not None:
            run.tools.fail_all(f"the run was {reason}")
        if run.sandbox is not None and await run.sandbox.cancel(caller=run):
            return
        if run.task is not None and not run.finished.is_set() and run.result is None:
            # Its code is not running: it is still acquiring its sandbox, laying
            # out its files, or queued behind another run on its container's
            # sandbox (whose call is that run's, not this one's to stop).
            run.task.cancel()

    # -- executing --------------------------------------------------------------------------------
    async def _execute(self, run: Run, slot: Slot) -> None:
        leftover: list[Sandbox] = []
        try:
            try:
                await self._run_in_sandbox(run, leftover)
                self._settle(run)
            except asyncio.CancelledError:
                run.status = "cancelled"
            except Exception as exc:  # noqa: BLE001 - a run fails, the server does not
                known = _client_error(exc)
                if known is None:
                    log.exception("run %s failed", run.id)
                run.status = "failed"
                run.error = known or "the run could not be executed (internal error)"
            finally:
                await self._finish(run, slot)
            # The client has its answer; an ephemeral sandbox goes away after it.
            for sandbox in leftover:
                await sandbox.close()
        finally:
            slot()

    def _settle(self, run: Run) -> None:
        if run.cancel_requested:
            run.status = "cancelled"
        elif run.result is not None and run.result.timed_out:
            run.status = "failed"
            run.error = f"the run timed out after {self._timeout_seconds(run):g}s"
        elif run.result is not None and Limit.MEMORY in run.result.limits:
            run.status = "failed"
            run.error = "the run was killed: it exceeded its memory limit"
        else:
            run.status = "completed"

    def _timeout_seconds(self, run: Run) -> float:
        ms = min(run.request.timeout_ms, MAX_TIMEOUT_MS)
        return min(ms / 1000, float(self.settings.max_timeout_seconds))

    async def _run_in_sandbox(self, run: Run, leftover: list[Sandbox]) -> None:
        sessions = self.sessions
        container = run.container
        if container is not None:
            sandbox, _ = await sessions.containers.acquire(container)
        else:
            sandbox = await sessions.pool.lease()
            leftover.append(sandbox)
        run.sandbox = sandbox
        sandbox.owner = {"tenant": run.tenant, "run": run.id,
                         **({"container": container.id} if container is not None else {})}
        scope = container.id if container is not None else f"run:{run.id}"
        env = {}
        token = None
        if run.request.model is not None and self.settings.model_upstream:
            token = sessions.model_tokens.issue(run.tenant, scope, run.request.model.user)
            env = model_env(run.request.model, token)
        sessions.grant_egress(sandbox, run.tenant, container, scope, env)
        try:
            request = run.request
            caronte = request.caronte_files and container is not None
            if caronte:
                await sessions.container_files.lay_out_external(container)
            if request.restart:
                await sandbox.restart()
            stubs = StubSpec(run.grant.stubs()) if run.grant.tools else None
            timeout = self._timeout_seconds(run)
            # Past the log's budget an output event is left out: the run's end
            # carries its output whole (to the output cap) all the same.
            on_output = lambda stream, text: run.emit(  # noqa: E731
                "run.output", {"stream": stream, "text": text}, bounded=True)
            if request.language == "bash":
                run.result = await sandbox.run_bash(request.code, timeout, on_output, caller=run)
            elif request.language == "edit":
                run.result = await sandbox.edit(request.edit or {}, timeout, caller=run)
            else:
                runner = sandbox.run_python if request.language == "python" else sandbox.run_javascript
                run.result = await runner(request.code, timeout, on_output, stubs=stubs,
                                          tools=run.tools, external_files=caronte, caller=run)
            if request.caronte_files:
                run.files = await self._keep_files(run, sandbox)
            elif container is not None:
                run.files = await sessions.container_files.produced(container, run.result.files)
        finally:
            if token is not None:
                sessions.model_tokens.revoke(token)
            run.sandbox = None
            if container is not None:
                sessions.containers.release(container)
                await sessions.containers.touch(container)

    async def _keep_files(self, run: Run, sandbox: Sandbox) -> list[ContainerFile]:
        """The files the run produced, made the container's (an implicit one is
        created for a run without a container, so nothing produced is lost)."""
        result = run.result
        assert result is not None
        produced = [f for f in result.files
                    if f.path.startswith(OUTPUTS + "/")
                    or (f.path.startswith(WORKSPACE + "/") and f.path.count("/") == 4)]
        if not produced:
            return []
        sessions = self.sessions
        if run.container is not None:
            return await sessions.container_files.keep_produced(
                run.container, produced, GENERATED_FILES_PER_RUN)
        run.container = await sessions.containers.create(run.tenant, implicit=True)
        run.implicit_container = True
        kept = []
        dropped: list[tuple[str, str]] = []
        targets: set[tuple[str, ...]] = set()
        files = sandbox.files
        for item in produced[:GENERATED_FILES_PER_RUN]:
            path = parse_path(item.path)
            # Where a container run keeps it (keep_produced): outputs/a/r.txt
            # stays there. Named by its last part alone, outputs/a/r.txt,
            # outputs/b/r.txt and ./r.txt were one file, written over twice and
            # reported three times under one id.
            if path.parts in targets:
                dropped.append((item.path, "a newer file of the run has its place in outputs"))
                continue
            try:
                handle, _ = await asyncio.to_thread(files.open_for_reading, path)
            except FileAccessError as exc:
                dropped.append((item.path, str(exc)))
                continue
            with handle:
                kept.append(await sessions.container_files.put(
                    run.container, SandboxPath(OUTPUTS, path.parts), handle,
                    source_kind="assistant", checkpoint=False))
            targets.add(path.parts)
        dropped += [(item.path, f"at most {GENERATED_FILES_PER_RUN} per run")
                    for item in produced[GENERATED_FILES_PER_RUN:]]
        log_left_out(f"run {run.id}", "produced but not kept", dropped)
        if kept:  # one snapshot for the run's files, not one each
            await sessions.container_files.checkpoint(run.container)
        return kept

    async def _finish(self, run: Run, slot: Slot) -> None:
        if run.finished.is_set():
            return
        run.duration_ms = int((time.perf_counter() - run.started) * 1000)
        if run.tools is not None:
            run.tools.fail_all("the run ended")
        # What only a running run needs goes: a finished one is kept for replay
        # (run_logs_kept of them), and its declared tools (128 schemas, up to a
        # request's size) with their compiled validators were kept with it,
        # outside the bytes counted (30 runs held 474 MiB).
        run.request.tools = []
        run.grant = _NO_TOOLS
        if run.tools is not None:
            run.tools.grant = _NO_TOOLS
        record = run.record()
        run.log.append(*_end_event(record))
        # The stream ends here, so the run is over for its tenant, who may start
        # the next one at once; its sandbox, closing, holds a server slot still.
        slot.leave_share()
        run.log.close()
        run.finished.set()
        for callback in run.finished_callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - a watcher's bug must not break the run
                log.exception("a callback of run %s failed", run.id)
        # Readers find the run among the finished ones from now on; the stored
        # record (written after the answer went out) outlives the in-memory log.
        self._live.pop(run.id, None)
        self._keep_log(run)
        try:
            stored = await self.sessions.metadata.put_run(RunRecord(
                tenant=run.tenant, id=run.id, container_id=run.container_id, status=run.status,
                created_at=run.created_at, body={**record, _LAST_EVENT_ID: run.log.last_id}))
            await self._bound_stored(run.tenant, stored)
        except Exception:  # noqa: BLE001 - the in-memory record still answers for a while
            log.exception("could not store run %s", run.id)

    async def _bound_stored(self, tenant: str, stored: int) -> None:
        """Hold a tenant's stored records to tenant_max_stored_run_bytes: each keeps
        its output (up to 2 MiB), and one tenant running code in a loop stored
        80 MiB in 5 s, terabytes a day for the retention to catch up with."""
        bound = self.settings.tenant_max_stored_run_bytes
        since = self._stored_since_trim.get(tenant, 0) + stored
        if since < bound // 16:
            self._stored_since_trim[tenant] = since
            return
        self._stored_since_trim.pop(tenant, None)
        forgotten = await self.sessions.metadata.trim_runs(tenant, bound)
        if forgotten:
            log.info("forgot %d of a tenant's oldest run records: its records passed %d bytes",
                     forgotten, bound, extra={"tenant": tenant})

    def _keep_log(self, run: Run) -> None:
        """Keep the finished run for replay, within the count and the bytes kept
        (the heaviest tenant's oldest out first): each log alone may hold
        run_log_bytes, and 256 such would be gigabytes that nothing frees."""
        settings = self.settings
        kept = self._finished_logs
        run.kept_bytes = run.held_bytes()
        kept[run.id] = run
        self._finished_bytes += run.kept_bytes
        while kept and (len(kept) > settings.run_logs_kept
                        or self._finished_bytes > settings.run_logs_kept_bytes):
            self._finished_bytes -= kept.pop(self._evicted(
                by_bytes=self._finished_bytes > settings.run_logs_kept_bytes)).kept_bytes

    def _evicted(self, by_bytes: bool) -> str:
        """The log that goes: the oldest of the tenant holding the most (logs, or
        bytes when those are over). Oldest of all, one tenant running code in a
        loop pushed every other tenant's logs out, whose replays then lost their
        output and tool-call events."""
        held: dict[str, int] = {}
        for run in self._finished_logs.values():
            held[run.tenant] = held.get(run.tenant, 0) + (run.kept_bytes if by_bytes else 1)
        heaviest = max(held, key=held.__getitem__)
        return next(run_id for run_id, run in self._finished_logs.items()
                    if run.tenant == heaviest)


def _replayed(body: dict) -> EventLog:
    """A finished run's log rebuilt from its record: ``run.created`` and its end,
    each with the id it had (a record stored before ids were kept: 1 and 2), so
    a client resuming from any id it was sent gets what followed it."""
    run_id = body["run_id"]
    last_id = body.get(_LAST_EVENT_ID)
    if isinstance(last_id, bool) or not isinstance(last_id, int) or last_id < 2:
        last_id = 2
    log = EventLog()
    log.append("run.created", {"runId": run_id})
    log.append(*_end_event(body), event_id=last_id)
    log.close()
    return log


def _end_event(record: dict) -> tuple[str, dict]:
    """A finished run's last event, from its record (the tool result shape): the
    same whether the run just ended or its log is rebuilt from the stored record."""
    data = {"runId": record["run_id"],
            **{key: record.get(key) for key in ("stdout", "stderr", "duration_ms")}}
    if record["status"] == "completed":
        return "run.completed", {**data, "exit_code": record["exit_code"],
                                 "inner_tool_calls": record["inner_tool_calls"],
                                 "files": record["files"], "container_id": record.get("container_id")}
    return "run.failed", {**data, "error": record.get("error") or record["status"],
                          "status": record["status"], "container_id": record.get("container_id")}


def _announce(run: Run, calls: list[PendingCall]) -> None:
    """Ask the client for a batch of tool calls if the run's log has room for it.
    Calls made together are announced together or not at all; past the budget
    they fail in the code at once, and the client never hears of them."""
    if run.emit("tool_call.required", {"calls": [c.public() for c in calls]},
                bounded=True) is not None or run.log.closed:
        return
    budget = run.log.budget or 0
    reason = (f"tool call not made: this run's event log is full (its tool calls' arguments "
              f"and its output may add up to {budget / MiB:g} MiB); pass large data through "
              "files instead")
    log.info("run %s: %d tool call(s) refused: its event log is full", run.id, len(calls))
    tools = run.tools
    assert tools is not None
    tools.calls -= len(calls)  # counted as made; like a call its schema refuses, none was
    for call in calls:
        tools.resolve(call.call_id, error=reason)


def _client_error(exc: Exception) -> str | None:
    """A failure the client can act on, in words; None for a server bug."""
    if isinstance(exc, (AtCapacity, PoolBusy, UidsExhausted, DiskFull)):
        return str(exc)
    if isinstance(exc, LaunchFailed):
        return "no sandbox could be started; retry later"
    if isinstance(exc, CallTooLarge):
        return "the code and its tools are too large to run"
    if isinstance(exc, SandboxClosed):
        return "the run's sandbox was shut down while it ran"
    if isinstance(exc, UnknownContainer):
        # Deleted (or expired) after the run looked it up: not a server bug.
        return "the run's container was deleted while the run used it"
    return None
