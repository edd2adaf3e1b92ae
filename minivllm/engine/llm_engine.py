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
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from minivllm import backend
from minivllm.config import CacheConfig, SchedulerConfig, cdiv
from minivllm.detokenizer import IncrementalDetokenizer
from minivllm.engine.executor import make_executor
from minivllm.engine.model_runner import ModelRunner
from minivllm.model.quantization import check_quantization
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput, StepStats
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"`` is float32 on a CPU (fastest there) and bfloat16 on a GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` is the first CUDA device if there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass
class EngineConfig:
    """Everything :class:`LLMEngine` needs; :class:`minivllm.LLM` takes the same names.

    ``kv_cache_memory`` (bytes) sizes the KV pool on a CPU;
    ``gpu_memory_utilization`` (fraction of the GPU's memory the whole engine
    may use) sizes it on CUDA. ``num_gpu_blocks_override`` fixes the number of
    blocks directly (tests use it to force preemption).
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
    enforce_eager: bool = False
    quantization: str | None = None

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}"
            )


class _RequestState:
    """Per-request bookkeeping the engine keeps beside the scheduler's Request."""

    def __init__(self, prompt: str | None, detokenizer: IncrementalDetokenizer,
                 want_logprobs: bool) -> None:
        self.prompt = prompt
        self.detokenizer = detokenizer
        self.logprobs: list[dict[int, Logprob]] | None = [] if want_logprobs else None
        self.cumulative_logprob = 0.0 if want_logprobs else None


