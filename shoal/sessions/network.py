"""A container's network policy: checked, stored, turned into what the broker grants.

OpenAI's containers carry ``network_policy``. It is ``{"type": "disabled"}``,
or ``{"type": "allowlist", "allowed_domains": [...], "domain_secrets":
[{"domain", "name", "value"}]}``. Here the policy only narrows what the
operator allows (``--egress-allow``): a destination must be on both lists. No
policy at all means the operator's list as it is.

A domain secret never enters the sandbox. Its ``name`` is set in the sandbox's
environment to a placeholder. The broker swaps the placeholder for the value
in plain-HTTP requests to that domain only (:mod:`shoal.egress.broker`).
"""

from __future__ import annotations

import hashlib
import json
import re

from shoal.egress.broker import Grant
from shoal.egress.policy import Allowlist, PolicyError
from shoal.storage import ContainerRecord

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class InvalidNetworkPolicy(ValueError):
    """A network_policy that cannot be applied; the client's error (400)."""


def check_network_policy(policy: object) -> str | None:
    """The policy as stored (JSON text), or InvalidNetworkPolicy."""
    if policy is None:
        return None
    if not isinstance(policy, dict):
        raise InvalidNetworkPolicy("network_policy must be an object")
    kind = policy.get("type")
    if kind == "disabled":
        if set(policy) - {"type"}:
            raise InvalidNetworkPolicy("a disabled network_policy takes no other field")
        return json.dumps({"type": "disabled"})
    if kind != "allowlist":
        raise InvalidNetworkPolicy("network_policy.type must be 'disabled' or 'allowlist'")
    domains = policy.get("allowed_domains")
    if (not isinstance(domains, list) or not domains or len(domains) > 100
            or not all(isinstance(d, str) and d.strip() for d in domains)):
        raise InvalidNetworkPolicy("network_policy.allowed_domains must be a non-empty list of "
                                   "domains (at most 100)")
    try:
        allowed = Allowlist(domains)
    except PolicyError as exc:
        raise InvalidNetworkPolicy(f"network_policy.allowed_domains: {exc}") from None
    secrets = policy.get("domain_secrets") or []
    if not isinstance(secrets, list) or len(secrets) > 50:
        raise InvalidNetworkPolicy("network_policy.domain_secrets must be a list (at most 50)")
    kept = []
    for secret in secrets:
        if not isinstance(secret, dict) or not all(
                isinstance(secret.get(key), str) and secret.get(key) for key in ("domain", "name", "value")):
            raise InvalidNetworkPolicy("each domain secret needs a domain, a name and a value")
        if not _NAME.match(secret["name"]):
            raise InvalidNetworkPolicy(f"domain secret name {secret['name']!r} is not an "
                                       "environment variable name")
        if not allowed.names(secret["domain"]):
            raise InvalidNetworkPolicy(f"domain secret for {secret['domain']!r}: the domain is "
                                       "not in allowed_domains")
        kept.append({key: secret[key] for key in ("domain", "name", "value")})
    return json.dumps({"type": "allowlist", "allowed_domains": [d.strip() for d in domains],
                       "domain_secrets": kept})


def render_network_policy(record: ContainerRecord, egress_allow: str) -> dict:
    """What the container object shows: never a secret's value. Without a policy of
    its own, a container may reach what the operator allows."""
    if record.network_policy is None:
        entries = [entry.strip() for entry in egress_allow.split(",") if entry.strip()]
        return {"type": "allowlist", "allowed_domains": entries} if entries else {"type": "disabled"}
    policy = json.loads(record.network_policy)
    if policy["type"] == "disabled":
        return {"type": "disabled"}
    return {"type": "allowlist", "allowed_domains": policy["allowed_domains"]}


def _placeholder(scope: str, name: str) -> str:
    return "shoal-secret-" + hashlib.sha256(f"{scope}\x00{name}".encode()).hexdigest()[:24]


def grant(tenant: str, record: ContainerRecord | None, scope: str) -> tuple[Grant, dict[str, str]]:
    """The broker's grant for a sandbox working for ``record`` (None: an ephemeral
    session or run), and the environment its code gets for the domain secrets.
    ``scope`` is what model tokens are bound to: the container id, or the
    session's or run's own."""
    policy = json.loads(record.network_policy) if record and record.network_policy else None
    if policy is None:
        return Grant(tenant, scope), {}
    if policy["type"] == "disabled":
        return Grant(tenant, scope, allowed=Allowlist([])), {}
    secrets, env = {}, {}
    for secret in policy.get("domain_secrets", []):
        placeholder = _placeholder(scope, secret["name"])
        secrets[placeholder] = (secret["domain"].lower(), secret["value"])
        env[secret["name"]] = placeholder
    return Grant(tenant, scope, allowed=Allowlist(policy["allowed_domains"]), secrets=secrets), env
