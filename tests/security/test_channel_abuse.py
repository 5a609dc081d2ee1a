"""Abuse of the control channel by the code it serves, over real HTTP.

The agent runs user Python in its own process, so the socket that carries its
frames to the host is in the attacker's hands: code finds it in /proc/self/fd and
writes whatever it likes into it. Lying about its *own* results is within reach
of any code (it can print anything, or patch the agent in memory); what must hold
is the host's side of the boundary:

- the server answers every call within a bounded time and never with a 5xx;
- nothing outside the session is ever served: a forged produced file that names
  /etc/shadow, a host canary or a ``..`` path is refused when fetched;
- after the attack the session either works again or says clearly that it was
  restarted; other sessions never notice (a bystander session is checked after
  every test).

| attack | test | what contains it |
| --- | --- | --- |
| find the channel from user code; reach it from a child process | test_the_channel_is_reachable_only_from_the_agent | close-on-exec; sockets cannot be opened through /proc |
| forged ``done`` for the current call | test_a_forged_done_answers_only_its_own_call | host reads frames of that call id only; the real ``done`` is dropped as stale |
| forged ``done`` with an absurd return code (2**64, ``true``) | test_a_forged_return_code_stays_an_integer_in_range | contained (it was not: fixed) |
| forged ``done`` whose ``files`` name /etc/passwd, /etc/shadow, a host canary, ``..`` paths, links to the host | test_forged_produced_files_never_serve_host_content | host filters to the session's mounts; every fetch walks with O_NOFOLLOW |
| forged ``files`` entries with a trailing ``..`` | test_forged_produced_files_have_no_dot_dot_components | dropped by the host's path filter (it was not: fixed) |
| forged ``done`` with a 3 MB ``error`` | test_a_forged_error_is_capped_like_output | contained (it was not: fixed) |
| forged frames with wrong field types, string/list/float ids | test_malformed_fields_in_forged_frames_are_ignored | type checks on every field |
| header claiming 2 GiB or 4 MiB + 1, non-JSON, non-UTF-8, non-object JSON, one stray byte | test_a_malformed_frame_is_answered_and_the_session_recovers | the sandbox restarts and the session recovers (it was a 500, for good: fixed) |
| a frame whose body never comes | test_a_truncated_frame_costs_at_most_the_timeout | timeout + backstop, then a restart |
| closing the channel, shutting it down, replacing it with /dev/null, closing it between calls | test_losing_the_channel_restarts_the_sandbox_and_keeps_files | channel EOF or backstop: restart, files kept |
| 20 MB of ``out`` frames for the current call; 50 000 frames for other ids | test_flooding_the_channel_is_capped | per-stream cap on the host; stale ids dropped |
| a thread flooding the channel while calls run | test_a_flood_from_a_thread_during_calls | frames of other ids dropped; bounded by the timeout |
| pre-forged answers to future calls; a thread that steals the host's calls and answers them | test_user_code_impersonating_the_agent_stays_in_its_session | nothing crosses the session: no 5xx, no host data, others unaffected, DELETE works |
| file descriptors passed to the host with SCM_RIGHTS | test_file_descriptors_sent_to_the_host_are_dropped | the host reads without ancillary data: the kernel closes them |
"""

from __future__ import annotations

import base64
import secrets
import time
from pathlib import Path

import httpx
import pytest
import yaml
from httpx_sse import connect_sse
from jsonschema import Draft202012Validator

from tests.security.helpers import execute, leaked, new_session, run_ok

BACKSTOP = 3.0  # shoal.sandbox.sandbox.BACKSTOP_SECONDS
# The bounds below say a call was answered at all, by its own timeout and the host's
# backstop, instead of waiting for ever (the clients give up after 60 s); the slack
# is that generous so that a loaded two-core machine never fails them.
SLACK = 30.0
OUTPUT_CAP = 1024 * 1024  # the server's default output_cap_bytes

