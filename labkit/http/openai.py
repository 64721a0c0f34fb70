"""OpenAI's error object and vLLM's API-key check, shared by labkit's servers (chapters 2, 5).

``labkit serve`` (:mod:`labkit.engine.server`) and ``labkit gateway``
(:mod:`labkit.gateway.server`) answer errors the way vLLM does, with OpenAI's error object
``{"error": {"message", "type", "param", "code"}}``: an :class:`APIError` raised in a route,
a :class:`~labkit.checks.ParameterError` from any labkit function, a request that fails
validation and an HTTP error of the framework all leave as that object
(:func:`add_error_handlers`). An API key is checked the way vLLM's ``--api-key`` does:
``Authorization: Bearer KEY`` on the protected routes, while ``/health`` and ``/metrics`` stay
open for probes and Prometheus.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from labkit.checks import ParameterError

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


class APIError(Exception):
    """An error a server answers itself with HTTP ``status`` and OpenAI's error object;
    ``param`` names the offending request field, ``headers`` go with the response (a 413's
    limit, a 503's ``Retry-After``)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


#: Where FastAPI says a bad value came from: the first item of a validation error's ``loc``.
_REQUEST_PARTS = ("body", "query", "path", "header", "cookie")


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    """A 400 for the first problem FastAPI found: ``param`` is the top-level field
    (``messages`` for ``body.messages.0.content``), the message says where inside it."""
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {first['msg']}")
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] in _REQUEST_PARTS:
        loc = loc[1:]
    where = ".".join(loc) or "body"
    return error_response(400, f"{where}: {first['msg']}", loc[0] if loc else None)


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` with OpenAI's error object: :class:`APIError` with its
    status, :class:`~labkit.checks.ParameterError` as a 400 naming its parameter, validation
    failures as a 400 (:func:`validation_error_response`), and the framework's own HTTP errors
    (404, 405 with its ``Allow`` header) with their status."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(ParameterError)
    async def _bad_parameter(_: Request, exc: ParameterError):
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return validation_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        # Its headers too: a 405 must say which methods are allowed (``Allow``, RFC 9110).
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)


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
