"""The Containers API driven by the official ``openai`` package, pointed at Shoal."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused-on-an-open-server",
                       max_retries=0) as sdk:
        yield sdk


def test_container_lifecycle(client):
    created = client.containers.create(name="monthly-report",
                                       expires_after={"anchor": "last_active_at", "minutes": 30})
    assert created.id.startswith("cnt_")
    assert created.name == "monthly-report"
    assert created.object == "container"
    assert created.expires_after.minutes == 30
    assert created.expires_after.anchor == "last_active_at"

    fetched = client.containers.retrieve(created.id)
    assert (fetched.id, fetched.name, fetched.status) == (created.id, "monthly-report", "active")

    listed = [c.id for c in client.containers.list(limit=100)]
    assert created.id in listed

    # The SDK's delete returns None whatever the body says: read the raw answer,
    # which OpenAI's API documents as a deletion status.
    deleted = client.containers.with_raw_response.delete(created.id)
    assert deleted.status_code == 200
    assert deleted.http_response.json() == {"id": created.id, "object": "container.deleted",
                                            "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.containers.retrieve(created.id)


def test_container_list_paginates_with_cursor(client):
    ids = [client.containers.create(name=f"page-{i}").id for i in range(5)]
    page = client.containers.list(limit=2, order="asc")
    seen = []
    for container in page:  # the SDK follows `after` cursors by itself
        seen.append(container.id)
    assert [i for i in seen if i in ids] == ids
    first = client.containers.list(limit=2, order="desc")
    assert len(first.data) == 2 and first.has_more
    for container_id in ids:
        client.containers.delete(container_id)


def test_container_files_upload_attach_read_delete(client):
    container = client.containers.create(name="files")
    uploaded = client.containers.files.create(container.id, file=("sales.csv", b"month,revenue\n1,10\n"))
    assert uploaded.object == "container.file"
    assert uploaded.container_id == container.id
    assert uploaded.path == "/mnt/user-data/uploads/sales.csv"
    assert uploaded.bytes == 19
    assert uploaded.source == "user"

    tenant_file = client.files.create(file=("notes.txt", b"attached by id"), purpose="user_data")
    assert tenant_file.id.startswith("file-") and tenant_file.bytes == 14
    attached = client.containers.files.create(container.id, file_id=tenant_file.id)
    assert attached.path == "/mnt/user-data/uploads/notes.txt"

    listed = {f.path: f for f in client.containers.files.list(container.id)}
    assert set(listed) == {"/mnt/user-data/uploads/sales.csv", "/mnt/user-data/uploads/notes.txt"}

    retrieved = client.containers.files.retrieve(uploaded.id, container_id=container.id)
    assert retrieved.bytes == 19
    content = client.containers.files.content.retrieve(attached.id, container_id=container.id)
    assert content.read() == b"attached by id"

    client.containers.files.delete(uploaded.id, container_id=container.id)
    remaining = [f.path for f in client.containers.files.list(container.id)]
    assert remaining == ["/mnt/user-data/uploads/notes.txt"]
    with pytest.raises(openai.NotFoundError):
        client.containers.files.retrieve(uploaded.id, container_id=container.id)
    client.containers.delete(container.id)


def test_create_with_file_ids_and_code_output_is_listed(client, server):
    tenant_file = client.files.create(file=("input.txt", b"7\n"), purpose="user_data")
    container = client.containers.create(name="with-files", file_ids=[tenant_file.id])
    with server.client() as http:
        session = http.post("/sessions", json={"container": container.id}).json()
        result = http.post(f"/sessions/{session['session_id']}/exec", json={
            "tool": "code_execution", "input": {"code": (
                "n = int(open('/mnt/user-data/uploads/input.txt').read())\n"
                "open('/mnt/user-data/outputs/square.txt', 'w').write(str(n * n))")}}).json()
        assert result["result_block"]["content"]["return_code"] == 0
        http.delete(f"/sessions/{session['session_id']}")
    files = {f.path: f for f in client.containers.files.list(container.id)}
    assert files["/mnt/data/square.txt"].source == "assistant"
    assert files["/mnt/user-data/uploads/input.txt"].source == "user"
    square = client.containers.files.content.retrieve(
        files["/mnt/data/square.txt"].id, container_id=container.id)
    assert square.read() == b"49"
    client.containers.delete(container.id)


def test_bad_requests_are_refused(client):
    # As OpenAI answers a malformed request: a 400 (they were 422s, which its SDK
    # raises as another error, UnprocessableEntityError).
    with pytest.raises(openai.BadRequestError):
        client.containers.create(name="x", expires_after={"anchor": "last_active_at", "minutes": 241})
    with pytest.raises(openai.BadRequestError):
        client.containers.create(name="x", memory_limit="2g")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.containers.create(name="x", file_ids=["file-doesnotexist"])
    with pytest.raises(openai.NotFoundError):
        client.containers.retrieve("cnt_doesnotexist")


def test_file_ids_are_attached_once_each_and_at_most_fifty(client):
    # 3,000 copies of one 1 MiB id wrote the file 3,000 times (13 s): a repeated
    # id is attached once, so this is one id, well under the cap.
    upload = client.files.create(file=("big.bin", b"x" * (1024 * 1024 - 1024)),
                                 purpose="user_data")
    container = client.containers.create(name="dup", file_ids=[upload.id] * 3000)
    assert [f.path for f in client.containers.files.list(container.id)] == \
        ["/mnt/user-data/uploads/big.bin"]
    client.containers.delete(container.id)
    # 51 distinct ids are refused before any is looked up.
    with pytest.raises(openai.BadRequestError) as refused:
        client.containers.create(name="x", file_ids=[f"file-{i}" for i in range(51)])
    assert refused.value.param == "file_ids" and refused.value.type == "invalid_request_error"
    assert "at most 50" in refused.value.message
    client.files.delete(upload.id)


def test_a_container_name_is_at_most_256_characters(client):
    # A 1 MB name was taken, and then carried by every listing of containers.
    with pytest.raises(openai.BadRequestError) as refused:
        client.containers.create(name="n" * 1_000_000)
    assert refused.value.param == "name" and refused.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.containers.create(name="n" * 257)
    longest = client.containers.create(name="\u00e9" * 256)  # characters, not bytes
    assert longest.name == "\u00e9" * 256
    client.containers.delete(longest.id)


def test_deleting_each_file_while_the_sdk_pages_deletes_them_all(client):
    """The SDK asks for each next page after the last item of the one before; a
    client deleting every item as it goes named a deleted item, which was a 400
    ("no item ... to page after") after the first page."""
    container = client.containers.create(name="emptied")
    made = {client.containers.files.create(container.id, file=(f"f{i}.txt", b"x")).id
            for i in range(7)}
    for order in ("desc", "asc"):
        if order == "asc":
            made = {client.containers.files.create(container.id, file=(f"g{i}.txt", b"y")).id
                    for i in range(7)}
        deleted = set()
        for item in client.containers.files.list(container.id, limit=2, order=order):
            client.containers.files.delete(item.id, container_id=container.id)
            deleted.add(item.id)
        assert deleted == made
        assert list(client.containers.files.list(container.id)) == []

    uploads = {client.files.create(file=(f"u{i}.txt", b"u"), purpose="user_data").id
               for i in range(5)}
    deleted = set()
    for item in client.files.list(limit=2, order="desc"):
        if item.id in uploads:
            client.files.delete(item.id)
            deleted.add(item.id)
    assert deleted == uploads
    client.containers.delete(container.id)
