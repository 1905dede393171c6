"""OpenAI-compatible routes under /v1 (SPEC 6): chat completions, completions, embeddings, models."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from localrt.errors import ModelNotFound
from localrt.store.names import parse_name

router = APIRouter(prefix="/v1")


def model_object(display: str, created: float, owner: str) -> dict[str, Any]:
    return {"id": display, "object": "model", "created": int(created), "owned_by": owner}


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    entries = request.app.state.store.list_models()
    return {"object": "list",
            "data": [model_object(e.name.display, e.modified, e.name.namespace) for e in entries]}


@router.get("/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> dict[str, Any]:
    wanted = parse_name(model_id)
    for entry in request.app.state.store.list_models():
        if entry.name.same_model(wanted):
            return model_object(entry.name.display, entry.modified, entry.name.namespace)
    raise ModelNotFound(f"model '{model_id}' not found")
