"""The OpenAI-style HTTP pieces that labkit's servers share (chapters 2 and 5).

``labkit serve`` (:mod:`labkit.engine.server`) and ``labkit gateway``
(:mod:`labkit.gateway.server`) answer errors the way vLLM does, with OpenAI's error object
``{"error": {"message", "type", "param", "code"}}``, and check an API key the way vLLM's
``--api-key`` does: ``Authorization: Bearer KEY`` on the protected routes, while ``/health``
and ``/metrics`` stay open for probes and Prometheus.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

#: The ``type`` the ``openai`` client maps each status to (its ``_exceptions`` module).
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError",
               422: "UnprocessableEntityError", 429: "RateLimitError",
               500: "InternalServerError", 502: "BadGatewayError",
               503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error object for HTTP ``status``; ``param`` names the offending field."""
    return {"error": {"message": _encodable(message), "type": ERROR_TYPES.get(status, "APIError"),
                      "param": None if param is None else _encodable(param), "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """:func:`error_body` as a JSON response with that status."""
    return JSONResponse(status_code=status, content=error_body(status, message, param),
                        headers=headers)


def _encodable(text: str) -> str:
    """``text`` with any lone surrogate escaped: an error may quote the client's input, and
    JSON lets that hold ``"\\ud800"``, which no UTF-8 response can carry."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIKeyAuthentication:
    """vLLM's API-key check: ``Authorization: Bearer KEY`` on every route under one of
    ``protected`` (path prefixes), compared in constant time; 401 otherwise."""

    def __init__(self, app: ASGIApp, api_key: str, protected: Sequence[str] = ("/v1",)) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()
        self.protected = tuple(protected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and scope["path"].startswith(self.protected)):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                refused = error_response(401, "Unauthorized: a valid API key is required "
                                              "(Authorization: Bearer ...)",
                                         headers={"WWW-Authenticate": "Bearer"})
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)
