"""OpenAI's ``logit_bias`` field, read into the engine's form.

OpenAI sends ``logit_bias`` as a JSON object whose keys are token ids written
as strings (JSON keys are strings) and whose values are biases in
``[-100, 100]``; the engine's :class:`~minivllm.SamplingParams` takes
``{int: float}``. Token ids past the vocabulary are the engine's check (it
knows the vocabulary), made when the request is added.
"""

from __future__ import annotations

import math


def logit_bias_ids(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """``{"42": 5.0}`` -> ``{42: 5.0}``; ``ValueError`` starting with ``logit_bias``
    (the server answers it with a 400 naming the field) for a key that is not a
    non-negative integer or a bias that is not a number in ``[-100, 100]``."""
    if logit_bias is None:
        return None
    out = {}
    for key, bias in logit_bias.items():
        if not (isinstance(key, str) and key.strip().isascii() and key.strip().isdigit()):
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers "
                             f"written as strings), got {str(key)[:40]!r}")
        if not (isinstance(bias, (int, float)) and math.isfinite(bias)
                and -100.0 <= bias <= 100.0):
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} "
                             f"for token {key.strip()}")
        out[int(key)] = float(bias)
    return out
