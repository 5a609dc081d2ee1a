"""The Files API (``/v1/files``), in two scopes.

With ``scope_id`` it is Zylon's container Files API: keys in a container,
uploads read-only to the code, outputs downloadable, ids that are the base64url
of the sandbox path. Without it, it is a tenant's own uploads, in OpenAI's
shape or, when the client speaks Anthropic (an ``anthropic-version`` header),
in Anthropic's; those files are attached to containers by id.
"""

from __future__ import annotations

import tempfile
from datetime import datetime, timezone

from fastapi import APIRouter, Depends, Query, Request, Response
from starlette.requests import ClientDisconnect

from shoal.sessions import (ContainerFile, InvalidKey, SessionManager, parse_scoped_file_id,
                            path_for_key, scoped_file_id)
from shoal.storage import ContainerRecord, UploadRecord

from ._pagination import check_limit, paginate
from ._responses import file_response, header_safe, json_response
from ._uploads import read_upload, upload_file_name
from .auth import tenant_of
from .errors import ERROR_RESPONSES, BadRequest
from .schemas import (BINARY, FILES_ERRORS, AnthropicFile, AnthropicFileList, FileDeleted,
                      FilesUpload, OpenAIFile, OpenAIFileDeleted, OpenAIFileList, PrefixDeleted,
                      ScopedFile, ScopedFileList, request_body)

# The purposes OpenAI accepts for an upload (and its SDK can read back).
PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data")

router = APIRouter(prefix="/v1/files", tags=["files"], responses=ERROR_RESPONSES)


def _manager(request: Request) -> SessionManager:
    return request.app.state.manager


