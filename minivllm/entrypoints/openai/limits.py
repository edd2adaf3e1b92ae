"""The server's size caps, one frozen record (``minivllm serve --max-...`` flags).

Kept apart from ``protocol.py`` (which needs pydantic) so that the command
line can show their defaults without the ``serve`` extra installed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ServingLimits:
    """How big a request may be; each has a ``minivllm serve`` flag.

    Attributes:
        max_request_body_bytes: the HTTP body, read at most this far (413 beyond).
        max_prompt_chars: characters of one prompt (all messages of a chat
            together; ``/tokenize`` too), checked before tokenizing.
        max_stop_strings: entries in ``stop``, and in ``stop_token_ids``.
        max_stop_string_chars: characters of one stop string (the detokenizer
            searches a window this wide every step).
        max_detokenize_tokens: token ids one ``/detokenize`` may send.
        max_n: completions one request may ask for: ``n`` times its number of
            prompts (each completion holds KV blocks of its own once it forks),
            and the widest ``use_beam_search``.
    """

    max_request_body_bytes: int = 2 << 20
    max_prompt_chars: int = 1 << 18
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_detokenize_tokens: int = 1 << 16
    max_n: int = 128

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")