# Finds the channel the way an attacker would, and the id of the call in flight.
FORGE = r'''
import gc, json, os, socket, struct
def _channel():
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                return int(name)
        except OSError:
            pass
    raise SystemExit("no channel")
CHANNEL = _channel()
CALL_ID = next(o.call_id for o in gc.get_objects() if type(o).__name__ == "_CallState")
_raw = socket.socket(fileno=os.dup(CHANNEL))
def frame(message):
    body = json.dumps(message).encode()
    return struct.pack(">I", len(body)) + body
def send(data):
    _raw.sendall(data)
'''


def file_id(path: str) -> str:
    return base64.urlsafe_b64encode(path.encode()).decode().rstrip("=")


def decode_id(value: str) -> str:
    return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).decode(errors="replace")


@pytest.fixture(scope="module")
def contract() -> dict:
    shared = Path(__file__).resolve().parents[3] / "shared" / "spec" / "code-execution-openapi.yaml"
    vendored = Path(__file__).resolve().parents[1] / "api" / "spec" / "code-execution-openapi.yaml"
    return yaml.safe_load((shared if shared.exists() else vendored).read_text())


@pytest.fixture(scope="module")
def bystander(security_server):
    """A session with state of its own, that every attack here must leave alone."""
    with httpx.Client(base_url=security_server.url, timeout=60) as http:
        session = new_session(http)
        token = secrets.token_hex(8)
        run_ok(http, session, f"kept = {token!r}")
        yield session, token
        http.delete(f"/sessions/{session}")


@pytest.fixture(autouse=True)
def other_sessions_unaffected(security_server, bystander):
    session, token = bystander
    with httpx.Client(base_url=security_server.url, timeout=60) as http:
        baseline = execute(http, session, "print(kept)").seconds
    yield
    with httpx.Client(base_url=security_server.url, timeout=60) as http:
        answer = execute(http, session, "print(kept)")
        assert answer.status == 200, answer.text
        assert answer.content["stdout"] == f"{token}\n", answer.content
        assert not answer.body["interpreter_restarted"]
        # Slowed down for good (a stuck worker, a busy loop left by the attack) fails;
        # a busy machine does not: the bound is relative to the same call just before.
        bound = max(10.0, 20 * baseline)
        assert answer.seconds < bound, \
            f"the bystander session was slowed down: {answer.seconds:.1f}s (baseline {baseline:.2f}s)"
        assert http.get("/health").status_code == 200


@pytest.fixture
def victim(security_server, http):
    """A fresh session for one attack; it is deleted afterwards, whatever state it is in."""
    session = new_session(http)
    yield session
    # A fresh client: after a 500 the server drops the connection the test was using.
    with httpx.Client(base_url=security_server.url, timeout=30) as own:
        response = own.delete(f"/sessions/{session}")
    assert response.status_code == 204, response.text


def recovers(http: httpx.Client, session: str, tries: int = 3) -> bool:
    """Whether the session runs real code again within ``tries`` calls."""
    for _ in range(tries):
        answer = execute(http, session, "print('recovered', 6 * 7)", timeout=5)
        assert answer.status < 500, answer.text
        if answer.status == 200 and answer.content["stdout"] == "recovered 42\n":
            return True
    return False


# -- finding the channel ----------------------------------------------------------------------
def test_the_channel_is_reachable_only_from_the_agent(http, victim):
    # The agent's own socket, as the interpreter it runs in holds it (whichever
    # launcher started it, and whatever fd number it got).
    found = run_ok(http, victim, FORGE + (
        "agent = next(o for o in gc.get_objects() if type(o).__name__ == 'Agent')\n"
        "print(CHANNEL, agent._channel.fileno(), os.getpid())"))
    channel, held, agent_pid = found["stdout"].split()
    assert channel == held  # the attacker has it: the rest of this module is meaningful
    children = run_ok(http, victim, (
        "ls -l /proc/self/fd | grep -c socket; "
        "python3 -c 'import os; print(sorted(os.listdir(\"/proc/self/fd\")))'; "
        f"python3 -c 'import os\ntry:\n    os.open(\"/proc/{agent_pid}/fd/{channel}\", os.O_RDWR)\n"
        "    print(\"OPENED\")\nexcept OSError as exc:\n    print(\"refused\", exc.errno)'"),
        tool="bash")
    lines = children["stdout"].splitlines()
    assert lines[0] == "0", f"a child process inherited the channel: {children['stdout']}"
    assert lines[1] == "['0', '1', '2', '3']", lines[1]
    assert lines[2].startswith("refused"), lines[2]


