"""A request's failure as the HTTP side answers it: a status, the OpenAI error `type` and a
message (llama-server's shape), raised wherever the request is refused (parsing, the engine,
the memory's slot files) and turned into the response by http/errors.py."""

from __future__ import annotations

from typing import Any


class TaskError(Exception):
    """A request-level failure: status + OpenAI error `type`; extra fields go inside `error`."""

    def __init__(self, status: int, type_: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.type, self.message, self.extra = status, type_, message, extra

    def to_json(self) -> dict[str, Any]:
        return {"error": {"code": self.status, "message": self.message, "type": self.type,
                          **self.extra}}


def invalid_request(message: str) -> TaskError:
    return TaskError(400, "invalid_request_error", message)


def not_supported(message: str) -> TaskError:
    """llama-server's 501: what this server (as started) does not do."""
    return TaskError(501, "not_supported_error", message)
