"""Bearer tokens and the tenants they stand for.

With no tokens configured the server is open (and says so at start-up). With
tokens, every route but ``/health`` needs ``Authorization: Bearer <token>``,
and the token decides the tenant whose sessions the caller may see. A tokens
file that cannot be read, or holds no token, stops the server rather than
silently opening it; so does an entry that parses more than one way, or a
token listed twice, rather than silently giving a tenant the wrong token.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

from fastapi import HTTPException, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.datastructures import Headers

from shoal.logs import request_context

OPEN_TENANT = "default"
log = logging.getLogger("shoal.auth")
# Declares the scheme in the served OpenAPI document; the token itself is read
# by bearer_token below, which also takes Anthropic's x-api-key.
_SCHEME = HTTPBearer(auto_error=False, description="A tenant's token (SHOAL_TOKENS); "
                     "Anthropic's x-api-key header is accepted too")


class TokenConfigError(ValueError):
    """The token setting is malformed; the server refuses to start."""


def operator_tokens_of(setting: str) -> list[str]:
    setting = setting.strip()
    if not setting:
        return []
    if setting.startswith("@"):
        path = Path(setting[1:])
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise TokenConfigError(f"cannot read operator tokens file {path}: {exc.strerror}") from None
        tokens = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not tokens:
            raise TokenConfigError(f"operator tokens file {path} holds no token")
        return tokens
    return [token.strip() for token in setting.split(",") if token.strip()]


class TokenTable:
    def __init__(self, tokens: dict[str, str], operators: list[str] | None = None) -> None:
        self._tokens = tokens
        self._operators = operators or []

    @classmethod
    def parse(cls, setting: str, operator_setting: str = "") -> "TokenTable":
        operators = operator_tokens_of(operator_setting)
        setting = setting.strip()
        if not setting:
            return cls({}, operators)
        if setting.startswith("@"):
            path = Path(setting[1:])
            try:
                lines = path.read_text().splitlines()
            except OSError as exc:
                raise TokenConfigError(f"cannot read tokens file {path}: {exc.strerror}") from None
            # An entry is named by where it is, never by its text: that holds a token.
            source = f"of {path}"
            pairs = [(f"line {number}", line.strip()) for number, line in enumerate(lines, 1)
                     if line.strip() and not line.strip().startswith("#")]
            if not pairs:
                raise TokenConfigError(f"tokens file {path} holds no token")
        else:
            source = "of the tokens setting"
            pairs = [(f"entry {number}", pair) for number, pair in enumerate(
                (pair.strip() for pair in setting.split(",") if pair.strip()), 1)]
        tokens: dict[str, str] = {}
        where: dict[str, str] = {}
        for place, pair in pairs:
            # Exactly one "=": with two, as in "dG9rZW4=tenant" (base64 padding)
            # or "a=b=c", no split is surely the one meant, and a wrong one would
            # give a tenant a token its client never sends.
            token, _, tenant = (part.strip() for part in pair.partition("="))
            if pair.count("=") != 1 or not token or not tenant:
                raise TokenConfigError(f"{place} {source}: each token must be written "
                                       "'token=tenant', with one '=' (neither may hold one)")
            if token in tokens:
                # Else the last would win, silently: a token stands for one tenant.
                raise TokenConfigError(f"{place} {source} repeats the token of "
                                       f"{where[token]}; a token stands for one tenant")
            tokens[token] = tenant
            where[token] = place
        if set(tokens) & set(operators):
            raise TokenConfigError("a token cannot be both a tenant's and the operator's")
        return cls(tokens, operators)

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    @property
    def tenants(self) -> int:
        """How many tenants the tokens name (1 when the server is open)."""
        return len(set(self._tokens.values())) or 1

    @property
    def tenant_names(self) -> frozenset[str]:
        """Every tenant a token can name (the open server's one, when there are none)."""
        return frozenset(self._tokens.values()) or frozenset({OPEN_TENANT})

    def is_operator(self, token: str) -> bool:
        matched = False
        for known in self._operators:
            if hmac.compare_digest(known.encode(), token.encode()):
                matched = True
        return matched

    def tenant_for(self, token: str) -> str | None:
        found = None
        for known, tenant in self._tokens.items():
            # Compare against every token, so timing says nothing about which matched.
            if hmac.compare_digest(known.encode(), token.encode()):
                found = tenant
        return found


def bearer_token(request: Request) -> str:
    """The request's bearer token (``Authorization: Bearer``, or ``x-api-key``
    as Anthropic's SDKs before 1.0 send it), or ``""``."""
    return _token_in(request.headers)


def scope_bearer_token(scope) -> str:
    """The same, from an ASGI scope (for middleware, before a route runs)."""
    return _token_in(Headers(scope=scope))


def _token_in(headers: Headers) -> str:
    header = headers.get("authorization", "")
    if not header:
        return headers.get("x-api-key", "").strip()
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def is_operator(request: Request) -> bool:
    """The caller holds an operator token, or the server is open (everyone is the operator)."""
    table: TokenTable = request.app.state.tokens
    if not table.enabled:
        return True
    token = bearer_token(request)
    return bool(token) and table.is_operator(token)


async def tenant_of(request: Request,
                    _: HTTPAuthorizationCredentials | None = Security(_SCHEME)) -> str:
    """FastAPI dependency: the caller's tenant, or 401."""
    table: TokenTable = request.app.state.tokens
    internal = _internal_tenant(request)
    if internal is not None:
        tenant = internal
        # What the sandbox's token was issued for: the gateway keeps its code there.
        request.state.model_scope = request.headers.get("x-shoal-container", "")
    elif not table.enabled:
        tenant = OPEN_TENANT
    else:
        token = bearer_token(request)
        tenant = table.tenant_for(token) if token else None
        if tenant is None:
            _rejected(request, token)
            raise HTTPException(401, "missing or invalid bearer token",
                                headers={"WWW-Authenticate": "Bearer"})
    request.state.tenant = tenant
    context = request_context.get()
    if context is not None:
        context["tenant"] = tenant
    return tenant


def model_scope(request: Request) -> str | None:
    """For a request a sandbox's code made with its model token (forwarded by the
    egress broker), the container (or run, or session) the token is bound to;
    None for a client's request."""
    return getattr(request.state, "model_scope", None)


def _internal_tenant(request: Request) -> str | None:
    """The tenant of a request the egress broker forwarded for a sandbox's code (after
    checking its model token), or None. Only the broker knows the secret."""
    secret = request.headers.get("x-shoal-internal")
    if secret is None:
        return None
    expected = request.app.state.manager.internal_secret
    if not hmac.compare_digest(secret.encode(), expected.encode()):
        return None
    tenant = request.headers.get("x-shoal-tenant")
    return tenant or None


def _rejected(request: Request, token: str) -> None:
    """A wrong token is worth a WARNING (a misconfigured client, or someone
    guessing); the log names a fingerprint of it, never the token."""
    client = request.client.host if request.client else "?"
    if not token:
        log.info("request without a token refused", extra={"client": client})
        return
    log.warning("rejected a bearer token", extra={
        "client": client, "token_sha256": hashlib.sha256(token.encode()).hexdigest()[:12]})