# -- forged done frames ---------------------------------------------------------------------
def test_a_forged_done_answers_only_its_own_call(http, victim):
    answer = execute(http, victim, FORGE + (
        "send(frame({'id': CALL_ID, 'type': 'done', 'return_code': 3}))\n"
        "import time; time.sleep(0.3)\nprint('the real end of the call')"))
    assert answer.status == 200, answer.text
    assert answer.content["return_code"] == 3  # a program may lie about its own result
    assert answer.seconds < 30  # answered, not left waiting for the 60 s default timeout
    # The agent's own `done` for that call arrives late and must not answer the next one.
    for n in range(3):
        following = execute(http, victim, f"print({n} * 2)")
        assert following.status == 200 and following.content["stdout"] == f"{n * 2}\n", following.text
        assert following.content["return_code"] == 0


@pytest.mark.parametrize("forged", ["True", "2 ** 64", "-(2 ** 63) - 1"])
def test_a_forged_return_code_stays_an_integer_in_range(http, victim, contract, forged):
    answer = execute(http, victim, FORGE + f"send(frame({{'id': CALL_ID, 'type': 'done', "
                                           f"'return_code': {forged}}}))")
    assert answer.status == 200, answer.text
    validator = Draft202012Validator({"$ref": "#/components/schemas/ExecResponse",
                                      "components": contract["components"]})
    errors = [error.message for error in validator.iter_errors(answer.body)]
    code = answer.content["return_code"]
    assert not errors, errors
    assert type(code) is int and -2**31 <= code < 2**31, code


def _produced_paths(canary: str) -> list[object]:
    ws, out, up = "/home/agent/workspace", "/mnt/user-data/outputs", "/mnt/user-data/uploads"
    return [
        "/etc/passwd", "/etc/shadow", canary, "/proc/self/environ", "/root/.bashrc",
        f"{ws}/../../../etc/shadow", f"{out}/../../../etc/passwd", f"{up}/../../../../etc/shadow",
        f"{ws}/..", f"{ws}/../..", f"{out}/..", f"{ws}/%2e%2e/etc/passwd",
        f"{ws}\\..\\..\\..\\etc\\shadow", f"{ws}/\u2025/etc/shadow",
        f"{out}/link-shadow", f"{out}/link-canary", f"{out}/etcdir/shadow", f"{ws}/rootdir/etc/shadow",
        f"{ws}/link-canary", f"{ws}/real.txt", f"{ws}/" + "x" * 5000,
        # (a NUL byte is left out: any client can send that id; see test_api_attacks)
        None, 42, {"path": "/etc/shadow"}, ["/etc/shadow"],
    ]