def rfc3339(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat().replace("+00:00", "Z")


def _anthropic(request: Request) -> bool:
    return "anthropic-version" in request.headers


async def _container(request: Request, tenant: str, scope_id: str, create: bool) -> ContainerRecord:
    containers = _manager(request).containers
    if create:
        return await containers.get_or_create(tenant, scope_id)
    return await containers.get(tenant, scope_id)


def render_container_file(item: ContainerFile, scope_id: str) -> dict:
    return {
        "id": item.id,
        "type": "file",
        "filename": item.filename,
        "mime_type": item.mime_type,
        "size_bytes": item.record.size,
        "created_at": rfc3339(item.record.created_at),
        "downloadable": item.downloadable,
        "etag": item.record.etag,
        "namespace": "session",
        "scope": {"id": scope_id, "type": "session"},
        "key": item.key,
        "path": item.path,
    }


def render_scoped(item: ContainerFile, container_id: str) -> dict:
    """A container's file in the tenant Files API (Anthropic's FileMetadata)."""
    return {"id": scoped_file_id(container_id, item.path), "type": "file",
            "filename": item.filename, "mime_type": item.mime_type, "size_bytes": item.record.size,
            "created_at": rfc3339(item.record.created_at), "downloadable": True,
            "scope": {"id": container_id, "type": "session"}}


async def _scoped(request: Request, tenant: str, file_id: str):
    """(container record, file id within it) for a container file named without
    its container, or None for an ordinary upload id."""
    found = parse_scoped_file_id(file_id)
    if found is None:
        return None
    container_id, inner = found
    return await _container(request, tenant, container_id, create=False), inner


def render_upload(record: UploadRecord, anthropic: bool) -> dict:
    if anthropic:
        return {"id": record.id, "type": "file", "filename": record.filename,
                "mime_type": record.mime_type, "size_bytes": record.size,
                "created_at": rfc3339(record.created_at), "downloadable": False}
    return {"id": record.id, "object": "file", "bytes": record.size,
            "created_at": int(record.created_at), "filename": record.filename,
            "purpose": record.purpose or "user_data", "status": "processed",
            "expires_at": None, "status_details": None}


# -- upload ---------------------------------------------------------------------------------
@router.post("", status_code=201, summary="Upload a file (to a container with scope_id)",
             responses={**FILES_ERRORS,
                        201: {"model": ScopedFile, "description": "With scope_id: the file, "
                                                                  "in the container"},
                        200: {"model": OpenAIFile | AnthropicFile,
                              "description": "Without scope_id: the tenant's upload (Anthropic's "
                                             "shape with anthropic-version)"}},
             openapi_extra=request_body(multipart=FilesUpload))
async def upload(request: Request, scope_id: str | None = Query(None),
                 path: str | None = Query(None), tenant: str = Depends(tenant_of)) -> Response:
    manager = _manager(request)
    # Caronte's (OpenAI's) tenant uploads refuse an oversized file with a 400.
    openai = scope_id is None and not _anthropic(request)
    upload_file, fields = await read_upload(request, manager.settings.max_file_bytes,
                                            too_large=400 if openai else 413)
    try:
        if scope_id is None:
            purpose = fields.get("purpose")
            if purpose is not None and not _anthropic(request) and purpose not in PURPOSES:
                raise BadRequest(400, f"purpose must be one of {', '.join(PURPOSES)}",
                                 param="purpose")
            record = await manager.uploads.create(tenant, upload_file_name(upload_file.filename),
                                                  upload_file.file, purpose)
            # OpenAI answers a created file with 200; so do we, for its SDK.
            return json_response(render_upload(record, _anthropic(request)), 200)
        key = path or fields.get("path") or upload_file_name(upload_file.filename)
        item = await put_scoped(request, tenant, scope_id, key, upload_file.file)
    finally:
        await upload_file.close()
    return json_response(render_container_file(item, scope_id), 201)


async def put_scoped(request: Request, tenant: str, scope_id: str, key: str,
                     source) -> ContainerFile:
    """Zylon's upload: ``key`` under the container's uploads, the container made if new."""
    target = path_for_key(key)
    container = await _container(request, tenant, scope_id, create=True)
    return await _manager(request).container_files.put(container, target, source)


async def put_scoped_body(request: Request, tenant: str, scope_id: str, key: str) -> ContainerFile:
    """Zylon's raw put: the request's body, capped while it streams in, at ``key``."""
    limit = _manager(request).settings.max_file_bytes
    path_for_key(key)  # a bad key is refused before the body is read
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(413, f"body is larger than the {limit}-byte cap")
    with tempfile.SpooledTemporaryFile(max_size=1024 * 1024) as spool:
        received = 0
        try:
            async for chunk in request.stream():
                received += len(chunk)
                if received > limit:
                    raise BadRequest(413, f"body is larger than the {limit}-byte cap")
                spool.write(chunk)
        except ClientDisconnect:
            # The client's mistake, as a broken multipart upload is (read_upload):
            # a 4xx nobody will read, and nothing stored, since the spool is dropped.
            raise BadRequest(400, "the client hung up before the body was complete") from None
        spool.seek(0)
        return await put_scoped(request, tenant, scope_id, key, spool)


@router.put("/{key:path}", status_code=201, summary="Put raw bytes at a key in a container",
            responses={**FILES_ERRORS,
                       201: {"model": ScopedFile, "description": "The file, in the container"}},
            openapi_extra=request_body(binary=True, description="The file's bytes, of any type"))
async def put_key(key: str, request: Request, scope_id: str = Query(...),
                  tenant: str = Depends(tenant_of)) -> Response:
    item = await put_scoped_body(request, tenant, scope_id, key)
    return json_response(render_container_file(item, scope_id), 201)


# -- list ------------------------------------------------------------------------------------
@router.get("", summary="List files",
            responses={**FILES_ERRORS, 200: {
                "model": ScopedFileList | OpenAIFileList | AnthropicFileList,
                "description": "A container's files (scope_id), or the tenant's uploads"}})
async def list_files(request: Request, scope_id: str | None = Query(None),
                     limit: int = Query(20), after_id: str | None = Query(None),
                     before_id: str | None = Query(None), after: str | None = Query(None),
                     page: str | None = Query(None), prefix: str | None = Query(None),
                     purpose: str | None = Query(None), order: str | None = Query(None),
                     tenant: str = Depends(tenant_of)) -> Response:
    manager = _manager(request)
    # after (OpenAI), after_id (Anthropic before 1.0) and page (Anthropic's cursor)
    # all continue after the same item.
    after_id = after_id or after or page
    if scope_id is None:
        anthropic = _anthropic(request)
        check_limit(limit, 1000 if anthropic else 10_000)
        uploads = await manager.uploads.list(tenant)
        ids = request.query_params.getlist("ids[]") + request.query_params.getlist("ids")
        if ids:
            uploads = [record for record in uploads if record.id in set(ids)]
        if purpose is not None:
            uploads = [record for record in uploads if (record.purpose or "user_data") == purpose]
        if order not in (None, "asc", "desc"):
            raise BadRequest(400, "order must be 'asc' or 'desc'", param="order")
        if order == "desc":
            uploads = list(reversed(uploads))
        listed = paginate(uploads, lambda r: r.id, limit, after_id, before_id,
                          order_of=lambda r: (r.created_at, r.id),
                          deleted=lambda cursor: manager.uploads.deleted_place(tenant, cursor),
                          descending=order == "desc")
        data = [render_upload(r, anthropic) for r in listed.items]
        body = {"data": data, "has_more": listed.has_more,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None}
        if anthropic:
            # The SDK pages with this cursor (it reads nothing else); null on the last page.
            body["next_page"] = body["last_id"] if listed.has_more and not before_id else None
        else:
            body["object"] = "list"
        return json_response(body)
    check_limit(limit, 1000)
    container = await _container(request, tenant, scope_id, create=False)
    items = await manager.container_files.list(container)
    if prefix:
        items = [item for item in items if item.key.startswith(prefix)]
    page = paginate(items, lambda item: item.id, limit, after_id, before_id,
                    order_of=lambda item: (item.record.created_at, item.path),
                    deleted=lambda cursor: manager.container_files.deleted_place(container,
                                                                                 cursor))
    data = [render_container_file(item, scope_id) for item in page.items]
    return json_response({"data": data, "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None,
                          "has_more": page.has_more})


# -- one file --------------------------------------------------------------------------------
@router.get("/{file_id}", summary="File metadata",
            responses={**FILES_ERRORS, 200: {
                "model": ScopedFile | OpenAIFile | AnthropicFile,
                "description": "A container's file (scope_id, or a scoped id), or an upload"}})
async def get_file(file_id: str, request: Request, scope_id: str | None = Query(None),
                   tenant: str = Depends(tenant_of)) -> Response:
    manager = _manager(request)
    if scope_id is None:
        scoped = await _scoped(request, tenant, file_id)
        if scoped is not None:
            container, inner = scoped
            item = await manager.container_files.get(container, inner)
            return json_response(render_scoped(item, container.id))
        record = await manager.uploads.get(tenant, file_id)
        return json_response(render_upload(record, _anthropic(request)))
    container = await _container(request, tenant, scope_id, create=False)
    item = await manager.container_files.get(container, file_id)
    return json_response(render_container_file(item, scope_id))


@router.head("/{file_id}", summary="Whether a file exists, its metadata in X-File-* headers",
             response_class=Response,
             responses={**FILES_ERRORS, 200: {"description": "The file exists", "headers": {
                 name: {"schema": {"type": "string"}} for name in (
                     "X-File-Id", "X-File-Name", "X-File-Size", "X-File-Mime-Type",
                     "X-File-Created-At", "X-File-Downloadable", "X-File-Etag")}}})
async def head_file(file_id: str, request: Request, scope_id: str = Query(...),
                    tenant: str = Depends(tenant_of)) -> Response:
    manager = _manager(request)
    container = await _container(request, tenant, scope_id, create=False)
    item = await manager.container_files.get(container, file_id)
    return Response(status_code=200, headers={
        "X-File-Id": item.id,
        "X-File-Name": header_safe(item.filename),
        "X-File-Size": str(item.record.size),
        "X-File-Mime-Type": item.mime_type,
        "X-File-Created-At": rfc3339(item.record.created_at),
        "X-File-Downloadable": "true" if item.downloadable else "false",
        "X-File-Etag": item.record.etag or "",
    })


@router.get("/{file_id}/content", summary="Download a file", response_class=Response,
            responses={**FILES_ERRORS, 200: {
                "content": BINARY, "description": "The file's bytes, typed by its MIME type"}})
async def download(file_id: str, request: Request, scope_id: str | None = Query(None),
                   disposition: str = Query("attachment", pattern="^(attachment|inline)$"),
                   tenant: str = Depends(tenant_of)) -> Response:
    manager = _manager(request)
    inline = disposition == "inline"
    if scope_id is None:
        scoped = await _scoped(request, tenant, file_id)
        if scoped is not None:
            container, inner = scoped
            item, handle, size = await manager.container_files.open(container, inner)
            return await file_response(handle, size, item.filename, item.mime_type, inline)
        record, handle, size = await manager.uploads.open(tenant, file_id)
        return await file_response(handle, size, record.filename, record.mime_type, inline)
    return await download_scoped(request, tenant, scope_id, file_id, inline)


async def download_scoped(request: Request, tenant: str, scope_id: str, file_id: str,
                          inline: bool = False, refusal=lambda item: None) -> Response:
    """A container file's bytes, unless ``refusal(item)`` names why not (a 403)."""
    container = await _container(request, tenant, scope_id, create=False)
    item, handle, size = await _manager(request).container_files.open(container, file_id)
    reason = refusal(item)
    if reason is not None:
        handle.close()
        raise BadRequest(403, reason)
    return await file_response(handle, size, item.filename, item.mime_type, inline)


@router.delete("/{file_id}", summary="Delete one file",
               responses={**FILES_ERRORS, 200: {
                   "model": FileDeleted | OpenAIFileDeleted,
                   "description": "Deleted (OpenAI's shape for an OpenAI client's upload)"}})
async def delete_file(file_id: str, request: Request, scope_id: str | None = Query(None),
                      tenant: str = Depends(tenant_of)) -> Response:
    manager = _manager(request)
    if scope_id is None:
        scoped = await _scoped(request, tenant, file_id)
        if scoped is not None:
            container, inner = scoped
            await manager.container_files.delete(container, inner)
            return json_response({"id": file_id, "type": "file_deleted"})
        record = await manager.uploads.delete(tenant, file_id)
        if _anthropic(request):
            return json_response({"id": record.id, "type": "file_deleted"})
        return json_response({"id": record.id, "object": "file", "deleted": True})
    container = await _container(request, tenant, scope_id, create=False)
    item = await manager.container_files.delete(container, file_id)
    return json_response({"id": item.id, "type": "file_deleted"})


@router.delete("", summary="Delete every file under a key prefix",
               responses={**FILES_ERRORS, 200: {"model": PrefixDeleted,
                                                "description": "How many were deleted"}})
async def delete_prefix(request: Request, scope_id: str = Query(...), prefix: str = Query(...),
                        tenant: str = Depends(tenant_of)) -> Response:
    if not prefix:
        raise InvalidKey("prefix must not be empty")
    container = await _container(request, tenant, scope_id, create=False)
    count = await _manager(request).container_files.delete_prefix(container, prefix)
    return json_response({"prefix": prefix, "deleted_count": count, "type": "prefix_deleted"})
