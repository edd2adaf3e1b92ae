"""The OpenAI-compatible server (``minivllm serve``), in vLLM's layout.

- ``protocol.py``: the request bodies (pydantic) and their mapping onto
  :class:`~minivllm.SamplingParams`;
- ``fields.py``: the vLLM request fields minivllm refuses, each with its reason;
- ``errors.py``: ``APIError`` and the size checks made before tokenizing;
- ``structured.py``: ``structured_outputs``, ``response_format`` and tools to a constraint;
- ``serving.py``: ``/v1/completions`` and ``/v1/chat/completions``, streamed
  (SSE) or not, with ``n`` fanned out over engine requests;
- ``metrics.py``: ``/metrics`` in Prometheus format;
- ``api_server.py``: the FastAPI app, API-key check, errors, and ``serve``.

FastAPI, uvicorn and prometheus-client come with the ``serve`` extra
(``pip install -e '.[serve]'``).
"""
