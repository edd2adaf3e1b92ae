"""Speculative decoding: what the proposers and the rejection sampler share.

- :mod:`minivllm.spec_decode.config`: :class:`SpeculativeConfig`, vLLM's
  ``speculative_config`` (method, ``num_speculative_tokens``, n-gram lookup
  lengths, the draft model).
- :mod:`minivllm.spec_decode.metadata`: :class:`SpecDecodeMetadata` (one step's
  draft tokens, flattened), :class:`RejectionSamplerOutput`, :class:`SpecStats`, and the helpers
  both rejection-sampler twins call: input checks, per-position sampling
  metadata and the one place verification randomness is drawn.
- :mod:`minivllm.spec_decode.proposer`: the :class:`Proposer` protocol (the
  hook a draft model plugs into), the n-gram proposer, and the
  :class:`Speculator` the engine's step calls (who gets drafts, how many).
  Verification is the sampling worker's step
  (:mod:`minivllm.worker.sampling`, the ``rejection_sampler`` component).
- :mod:`minivllm.spec_decode.backoff`: when a request stops getting drafts.
- :mod:`minivllm.spec_decode.draft_model`: the draft-model proposer, including
  self-speculation on the target's first ``L`` layers
  (:meth:`~minivllm.model.llama.LlamaForCausalLM.first_layers`) over the
  target's own KV cache.

The components themselves are twins behind the swap layer:
``backend.get("rejection_sampler")`` and ``backend.get("ngram_proposer")``
(``minivllm/ref/`` and ``minivllm/fast/``). See ``docs/speculative_decoding.md``.
"""
