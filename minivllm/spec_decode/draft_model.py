"""The draft-model proposer: ``k`` cheap decode steps of a smaller model, with their ``q``.

Speculative decoding needs a proposer that guesses the target's next tokens.
This one runs a *draft model* for ``k`` decode steps per request and returns
the drafts together with ``draft_probs``, the distribution ``q`` each draft was
sampled from, in the layout :mod:`minivllm.ref.rejection_sampler` takes
(``(num_draft_tokens, V)`` float32, request after request).

Two kinds of draft model (``SpeculativeConfig.method == "draft_model"``):

- **Self-speculation** (``model=None``, ``num_draft_layers=L``): the target's
  first ``L`` decoder layers, its final norm and its LM head
  (LayerSkip-style, :meth:`~minivllm.model.llama.LlamaForCausalLM.first_layers`;
  no weight is copied). Layers ``0 .. L-1`` of the draft *are* the target's,
  so the draft reads and writes the target's own KV cache for those layers:
  zero extra memory. It needs no prefill either, because the target has
  already written every position but the last sampled token. The K/V it
  writes at the lookahead positions are rewritten by the next verification
  pass (which writes before it reads, in every layer) and the rejected ones
  later still, so nothing the draft writes is ever read by the target.
- **A separate draft model** (``model=path``, same tokenizer): its own KV
  cache, one tensor pair per draft layer on the **same block ids** as the
  target (as vLLM v1 does), so it needs no block table of its own. It
  remembers how many positions of each request it has computed; a position
  holds valid draft K/V if the draft computed it and the token there was
  accepted, and the first draft step of a round computes everything after
  that (the whole prompt the first time). A preemption (the worker drops the
  request's block-table row) moves the request to new blocks and voids what
  the draft had (:meth:`DraftModelProposer.invalidate`); finished requests are
  forgotten.

Drafts are sampled from ``q = softmax(filter(draft_logits))``: the request's
temperature, min-p, top-k and top-p, through the engine's sampler component;
greedy requests take the argmax (and ``q`` is one-hot). Penalties are left
out of ``q``. Any ``q`` keeps the output exact, since the rejection sampler
corrects for whatever ``q`` is; a ``q`` closer to ``p`` is only accepted more often.
The randomness has its own generators (one per seeded request, seeded from
the request's seed through :func:`draft_seed`), never the ones verification
draws from, because the rule needs the draft independent of the acceptance
uniforms and of the recovery race. A seeded request's drafts therefore do not
depend on the rest of the batch.

Two ways to run the same steps: :meth:`DraftModelProposer.propose` batches
every request into each of the ``k`` steps (``k`` forward passes for the whole
batch); :func:`propose_one_by_one` is the reference, a plain loop over
requests and steps, one token per forward pass, which the tests hold the
batched one to.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minivllm import backend
from minivllm.metadata import ModelInput
from minivllm.request import Request
from minivllm.sampling_metadata import SamplingMetadata, draw_exponentials

_SEED_MULT, _SEED_ADD = 6364136223846793005, 1442695040888963407  # Knuth's MMIX LCG


def draft_seed(seed: int) -> int:
    """The seed of a seeded request's draft generator: a fixed, different stream."""
    return (seed * _SEED_MULT + _SEED_ADD) % 2**64


#: What a proposer returns (:class:`~minivllm.spec_decode.proposer.Proposer`): per
#: request its drafts (possibly fewer than asked, or none), and ``draft_probs``
#: ``(num_draft_tokens, V)`` float32, row ``j`` of request ``i`` the ``q`` its
#: ``j``-th draft was sampled from, requests in order.
DraftProposal = tuple[list[list[int]], torch.Tensor]