class LLMEngine:
    """The offline inference engine: add requests, then call :meth:`step` until done."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        spec = backend.validate_spec(config.backend if config.backend is not None
                                     else backend.get_backend())
        self.backend_spec = spec
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        with backend.use_backend(spec):
            self.executor = make_executor(config.model, dtype, device,
                                          config.tensor_parallel_size, spec, config.quantization)
            self.tokenizer = self.executor.tokenizer
            hf_config = self.executor.hf_config
            self.vocab_size = hf_config.vocab_size
            max_pos = getattr(hf_config, "max_position_embeddings", 2048)
            max_model_len = config.max_model_len or max_pos
            if max_model_len > max_pos:
                raise ValueError(
                    f"max_model_len must be at most the model's max_position_embeddings "
                    f"({max_pos}), got {max_model_len}"
                )
            num_blocks = self._num_kv_blocks(device, dtype)
            # The KV cache and the block table live on every rank (the worker's).
            self.executor.init_kv_cache(num_blocks, config.block_size, config.max_num_seqs,
                                        cdiv(max_model_len, config.block_size))
            worker = getattr(self.executor, "worker", None)
            if device.type == "cuda" and not config.enforce_eager and \
                    config.tensor_parallel_size == 1 and worker is not None:
                worker.capture_cuda_graphs(config.max_num_seqs, max_model_len,
                                           config.block_size)
            self.scheduler_config = SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
            )
            self.cache_config = CacheConfig(config.block_size, num_blocks,
                                            config.enable_prefix_caching)
            self.scheduler = backend.get("scheduler").Scheduler(
                self.scheduler_config, self.cache_config
            )
            self.runner = ModelRunner(self.vocab_size, device, config.seed)
        self.device, self.dtype = device, dtype
        self.eos_token_id = self.tokenizer.eos_token_id
        self.states: dict[str, _RequestState] = {}
        self._ids = itertools.count()
        self._step_index = itertools.count()
        logger.info(
            "minivllm: %d KV blocks of %d tokens: at most %d tokens cached at once "
            "(max_model_len %d); backends %s",
            num_blocks, config.block_size, num_blocks * config.block_size,
            max_model_len, backend.describe(spec),
        )

    # -- set-up ---------------------------------------------------------------

    def _num_kv_blocks(self, device: torch.device, dtype: torch.dtype) -> int:
        """Size the KV pool from the memory budget."""
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        per_block = self.executor.bytes_per_block(cfg.block_size)
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

        Checks what the engine knows before scheduling: an empty prompt, token
        ids outside the vocabulary, and prompt + max_tokens beyond
        max_model_len. (The scheduler also refuses a request that needs more
        KV blocks than the whole pool.)
        """
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}"
            )
        max_len = self.scheduler_config.max_model_len
        need = len(prompt_token_ids) + (sampling_params.max_tokens or 1)
        if need > max_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                f"({sampling_params.max_tokens}) must be at most max_model_len={max_len}"
            )

    def add_request(
        self,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue one request; return its id.

        Raises ``ValueError`` (and queues nothing) for an empty prompt, token
        ids outside the vocabulary, or a request that can never fit.
        """
        self.validate_prompt(prompt_token_ids, sampling_params)
        request_id = str(next(self._ids)) if request_id is None else request_id
        request = Request(request_id, prompt_token_ids, sampling_params, self.eos_token_id)
        self.scheduler.add_request(request)  # raises ValueError if it can never fit
        self.runner.add_request(request)
        detok = IncrementalDetokenizer.from_request(self.tokenizer, request)
        self.states[request_id] = _RequestState(prompt, detok,
                                                sampling_params.logprobs is not None)
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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that made progress."""
        return self.step_with_stats()[0]

    def step_with_stats(self) -> tuple[list[RequestOutput], StepStats]:
        """:meth:`step`, plus a :class:`~minivllm.outputs.StepStats` record of what it did."""
        with record_function("schedule"):
            scheduler_output = self.scheduler.schedule()
        # Which chunks are decodes is known only before the step advances the requests.
        decode_ids = frozenset(
            r.request_id for r in scheduler_output.scheduled_requests
            if scheduler_output.num_scheduled_tokens[r.request_id] == 1
            and r.num_computed_tokens >= r.num_prompt_tokens
        )
        outputs: list[RequestOutput] = []
        finished_ids: list[str] = []
        # A step without tokens still carries block-table changes (aborts,
        # preemptions) that every worker's table must see before the next one.
        if not scheduler_output.is_empty or scheduler_output.removed_req_ids:
            outputs = self._run_step(scheduler_output)
            finished_ids = [o.request_id for o in outputs if o.finished]
        stats = StepStats(
            step=next(self._step_index),
            num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
            decode_req_ids=decode_ids,
            preempted_req_ids=tuple(scheduler_output.preempted_req_ids),
            finished_req_ids=tuple(finished_ids),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=self.cache_config.num_blocks,
            num_free_blocks=self.scheduler.num_free_blocks,
            num_prefix_cache_queries=scheduler_output.num_prefix_cache_queries,
            num_prefix_cache_hits=scheduler_output.num_prefix_cache_hits,
        )
        return outputs, stats

    def _run_step(self, scheduler_output) -> list[RequestOutput]:
        """Prepare inputs, run the model, sample and detokenize one scheduled batch."""
        with record_function("prepare_inputs"):
            step_input, sampling_reqs = self.runner.prepare_inputs(scheduler_output)
        with record_function("forward"):
            logits = self.executor.execute_model(step_input)
        if scheduler_output.is_empty:
            return []  # only block-table changes this step
        with record_function("sample"):
            sampler_output = self.runner.sample(logits, sampling_reqs)
            token_ids = sampler_output.sampled_token_ids.tolist()
        sampled = {r.request_id: t for r, t in zip(sampling_reqs, token_ids)}
        finished = self.scheduler.update_from_output(scheduler_output, sampled)
        with record_function("detokenize"):
            return self._make_outputs(sampling_reqs, sampler_output, finished)

    def _make_outputs(self, sampling_reqs, sampler_output, finished) -> list[RequestOutput]:
        finished_ids = {r.request_id for r in finished}
        logprobs = self._logprob_dicts(sampler_output, sampling_reqs)
        outputs = []
        for i, req in enumerate(sampling_reqs):
            state = self.states.get(req.request_id)
            if state is None:
                continue
            token = req.output_token_ids[-1]
            stop_str = state.detokenizer.update([token])
            if stop_str is not None and req.request_id not in finished_ids:
                req.stop_reason = stop_str
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                finished_ids.add(req.request_id)
            elif stop_str is not None:
                req.stop_reason = stop_str
            if state.logprobs is not None and logprobs is not None:
                state.logprobs.append(logprobs[i])
                state.cumulative_logprob += logprobs[i][token].logprob
            outputs.append(self._output(req, state, req.request_id in finished_ids))
            if req.request_id in finished_ids:
                self._forget(req.request_id)
        return outputs

    def _logprob_dicts(self, sampler_output, reqs) -> list[dict[int, Logprob]] | None:
        """Per sampling row, ``{token_id: Logprob}``: the sampled token, then the top-n."""
        lp = sampler_output.logprobs
        if lp is None:
            return None
        decode = self.tokenizer.convert_ids_to_tokens
        ids_all, vals_all = lp.logprob_token_ids.tolist(), lp.logprobs.tolist()
        ranks = lp.selected_token_ranks.tolist()
        dicts = []
        for i, req in enumerate(reqs):
            n = req.sampling_params.logprobs or 0
            ids, vals = ids_all[i][: n + 1], vals_all[i][: n + 1]
            d = {ids[0]: Logprob(vals[0], rank=ranks[i], decoded_token=decode(ids[0]))}
            for k in range(1, n + 1):
                d.setdefault(ids[k], Logprob(vals[k], rank=k, decoded_token=decode(ids[k])))
            dicts.append(d)
        return dicts

    def _output(self, req: Request, state: _RequestState, finished: bool) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=state.detokenizer.output_text,
            token_ids=list(req.output_token_ids),
            cumulative_logprob=state.cumulative_logprob,
            logprobs=None if state.logprobs is None else list(state.logprobs),
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
