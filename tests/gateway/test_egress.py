"""Sandbox egress: the model API from inside a sandbox, and the operator's allowlist.

Real servers on loopback: a ``shoal serve`` whose upstream is the scripted model,
with ``--egress-allow`` naming test services on the host; real sandboxes whose
code uses Python, curl and Bun through the proxy the sandbox's environment names.

The test services listen on 127.0.0.1, which the sandbox's ``NO_PROXY`` keeps
for the sandbox's own loopback (a server the code runs itself), so the clients
here drop ``NO_PROXY`` to go through the proxy, as a client of a named internal
service would without doing anything.
"""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anthropic
import httpx
import pytest
from httpx_sse import connect_sse

from tests.gateway.conftest import CLIENT_TOKEN, OPERATOR_KEY
from tests.gateway.scripted_upstream import anthropic_turn, text, tool_use
from tests.uid_slots import OFFSET

TOOL = {"type": "code_execution_20250825", "name": "code_execution"}
SECRET_VALUE = "real-secret-value-7d1c"
OPERATOR_TOKEN = "egress-operator-token"


class _Service(ThreadingHTTPServer):
    """A host service the operator may allow: answers who it is and what it was sent."""

    daemon_threads = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[dict] = []
        self.holding = 0
        self.release = threading.Event()
        super().__init__(("127.0.0.1", 0), _ServiceHandler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _ServiceHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.server.seen.append({"path": self.path, "headers": dict(self.headers)})
        if self.path == "/slow":  # holds its answer until the test lets it go
            self.server.holding += 1
            self.server.release.wait(120)
        body = f"hello from {self.server.name}\n".encode()
        if self.path.startswith("/big/"):  # /big/N: N MiB
            body = b"\0" * (int(self.path[5:]) << 20)
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except ConnectionError:
            pass  # a held answer's client is gone (as the test meant)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def services():
    allowed, named_only = _Service("allowed"), _Service("named-only")
    yield allowed, named_only
    for service in (allowed, named_only):
        service.shutdown()
        service.server_close()


class _TlsService:
    """A TLS service on 127.0.0.1 (a self-signed certificate for that address):
    answers every request with one line, and notes the name each client asked for."""

    def __init__(self) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="shoal-tls-")
        cert, key = (os.path.join(self._directory.name, name) for name in ("cert.pem", "key.pem"))
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", key, "-out", cert], check=True, capture_output=True)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.names: list[str | None] = []  # each handshake's SNI, as it began
        self.context.sni_callback = lambda _sock, name, _context: self.names.append(name)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        connection.settimeout(30)
        try:
            with self.context.wrap_socket(connection, server_side=True) as tls:
                tls.recv(65536)
                tls.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 15\r\n\r\nhello over tls\n")
        except (OSError, ssl.SSLError):
            pass

    def close(self) -> None:
        self._listener.close()
        self._directory.cleanup()


@pytest.fixture(scope="module")
def tls_service():
    service = _TlsService()
    yield service
    service.close()


# The shared server's model tokens outlive any test's wait, however busy the
# machine (a sandbox that starts Python and imports anthropic under a loaded CI
# once took longer than a 10 s lifetime); test_a_token_expires has a server of
# its own whose tokens expire in seconds.
TOKEN_SECONDS = 600
SHORT_TOKEN_SECONDS = 4


@pytest.fixture(scope="module")
def egress_server(gateway_factory, services, tls_service):
    allowed, named_only = services
    # 127.0.0.1:PORT names the address; localhost:PORT2 names only a name, which
    # resolves to loopback: the broker must refuse it.
    return gateway_factory(egress_allow=f"127.0.0.1:{allowed.port},localhost:{named_only.port},"
                                        f"127.0.0.1:{tls_service.port}",
                           model_token_seconds=TOKEN_SECONDS, model_token_requests=3,
                           operator_tokens=OPERATOR_TOKEN)


def _container(http: httpx.Client, **extra) -> str:
    answer = http.post("/v1/containers", json={"name": f"egress-{uuid.uuid4().hex[:8]}", **extra})
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


