"""Where a sandbox may connect: the operator's allowlist, narrowed per container.

An entry is ``host``, ``host:port``, ``*.suffix`` (any depth below it), an IP
literal with or without a port, or a CIDR (any port). A name entry without a
port means ports 80 and 443 only, the web; a port opens exactly that one.

A name is checked twice, the second time after resolving it. The broker
resolves every name itself and checks each address it got. A private,
loopback, link-local, multicast or reserved address (the metadata service is
link-local) is reached only if an entry names that address or its range
literally. So a name the operator allowed cannot be pointed by DNS at the
host's own services or the cloud's metadata endpoint.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

_WEB_PORTS = (80, 443)
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class PolicyError(ValueError):
    """An allowlist entry that cannot be understood."""


@dataclass(frozen=True)
class _Entry:
    pattern: str  # a lower-case host, "*.suffix", or "" for a network
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None
    port: int | None

    def port_ok(self, port: int) -> bool:
        if self.port is not None:
            return port == self.port
        return self.network is not None or port in _WEB_PORTS

    def names(self, host: str) -> bool:
        if self.network is not None:
            return False
        if self.pattern.startswith("*."):
            return host.endswith(self.pattern[1:]) and host != self.pattern[2:]
        return host == self.pattern

    def covers(self, address: Address) -> bool:
        if self.network is not None:
            return address in self.network
        try:
            return ipaddress.ip_address(self.pattern) == address
        except ValueError:
            return False


def _port(port: str, entry: str) -> int:
    # Checked here, for brackets or none: a port no connection can have would
    # make an entry that never matches, and the operator would not know.
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise PolicyError(f"bad port in {entry!r}")
    return int(port)


def _split_port(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise PolicyError(f"bad entry {entry!r}")
        return host, _port(rest[1:], entry) if rest else None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, _port(port, entry)
    return entry, None


def _parse(entry: str) -> _Entry:
    entry = entry.strip().lower()
    host, port = _split_port(entry)
    if "/" in host:
        try:
            return _Entry("", ipaddress.ip_network(host, strict=False), port)
        except ValueError:
            raise PolicyError(f"bad network {entry!r}") from None
    if not host or any(char in host for char in " @\\?#") or host.startswith("*") and not host.startswith("*."):
        raise PolicyError(f"bad host {entry!r}")
    return _Entry(host, None, port)


class Allowlist:
    """A parsed list of entries (``--egress-allow``, ``--callback-allow``, a
    container's ``allowed_domains``)."""

    def __init__(self, setting: str | list[str] = "") -> None:
        entries = setting.split(",") if isinstance(setting, str) else list(setting)
        self._entries = [_parse(entry) for entry in entries if entry.strip()]

    def __bool__(self) -> bool:
        return bool(self._entries)

    def allows(self, host: str, port: int) -> bool:
        """Whether the name (or address literal) and port are listed."""
        host = host.lower().strip("[]").rstrip(".")
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return any(entry.port_ok(port) and entry.names(host) for entry in self._entries)
        return any(entry.port_ok(port) and entry.covers(address) for entry in self._entries)

    def names(self, host: str) -> bool:
        """Whether some entry names ``host`` (or covers it, an address), on any port."""
        host = host.lower().strip("[]").rstrip(".")
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return any(entry.names(host) for entry in self._entries)
        return any(entry.covers(address) for entry in self._entries)

    def allows_address(self, address: Address, port: int) -> bool:
        """Whether an address a name resolved to may be reached: a public address
        if the name was allowed, anything else only where an entry names it."""
        if address.is_global and not address.is_multicast:
            return True
        return any(entry.port_ok(port) and entry.covers(address) for entry in self._entries)

    def narrowed(self, other: "Allowlist | None") -> "Narrowed":
        return Narrowed(self, other)


class Narrowed:
    """The operator's list, and a container's narrower one: both must allow."""

    def __init__(self, operator: Allowlist, container: Allowlist | None) -> None:
        self.operator = operator
        self.container = container

    def allows(self, host: str, port: int) -> bool:
        return self.operator.allows(host, port) and (
            self.container is None or self.container.allows(host, port))

    def allows_address(self, address: Address, port: int) -> bool:
        # Private ranges are the operator's to open; a container cannot add any.
        return self.operator.allows_address(address, port)
