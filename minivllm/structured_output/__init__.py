"""Structured outputs below the engine: constraints, automata and token vocabularies.

A structured-output request (``SamplingParams(structured_outputs=
StructuredOutputsParams(json=...))``) may only produce text in a language: a
JSON schema's documents, a regex's matches, one of a few choices, a grammar's
sentences. Every step, the engine asks the request's :class:`Grammar` which
tokens may come next (a *token bitmask*, one bit per vocabulary entry) and
sets the logits of all others to ``-inf`` before sampling.

The swap-layer component ``structured_output`` (``minivllm/ref/`` and
``minivllm/fast/structured_output.py``) does that work. This package holds the
neutral pieces the twins and the tests share, each one page:

- :mod:`.regex`: a regex as a tree of character sets (the syntax the ref reads);
- :mod:`.automata`: that tree to an NFA (Thompson) to a byte-level DFA (subset
  construction), characters spelled as UTF-8 bytes;
- :mod:`.json_schema`: a JSON schema (a documented subset) to a regex, the way
  outlines does it;
- :mod:`.vocab`: the bytes each token id stands for, from a Hugging Face tokenizer;
- :mod:`.bitmask`: the packed int32 bitmask layout (vLLM's and xgrammar's).

See ``docs/structured_outputs.md`` for the whole story.
"""