def _run(http: httpx.Client, container: str, language: str, code: str) -> dict:
    """A direct run in ``container``: its run.completed (or run.failed) event."""
    with connect_sse(http, "POST", "/v1/code-execution/runs", json={
            "language": language, "code": code, "container": container,
            "timeout_ms": 60_000}) as source:
        assert source.response.status_code == 200, source.response.read()
        ends = [{"event": sse.event, **sse.json()} for sse in source.iter_sse()
                if sse.event in ("run.completed", "run.failed")]
    assert len(ends) == 1, ends
    return ends[0]


def _sh(http: httpx.Client, container: str, command: str) -> dict:
    """``command`` in bash, through a Python run (the runs API takes Python and JS)."""
    code = ("import subprocess, sys\n"
            f"p = subprocess.run(['bash', '-c', {command!r}], capture_output=True, text=True)\n"
            "sys.stdout.write(p.stdout); sys.stderr.write(p.stderr); sys.exit(p.returncode)\n")
    return _run(http, container, "python", code)


DIRECT = "env -u NO_PROXY -u no_proxy "  # through the proxy even to 127.0.0.1


# -- the operator's allowlist -----------------------------------------------------------------
def test_an_allowed_service_is_reached_from_python_curl_and_bun(egress_server, services):
    allowed, _ = services
    url = f"http://127.0.0.1:{allowed.port}/hi"
    with egress_server.client(CLIENT_TOKEN) as http:
        box = _container(http)
        curl = _sh(http, box, f"{DIRECT} curl -sS --max-time 20 {url}")
        assert (curl.get("exit_code"), curl.get("stdout")) == (0, "hello from allowed\n"), curl
        python = _run(http, box, "python", (
            "import os\n"
            "os.environ.pop('NO_PROXY'); os.environ.pop('no_proxy')\n"
            "import urllib.request, requests, httpx\n"
            f"print(urllib.request.urlopen({url!r}, timeout=20).read().decode(), end='')\n"
            f"print(requests.get({url!r}, timeout=20).text, end='')\n"
            f"print(httpx.get({url!r}, timeout=20).text, end='')\n"))
        assert python.get("stdout") == "hello from allowed\n" * 3, python
        bun = _run(http, box, "javascript", (
            "delete process.env.NO_PROXY; delete process.env.no_proxy;\n"
            f"const r = await fetch({url!r});\n"
            "console.log((await r.text()).trim());\n"))
        assert bun.get("stdout") == "hello from allowed\n", bun
        node = _sh(http, box, DIRECT + "node -e \"fetch('" + url + "').then(r => r.text())"
                              ".then(t => process.stdout.write(t))\"")
        assert (node.get("stdout"), node.get("stderr")) == ("hello from allowed\n", ""), node
    assert len(allowed.seen) == 6


def test_sandboxes_whose_host_uids_pass_two_to_the_31st_get_their_grants(gateway_factory, services):
    # The broker read SO_PEERCRED's uid as a signed int: past 2**31 it came out
    # negative, matched no grant, and every connection was refused. Such uids are
    # valid (Linux takes up to 2**32 - 2) and an operator's --uid-base may give them.
    # 2**31 + 1M + …: a region no suite uses in any uid slot (tests/uid_slots.py).
    allowed, _ = services
    high = 2**31 + 1_000_000 + (os.getpid() % 1000) * 10_000
    server = gateway_factory(uid_base=high - OFFSET, egress_allow=f"127.0.0.1:{allowed.port}")
    with server.client(CLIENT_TOKEN) as http:
        box = _container(http)
        answer = _sh(http, box, f"{DIRECT} curl -sS --max-time 20 http://127.0.0.1:{allowed.port}/high")
        assert (answer.get("exit_code"), answer.get("stdout")) == (0, "hello from allowed\n"), answer
        assert _host_uids_at_or_above(high), "no sandbox ran under a uid past 2**31"
    assert allowed.seen[-1]["path"] == "/high"


