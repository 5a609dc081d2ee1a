"""``GET /v1/runtime``: what code in a sandbox can use.

A gateway puts this list into the model's tool description, so the model
writes code against what is installed rather than guessing. The list comes
from the pinned lists (:mod:`shoal.sandbox.catalog`), which are also what
``docs/runtime.md`` is generated from. Commands that this host's build left out
(the heavy document tools are optional) are reported as unavailable.
"""

from __future__ import annotations

import asyncio
import functools

from fastapi import APIRouter, Depends, Request, Response

from shoal.sandbox import catalog
from shoal.sandbox.runtime import python_version

from ._responses import json_response
from .auth import tenant_of
from .schemas import PROTOCOL_ERRORS, RuntimeDescription

router = APIRouter(prefix="/v1/runtime", tags=["runtime"])


@functools.lru_cache(maxsize=4)
def _described(egress: bool, model_api: bool) -> dict:
    return catalog.describe(python_version(), egress=egress, model_api=model_api)


@router.get("", summary="The libraries and commands sandboxes offer",
            responses={**PROTOCOL_ERRORS, 200: {"model": RuntimeDescription,
                                                "description": "The runtime"}})
async def runtime(request: Request, tenant: str = Depends(tenant_of)) -> Response:
    settings = request.app.state.settings
    return json_response(await asyncio.to_thread(
        _described, settings.egress_enabled, settings.model_upstream))
