"""`blockdiff serve [MODEL]`: the OpenAI-compatible HTTP server (see docs/server.md)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from blockdiff.arg_utils import (add_chat_template_arg, add_engine_args, add_sampling_args, at_least, engine_config,
                                 given_model, parse_size, port, positive, positive_seconds, sampling_overrides,
                                 show_first, trusted_proxies)
from blockdiff.entrypoints.openai.config import ServerConfig
from blockdiff.entrypoints.openai.reasoning import REASONING_PARSERS
from blockdiff.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS
from blockdiff.vllm_options import json_object


def register(sub: argparse._SubParsersAction) -> None:
    # A short usage line, as vLLM's: the full synopsis of every flag would fill the first screens.
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       usage="%(prog)s [MODEL] [options]",
                       description="The main flags first, then every flag by topic (docs/server.md).")
    add_engine_args(p, model_positional=True)
    add_chat_template_arg(p)
    add_sampling_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=8000, help="port to listen on (0: a free one, printed at startup)")
    p.add_argument("--uvicorn-log-level", type=str.lower, default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level (default: --log-level)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names clients use as `model` (default: MODEL as given, or 'demo'); the first one is reported")
    p.add_argument("--api-key", default=os.environ.get("BLOCKDIFF_API_KEY"), metavar="KEY",
                   help="require `Authorization: Bearer KEY` (or `x-api-key: KEY`) everywhere but /health, /ping, "
                        "the playground and /metrics (default: $BLOCKDIFF_API_KEY)")
    p.add_argument("--metrics-require-api-key", action="store_true",
                   help="with --api-key: /metrics needs the key too (default: open, as vLLM serves it, for "
                        "Prometheus; it shows counts, latencies, the model's and running adapters' names)")
    p.add_argument("--max-queued-requests", type=at_least(0), default=None,
                   help="answer 429 when more requests than this would wait (default: no limit)")
    p.add_argument("--max-client-concurrency", type=at_least(1), default=None,
                   help="engine requests (each choice and prompt of a call counts) one client host may have in "
                        "progress; more get 429 (default: no limit)")
    p.add_argument("--max-request-size", type=parse_size, default=16 * 2**20, help="largest request body (default 16MiB)")
    p.add_argument("--max-stream-buffer", type=parse_size, default=ServerConfig.max_stream_buffer,
                   help="output of a stream its client may leave unread before the connection is dropped, "
                        "approximately (default 8MiB)")
    p.add_argument("--responses-store-size", type=parse_size, default=ServerConfig.responses_store_bytes,
                   help="JSON of /v1/responses turns kept for previous_response_id, in memory, for a day; the oldest "
                        "go first (default 256MiB)")
    p.add_argument("--max-response-bytes", type=parse_size, default=ServerConfig.max_response_bytes,
                   help="refuse, before any work, a request whose response could be larger (choices x tokens "
                        "returned x (1 + logprobs) entries; default 32MiB)")
    p.add_argument("--max-request-cost", type=at_least(1), default=None,
                   help="most canvas positions one API request may ask the decoder for: choices x canvases x "
                        "max_denoising_steps x canvas length (default: max-num-seqs requests of max-model-len tokens "
                        "at the steps limit)")
    p.add_argument("--shutdown-timeout", type=at_least(0), default=3,
                   help="seconds open requests get to finish after SIGTERM before they are aborted")
    p.add_argument("--max-connections", type=at_least(1), default=ServerConfig.max_connections,
                   help="open connections at most; past it the longest-idle one is closed, or requests get 503 "
                        "(default %(default)s, less if `ulimit -n` leaves less room)")
    p.add_argument("--header-timeout", type=positive_seconds, default=ServerConfig.header_timeout,
                   help="seconds a connection may stay open without sending a request (default %(default)s)")
    p.add_argument("--body-timeout", type=positive_seconds, default=ServerConfig.body_timeout,
                   help="seconds a request may take to send its body (default %(default)s)")
    p.add_argument("--min-body-rate", type=positive("number of bytes per second"), default=ServerConfig.min_body_rate,
                   metavar="BYTES",
                   help="bytes a second a request body must average once --header-timeout seconds have passed, or "
                        "it gets 408 (default %(default)g)")
    p.add_argument("--max-client-uploads", type=at_least(1), default=ServerConfig.max_client_uploads,
                   help="connections of one client address that may be sending a request body at once; more get "
                        "429 (default %(default)s)")
    p.add_argument("--forwarded-allow-ips", type=trusted_proxies, default=ServerConfig.forwarded_allow_ips,
                   metavar="IPS",
                   help="uvicorn's: the reverse proxies (comma-separated IP addresses and CIDR networks, * for any "
                        "peer) whose X-Forwarded-For names the client that per-client limits, stored responses and "
                        "the prefix cache belong to; from any other peer the header is ignored (default: none, "
                        "every client is the address it connects from)")
    p.add_argument("--keep-alive-timeout", type=positive_seconds, default=ServerConfig.keep_alive_timeout,
                   help="seconds an idle keep-alive connection stays open (default %(default)s)")
    p.add_argument("--preprocess-threads", type=at_least(1), default=ServerConfig.preprocess_threads,
                   help="threads that decode request bodies, render chat templates and tokenize (default %(default)s)")
    p.add_argument("--preprocess-timeout", type=positive_seconds, default=ServerConfig.preprocess_timeout,
                   help="seconds a request's preprocessing (body, chat template, tokenizer, images) may take before "
                        "it is abandoned with a 413 (default %(default)s)")
    p.add_argument("--image-decode-threads", type=at_least(1), default=ServerConfig.image_decode_threads,
                   help="threads that decode images; each holds one image's memory at a time (default %(default)s)")
    p.add_argument("--image-fetch-threads", type=at_least(1), default=ServerConfig.image_fetch_threads,
                   help="image URLs fetched at once (default %(default)s)")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="format of tool calls in the output, read into message.tool_calls (default: the checkpoint's "
                        "own, gemma4, when its tokenizer has that format's tokens; else calls are not read)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="format of the thinking in the output, read into message.reasoning_content (default: as "
                        "--tool-call-parser)")
    p.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                   help='vLLM\'s: chat template variables every chat gets unless it sets them, e.g. '
                        '\'{"enable_thinking": true}\' (only variables the template reads)')
    p.add_argument("--strict-request-fields", action="store_true",
                   help="refuse requests with unknown top-level fields with a 400 (default: ignore them with a "
                        "warning naming them, as vLLM does)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="vLLM's: let a chat request bring its own chat_template (rendered in the same sandbox)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="vLLM's: serve GET /tokenizer_info, the tokenizer's configuration and chat template, from "
                        "which tools such as lm-eval's local-completions tokenize through the server (off by "
                        "default: it shows the chat template)")
    show_first(p, "main flags", ["--host", "--port", "--api-key", "--served-model-name", "--max-model-len", "--dtype",
                                 "--tensor-parallel-size", "--max-num-seqs"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from blockdiff.entrypoints.openai.server import serve

    if args.metrics_require_api_key and not args.api_key:
        raise ValueError("--metrics-require-api-key needs --api-key (or $BLOCKDIFF_API_KEY)")
    model = given_model(args)
    names = args.served_model_name or [model if model is not None else "demo"]
    cfg = ServerConfig(
        served_model_names=names,
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        metrics_require_api_key=args.metrics_require_api_key,
        max_queued_requests=args.max_queued_requests,
        max_client_concurrency=args.max_client_concurrency,
        max_request_bytes=args.max_request_size,
        max_stream_buffer=args.max_stream_buffer,
        shutdown_timeout=args.shutdown_timeout,
        max_connections=args.max_connections,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        min_body_rate=args.min_body_rate,
        max_client_uploads=args.max_client_uploads,
        forwarded_allow_ips=args.forwarded_allow_ips,
        keep_alive_timeout=args.keep_alive_timeout,
        max_request_cost=args.max_request_cost,
        max_response_bytes=args.max_response_bytes,
        responses_store_bytes=args.responses_store_size,
        preprocess_threads=args.preprocess_threads,
        preprocess_timeout=args.preprocess_timeout,
        image_decode_threads=args.image_decode_threads,
        image_fetch_threads=args.image_fetch_threads,
        log_level=args.uvicorn_log_level or args.log_level,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        default_chat_template_kwargs=json_object(args.default_chat_template_kwargs, "--default-chat-template-kwargs"),
        strict_request_fields=args.strict_request_fields,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
    )
    engine = dataclasses.replace(engine_config(args), sampling_defaults=sampling_overrides(args))
    if engine.kv_events_config is not None:  # KV events carry every client's token ids: on the server's address,
        # and behind the API key, if there is one
        engine = dataclasses.replace(engine, kv_events_config=dataclasses.replace(
            engine.kv_events_config, bind_host=args.host, require_curve=cfg.api_key is not None))
    serve(engine, cfg)
    return 0
