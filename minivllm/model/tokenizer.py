"""Load a model's tokenizer with transformers, or fail naming the folder and the problem.

transformers raises any of a handful of types for tokenizer files that are
incomplete or corrupt (a ``JSONDecodeError``, an ``OSError``, "Couldn't
instantiate the backend tokenizer"), and rarely says which folder it read;
:func:`load_tokenizer` is the one place minivllm loads a tokenizer (an HF
folder's, or the one in a GGUF file's metadata) and turns each into a
``ValueError`` that does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Any of these in a model directory means it ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
#: The files that hold the vocabulary itself (``tokenizer_config.json`` alone does not).
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: Path, gguf_file: str | None = None) -> Any:
    """transformers' tokenizer of ``model_dir`` (or of ``gguf_file`` in it).

    Raises ``ValueError`` naming the directory (or file) and the problem when
    the tokenizer files are incomplete or unreadable: transformers' own errors
    (any of a handful of types) rarely say which file was wrong.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), gguf_file=gguf_file,
                                             local_files_only=True)
    except Exception as e:  # noqa: BLE001  (json, OSError, ValueError, KeyError, ...)
        if gguf_file is not None:
            raise ValueError(f"{model_dir / gguf_file}: cannot load the tokenizer in its "
                             f"metadata: {type(e).__name__}: {e}") from None
        present = [f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
        hint = "" if set(present) & set(VOCAB_FILES) else (
            f" ({' / '.join(VOCAB_FILES)} missing?)")
        raise ValueError(f"{model_dir}: cannot load the tokenizer from {present}{hint}: "
                         f"{type(e).__name__}: {e}") from None
