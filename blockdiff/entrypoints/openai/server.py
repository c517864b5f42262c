"""The OpenAI-compatible HTTP server: FastAPI app, ASGI middleware, and the uvicorn runner."""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from contextlib import asynccontextmanager
from dataclasses import replace

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic.json_schema import models_json_schema

from blockdiff import __version__
from blockdiff.engine.async_engine import AsyncEngine
from blockdiff.config import EngineConfig
from blockdiff.engine.engine import LLMEngine
from blockdiff.entrypoints.openai import body, errors, playground
from blockdiff.entrypoints.openai.config import ServerConfig
from blockdiff.entrypoints.openai.connections import AcceptErrorLog, connection_limit, guarded_protocol
from blockdiff.entrypoints.openai.metrics import CONTENT_TYPE, ServingMetrics
from blockdiff.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
                                                   TokenizeRequest, TokenizeResponse, now, request_types)
from blockdiff.entrypoints.openai.serving import OpenAIServing
from blockdiff.entrypoints.openai.tokenization import OpenAIServingTokenization
from blockdiff.startup import start_engine

log = logging.getLogger(__name__)


class _Middleware:
    """Plain ASGI middleware (no BaseHTTPMiddleware: it would break streaming and disconnects)."""

    def __init__(self, app, **options):
        self.app = app
        self.__dict__.update(options)

    @staticmethod
    async def reject(send, status: int, message: str, code: str | None = None) -> None:
        response = errors.error_response(status, message, code=code)
        await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})


