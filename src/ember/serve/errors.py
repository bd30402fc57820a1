"""Errors as OpenAI sends them: a status code and `{"error": {"message", "type", "param", "code"}}`.

Routes raise `APIError`; the app's handlers turn it, pydantic's validation errors, unknown routes and
unexpected exceptions into that body, so a client never sees FastAPI's own `{"detail": ...}` shape.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ember.serve.protocol import ErrorDetail, ErrorResponse, UnsupportedParameterError

# OpenAI's error types by status code.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorDetail(
                message=self.message,
                type=_TYPES.get(self.status, "invalid_request_error"),
                param=self.param,
                code=self.code,
            )
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def _path(loc: tuple) -> list[str]:
    # pydantic puts the tried union member into the location (`stop.list[str].0`): drop those tags.
    return [str(p) for p in loc if isinstance(p, int) or ("[" not in str(p) and p not in ("str", "int"))]


def from_validation_error(e: ValidationError) -> APIError:
    """The first problem of a request body as a 400, naming the parameter."""
    errors = e.errors()
    # A union reports one error per member (`content` is not a string; its part 0 is not text): the deepest
    # error under the first one's location says what is wrong most precisely.
    head = _path(errors[0]["loc"])
    err = max((x for x in errors if _path(x["loc"])[: len(head)] == head), key=lambda x: len(_path(x["loc"])))
    cause = (err.get("ctx") or {}).get("error")
    path = _path(err["loc"])
    if isinstance(cause, UnsupportedParameterError):
        # Raised by the model that holds the field: `messages.1` + `tool_calls`.
        param = ".".join([*path, cause.param])
        return APIError(
            400,
            f"{param} is not supported by Ember; leave it unset",
            param=param,
            code="unsupported_parameter",
        )
    param = ".".join(path) or None
    if err["type"] == "extra_forbidden":
        return APIError(
            400,
            f"unknown parameter {param!r}; Ember does not implement it",
            param=param,
            code="unknown_parameter",
        )
    if err["type"] == "missing":
        return APIError(
            400, f"missing required parameter {param!r}", param=param, code="missing_required_parameter"
        )
    got = repr(err.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    where = f"{param}: " if param else ""
    return APIError(400, f"{where}{err['msg']} (got {got})", param=param, code="invalid_value")
