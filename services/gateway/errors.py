"""OpenAI-style errors: every failure the gateway answers is `{"error": {message, type, param, code}}`."""

from aiohttp import web


class ApiError(Exception):
    """A request the gateway refuses; the middleware turns it into a JSON error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unknown_model(model: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist. This server serves {served}.",
        param="model",
        code="model_not_found",
    )


def internal_error() -> ApiError:
    """A bug in the gateway (logged with the request's id): retrying will not help."""
    return ApiError(500, "internal server error", error_type="server_error", code="internal_error")


def unknown_request(request_id: str) -> ApiError:
    message = f"No request with id `{request_id}` (unknown or expired)."
    return ApiError(404, message, param="id", code="request_not_found")


class ServiceUnavailable(ApiError):
    """Redis does not answer (down, restarting, or too slow): the client should retry."""

    def __init__(self, detail: str = "") -> None:
        message = "service unavailable, retry" + (f" ({detail})" if detail else "")
        super().__init__(
            503, message, error_type="service_unavailable", code="service_unavailable", headers={"Retry-After": "1"}
        )
