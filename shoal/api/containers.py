"""The Containers API in OpenAI's shape (``/v1/containers``).

Works with the official ``openai`` package pointed at Shoal: containers are
created, listed with cursor pagination, retrieved and deleted; their files are
uploaded (multipart) or attached from the tenant's Files API by id, listed,
read and deleted. Uploaded and attached files land in
``/mnt/user-data/uploads/``, read-only to the code; files the code writes to
``/mnt/data/`` (the outputs directory, ``/mnt/user-data/outputs/``) appear here
as ``source: assistant``. Ids and paths follow OpenAI's conventions: ``cfile_…``
ids, and outputs under ``/mnt/data/``.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request, Response

from shoal.runs import public_file_id
from shoal.sandbox.files import SandboxPath
from shoal.sandbox.mounts import OPENAI_DATA, OUTPUTS, UPLOADS
from shoal.sessions import ContainerFile, SessionManager
from shoal.sessions.network import (InvalidNetworkPolicy, check_network_policy,
                                    render_network_policy)
from shoal.storage import ContainerRecord

from ._bodies import MAX_CONTAINER_NAME_CHARS, distinct_file_ids, read_json_object
from ._pagination import check_limit, paginate
from ._responses import file_response, json_response
from ._uploads import read_upload, upload_file_name
from .auth import tenant_of
from .errors import ERROR_RESPONSES, BadRequest
from .schemas import (BINARY, CONTAINERS_ERRORS, AttachFile, Container, ContainerDeleted,
                      ContainerFileDeleted, ContainerFileList, ContainerFileObject, ContainerList,
                      ContainerUpload, CreateContainer, request_body)

router = APIRouter(prefix="/v1/containers", tags=["containers"], responses=ERROR_RESPONSES)


def _manager(request: Request) -> SessionManager:
    return request.app.state.manager


def render_container(record: ContainerRecord, egress_allow: str) -> dict:
    return {
        "id": record.id,
        "object": "container",
        "created_at": int(record.created_at),
        "status": record.status,
        "expires_after": {"anchor": "last_active_at", "minutes": record.expires_after_minutes},
        "last_active_at": int(record.last_active_at),
        "expires_at": int(record.expires_at),
        "memory_limit": record.memory_limit,
        # OpenAI's name is always a string; a container made implicitly (by a run,
        # a gateway request, a v1 session) has none of its own and goes by its id.
        "name": record.name if record.name is not None else record.id,
        "implicit": record.implicit,
        # Never a domain secret's value; no policy: what the operator allows.
        "network_policy": render_network_policy(record, egress_allow),
    }


def openai_path(sandbox_path: str) -> str:
    """Outputs as the code interpreter names them (``/mnt/data`` is the outputs
    directory inside every sandbox); anything else by its own sandbox path."""
    if sandbox_path.startswith(OUTPUTS + "/"):
        return OPENAI_DATA + sandbox_path[len(OUTPUTS):]
    return sandbox_path


def file_id_of(public_id: str) -> str:
    """The file store's id behind an OpenAI ``cfile_…`` id (the bare id works too)."""
    return public_id[len("cfile_"):] if public_id.startswith("cfile_") else public_id


def render_file(item: ContainerFile, container_id: str) -> dict:
    return {
        "id": public_file_id(item),
        "object": "container.file",
        "created_at": int(item.record.created_at),
        "bytes": item.record.size,
        "container_id": container_id,
        "path": openai_path(item.path),
        "source": item.record.source,
    }


