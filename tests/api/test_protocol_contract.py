"""Contract tests: every response of every operation validated against the
contract's own schemas, with real code run in real sandboxes."""

from __future__ import annotations

import base64

import httpx

MARKER = "shoal-conformance-ok"


def exec_call(client, session_id, tool, tool_input, **extra) -> httpx.Response:
    return client.post(f"/sessions/{session_id}/exec",
                       json={"tool": tool, "input": tool_input, **extra})


def test_the_contracts_client_pattern(server):
    # Exactly what the contract's reference client does.
    with httpx.Client(base_url=server.url, timeout=70) as http:
        created = http.post("/sessions", json={})
        assert created.status_code == 201
        session_id = created.json()["session_id"]
        response = http.post(f"/sessions/{session_id}/exec",
                             json={"tool": "code_execution", "input": {"code": "print(2 + 2)"},
                                   "timeout_seconds": 60})
        assert response.status_code == 200
        assert response.json()["result_block"]["content"]["stdout"] == "4\n"
        assert http.delete(f"/sessions/{session_id}").status_code == 204


def test_create_session_handle_matches_contract(client, schema_errors):
    response = client.post("/sessions", json={"idle_timeout_seconds": 120, "max_lifetime_seconds": 600})
    assert response.status_code == 201
    handle = response.json()
    assert schema_errors("SessionHandle", handle) == []
    assert handle["idle_timeout_seconds"] == 120
    assert handle["max_lifetime_seconds"] == 600
    assert handle["created_at"] <= handle["last_activity_at"]
    refreshed = client.get(f"/sessions/{handle['session_id']}")
    assert refreshed.status_code == 200
    assert schema_errors("SessionHandle", refreshed.json()) == []
    assert client.delete(f"/sessions/{handle['session_id']}").status_code == 204


def test_create_session_without_body(client, schema_errors):
    response = client.post("/sessions")
    assert response.status_code == 201
    assert schema_errors("SessionHandle", response.json()) == []
    client.delete(f"/sessions/{response.json()['session_id']}")


def test_code_execution_result_block(client, session_id, schema_errors):
    response = exec_call(client, session_id, "code_execution", {"code": f"print('{MARKER}')"},
                         timeout_seconds=30, tool_use_id="srvtoolu_abc")
    assert response.status_code == 200
    body = response.json()
    assert schema_errors("ExecResponse", body) == []
    assert body["tool_use_id"] == "srvtoolu_abc"
    block = body["result_block"]
    assert block["type"] == "code_execution_tool_result"
    assert block["tool_use_id"] == "srvtoolu_abc"
    assert block["content"] == {"type": "code_execution_result", "stdout": f"{MARKER}\n",
                                "stderr": "", "return_code": 0, "content": []}
    assert isinstance(body["execution_time_ms"], int) and body["execution_time_ms"] >= 0


def test_tool_use_id_generated_when_absent(client, session_id, schema_errors):
    body = exec_call(client, session_id, "code_execution", {"code": "1"}).json()
    assert schema_errors("ExecResponse", body) == []
    assert body["tool_use_id"].startswith("srvtoolu_")
    assert body["result_block"]["tool_use_id"] == body["tool_use_id"]


def test_state_persists_across_calls(client, session_id):
    exec_call(client, session_id, "code_execution", {"code": "counter = 41"})
    body = exec_call(client, session_id, "code_execution", {"code": "counter += 1\ncounter"}).json()
    assert body["result_block"]["content"]["stdout"] == "42\n"


def test_failed_program_is_a_successful_operation(client, session_id, schema_errors):
    response = exec_call(client, session_id, "code_execution", {"code": "raise ValueError('boom')"})
    assert response.status_code == 200
    body = response.json()
    assert schema_errors("ExecResponse", body) == []
    content = body["result_block"]["content"]
    assert content["type"] == "code_execution_result"
    assert content["return_code"] == 1
    assert "ValueError: boom" in content["stderr"]


def test_bash_result_block(client, session_id, schema_errors):
    response = exec_call(client, session_id, "bash_code_execution",
                         {"command": f"echo {MARKER}; echo err >&2; exit 3"})
    assert response.status_code == 200
    body = response.json()
    assert schema_errors("ExecResponse", body) == []
    assert body["result_block"]["type"] == "bash_code_execution_tool_result"
    content = body["result_block"]["content"]
    assert (content["stdout"], content["stderr"], content["return_code"]) == (f"{MARKER}\n", "err\n", 3)


