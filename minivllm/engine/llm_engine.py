"""``LLMEngine``: one engine step = schedule -> prepare inputs -> forward -> sample -> detokenize.

The loop that ties every component together::

    scheduler_output = scheduler.schedule()              # who runs, how many tokens, new blocks
    step_input, sampling_reqs = runner.prepare_inputs()  # the flat batch + block-table changes
    logits = executor.execute_model(step_input)          # every rank: update its block table,
                                                         # build metadata, run the forward
    tokens = runner.sample(logits, sampling_reqs)        # one token per finished prefill/decode
    finished = scheduler.update_from_output(...)         # append tokens, check stops, free blocks
    outputs = detokenize(...)                            # text, stop strings, RequestOutputs

:class:`minivllm.LLM` drives this loop for offline batches; the chat REPL
drives it one step at a time to stream tokens.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass

import torch

from minivllm import backend
from minivllm.config import CacheConfig, SchedulerConfig, _require, cdiv
from minivllm.detokenizer import IncrementalDetokenizer
from minivllm.dtype import DTYPES as _DTYPES
from minivllm.dtype import resolve_dtype  # noqa: F401  (re-exported: callers import it here)
from minivllm.engine.executor import make_executor
from minivllm.engine.launcher import check_executor_backend
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.pipeline import BatchQueue
from minivllm.model.llama import op_range
from minivllm.model.quantization import check_quantization
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput, StepStats
from minivllm.pp_stages import parse_partition
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SEED_MAX, SEED_MIN, RequestOutputKind, SamplingParams
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.proposer import num_lookahead_tokens
from minivllm.spec_decode.step import SpecDecoder, SpecStats

logger = logging.getLogger("minivllm")



def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` is the first CUDA device if there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _max_model_len(requested: int | None, hf_config) -> int:
    """``max_model_len``: the request, else the model's limit; never past a sliding window.

    A model with a sliding window (Mistral 7B v0.1: 4096) attends only to its
    last ``sliding_window`` tokens. minivllm's attention attends to the whole
    context, which is the same thing while no sequence is longer than the
    window, so the length is capped there (see docs/models.md).
    """
    max_pos = getattr(hf_config, "max_position_embeddings", 2048)
    if requested is not None and requested > max_pos:
        raise ValueError(f"max_model_len must be at most the model's max_position_embeddings "
                         f"({max_pos}), got {requested}")
    window = getattr(hf_config, "sliding_window", None)
    if not getattr(hf_config, "use_sliding_window", True) or not isinstance(window, int):
        return requested or max_pos
    if requested is not None and requested > window:
        raise ValueError(f"max_model_len must be at most the model's sliding_window ({window}: "
                         f"minivllm has no sliding-window attention), got {requested}")
    if requested is None and max_pos > window:
        logger.warning("minivllm: max_model_len capped at the model's sliding_window (%d) "
                       "instead of max_position_embeddings (%d): minivllm attends to the "
                       "whole context, which equals sliding-window attention only up to "
                       "the window", window, max_pos)
    return requested or min(max_pos, window)


@dataclass
class EngineConfig:
    """Everything :class:`LLMEngine` needs; :class:`minivllm.LLM` takes the same names.

    ``kv_cache_memory`` (bytes) sizes the KV pool on a CPU;
    ``gpu_memory_utilization`` (fraction of the GPU's memory the whole engine
    may use) sizes it on CUDA. ``num_gpu_blocks_override`` fixes the number of
    blocks directly (tests use it to force preemption).
    ``distributed_executor_backend`` says who starts the ranks: None
    (choose), ``"uni"``, ``"mp"`` or ``"external_launcher"`` (``torchrun``;
    see :mod:`minivllm.engine.launcher`).
    ``speculative_config`` (vLLM's dict, or a
    :class:`~minivllm.spec_decode.config.SpeculativeConfig`) turns on
    speculative decoding (docs/speculative_decoding.md).
    """

    model: str = "smollm2"
    backend: backend.BackendSpec | None = None
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_layer_partition: str | None = None
    enforce_eager: bool = False
    quantization: str | None = None
    speculative_config: SpeculativeConfig | dict | None = None
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        """Check every field before anything is loaded (one ``_require`` rule each)."""
        _require(isinstance(self.model, str) and bool(self.model), "model", self.model,
                 "a registered name, a model directory or a .gguf path")
        if self.backend is not None:
            backend.validate_spec(self.backend)
        dtypes = ("auto", *sorted(_DTYPES))
        _require(self.dtype in _DTYPES.values() if isinstance(self.dtype, torch.dtype)
                 else isinstance(self.dtype, str) and self.dtype in dtypes,
                 "dtype", self.dtype, f"one of {dtypes} or torch.float32/float16/bfloat16")
        _require(isinstance(self.device, (str, torch.device)) and _is_device(self.device),
                 "device", self.device, "'auto', 'cpu', or 'cuda' / 'cuda:N' of a GPU here")
        _require(_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX, "seed", self.seed,
                 f"an int in [{SEED_MIN}, {SEED_MAX}] (torch.Generator's range)")
        for name, lo, hi in _INT_RANGES:
            value = getattr(self, name)
            if value is None and name in ("max_model_len", "num_gpu_blocks_override"):
                continue
            _require(_is_int(value) and lo <= value <= hi, name, value,
                     f"an int in [{lo}, {hi}]")
        check_quantization(self.quantization)
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        check_executor_backend(self.distributed_executor_backend)
        parse_partition(self.pp_layer_partition)  # its fit to the model: once it is known
        if self.speculative_config is not None and self.pipeline_parallel_size > 1:
            raise ValueError(
                "speculative_config needs pipeline_parallel_size=1 (the pipeline's batch "
                f"queue does not verify drafts), got {self.pipeline_parallel_size}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager"):
            _require(isinstance(getattr(self, name), bool), name, getattr(self, name),
                     "True or False")
        g = self.gpu_memory_utilization
        _require(isinstance(g, (int, float)) and not isinstance(g, bool) and 0.0 < g <= 1.0,
                 "gpu_memory_utilization", g, "a number in (0, 1]")
        memory = _physical_memory()
        _require(self.kv_cache_memory <= memory, "kv_cache_memory", self.kv_cache_memory,
                 f"at most this machine's memory ({memory} bytes)")
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            _require(self.max_num_batched_tokens >= self.max_model_len,
                     "max_num_batched_tokens", self.max_num_batched_tokens,
                     f">= max_model_len={self.max_model_len} when chunked prefill is off")


#: (field, lowest, highest) of EngineConfig's int fields. The upper bounds keep
#: a typo from allocating a block table or a pool no machine has.
_INT_RANGES = (
    ("block_size", 1, 256),
    ("max_num_seqs", 1, 1 << 16),
    ("max_num_batched_tokens", 1, 1 << 24),
    ("max_model_len", 1, 1 << 24),
    ("kv_cache_memory", 1, 1 << 62),
    ("num_gpu_blocks_override", 1, 1 << 24),
    ("tensor_parallel_size", 1, 1024),
    ("pipeline_parallel_size", 1, 1024),
)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_device(device: str | torch.device) -> bool:
    """``"auto"``, the CPU, or a CUDA device this machine has."""
    if device == "auto":
        return True
    try:
        device = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        return False
    if device.type == "cuda":
        return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    return device.type == "cpu"


def _physical_memory() -> int:
    """Bytes of RAM on this machine (a huge number where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


class _RequestState:
    """Per-request bookkeeping the engine keeps beside the scheduler's Request."""

    def __init__(self, prompt: str | None, detokenizer: IncrementalDetokenizer,
                 sampling_params: SamplingParams) -> None:
        want_logprobs = sampling_params.logprobs is not None
        self.prompt = prompt
        self.detokenizer = detokenizer
        self.output_kind = sampling_params.output_kind
        self.logprobs: list[dict[int, Logprob]] | None = [] if want_logprobs else None
        self.cumulative_logprob = 0.0 if want_logprobs else None
        self.num_sent_tokens = 0  # output tokens already handed out (DELTA)


class LLMEngine:
    """The offline inference engine: add requests, then call :meth:`step` until done."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # The swap layer's choice, resolved ONCE for this engine and passed down:
        # nothing below reads the process-global spec (see backend.Components).
        self.components = backend.Components.resolve(config.backend)
        self.backend_spec = self.components.spec
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        self.executor = make_executor(config.model, dtype, device,
                                      config.tensor_parallel_size, self.components,
                                      config.quantization, config.pipeline_parallel_size,
                                      config.pp_layer_partition,
                                      config.distributed_executor_backend)
        # Pipeline stages overlap with micro-batches in flight (engine/pipeline.py).
        self.batch_queue = (BatchQueue(self) if
                            getattr(self.executor, "max_concurrent_batches", 1) > 1 else None)
        self.tokenizer = self.executor.tokenizer
        hf_config = self.executor.hf_config
        self.vocab_size = hf_config.vocab_size
        max_model_len = _max_model_len(config.max_model_len, hf_config)
        num_blocks = self._num_kv_blocks(device, dtype)
        # The KV cache and the block table live on every rank (the worker's).
        self.executor.init_kv_cache(num_blocks, config.block_size, config.max_num_seqs,
                                    cdiv(max_model_len, config.block_size))
        worker = getattr(self.executor, "worker", None)
        if device.type == "cuda" and not config.enforce_eager and \
                config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1 \
                and worker is not None:
            worker.capture_cuda_graphs(config.max_num_seqs, max_model_len, config.block_size)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            num_lookahead_tokens=num_lookahead_tokens(config.speculative_config),
        )
        self.cache_config = CacheConfig(config.block_size, num_blocks,
                                        config.enable_prefix_caching)
        self.scheduler = self.components.scheduler.Scheduler(
            self.scheduler_config, self.cache_config, components=self.components
        )
        self.runner = ModelRunner(self.vocab_size, device, config.seed, self.components)
        self.spec = None if config.speculative_config is None else SpecDecoder(
            config.speculative_config, self.components, self.vocab_size, max_model_len,
            executor=self.executor)
        self.device, self.dtype = device, dtype
        self.eos_token_id = self.tokenizer.eos_token_id
        self.states: dict[str, _RequestState] = {}
        self._ids = itertools.count()
        self._step_index = itertools.count()
        logger.info(
            "minivllm: %d KV blocks of %d tokens: at most %d tokens cached at once "
            "(max_model_len %d); backends %s",
            num_blocks, config.block_size, num_blocks * config.block_size,
            max_model_len, self.components.describe(),
        )

    # -- set-up ---------------------------------------------------------------

    def _num_kv_blocks(self, device: torch.device, dtype: torch.dtype) -> int:
        """Size the KV pool from the memory budget."""
        cfg = self.config
        per_block = self.executor.bytes_per_block(cfg.block_size)
        if cfg.num_gpu_blocks_override is not None:
            need = cfg.num_gpu_blocks_override * per_block
            have = (torch.cuda.mem_get_info(device)[0] if device.type == "cuda"
                    else _physical_memory())
            _require(need <= have, "num_gpu_blocks_override", cfg.num_gpu_blocks_override,
                     f"at most {have // per_block} here (blocks of {per_block} bytes)")
            return cfg.num_gpu_blocks_override
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            # Our share of the GPU minus what we hold already (weights), never more than
            # is free (other processes may use the GPU too), minus room for activations.
            ours = torch.cuda.memory_reserved(device)
            activation_reserve = 2 << 30
            budget = min(int(total * cfg.gpu_memory_utilization) - ours, free) \
                - activation_reserve
        else:
            budget = cfg.kv_cache_memory
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"the KV-cache budget ({budget} bytes) is smaller than one block "
                f"({per_block} bytes); raise kv_cache_memory / gpu_memory_utilization"
            )
        return num_blocks

    # -- requests -------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int],
                        sampling_params: SamplingParams) -> None:
        """Raise ``ValueError`` if this prompt can never be served.

        Checks what the engine knows before scheduling: the types, an empty
        prompt, prompt + max_tokens beyond max_model_len (before looking at
        the ids, so a huge prompt costs nothing), and token ids outside the
        vocabulary. (The scheduler also refuses a request that needs more KV
        blocks than the whole pool.)
        """
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, "
                             f"got {type(sampling_params).__name__}")
        if not isinstance(prompt_token_ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of ints, "
                             f"got {type(prompt_token_ids).__name__}")
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        # The length first: a huge prompt is refused without scanning it.
        max_len = self.scheduler_config.max_model_len
        max_tokens = sampling_params.max_tokens
        need = len(prompt_token_ids) + (max_tokens if isinstance(max_tokens, int) else 1)
        if need > max_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                f"({max_tokens}) must be at most max_model_len={max_len}"
            )
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids
               if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids must be ints in [0, {vocab}), got {bad[:5]}")

    def add_request(
        self,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
    ) -> str:
        """Validate, build and queue one request; return its id. Atomic.

        Everything the request needs is checked and built first: its
        sampling parameters (checked again, since a ``SamplingParams`` can be
        changed after it was made), its prompt, its own generator (for a
        seed), its detokenizer and stop strings. Only then does the scheduler
        see it, as the last step that can refuse it (a request that can never
        fit). So on any error the request is nowhere: not in the scheduler,
        the runner or the engine's states.
        """
        self.validate_prompt(prompt_token_ids, sampling_params)
        sampling_params.verify()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        if request_id in self.states:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        request = Request(request_id, prompt_token_ids, sampling_params, self.eos_token_id)
        generator = self.runner.make_generator(request)
        detok = IncrementalDetokenizer.from_request(self.tokenizer, request)
        state = _RequestState(prompt, detok, sampling_params)
        self.scheduler.add_request(request)  # raises ValueError if it can never fit
        # Nothing below can fail: the request is now in the engine, whole.
        self.runner.add_request(request, generator)
        self.states[request_id] = state
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now and free their KV blocks."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self._forget(rid)

    def _forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.runner.remove_request(request_id)
        if self.spec is not None:
            self.spec.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        busy = self.batch_queue is not None and self.batch_queue.busy
        return busy or self.scheduler.has_unfinished_requests()

    # -- the step ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that made progress."""
        return self.step_with_stats()[0]

    def step_with_stats(self) -> tuple[list[RequestOutput], StepStats]:
        """:meth:`step`, plus a :class:`~minivllm.outputs.StepStats` record of what it did.

        With pipeline parallelism a step either sends a new micro-batch or
        finishes the oldest one (:mod:`minivllm.engine.pipeline`).
        """
        if self.batch_queue is not None:
            return self.batch_queue.step_with_stats()
        with op_range("schedule"):
            scheduler_output = self.scheduler.schedule()
        decode_ids = self.decode_ids(scheduler_output)
        step = next(self._step_index)
        outputs: list[RequestOutput] = []
        spec_stats = SpecStats()
        # A step without tokens still carries block-table changes (aborts,
        # preemptions) that every worker's table must see before the next one.
        if not scheduler_output.is_empty or scheduler_output.removed_req_ids:
            outputs, spec_stats = self._run_step(scheduler_output, step)
        stats = self.make_step_stats(scheduler_output, decode_ids, outputs, step, spec_stats)
        return outputs, stats

    @staticmethod
    def decode_ids(so) -> frozenset[str]:
        """The scheduled decodes (one token, plus its drafts): known only before the step
        advances the requests."""
        if so is None:
            return frozenset()
        spec_tokens = so.scheduled_spec_decode_tokens
        return frozenset(
            r.request_id for r in so.scheduled_requests
            if so.num_scheduled_tokens[r.request_id] == 1 + len(spec_tokens.get(r.request_id, ()))
            and r.num_computed_tokens >= r.num_prompt_tokens
        )

    def make_step_stats(self, so, decode_ids: frozenset[str], outputs: list[RequestOutput],
                        step: int | None = None, spec: SpecStats | None = None) -> StepStats:
        """The step's record: what ``so`` (a SchedulerOutput; None: nothing scheduled) ran.

        ``step``: its index (None: the next one); ``spec``: its drafts' counts.
        """
        spec = SpecStats() if spec is None else spec
        return StepStats(
            step=next(self._step_index) if step is None else step,
            num_scheduled_tokens={} if so is None else dict(so.num_scheduled_tokens),
            decode_req_ids=decode_ids,
            preempted_req_ids=() if so is None else tuple(so.preempted_req_ids),
            finished_req_ids=tuple(o.request_id for o in outputs if o.finished),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=self.cache_config.num_blocks,
            num_free_blocks=self.scheduler.num_free_blocks,
            num_prefix_cache_queries=0 if so is None else so.num_prefix_cache_queries,
            num_prefix_cache_hits=0 if so is None else so.num_prefix_cache_hits,
            num_drafts=spec.num_drafts,
            num_draft_tokens=spec.num_draft_tokens,
            num_accepted_tokens=spec.num_accepted_tokens,
            num_accepted_tokens_per_pos=spec.num_accepted_tokens_per_pos,
        )

    def _run_step(self, scheduler_output, step: int) -> tuple[list[RequestOutput], SpecStats]:
        """Prepare inputs, run the model, sample and detokenize one scheduled batch.

        With speculative decoding the sampling is a verification
        (:class:`~minivllm.spec_decode.step.SpecDecoder`), a request emits
        one or more tokens, and new drafts are proposed at the end.

        Isolation: a failure that belongs to one request (building its inputs,
        sampling it, detokenizing it, matching its stop strings) ends that
        request alone with ``finish_reason="error"`` and the exception on its
        :class:`~minivllm.outputs.RequestOutput`; its blocks are freed and
        the step goes on for the others. Only the forward pass (the executor,
        every rank together) is fatal: it raises out of the step.
        """
        outputs, step_input, sampling_reqs = self.prepare_step(scheduler_output)
        with op_range("forward"):
            logits = self.executor.execute_model(step_input)
        more, spec_stats = self._finish(scheduler_output, sampling_reqs, logits, step)
        return outputs + more, spec_stats

    def prepare_step(self, scheduler_output):
        """``(outputs of requests that failed, step input, requests to sample)``."""
        with op_range("prepare_inputs"):
            step_input, sampling_reqs, failed = self.runner.prepare_inputs(scheduler_output)
        by_id = {r.request_id: r for r in scheduler_output.scheduled_requests}
        outputs = [self._fail(by_id[rid], e) for rid, e in failed.items()]
        return outputs, step_input, sampling_reqs

    def finish_step(self, scheduler_output, sampling_reqs: list[Request],
                    logits: torch.Tensor | None) -> list[RequestOutput]:
        """Sample ``logits``, update the scheduler and detokenize: the outputs.

        The pipeline's batch queue calls this (speculative decoding and
        pipeline parallelism do not combine; the config refuses it).
        """
        return self._finish(scheduler_output, sampling_reqs, logits, step=None)[0]

    def _finish(self, scheduler_output, sampling_reqs: list[Request],
                logits: torch.Tensor | None, step: int | None
                ) -> tuple[list[RequestOutput], SpecStats]:
        outputs: list[RequestOutput] = []
        spec_stats = SpecStats()
        if logits is None:
            return outputs, spec_stats  # only block-table changes (or nothing left) this step
        with op_range("sample"):
            # A step of prefill chunks alone samples nothing, but still advances them.
            if not sampling_reqs:
                rows = []
            elif self.spec is None or not scheduler_output.scheduled_spec_decode_tokens:
                # No drafts this step: the plain sampler (rejection_sample with k = 0
                # gives the same tokens, at a higher cost).
                rows = self._sample(logits, sampling_reqs, outputs)
            else:
                rows, spec_stats = self.spec.sample(
                    self.runner, logits, sampling_reqs, scheduler_output, step,
                    fail=lambda req, e: outputs.append(self._fail(req, e)))
        num_before = {r.request_id: r.num_output_tokens for r, _, _ in rows}
        sampled = {r.request_id: tokens for r, tokens, _ in rows}
        finished = self.scheduler.update_from_output(scheduler_output, sampled)
        # What the scheduler kept: a stop inside an accepted run drops the rest.
        rows = [(r, r.output_token_ids[num_before[r.request_id]:], lp) for r, _, lp in rows]
        with op_range("detokenize"):
            outputs += self._make_outputs(rows, finished)
        if self.spec is not None:
            with op_range("propose"):
                self.spec.propose(self.scheduler.running, step + 1)
        return outputs, spec_stats

    def _sample(self, logits: torch.Tensor, reqs: list[Request],
                outputs: list[RequestOutput]) -> list[tuple[Request, list[int], list | None]]:
        """Sample every row; ``(request, [token], [logprob row])`` for each that did.

        If the batched sampler raises, each row is sampled on its own (from
        the generator states it had before) to find the requests it belongs
        to; those are failed (their outputs appended to ``outputs``).
        """
        runner = self.runner
        seeded = {r.request_id: runner.seeded_generators[r.request_id].get_state()
                  for r in reqs if r.request_id in runner.seeded_generators}
        try:
            return _rows(runner.sample(logits, reqs), reqs)
        except Exception:  # noqa: BLE001 -- find whose it is, below
            pass
        rows = []
        for i, req in enumerate(reqs):
            if req.request_id in seeded:
                runner.seeded_generators[req.request_id].set_state(seeded[req.request_id])
            try:
                rows += _rows(runner.sample(logits[i : i + 1], [req]), [req])
            except Exception as e:  # noqa: BLE001 -- it belongs to this request alone
                outputs.append(self._fail(req, e))
        return rows

    def _make_outputs(self, rows, finished) -> list[RequestOutput]:
        """Detokenize, match stop strings and build each sampled request's output."""
        finished_ids = {r.request_id for r in finished}
        outputs = []
        for req, tokens, lp_rows in rows:
            state = self.states.get(req.request_id)
            if state is None or not tokens:
                continue
            try:
                output = self._advance(req, state, tokens, lp_rows, finished_ids)
            except Exception as e:  # noqa: BLE001 -- it belongs to this request alone
                outputs.append(self._fail(req, e))
                continue
            if output is not None:
                outputs.append(output)
            if req.request_id in finished_ids:
                self._forget(req.request_id)
        return outputs

    def _advance(self, req: Request, state: _RequestState, tokens: list[int], lp_rows,
                 finished_ids: set[str]) -> RequestOutput | None:
        """One request's new tokens: their logprobs, text and stop strings; its output.

        Token by token, so that a stop string inside a speculative run ends
        the request at the token plain decoding would have ended it at: the
        tokens after it are taken back off the request.
        """
        for i, token in enumerate(tokens):
            if state.logprobs is not None and lp_rows is not None:
                logprobs = self._logprob_dict(req, *lp_rows[i])
                state.logprobs.append(logprobs)
                state.cumulative_logprob += logprobs[token].logprob
            stop_str = state.detokenizer.update([token])
            if stop_str is None:
                continue
            req.stop_reason = stop_str
            num_after = len(tokens) - 1 - i
            if num_after:
                del req.output_token_ids[-num_after:]
                del req.all_token_ids[-num_after:]
            if req.request_id not in finished_ids:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                finished_ids.add(req.request_id)
            elif num_after:  # the scheduler stopped it at a later token
                req.status = RequestStatus.FINISHED_STOPPED
            break
        return self._output(req, state, req.request_id in finished_ids)

    def _fail(self, req: Request, error: Exception) -> RequestOutput:
        """End ``req`` alone after a failure of its own: free its blocks, report ``error``."""
        logger.warning("minivllm: request %r failed and was aborted: %s: %s",
                       req.request_id, type(error).__name__, error)
        self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
        req.status = RequestStatus.FINISHED_ERROR  # also if it had finished this step
        state = self.states.get(req.request_id)
        first = 0
        if state is not None and state.output_kind == RequestOutputKind.DELTA:
            first = state.num_sent_tokens
        completion = CompletionOutput(
            index=0,
            # A delta stream has had the text it may see; cumulative ones get it whole.
            text="" if state is None or state.output_kind == RequestOutputKind.DELTA
            else state.detokenizer.output_text,
            token_ids=req.output_token_ids[first:],
            cumulative_logprob=None if state is None else state.cumulative_logprob,
            logprobs=None,
            finish_reason=req.get_finished_reason(),
        )
        self._forget(req.request_id)
        return RequestOutput(
            request_id=req.request_id,
            prompt=None if state is None else state.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=True,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            error=error,
        )

    def _logprob_dict(self, req: Request, ids: list[int], vals: list[float],
                      rank: int) -> dict[int, Logprob]:
        """``{token_id: Logprob}`` for one row: the sampled token, then the top-n."""
        decode = self.tokenizer.convert_ids_to_tokens
        n = req.sampling_params.logprobs or 0
        ids, vals = ids[: n + 1], vals[: n + 1]
        d = {ids[0]: Logprob(vals[0], rank=rank, decoded_token=decode(ids[0]))}
        for k in range(1, n + 1):
            d.setdefault(ids[k], Logprob(vals[k], rank=k, decoded_token=decode(ids[k])))
        return d

    def _output(self, req: Request, state: _RequestState,
                finished: bool) -> RequestOutput | None:
        """This step's output for ``req`` in its ``output_kind`` (None: nothing to report)."""
        kind = state.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind == RequestOutputKind.DELTA:
            # Only what is new; the detokenizer holds back a possible stop string.
            first = state.num_sent_tokens
            text = state.detokenizer.get_next_delta_text(finished=finished)
        else:
            first = 0
            text = state.detokenizer.output_text
        state.num_sent_tokens = req.num_output_tokens
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=req.output_token_ids[first:],
            cumulative_logprob=state.cumulative_logprob,
            logprobs=None if state.logprobs is None else state.logprobs[first:],
            finish_reason=req.get_finished_reason() if finished else None,
            stop_reason=req.stop_reason if finished else None,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=state.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=max(req.num_cached_tokens, 0),
        )

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if any."""
        self.executor.shutdown()


def _rows(sampler_output, reqs: list[Request]) -> list[tuple[Request, list[int], list | None]]:
    """Per row: the request, ``[its sampled token]`` and ``[its logprob row (ids, vals,
    rank)]`` (lists: with speculative decoding a request emits several tokens)."""
    tokens = sampler_output.sampled_token_ids.tolist()
    lp = sampler_output.logprobs
    if lp is None:
        return [(r, [t], None) for r, t in zip(reqs, tokens)]
    rows = zip(lp.logprob_token_ids.tolist(), lp.logprobs.tolist(),
               lp.selected_token_ranks.tolist())
    return [(r, [t], [row]) for r, t, row in zip(reqs, tokens, rows)]