def _host_uids_at_or_above(floor: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            real = int(status.read_text().split("Uid:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            continue
        if floor <= real < floor + 10_000:
            found.append(real)
    return found


def test_what_the_operator_did_not_allow_is_refused(egress_server, services):
    allowed, named_only = services
    with egress_server.client(CLIENT_TOKEN) as http:
        box = _container(http)
        refused = _sh(http, box, "; ".join([
            # another port of the allowed address
            f"{DIRECT} curl -s -o /dev/null -w '%{{http_code}}\\n' http://127.0.0.1:{named_only.port}/",
            # a name the operator allowed, resolving to loopback the operator did not name
            f"{DIRECT} curl -s -o /dev/null -w '%{{http_code}}\\n' http://localhost:{named_only.port}/",
            # another host
            f"{DIRECT} curl -s -o /dev/null -w '%{{http_code}}\\n' http://10.1.2.3/",
            # a tunnel to a port that is not allowed
            f"{DIRECT} curl -s -o /dev/null -w '%{{http_connect}}\\n' -p http://127.0.0.1:{named_only.port}/",
        ]))
        assert refused.get("stdout", "").split() == ["403", "403", "403", "403"], refused
        # Without the proxy there is no way out at all.
        bypass = _sh(http, box, f"curl -sS --noproxy '*' --max-time 5 "
                                f"http://127.0.0.1:{allowed.port}/; echo rc=$?")
        assert "rc=7" in bypass.get("stdout", ""), bypass
        raw = _run(http, box, "python", (
            "import socket\n"
            "s = socket.socket()\n"
            "s.settimeout(5)\n"
            f"print(s.connect_ex(('127.0.0.1', {allowed.port})))\n"))
        assert raw.get("stdout", "").strip() == "111", raw  # ECONNREFUSED: its own loopback
    assert named_only.seen == []


FRONTING = """
import os, socket, ssl
from urllib.parse import urlsplit
proxy = urlsplit(os.environ['HTTP_PROXY'])
def through(name):
    s = socket.create_connection((proxy.hostname, proxy.port), timeout=20)
    s.sendall(b'CONNECT 127.0.0.1:{port} HTTP/1.1\\r\\n\\r\\n')
    head = b''
    while not head.endswith(b'\\r\\n\\r\\n'):
        head += s.recv(1)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with context.wrap_socket(s, server_hostname=name) as tls:
            tls.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n')
            return tls.recv(100).decode().split('\\r\\n')[-1].strip()
    except ssl.SSLError as exc:
        return exc.reason
print(through(None))
print(through('fronted.example.com'))
print(through(None))
"""


def test_a_tunnel_reaches_only_the_name_it_was_allowed(egress_server, tls_service):
    """An allowed address often serves other names (a CDN): a TLS client in a
    tunnel to it that asks for another name (domain fronting) is refused with
    TLS's unrecognized_name alert before its hello leaves, and counted as
    refused; one that asks for none, or for the tunnel's own host, gets through
    (curl included)."""
    url = f"https://127.0.0.1:{tls_service.port}/"
    with egress_server.client(CLIENT_TOKEN) as http:
        box = _container(http)
        answer = _run(http, box, "python", FRONTING.format(port=tls_service.port))
        assert answer.get("stdout", "").split("\n")[:3] == [
            "hello over tls", "TLSV1_UNRECOGNIZED_NAME", "hello over tls"], answer
        curl = _sh(http, box, f"{DIRECT} curl -sSk --max-time 20 {url}")
        assert (curl.get("exit_code"), curl.get("stdout")) == (0, "hello over tls\n"), curl
        metrics = http.get("/metrics", headers={"authorization": f"Bearer {OPERATOR_TOKEN}"}).text
    # The fronted hello never reached the service: it saw only nameless handshakes.
    assert tls_service.names == [None, None, None], tls_service.names
    assert f'shoal_egress_refused_total{{container="{box}"}} 1' in metrics, [
        line for line in metrics.splitlines() if box in line]


def test_a_network_policy_narrows_and_its_secrets_stay_outside(egress_server, services):
    allowed, _ = services
    host = f"127.0.0.1:{allowed.port}"
    with egress_server.client(CLIENT_TOKEN) as http:
        # Wider than the operator's list: the extra entry changes nothing.
        box = _container(http, network_policy={
            "type": "allowlist", "allowed_domains": [host, "10.0.0.0/8"],
            "domain_secrets": [{"domain": "127.0.0.1", "name": "SERVICE_KEY",
                                "value": SECRET_VALUE}]})
        shown = http.get(f"/v1/containers/{box}").json()
        assert SECRET_VALUE not in json.dumps(shown)
        seen_before = len(allowed.seen)
        answer = _sh(http, box, (
            f"{DIRECT} curl -sS -H \"Authorization: Bearer $SERVICE_KEY\" http://{host}/s; "
            "echo key=$SERVICE_KEY; "
            f"grep -rl {SECRET_VALUE} /proc/self/environ /mnt /tmp 2>/dev/null; echo end"))
        stdout = answer.get("stdout", "")
        assert stdout.startswith("hello from allowed\nkey=shoal-secret-"), answer
        assert SECRET_VALUE not in stdout and stdout.endswith("end\n"), answer
        assert allowed.seen[seen_before]["headers"]["Authorization"] == f"Bearer {SECRET_VALUE}"
        wider = _sh(http, box, f"{DIRECT} curl -s -o /dev/null -w '%{{http_code}}' http://10.1.2.3/")
        assert wider.get("stdout") == "403", wider

        # Narrower: this container may not reach what the operator allows.
        narrow = _container(http, network_policy={"type": "allowlist",
                                                  "allowed_domains": ["example.com"]})
        refused = _sh(http, narrow, f"{DIRECT} curl -s -o /dev/null -w '%{{http_code}}' http://{host}/")
        assert refused.get("stdout") == "403", refused
        disabled = _container(http, network_policy={"type": "disabled"})
        refused = _sh(http, disabled, f"{DIRECT} curl -s -o /dev/null -w '%{{http_code}}' http://{host}/")
        assert refused.get("stdout") == "403", refused


def test_bad_network_policies_are_the_clients_error(egress_server):
    with egress_server.client(CLIENT_TOKEN) as http:
        for policy in ({"type": "open"}, {"type": "allowlist"},
                       {"type": "allowlist", "allowed_domains": ["a b"]},
                       {"type": "allowlist", "allowed_domains": ["x.com"],
                        "domain_secrets": [{"domain": "y.com", "name": "K", "value": "v"}]}):
            answer = http.post("/v1/containers", json={"name": "bad", "network_policy": policy})
            assert answer.status_code == 400, (policy, answer.text)
            assert answer.json()["error"]["message"], answer.text


def test_the_first_connection_after_start_succeeds(egress_server, services):
    allowed, _ = services
    with egress_server.client(CLIENT_TOKEN) as http:
        for _ in range(3):
            box = _container(http)  # a sandbox started for this very call
            first = _sh(http, box, f"{DIRECT} curl -sS http://127.0.0.1:{allowed.port}/")
            assert first.get("stdout") == "hello from allowed\n", first


def test_metrics_count_each_containers_traffic(egress_server, services):
    allowed, _ = services
    with egress_server.client(CLIENT_TOKEN) as http:
        box = _container(http)
        _sh(http, box, f"{DIRECT} curl -sS http://127.0.0.1:{allowed.port}/")
        _sh(http, box, f"{DIRECT} curl -s http://10.1.2.3/")
        metrics = http.get("/metrics", headers={"authorization": f"Bearer {OPERATOR_TOKEN}"}).text
    lines = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
             if box in line and not line.startswith("#")}
    assert lines, [line for line in metrics.splitlines() if "egress" in line]
    assert lines[f'shoal_egress_connections_total{{container="{box}"}}'] == 2, lines
    assert lines[f'shoal_egress_refused_total{{container="{box}"}}'] == 1, lines
    assert lines[f'shoal_egress_bytes_total{{container="{box}",direction="in"}}'] > 0, lines
    assert lines[f'shoal_egress_bytes_total{{container="{box}",direction="out"}}'] > 0, lines


HOLD = """
import os, threading, urllib.request
for name in ('NO_PROXY', 'no_proxy'):
    os.environ.pop(name, None)
def hold():
    try:
        urllib.request.urlopen({url!r}, timeout=120).read()
    except Exception:
        pass
for _ in range({n}):
    threading.Thread(target=hold, daemon=True).start()
print(open('/proc/self/uid_map').read().split()[1])
"""

UID = "print(open('/proc/self/uid_map').read().split()[1])"

RAW = """
import os, socket
from urllib.parse import urlsplit
proxy = urlsplit(os.environ['HTTP_PROXY'])
def ask(head):
    with socket.create_connection((proxy.hostname, proxy.port), timeout=20) as s:
        s.sendall(head.encode('latin-1'))
        answer = b''
        while chunk := s.recv(65536):
            answer += chunk
    return answer.decode('latin-1').split(' ')[1] if answer else 'closed'
print(open('/proc/self/uid_map').read().split()[1])
print(ask('GET http://127.0.0.1:{port}/hi HTTP/1.1\\r\\nHost: internal-admin.corp\\r\\n\\r\\n'))
print(ask('GET http://127.0.0.1:99999/ HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n'))
print(ask('CONNECT ' + 'a' * 64 + '.example.com:443 HTTP/1.1\\r\\n\\r\\n'))
print(ask('CONNECT a..example.com:443 HTTP/1.1\\r\\n\\r\\n'))
print(ask('GET http://[::1/ HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n'))
print(ask('CONNECT 127.0.0.1:\N{SUPERSCRIPT TWO} HTTP/1.1\\r\\n\\r\\n'))
"""


def _open_egress(server) -> float:
    with server.client(OPERATOR_TOKEN) as http:
        metrics = http.get("/metrics").text
    (value,) = [line.split(" ")[1] for line in metrics.splitlines()
                if line.startswith("shoal_egress_open_connections ")]
    return float(value)


def test_a_sandbox_that_ends_takes_its_connections_with_it(gateway_factory):
    """A session's code holds every connection it may open on a service that never
    answers, and the session is deleted: the broker closes those connections (they
    held the host's sockets and fds for as long as the service stayed silent), and
    the next sandbox to get the same uid has its whole allowance, not a 429 for
    what a dead sandbox held. Bad destinations are a 400, not a dropped
    connection and a traceback in the log; the Host header is the URL's."""
    slow = _Service("slow")
    server = gateway_factory(egress_allow=f"127.0.0.1:{slow.port},*.example.com:443",
                             egress_max_connections=3, uid_count=2, pool_size=1,
                             operator_tokens=OPERATOR_TOKEN)
    try:
        with server.client(CLIENT_TOKEN) as http:
            def session() -> str:
                answer = http.post("/sessions", json={})
                assert answer.status_code == 201, answer.text
                return answer.json()["session_id"]

            def run(session_id: str, code: str) -> str:
                answer = http.post(f"/sessions/{session_id}/exec", json={
                    "tool": "code_execution", "input": {"code": code}})
                assert answer.status_code == 200, answer.text
                return answer.json()["result_block"]["content"]["stdout"]

            first = session()
            first_uid = run(first, HOLD.format(url=f"http://127.0.0.1:{slow.port}/slow", n=3)).strip()
            deadline = time.monotonic() + 30
            while slow.holding < 3 or _open_egress(server) < 3:
                assert time.monotonic() < deadline, (slow.holding, _open_egress(server))
                time.sleep(0.1)
            assert http.delete(f"/sessions/{first}").status_code in (200, 204)
            deadline = time.monotonic() + 10
            while _open_egress(server):
                assert time.monotonic() < deadline, "a deleted session's connections stayed open"
                time.sleep(0.2)
            # Two uids, leased round-robin: within a few sessions one has the first's.
            for _ in range(4):
                later = session()
                if run(later, UID).strip() == first_uid:
                    break
                assert http.delete(f"/sessions/{later}").status_code in (200, 204)
            uid, host_header, *refusals = run(later, RAW.format(port=slow.port)).split()
            assert uid == first_uid
            assert host_header == "200"
            assert slow.seen[-1]["path"] == "/hi"
            assert slow.seen[-1]["headers"]["Host"] == f"127.0.0.1:{slow.port}"
            # A bad port, a 64-character label, an empty label, an unclosed IPv6
            # literal, a port in digits that are not ASCII.
            assert refusals == ["400"] * 5, refusals
        assert "Unhandled exception" not in server.log()
    finally:
        slow.release.set()
        slow.shutdown()
        slow.server_close()


def test_a_sandbox_moves_bytes_at_its_rate(gateway_factory, services):
    """One sandbox's download through the broker (on the API's event loop) is held
    to egress_bytes_per_second: 4 MiB at 1 MiB/s, a second's worth at once and
    the rest at the rate, takes 3 s, and arrives whole; so do four downloads of
    1 MiB one after another (the rate is the sandbox's, not a connection's: a
    fresh burst for each new connection let a sandbox that reconnects pass it)."""
    allowed, _ = services
    server = gateway_factory(egress_allow=f"127.0.0.1:{allowed.port}",
                             egress_bytes_per_second=1 << 20)
    with server.client(CLIENT_TOKEN) as http:
        box = _container(http)
        answer = _sh(http, box, f"{DIRECT} curl -sS -o /dev/null -w '%{{size_download}} "
                                f"%{{time_total}}' http://127.0.0.1:{allowed.port}/big/4")
        size, seconds = answer.get("stdout", "").split()
        assert int(size) == 4 << 20, answer
        assert float(seconds) >= 2.5, answer
        time.sleep(4.5)  # the bucket fills again: a second's worth
        answer = _run(http, box, "python", (
            "import os, time, urllib.request\n"
            "os.environ.pop('NO_PROXY'); os.environ.pop('no_proxy')\n"
            "start, size = time.monotonic(), 0\n"
            "for _ in range(4):\n"
            f"    size += len(urllib.request.urlopen('http://127.0.0.1:{allowed.port}/big/1', "
            "timeout=60).read())\n"
            "print(size, time.monotonic() - start)\n"))
    size, seconds = answer.get("stdout", "").split()
    assert int(size) == 4 << 20, answer
    assert float(seconds) >= 2.5, answer


# -- the model API from inside ----------------------------------------------------------------
def _sandbox_memory_holds(uid: int, needle: bytes) -> list[str]:
    """Where the processes of the sandbox running as ``uid`` hold ``needle`` in
    memory; read from the host. (That sandbox is a fork of the zygote: what the
    zygote held, every sandbox would hold, this one too.)"""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if int(re.search(r"^Uid:\s+(\d+)", status.read_text(), re.M).group(1)) != uid:
                continue
            pid = status.parent.name
            with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
                for line in maps:
                    span, perms = line.split()[:2]
                    if not perms.startswith("r"):
                        continue
                    start, end = (int(x, 16) for x in span.split("-"))
                    try:
                        mem.seek(start)
                        if needle in mem.read(end - start):
                            found.append(f"{pid}: {line.strip()}")
                    except (OSError, OverflowError, ValueError):
                        continue
        except (OSError, AttributeError):
            continue
    return found


INNER = """
import os, anthropic
client = anthropic.Anthropic()
answer = client.messages.create(model=os.environ["ANTHROPIC_MODEL"], max_tokens=64,
                                messages=[{"role": "user", "content": "from inside"}])
print(answer.content[0].text)
print("token", os.environ["ANTHROPIC_AUTH_TOKEN"])
print("base", os.environ["ANTHROPIC_BASE_URL"])
"""


def test_code_calls_the_model_with_a_token_not_the_operators_key(egress_server, upstream):
    client = anthropic.Anthropic(base_url=egress_server.url, api_key=CLIENT_TOKEN, max_retries=0)
    seen = {}

    def reply(body):
        # Told apart by what they ask, not by their order: a sandbox call that
        # never came shows as the tool result's stderr, not as a swapped answer.
        if body["messages"] == [{"role": "user", "content": "from inside"}]:
            return anthropic_turn(text("inner answer"))
        result = json.loads([b for b in body["messages"][-1]["content"]
                             if b.get("type") == "tool_result"][-1]["content"])
        seen.update(result)
        return anthropic_turn(text("done"))

    # The command holds the key reversed (the agent keeps the command it ran): the
    # shell assembles it only to search for it.
    upstream.script(anthropic_turn(tool_use("bash_code_execution", {
        "command": f"cat > inner.py <<'EOF'\n{INNER}\nEOF\npython3 inner.py; "
                   f"key=$(echo {OPERATOR_KEY[::-1]} | rev); env | grep -c \"$key\"; "
                   "grep -rl \"$key\" /proc/self/environ /mnt /tmp /etc 2>/dev/null; "
                   "echo scanned; id -u"})), reply, reply)
    message = client.messages.create(model="claude-inner", max_tokens=256, tools=[TOOL],
                                     messages=[{"role": "user", "content": "go"}])
    assert message.content[-1].text == "done"
    lines = seen["stdout"].splitlines()
    assert lines[0] == "inner answer", seen
    token = lines[1].removeprefix("token ")
    assert token.startswith("shoal-mt-") and token not in (CLIENT_TOKEN, OPERATOR_KEY)
    assert lines[2] == "base http://shoal.internal"
    assert lines[3:5] == ["0", "scanned"], seen  # not in the environment, not in files
    # The upstream saw the operator's key for the sandbox's call, and the model it named.
    outer, inner, _ = upstream.requests
    assert inner.body["messages"] == [{"role": "user", "content": "from inside"}]
    assert inner.body["model"] == "claude-inner"
    assert inner.headers["x-api-key"] == OPERATOR_KEY
    assert token not in json.dumps(inner.headers)
    # Nor in the memory of the sandbox that called the model.
    sandbox_uid = int(lines[5])
    assert _sandbox_memory_holds(sandbox_uid, OPERATOR_KEY.encode()) == []
    assert _sandbox_memory_holds(sandbox_uid, token.encode()) != []  # the scan sees what it holds

    # The token is useless outside its container: from the host, as a client token...
    stolen = anthropic.Anthropic(base_url=egress_server.url, api_key=token, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        stolen.messages.create(model="x", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    # ...and from another container's sandbox.
    with egress_server.client(CLIENT_TOKEN) as http:
        other = _container(http)
        answer = _sh(http, other, (
            "curl -s -o /dev/null -w '%{http_code}' -H 'content-type: application/json' "
            f"-H 'authorization: Bearer {token}' -d '{{}}' http://shoal.internal/v1/messages"))
        assert answer.get("stdout") == "401", answer
        # Shoal's other routes are not the model API.
        answer = _sh(http, other, "curl -s -o /dev/null -w '%{http_code}' "
                                  "http://shoal.internal/v1/containers")
        assert answer.get("stdout") == "403", answer


def test_a_token_expires(gateway_factory, upstream):
    # A server of its own, whose tokens live a few seconds: the sandbox asks with
    # curl, which starts in milliseconds, so only the sleep crosses the expiry.
    server = gateway_factory(model_token_seconds=SHORT_TOKEN_SECONDS)
    client = anthropic.Anthropic(base_url=server.url, api_key=CLIENT_TOKEN, max_retries=0)
    seen = {}

    def final(body):
        seen.update(json.loads([b for b in body["messages"][-1]["content"]
                                if b.get("type") == "tool_result"][-1]["content"]))
        return anthropic_turn(text("done"))

    # The token is issued before the command starts: sleeping until the token's
    # lifetime after the command's own start is past its expiry, however slow the start.
    ask = ("curl -s -o answer.json -w '%{http_code}\\n' -H 'content-type: application/json' "
           "-H \"authorization: Bearer $ANTHROPIC_AUTH_TOKEN\" "
           "-d '{\"model\": \"m\", \"max_tokens\": 8, "
           "\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}' "
           "\"$ANTHROPIC_BASE_URL/v1/messages\"")
    upstream.script(anthropic_turn(tool_use("bash_code_execution", {
        "command": f"STARTED=$(date +%s.%N)\n{ask}\n"
                   "python3 -c \"import json; print(json.load(open('answer.json'))"
                   "['content'][0]['text'])\"\n"
                   f"sleep $(python3 -c \"import time; print(max(0, $STARTED + "
                   f"{SHORT_TOKEN_SECONDS} + 0.5 - time.time()))\")\n{ask}"})),
        anthropic_turn(text("first")), final)
    message = client.messages.create(model="m", max_tokens=64, tools=[TOOL],
                                     messages=[{"role": "user", "content": "go"}])
    assert seen, ([block.type for block in message.content], message.content[-1],
                  [r.path for r in upstream.requests])
    assert seen["stdout"].splitlines() == ["200", "first", "401"], seen
