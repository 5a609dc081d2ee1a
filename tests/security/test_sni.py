"""The egress broker's look at a tunnel's first flight (shoal.egress.sni), on real
ClientHellos: each made by OpenSSL (Python's ssl, through a memory BIO) for the
name it is given, then fed to the check as a client's socket would deliver it.
The tunnel end to end, from a sandbox, is in tests/gateway/test_egress.py."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from shoal.egress import sni


def hello(name: str | None, version=ssl.TLSVersion.TLSv1_3) -> bytes:
    """The first flight of a TLS client asking for ``name`` (none: no SNI)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.maximum_version = version
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = context.wrap_bio(incoming, outgoing, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    return outgoing.read()


def split_into_records(flight: bytes, size: int) -> bytes:
    """The same handshake carried in records of at most ``size`` bytes (TLS allows it)."""
    body = flight[5:5 + int.from_bytes(flight[3:5], "big")]
    records = b""
    for at in range(0, len(body), size):
        part = body[at:at + size]
        records += flight[:3] + len(part).to_bytes(2, "big") + part
    return records


async def first_flight(pieces: list[bytes], host: str) -> bytes:
    """What the check lets through when the client sends ``pieces`` one by one."""
    reader = asyncio.StreamReader()
    for piece in pieces:
        reader.feed_data(piece)
    reader.feed_eof()
    return await sni.first_flight(_OneReadAtATime(reader, [len(p) for p in pieces]), host, 65536)


class _OneReadAtATime:
    """Hands each read exactly one piece, as separate TCP segments would."""

    def __init__(self, reader: asyncio.StreamReader, sizes: list[int]) -> None:
        self._reader, self._sizes = reader, sizes

    async def read(self, limit: int) -> bytes:
        size = self._sizes.pop(0) if self._sizes else limit
        return await self._reader.read(min(size, limit))


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_the_name_a_client_asks_for_is_read(version):
    assert sni.server_name(hello("api.example.com", version)) == "api.example.com"
    assert sni.server_name(hello("API.Example.COM", version)) == "api.example.com"
    assert sni.server_name(hello(None, version)) is None  # an address: no SNI


async def test_a_hello_for_the_tunnels_host_goes_through_whole():
    flight = hello("api.example.com")
    assert await first_flight([flight], "api.example.com") == flight
    assert await first_flight([flight], "API.example.com") == flight
    # No name at all (a client connecting to an address) asks for nothing else.
    nameless = hello(None)
    assert await first_flight([nameless], "203.0.113.7") == nameless


async def test_a_hello_for_another_name_is_refused():
    with pytest.raises(sni.Refused, match="other.example.net"):
        await first_flight([hello("other.example.net")], "api.example.com")
    with pytest.raises(sni.Refused):  # a name, where the tunnel named an address
        await first_flight([hello("fronted.example.com")], "203.0.113.7")


async def test_a_hello_split_across_segments_and_records_is_read_whole():
    flight = hello("api.example.com")
    segments = [flight[:3], flight[3:40], flight[40:]]
    assert await first_flight(segments, "api.example.com") == flight
    records = split_into_records(flight, 100)
    assert len(records) > len(flight) + 5  # more than one record
    assert await first_flight([records[:150], records[150:]], "api.example.com") == records
    with pytest.raises(sni.Refused):
        await first_flight([split_into_records(hello("other.example.net"), 64)], "api.example.com")


async def test_what_is_not_tls_passes_and_a_broken_hello_does_not():
    assert await first_flight([b"SSH-2.0-OpenSSH_9.2\r\n"], "git.example.com") == \
        b"SSH-2.0-OpenSSH_9.2\r\n"
    assert await first_flight([], "git.example.com") == b""
    flight = hello("api.example.com")
    with pytest.raises(sni.Refused, match="closed"):  # the hello cut short
        await first_flight([flight[:60]], "api.example.com")
    garbled = bytearray(flight)
    garbled[5] = 0x02  # a ServerHello where the ClientHello should be
    with pytest.raises(sni.Refused):
        await first_flight([bytes(garbled)], "api.example.com")
    # A message that says it ends before its own fields do (its session id,
    # 32 bytes from OpenSSL, runs past the 46 bytes the header gives).
    short = b"\x01" + (46).to_bytes(3, "big") + flight[9:9 + 46]
    with pytest.raises(sni.Refused, match="past its end"):
        await first_flight([b"\x16\x03\x01" + len(short).to_bytes(2, "big") + short],
                           "api.example.com")
    with pytest.raises(sni.Refused, match="bytes"):  # a hello that never ends
        await first_flight([b"\x16\x03\x01\x40\x00" + b"\x01\xff\xff\xff" + b"\0" * 70000],
                           "api.example.com")
