"""Short-lived tokens for the model API, one per request that runs code.

Zylon's promise: code in the sandbox can call the model "with the permissions
of the user who sent the request". The sandbox never sees the operator's key.
It gets a token instead, in ``ANTHROPIC_AUTH_TOKEN`` (``OPENAI_API_KEY``),
that is:

- bound to one container, its tenant and the request's user. The broker
  accepts it only on a connection from that container's sandbox, so a token
  copied elsewhere is useless;
- short-lived: revoked when the run it was issued for ends, and never older
  than ``model_token_seconds``; with a budget of requests (``model_token_requests``);
- held only in this process's memory, as a hash. A restart revokes them all.

The broker checks the token and calls Shoal's own gateway as the tenant. The
gateway calls the upstream with the operator's key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

PREFIX = "shoal-mt-"


class TokenRefused(Exception):
    """Why a token cannot be used: the status and message the sandbox is answered."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ModelToken:
    tenant: str
    container_id: str
    user: str | None
    expires_at: float
    requests_left: int


@dataclass(frozen=True)
class ModelAccess:
    """The gateway request code runs for: which API its token speaks, with which model."""

    dialect: str  # anthropic | openai
    model: str | None
    user: str | None = None


MODEL_HOST = "shoal.internal"  # the broker routes this host to Shoal's own gateway
MODEL_BASE = f"http://{MODEL_HOST}"


def model_env(access: ModelAccess, token: str) -> dict[str, str]:
    """The variables the providers' SDKs read, pointing them at the gateway."""
    if access.dialect == "openai":
        env = {"OPENAI_BASE_URL": f"{MODEL_BASE}/v1", "OPENAI_API_KEY": token}
        if access.model:
            env["OPENAI_MODEL"] = access.model
        return env
    env = {"ANTHROPIC_BASE_URL": MODEL_BASE, "ANTHROPIC_AUTH_TOKEN": token}
    if access.model:
        env["ANTHROPIC_MODEL"] = access.model
    return env


class ModelTokens:
    def __init__(self, lifetime_seconds: float, budget: int) -> None:
        self._lifetime = lifetime_seconds
        self._budget = budget
        self._tokens: dict[bytes, ModelToken] = {}
        self._issued = 0

    @staticmethod
    def _key(token: str) -> bytes:
        return hashlib.sha256(token.encode()).digest()

    def issue(self, tenant: str, container_id: str, user: str | None = None) -> str:
        self._forget_expired()
        token = PREFIX + secrets.token_urlsafe(32)
        self._tokens[self._key(token)] = ModelToken(
            tenant, container_id, user, time.time() + self._lifetime, self._budget)
        return token

    def revoke(self, token: str) -> None:
        """The request the token was issued for is over: the token is no more.
        Else what its code left in the container (the token in a file, a
        background job) called the model as that request's user, from later runs
        given no model access, for the rest of its lifetime."""
        self._tokens.pop(self._key(token), None)

    def spend(self, token: str, tenant: str, container_id: str | None) -> ModelToken:
        """The token's grant, with one request taken from its budget, if it may be
        used from the sandbox of ``tenant``'s ``container_id`` now; TokenRefused
        otherwise. The tenant too: clients name containers, so two tenants' may
        share an id."""
        found = self._tokens.get(self._key(token)) if token.startswith(PREFIX) else None
        if (found is None or container_id is None or found.tenant != tenant
                or not hmac.compare_digest(found.container_id.encode(), container_id.encode())):
            raise TokenRefused(401, "invalid model token for this sandbox")
        if time.time() >= found.expires_at:
            raise TokenRefused(401, "the model token has expired")
        if found.requests_left <= 0:
            raise TokenRefused(429, "the model token's request budget is spent")
        found.requests_left -= 1
        return found

    def _forget_expired(self) -> None:
        self._issued += 1
        if self._issued % 256 and len(self._tokens) < 4096:
            return
        now = time.time()
        for key, token in list(self._tokens.items()):
            if token.expires_at <= now or token.requests_left <= 0:
                del self._tokens[key]