class CountResponses(_Middleware):
    """The outermost layer: counts every response by status code for /metrics, 500s included.
    Starlette's error layer re-raises an exception after it has sent the 500 (for servers to log
    it; our handler already did), and uvicorn then drops the connection: a complete response ends
    the exception here, so a keep-alive connection survives a 500."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"complete": False}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.response(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["complete"] = True
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not state["complete"]:
                raise  # half a response: only closing the connection ends it


class LimitBody(_Middleware):
    """413 for bodies over `limit` bytes, declared or streamed; the body is read here and replayed."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self.reject(send, 413, f"request body of {int(declared)} bytes is over the {self.limit}-byte limit",
                                     code="request_too_large")
        chunks, size, more = [], 0, True
        deadline = asyncio.get_running_loop().time() + self.timeout
        while more:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return await self.reject(send, 408, f"the request body did not arrive within {self.timeout:g} s",
                                         code="request_timeout")
            if message["type"] != "http.request":  # disconnected while sending the body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                return await self.reject(send, 413, f"request body is over the {self.limit}-byte limit",
                                         code="request_too_large")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class LimitClients(_Middleware):
    """429 for a client's generation request while it already has `limit` in progress. A client is
    its host: a bearer token would not do, since without --api-key any token is accepted, and with
    it every client sends the same one."""

    def __init__(self, app, limit: int):
        super().__init__(app, limit=limit)
        self.running: dict[str, int] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        client = (scope.get("client") or ("",))[0]
        if self.running.get(client, 0) >= self.limit:
            return await self.reject(send, 429, f"this client already has {self.limit} requests in progress "
                                                "(--max-client-concurrency); retry when one ends", code="too_many_requests")
        self.running[client] = self.running.get(client, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.running[client] -= 1
            if not self.running[client]:
                del self.running[client]


_OPEN_PATHS = frozenset({"/health", "/ping", *playground.PUBLIC_PATHS})


class RequireAPIKey(_Middleware):
    """Bearer-token check on every path but /health and /ping (which probes call without credentials)
    and the playground's page and files (which hold nothing of the server's; the page sends the key):
    /metrics, /docs and /openapi.json describe the server and need the key too. Two Authorization
    headers are a 400, not "the last one wins"."""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            given = [value for name, value in scope["headers"] if name == b"authorization"]
            if len(given) > 1:
                return await self.reject(send, 400, "more than one Authorization header", code="invalid_api_key")
            if not hmac.compare_digest(given[0] if given else b"", b"Bearer " + self.key.encode()):
                return await self.reject(send, 401, "missing or wrong API key (send Authorization: Bearer <key>)",
                                         code="invalid_api_key")
        await self.app(scope, receive, send)


def build_app(engine: LLMEngine, cfg: ServerConfig) -> FastAPI:
    """The app owns `engine` from here on: it is shut down when the app's lifespan ends."""
    metrics = ServingMetrics(engine, cfg.served_model_names[0])
    async_engine = AsyncEngine(engine, cfg.max_queued_requests, on_step=metrics.step, on_finish=metrics.finished)
    serving = OpenAIServing(async_engine, cfg.served_model_names, cfg.max_request_cost, cfg.tool_call_parser,
                            cfg.reasoning_parser, cfg.default_chat_template_kwargs)
    tokenization = OpenAIServingTokenization(serving)
    # What a request that sets no sampler field gets: server flags over the checkpoint's defaults.
    sampling_defaults = {f.name: engine.inputs.defaults[f.name] for f in engine.sampler.fields}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
        async_engine.start()
        log.info("serving %s as %s on http://%s:%d", engine.cfg.model, cfg.served_model_names, cfg.host, cfg.port)
        try:
            yield
        finally:
            await async_engine.stop()

    # The generation bodies take the fields of the model's sampler (protocol.request_types).
    CompletionRequest, ChatCompletionRequest = request_types(engine.sampler.fields)
    app = _App(title="blockdiff", lifespan=lifespan, count=CountResponses(None, metrics=metrics),
               bodies=(CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest))
    app.state.async_engine = async_engine
    errors.install(app)
    parse = body.BodyParser()

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.available:
            return errors.error_response(503, async_engine.unavailable_reason(), code="engine_unavailable")
        return JSONResponse({"status": "ok"})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (SageMaker's) name for the health check."""
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> ModelList:
        created = now()
        return ModelList(data=[ModelCard(id=name, created=created, root=engine.cfg.model, max_model_len=engine.max_model_len,
                                         canvas_length=engine.canvas_length, sampling_defaults=sampling_defaults)
                               for name in cfg.served_model_names])

    # Bodies are parsed by `body.BodyParser` (bounded, off the loop when large), not by FastAPI; the
    # schema still documents them.
    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await serving.completions(await parse(await request.body(), CompletionRequest), request)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat(request: Request) -> Response:
        return await serving.chat(await parse(await request.body(), ChatCompletionRequest), request)

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize(request: Request) -> TokenizeResponse:
        return tokenization.tokenize(await parse(await request.body(), TokenizeRequest))

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> DetokenizeResponse:
        return tokenization.detokenize(await parse(await request.body(), DetokenizeRequest))

    playground.install(app, api_key_required=bool(cfg.api_key))

    # The last added runs first: check the key before reading any body. CountResponses wraps them all.
    app.add_middleware(LimitBody, limit=cfg.max_request_bytes, timeout=cfg.body_timeout)
    if cfg.max_client_concurrency is not None:
        app.add_middleware(LimitClients, limit=cfg.max_client_concurrency)
    if cfg.api_key:
        app.add_middleware(RequireAPIKey, key=cfg.api_key)
    return app


def _body_schema(model) -> dict:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


class _App(FastAPI):
    """FastAPI with `count` (a CountResponses) around its whole middleware stack, Starlette's error
    layer included, and the request bodies' schemas in /openapi.json."""

    def __init__(self, count: CountResponses, bodies: tuple, **kwargs):
        super().__init__(**kwargs)
        self._count, self._bodies = count, bodies

    def build_middleware_stack(self):
        self._count.app = super().build_middleware_stack()
        return self._count

    def openapi(self) -> dict:
        if self.openapi_schema is None:
            schema = get_openapi(title=self.title, version=self.version, routes=self.routes)
            _, defs = models_json_schema([(m, "validation") for m in self._bodies], ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            self.openapi_schema = schema
        return self.openapi_schema


class _Server(uvicorn.Server):
    """uvicorn stops accepting connections on SIGTERM/SIGINT and waits for open ones to close; this
    also tells the engine, whose requests then get `grace` seconds before they end with an error
    (so streams close cleanly instead of being cancelled mid-write)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace: float):
        super().__init__(config)
        self._engine, self._grace = engine, grace

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._engine.drain_threadsafe(self._grace)

    async def on_tick(self, counter: int) -> bool:
        if self._engine.dead and not self.should_exit:
            log.error("the tensor-parallel workers could not be restarted: exiting so that a supervisor restarts the server")
            self.should_exit = True
        return await super().on_tick(counter)

    def run(self, *args, **kwargs) -> None:
        super().run(*args, **kwargs)
        if self._engine.dead:
            raise SystemExit(1)


def serve(engine_cfg: EngineConfig, cfg: ServerConfig) -> None:
    """Bind the port, load the model, serve until SIGTERM/SIGINT, then stop the engine (and its
    workers). The port is bound first so that a taken one fails at once, before minutes of loading,
    and the `serving ... on http://...` line names the port really bound (--port 0: a free one)."""
    sock = _bind(cfg.host, cfg.port)
    try:
        cfg = replace(cfg, port=sock.getsockname()[1])
        engine = start_engine(engine_cfg)
        try:
            app = build_app(engine, cfg)
        except BaseException:
            engine.shutdown()  # stops tensor-parallel workers too
            raise
        # uvicorn's own timeout is a backstop: the engine ends every request after shutdown_timeout.
        max_connections = connection_limit(cfg.max_connections)
        config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                timeout_graceful_shutdown=cfg.shutdown_timeout + 5, timeout_keep_alive=cfg.keep_alive_timeout,
                                http=guarded_protocol(cfg.header_timeout, max_connections),
                                limit_concurrency=max_connections + 1)
        try:
            _Server(config, app.state.async_engine, cfg.shutdown_timeout).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled; the shutdown already ran
            pass
        finally:
            # Normally the lifespan already stopped the engine; this covers a server that never started.
            app.state.async_engine.shutdown()
    finally:
        sock.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart while old connections linger
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}; stop what uses it or pick another --port") from None
    return sock