def _list_body(data: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def _ordered(items: list, order: str) -> list:
    if order not in ("asc", "desc"):
        raise BadRequest(400, "order must be 'asc' or 'desc'")
    return list(reversed(items)) if order == "desc" else items


# -- containers -------------------------------------------------------------------------------
@router.post("", summary="Create a container",
             responses={**CONTAINERS_ERRORS,
                        200: {"model": Container, "description": "The container"}},
             openapi_extra=request_body(json=CreateContainer, required=False))
async def create_container(request: Request, tenant: str = Depends(tenant_of)) -> Response:
    manager = _manager(request)
    body = await read_json_object(request, required=False)
    name = body.get("name")  # optional in Caronte's API; OpenAI's SDK always sends one
    if name is not None and not isinstance(name, str):
        raise BadRequest(422, "name must be a string", param="name")
    if name is not None and len(name) > MAX_CONTAINER_NAME_CHARS:
        raise BadRequest(400, f"name is {len(name)} characters long; at most "
                              f"{MAX_CONTAINER_NAME_CHARS}", param="name")
    expires_after = body.get("expires_after") or {}
    if not isinstance(expires_after, dict):
        raise BadRequest(422, "expires_after must be an object")
    anchor = expires_after.get("anchor", "last_active_at")
    if anchor != "last_active_at":
        raise BadRequest(422, "expires_after.anchor must be 'last_active_at'")
    file_ids = body.get("file_ids") or []
    if not isinstance(file_ids, list) or not all(isinstance(f, str) for f in file_ids):
        raise BadRequest(422, "file_ids must be a list of file ids")
    file_ids = distinct_file_ids(file_ids)
    try:
        policy = check_network_policy(body.get("network_policy"))
    except InvalidNetworkPolicy as exc:
        raise BadRequest(400, str(exc), param="network_policy") from None
    memory_limit = manager.containers.check_memory_limit(body.get("memory_limit"))
    uploads = [await manager.uploads.get(tenant, file_id) for file_id in file_ids]
    record = await manager.containers.create(tenant, name=name,
                                             minutes=expires_after.get("minutes"),
                                             memory_limit=memory_limit, network_policy=policy)
    for upload in uploads:
        await _attach_upload(manager, tenant, record, upload.id)
    return json_response(render_container(record, manager.settings.egress_allow))


@router.get("", summary="List containers",
            responses={**CONTAINERS_ERRORS,
                       200: {"model": ContainerList, "description": "A page of containers"}})
async def list_containers(request: Request, limit: int = Query(20), after: str | None = Query(None),
                          order: str = Query("desc"), name: str | None = Query(None),
                          tenant: str = Depends(tenant_of)) -> Response:
    check_limit(limit, 100)
    records = await _manager(request).containers.list(tenant)
    if name is not None:
        records = [record for record in records if record.name == name]
    records = _ordered(records, order)
    page = paginate(records, lambda r: r.id, limit, after)
    egress_allow = _manager(request).settings.egress_allow
    return json_response(_list_body([render_container(r, egress_allow) for r in page.items],
                                    page.has_more))


@router.get("/{container_id}", summary="Retrieve a container",
            responses={**CONTAINERS_ERRORS,
                       200: {"model": Container, "description": "The container"}})
async def get_container(container_id: str, request: Request,
                        tenant: str = Depends(tenant_of)) -> Response:
    manager = _manager(request)
    return json_response(render_container(await manager.containers.get(tenant, container_id),
                                          manager.settings.egress_allow))


@router.delete("/{container_id}", summary="Delete a container and its files",
               responses={**CONTAINERS_ERRORS,
                          200: {"model": ContainerDeleted, "description": "Deleted"}})
async def delete_container(container_id: str, request: Request,
                           tenant: str = Depends(tenant_of)) -> Response:
    await _manager(request).containers.delete(tenant, container_id)
    return json_response({"id": container_id, "object": "container.deleted", "deleted": True})


# -- container files ----------------------------------------------------------------------------
async def _attach_upload(manager: SessionManager, tenant: str, record: ContainerRecord,
                         file_id: str) -> ContainerFile:
    upload, handle, _ = await manager.uploads.open(tenant, file_id)
    return await manager.container_files.attach_upload(record, upload, handle)


@router.post("/{container_id}/files", summary="Upload or attach a file",
             responses={**CONTAINERS_ERRORS,
                        200: {"model": ContainerFileObject, "description": "The file"}},
             openapi_extra=request_body(multipart=ContainerUpload, json=AttachFile))
async def create_file(container_id: str, request: Request,
                      tenant: str = Depends(tenant_of)) -> Response:
    manager = _manager(request)
    record = await manager.containers.get(tenant, container_id)
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        upload, _ = await read_upload(request, manager.settings.max_file_bytes, too_large=400)
        try:
            name = upload_file_name(upload.filename)
            item = await manager.container_files.put(record, SandboxPath(UPLOADS, (name,)),
                                                     upload.file)
        finally:
            await upload.close()
    else:
        body = await read_json_object(request, required=False)
        file_id = body.get("file_id")
        if not isinstance(file_id, str) or not file_id:
            raise BadRequest(422, "send a multipart 'file' or JSON {\"file_id\": ...}")
        item = await _attach_upload(manager, tenant, record, file_id)
    return json_response(render_file(item, container_id))


@router.get("/{container_id}/files", summary="List a container's files",
            responses={**CONTAINERS_ERRORS,
                       200: {"model": ContainerFileList, "description": "A page of files"}})
async def list_files(container_id: str, request: Request, limit: int = Query(20),
                     after: str | None = Query(None), order: str = Query("desc"),
                     tenant: str = Depends(tenant_of)) -> Response:
    check_limit(limit, 100)
    manager = _manager(request)
    record = await manager.containers.get(tenant, container_id)
    items = _ordered(await manager.container_files.list(record), order)
    page = paginate(items, public_file_id, limit, after and "cfile_" + file_id_of(after),
                    order_of=lambda item: (item.record.created_at, item.path),
                    deleted=lambda cursor: manager.container_files.deleted_place(
                        record, file_id_of(cursor)),
                    descending=order == "desc")
    return json_response(_list_body([render_file(i, container_id) for i in page.items],
                                    page.has_more))


@router.get("/{container_id}/files/{file_id}", summary="Retrieve a container file",
            responses={**CONTAINERS_ERRORS,
                       200: {"model": ContainerFileObject, "description": "The file"}})
async def get_file(container_id: str, file_id: str, request: Request,
                   tenant: str = Depends(tenant_of)) -> Response:
    manager = _manager(request)
    record = await manager.containers.get(tenant, container_id)
    return json_response(render_file(await manager.container_files.get(record, file_id_of(file_id)),
                                     container_id))


@router.get("/{container_id}/files/{file_id}/content", summary="Download a container file",
            response_class=Response,
            responses={**CONTAINERS_ERRORS, 200: {
                "content": BINARY, "description": "The file's bytes, typed by its MIME type"}})
async def get_file_content(container_id: str, file_id: str, request: Request,
                           tenant: str = Depends(tenant_of)) -> Response:
    manager = _manager(request)
    record = await manager.containers.get(tenant, container_id)
    item, handle, size = await manager.container_files.open(record, file_id_of(file_id))
    return await file_response(handle, size, item.filename, item.mime_type)


@router.delete("/{container_id}/files/{file_id}", summary="Delete a container file",
               responses={**CONTAINERS_ERRORS,
                          200: {"model": ContainerFileDeleted, "description": "Deleted"}})
async def delete_file(container_id: str, file_id: str, request: Request,
                      tenant: str = Depends(tenant_of)) -> Response:
    manager = _manager(request)
    record = await manager.containers.get(tenant, container_id)
    item = await manager.container_files.delete(record, file_id_of(file_id))
    return json_response({"id": public_file_id(item), "object": "container.file.deleted",
                          "deleted": True})
