"""The gateway as the routers see it: upstreams, and requests made ready for the loop.

Everything a request needs before its first model call is resolved here, so a
bad request fails before anything runs: its container (given, or the one keyed
on the user), the files it uploads into it, the skills it mounts, its history
mapped for the upstream.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import httpx

from shoal.config import Settings, read_secret
from shoal.egress.tokens import ModelAccess
from shoal.runs import RunManager, UnknownRun
from shoal.sessions import (ContainerExists, ContainerFile, SessionManager, TenantQuotaExceeded,
                            UnknownContainer)
from shoal.sessions.network import check_network_policy
from shoal.storage import ContainerRecord, ResponseRecord

from . import anthropic, openai
from .engine import Paused, ToolLoop, ToolUse, for_model
from .passed import PassedResponses
from .upstream import Upstream, UpstreamNotConfigured

log = logging.getLogger("shoal.gateway")


class OutOfScope(PermissionError):
    """A sandbox's own model call names a container its token was not issued for."""


def _within(scope: str | None, container_id: str | None) -> None:
    """``scope``: the container (or ephemeral run or session) whose sandbox made
    the request with its model token, None for a client's request. The token is
    that container's, so is any code the call runs: it ran wherever the code
    named, so code in one user's container read another user's files."""
    if scope is not None and container_id is not None and container_id != scope:
        raise OutOfScope(f"container {container_id!r} is not this sandbox's: code calls the "
                         "model with a token for its own container only")


class UnknownResponse(LookupError):
    """No stored response with that id for this tenant."""


@dataclass
class _PausedResponse:
    """A response whose run waited for the client's tool results when it ended:
    the run, the model's hidden call it answers, the calls the client was given,
    and the conversation to continue from."""

    tenant: str
    run_id: str
    use: ToolUse
    call_ids: list[str]
    state: dict
    size: int = 0  # about what its state holds, in bytes (its JSON)

    def stored(self) -> dict:
        return {"run_id": self.run_id, "use_id": self.use.id, "use_name": self.use.name,
                "calls": self.call_ids}

    @classmethod
    def from_stored(cls, tenant: str, stored: dict, state: dict) -> "_PausedResponse":
        return cls(tenant, stored["run_id"], ToolUse(stored["use_id"], stored["use_name"], None),
                   list(stored["calls"]), state)


# Paused responses remembered by call id, for clients that answer with the full
# input instead of previous_response_id; the oldest are forgotten first, past a
# count and past gateway_paused_bytes: each holds its conversation (a request's
# input may be tens of MiB), and 1,024 of them held 68 GiB at most. One tenant's
# may hold half the bytes, so that its flood does not push every other tenant's out.
_PAUSED_KEPT = 1024


def _model_of(body: dict) -> str | None:
    model = body.get("model")
    return model if isinstance(model, str) and model else None


