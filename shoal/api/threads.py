"""Zylon's Workspace thread endpoints: a chat thread's files, the thread being the container.

Three routes on top of the container Files API (:mod:`shoal.api.files`), under
the paths Zylon's Workspace clients call:

- ``POST /api/v1/app/thread/{threadId}/upload-file``: multipart ``file``, optional
  ``path``; it lands under ``/mnt/user-data/uploads/``;
- ``PUT /api/v1/app/thread/{threadId}/put-file/{path}``: raw bytes at a key;
- ``GET /api/v1/app/thread/{threadId}/download-file?path=``: a file by its sandbox
  path.

Zylon's note on downloads is the operator's to set: generated files (outputs)
need ``--download-generated``, uploaded ones ``--download-uploaded`` (both on by
default); a refused download is a 403.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request, Response

from shoal.sandbox import encode_file_id
from shoal.sandbox.mounts import OUTPUTS, UPLOADS

from ._responses import json_response
from ._uploads import read_upload, upload_file_name
from .auth import tenant_of
from .errors import ERROR_RESPONSES, BadRequest
from .files import download_scoped, put_scoped, put_scoped_body, render_container_file
from .schemas import BINARY, PROTOCOL_ERRORS, FilesUpload, ScopedFile, request_body

# Zylon's own paths, outside /api/gpt: errors in the protocol's {detail} shape.
router = APIRouter(prefix="/api/v1/app/thread", tags=["threads"], responses=ERROR_RESPONSES)
_FILE = {**PROTOCOL_ERRORS, 201: {"model": ScopedFile, "description": "The file, in the thread"}}


@router.post("/{thread_id}/upload-file", status_code=201, summary="Upload a file to a thread",
             responses=_FILE, openapi_extra=request_body(multipart=FilesUpload))
async def upload_file(thread_id: str, request: Request, tenant: str = Depends(tenant_of)) -> Response:
    upload, fields = await read_upload(request, request.app.state.settings.max_file_bytes)
    try:
        key = fields.get("path") or upload_file_name(upload.filename)
        item = await put_scoped(request, tenant, thread_id, key, upload.file)
    finally:
        await upload.close()
    return json_response(render_container_file(item, thread_id), 201)


@router.put("/{thread_id}/put-file/{path:path}", status_code=201,
            summary="Put raw bytes at a key of a thread", responses=_FILE,
            openapi_extra=request_body(binary=True, description="The file's bytes"))
async def put_file(thread_id: str, path: str, request: Request,
                   tenant: str = Depends(tenant_of)) -> Response:
    item = await put_scoped_body(request, tenant, thread_id, path)
    return json_response(render_container_file(item, thread_id), 201)


@router.get("/{thread_id}/download-file", summary="Download a thread's file by sandbox path",
            response_class=Response,
            responses={**PROTOCOL_ERRORS, 200: {"content": BINARY, "description": "The bytes"}})
async def download_file(thread_id: str, request: Request, path: str = Query(...),
                        tenant: str = Depends(tenant_of)) -> Response:
    settings = request.app.state.settings
    if not path.startswith("/"):
        raise BadRequest(400, "path must be an absolute sandbox path, e.g. "
                              f"{OUTPUTS}/chart.png")

    def refusal(item) -> str | None:
        if item.path.startswith(OUTPUTS + "/") and not settings.download_generated:
            return "downloads of generated files are disabled on this server"
        if item.path.startswith(UPLOADS + "/") and not settings.download_uploaded:
            return "downloads of uploaded files are disabled on this server"
        return None

    return await download_scoped(request, tenant, thread_id, encode_file_id(path),
                                 refusal=refusal)
