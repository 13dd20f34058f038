"""A request's failure as the HTTP side answers it: a status, the OpenAI error `type` and a
message (llama-server's shape), raised wherever the request is refused (parsing, the engine,
the memory's slot files) and turned into the response by http/errors.py."""

from __future__ import annotations

import json
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


def bad_field(where: str, message: str) -> TaskError:
    """A 400 naming the field: `Field 'where': message`."""
    return invalid_request(f"Field '{where}': {message}")


def show(v: Any) -> str:
    """A value as an error message quotes it: its JSON (else its repr), cut short."""
    try:
        return json.dumps(v)[:80]
    except (TypeError, ValueError):
        return repr(v)[:80]


def not_supported(message: str) -> TaskError:
    """llama-server's 501: what this server (as started) does not do."""
    return TaskError(501, "not_supported_error", message)