class Gateway:
    def __init__(self, settings: Settings, sessions: SessionManager, runs: RunManager,
                 client: httpx.AsyncClient, tenants: int = 1) -> None:
        self.settings = settings
        self.passed = PassedResponses(sessions.metadata, tenants)
        self.sessions = sessions
        self.runs = runs
        self._anthropic = _upstream("anthropic", settings.upstream_anthropic_url,
                                    settings.upstream_anthropic_key, client,
                                    "bearer" if settings.upstream_anthropic_auth == "bearer"
                                    else "default")
        self._openai = _upstream("openai", settings.upstream_openai_url,
                                 settings.upstream_openai_key, client)
        # Paused responses by (tenant, call id): a request that answers one with
        # the full input instead of previous_response_id still finds it.
        self._paused: dict[tuple[str, str], _PausedResponse] = {}
        self._paused_order: dict[int, _PausedResponse] = {}  # by id(), oldest first
        self._paused_bytes: dict[str, int] = {}  # by tenant
        # Requests in flight by tenant: a model call may hold its connection for
        # minutes, and one tenant's many must not hold every other tenant's too.
        self._in_flight: dict[str, int] = {}
        self._sweeper: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)

    async def _sweep_forever(self) -> None:
        """Stored responses past response_retention_seconds are deleted: none
        ever was, and each stayed readable, continuable and counted against its
        tenant's quota for good; so are the owners of passed-through responses
        the upstream no longer keeps. Swept at start too (a server down for a while)."""
        retention = self.settings.response_retention_seconds
        while True:
            try:
                removed = await self.sessions.metadata.delete_responses_before(
                    time.time() - retention)
                if removed:
                    log.info("forgot %d stored responses older than their retention", removed)
                await self.passed.sweep()
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("the stored-response sweep failed; retrying next round")
            await asyncio.sleep(min(60.0, max(1.0, retention / 2)))

    async def _kept(self, tenant: str, response_id: str) -> ResponseRecord | None:
        """A stored response, unless its retention is over: what the next sweep
        deletes is gone already."""
        stored = await self.sessions.metadata.get_response(tenant, response_id)
        if stored is None or (stored.created_at
                              < time.time() - self.settings.response_retention_seconds):
            return None
        return stored

    def hold(self, tenant: str) -> Callable[[], None]:
        """Count one request of ``tenant`` in flight until the returned function is
        called (any number of times); TenantQuotaExceeded past its share."""
        limit = self.settings.tenant_max_gateway_requests
        held = self._in_flight.get(tenant, 0)
        if limit and held >= limit:
            raise TenantQuotaExceeded(f"this tenant already has {held} gateway requests in "
                                      f"flight, its limit; retry when one has finished")
        self._in_flight[tenant] = held + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                left = self._in_flight[tenant] - 1
                if left:
                    self._in_flight[tenant] = left
                else:
                    del self._in_flight[tenant]
        return release

    def upstream(self, dialect: str) -> Upstream:
        upstream = self._anthropic if dialect == "anthropic" else self._openai
        if upstream is None:
            variable = f"SHOAL_UPSTREAM_{dialect.upper()}_URL"
            raise UpstreamNotConfigured(
                f"this server has no upstream model for this API: the operator sets {variable} "
                f"(--upstream-{dialect}-url)")
        return upstream

    async def container_for(self, tenant: str, container_id: str | None,
                            user: str | None, scope: str | None = None) -> ContainerRecord:
        """The named container (made if new), or the one keyed on the user, as
        Zylon's documentation describes for requests that name none; for a
        sandbox's own call (``scope``), one keyed on its scope whatever user it names."""
        _within(scope, container_id)
        if scope is not None:
            # Not the scope's container itself, busy running the very code that
            # waits on this call: a container of the scope's own, for its code.
            user = f"\x00{scope}"
        if container_id is None:
            digest = hashlib.sha256(f"{tenant}\x00{user or ''}".encode()).hexdigest()[:24]
            container_id = f"user_{digest}"
        return await self.sessions.containers.get_or_create(tenant, container_id)

    # -- /v1/messages --------------------------------------------------------------------------
    async def prepare_messages(self, tenant: str, request: anthropic.MessagesRequest,
                               headers: dict[str, str], run: bool = True,
                               scope: str | None = None
                               ) -> tuple[anthropic.AnthropicAdapter | None, ToolLoop | None]:
        """Check everything; with ``run``, also create what the request names and
        return the loop that serves it."""
        uploads = [await self.sessions.uploads.get(tenant, file_id) for file_id in request.uploads]
        if request.skills:
            self.sessions.containers.check_skills(request.skills)
        notes = {upload.id: f"[The user uploaded {upload.filename}: it is at "
                            f"/mnt/user-data/uploads/{upload.filename}]" for upload in uploads}
        history = anthropic.upstream_history(request.body["messages"], notes)
        if not run:
            return None, None
        upstream = self.upstream("anthropic")
        metadata = request.body.get("metadata")
        user = metadata.get("user_id") if isinstance(metadata, dict) else None
        container = await self.container_for(tenant, request.container_id,
                                             user if isinstance(user, str) else None, scope)
        for upload in uploads:
            _, handle, _ = await self.sessions.uploads.open(tenant, upload.id)
            await self.sessions.container_files.attach_upload(container, upload, handle)
        if request.skills is not None:
            await self.sessions.containers.select_skills(container, request.skills)
        containers = self.sessions.containers

        def expiry() -> float:
            return containers.current(container).expires_at

        adapter = anthropic.AnthropicAdapter(request, upstream, container, history, headers, expiry)
        model = ModelAccess("anthropic", _model_of(request.body), user if isinstance(user, str) else None)
        return adapter, ToolLoop(adapter, self.runs, tenant, self.settings.gateway_max_round_trips,
                                 model, keepalive_seconds=self.settings.stream_ping_seconds)


    # -- /v1/responses -------------------------------------------------------------------------
    async def prepare_responses(self, tenant: str, request: openai.ResponsesRequest,
                                headers: dict[str, str],
                                scope: str | None = None) -> "ResponsesSession":
        upstream = self.upstream("openai")
        if request.store:
            # Checked before the model is asked: a response is stored only once it
            # is done, when refusing to keep it would lose what the client paid for.
            # So a tenant passes its quota by at most what its requests in flight add.
            used = await self.sessions.metadata.stored_response_bytes(tenant)
            if used >= self.settings.tenant_max_stored_response_bytes:
                raise TenantQuotaExceeded(
                    f"this tenant's stored responses take {used} bytes, its quota of "
                    f"{self.settings.tenant_max_stored_response_bytes}; delete some "
                    "(DELETE /v1/responses/{id}), or send \"store\": false")
        containers = self.sessions.containers
        state: dict = {}
        pending = None
        items = list(request.items)
        if request.previous_response_id is not None:
            stored = await self._kept(tenant, request.previous_response_id)
            if stored is None:
                raise UnknownResponse(f"Previous response with id "
                                      f"'{request.previous_response_id}' not found.")
            state = stored.state
            if state.get("paused_run"):
                pending = _PausedResponse.from_stored(tenant, state["paused_run"], state)
        else:
            answering = [index for index, item in enumerate(items)
                         if item.get("type") == "function_call_output"
                         and (tenant, str(item.get("call_id"))) in self._paused]
            if answering:
                # The full conversation came back: what we kept of it replaces the
                # client's copy, and only what follows the answers is new.
                pending = self._paused[(tenant, str(items[answering[0]]["call_id"]))]
                state = pending.state
                answers = [items[index] for index in answering]
                items = answers + items[answering[-1] + 1:]
        # A conversation carried on (stored, or paused) keeps its containers; a
        # sandbox's own call carries on only what its code started (one that ran
        # no code names no container, and may be another user's).
        if scope is not None and state and state.get("scope") != scope:
            raise OutOfScope("this conversation was not started by this sandbox's code: code "
                             "continues only the conversations it started")
        _within(scope, state.get("interpreter_container"))
        _within(scope, state.get("caronte_container"))
        conversation = openai.Conversation(list(state.get("history") or []),
                                           state.get("interpreter_container"),
                                           state.get("caronte_container"),
                                           dict(state.get("attached") or {}))
        resume = None
        if pending is not None:
            answers = [item for item in items if item.get("type") == "function_call_output"
                       and item.get("call_id") in pending.call_ids]
            items = [item for item in items if item not in answers]
            resume = await self._resume(pending, answers)
            if resume is None:
                conversation.history.append(await self._finished_run_output(pending))
        tool = request.code_interpreter
        if tool is not None and isinstance(tool.get("container"), str):
            _within(scope, tool["container"])
            conversation.interpreter_container = (await containers.get(tenant, tool["container"])).id
        if request.caronte is not None and request.caronte.get("container"):
            _within(scope, request.caronte["container"])
            await containers.get(tenant, request.caronte["container"])
        if tool is not None and isinstance(tool.get("container"), dict):
            containers.check_memory_limit(tool["container"].get("memory_limit"))
            for file_id in tool["container"].get("file_ids") or []:
                await self.sessions.uploads.get(tenant, file_id)
        for file_id in (request.caronte or {}).get("file_ids") or []:
            await self.sessions.uploads.get(tenant, file_id)
        conversation.history.extend(openai.upstream_items(items))

        async def container(kind: str, marker: dict | None) -> ContainerRecord | None:
            if kind == "interpreter":
                named = isinstance((marker or {}).get("container"), str)
                current = conversation.interpreter_container_id()
                spec = (marker or {}).get("container") if not named else None
                spec = spec or {}
                try:
                    record = await containers.get(tenant, current)
                except UnknownContainer:
                    if named:
                        raise
                    # An auto container, made now, when the model first calls the tool
                    # (under the id the client was already shown), or anew if it expired.
                    conversation.attached.pop(current, None)
                    try:
                        record = await containers.create(
                            tenant, current, name="code_interpreter", implicit=True,
                            memory_limit=spec.get("memory_limit"),
                            network_policy=check_network_policy(spec.get("network_policy")))
                    except ContainerExists:  # a concurrent request of the conversation made it
                        record = await containers.get(tenant, current)
                # A follow-up's files go into the conversation's container too: they
                # were attached only when it was made, and a file the user added later
                # was not there for the model's code.
                for file_id in conversation.not_attached(record.id, spec.get("file_ids") or []):
                    upload, handle, _ = await self.sessions.uploads.open(tenant, file_id)
                    await self.sessions.container_files.attach_upload(record, upload, handle)
                    conversation.mark_attached(record.id, [file_id])
                return record
            named = (marker or {}).get("container") or conversation.caronte_container
            if named is None:
                return None
            try:
                return await containers.get(tenant, named)
            except UnknownContainer:
                if (marker or {}).get("container"):
                    raise
                conversation.caronte_container = None  # expired since: a new implicit one
                return None

        async def read_file(container_id: str, item: ContainerFile) -> bytes:
            record = await containers.get(tenant, container_id)
            _, handle, _ = await self.sessions.container_files.open(record, item.id)
            with handle:
                return await asyncio.to_thread(handle.read)

        adapter = openai.OpenAIAdapter(request, upstream, conversation, container, read_file, headers)
        user = request.body.get("user") or request.body.get("safety_identifier")
        loop = ToolLoop(adapter, self.runs, tenant, self.settings.gateway_max_round_trips,
                        ModelAccess("openai", _model_of(request.body),
                                    user if isinstance(user, str) else None),
                        max_calls=request.body.get("max_tool_calls"),
                        keepalive_seconds=self.settings.stream_ping_seconds)
        return ResponsesSession(self, tenant, request, adapter, loop, resume, scope)

    async def _resume(self, pending: _PausedResponse, answers: list[dict]) -> Paused | None:
        """Hand the client's answers to the paused run; None if it is no longer
        waiting (it ended: its calls passed the wait ceiling)."""
        try:
            run = self.runs.live(pending.tenant, pending.run_id)
        except UnknownRun:
            return None
        if run.finished.is_set():
            return None
        if answers:
            try:
                await self.runs.submit(pending.tenant, pending.run_id, [
                    {"call_id": item["call_id"], "output": item.get("output"), "error": None}
                    for item in answers])
            except (LookupError, RuntimeError):
                return None
        return Paused(run, pending.use)

    async def _finished_run_output(self, pending: _PausedResponse) -> dict:
        """The hidden call's result, for a run that ended while the client thought."""
        try:
            record = await self.runs.record(pending.tenant, pending.run_id)
        except UnknownRun:
            record = {"status": "failed", "error": "the paused run is gone"}
        # Bounded as every other output the model is told of (engine.for_model).
        record = {**record, **{stream: for_model(record[stream]) for stream in ("stdout", "stderr")
                               if isinstance(record.get(stream), str)}}
        return {"type": "function_call_output", "call_id": pending.use.id,
                "output": json.dumps(record, ensure_ascii=False)}

    def _remember(self, entry: _PausedResponse) -> None:
        budget = self.settings.gateway_paused_bytes
        entry.size = len(json.dumps(entry.state, ensure_ascii=False, default=str))
        if entry.size > budget // 2:
            log.info("a paused response of %d bytes is not kept for a full-input answer "
                     "(previous_response_id still finds it)", entry.size)
            return
        for call_id in entry.call_ids:
            replaced = self._paused.pop((entry.tenant, call_id), None)
            if replaced is not None and replaced is not entry and not any(
                    self._paused.get((replaced.tenant, c)) is replaced for c in replaced.call_ids):
                self._forget(replaced)
            self._paused[(entry.tenant, call_id)] = entry
        self._paused_order[id(entry)] = entry
        self._paused_bytes[entry.tenant] = self._paused_bytes.get(entry.tenant, 0) + entry.size
        while self._paused_order and (
                len(self._paused_order) > _PAUSED_KEPT
                or sum(self._paused_bytes.values()) > budget
                or self._paused_bytes.get(entry.tenant, 0) > budget // 2):
            mine = [e for e in self._paused_order.values() if e.tenant == entry.tenant]
            over_share = self._paused_bytes.get(entry.tenant, 0) > budget // 2
            self._forget(mine[0] if over_share else next(iter(self._paused_order.values())))

    def _forget(self, entry: _PausedResponse) -> None:
        if self._paused_order.pop(id(entry), None) is None:
            return
        for call_id in entry.call_ids:
            if self._paused.get((entry.tenant, call_id)) is entry:
                del self._paused[(entry.tenant, call_id)]
        left = self._paused_bytes[entry.tenant] - entry.size
        if left:
            self._paused_bytes[entry.tenant] = left
        else:
            del self._paused_bytes[entry.tenant]

    async def store_response(self, session: "ResponsesSession") -> None:
        adapter = session.adapter
        conversation = adapter.conversation
        state = {"history": conversation.history + adapter.pending_outputs(),
                 "interpreter_container": conversation.interpreter_container,
                 "caronte_container": conversation.caronte_container,
                 "attached": conversation.attached}
        if session.scope is not None:
            state["scope"] = session.scope  # started by a sandbox's code (prepare_responses)
        paused = session.loop.paused
        if paused is not None:
            entry = _PausedResponse(session.tenant, paused.run.id, paused.use,
                                    [item["call_id"] for item in adapter.pending_calls], state)
            state["paused_run"] = entry.stored()
            self._remember(entry)
        if not session.request.store:
            return
        await self.sessions.metadata.put_response(ResponseRecord(
            tenant=session.tenant, id=adapter.response_id, created_at=time.time(),
            body=adapter.response(), state=state))

    async def holds_conversation(self, tenant: str, body: dict) -> bool:
        """Whether the request continues a response kept here: the upstream never
        kept it (the loop's calls are store:false), so it cannot be passed through."""
        previous = body.get("previous_response_id")
        return isinstance(previous, str) and await self._kept(tenant, previous) is not None

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        return (await self._kept(tenant, response_id) is not None
                and await self.sessions.metadata.delete_response(tenant, response_id))

    async def stored_response(self, tenant: str, response_id: str) -> dict:
        stored = await self._kept(tenant, response_id)
        if stored is None:
            raise UnknownResponse(f"No response with id '{response_id}' found.")
        return stored.body


@dataclass
class ResponsesSession:
    """One /v1/responses request with a code tool, ready to run."""

    gateway: Gateway
    tenant: str
    request: openai.ResponsesRequest
    adapter: openai.OpenAIAdapter
    loop: ToolLoop
    resume: Paused | None
    # The sandbox whose code made the request with its model token; None for a client.
    scope: str | None = None

    async def events(self) -> AsyncIterator[bytes | None]:
        async for event in self.loop.events(self.resume):
            yield event
        await self.gateway.store_response(self)


def _upstream(dialect: str, url: str, key: str, client: httpx.AsyncClient,
              auth: str = "default") -> Upstream | None:
    if not url:
        return None
    return Upstream(dialect=dialect, base_url=url, key=read_secret(key) if key else "",
                    client=client, auth=auth)
