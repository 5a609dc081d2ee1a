"""The tool-call broker: the one place that decides inner tool calls.

Code in a sandbox calls stubs; every call, whatever dialect started the code,
comes here. The broker holds what the run was granted (the client's declared
tools intersected with ``allowed_tools``, default deny), checks each call's
name against that grant and its arguments against the tool's JSON schema
*again* on the host, since a stub is only a convenience and the channel can be
forged by the code, and then hands valid calls to one of two faces:

- :class:`ClientTools`: the client answers by call id (Caronte's
  ``tool_call.required`` / ``tool-results``, paused ``function_call`` items in
  ``/v1/responses``, ``tool_use`` in ``/v1/messages``);
- :class:`CallbackTools`: the host itself POSTs each call to an operator-allowed
  callback URL (the reference backend's programmatic tools).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import secrets
import socket
from dataclasses import dataclass, field
from typing import Awaitable, Callable
from urllib.parse import urlsplit

from shoal.egress.policy import Allowlist

import httpx
import jsonschema_rs

from shoal.sandbox import ToolCall, ToolOutcome
from shoal.sandbox.toolcalls import MAX_RESULT_BYTES

log = logging.getLogger("shoal.tools")

MAX_TOOLS = 128
_MAX_DESCRIPTION = 16_384
# Schemas come from the client and arguments from code in a sandbox, so the
# validator must be safe with both. jsonschema_rs, offline, retrieves nothing a
# $ref or $schema names outside the schema (jsonschema's default registry
# fetched any URI with urlopen: the host calling a URL the client chose, or
# reading one of its files, each time code called the tool), and its regex
# engine is bounded (Python's re took 0.48 s on "^(a+)+$" against 24
# characters, doubling with each more: hours at 40, with the event loop, and
# so every tenant, waiting).
_PATTERNS = jsonschema_rs.FancyRegexOptions(backtrack_limit=100_000)


class InvalidTools(ValueError):
    """The declared tools or the grant are not usable; the message says why."""


@dataclass(frozen=True)
class ToolSpec:
    """A client's function tool, in one shape whatever dialect declared it."""

    name: str
    description: str
    parameters: dict

    def stub(self) -> dict:
        return {"name": self.name, "description": self.description,
                "parameters": self.parameters}


def normalise_tool(raw: object) -> ToolSpec:
    """A function tool in OpenAI's Responses or Chat shape, or Anthropic's."""
    if not isinstance(raw, dict):
        raise InvalidTools("each tool must be an object")
    body = raw.get("function") if isinstance(raw.get("function"), dict) else raw
    kind = raw.get("type", "function")
    if kind not in ("function", "custom") and "input_schema" not in raw:
        raise InvalidTools(f"tool type {kind!r} cannot be called from code; only function "
                           "tools can")
    name = body.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not all(
            char.isalnum() or char in "_-" for char in name):
        raise InvalidTools("a tool name is 1 to 64 letters, digits, '_' or '-'")
    description = body.get("description") or ""
    if not isinstance(description, str) or len(description) > _MAX_DESCRIPTION:
        raise InvalidTools(f"tool {name!r}: description must be a string of at most "
                           f"{_MAX_DESCRIPTION} characters")
    parameters = body.get("parameters", body.get("input_schema")) or {"type": "object"}
    if not isinstance(parameters, dict):
        raise InvalidTools(f"tool {name!r}: parameters must be a JSON schema object")
    _validator(name, parameters)  # checked against its metaschema, every $ref resolved
    return ToolSpec(name, description, parameters)


def _validator(name: str, schema: dict) -> jsonschema_rs.Validator:
    try:
        return jsonschema_rs.validator_for(schema, offline=True, pattern_options=_PATTERNS)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as exc:
        reason = (getattr(exc, "message", None) or str(exc) or type(exc).__name__)
        raise InvalidTools(f"tool {name!r}: parameters is not a usable JSON schema: "
                           f"{reason.splitlines()[0][:300]}") from None


class Grant:
    """The tools one run may call from its code, with their schemas compiled once."""

    def __init__(self, tools: list[ToolSpec], allowed: list[str] | None) -> None:
        if len(tools) > MAX_TOOLS:
            raise InvalidTools(f"at most {MAX_TOOLS} tools may be declared")
        declared = {tool.name: tool for tool in tools}
        if len(declared) != len(tools):
            raise InvalidTools("tool names must be unique")
        allowed = allowed or []
        unknown = [name for name in allowed if name not in declared]
        if unknown:
            raise InvalidTools(f"allowed_tools names tools that are not declared: "
                               f"{', '.join(map(repr, unknown))}")
        self.tools = [declared[name] for name in dict.fromkeys(allowed)]
        self._validators = {tool.name: _validator(tool.name, tool.parameters)
                            for tool in self.tools}

    @property
    def names(self) -> list[str]:
        return [tool.name for tool in self.tools]

    def stubs(self) -> list[dict]:
        return [tool.stub() for tool in self.tools]

    def refusal(self, call: ToolCall) -> str | None:
        """Why a call may not go through, or None if it may."""
        validator = self._validators.get(call.name)
        if validator is None:
            return f"tool {call.name!r} is not allowed in this run"
        try:
            error = next(iter(validator.iter_errors(call.arguments)), None)
        except Exception as exc:  # noqa: BLE001 - arguments no schema can check fail the call
            return f"invalid arguments for tool {call.name!r}: they cannot be checked: {exc}"
        if error is not None:
            where = "/".join(map(str, error.instance_path)) or "arguments"
            return f"invalid arguments for tool {call.name!r}: {where}: {error.message}"
        return None


