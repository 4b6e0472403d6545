"""What ``/openapi.json`` says about the ``/v1/videos`` routes (:mod:`metainfer_gen.serve.video.routes`): the
request fields of :mod:`metainfer_gen.serve.video.request` (JSON, or a multipart form with an image) and
OpenAI's ``Video`` object, merged by :func:`~metainfer_gen.serve.openapi_docs.install_schema`."""

from __future__ import annotations

from metainfer_gen.serve.openapi_docs import json_body, json_response
from metainfer_gen.serve.video.routes import MAX_LIST

_VIDEO = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "size", "seconds", "prompt"],
          "properties": {"id": {"type": "string"}, "object": {"const": "video"}, "created_at": {"type": "integer"},
                         "status": {"enum": ["queued", "in_progress", "completed", "failed", "cancelled"]},
                         "progress": {"type": ["number", "integer"]}, "model": {"type": "string"},
                         "size": {"type": "string"}, "seconds": {"type": "string"}, "prompt": {"type": "string"},
                         "error": {"type": ["object", "null"]}}}
_MP4 = {"description": "the clip", "content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}}


def _fields(model_name: str) -> dict:
    return {"prompt": {"type": "string", "minLength": 1, "pattern": r"\S"}, "model": {"enum": [model_name]},
            "seconds": {"type": "string", "pattern": r"^\d+(\.\d+)?$"},
            "size": {"type": "string", "pattern": r"^\d{1,6}x\d{1,6}$"},
            "num_frames": {"type": "integer", "minimum": 1}, "width": {"type": "integer", "minimum": 1},
            "height": {"type": "integer", "minimum": 1}, "fps": {"type": "number", "exclusiveMinimum": 0},
            "num_inference_steps": {"type": "integer", "minimum": 1}, "guidance_scale": {"type": "number"},
            "negative_prompt": {"type": "string"}, "seed": {"type": "integer", "minimum": 0},
            "cache": {"type": "string"}, "lora": {"type": "string"}, "lora_weight": {"type": "number"}}


def video_operations(model_name: str) -> dict:
    """``{(path, method): operation fields}`` for the video routes of a server serving ``model_name``."""
    fields = _fields(model_name)
    body = json_body({"type": "object", "required": ["prompt"], "additionalProperties": False, "properties": fields})
    form = {"type": "object", "required": ["prompt"], "additionalProperties": False,
            "properties": {**fields, "input_reference": {"type": "string", "format": "binary"}}}  # typed as in JSON
    body["content"]["multipart/form-data"] = {"schema": form}
    listing = {"type": "object", "required": ["object", "data", "has_more"],
               "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _VIDEO},
                              "has_more": {"type": "boolean"}}}
    deleted = {"type": "object", "required": ["id", "object", "deleted"],
               "properties": {"id": {"type": "string"}, "object": {"const": "video.deleted"},
                              "deleted": {"type": "boolean"}}}
    return {
        ("/v1/videos", "post"): {"requestBody": body, "responses": {"200": json_response(_VIDEO)}},
        ("/v1/videos/sync", "post"): {"requestBody": body, "responses": {"200": _MP4, "409": json_response(
            {"type": "object"}, "the job was cancelled")}},
        ("/v1/videos", "get"): {"responses": {"200": json_response(listing)},
                                "parameters": {"limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIST},
                                               "order": {"enum": ["desc"]}}},
        ("/v1/videos/{video_id}", "get"): {"responses": {"200": json_response(_VIDEO)}},
        ("/v1/videos/{video_id}/content", "get"): {"responses": {"200": _MP4},
                                                   "parameters": {"variant": {"enum": ["video"]}}},
        ("/v1/videos/{video_id}", "delete"): {"responses": {"200": json_response(deleted)}},
    }
