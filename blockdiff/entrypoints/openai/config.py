"""The server's settings, apart from the server (the command line reads their defaults without
importing FastAPI and uvicorn)."""

from __future__ import annotations

from dataclasses import dataclass, field

from blockdiff.chat_parts import MediaPolicy


@dataclass
class ServerConfig:
    served_model_names: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    metrics_require_api_key: bool = False  # with api_key: /metrics needs it too (vLLM leaves /metrics open)
    max_queued_requests: int | None = None
    max_client_concurrency: int | None = None  # engine requests (choices x prompts) in progress per client host
    max_request_bytes: int = 16 * 2**20
    max_stream_buffer: int = 8 * 2**20  # bytes (approximately) of a stream its client may leave unread
    shutdown_timeout: int = 3  # seconds open requests get after SIGTERM before they are aborted
    max_connections: int = 1024  # open connections; fewer if the descriptor limit leaves less room
    header_timeout: float = 10.0  # seconds a connection may stay open without starting a request
    body_timeout: float = 60.0  # seconds a request may take to send its body
    min_body_rate: float = 1024.0  # bytes a second a body must average once header_timeout has passed
    max_client_uploads: int = 64  # connections of one client address whose request body is still arriving
    # The peers (IPs, CIDR networks; "*": any) whose X-Forwarded-For names the client (clients.py)
    forwarded_allow_ips: tuple[str, ...] = ()
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open
    responses_store_bytes: int = 256 * 2**20  # JSON of the stored /v1/responses turns; the oldest go first
    max_response_bytes: int = 32 * 2**20  # a request whose response could be larger is refused before any work
    max_request_cost: int | None = None  # None: max_num_seqs requests of max_model_len tokens at the steps limit
    preprocess_threads: int = 2  # threads that decode bodies, render chat templates and tokenize (work_pool.py)
    preprocess_timeout: float = 10.0  # seconds a request's preprocessing may run in all before a 413
    image_decode_threads: int = 1  # threads that decode images (media.py): each may hold one image's memory
    image_fetch_threads: int = 8  # image URLs fetched at once
    log_level: str = "info"
    tool_call_parser: str | None = None  # None: the checkpoint's own format (Gemma 4's) if its tokenizer has it
    reasoning_parser: str | None = None  # the same
    # vLLM's --default-chat-template-kwargs: template variables every chat gets unless it sets them
    default_chat_template_kwargs: dict = field(default_factory=dict)
    strict_request_fields: bool = False  # unknown top-level request fields: a 400 (else ignored with a warning, as vLLM)
    trust_request_chat_template: bool = False  # vLLM's: a request may bring its own chat_template
    enable_tokenizer_info_endpoint: bool = False  # vLLM's: GET /tokenizer_info (it shows the chat template)
    media: MediaPolicy = MediaPolicy()  # where chat image URLs may point (the engine flags --allowed-media-*)
