"""One rank's worker: its model, KV cache, block table and model runner
(:class:`~minivllm.worker.worker.Worker`), vLLM v1's ``vllm/v1/worker/``. The
model runners themselves are a swap-layer component (``ref/model_runner.py``,
``fast/model_runner.py``).
"""
