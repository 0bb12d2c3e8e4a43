"""The tool-call argument schema the API tests (chat tools, /v1/responses) ask the model to fill."""

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
