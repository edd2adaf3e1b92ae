"""The engine's configuration: :class:`EngineConfig` (every engine argument, checked) and
:class:`WorkerConfig` (what every rank needs to build its worker).

Every engine argument is checked here, once, before any weight is read: a bad
value raises ``ValueError`` naming the field, the value and the allowed range.
The environment variables minivllm honours are read here too, once, into the
config (``$MINIVLLM_PP_LAYER_PARTITION``, ``$MINIVLLM_PREPACK``,
``$MINIVLLM_TP_TIMEOUT_S``); nothing below the engine reads the environment.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from minivllm import backend
from minivllm.config import (
    SCHEDULING_POLICIES,
    _require,
    cdiv,
    check_block_size,
    check_chunked_prefill,
)
from minivllm.dtype import DTYPES
from minivllm.kv_quant import check_kv_cache_dtype
from minivllm.logits_processor import load_logits_processor
from minivllm.lora.manager import LoRAConfig
from minivllm.model.generation_config import check_generation_config
from minivllm.model.quantization import check_quantization
from minivllm.pp_stages import parse_partition
from minivllm.sampling_params import SEED_MAX, SEED_MIN
from minivllm.spec_decode.config import SpeculativeConfig

logger = logging.getLogger("minivllm")

#: The values ``distributed_executor_backend`` takes (None: choose, see
#: :func:`minivllm.executor.abstract.make_executor`).
EXECUTOR_BACKENDS = ("uni", "mp", "external_launcher")

#: (field, lowest, highest) of EngineConfig's int fields. The upper bounds keep
#: a typo from allocating a block table or a pool no machine has.
_INT_RANGES = (
    ("max_num_seqs", 1, 1 << 16),
    ("max_num_batched_tokens", 1, 1 << 24),
    ("max_model_len", 1, 1 << 24),
    ("kv_cache_memory", 1, 1 << 62),
    ("num_gpu_blocks_override", 1, 1 << 24),
    ("tensor_parallel_size", 1, 1024),
    ("pipeline_parallel_size", 1, 1024),
    ("max_logprobs", -1, 1 << 24),
)


def check_executor_backend(value: object) -> None:
    """Refuse a ``distributed_executor_backend`` that is not None or one of :data:`EXECUTOR_BACKENDS`."""
    if value is not None and value not in EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend must be None (choose) or one of "
                         f"{list(EXECUTOR_BACKENDS)}, got {value!r}")


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` is the first CUDA device if there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def physical_memory() -> int:
    """Bytes of RAM on this machine (a huge number where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def max_model_len_for(requested: int | None, hf_config: Any) -> int:
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


@dataclass(frozen=True)
class WorkerConfig:
    """What every rank needs to build its :class:`~minivllm.worker.worker.Worker`.

    Made by :meth:`EngineConfig.worker_config` (or directly, in tests and
    tutorials), and pickled to every worker process as it is.

    Attributes:
        model: a registered name, an HF model directory or a ``.gguf`` file.
        dtype: weight and activation dtype.
        device: the device of rank 0 (the others follow it, see
            :func:`~minivllm.executor.ranks.rank_devices`).
        tensor_parallel_size: ranks per pipeline stage.
        pipeline_parallel_size: pipeline stages.
        pp_layer_partition: layers per stage, or None for the rule
            (:func:`minivllm.pp_stages.get_pp_indices`).
        quantization: None, ``"int8"``, ``"int4"`` or ``"gguf"``.
        kv_cache_dtype: how the KV cache is stored: ``"auto"`` (the model's
            dtype), ``"int8"``, ``"fp8"`` / ``"fp8_e4m3"`` (with a float32
            scale per token and KV head, :mod:`minivllm.kv_quant`).
        enforce_eager: the model's own forward on every step (no CUDA graph,
            no C++ layer stack).
        prepack: let linear layers keep a prepacked copy of their weight: float
            weights for the GEMM, and on AVX512-VNNI int8 / 4-bit weights with int8
            activations for batch 1 (``$MINIVLLM_PREPACK=0`` turns it off).
        timeout_s: how long a collective waits for a peer before failing.
        lora_config: the LoRA slots every rank keeps (``enable_lora``); None: no LoRA.
        seed: the seed of the sampling worker's generator for unseeded requests.
        speculative_config: speculative decoding's settings (the sampling worker
            verifies and proposes the drafts); None: none.
        logits_processors: custom logits-processor classes the sampling worker runs.
    """

    model: str
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    prepack: bool = True
    timeout_s: float = 60.0
    lora_config: LoRAConfig | None = None
    seed: int = 0
    speculative_config: Any = None
    logits_processors: tuple = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", torch.device(self.device))
        object.__setattr__(self, "pp_layer_partition", parse_partition(self.pp_layer_partition))

    @property
    def num_speculative_tokens(self) -> int:
        """``k`` of speculative decoding (0 without it)."""
        spec = self.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    @property
    def num_ranks(self) -> int:
        """``tensor_parallel_size x pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineConfig:
    """Everything :class:`~minivllm.engine.llm_engine.LLMEngine` needs; :class:`minivllm.LLM`
    takes the same names.

    ``kv_cache_memory`` (bytes) sizes the KV pool on a CPU;
    ``gpu_memory_utilization`` (fraction of the GPU's memory the whole engine
    may use) sizes it on CUDA. ``num_gpu_blocks_override`` fixes the number of
    blocks directly (tests use it to force preemption).
    ``distributed_executor_backend`` says who starts the ranks: None
    (choose), ``"uni"``, ``"mp"`` or ``"external_launcher"`` (``torchrun``).
    ``speculative_config`` (vLLM's dict, or a
    :class:`~minivllm.spec_decode.config.SpeculativeConfig`) turns on
    speculative decoding (docs/speculative_decoding.md).
    ``enforce_eager`` runs the model's own forward on every device (no CUDA
    graph, no C++ layer stack), so a breakpoint in the model fires.
    ``enable_lora`` serves LoRA adapters (``LoRARequest`` per prompt, docs/lora.md):
    ``max_loras`` distinct adapters in one step, of rank at most ``max_lora_rank``,
    ``max_cpu_loras`` kept loaded in host memory.
    ``kv_cache_dtype`` (vLLM's name) stores the KV cache in the model's dtype
    (``"auto"``) or quantized, ``"int8"`` or ``"fp8"`` (= ``"fp8_e4m3"``), with
    a float32 scale per token and KV head: 3.8x the tokens of a float32 cache
    at head_dim 64, 1.9x of a bf16 one (docs/kv_cache.md).
    ``max_logprobs`` (vLLM's, default 20): the most ``logprobs`` (or
    ``prompt_logprobs``) a request may ask for; -1 lifts the cap (then -1, the
    whole vocabulary, is allowed).
    ``scheduling_policy`` (vLLM's): ``"fcfs"`` or ``"priority"`` (requests' own
    ``priority``, lower first; see :mod:`minivllm.ref.scheduler`).
    ``generation_config`` (vLLM's): ``"auto"`` takes the model's
    ``generation_config.json`` (its recommended sampling defaults and every EOS id),
    ``"vllm"`` ignores it, a folder reads it from there
    (:mod:`minivllm.model.generation_config`).
    ``structured_outputs_compile_timeout_s`` caps the compilation of one
    request's constraint (a JSON schema, regex, choice or grammar; None: no
    cap): a constraint that takes longer is refused with a ``ValueError``.
    ``logits_processors`` (vLLM's): custom
    :class:`~minivllm.logits_processor.LogitsProcessor` classes, or their
    ``"pkg.module:Class"`` / ``"pkg.module.Class"`` paths, applied to every
    step's logits after the built-ins (docs/sampling.md); loaded here, once.

    Read once from the environment when left at None: ``pp_layer_partition``
    (``$MINIVLLM_PP_LAYER_PARTITION``), ``prepack`` (``$MINIVLLM_PREPACK``,
    default on) and ``distributed_timeout_s`` (``$MINIVLLM_TP_TIMEOUT_S``,
    default 60).
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
    pp_layer_partition: str | tuple[int, ...] | None = None
    enforce_eager: bool = False
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    speculative_config: SpeculativeConfig | dict | None = None
    distributed_executor_backend: str | None = None
    prepack: bool | None = None
    distributed_timeout_s: float | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    structured_outputs_compile_timeout_s: float | None = 10.0
    generation_config: str = "auto"
    max_logprobs: int = 20
    logits_processors: tuple | list | None = None
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        """Check every field before anything is loaded (one rule each); read the environment."""
        _require(isinstance(self.model, str) and bool(self.model), "model", self.model,
                 "a registered name, a model directory or a .gguf path")
        if self.backend is not None:
            backend.validate_spec(self.backend)
        dtypes = ("auto", *sorted(DTYPES))
        _require(self.dtype in DTYPES.values() if isinstance(self.dtype, torch.dtype)
                 else isinstance(self.dtype, str) and self.dtype in dtypes,
                 "dtype", self.dtype, f"one of {dtypes} or torch.float32/float16/bfloat16")
        _require(isinstance(self.device, (str, torch.device)) and _is_device(self.device),
                 "device", self.device, "'auto', 'cpu', or 'cuda' / 'cuda:N' of a GPU here")
        _require(_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX, "seed", self.seed,
                 f"an int in [{SEED_MIN}, {SEED_MAX}] (torch.Generator's range)")
        check_block_size(self.block_size)
        for name, lo, hi in _INT_RANGES:
            value = getattr(self, name)
            if value is None and name in ("max_model_len", "num_gpu_blocks_override"):
                continue
            _require(_is_int(value) and lo <= value <= hi, name, value,
                     f"an int in [{lo}, {hi}]")
        check_quantization(self.quantization)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        check_executor_backend(self.distributed_executor_backend)
        _require(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
                 self.scheduling_policy, f"one of {SCHEDULING_POLICIES}")
        if self.pp_layer_partition is None:
            self.pp_layer_partition = os.environ.get("MINIVLLM_PP_LAYER_PARTITION") or None
        # Its fit to the model is checked once the model's layer count is known.
        self.pp_layer_partition = parse_partition(self.pp_layer_partition)
        if self.speculative_config is not None and self.pipeline_parallel_size > 1:
            raise ValueError(
                "speculative_config needs pipeline_parallel_size=1 (a micro-batch in flight "
                f"cannot verify drafts), got {self.pipeline_parallel_size}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager",
                     "enable_lora"):
            _require(isinstance(getattr(self, name), bool), name, getattr(self, name),
                     "True or False")
        if self.prepack is None:
            self.prepack = os.environ.get("MINIVLLM_PREPACK", "1") != "0"
        _require(isinstance(self.prepack, bool), "prepack", self.prepack, "True or False")
        if self.distributed_timeout_s is None:
            raw = os.environ.get("MINIVLLM_TP_TIMEOUT_S", "60")
            try:
                self.distributed_timeout_s = float(raw)
            except ValueError:
                raise ValueError(f"$MINIVLLM_TP_TIMEOUT_S must be a number of seconds, "
                                 f"got {raw!r}") from None
        t = self.distributed_timeout_s
        _require(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= 86400,
                 "distributed_timeout_s", t, "a number of seconds in (0, 86400]")
        c = self.structured_outputs_compile_timeout_s
        _require(c is None or isinstance(c, (int, float)) and not isinstance(c, bool)
                 and 0 < c <= 86400, "structured_outputs_compile_timeout_s", c,
                 "None or a number of seconds in (0, 86400]")
        g = self.gpu_memory_utilization
        _require(isinstance(g, (int, float)) and not isinstance(g, bool) and 0.0 < g <= 1.0,
                 "gpu_memory_utilization", g, "a number in (0, 1]")
        memory = physical_memory()
        _require(self.kv_cache_memory <= memory, "kv_cache_memory", self.kv_cache_memory,
                 f"at most this machine's memory ({memory} bytes)")
        check_chunked_prefill(self.enable_chunked_prefill, self.max_num_batched_tokens,
                              self.max_model_len)
        check_generation_config(self.generation_config)
        procs = self.logits_processors
        _require(procs is None or isinstance(procs, (list, tuple)), "logits_processors", procs,
                 "None or a list of LogitsProcessor classes or 'pkg.module:Class' paths")
        self.logits_processors = tuple(load_logits_processor(p) for p in procs or ())
        self.lora_config()  # max_loras, max_lora_rank, max_cpu_loras: ValueError names one

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA slots' settings, checked; None without ``enable_lora``."""
        config = LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
        return config if self.enable_lora else None

    def worker_config(self, dtype: torch.dtype, device: torch.device) -> WorkerConfig:
        """What every rank needs, with ``dtype`` and ``device`` resolved (``"auto"`` decided)."""
        return WorkerConfig(
            model=self.model, dtype=dtype, device=device,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            pp_layer_partition=self.pp_layer_partition, quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype, enforce_eager=self.enforce_eager,
            prepack=self.prepack,
            timeout_s=float(self.distributed_timeout_s), lora_config=self.lora_config(),
            seed=self.seed, logits_processors=tuple(self.logits_processors),
            speculative_config=self.speculative_config)


def num_kv_blocks(config: EngineConfig, bytes_per_block: int, device: torch.device,
                  max_model_len: int, num_lookahead_tokens: int = 0) -> int:
    """How many KV blocks the memory budget holds (``bytes_per_block``: one rank's block).

    On a CPU the budget is ``kv_cache_memory``; on CUDA it is the engine's
    share of the GPU (``gpu_memory_utilization``) minus what it already holds
    (the weights), never more than is free, minus room for activations.
    ``num_gpu_blocks_override`` fixes the number instead. Either way the pool
    must hold one request of ``max_model_len`` tokens (:func:`check_kv_pool_fits`).
    """
    if config.num_gpu_blocks_override is not None:
        need = config.num_gpu_blocks_override * bytes_per_block
        have = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else physical_memory()
        _require(need <= have, "num_gpu_blocks_override", config.num_gpu_blocks_override,
                 f"at most {have // bytes_per_block} here (blocks of {bytes_per_block} bytes)")
        num_blocks = config.num_gpu_blocks_override
    else:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            ours = torch.cuda.memory_reserved(device)
            activation_reserve = 2 << 30
            budget = min(int(total * config.gpu_memory_utilization) - ours, free) \
                - activation_reserve
        else:
            budget = config.kv_cache_memory
        num_blocks = budget // bytes_per_block
    check_kv_pool_fits(config, num_blocks, bytes_per_block, device, max_model_len,
                       num_lookahead_tokens)
    return num_blocks


def check_kv_pool_fits(config: EngineConfig, num_blocks: int, bytes_per_block: int,
                       device: torch.device, max_model_len: int,
                       num_lookahead_tokens: int = 0) -> None:
    """Refuse, at engine start, a KV pool that cannot hold one request of ``max_model_len``.

    One such request needs ``ceil((max_model_len + num_lookahead_tokens) /
    block_size)`` blocks: the scheduler's own rule for a request alone
    (:meth:`minivllm.ref.scheduler.Scheduler.add_request`), with the slots a
    draft model writes ahead (``num_speculative_tokens``; none for n-gram
    drafts, which are scheduled tokens). A smaller pool would start and then
    refuse every long request when it is added. The message gives the numbers
    and the engine arguments that change them.

    ``n > 1`` and beam search are per request (``SamplingParams.n``,
    ``BeamSearchParams.beam_width``; the engine bounds neither by the pool), so
    their ``n x`` blocks are checked when such a request is added
    (:func:`minivllm.engine.sequence_groups.check_group_fits`). LoRA adds no KV.
    """
    block_size = config.block_size
    need = cdiv(max_model_len + num_lookahead_tokens, block_size)
    if need <= num_blocks:
        return
    ahead = (f" + {num_lookahead_tokens} lookahead slots (num_speculative_tokens)"
             if num_lookahead_tokens else "")
    if config.num_gpu_blocks_override is not None:
        knob = f"num_gpu_blocks_override to {need}"
    elif device.type == "cuda":
        knob = "gpu_memory_utilization"
    else:
        knob = f"kv_cache_memory to {need * bytes_per_block} bytes"
    num_blocks = max(num_blocks, 0)  # a budget below one block: none at all
    longest = num_blocks * block_size - num_lookahead_tokens
    lower = f", or lower max_model_len to {longest}" if longest >= 1 else ""
    raise ValueError(
        f"the KV cache pool is too small for one request of max_model_len={max_model_len} "
        f"tokens{ahead}: it needs {need} blocks of {block_size} tokens "
        f"({need * bytes_per_block} bytes), the pool has {num_blocks} "
        f"({num_blocks * bytes_per_block} bytes); raise {knob}{lower}")