def test_text_editor_result_blocks(client, session_id, schema_errors):
    created = exec_call(client, session_id, "text_editor_code_execution",
                        {"command": "create", "path": "notes.txt", "file_text": f"{MARKER}\nline 2\n"})
    assert created.status_code == 200
    assert schema_errors("ExecResponse", created.json()) == []
    assert created.json()["result_block"]["type"] == "text_editor_code_execution_tool_result"
    assert created.json()["result_block"]["content"]["return_code"] == 0

    viewed = exec_call(client, session_id, "text_editor_code_execution",
                       {"command": "view", "path": "notes.txt"}).json()
    assert schema_errors("ExecResponse", viewed) == []
    assert viewed["result_block"]["content"]["stdout"].splitlines()[:2] == [
        f"     1\t{MARKER}", "     2\tline 2"]

    failed = exec_call(client, session_id, "text_editor_code_execution",
                       {"command": "str_replace", "path": "notes.txt", "old_str": "absent",
                        "new_str": "x"}).json()
    assert schema_errors("ExecResponse", failed) == []
    content = failed["result_block"]["content"]
    assert content["type"] == "code_execution_result"
    assert content["return_code"] == 1
    assert "did not appear verbatim" in content["stderr"]


def test_files_round_trip(client, session_id, schema_errors):
    payload = bytes(range(256)) * 10
    uploaded = client.post(f"/sessions/{session_id}/files",
                           files={"file": ("data.bin", payload, "application/octet-stream")},
                           data={"path": "inputs/data.bin"})
    assert uploaded.status_code == 201
    assert schema_errors("FileUploadResult", uploaded.json()) == []
    assert uploaded.json() == {"path": "inputs/data.bin", "size_bytes": len(payload)}

    seen = exec_call(client, session_id, "code_execution",
                     {"code": "print(len(open('inputs/data.bin','rb').read()))"}).json()
    assert seen["result_block"]["content"]["stdout"] == f"{len(payload)}\n"

    listing = client.get(f"/sessions/{session_id}/files/list", params={"path": "."})
    assert listing.status_code == 200
    assert schema_errors("FileList", listing.json()) == []
    entries = {entry["path"]: entry for entry in listing.json()["files"]}
    assert entries["inputs/data.bin"]["size_bytes"] == len(payload)

    downloaded = client.get(f"/sessions/{session_id}/files", params={"path": "inputs/data.bin"})
    assert downloaded.status_code == 200
    assert downloaded.content == payload


def test_upload_path_derived_from_file_name(client, session_id):
    uploaded = client.post(f"/sessions/{session_id}/files", files={"file": ("name.txt", b"hi")})
    assert uploaded.status_code == 201
    assert uploaded.json()["path"] == "name.txt"


def test_produced_files_are_reported_and_retrievable(client, session_id, schema_errors):
    code = ("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\n"
            "open('/mnt/user-data/outputs/report.csv', 'w').write('a,b\\n1,2\\n')")
    body = exec_call(client, session_id, "code_execution", {"code": code}).json()
    assert schema_errors("ExecResponse", body) == []
    produced = {f["filename"]: f for f in body["result_block"]["content"]["content"]}
    assert set(produced) == {"report.csv", "figure_1.png"}
    for item in produced.values():
        assert item["type"] == "code_execution_output"
    file_id = produced["report.csv"]["file_id"]
    assert base64.urlsafe_b64decode(file_id + "==").decode() == "/mnt/user-data/outputs/report.csv"

    by_id = client.get(f"/sessions/{session_id}/files", params={"path": file_id})
    assert by_id.status_code == 200 and by_id.content == b"a,b\n1,2\n"
    by_path = client.get(f"/sessions/{session_id}/files",
                         params={"path": "/mnt/user-data/outputs/report.csv"})
    assert by_path.content == b"a,b\n1,2\n"
    png = client.get(f"/sessions/{session_id}/files", params={"path": produced["figure_1.png"]["file_id"]})
    assert png.content.startswith(b"\x89PNG") and png.headers["content-type"] == "image/png"

    outputs = client.get(f"/sessions/{session_id}/files/list",
                         params={"path": "/mnt/user-data/outputs"}).json()
    assert {entry["path"] for entry in outputs["files"]} == {
        "/mnt/user-data/outputs/report.csv", "/mnt/user-data/outputs/figure_1.png"}


def test_destroy_is_idempotent(client):
    session_id = client.post("/sessions", json={}).json()["session_id"]
    assert client.delete(f"/sessions/{session_id}").status_code == 204
    assert client.delete(f"/sessions/{session_id}").status_code == 204
    assert client.delete("/sessions/never-existed").status_code == 204
    assert exec_call(client, session_id, "code_execution", {"code": "1"}).status_code == 404


def test_timeout_reported_in_the_payload(client, session_id, schema_errors):
    body = exec_call(client, session_id, "bash_code_execution", {"command": "sleep 30"},
                     timeout_seconds=1).json()
    assert schema_errors("ExecResponse", body) == []
    content = body["result_block"]["content"]
    assert content["return_code"] == 124
    assert content["stderr"].endswith("Command timed out after 1s.")
    assert body["limits"] == ["timeout"]


def test_health_and_openapi(client):
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    document = client.get("/openapi.json").json()
    assert {"/sessions", "/sessions/{session_id}/exec", "/sessions/{session_id}/files"} <= set(
        document["paths"])