async def _settled(outcome: ToolOutcome) -> ToolOutcome:
    return outcome


@dataclass(eq=False)
class PendingCall:
    call_id: str
    name: str
    arguments: object
    future: asyncio.Future = field(repr=False)

    def public(self) -> dict:
        return {"call_id": self.call_id, "name": self.name, "arguments": self.arguments}


class ClientTools:
    """Calls the client answers by id; ``on_required`` announces each batch.

    A call the client leaves unanswered for the whole wait fails, and the run's
    later calls fail at once, unannounced: a client that let one go that long
    is taken to be gone. Else code that caught each failure and called again
    kept its sandbox and its tenant's slots for up to 1,000 waits (83 hours at
    the defaults) with no one there; now a run outlives its client by at most
    its own timeout plus one wait."""

    def __init__(self, grant: Grant, wait_limit: float,
                 on_required: Callable[[list[PendingCall]], None]) -> None:
        self.grant = grant
        self.wait_limit = wait_limit
        self._on_required = on_required
        self._pending: dict[str, PendingCall] = {}
        self._settled: set[str] = set()
        self.calls = 0
        self.unanswered: str | None = None  # the tool of a call whose wait ran out

    def submit(self, calls: list[ToolCall]) -> list[Awaitable[ToolOutcome]]:
        outcomes: list[Awaitable[ToolOutcome]] = []
        required = []
        loop = asyncio.get_running_loop()
        for call in calls:
            refusal = self.grant.refusal(call)
            if refusal is None and self.unanswered is not None:
                refusal = (f"tool call not made: an earlier call of {self.unanswered!r} went "
                           f"unanswered for {self.wait_limit:g}s, so this run's client is taken "
                           "to be gone")
            if refusal is not None:
                log.info("refused an inner tool call: %s", refusal)
                outcomes.append(_settled(ToolOutcome(error=refusal)))
                continue
            pending = PendingCall("call_" + secrets.token_hex(12), call.name, call.arguments,
                                  loop.create_future())
            self._pending[pending.call_id] = pending
            required.append(pending)
            outcomes.append(self._wait(pending))
        self.calls += len(required)
        if required:
            self._on_required(required)
        return outcomes

    async def _wait(self, pending: PendingCall) -> ToolOutcome:
        try:
            return await pending.future
        except asyncio.CancelledError:
            # Cut by the wait limit (shoal.sandbox.toolcalls), or by the run's end.
            self.unanswered = pending.name
            raise
        finally:
            self._pending.pop(pending.call_id, None)
            self._settled.add(pending.call_id)

    @property
    def waiting(self) -> list[PendingCall]:
        return [p for p in self._pending.values() if not p.future.done()]

    def knows(self, call_id: str) -> bool:
        return call_id in self._pending or call_id in self._settled

    def resolve(self, call_id: str, output: object = None, error: str | None = None) -> bool:
        """Answer one call; False if it was answered before (a no-op)."""
        pending = self._pending.get(call_id)
        if pending is None or pending.future.done():
            return False
        pending.future.set_result(ToolOutcome(output=output, error=error))
        return True

    def fail_all(self, reason: str) -> None:
        for pending in list(self._pending.values()):
            if not pending.future.done():
                pending.future.set_result(ToolOutcome(error=reason))


# -- callbacks to operator-allowed hosts ----------------------------------------------------------
# The same entries, and the same matching, as the sandbox's egress allowlist.
HostAllowlist = Allowlist
# Callbacks one session's code has in flight at once; the others wait their turn.
# All sessions share the host's client, whose pool holds this many for each
# (shoal.app): with one pool of 100 for everyone, one tenant's code calling a
# slow tool 100 times at once held every other tenant's callbacks until their
# wait ran out.
CALLBACKS_AT_ONCE = 4