class DraftModelProposer:
    """Proposes drafts with a draft model over a paged KV cache (the ``Proposer`` protocol).

    Build it with :meth:`self_speculation` or :meth:`separate` once the
    target's KV cache exists (``Worker.init_kv_cache``), or through
    :func:`make_draft_proposer` from an engine's executor.

    Args:
        model: the draft model (a :class:`~minivllm.model.llama.LlamaForCausalLM`
            or a :meth:`first_layers` view of the target).
        kv_caches: one ``(k_cache, v_cache)`` per draft layer.
        block_tables: the worker's block tables (the target's rows, read at each call).
        vocab_size: ``V`` of the target (the draft's must be the same).
        shares_target_cache: True for self-speculation: positions the target
            computed are valid for the draft.
        components: the engine's components (its sampler filters the logits).
        seed: seed of the generator for unseeded random requests.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list, block_tables, vocab_size: int,
                 shares_target_cache: bool, components: backend.Components | None = None,
                 seed: int = 0, enforce_eager: bool = False) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_tables = block_tables
        self.vocab_size = vocab_size
        self.device = kv_caches[0][0].device
        self.shares_target_cache = shares_target_cache
        components = backend.as_components(components)
        self.sampler = components.sampler
        # The engine's model runner component, over the draft's layers and cache:
        # the model's own forward, or its fast twin's bit-identical C++ stack.
        self.runner = components.model_runner.ModelRunner(
            model, kv_caches, block_size=block_tables.block_size, enforce_eager=enforce_eager)
        self.generator = torch.Generator(device=self.device).manual_seed(draft_seed(seed))
        self.seeded_generators: dict[str, torch.Generator] = {}
        # A separate draft: request id -> the positions with valid draft K/V. A
        # preemption or a fork rebuilds the request's row: then none (invalidate).
        self.num_cached: dict[str, int] = {}

    @classmethod
    def self_speculation(cls, worker, num_draft_layers: int | None,
                         seed: int = 0) -> DraftModelProposer:
        """The target's first ``num_draft_layers`` layers (None: all) on its own KV cache."""
        layers = worker.num_layers if num_draft_layers is None else num_draft_layers
        draft = worker.model.first_layers(layers)
        return cls(draft, worker.kv_caches[:layers], worker.block_tables,
                   worker.model.config.vocab_size, shares_target_cache=True,
                   components=worker.components, seed=seed,
                   enforce_eager=worker.config.enforce_eager)

    @classmethod
    def separate(cls, worker, model: str, num_draft_layers: int | None = None,
                 seed: int = 0) -> DraftModelProposer:
        """A separate draft model at ``model``, with its own KV cache on the target's block ids.

        The cache has the target's ``num_blocks``; it is not counted in the
        engine's KV memory budget (``Worker.bytes_per_block``), so leave room.
        """
        from minivllm.model.loader import load_model

        draft, config, _ = load_model(model, dtype=worker.dtype, device=worker.device,
                                      tp_size=worker.config.tensor_parallel_size,
                                      components=worker.components)
        vocab = worker.model.config.vocab_size
        if config.vocab_size != vocab:
            raise ValueError(f"speculative_config.model {model!r} has vocab_size "
                             f"{config.vocab_size}; the target's is {vocab} (a draft model "
                             "must share the target's tokenizer)")
        if num_draft_layers is not None:
            draft = draft.first_layers(num_draft_layers)
        num_blocks, block_size = worker.kv_caches[0][0].shape[:2]
        attn = draft.model.layers[0].self_attn
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        kv_caches = [(torch.zeros(shape, dtype=worker.dtype, device=worker.device),
                      torch.zeros(shape, dtype=worker.dtype, device=worker.device))
                     for _ in draft.model.layers]
        return cls(draft, kv_caches, worker.block_tables, vocab, shares_target_cache=False,
                   components=worker.components, seed=seed,
                   enforce_eager=worker.config.enforce_eager)

    def first_uncached(self, request: Request) -> int:
        """The first position whose draft K/V must be computed before drafting.

        Every token but the last (just sampled) is in the target's cache; the
        draft's own cache holds what it computed and was accepted since (a
        preemption, which moves the request to new blocks, voids it: :meth:`invalidate`).
        """
        n = request.num_tokens - 1
        if self.shares_target_cache:
            return n
        return min(self.num_cached.get(request.request_id, 0), n)

    def invalidate(self, request_id: str) -> None:
        """The request's block-table row was dropped (preempted, or rebuilt by a fork):
        what a separate draft cached for it is gone."""
        self.num_cached.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request finished: its cache record and its generator go."""
        self.num_cached.pop(request_id, None)
        self.seeded_generators.pop(request_id, None)

    def drafts_that_fit(self, request: Request, k: int) -> int:
        """``k`` capped so that every position the draft writes has a slot.

        Draft step ``j`` writes position ``num_tokens - 1 + j``; the scheduler's
        lookahead slots (``num_lookahead_tokens``) cover all ``k``, so this
        guard only bites without them.
        """
        tables = self.block_tables
        capacity = len(tables.get_block_ids(request.request_id)) * tables.block_size
        return max(0, min(k, capacity - request.num_tokens + 1))

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], max_num_drafts: Sequence[int]
                ) -> DraftProposal:
        """Up to ``max_num_drafts[i]`` drafts for each of ``requests``, all batched.

        Args:
            requests: requests that have just sampled (their last token is not
                yet computed), in batch order; each has a block-table row.
            max_num_drafts: the most drafts for each (capped by the caller
                for ``max_tokens`` and ``max_model_len``; 0 for none).

        Returns:
            ``(drafts, draft_probs)``; step ``j`` runs one forward pass over
            every request that wants a ``j``-th draft.
        """
        ks = [self.drafts_that_fit(r, k) if k > 0 else 0
              for r, k in zip(requests, max_num_drafts, strict=True)]
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        for j in range(max(ks, default=0)):
            rows = [i for i, k in enumerate(ks) if k > j]
            chunks = []
            for i in rows:
                r = requests[i]
                if j == 0:  # the uncached tokens (self-speculation: the last one alone)
                    start = self.first_uncached(r)
                    chunks.append((start, r.all_token_ids[start:]))
                else:  # the previous draft, at position num_tokens - 1 + j
                    chunks.append((r.num_tokens - 1 + j, [drafts[i][-1]]))
            logits = self._forward([requests[i] for i in rows], chunks)
            tokens, q = self._sample(logits, [requests[i] for i in rows])
            for i, t, qi in zip(rows, tokens, q):
                drafts[i].append(t)
                probs[i].append(qi)
        self._remember(requests, ks)
        return _proposal(drafts, probs, self.vocab_size, self.device)

    def _remember(self, requests: Sequence[Request], ks: Sequence[int]) -> None:
        """A separate draft: record what its cache now holds."""
        if self.shares_target_cache:
            return
        for r, k in zip(requests, ks):
            if k:  # it computed positions up to num_tokens - 1 + k - 1
                self.num_cached[r.request_id] = r.num_tokens - 1 + k

    def _forward(self, requests: Sequence[Request],
                 chunks: list[tuple[int, list[int]]]) -> torch.Tensor:  # (len(requests), V)
        """One draft forward pass over ``chunks[i] = (start, tokens)``; each last row's logits."""
        starts = [s for s, _ in chunks]
        counts = [len(t) for _, t in chunks]
        ids = torch.tensor([t for _, toks in chunks for t in toks], dtype=torch.int64)
        positions = torch.tensor([p for s, n in zip(starts, counts) for p in range(s, s + n)],
                                 dtype=torch.int64)
        last = torch.tensor(counts).cumsum(0) - 1  # (B,) each chunk's last row
        model_input = ModelInput.build(self.block_tables, [r.request_id for r in requests],
                                       counts, [s + n for s, n in zip(starts, counts)], ids,
                                       positions, last, self.device)
        return self.runner.execute_model_logits(model_input)

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]
                ) -> tuple[list[int], torch.Tensor]:
        """One draft token per row from ``q``, and ``q`` itself ((B, V) float32)."""
        for r in requests:
            seed = r.sampling_params.seed
            if seed is not None and r.request_id not in self.seeded_generators:
                self.seeded_generators[r.request_id] = torch.Generator(
                    device=self.device).manual_seed(draft_seed(seed))
        md = SamplingMetadata.from_requests(list(requests), self.vocab_size, self.device,
                                            self.generator, self.seeded_generators)
        return sample_drafts(logits, md, self.sampler)


