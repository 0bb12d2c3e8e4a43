"""`/openapi.json`: the OpenAPI description of the served endpoints, generated from the pydantic
models (request bodies from `protocol.py` and `responses_protocol.py`, responses from
`response_models.py`), so the document cannot drift from what the router validates and sends."""

from __future__ import annotations

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from disagg.worker.router import response_models as rm
from disagg.worker.router.protocol import ChatCompletionRequest, CompletionRequest
from disagg.worker.router.responses_protocol import ResponsesRequest

_REF = "#/components/schemas/{model}"
# what a generation endpoint may answer besides 200: refusals, auth, capacity, worker failures
_ERRORS = {
    "400": "invalid request (the error's `param` names the field)",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "413": "request body too large (decoded)",
    "415": "Content-Encoding other than gzip, deflate or identity",
    "429": "at capacity",
    "500": "worker failure",
    "503": "no worker available",
    "504": "timed out",
}
_GENERATION = (
    ("/v1/completions", CompletionRequest, rm.Completion, "Text completion"),
    ("/v1/chat/completions", ChatCompletionRequest, rm.ChatCompletion, "Chat completion"),
    ("/v1/responses", ResponsesRequest, rm.ResponseObject, "Response (Responses API)"),
)


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": _REF.format(model=model.__name__)}


def _errors() -> dict:
    return {
        code: {"description": why, "content": {"application/json": {"schema": _ref(rm.ErrorResponse)}}}
        for code, why in _ERRORS.items()
    }


_BOUND_KEYWORDS = {"ge": ("minimum", max), "le": ("maximum", min),
                   "gt": ("exclusiveMinimum", max), "lt": ("exclusiveMaximum", min)}  # fmt: skip


def _json_schema_bounds(node):
    """Bounds that pydantic leaves under their own names (`ge`, `le`: the wire-type range of the
    integers, applied after their strict-integer check) as JSON Schema's, merged with the field's
    own so the document refuses what the validator refuses."""
    if isinstance(node, list):
        return [_json_schema_bounds(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _json_schema_bounds(v) for k, v in node.items() if k not in _BOUND_KEYWORDS}
    for key, (keyword, tighter) in _BOUND_KEYWORDS.items():
        if key in node and isinstance(node[key], int | float):
            out[keyword] = tighter(node[key], out[keyword]) if keyword in out else node[key]
    return out


def openapi_spec(model_name: str | None = None) -> dict:
    """The document; with `model_name`, `model` is documented as the one model this router
    serves (any other is a 404)."""
    # request models as the validator sees them, responses as they are serialized
    requests = [(req, "validation") for _, req, _, _ in _GENERATION]
    responses = [(m, "serialization") for m in (*(resp for _, _, resp, _ in _GENERATION), rm.ModelList, rm.ModelCard,
                                                rm.ErrorResponse)]  # fmt: skip
    _, defs = models_json_schema([*requests, *responses], by_alias=True, ref_template=_REF)
    paths: dict = {}
    for path, req, resp, summary in _GENERATION:
        paths[path] = {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(req)}}},
                "responses": {
                    "200": {
                        "description": "the whole response, or its server-sent events when `stream` is true",
                        "content": {
                            "application/json": {"schema": _ref(resp)},
                            "text/event-stream": {"schema": {"type": "string"}},
                        },
                    },
                    **_errors(),
                },
            }
        }
    paths["/v1/models/{model_id}"] = {
        "get": {
            "summary": "The served model by its id (a 404 naming any other)",
            "parameters": [
                {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
            "responses": {
                "200": {
                    "description": "model",
                    "content": {"application/json": {"schema": _ref(rm.ModelCard)}},
                },
                "401": _errors()["401"],
                "404": _errors()["404"],
            },
        }
    }
    paths["/v1/models"] = {
        "get": {
            "summary": "The served model",
            "responses": {
                "200": {
                    "description": "model list",
                    "content": {"application/json": {"schema": _ref(rm.ModelList)}},
                },
                "401": _errors()["401"],
            },
        }
    }
    schemas = _json_schema_bounds(defs.get("$defs", {}))
    if model_name is not None:
        for _, req, _, _ in _GENERATION:
            schemas[req.__name__]["properties"]["model"] = {"type": "string", "const": model_name}
    return {
        "openapi": "3.1.0",
        "info": {"title": "disagg router", "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas},
    }
