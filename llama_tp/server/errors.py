"""OpenAI's error answer: `RequestError` (a status and the field it names) and its body."""

from __future__ import annotations

from typing import Any


class RequestError(ValueError):
    """A bad request: answered with `status` and OpenAI's error body naming `param`."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = "invalid_value",
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.param, self.status, self.code, self.kind = param, status, code, kind

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
