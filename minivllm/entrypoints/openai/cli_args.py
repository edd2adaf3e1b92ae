"""``minivllm serve``'s own arguments (vLLM's ``vllm/entrypoints/openai/cli_args.py``).

The server group, the request size caps, LoRA adapters and logging; the engine's
arguments are :mod:`minivllm.cli`'s, shared with ``generate`` and ``chat``. Nothing here
needs the ``serve`` extra, so ``minivllm serve --help`` works without it.
"""

from __future__ import annotations

import argparse
import json

from minivllm.entrypoints.openai.limits import ServingLimits
from minivllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCallOptions, get_tool_parser


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Add ``minivllm serve``'s own argument groups to ``p``."""
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default %(default)s: this machine only; "
                        "0.0.0.0 exposes it to the network)")
    g.add_argument("--port", type=int, default=8000,
                   help="port (default %(default)s; 0 picks a free one, printed at start)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and "
                        "/detokenize; /health, /metrics, /docs and /openapi.json stay open "
                        "(default: $MINIVLLM_API_KEY, which, unlike this flag, `ps` does "
                        "not show)")
    g.add_argument("--api-key-all-paths", action="store_true",
                   help="with a key, guard /health, /metrics, /docs and /openapi.json too")
    g.add_argument("--served-model-name", default=None,
                   help="the name clients send as 'model' (default: MODEL as given)")
    g.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests allowed to wait beyond --max-num-seqs; more get HTTP 503 "
                        "(default %(default)s)")
    g.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="the Jinja chat template for every chat request (a file, or the "
                        "template itself) instead of the tokenizer's")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="take a request's own chat_template (a template is code the server "
                        "runs; without this flag such a request is a 400, as in vLLM)")
    g = p.add_argument_group("tool calling (tool_choice 'required' and named functions need "
                             "none of this)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="answer tool_choice 'auto' (OpenAI's default when a request has tools): "
                        "the model writes its calls in its own format, which "
                        "--tool-call-parser reads back as tool_calls; without this flag such "
                        "a request is a 400, as in vLLM")
    g.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help=f"the model's tool-call format, with --enable-auto-tool-choice: "
                        f"{', '.join(TOOL_PARSERS)} (hermes: Hermes, Qwen2.5, Qwen3; "
                        f"llama3_json: Llama 3.1-3.3), or one from --tool-parser-plugin")
    g.add_argument("--tool-parser-plugin", default=None, metavar="FILE",
                   help="a Python file whose ToolParser subclasses (each with a name) join "
                        "the parsers (code the server runs)")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="leave the tools out of the chat template when a request says "
                        "tool_choice 'none' (by default the template still describes them)")
    caps = ServingLimits()
    g = p.add_argument_group("request size caps (HTTP 413 or 400 beyond them)")
    g.add_argument("--max-request-body-bytes", type=int, default=caps.max_request_body_bytes,
                   help="largest request body, in bytes (default %(default)s)")
    g.add_argument("--max-prompt-chars", type=int, default=caps.max_prompt_chars,
                   help="longest prompt in characters (a chat's messages together, "
                        "/tokenize too), checked before tokenizing (default %(default)s)")
    g.add_argument("--max-stop-strings", type=int, default=caps.max_stop_strings,
                   help="most entries in stop, and in stop_token_ids (default %(default)s)")
    g.add_argument("--max-stop-string-chars", type=int, default=caps.max_stop_string_chars,
                   help="longest stop string in characters (default %(default)s)")
    g.add_argument("--max-detokenize-tokens", type=int, default=caps.max_detokenize_tokens,
                   help="most token ids one /detokenize may send (default %(default)s)")
    g.add_argument("--max-n", type=int, default=caps.max_n,
                   help="most completions one request may ask for: n times its prompts, "
                        "and the widest use_beam_search (default %(default)s)")
    g = p.add_argument_group("LoRA adapters (with --enable-lora)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH|JSON",
                   help="adapters to serve, each chosen by a request's model field and "
                        "listed in /v1/models: name=path, or vLLM's JSON form "
                        '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "..."}\'')
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="open POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    g = p.add_argument_group("server logging")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level; 'info' logs every request")


def tool_call_options(args: argparse.Namespace) -> ToolCallOptions:
    """The tool-calling flags, checked before the model loads (``ValueError``, as vLLM's
    checks: the parser flags go together, and a parser name must exist)."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if args.tool_call_parser is None:
        if args.tool_parser_plugin is not None:
            raise ValueError("--tool-parser-plugin needs --tool-call-parser")
        return ToolCallOptions(None, args.exclude_tools_when_tool_choice_none)
    parser = get_tool_parser(args.tool_call_parser, args.tool_parser_plugin)
    if not args.enable_auto_tool_choice:
        raise ValueError("--tool-call-parser is used only with --enable-auto-tool-choice; "
                         "add it")
    return ToolCallOptions(parser, args.exclude_tools_when_tool_choice_none)


def parse_lora_module(spec: str, served_name: str) -> tuple[str, str]:
    """One ``--lora-modules`` entry, in either of vLLM's forms: ``name=path``, or JSON
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (the base model's name, if
    given, must be the served one: minivllm serves one base model). -> (name, path)."""
    if spec.lstrip().startswith("{"):
        try:
            entry = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e} in {spec!r}") from None
        unknown = sorted(set(entry) - {"name", "path", "base_model_name"}) \
            if isinstance(entry, dict) else None
        if unknown is None or unknown:
            raise ValueError(f"a JSON entry has the keys name, path and base_model_name, "
                             f"got {spec!r}")
        name, path = entry.get("name"), entry.get("path")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise ValueError(f"a JSON entry needs a non-empty name and path, got {spec!r}")
        base = entry.get("base_model_name")
        if base is not None and base != served_name:
            raise ValueError(f"base_model_name must be the served model {served_name!r}, "
                             f"got {base!r}")
        return name, path
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"expected name=path or a JSON object, got {spec!r}")
    return name, path


def load_lora_modules(engine, specs: list[str], served_name: str = "") -> dict:
    """``--lora-modules`` entries -> ``{name: LoRARequest}``, each adapter loaded (ids 1, 2, ...)."""
    from minivllm.lora.request import LoRARequest

    adapters = {}
    for i, spec in enumerate(specs, start=1):
        name, path = parse_lora_module(spec, served_name)
        if name in adapters:
            raise ValueError(f"the name {name!r} is given twice")
        adapters[name] = LoRARequest(name, i, path)
        engine.lora.check(adapters[name])  # loaded on every rank now: a bad one stops here
    return adapters