def make_draft_proposer(config, worker, seed: int = 0) -> DraftModelProposer:
    """The proposer of ``speculative_config`` method ``draft_model`` beside ``worker``.

    The draft runs beside the target, in the sampling worker, when it holds
    every layer (its tensor-parallel shards: each rank of the last stage
    samples alike and runs the draft's forward with the others).
    ``ValueError`` when it does not (pipeline stages).
    """
    if worker is None:
        raise ValueError("speculative_config.method 'draft_model' needs every layer on the "
                         "sampling worker; with pipeline stages use method 'ngram'")
    if config.model is None:
        return DraftModelProposer.self_speculation(worker, config.num_draft_layers, seed)
    return DraftModelProposer.separate(worker, config.model, config.num_draft_layers, seed)


def sample_drafts(logits: torch.Tensor, metadata: SamplingMetadata, sampler
                  ) -> tuple[list[int], torch.Tensor]:
    """Sample one draft per row of ``logits`` (B, V) and return it with its ``q`` (B, V).

    Random rows: ``q = softmax(filter_logits(logits))`` and the draft is the
    exponential race ``argmax(q / e)``, ``e ~ Exp(1)`` from the metadata's
    generators. Greedy rows: the argmax, with a one-hot ``q``.
    """
    logits = logits.to(torch.float32)
    greedy_tokens = logits.argmax(dim=-1)  # (B,)
    q = torch.zeros_like(logits)
    if metadata.all_greedy:
        tokens = greedy_tokens
    else:
        q = torch.softmax(sampler.filter_logits(logits, metadata), dim=-1)  # (B, V)
        e = draw_exponentials(metadata, logits.shape[1])  # (B, V)
        tokens = torch.where(metadata.greedy_mask, greedy_tokens, (q / e).argmax(dim=-1))
    greedy_rows = metadata.greedy_mask.nonzero().flatten()
    q[greedy_rows] = 0.0
    q[greedy_rows, tokens[greedy_rows]] = 1.0
    return tokens.tolist(), q


