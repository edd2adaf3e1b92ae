"""Log-probabilities in the OpenAI formats: the completion's, and the prompt's.

The engine hands out, per token, a ``{token_id: Logprob}`` dict (the token
itself plus the ``top_n`` most likely, ranks 1..top_n). Here they become:

- :func:`openai_logprobs`: OpenAI's per-token ``logprobs`` object, the
  completions shape (``tokens``, ``token_logprobs``, ``top_logprobs``,
  ``text_offset``) or the chat shape (``content``). With ``echo`` the prompt's
  tokens lead, and the prompt's first token, which nothing scores, has a
  ``null`` logprob and ``null`` top logprobs (as vLLM answers);
- :func:`prompt_logprobs_json`: vLLM's ``prompt_logprobs`` field (completions:
  on each choice; chat: on the response), one entry per prompt token, ``null``
  for the first, then ``{token_id: {"logprob", "rank", "decoded_token"}}``.
  JSON has no ``-Infinity``: a logprob below -9999 is sent as -9999 (vLLM's clamp).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

#: The smallest logprob sent over JSON (vLLM's clamp for ``-inf``).
MIN_JSON_LOGPROB = -9999.0


def openai_logprobs(decode: Callable[[list[int]], str], chat: bool, top_n: int,
                    entries: Sequence[dict | None], token_ids: Sequence[int]) -> dict:
    """Per-token logprobs in the endpoint's OpenAI format (``decode``: the tokenizer's).

    The token is listed among the top only if its rank is within ``top_n``.
    """
    rows = []  # (token text, its logprob, [(top token text, logprob), ...] or None)
    for tok, entry in zip(token_ids, entries):
        if entry is None:  # the prompt's first token (echo): nothing scores it
            rows.append((decode([tok]), None, None))
            continue
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items()
                     if lp.rank is not None and lp.rank <= top_n)
        rows.append((decode([tok]), _clamp(entry[tok].logprob),
                     [(decode([t]), _clamp(v)) for _, t, v in top]))
    if chat:
        return {"content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()),
             "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())}
                              for s, v in top]}
            for t, lp, top in rows]}
    offsets, pos = [], 0
    for t, _, _ in rows:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": [t for t, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [None if top is None else _by_text(top) for _, _, top in rows],
            "text_offset": offsets}


def prompt_logprobs_json(entries: Sequence[dict | None] | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token ``null`` (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` (ids become JSON keys)."""
    if entries is None:
        return None
    return [None if e is None else
            {str(t): {"logprob": _clamp(lp.logprob), "rank": lp.rank,
                      "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in entries]


def _clamp(value: float) -> float:
    return max(value, MIN_JSON_LOGPROB)


def _by_text(top: list[tuple[str, float]]) -> dict[str, float]:
    """``{text: logprob}``, most likely first; where two tokens decode to the same
    text (e.g. two halves of a character, both U+FFFD) the likelier one is kept."""
    out: dict[str, float] = {}
    for text, logprob in top:
        out.setdefault(text, logprob)
    return out
