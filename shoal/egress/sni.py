"""The name a TLS client asks for in a tunnel, held to the name it was allowed.

A ``CONNECT`` tunnel is checked by the host it names, and the broker connects
to an address that host resolved to. But one address often serves many names
(a CDN, a cloud load balancer), and TLS says which one in the ClientHello's
``server_name`` (SNI). Without a look at it, a sandbox allowed
``api.allowed.example`` could tunnel to that address and ask it for any other
site it fronts ("domain fronting"): the allowlist would name a door, not a
destination.

So the first bytes a client sends through a tunnel are read before they are
forwarded. If they are a TLS handshake, the ClientHello is read whole (it may
span records) and its ``server_name``, when it has one, must be the tunnel's
host; otherwise the client gets TLS's own ``unrecognized_name`` alert and the
tunnel is closed, unforwarded. A handshake that cannot be parsed is refused the
same way (a real server would not take it either). Bytes that are not TLS pass
as they are: the tunnel is plain TCP to the allowed host and port. Nothing
waits for the client to speak first, so server-first protocols (SSH, SMTP)
are untouched.

What it does not see: the name inside TLS (the HTTP ``Host`` header, and the
inner ClientHello of Encrypted Client Hello, whose outer name is the
provider's, so it is refused unless the tunnel named that). Once the
handshake is out, the tunnel is opaque.
"""

from __future__ import annotations

import asyncio

# A ClientHello is a few hundred bytes, ~2 KiB with post-quantum key shares;
# TLS allows 2**24, which a proxy need not read to say no.
MAX_HELLO_BYTES = 64 * 1024
_HANDSHAKE, _CLIENT_HELLO, _SERVER_NAME, _HOST_NAME = 0x16, 0x01, 0x0000, 0x00
# A fatal alert (level 2) saying unrecognized_name (112), in a TLS 1.2 record
# (what TLS 1.3 uses on the wire too): clients report it as such.
UNRECOGNIZED_NAME_ALERT = bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x70])


class Refused(Exception):
    """The tunnel's first flight asks for another name, or is not a ClientHello TLS would take."""


async def first_flight(reader: asyncio.StreamReader, host: str, chunk: int) -> bytes:
    """The client's first bytes, checked: what to forward, or :class:`Refused`.

    ``b""`` at once if the client closed without a byte."""
    data = await reader.read(chunk)
    if not data or data[0] != _HANDSHAKE:
        return data
    while True:
        name = server_name(data)
        if name is not _INCOMPLETE:
            break
        if len(data) >= MAX_HELLO_BYTES:
            raise Refused(f"a ClientHello past {MAX_HELLO_BYTES} bytes")
        more = await reader.read(chunk)
        if not more:
            raise Refused("the client closed the tunnel inside its ClientHello")
        data += more
    if name is not None and name != _canonical(host):
        raise Refused(f"the ClientHello asks for {name!r}, the tunnel was allowed to {host!r}")
    return data


_INCOMPLETE = object()


def server_name(data: bytes):
    """The ``server_name`` of the ClientHello that ``data`` begins with: a lower-case
    name, None if it names none, or ``_INCOMPLETE`` if more bytes are needed.
    Raises :class:`Refused` for anything that is not a ClientHello."""
    handshake = bytearray()
    at = 0
    while True:
        if len(handshake) >= 4:
            length = int.from_bytes(handshake[1:4], "big")
            if handshake[0] != _CLIENT_HELLO:
                raise Refused("the first handshake message is not a ClientHello")
            if length + 4 > MAX_HELLO_BYTES:
                raise Refused(f"a ClientHello of {length} bytes")
            if len(handshake) >= length + 4:
                return _name_in_hello(bytes(handshake[4:length + 4]))
        if at + 5 > len(data):
            return _INCOMPLETE
        if data[at] != _HANDSHAKE:
            raise Refused("a record inside the ClientHello is not a handshake record")
        size = int.from_bytes(data[at + 3:at + 5], "big")
        if size == 0:
            raise Refused("an empty handshake record")
        if at + 5 + size > len(data):
            return _INCOMPLETE
        handshake += data[at + 5:at + 5 + size]
        at += 5 + size


def _name_in_hello(hello: bytes) -> str | None:
    read = _Reader(hello)
    read.skip(2 + 32)                 # client_version, random
    read.skip(read.int(1))            # legacy_session_id
    read.skip(read.int(2))            # cipher_suites
    read.skip(read.int(1))            # legacy_compression_methods
    if read.done():
        return None                   # no extensions at all
    extensions = _Reader(read.take(read.int(2)))
    while not extensions.done():
        kind, body = extensions.int(2), extensions.take(extensions.int(2))
        if kind != _SERVER_NAME:
            continue
        names = _Reader(body)
        names = _Reader(names.take(names.int(2)))
        while not names.done():
            name_type, name = names.int(1), names.take(names.int(2))
            if name_type == _HOST_NAME:
                try:
                    return name.decode("ascii").lower().rstrip(".")
                except UnicodeDecodeError:
                    raise Refused("a server_name that is not an ASCII host name") from None
        return None
    return None


def _canonical(host: str) -> str:
    """The tunnel's host as SNI spells it: ASCII (IDNA), lower case."""
    try:
        return host.encode("idna").decode("ascii").lower()
    except UnicodeError:
        return host.lower()


class _Reader:
    def __init__(self, data: bytes) -> None:
        self._data, self._at = data, 0

    def take(self, size: int) -> bytes:
        if self._at + size > len(self._data):
            raise Refused("a ClientHello field runs past its end")
        self._at += size
        return self._data[self._at - size:self._at]

    def skip(self, size: int) -> None:
        self.take(size)

    def int(self, size: int) -> int:
        return int.from_bytes(self.take(size), "big")

    def done(self) -> bool:
        return self._at >= len(self._data)
