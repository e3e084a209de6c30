"""OpenAI-style API errors: one exception type, one body shape, one status table.

Every error the gateway returns has the body OpenAI clients parse:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": "invalid_value"}}

`ApiError` carries the HTTP status with the body, and optionally a `Retry-After` (seconds)
for 429 and 503. Handlers raise it; the HTTP layer's middleware renders it. Constructors
below name the cases so callers never pick a status and a type by hand.
"""

from __future__ import annotations

import math

import msgspec


class ErrorDetail(msgspec.Struct, kw_only=True, omit_defaults=False):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct, kw_only=True):
    error: ErrorDetail


# status -> OpenAI error `type`. OpenAI uses invalid_request_error for 400/404/413/422.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    415: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An error answered to the client; `status` is the HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        if status not in ERROR_TYPES:
            raise ValueError(f"no OpenAI error type for HTTP status {status}")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        return ERROR_TYPES[self.status]

    def body(self) -> ErrorBody:
        return ErrorBody(error=ErrorDetail(message=self.message, type=self.type,
                                           param=self.param, code=self.code))

    def body_bytes(self) -> bytes:
        return msgspec.json.encode(self.body())

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        # Retry-After takes whole seconds; rounding down to 0 would invite a retry storm.
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def invalid_request(message: str, param: str | None = None,
                    code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported_value")


def authentication_failed(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", param="model",
                    code="model_not_found")


def route_not_found(method: str, path: str) -> ApiError:
    return ApiError(404, f"Unknown request URL: {method} {path}.", code="unknown_url")


def method_not_allowed(method: str, path: str) -> ApiError:
    return ApiError(405, f"Method {method} is not allowed on {path}.", code="method_not_allowed")


def body_too_large(limit_bytes: int) -> ApiError:
    return ApiError(413, f"Request body is larger than the limit of {limit_bytes} bytes.",
                    code="request_too_large")


def unprocessable(message: str, param: str | None = None) -> ApiError:
    return ApiError(422, message, param=param, code="unprocessable_entity")


def rate_limited(message: str, retry_after_s: float, code: str = "rate_limit_exceeded") -> ApiError:
    return ApiError(429, message, code=code, retry_after_s=retry_after_s)


def overloaded(message: str, retry_after_s: float | None = None,
               code: str = "service_unavailable") -> ApiError:
    return ApiError(503, message, code=code, retry_after_s=retry_after_s)


def internal_error() -> ApiError:
    # The detail goes to the log, not to the client.
    return ApiError(500, "The server had an error while processing your request.",
                    code="internal_error")
