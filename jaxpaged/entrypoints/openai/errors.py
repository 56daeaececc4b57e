"""OpenAI's error body, and the mapping from every failure we expect to a status other than 500.

Bad input is reported the way the engine already words it: `SamplingParams` and
`LLMEngine.add_request` raise ValueErrors whose first word names the parameter, so the server
reuses their checks instead of repeating them, and only translates the name into the request's field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_FIRST_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class FieldError(ValueError):
    """Bad input whose request field is known (a dotted path such as `response_format.json_schema.schema`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error, with its location as `param` (invalid JSON and non-objects have none)."""
    err = exc.errors(include_url=False)[0]
    loc = _param(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if not loc and err["type"] == "value_error":  # a check across fields: its message starts with the field
        match = _FIRST_WORD.match(msg)
        return bad_request(msg, param=match.group(0) if match else None)
    if err["type"] == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {err.get('ctx', {}).get('error', msg)}", code="invalid_json")
    if err["type"] == "model_type" and not loc:
        return bad_request("The request body must be a JSON object", code="invalid_json")
    if err["type"] == "missing":
        return bad_request(f"Missing required parameter: '{loc}'", param=loc, code="missing_required_parameter")
    return bad_request(f"Invalid value for '{loc}': {msg}" if loc else msg, param=loc or None)


def _param(loc: tuple) -> str:
    """The field a pydantic error points at: `messages.2.role`, or the top-level name (not union branch tags)."""
    if not loc:
        return ""
    if loc[0] == "messages" and len(loc) >= 2 and isinstance(loc[1], int):
        return ".".join(str(part) for part in loc[:3])
    return str(loc[0])


def from_value_error(exc: Exception, fields: Mapping[str, str], default: str | None = None) -> APIError:
    """A ValueError from SamplingParams or the engine; `fields` maps the words they use to request fields."""
    message = str(exc)
    match = _FIRST_WORD.match(message)
    if match and match.group(0) == "structured_outputs" and fields.get("structured_outputs"):
        param = fields["structured_outputs"]  # the engine words it as the offline field: use the request's
        return bad_request(rename_constraint(message, param), param=param)
    param = fields.get(match.group(0), default) if match else default
    return bad_request(message, param=param)


def rename_constraint(message: str, field: str) -> str:
    """An engine message about `structured_outputs.<kind>`, worded with the request's field."""
    return re.sub(r"^structured_outputs(\.\w+)?", field, message, count=1)


def rename_field(message: str, old: str, new: str) -> str:
    """A message that names a request field `old` (as a whole word), worded with `new` instead."""
    return re.sub(rf"(?<![\w.]){re.escape(old)}(?!\w)", new, message)


def model_not_found(name: str, served: list[str]) -> APIError:
    return APIError(
        404, f"The model '{name}' does not exist; this server serves {', '.join(repr(s) for s in served)}",
        param="model", code="model_not_found",
    )


def unauthorized() -> APIError:
    return APIError(401, "Missing or incorrect API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than {limit} bytes", code="request_too_large")


def queue_full(message: str, retry_after: int) -> APIError:
    return APIError(
        503, message, type="server_error", code="queue_full", headers={"Retry-After": str(retry_after)}
    )


def engine_dead(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="engine_dead")


def engine_asleep(message: str, retry_after: int) -> APIError:
    """The engine sleeps between a trainer's rollouts (POST /sleep): requests are refused until POST /wake_up."""
    return APIError(503, message, type="server_error", code="engine_asleep", headers={"Retry-After": str(retry_after)})
