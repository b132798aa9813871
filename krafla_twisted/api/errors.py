"""Errors in the OpenAI API's shape: `{"error": {"message", "type", "param", "code"}}`."""

import json


class APIError(Exception):
    """A request the server answers with an error status and an OpenAI-shaped body."""

    status = 400
    error_type = "invalid_request_error"

    def __init__(self, message, *, param=None, code=None, status=None, headers=()):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status
        self.headers = tuple(headers)

    def body(self):
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def json_bytes(self):
        return json.dumps(self.body()).encode("utf-8")


class InvalidRequest(APIError):
    """400: the body is not JSON, a field has a wrong type or value, or asks for what we cannot do."""


class Unsupported(InvalidRequest):
    """400: a valid OpenAI request for something this server refuses to do (logprobs, tools, ...)."""

    def __init__(self, message, *, param):
        super().__init__(message, param=param, code="unsupported_parameter")


class ContextTooLong(InvalidRequest):
    """400: the prompt does not fit the context."""

    def __init__(self, message, *, param):
        super().__init__(message, param=param, code="context_length_exceeded")


class Unauthorized(APIError):
    status = 401

    def __init__(self, message):
        super().__init__(message, code="invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])


class NotFound(APIError):
    status = 404

    def __init__(self, message, *, param=None, code=None):
        super().__init__(message, param=param, code=code)


class MethodNotAllowed(APIError):
    status = 405

    def __init__(self, method, path, allowed):
        super().__init__(
            f"{method} is not allowed on {path}; use {', '.join(allowed)}",
            code="method_not_allowed",
            headers=[(b"allow", ", ".join(allowed).encode("ascii"))],
        )


class BodyTooLarge(APIError):
    status = 413

    def __init__(self, limit):
        super().__init__(f"The request body is larger than {limit // (1024 * 1024)} MiB", code="request_too_large")


class HeadTooLarge(APIError):
    status = 431

    def __init__(self, limit):
        super().__init__(f"The request line and headers are larger than {limit // 1024} KiB", code="headers_too_large")


class LengthRequired(APIError):
    status = 411

    def __init__(self):
        super().__init__("Send the request body with a Content-Length (chunked request bodies are not accepted)")


class HostNotAllowed(APIError):
    """403: without an API key, a request addressed to a DNS name (DNS rebinding)."""

    status = 403

    def __init__(self, name):
        super().__init__(
            f"Requests addressed to {name!r} are not answered: without an API key this server answers only "
            f"requests to localhost or an IP address (against DNS rebinding). Start it with --allow-host "
            f"{name} or set an API key",
            code="host_not_allowed",
        )


class RequestTimeout(APIError):
    status = 408

    def __init__(self, seconds):
        super().__init__(f"The request did not arrive whole within {seconds} seconds", code="request_timeout")


class Overloaded(APIError):
    """503 with Retry-After: more requests wait than --max-queue allows; clients retry after a second."""

    status = 503
    error_type = "server_error"

    def __init__(self, waiting):
        super().__init__(
            f"The server is busy: {waiting} requests are waiting already; retry shortly",
            code="server_overloaded", headers=[(b"retry-after", b"1")],
        )


class ShuttingDown(APIError):
    """503: the server stops (SIGTERM) before this request was answered."""

    status = 503
    error_type = "server_error"

    def __init__(self):
        super().__init__("The server is shutting down; the request was not finished", code="server_shutting_down")


class ServerError(APIError):
    """500: a bug or an engine failure; the message is the engine's."""

    status = 500
    error_type = "server_error"
