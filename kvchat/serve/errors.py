"""The server's one error: a request refused with an HTTP status and one sentence,
which the app turns into OpenAI's error shape."""

from __future__ import annotations


class ApiError(Exception):
    """A request refused with ``status``; ``message`` is one sentence for the client."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
