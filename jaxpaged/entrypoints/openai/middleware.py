"""Plain ASGI middleware: the API key and the body-size limit act before any route runs."""

from __future__ import annotations

import hmac

from jaxpaged.entrypoints.openai import errors

OPEN_PATHS = ("/health", "/ping", "/version")  # probes: vLLM leaves them open too


async def _send_error(send, error: errors.APIError) -> None:
    response = error.response()
    await response({"type": "http"}, _no_receive, send)


async def _no_receive():
    return {"type": "http.disconnect"}


class APIKeyMiddleware:
    """Every route except the probes (OPEN_PATHS) needs `Authorization: Bearer <key>`, or Anthropic's `x-api-key:
    <key>` (what its clients send), compared in constant time."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.bearer, self.key = f"Bearer {api_key}".encode(), api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        bearer_ok = hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
        key_ok = hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)
        if not (bearer_ok or key_ok):
            if scope["path"].startswith("/v1/messages"):  # an Anthropic client reads Anthropic's error shape
                from jaxpaged.entrypoints.openai.anthropic import error_response

                return await error_response(errors.unauthorized())({"type": "http"}, _no_receive, send)
            return await _send_error(send, errors.unauthorized())
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse bodies over `limit` bytes with 413, whether Content-Length says so or the chunks add up to it.

    The body is read here (at most limit + 1 bytes) and replayed to the app; after it, `receive`
    passes through, so the app still hears about a client that disconnects.
    """

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _send_error(send, errors.too_large(self.limit))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # gone before the body arrived
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                return await _send_error(send, errors.too_large(self.limit))
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
