"""The OpenAI-compatible HTTP server: FastAPI app, ASGI middleware, and the uvicorn runner."""

from __future__ import annotations

import hmac
import logging
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from blockdiff.engine.async_engine import AsyncEngine
from blockdiff.config import EngineConfig
from blockdiff.engine.engine import LLMEngine
from blockdiff.entrypoints.openai import errors
from blockdiff.entrypoints.openai.metrics import CONTENT_TYPE, ServingMetrics
from blockdiff.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, now
from blockdiff.entrypoints.openai.serving import OpenAIServing
from blockdiff.startup import start_engine

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    served_model_names: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queued_requests: int | None = None
    max_request_bytes: int = 16 * 2**20
    shutdown_timeout: int = 3  # seconds open requests get after SIGTERM before they are aborted
    max_request_cost: int | None = None  # None: max_num_seqs requests of max_model_len tokens at the default steps
    log_level: str = "info"


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
    """Counts responses by status code for /metrics."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.response(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


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
        while more:
            message = await receive()
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


class RequireAPIKey(_Middleware):
    """Bearer-token check on /v1/*; /health and /metrics stay open for probes and scrapers."""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.key.encode()):
                return await self.reject(send, 401, "missing or wrong API key (send Authorization: Bearer <key>)",
                                         code="invalid_api_key")
        await self.app(scope, receive, send)


def build_app(engine: LLMEngine, cfg: ServerConfig) -> FastAPI:
    """The app owns `engine` from here on: it is shut down when the app's lifespan ends."""
    metrics = ServingMetrics(engine)
    async_engine = AsyncEngine(engine, cfg.max_queued_requests, on_step=metrics.step, on_finish=metrics.finished)
    serving = OpenAIServing(async_engine, cfg.served_model_names, cfg.max_request_cost)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        log.info("serving %s as %s on http://%s:%d", engine.cfg.model, cfg.served_model_names, cfg.host, cfg.port)
        try:
            yield
        finally:
            await async_engine.stop()

    app = FastAPI(title="blockdiff", lifespan=lifespan)
    app.state.async_engine = async_engine
    errors.install(app)

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.available:
            return errors.error_response(503, async_engine.unavailable_reason(), code="engine_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> ModelList:
        created = now()
        return ModelList(data=[ModelCard(id=name, created=created, root=engine.cfg.model, max_model_len=engine.max_model_len)
                               for name in cfg.served_model_names])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    # The last added runs first: count every response, check the key before reading any body.
    app.add_middleware(LimitBody, limit=cfg.max_request_bytes)
    if cfg.api_key:
        app.add_middleware(RequireAPIKey, key=cfg.api_key)
    app.add_middleware(CountResponses, metrics=metrics)
    return app


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
        config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                timeout_graceful_shutdown=cfg.shutdown_timeout + 5, timeout_keep_alive=5)
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
