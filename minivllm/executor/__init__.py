"""Who runs the workers, on every rank: vLLM v1's ``vllm/v1/executor/``.

``abstract.py`` (the :class:`Executor` interface and its one RPC,
``collective_rpc``), ``uniproc_executor.py`` (every worker in this process),
``multiproc_executor.py`` (one process per rank), how the other ranks start
(``rank_starters.py``, ``launcher.py`` chooses), and how calls and tensors
travel between them (``wire.py``, ``stage_link.py``; ``ranks.py`` checks the
parallel sizes).
"""
