"""The OpenAI-compatible HTTP server: FastAPI app, ASGI middleware, and the uvicorn runner."""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import os
import socket
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic.json_schema import models_json_schema

from blockdiff import __version__
from blockdiff.chat_parts import MediaPolicy
from blockdiff.config import EngineConfig
from blockdiff.engine.client import EngineClient
from blockdiff.entrypoints.anthropic.errors import AnthropicErrors
from blockdiff.entrypoints.anthropic.protocol import CountTokensResponse, messages_request_types
from blockdiff.entrypoints.anthropic.serving import AnthropicServingMessages
from blockdiff.entrypoints.openai import body, errors, playground
from blockdiff.entrypoints.openai.config import ServerConfig
from blockdiff.entrypoints.openai.connections import AcceptErrorLog, BodyAdmission, connection_limit, guarded_protocol
from blockdiff.entrypoints.openai.media import ChatMedia
from blockdiff.entrypoints.openai.metrics import ServingMetrics
from blockdiff.entrypoints.openai.protocol import (MAX_CHOICES, MAX_MESSAGES, DetokenizeRequest, DetokenizeResponse,
                                                   ModelCard, ModelList, TokenizeRequest, TokenizeResponse, now,
                                                   request_types)
from blockdiff.entrypoints.openai.work_pool import WorkPool
from blockdiff.entrypoints.openai.request_builder import RequestBuilder
from blockdiff.entrypoints.openai.clients import ClientLimit, client_of
from blockdiff.entrypoints.openai.responses import OpenAIServingResponses, ResponseStore
from blockdiff.entrypoints.openai.responses_protocol import DeletedResponse, ResponseObject, responses_request_type
from blockdiff.entrypoints.openai.serving_chat import OpenAIServingChat
from blockdiff.entrypoints.openai.serving_completion import OpenAIServingCompletion
from blockdiff.entrypoints.openai.tokenization import OpenAIServingTokenization
from blockdiff.entrypoints.openai.tokenizer_info import tokenizer_info
from blockdiff.engine.startup import start_client
from blockdiff.engine.lora_adapters import AdapterRefused, LoRAAdapters, LoRAInfo, served_adapters

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
    the exception here, so a keep-alive connection survives a 500. An exception before any
    response (in a middleware) gets the OpenAI-shaped 500 here, not uvicorn's plain-text one."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "complete": False}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                state["started"] = True
                self.metrics.response(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["complete"] = True
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception as e:
            if state["started"] and not state["complete"]:
                raise  # half a response: only closing the connection ends it
            if not state["started"]:
                log.exception("unhandled error on %s %s", scope["method"], scope["path"])
                await self.reject(counting_send, 500, f"internal server error: {type(e).__name__}")


_OPEN_PATHS = frozenset({"/health", "/ping", *playground.PUBLIC_PATHS})


class RequireAPIKey(_Middleware):
    """API key check on every path but `open_paths`: /health and /ping (which probes call without
    credentials), the playground's page and files (which hold nothing of the server's; the page sends
    the key) and, as vLLM serves it, /metrics (which Prometheus scrapes without credentials; it holds
    counts, latencies and names, never a request's text). /docs, /openapi.json and /version describe
    the server and need the key. The key comes as a Bearer token (OpenAI's clients) or in x-api-key
    (Anthropic's); either one right lets the request in. Two of the same header are a 400, not "the
    last one wins"."""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            bearer = [value for name, value in scope["headers"] if name == b"authorization"]
            keys = [value for name, value in scope["headers"] if name == b"x-api-key"]
            if len(bearer) > 1 or len(keys) > 1:
                header = "Authorization" if len(bearer) > 1 else "x-api-key"
                return await self.reject(send, 400, f"more than one {header} header", code="invalid_api_key")
            key = self.key.encode()
            # Both compared, always: how long the check takes says nothing about which one was close.
            right = [hmac.compare_digest(bearer[0] if bearer else b"", b"Bearer " + key),
                     hmac.compare_digest(keys[0] if keys else b"", key)]
            if not any(right):
                return await self.reject(send, 401, "missing or wrong API key (send Authorization: Bearer <key>, or "
                                                    "x-api-key: <key>)", code="invalid_api_key")
        await self.app(scope, receive, send)


def build_app(engine: EngineClient, cfg: ServerConfig, loras: LoRAAdapters | None = None) -> FastAPI:
    """The app owns the client `engine` from here on: it is started and stopped by the app's lifespan.
    `loras`: the LoRA adapters served by name (docs/lora.md; None: none)."""
    limits = engine.limits
    metrics = ServingMetrics(engine, cfg.served_model_names[0])
    metrics.registry.register(LoRAInfo(engine))
    engine.on_step, engine.on_finish = metrics.step, metrics.finished
    pool = WorkPool(cfg.preprocess_threads, cfg.preprocess_timeout, "blockdiff-preprocess")
    media = ChatMedia(engine.mm, cfg.media,
                        WorkPool(cfg.image_decode_threads, cfg.preprocess_timeout, "blockdiff-decode"),
                        WorkPool(cfg.image_fetch_threads, cfg.preprocess_timeout, "blockdiff-fetch"))
    preprocess = RequestBuilder(engine, pool, media, cfg.max_request_cost, cfg.max_response_bytes,
                                cfg.default_chat_template_kwargs, cfg.trust_request_chat_template)
    clients = ClientLimit(cfg.max_client_concurrency)
    shared = (engine, cfg.served_model_names, preprocess, clients, cfg.max_stream_buffer)
    completion = OpenAIServingCompletion(*shared)
    chat_serving = OpenAIServingChat(*shared, cfg.tool_call_parser, cfg.reasoning_parser)
    tokenization = OpenAIServingTokenization(chat_serving)
    # The LoRA adapters served by name, one dict that every endpoint reads.
    adapters = preprocess.adapters = {} if loras is None else loras.by_name
    # What a request that sets no sampler field gets: server flags over the checkpoint's defaults.
    sampling_defaults = {f.name: engine.defaults[f.name] for f in engine.sampler.fields}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
        engine.start()
        log.info("serving %s as %s on http://%s:%d", limits.model, cfg.served_model_names, cfg.host, cfg.port)
        try:
            yield
        finally:
            await engine.stop()
            for p in (pool, media.decode, media.fetch):
                p.shutdown()

    # The generation bodies take the fields of the model's sampler (protocol.request_types).
    CompletionRequest, ChatCompletionRequest = request_types(engine.sampler.fields)
    ResponsesRequest = responses_request_type(engine.sampler.fields)
    responses = OpenAIServingResponses(chat_serving, ChatCompletionRequest, ResponseStore(cfg.responses_store_bytes))
    MessagesRequest, CountTokensRequest = messages_request_types(engine.sampler.fields)
    messages = AnthropicServingMessages(chat_serving, ChatCompletionRequest)
    app = _App(title="blockdiff", lifespan=lifespan, count=CountResponses(None, metrics=metrics),
               bodies=(CompletionRequest, ChatCompletionRequest, ResponsesRequest, MessagesRequest, CountTokensRequest,
                       TokenizeRequest, DetokenizeRequest))
    app.state.engine = engine
    app.state.metrics = metrics
    errors.install(app)
    # One item past the longest list a field takes: the field then says what its limit is.
    parse = body.BodyParser(pool, max(limits.max_model_len, MAX_CHOICES, MAX_MESSAGES) + 1, cfg.strict_request_fields)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not engine.available:
            return errors.error_response(503, engine.unavailable_reason(), code="engine_unavailable")
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
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        created = now()
        return ModelList(data=[ModelCard(id=name, created=created, root=model_root(limits.model), max_model_len=limits.max_model_len,
                                         canvas_length=limits.canvas_length, sampling_defaults=sampling_defaults)
                               for name in cfg.served_model_names]
                         + [ModelCard(id=name, created=created, root=model_root(lo.lora_path), parent=cfg.served_model_names[0],
                                      max_model_len=limits.max_model_len, canvas_length=limits.canvas_length,
                                      sampling_defaults=sampling_defaults)
                            for name, lo in list(adapters.items())])

    if loras is not None and loras.runtime_updating:
        async def lora_body(request: Request, *fields: str) -> dict:
            try:
                data = json.loads(await request.body())
            except ValueError:
                raise errors.APIError(400, "the body is not JSON") from None
            for name in fields:
                if not isinstance(data, dict) or not isinstance(data.get(name), str) or not data[name]:
                    raise errors.APIError(400, f"{name} is required (a string)", param=name)
            return data

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            """vLLM's: {"lora_name", "lora_path"} served from now on under lora_name."""
            data = await lora_body(request, "lora_name", "lora_path")
            with refused_as_api_error():
                await loras.load(data["lora_name"], data["lora_path"])
            return Response(f"Success: LoRA adapter '{data['lora_name']}' added successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            """vLLM's: {"lora_name"} no longer served (requests running with it finish)."""
            name = (await lora_body(request, "lora_name"))["lora_name"]
            with refused_as_api_error():
                loras.unload(name)
            return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    # Bodies are parsed by `body.BodyParser` (bounded, off the loop when large), not by FastAPI; the
    # schema still documents them.
    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await completion.completions(await parse(await request.body(), CompletionRequest, client_of(request)), request)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat(request: Request) -> Response:
        return await chat_serving.chat(await parse(await request.body(), ChatCompletionRequest, client_of(request)), request)

    @app.post("/v1/responses", openapi_extra=_body_schema(ResponsesRequest))
    async def create_response(request: Request) -> Response:
        return await responses.create(await parse(await request.body(), ResponsesRequest, client_of(request)), request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> ResponseObject:
        return responses.retrieve(response_id, client_of(request))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> DeletedResponse:
        return responses.delete(response_id, client_of(request))

    @app.post("/v1/messages", openapi_extra=_body_schema(MessagesRequest))
    async def create_message(request: Request) -> Response:
        return await messages.create(await parse(await request.body(), MessagesRequest, client_of(request)), request)

    @app.post("/v1/messages/count_tokens", openapi_extra=_body_schema(CountTokensRequest))
    async def count_tokens(request: Request) -> CountTokensResponse:
        return await messages.count_tokens(await parse(await request.body(), CountTokensRequest, client_of(request)),
                                           request)

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize(request: Request) -> TokenizeResponse:
        client = client_of(request)
        return await pool.run(client, tokenization.tokenize, await parse(await request.body(), TokenizeRequest, client))

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> DetokenizeResponse:
        client = client_of(request)
        return await pool.run(client, tokenization.detokenize, await parse(await request.body(), DetokenizeRequest, client))

    if cfg.enable_tokenizer_info_endpoint:
        info = None if engine.tokenizer is None else tokenizer_info(engine.tokenizer)  # built once: it never changes

        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> JSONResponse:
            if info is None:
                raise errors.APIError(404, "this checkpoint has no tokenizer")
            return JSONResponse(info)

    playground.install(app, api_key_required=bool(cfg.api_key))

    # The last added runs first: check the key before reading any body. CountResponses wraps them all.
    max_connections = connection_limit(cfg.max_connections)
    app.add_middleware(BodyAdmission, max_bytes=cfg.max_request_bytes, timeout=cfg.body_timeout,
                       min_rate=cfg.min_body_rate, grace=cfg.header_timeout, per_client=cfg.max_client_uploads,
                       total=max(1, max_connections // 2), on_refused=metrics.refused)
    if cfg.api_key:
        app.add_middleware(RequireAPIKey, key=cfg.api_key,
                           open_paths=_OPEN_PATHS if cfg.metrics_require_api_key else _OPEN_PATHS | {"/metrics"})
    return app


def _body_schema(model) -> dict:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


class _App(FastAPI):
    """FastAPI with `count` (a CountResponses) around its whole middleware stack, Starlette's error
    layer included, and the request bodies' schemas in /openapi.json. Inside `count`, AnthropicErrors
    rewrites the errors on /v1/messages, whichever layer made them (Starlette's error layer sends
    the 500s, outside every added middleware)."""

    def __init__(self, count: CountResponses, bodies: tuple, **kwargs):
        super().__init__(**kwargs)
        self._count, self._bodies = count, bodies

    def build_middleware_stack(self):
        self._count.app = AnthropicErrors(super().build_middleware_stack())
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

    def __init__(self, config: uvicorn.Config, engine: EngineClient, grace: float):
        super().__init__(config)
        self._engine, self._grace = engine, grace

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._engine.drain_threadsafe(self._grace)

    async def on_tick(self, counter: int) -> bool:
        if self._engine.dead and not self.should_exit:
            log.error("the engine could not be restarted: exiting so that a supervisor restarts the server")
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
        # Image URLs are the server's to fetch, under the engine flags that allow them.
        cfg = replace(cfg, port=sock.getsockname()[1], media=MediaPolicy.of(engine_cfg))
        loras = None
        if engine_cfg.enable_lora:
            loras = served_adapters(engine_cfg, cfg.served_model_names,
                                    os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"))
        engine = start_client(engine_cfg, cfg.max_queued_requests)
        try:
            app = build_app(engine, cfg, loras)
        except BaseException:
            engine.shutdown()  # stops tensor-parallel workers and replicas too
            raise
        # What is loaded now (torch, the model, the tokenizer) lives as long as the server: kept out of
        # the cyclic collector's sight, a full collection, which stops every thread, takes no 150 ms.
        gc.collect()
        gc.freeze()
        # uvicorn's own timeout is a backstop: the engine ends every request after shutdown_timeout.
        metrics = app.state.metrics

        def refused(status: int, reason: str) -> None:
            metrics.response(status)
            metrics.refused(reason)

        # No limit_concurrency: uvicorn would answer /health too with a plain 503 (connections.py).
        # Proxy headers only from --forwarded-allow-ips (clients.py): both given, so that neither
        # uvicorn's default (trust 127.0.0.1, where any local process connects from) nor its
        # FORWARDED_ALLOW_IPS variable applies.
        config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, ws="none",
                                proxy_headers=bool(cfg.forwarded_allow_ips),
                                forwarded_allow_ips=list(cfg.forwarded_allow_ips),
                                timeout_graceful_shutdown=cfg.shutdown_timeout + 5, timeout_keep_alive=cfg.keep_alive_timeout,
                                http=guarded_protocol(cfg.header_timeout, connection_limit(cfg.max_connections),
                                                      metrics.connection_closed, refused))
        try:
            _Server(config, app.state.engine, cfg.shutdown_timeout).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled; the shutdown already ran
            pass
        finally:
            # Normally the lifespan already stopped the engine; this covers a server that never started.
            app.state.engine.shutdown()
    finally:
        sock.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose
    # protocol says TCP, and with it on, a response written in two parts (headers, body) waited for the
    # client's delayed ACK: 40 ms on every keep-alive request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart while old connections linger
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}; stop what uses it or pick another --port") from None
    return sock


@contextmanager
def refused_as_api_error():
    """A refused adapter load or unload as the OpenAI-style error the endpoints answer."""
    try:
        yield
    except AdapterRefused as e:
        raise errors.APIError(e.status, str(e), param=e.param, code=e.code) from None


def model_root(model: str) -> str:
    """The served checkpoint as /v1/models names it: a hub id as given, a local directory by its
    name alone, so that clients learn nothing of the server's file system."""
    return os.path.basename(os.path.normpath(model)) if os.path.isabs(model) or os.path.isdir(model) else model