def test_forged_produced_files_never_serve_host_content(security_server, http, canary,
                                                       host_secrets):
    scope = f"sec-forged-{secrets.token_hex(4)}"
    session = new_session(http, container=scope)
    try:
        run_ok(http, session, (
            "cd /mnt/user-data/outputs && ln -s /etc/shadow link-shadow && "
            f"ln -s {canary.path} link-canary && ln -s /etc etcdir && "
            f"cd /home/agent/workspace && ln -s / rootdir && ln -s {canary.path} link-canary && "
            "echo session-content > real.txt"), tool="bash")
        entries = [{"path": path, "size": 10} for path in _produced_paths(str(canary.path))]
        entries += [{"path": "/etc/shadow", "size": "big"}, {"path": "/etc/shadow"},
                    {"size": 1}, "just a string"]
        entries += [{"path": f"/etc/hosts-{n}", "size": 1} for n in range(200)]
        answer = execute(http, session, FORGE + f"send(frame({{'id': CALL_ID, 'type': 'done', "
                                                f"'return_code': 0, 'files': {entries!r}}}))")
        assert answer.status == 200, answer.text
        assert not leaked(answer.text, host_secrets)
        reported = answer.content["content"]
        assert len(reported) <= 50
        paths = [decode_id(item["file_id"]) for item in reported]
        outside = [p for p in paths if not p.startswith(("/home/agent/workspace/",
                                                         "/mnt/user-data/outputs/"))]
        assert not outside, outside
        fetches = 0
        for item in reported:
            fid = item["file_id"]
            for url, params in ((f"/sessions/{session}/files", {"path": fid}),
                                (f"/v1/files/{fid}/content", {"scope_id": scope}),
                                (f"/v1/containers/{scope}/files/{fid}/content", {})):
                response = http.get(url, params=params)
                fetches += 1
                assert response.status_code < 500, (url, response.status_code, response.text)
                assert not leaked(response.content, host_secrets), (url, decode_id(fid))
                if response.status_code == 200:
                    assert response.content == b"session-content\n", (url, decode_id(fid))
                else:
                    assert response.status_code in (400, 403, 404), (url, response.status_code)
        # control: forged files that pass the host's path filter were reported and fetched
        assert fetches >= 3 * 5, fetches
        listing = http.get("/v1/files", params={"scope_id": scope})
        assert listing.status_code == 200 and not leaked(listing.text, host_secrets)
        assert recovers(http, session)
    finally:
        http.delete(f"/sessions/{session}")
        http.delete(f"/v1/containers/{scope}")


def test_forged_produced_files_have_no_dot_dot_components(http, victim):
    paths = ["/home/agent/workspace/..", "/mnt/user-data/outputs/..", "/home/agent/workspace/."]
    answer = execute(http, victim, FORGE + (
        f"send(frame({{'id': CALL_ID, 'type': 'done', 'return_code': 0, "
        f"'files': {[{'path': p, 'size': 1} for p in paths]!r}}}))"))
    assert answer.status == 200, answer.text
    reported = [decode_id(item["file_id"]) for item in answer.content["content"]]
    assert not [p for p in reported if {"..", "."} & set(p.split("/"))], reported


@pytest.mark.parametrize("container", [False, True], ids=["run", "container-run"])
def test_a_forged_produced_path_longer_than_any_path_is_dropped(security_server, http,
                                                                container):
    """A run keeps the files its code produced: a forged path past 4096 bytes was
    refused there, and the run failed as an internal error, logged at ERROR with its
    traceback, as often as the code liked."""
    long_path = "/home/agent/workspace/" + "f" * 4100
    body = {"language": "python", "timeout_ms": 30_000, "code": FORGE + (
        f"send(frame({{'id': CALL_ID, 'type': 'done', 'return_code': 0, "
        f"'files': [{{'path': {long_path!r}, 'size': 1}}]}}))\n")}
    if container:
        created = http.post("/v1/containers", json={"name": "forged-paths"})
        assert created.status_code == 200, created.text
        body["container"] = created.json()["id"]
    with connect_sse(http, "POST", "/v1/code-execution/runs", json=body) as source:
        assert source.response.status_code == 200, source.response.read()
        ends = [(sse.event, sse.json()) for sse in source.iter_sse()
                if sse.event in ("run.completed", "run.failed")]
    assert [event for event, _ in ends] == ["run.completed"], ends
    assert ends[0][1]["files"] == [], ends
    assert f"run {ends[0][1]['runId']} failed" not in security_server.log()
    if container:
        http.delete(f"/v1/containers/{body['container']}")


