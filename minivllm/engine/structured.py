"""Structured outputs in the engine: each constrained request's grammar, its mask, its end.

vLLM's ``StructuredOutputManager`` (``vllm/v1/structured_output/``). The
``structured_output`` component (docs/structured_outputs.md) compiles a
constraint into a per-request ``Grammar`` and fills one row of a token
bitmask per request; this module is where the engine's step calls it:

1. **add_request** (:meth:`StructuredOutputs.compile`): the constraint is
   compiled *before* anything is queued, so a schema, regex or grammar that
   does not compile is a ``ValueError`` naming the field and the request is
   nowhere. Compiled constraints are cached (LRU, keyed by the constraint) and
   compiling is capped in time (``structured_outputs_compile_timeout_s``).
   The server compiles on a thread of its own first (:meth:`validate`), so the
   engine thread's compile is a cache hit and a slow schema stalls no stream.
2. **When a step is sent** (:meth:`bitmask`): for the constrained rows only,
   ``fill_bitmask``; the bitmask travels in the step's
   :class:`~minivllm.step_sampling.SamplingPlan`, and the sampling worker
   applies it (``apply_token_bitmask_inplace``) before its sampler. A batch
   without a constrained request does no bitmask work at all; unconstrained
   rows of a mixed batch are not touched. A request whose row allows no token
   (a dead end) is left out of the sampling and ends alone with
   ``finish_reason="error"``.
3. **After the scheduler kept the step's tokens** (:meth:`advance`):
   ``accept_tokens``; a grammar that ``is_terminated()`` (EOS accepted, or the
   text is complete and only EOS could follow) finishes its request with
   ``finish_reason="stop"`` through the scheduler, which frees its blocks, as
   a stop string does.

The grammars live here, by request id, for the whole life of the request:
a preempted request keeps its grammar (its accepted tokens are unchanged)
and resumes in the right state when it is recomputed. Masks are built on the
engine's host, where the grammars are, and only the packed bitmask (``V / 32``
int32 a constrained row) goes to the sampling worker.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams
from minivllm.structured_output.bitmask import pack_bitmask

#: Compiling one constraint may take at most this long by default (seconds).
DEFAULT_COMPILE_TIMEOUT_S = 10.0


class StructuredOutputs:
    """The engine's constrained requests and their grammars (see the module docstring).

    Args:
        impl: the ``structured_output`` component's module (ref or fast twin).
        tokenizer: the model's tokenizer (None: structured outputs are refused).
        vocab_size: the logits' width.
        eos_token_id: the id allowed where the output may end.
        compile_timeout_s: refuse a constraint that takes longer to compile.
        cache_size: compiled constraints kept (least recently used dropped first).
    """

    def __init__(self, impl: Any, tokenizer: Any, vocab_size: int, eos_token_id: int | None,
                 compile_timeout_s: float | None = DEFAULT_COMPILE_TIMEOUT_S,
                 cache_size: int = 64) -> None:
        self.impl = impl
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.compile_timeout_s = compile_timeout_s
        self.cache_size = cache_size
        #: The grammar of every constrained request the engine holds, by request id.
        self.grammars: dict[str, Any] = {}
        self._backend = None  # built at the first constrained request (reads the vocabulary)
        self._backend_lock = threading.Lock()  # the server's compile thread may build it
        self._bitmask: torch.Tensor | None = None  # (rows, W) int32 on the host, reused
        self._valid_bits: np.ndarray | None = None  # (W,) int32: the ids below vocab_size
        self._suppress_cache: dict[frozenset[int], np.ndarray] = {}  # min_tokens' masks

    def __bool__(self) -> bool:
        return bool(self.grammars)

    # -- compiling ----------------------------------------------------------------------

    def backend(self) -> Any:
        """The component's ``StructuredOutputBackend``, built once (thread-safe)."""
        if self._backend is None:
            with self._backend_lock:
                if self._backend is None:
                    if self.tokenizer is None:
                        raise ValueError("structured_outputs needs the model's tokenizer (the "
                                         "token texts), and this engine has none")
                    self._backend = self.impl.StructuredOutputBackend(
                        self.tokenizer, self.vocab_size,
                        eos_token_ids=None if self.eos_token_id is None else [self.eos_token_id],
                        cache_size=self.cache_size, compile_timeout_s=self.compile_timeout_s)
        return self._backend

    def compile(self, params: SamplingParams) -> Any | None:
        """A new grammar for ``params.structured_outputs`` (None if unconstrained).

        ``ValueError`` naming the field if the constraint does not compile (or
        takes longer than ``compile_timeout_s``). Any thread may call it: the
        compiled constraints are cached, and the cache is thread-safe.
        """
        if params.structured_outputs is None:
            return None
        return self.backend().compile(params.structured_outputs)

    def validate(self, params: SamplingParams) -> None:
        """Compile ``params``' constraint and drop the grammar: the server calls it off the
        event loop and off the engine thread, so the engine's own compile is a cache hit."""
        self.compile(params)

    # -- requests -------------------------------------------------------------------------

    def add(self, request_id: str, grammar: Any | None) -> None:
        """Keep a newly queued request's grammar (None: unconstrained, nothing kept)."""
        if grammar is not None:
            self.grammars[request_id] = grammar

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted request's grammar."""
        self.grammars.pop(request_id, None)

    def constrained(self, requests: list[Request]) -> list[str]:
        """The ids of the constrained requests among ``requests`` (they get no drafts)."""
        if not self.grammars:
            return []
        return [r.request_id for r in requests if r.request_id in self.grammars]

    # -- the step -------------------------------------------------------------------------

    def bitmask(self, reqs: list[Request]) -> tuple[torch.Tensor | None, tuple[str, ...],
                                                      list[tuple[Request, Exception]]]:
        """The step's grammar bitmask for the constrained requests among ``reqs``.

        Returns ``(bitmask, ids, dead)``: a ``(len(ids), W)`` int32 copy (the
        sampling worker applies row ``i`` to request ``ids[i]``'s row), or None
        when no request is constrained, and the requests whose row allows no
        token (dead ends: they are not sampled and end alone).
        """
        if not self.grammars:
            return None, (), []
        rows = [(req, self.grammars[req.request_id]) for req in reqs
                if req.request_id in self.grammars]
        if not rows:
            return None, (), []
        bitmask = self._bitmask_rows(len(rows))  # (R, W) int32, reused
        filled, dead = [], []
        for req, grammar in rows:
            try:
                grammar.fill_bitmask(bitmask, len(filled))
            except Exception as e:  # noqa: BLE001 -- it belongs to this request alone
                dead.append((req, e))
                continue
            filled.append((len(filled), req))
        dead += self._dead_ends(bitmask, filled)
        gone = {id(r) for r, _ in dead}
        keep = [row for row, r in filled if id(r) not in gone]
        if not keep:
            return None, (), dead
        ids = tuple(r.request_id for row, r in filled if id(r) not in gone)
        return bitmask[keep].clone(), ids, dead

    def advance(self, rows: list[tuple[Request, list[int], Any]], finished: set[str],
                scheduler: Any) -> tuple[list[tuple[Request, Exception]], set[str]]:
        """After ``update_from_output``: accept each constrained request's kept tokens.

        Returns ``(failed, stopped)``: the requests whose grammar refused a token
        or raised (the engine ends them alone), and the ids of those whose
        grammar terminated, which are finished here (``FINISHED_STOPPED``,
        blocks freed) unless the scheduler already finished them.
        """
        failed, stopped = [], set()
        if not self.grammars:
            return failed, stopped
        for req, tokens, _ in rows:
            grammar = self.grammars.get(req.request_id)
            if grammar is None or not tokens:
                continue
            try:
                if not grammar.accept_tokens(tokens):
                    raise ValueError(f"structured_outputs: the sampled tokens {tokens} are not "
                                     f"allowed by the constraint after "
                                     f"{grammar.num_accepted_tokens} tokens")
                done = grammar.is_terminated()
            except Exception as e:  # noqa: BLE001 -- it belongs to this request alone
                failed.append((req, e))
                continue
            if done and req.request_id not in finished:
                scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                stopped.add(req.request_id)
        return failed, stopped

    # -- helpers --------------------------------------------------------------------------

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:  # (num_rows, W) int32
        """The first ``num_rows`` rows of the reused host bitmask (grown when too small).

        Rows not filled this step hold stale bits, but only the filled rows are
        passed to ``apply_token_bitmask_inplace``.
        """
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            size = max(num_rows, 2 * (0 if self._bitmask is None else self._bitmask.shape[0]))
            self._bitmask = self.impl.allocate_token_bitmask(size, self.vocab_size)
            valid = torch.zeros(32 * self._bitmask.shape[1], dtype=torch.bool)
            valid[: self.vocab_size] = True
            self._valid_bits = pack_bitmask(valid).numpy()
        return self._bitmask[:num_rows]

    def _unsuppressed(self, req: Request) -> np.ndarray:  # (W,) int32
        """Every id but EOS and ``req``'s stop ids (what ``min_tokens`` leaves the sampler)."""
        ids = set(req.sampling_params.stop_token_ids)
        if req.eos_token_id is not None:
            ids.add(req.eos_token_id)
        key = frozenset(t for t in ids if t < self.vocab_size)
        if key not in self._suppress_cache:
            keep = torch.ones(32 * self._bitmask.shape[1], dtype=torch.bool)
            keep[list(key)] = False
            self._suppress_cache[key] = pack_bitmask(keep).numpy()
        return self._suppress_cache[key]

    def _dead_ends(self, bitmask: torch.Tensor,
                   filled: list[tuple[int, Request]]) -> list[tuple[Request, Exception]]:
        """The requests whose row allows no token the sampler may draw.

        Below ``min_tokens`` the sampler suppresses EOS and the stop ids, so
        those bits do not count; a constraint that then allows nothing else
        (it admits only an output shorter than ``min_tokens``) is a dead end too.
        """
        # numpy on the host bitmask's memory: a few microseconds, where torch's
        # per-op overhead would cost more than filling the rows.
        live = bitmask.numpy()[[row for row, _ in filled]] & self._valid_bits  # (R, W)
        below_min = [i for i, (_, req) in enumerate(filled)
                     if req.num_output_tokens < req.sampling_params.min_tokens]
        for i in below_min:
            live[i] &= self._unsuppressed(filled[i][1])
        dead = []
        for i in np.flatnonzero(~live.any(axis=1)).tolist():
            req = filled[i][1]
            why = (f" (min_tokens={req.sampling_params.min_tokens} suppresses EOS and the "
                   f"stop ids)" if i in below_min else "")
            dead.append((req, ValueError(
                f"structured_outputs: dead end after {req.num_output_tokens} output tokens: "
                f"the constraint allows no token here{why}")))
        return dead

