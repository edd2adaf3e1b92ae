"""The HTTP server: ``minivllm serve [MODEL] --host 127.0.0.1 --port 8000 [--api-key KEY]``.

A FastAPI app over one :class:`~minivllm.engine.async_llm.AsyncLLM`:

=========================  ====================================================
``POST /v1/completions``   continue a prompt (OpenAI's completions API)
``POST /v1/chat/completions``  answer a conversation (the model's chat template)
``GET  /v1/models``        the served model, and its LoRA adapters (``--lora-modules``)
``POST /v1/load_lora_adapter``    load an adapter (``--allow-runtime-lora-updating``)
``POST /v1/unload_lora_adapter``  stop serving one (the same flag)
``GET  /health``           200 while the engine loop is alive, else 503
``POST /tokenize``         text or messages -> token ids
``POST /detokenize``       token ids -> text
``GET  /metrics``          Prometheus metrics (vLLM's ``vllm:...`` names)
=========================  ====================================================

Errors are OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``:
400 for a bad field or a prompt too long, 401 for a missing or wrong API key,
404 for an unknown model, 413 for a body over ``--max-request-body-bytes``,
503 when the waiting queue is full, 500 when the engine failed. The server
binds to loopback unless told otherwise. With an API key (``--api-key`` or
``$MINIVLLM_API_KEY``), every path needs ``Authorization: Bearer KEY``
(compared in constant time) except :data:`OPEN_PATHS`: ``/health``,
``/metrics``, ``/docs`` and ``/openapi.json`` stay open for health checks and
Prometheus scrapers, as in vLLM, unless ``--api-key-all-paths`` guards them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import threading
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.engine.async_llm import AsyncLLM, EngineDeadError
from minivllm.entrypoints.chat_utils import ChatTemplates
from minivllm.entrypoints.openai.limits import ServingLimits
from minivllm.entrypoints.openai.metrics import PrometheusStatLogger
from minivllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from minivllm.entrypoints.openai.serving import OpenAIServing
from minivllm.entrypoints.openai.tool_parsers import ToolCallOptions

logger = logging.getLogger("minivllm")


class SSEResponse(StreamingResponse):
    """A Server-Sent-Events response that always closes its generator.

    Closing it runs the generator's ``finally`` blocks, which abort the
    engine requests behind a stream whose client went away.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def cancel_on_disconnect(request: Request, work):
    """Await ``work``, unless the client hangs up first: then cancel it.

    A non-streamed completion is awaited whole before anything is sent, so
    without this a client that gave up would still cost its full generation.
    Cancelling runs the ``finally`` blocks that abort its engine requests.
    """
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return task.result()


def _validation_message(e: RequestValidationError) -> str:
    """Pydantic's first complaints, as ``field: what is wrong`` (each cut short)."""
    parts = []
    for err in e.errors()[:3]:
        loc = ".".join(str(x)[:40] for x in err.get("loc", ())[1:]) or "body"
        parts.append(f"{loc}: {str(err.get('msg'))[:200]}")
    return "; ".join(parts)


#: Paths that stay open with ``--api-key`` (as vLLM, which guards ``/v1/*``):
#: health checks and Prometheus scrapers carry no key. ``--api-key-all-paths``
#: guards them too.
OPEN_PATHS = frozenset({"/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc",
                        "/openapi.json"})


def _error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(APIError(status, message).body(), status_code=status)