def test_the_files_a_run_leaves_out_cost_the_log_nothing_at_the_default_level(security_server,
                                                                              http):
    """Each file a run left out was a warning of its own: every run of a container of
    a hundred files logged fifty (its files past the fifty laid out for it), and 50
    forged names of 4 KiB each logged 400 KB, a run, as often as the tenant liked."""
    created = http.post("/v1/containers", json={"name": "many-files"})
    assert created.status_code == 200, created.text
    container = created.json()["id"]

    def run(code: str) -> dict:
        with connect_sse(http, "POST", "/v1/code-execution/runs", json={
                "language": "python", "code": code, "container": container,
                "timeout_ms": 30_000}) as source:
            ends = [(sse.event, sse.json()) for sse in source.iter_sse()
                    if sse.event in ("run.completed", "run.failed")]
        assert [event for event, _ in ends] == ["run.completed"], ends
        return ends[0][1]

    def write(count: int, prefix: str) -> str:
        return (f"for i in range({count}):\n"
                f"    open(f'/mnt/user-data/outputs/{prefix}{{i}}.txt', 'w').write('x')\n")

    try:
        for batch in range(2):
            assert len(run(write(50, f"b{batch}-"))["files"]) == 50
        before = len(security_server.log())
        long_names = [{"path": f"/home/agent/workspace/{i:02d}" + "x" * 4000, "size": 1}
                      for i in range(50)]
        forged = run(FORGE + f"send(frame({{'id': CALL_ID, 'type': 'done', 'return_code': 0, "
                             f"'files': {long_names!r}}}))\n")
        assert forged["files"] == [], forged
        laid_out = "import os\nprint(sum(len(f) for _, _, f in os.walk('external-files')))\n"
        assert run(laid_out)["stdout"] == "50\n"
        assert len(run(write(70, "c-"))["files"]) == 50
        grown = security_server.log()[before:]
        assert len(grown) < 2048, grown[:3000]
    finally:
        http.delete(f"/v1/containers/{container}")


def test_a_forged_error_is_capped_like_output(http, victim):
    answer = execute(http, victim, FORGE + (
        "send(frame({'id': CALL_ID, 'type': 'done', 'return_code': 1, 'error': 'E' * 3_000_000}))"))
    assert answer.status == 200, answer.text[:500]
    assert len(answer.content["stderr"]) <= OUTPUT_CAP + 64, len(answer.content["stderr"])


def test_malformed_fields_in_forged_frames_are_ignored(http, victim):
    answer = execute(http, victim, FORGE + r'''
for bad in ({"id": CALL_ID, "type": "out", "stream": "stdout", "data": {"x": 1}},
            {"id": CALL_ID, "type": "out", "stream": "stdout", "data": None},
            {"id": CALL_ID, "type": "out", "stream": "stdin", "data": "FORGED-STREAM"},
            {"id": CALL_ID, "type": "out", "stream": ["stdout"], "data": "FORGED-LIST"},
            {"id": str(CALL_ID), "type": "done", "return_code": 9},
            {"id": [CALL_ID], "type": "done", "return_code": 9},
            {"id": None, "type": "done", "return_code": 9},
            {"id": {"id": CALL_ID}, "type": "done", "return_code": 9},
            {"type": "done", "return_code": 9},
            {"id": CALL_ID, "type": "DONE", "return_code": 9},
            {"id": CALL_ID, "type": ["done"], "return_code": 9},
            {"id": CALL_ID + 1000, "type": "done", "return_code": 9},
            {"id": -1, "type": "done", "return_code": 9}):
    send(frame(bad))
print("real")
''')
    assert answer.status == 200, answer.text
    assert answer.content["stdout"] == "real\n", answer.content
    assert answer.content["return_code"] == 0
    assert recovers(http, victim)


# -- malformed frames ---------------------------------------------------------------------------
MALFORMED = {
    "header-2GiB": "send(struct.pack('>I', 2**31))",
    "header-cap-plus-one": "send(struct.pack('>I', 4 * 1024 * 1024 + 1))",
    "header-4GiB-1": "send(b'\\xff\\xff\\xff\\xff')",
    "not-json": "send(struct.pack('>I', 5) + b'hello')",
    "not-utf8": "send(struct.pack('>I', 4) + b'\\xff\\xfe\\xfd\\xfc')",
    "json-array": "send(struct.pack('>I', 3) + b'[1]')",
    "json-string": "send(struct.pack('>I', 4) + b'\"ab\"')",
    "huge-integer": "body = b'{\"id\": ' + b'9' * 5000 + b'}'\nsend(struct.pack('>I', len(body)) + body)",
    "stray-byte": "send(b'\\x00')",
}