def check_callback_url(url: object, allowlist: HostAllowlist) -> str:
    """The callback URL if the operator allows its host; InvalidTools otherwise."""
    if not isinstance(url, str) or not url:
        raise InvalidTools("callback_url is required")
    try:
        parts = urlsplit(url)
        explicit = parts.port  # raises for a port that is not a number in range
    except ValueError as exc:
        raise InvalidTools(f"callback_url is not a valid URL: {exc}") from None
    if (parts.scheme not in ("http", "https") or not parts.hostname
            or any(char.isspace() or ord(char) < 32 for char in url)):
        raise InvalidTools("callback_url must be an http or https URL")
    port = explicit or (443 if parts.scheme == "https" else 80)
    if not allowlist.allows(parts.hostname, port):
        raise CallbackNotAllowed(
            f"callback host {parts.hostname}:{port} is not allowed; the operator allows "
            "callback hosts with --callback-allow (SHOAL_CALLBACK_ALLOW)")
    return url


class CallbackNotAllowed(InvalidTools):
    """The callback's host is not one the operator allowed."""


class CallbackTools:
    """Programmatic tools: the host POSTs each call to the registered callback.

    The body is ``{call_id, name, input}`` with the registered bearer token; the
    callback answers ``{"content": ...}``, or ``{"is_error": true, "content":
    message}`` for a failure the code sees as ``ToolError`` (the reference
    backend's semantics). The sandbox never learns the URL or the token.
    """

    def __init__(self, names: list[str], url: str, token: str, timeout: float,
                 client: httpx.AsyncClient, allowlist: HostAllowlist) -> None:
        self._names = set(names)
        self._url = url
        self._allowlist = allowlist
        self._token = token
        self.wait_limit = timeout
        self._client = client
        self._slots = asyncio.Semaphore(CALLBACKS_AT_ONCE)

    def submit(self, calls: list[ToolCall]) -> list[Awaitable[ToolOutcome]]:
        return [self._call(call) for call in calls]

    async def _call(self, call: ToolCall) -> ToolOutcome:
        async with self._slots:
            return await self._call_now(call)

    async def _call_now(self, call: ToolCall) -> ToolOutcome:
        if call.name not in self._names:
            return ToolOutcome(error=f"tool {call.name!r} is not registered for this session")
        if not isinstance(call.arguments, dict):
            return ToolOutcome(error=f"tool {call.name!r} takes keyword arguments only")
        body = {"call_id": secrets.token_hex(16), "name": call.name, "input": call.arguments}
        try:
            url, host, extensions = await self._destination()
        except CallbackNotAllowed as exc:
            return ToolOutcome(error=f"tool {call.name!r} not called: {exc}")
        except (OSError, UnicodeError):
            return ToolOutcome(error=f"tool {call.name!r} unreachable: cannot resolve its host")
        try:
            async with self._client.stream(
                    "POST", url, json=body, timeout=self.wait_limit, extensions=extensions,
                    headers={"Authorization": f"Bearer {self._token}", **host}) as response:
                if not 200 <= response.status_code < 300:
                    return ToolOutcome(error=f"tool {call.name!r} failed: HTTP "
                                             f"{response.status_code}")
                # Read no more than the code could be handed: a callback that
                # answers gigabytes costs the host the cap, not the gigabytes.
                content = bytearray()
                async for chunk in response.aiter_bytes():
                    content += chunk
                    if len(content) > MAX_RESULT_BYTES:
                        return ToolOutcome(error=f"tool {call.name!r} answered more than "
                                                 f"{MAX_RESULT_BYTES} bytes")
        except httpx.TimeoutException as exc:
            return ToolOutcome(error=f"tool {call.name!r} transport error: timed out ({exc})")
        except httpx.HTTPError as exc:
            return ToolOutcome(error=f"tool {call.name!r} unreachable: {exc}")
        try:
            answer = json.loads(content)
        except ValueError:
            return ToolOutcome(error=f"tool {call.name!r} answered with invalid JSON")
        if not isinstance(answer, dict):
            return ToolOutcome(error=f"tool {call.name!r} answered with a non-object body")
        if answer.get("is_error"):
            return ToolOutcome(error=str(answer.get("content", "tool error")))
        return ToolOutcome(output=answer.get("content"))

    async def _destination(self) -> tuple[httpx.URL, dict, dict]:
        """Where to POST: the name resolved here and every address checked as the
        egress broker checks them (a private one only where the operator named it
        literally), then the checked address itself, under the name's Host and
        TLS name. httpx resolved the name on its own, so an allowed name that DNS
        pointed at loopback or the metadata service had the host POST there and
        hand the answer to the code."""
        url = httpx.URL(self._url)
        host = url.host
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            ipaddress.ip_address(host)
            return url, {}, {}  # a literal, matched as it is when it was registered
        except ValueError:
            pass
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = list(dict.fromkeys(info[4][0] for info in found))
        for address in addresses:
            checked = ipaddress.ip_address(address.split("%")[0])
            if not self._allowlist.allows_address(checked, port):
                raise CallbackNotAllowed(f"callback host {host} resolves to {address}, which is "
                                         "not allowed")
        extensions = {"sni_hostname": host} if url.scheme == "https" else {}
        return url.copy_with(host=addresses[0]), {"Host": url.netloc.decode("ascii")}, extensions
