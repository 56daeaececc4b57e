"""Constraints the structured-outputs tests share (offline and over the API): small enough for the tiny cycle model
to finish under them in a few dozen tokens."""

SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "ok", "color"],
    "additionalProperties": False,
}
SCHEMA = {  # ... with an array
    **SMALL_SCHEMA,
    "properties": {**SMALL_SCHEMA["properties"], "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    "required": [*SMALL_SCHEMA["required"], "tags"],
}
REGEX = r"[a-c]{2,4}-\d{1,3}"
CHOICES = ["yes", "no", "maybe é"]
GRAMMAR = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'