@pytest.mark.parametrize("attack", MALFORMED)
def test_a_malformed_frame_is_answered_and_the_session_recovers(http, victim, attack):
    answer = execute(http, victim, FORGE + MALFORMED[attack], timeout=3)
    assert answer.status == 200, (answer.status, answer.text[:300])
    assert answer.seconds < 3 + BACKSTOP + SLACK
    assert answer.body["interpreter_restarted"] or answer.content["return_code"] == 0
    assert recovers(http, victim)


def test_a_truncated_frame_costs_at_most_the_timeout(http, victim):
    run_ok(http, victim, "open('kept.txt', 'w').write('kept')")
    answer = execute(http, victim, FORGE + "send(struct.pack('>I', 1000) + b'{')", timeout=2)
    assert answer.status == 200, answer.text
    assert answer.seconds < 2 + BACKSTOP + SLACK, answer.seconds
    assert answer.body["interpreter_restarted"] is True
    assert answer.content["return_code"] != 0 and answer.content["stderr"], answer.content
    assert recovers(http, victim)
    assert run_ok(http, victim, "print(open('kept.txt').read())")["stdout"] == "kept\n"


LOSING_THE_CHANNEL = {
    "close": "os.close(CHANNEL)",
    "shutdown": "_raw.shutdown(socket.SHUT_RDWR)",
    "replace-with-dev-null": "os.dup2(os.open('/dev/null', os.O_RDWR), CHANNEL)",
    "close-from-a-thread-later": ("import threading, time\n"
                                  "threading.Thread(target=lambda: (time.sleep(0.3), "
                                  "os.close(CHANNEL)), daemon=True).start()"),
}


@pytest.mark.parametrize("attack", LOSING_THE_CHANNEL)
def test_losing_the_channel_restarts_the_sandbox_and_keeps_files(http, victim, attack):
    run_ok(http, victim, "open('kept.txt', 'w').write('kept')")
    answers = [execute(http, victim, FORGE + LOSING_THE_CHANNEL[attack], timeout=2)]
    answers.append(execute(http, victim, "import time; time.sleep(0.5); print('second')", timeout=2))
    for answer in answers:
        assert answer.status == 200, answer.text
        assert answer.seconds < 2 + BACKSTOP + SLACK, answer.seconds
    restarted = [a for a in answers if a.body["interpreter_restarted"]]
    assert restarted, "control: losing the channel must cost a restart"
    for answer in restarted:
        assert answer.content["return_code"] != 0
        assert "restarted" in answer.content["stderr"] or "timed out" in answer.content["stderr"]
    assert recovers(http, victim)
    assert run_ok(http, victim, "print(open('kept.txt').read())")["stdout"] == "kept\n"


# -- floods --------------------------------------------------------------------------------------
def test_flooding_the_channel_is_capped(http, victim):
    answer = execute(http, victim, FORGE + (
        "chunk = frame({'id': CALL_ID, 'type': 'out', 'stream': 'stdout', 'data': 'F' * 1000})\n"
        "send(chunk * 20000)\n"))
    assert answer.status == 200, answer.text[:300]
    assert answer.seconds < 45  # answered before the client gives up (60 s)
    stdout = answer.content["stdout"]
    assert len(stdout) <= OUTPUT_CAP + 64, len(stdout)
    assert stdout.endswith("...[truncated]")
    assert "output" in answer.body["limits"]
    stale = execute(http, victim, FORGE + (
        "chunk = b''.join(frame({'id': i, 'type': 'out', 'stream': 'stdout', 'data': 'STALE'}) "
        "for i in (0, -1, CALL_ID - 1, CALL_ID + 10**6, 'x'))\n"
        "send(chunk * 10000)\nprint('mine')"))
    assert stale.status == 200, stale.text[:300]
    assert stale.content["stdout"] == "mine\n"
    assert recovers(http, victim)


