"""The HTTP server: ``minivllm serve [MODEL] --host 127.0.0.1 --port 8000 [--api-key KEY]``.

A FastAPI app over one :class:`~minivllm.engine.async_llm.AsyncLLM`:

=========================  ====================================================
``POST /v1/completions``   continue a prompt (OpenAI's completions API)
``POST /v1/chat/completions``  answer a conversation (the model's chat template)
``GET  /v1/models``        the one served model
``GET  /health``           200 while the engine loop is alive, else 503 (no key needed)
``POST /tokenize``         text or messages -> token ids
``POST /detokenize``       token ids -> text
``GET  /metrics``          Prometheus metrics (``minivllm:...``)
=========================  ====================================================

Errors are OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``:
400 for a bad field or a prompt too long, 401 for a missing or wrong API key,
404 for an unknown model, 503 when the waiting queue is full, 500 when the
engine failed. The server binds to loopback unless told otherwise; with an API
key, every path but ``/health`` needs ``Authorization: Bearer KEY`` (compared
in constant time).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
import threading
import time
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.metrics import PrometheusStatLogger
from minivllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from minivllm.entrypoints.openai.serving import OpenAIServing


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
    """Pydantic's first complaint, as ``field: what is wrong``."""
    parts = []
    for err in e.errors()[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ())[1:]) or "body"
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts)


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``llm`` as ``model_name``; metrics are registered on ``llm``."""
    metrics = PrometheusStatLogger(model_name)
    llm.stat_loggers.append(metrics)
    serving = OpenAIServing(llm, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await llm.shutdown()  # fail what is in flight, stop tensor-parallel workers

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "invalid or missing API key: send the header "
                                "'Authorization: Bearer <key>' with the server's --api-key")

    app = FastAPI(title="minivllm", lifespan=lifespan)
    guarded = [Depends(check_key)]

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(400, _validation_message(e)).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(),
                            status_code=e.status_code)

    async def respond(result) -> Response:
        if isinstance(result, Response):
            return result
        if isinstance(result, dict):
            return JSONResponse(result)
        return SSEResponse(result)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await respond(await cancel_on_disconnect(raw, serving.create_completion(req)))

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await respond(
            await cancel_on_disconnect(raw, serving.create_chat_completion(req)))

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()),
            "owned_by": "minivllm", "max_model_len": llm.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if llm.error is not None:
            return JSONResponse(APIError(503, str(llm.error)).body(), status_code=503)
        return Response(status_code=200)

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(req: TokenizeRequest) -> dict:
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            tokens = serving.chat_prompt(req.messages, req.add_generation_prompt)
        else:
            tokens = llm.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(req: DetokenizeRequest) -> dict:
        serving.check_model(req.model)
        vocab = llm.engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be in [0, {vocab}), got {bad[:5]}", "tokens")
        return {"prompt": llm.tokenizer.decode(req.tokens)}

    @app.get("/metrics", dependencies=guarded)
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


def _uvicorn_server(app: FastAPI, log_level: str):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5,
                                         timeout_keep_alive=30))


def run_server(llm: AsyncLLM, model_name: str, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM (blocking). Prints the URL once it listens."""
    sock = bind(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = _uvicorn_server(build_app(llm, model_name, api_key), log_level)
    print(f"minivllm serve: {model_name!r} on {url} (OpenAI API at {url}/v1)", flush=True)
    server.run(sockets=[sock])


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
              api_key: str | None = None, timeout_s: float = 60.0) -> ServerThread:
        """Start serving on a free port of ``host``; return once it accepts requests."""
        sock = bind(host, 0)
        server = _uvicorn_server(build_app(llm, model_name, api_key), "warning")
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
