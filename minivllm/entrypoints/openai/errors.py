"""The error every endpoint answers with (:class:`APIError`), and the size and text
checks made before anything is tokenized.

Apart from :mod:`.protocol` (the request bodies), which re-exports them.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from minivllm.entrypoints.openai.limits import ServingLimits


class APIError(Exception):
    """An error answered as OpenAI's error JSON with an HTTP status.

    ``status`` 400 (bad request), 401 (bad key), 404 (unknown model or path),
    413 (body too large), 503 (overloaded), 500 (the engine failed).
    """

    TYPES = MappingProxyType({400: "invalid_request_error", 401: "authentication_error",
                              404: "not_found_error", 413: "invalid_request_error",
                              503: "service_unavailable", 500: "internal_error"})

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``, as OpenAI answers."""
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}


def check_prompt_chars(limits: ServingLimits, num_chars: int,
                       field_name: str = "prompt") -> None:
    """400 if a prompt of ``num_chars`` characters is over the cap."""
    if num_chars > limits.max_prompt_chars:
        raise APIError(400, f"{field_name} has {num_chars} characters, more than the "
                            f"server's --max-prompt-chars {limits.max_prompt_chars}",
                       field_name)

def check_text(text: str, field_name: str = "prompt") -> None:
    """400 if ``text`` is not valid Unicode: JSON's ``\\ud800`` escapes decode to a
    lone surrogate, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{field_name} is not valid Unicode: a lone surrogate "
                            f"{text[e.start]!a} at character {e.start}", field_name) from None


def check_stop(limits: ServingLimits, stop: str | list[str] | None,
               stop_token_ids: list[int] | None) -> None:
    """400 if there are too many stop strings or ids, or one string is too long."""
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    for name, items in (("stop", strings), ("stop_token_ids", stop_token_ids or [])):
        if len(items) > limits.max_stop_strings:
            raise APIError(400, f"{name} has {len(items)} entries, more than the "
                                f"server's --max-stop-strings {limits.max_stop_strings}", name)
    longest = max(strings, key=len, default="")
    if len(longest) > limits.max_stop_string_chars:
        raise APIError(400, f"stop strings must have at most --max-stop-string-chars "
                            f"{limits.max_stop_string_chars} characters, got one of "
                            f"{len(longest)}", "stop")