def test_a_flood_from_a_thread_during_calls(http, victim):
    # The flood runs until a call tells it to stop (at most two minutes), so the
    # calls below are sure to run while it does.
    started = run_ok(http, victim, FORGE + (
        "import threading, time\n"
        "flood_done = threading.Event()\n"
        "def flood():\n"
        "    junk = frame({'id': 0, 'type': 'out', 'stream': 'stdout', 'data': 'J' * 200})\n"
        "    end = time.monotonic() + 120\n"
        "    try:\n"
        "        while time.monotonic() < end and not os.path.exists('/tmp/stop-flood'):\n"
        "            os.write(CHANNEL, junk)\n"
        "    except OSError:\n"
        "        pass\n"
        "    flood_done.set()\n"
        "threading.Thread(target=flood, daemon=True).start()\nprint('flooding')"))
    assert started["stdout"] == "flooding\n"
    for _ in range(3):
        answer = execute(http, victim, "print('during', flood_done.is_set())", timeout=3)
        assert answer.status == 200, answer.text[:300]
        assert answer.seconds < 3 + BACKSTOP + SLACK
        assert answer.content["stdout"] == "during False\n", answer.content
    stopped = execute(http, victim, "open('/tmp/stop-flood', 'w').close()\n"
                                    "print(flood_done.wait(30))", timeout=40)
    assert stopped.status == 200, stopped.text[:300]
    assert stopped.content["stdout"] == "True\n", stopped.content
    assert recovers(http, victim)


IMPERSONATION = {
    # Answers prepared now for the next twenty calls of this session.
    "pre-forged": ("send(b''.join(frame({'id': CALL_ID + n, 'type': 'done', 'return_code': 0, "
                   "'stdout': 'FORGED', 'files': [{'path': '/etc/shadow', 'size': 1}]}) "
                   "for n in range(1, 21)))"),
    # A thread that takes the host's calls off the channel and answers them itself.
    "thief": ("import threading\n"
              "def thief():\n"
              "    while True:\n"
              "        header = os.read(CHANNEL, 4)\n"
              "        if len(header) < 4:\n"
              "            return\n"
              "        call = json.loads(os.read(CHANNEL, struct.unpack('>I', header)[0]))\n"
              "        send(frame({'id': call['id'], 'type': 'done', 'return_code': 0,\n"
              "                    'files': [{'path': '/home/agent/workspace/../../../etc/shadow',"
              " 'size': 1}]}))\n"
              "threading.Thread(target=thief, daemon=True).start()"),
}


@pytest.mark.parametrize("attack", IMPERSONATION)
def test_user_code_impersonating_the_agent_stays_in_its_session(security_server, http, victim,
                                                                host_secrets, attack):
    answer = execute(http, victim, FORGE + IMPERSONATION[attack])
    assert answer.status == 200, answer.text
    for _ in range(5):
        later = execute(http, victim, "print('real')", timeout=3)
        assert later.status == 200, later.text[:300]
        assert later.seconds < 3 + BACKSTOP + SLACK
        assert not leaked(later.text, host_secrets)
        for item in later.content["content"]:
            fetched = http.get(f"/sessions/{victim}/files", params={"path": item["file_id"]})
            assert fetched.status_code in (400, 403, 404), fetched.text
            assert not leaked(fetched.content, host_secrets)
    # A new session is untouched by all of it.
    fresh = new_session(http)
    try:
        assert run_ok(http, fresh, "print('clean')")["stdout"] == "clean\n"
    finally:
        http.delete(f"/sessions/{fresh}")


# -- descriptors -----------------------------------------------------------------------------------
def _open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def test_file_descriptors_sent_to_the_host_are_dropped(security_server, http, victim):
    server_pid = security_server.process.pid
    run_ok(http, victim, "print('warm')")
    before = _open_fds(server_pid)
    answer = execute(http, victim, FORGE + (
        "import array\n"
        "fds = [os.open('/etc/hosts', os.O_RDONLY), os.open('/home/agent/workspace', os.O_RDONLY),\n"
        "       *os.pipe(), os.open('/proc/self/ns/net', os.O_RDONLY)]\n"
        "for n in range(200):\n"
        "    _raw.sendmsg([frame({'id': 0, 'type': 'out', 'stream': 'stdout', 'data': 'fd'})],\n"
        "                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', fds))])\n"
        "print('sent')"))
    assert answer.status == 200, answer.text
    assert answer.content["stdout"] == "sent\n"
    time.sleep(0.2)
    after = _open_fds(server_pid)
    assert after < before + 20, f"the server holds {after - before} more descriptors"
    assert recovers(http, victim)