class AuthMiddleware:
    """Refuse (401) a request without ``Authorization: Bearer KEY``, outside the open paths.

    A pure ASGI middleware, so it also covers the routes FastAPI adds itself
    (``/docs``, ``/openapi.json``) and unknown paths. The key is compared in
    constant time (``hmac.compare_digest``).
    """

    def __init__(self, app, api_key: str, open_paths: frozenset[str]) -> None:
        self.app, self.open_paths = app, open_paths
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and \
                scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = _error_response(
                    401, "invalid or missing API key: send the header "
                         "'Authorization: Bearer <key>' with the server's --api-key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answer 413 to a request body over ``max_bytes``, before anything parses it.

    The body is read here (at most ``max_bytes`` + one chunk, whatever
    ``Content-Length`` claims) and replayed to the app; after it, the app's
    ``receive`` is the server's again, so a disconnect still reaches it.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = _error_response(
            413, f"the request body is larger than the server's --max-request-body-bytes "
                 f"({self.max_bytes} bytes)")
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await too_large(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await too_large(scope, receive, send)
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None,
              limits: ServingLimits | None = None,
              api_key_all_paths: bool = False, lora_modules: dict | None = None,
              allow_lora_updates: bool = False,
              chat_templates: ChatTemplates | None = None,
              tool_options: ToolCallOptions | None = None) -> FastAPI:
    """The FastAPI app serving ``llm`` as ``model_name``; metrics are registered on ``llm``.

    With ``api_key``, every path needs it except :data:`OPEN_PATHS`
    (``/health``, ``/metrics``, ``/docs``, ``/openapi.json``), which need it
    too with ``api_key_all_paths``.
    """
    limits = limits or ServingLimits()
    metrics = PrometheusStatLogger(model_name)
    llm.stat_loggers.append(metrics)
    serving = OpenAIServing(llm, model_name, limits, lora_modules, chat_templates, tool_options)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await llm.shutdown()  # fail what is in flight, stop tensor-parallel workers
        serving.close()
        _forget_endpoints()

    app = FastAPI(title="minivllm", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_request_body_bytes)
    if api_key is not None:  # added last, so it runs first: no key, no body read
        app.add_middleware(AuthMiddleware, api_key=api_key,
                           open_paths=frozenset() if api_key_all_paths else OPEN_PATHS)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error_response(400, _validation_message(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(e.status_code, str(e.detail))

    async def respond(result) -> Response:
        if isinstance(result, Response):
            return result
        if isinstance(result, dict):
            return JSONResponse(result)
        return SSEResponse(result)

    def warn_ignored(req, path: str) -> None:
        ignored = req.ignored_fields()
        if ignored:  # names cut short: a body may carry junk keys
            logger.warning("minivllm: %s: ignoring the unknown fields %s", path,
                           ", ".join(repr(n[:60]) for n in ignored[:10]))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        warn_ignored(req, "/v1/completions")
        return await respond(await cancel_on_disconnect(raw, serving.create_completion(req)))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        warn_ignored(req, "/v1/chat/completions")
        return await respond(
            await cancel_on_disconnect(raw, serving.create_chat_completion(req)))

    @app.get("/v1/models")
    async def models() -> dict:
        now = int(time.time())
        base = {"id": model_name, "object": "model", "created": now, "owned_by": "minivllm",
                "root": model_name, "parent": None, "max_model_len": llm.max_model_len}
        adapters = [{**base, "id": name, "root": lora.lora_path, "parent": model_name}
                    for name, lora in serving.lora_modules.items()]
        return {"object": "list", "data": [base, *adapters]}

    if allow_lora_updates:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
            await serving.load_lora_adapter(req.lora_name, req.lora_path)
            return Response(f"Success: LoRA adapter {req.lora_name!r} added.", 200)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
            await serving.unload_lora_adapter(req.lora_name)
            return Response(f"Success: LoRA adapter {req.lora_name!r} removed.", 200)

    @app.get("/health")
    async def health() -> Response:
        if llm.error is not None:
            return _error_response(503, str(llm.error))
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        warn_ignored(req, "/tokenize")
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            tokens = await serving.chat_prompt(req)
        else:
            tokens = await serving.encode(req.prompt, req.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        warn_ignored(req, "/detokenize")
        serving.check_model(req.model)
        return {"prompt": await serving.decode(req.tokens)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free port the OS picks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _forget_endpoints() -> None:
    """Drop fastapi's caches of endpoint functions once a server has stopped.

    fastapi (0.16x) classifies each endpoint in module-level ``lru_cache``s that hold the
    function, and so its closure: this app's ``llm``, its engine, weights and KV cache.
    A process that starts servers one after another (a tutorial, a benchmark, the book
    build) would keep every stopped engine; clearing the caches lets them go.
    """
    from fastapi.dependencies import models

    for value in vars(models).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


#: Seconds a server whose engine died keeps answering (every open stream ends with its
#: error event, ``/health`` says 503) before it exits with status 1.
DEAD_ENGINE_GRACE_S = 3.0


def _uvicorn_server(app: FastAPI, log_level: str, llm: AsyncLLM | None = None):
    """uvicorn's server; with ``llm``, SIGTERM / SIGINT first end what is in flight,
    and a dead engine ends the server.

    uvicorn's graceful shutdown waits for open connections (at most 5 s here) and then
    cuts them: a stream running longer would stop mid-way with no word of why. So the
    first signal fails every request in flight with an ``EngineDeadError`` naming it
    (each open stream sends that as its last event), and then lets uvicorn stop.

    If the engine itself fails (a rank died: ``llm.failed_at`` is set), the server
    cannot serve again, so, as vLLM's does, it stops :data:`DEAD_ENGINE_GRACE_S`
    later and its ``exit_code`` is 1 (a supervisor restarts it); the executor has
    already stopped the other ranks, and the shutdown reaps them.
    """
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        exit_code = 0

        async def on_tick(self, counter: int) -> bool:
            failed = None if llm is None else llm.failed_at
            if failed is not None and time.monotonic() - failed > DEAD_ENGINE_GRACE_S:
                if not self.exit_code:
                    logger.error("minivllm serve: the engine died (%s); exiting", llm.error)
                self.exit_code = 1
                return True
            return await super().on_tick(counter)

        def handle_exit(self, sig: int, frame) -> None:
            if llm is not None and llm.error is None:
                llm.error = EngineDeadError(
                    f"the server is shutting down ({signal.Signals(sig).name}); this "
                    f"request was not finished")
                with contextlib.suppress(RuntimeError):  # no loop: nothing is in flight
                    loop = asyncio.get_running_loop()
                    self._ending = loop.create_task(llm.shutdown())
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5,
                                 timeout_keep_alive=30))


def run_server(llm: AsyncLLM, model_name: str, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, log_level: str = "warning",
               limits: ServingLimits | None = None, api_key_all_paths: bool = False,
               lora_modules: dict | None = None, allow_lora_updates: bool = False,
               chat_templates: ChatTemplates | None = None,
               tool_options: ToolCallOptions | None = None) -> int:
    """Serve until SIGINT/SIGTERM, or until the engine dies (blocking); return the exit
    status (0, or 1 after a dead engine). Prints the URL once it listens."""
    sock = bind(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = _uvicorn_server(build_app(llm, model_name, api_key, limits, api_key_all_paths,
                                       lora_modules, allow_lora_updates, chat_templates,
                                       tool_options),
                             log_level, llm)
    generation = llm.engine.generation
    if generation.sampling:  # said as vLLM says it: requests that set nothing get these
        print(f"minivllm serve: default sampling params from the model's generation config "
              f"({generation.source}): {generation.sampling}; --generation-config vllm "
              f"ignores them", flush=True)
    print(f"minivllm serve: {model_name!r} on {url} (OpenAI API at {url}/v1)", flush=True)
    server.run(sockets=[sock])
    return server.exit_code


@dataclass
class ServerThread:
    """A server running in a background thread of this process (tutorial, benchmark).

    ``with ServerThread.start(llm, "smollm2") as srv: ... srv.base_url ...``
    """

    base_url: str
    thread: threading.Thread
    server: object

    @classmethod
    def start(cls, llm: AsyncLLM, model_name: str, host: str = "127.0.0.1",
              api_key: str | None = None, timeout_s: float = 60.0,
              limits: ServingLimits | None = None,
              lora_modules: dict | None = None) -> ServerThread:
        """Start serving on a free port of ``host``; return once it accepts requests."""
        sock = bind(host, 0)
        server = _uvicorn_server(build_app(llm, model_name, api_key, limits,
                                           lora_modules=lora_modules), "warning")
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                  name="minivllm-server", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)
        return cls(f"http://{host}:{sock.getsockname()[1]}", thread, server)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Shut down (the engine's workers too) and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