def _proposal(drafts: list[list[int]], probs: list[list[torch.Tensor]], vocab_size: int,
              device: torch.device) -> DraftProposal:
    rows = [q for per_request in probs for q in per_request]
    draft_probs = (torch.stack(rows) if rows else
                   torch.zeros(0, vocab_size, dtype=torch.float32, device=device))
    return drafts, draft_probs


@torch.inference_mode()
def propose_one_by_one(proposer: DraftModelProposer, requests: Sequence[Request],
                       max_num_drafts: Sequence[int]) -> DraftProposal:
    """The reference: :meth:`DraftModelProposer.propose` as a plain loop, one token a pass.

    For each request in turn, its uncached tokens one by one, then its drafts
    one by one, each a forward pass of a single token. The same drafts and
    ``q`` as the batched version (up to float rounding), and the same tokens
    for greedy and for seeded requests (each draws from its own generator).
    """
    drafts: list[list[int]] = []
    probs: list[list[torch.Tensor]] = []
    ks = []
    for r, k in zip(requests, max_num_drafts, strict=True):
        k = proposer.drafts_that_fit(r, k) if k > 0 else 0
        ks.append(k)
        mine: list[int] = []
        mine_q: list[torch.Tensor] = []
        if k:
            n = r.num_tokens - 1
            tokens = list(r.all_token_ids)
            for pos in range(proposer.first_uncached(r), n + k):
                token = tokens[pos] if pos <= n else mine[-1]
                logits = proposer._forward([r], [(pos, [token])])
                if pos >= n:  # the logits after position n + j predict draft j
                    t, q = proposer._sample(logits, [r])
                    mine.append(t[0])
                    mine_q.append(q[0])
        drafts.append(mine)
        probs.append(mine_q)
    proposer._remember(requests, ks)
    return _proposal(drafts, probs, proposer.vocab_size, proposer.device)
