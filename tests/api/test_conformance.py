"""The contract's conformance checker, restated: its 13 checks, each asserted.

The published checker leases a session, runs each tool kind, exercises the file
operations and confinement, and releases the session twice; these are the same
requests with the same expectations, so a pass here is a pass there.
"""

from __future__ import annotations

import pytest

MARKER = "otari-conformance-ok"


@pytest.fixture(scope="module")
def checked(server, schema_errors):
    """Run the checker's sequence once; each test reads one check's outcome."""
    with server.client() as client:
        return run_checks(client, schema_errors)


def run_checks(client, schema_errors) -> dict[str, object]:
    """The checker's requests, in its order, against the server ``client`` talks to
    (a cluster front end too: tests/cluster/test_ray.py)."""
    outcomes: dict[str, object] = {}
    created = client.post("/sessions", json={"idle_timeout_seconds": 300})
    outcomes["CreateSession"] = (created.status_code, schema_errors("SessionHandle", created.json()))
    handle = created.json()
    outcomes["hints"] = handle["idle_timeout_seconds"]
    sid = handle["session_id"]

    def run(tool, tool_input):
        response = client.post(f"/sessions/{sid}/exec", json={
            "tool": tool, "input": tool_input, "timeout_seconds": 30,
            "tool_use_id": f"srvtoolu_{MARKER}"})
        body = response.json()
        return response.status_code, schema_errors("ExecResponse", body), body

    outcomes["code"] = run("code_execution", {"code": f'print("{MARKER}")'})
    outcomes["bash"] = run("bash_code_execution", {"command": f"echo {MARKER}"})
    outcomes["create"] = run("text_editor_code_execution",
                             {"command": "create", "path": "conformance_editor.txt",
                              "file_text": f"{MARKER}\n"})
    outcomes["view"] = run("text_editor_code_execution",
                           {"command": "view", "path": "conformance_editor.txt"})
    outcomes["unknown"] = client.post(f"/sessions/{sid}/exec", json={
        "tool": "no_such_tool_kind", "input": {}, "timeout_seconds": 30}).status_code
    put = client.post(f"/sessions/{sid}/files",
                      files={"file": ("conformance.txt", f"{MARKER}\n".encode(), "text/plain")},
                      data={"path": "conformance.txt"})
    outcomes["put"] = (put.status_code, schema_errors("FileUploadResult", put.json()))
    listing = client.get(f"/sessions/{sid}/files/list", params={"path": "."})
    outcomes["list"] = (listing.status_code, schema_errors("FileList", listing.json()),
                        [entry["path"] for entry in listing.json()["files"]])
    read = client.get(f"/sessions/{sid}/files", params={"path": "conformance.txt"})
    outcomes["get"] = (read.status_code, read.content)
    outcomes["escape"] = client.get(f"/sessions/{sid}/files",
                                    params={"path": "../../etc/passwd"}).status_code
    outcomes["destroy"] = client.delete(f"/sessions/{sid}").status_code
    outcomes["destroy again"] = client.delete(f"/sessions/{sid}").status_code
    return outcomes


def assert_conformant(checked: dict[str, object]) -> None:
    """All 13 checks at once (the tests below assert them one by one)."""
    for test in (test_create_session, test_create_session_honours_lifetime_hints,
                 test_execute_code_execution, test_execute_bash_code_execution,
                 test_execute_text_editor_create, test_execute_text_editor_view,
                 test_execute_refuses_unknown_tool_kind, test_put_file, test_list_files,
                 test_get_file, test_get_file_confines_access_to_the_workspace,
                 test_destroy_session, test_destroy_session_is_idempotent):
        test(checked)


def _ran(outcome) -> str:
    status, errors, body = outcome
    assert status == 200 and errors == []
    assert body["tool_use_id"] == f"srvtoolu_{MARKER}"
    content = body["result_block"]["content"]
    assert content["return_code"] == 0, content
    return content["stdout"]


def test_create_session(checked):
    assert checked["CreateSession"] == (201, [])


def test_create_session_honours_lifetime_hints(checked):
    assert checked["hints"] <= 300


def test_execute_code_execution(checked):
    assert MARKER in _ran(checked["code"])


def test_execute_bash_code_execution(checked):
    assert MARKER in _ran(checked["bash"])


def test_execute_text_editor_create(checked):
    _ran(checked["create"])


def test_execute_text_editor_view(checked):
    assert MARKER in _ran(checked["view"])


def test_execute_refuses_unknown_tool_kind(checked):
    assert checked["unknown"] == 400


def test_put_file(checked):
    assert checked["put"] == (201, [])


def test_list_files(checked):
    status, errors, paths = checked["list"]
    assert (status, errors) == (200, [])
    assert any(path.endswith("conformance.txt") for path in paths)


def test_get_file(checked):
    assert checked["get"] == (200, f"{MARKER}\n".encode())


def test_get_file_confines_access_to_the_workspace(checked):
    assert checked["escape"] == 403


def test_destroy_session(checked):
    assert checked["destroy"] == 204


def test_destroy_session_is_idempotent(checked):
    assert checked["destroy again"] == 204
