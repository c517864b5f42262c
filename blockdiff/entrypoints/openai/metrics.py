"""Serving metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

Counters and histograms are updated on the event loop; gauges are read from the engine when
/metrics is scraped. Beside blockdiff's own families, `VllmMetrics` reports the same events under
vLLM's names (with vLLM's `model_name` label), so that dashboards and tools written for a vLLM
server read a blockdiff one (docs/server.md, "vLLM metric names").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from blockdiff.engine.client import EngineClient, EngineStats


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OUTCOMES = ("stop", "length", "abort", "error")


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    # Label values escaped as the exposition format requires (a served model name may hold any text).
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in pairs)
    return "{" + body + "}" if body else ""


Labels = tuple[tuple[str, str], ...]


class Counter:
    def __init__(self, name: str, help: str, label: str | None = None, initial: Iterable[str] = (), const: Labels = ()):
        self.name, self.help, self.label, self.const = name, help, label, const
        self.values: dict[str, float] = {v: 0.0 for v in initial} if label else {"": 0.0}

    def inc(self, amount: float = 1.0, label: str = "") -> None:
        self.values[label] = self.values.get(label, 0.0) + amount

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]

    def samples(self) -> list[str]:
        return [f"{self.name}{_labels([*self.const, *([(self.label, value)] if self.label else [])])} {_number(total)}"
                for value, total in sorted(self.values.items())]

    def render(self) -> list[str]:
        return self.header() + self.samples()


class Gauge:
    """A value read from the engine at each scrape; kind "counter" for a total the engine keeps. A
    read that gives None (an engine that is not there now) writes no sample."""

    def __init__(self, name: str, help: str, read: Callable[[], float | None], kind: str = "gauge", const: Labels = ()):
        self.name, self.help, self.read, self.kind, self.const = name, help, read, kind, const

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> list[str]:
        value = self.read()
        return [] if value is None else [f"{self.name}{_labels(self.const)} {_number(value)}"]

    def render(self) -> list[str]:
        return self.header() + self.samples()


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...], const: Labels = ()):
        self.name, self.help, self.const = name, help, const
        self.bounds = (*sorted(buckets), math.inf)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]

    def samples(self) -> list[str]:
        lines = [f"{self.name}_bucket{_labels([*self.const, ('le', _number(bound))])} {count}"
                 for bound, count in zip(self.bounds, self.counts)]
        lines.append(f"{self.name}_sum{_labels(self.const)} {_number(self.sum)}")
        lines.append(f"{self.name}_count{_labels(self.const)} {self.counts[-1]}")
        return lines

    def render(self) -> list[str]:
        return self.header() + self.samples()


_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_CANVAS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


def _token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context length."""
    out, scale = [], 1
    while scale <= max_model_len:
        out += [b for b in (scale, 2 * scale, 5 * scale) if b <= max_model_len]
        scale *= 10
    return tuple(out)


class VllmMetrics:
    """vLLM's metric names for the events ServingMetrics counts, of one engine, labelled as vLLM
    labels them: the served model's name and the engine's index (`engine`, one per data-parallel
    replica). A diffusion model outputs a canvas at a time: a "token" latency here is a canvas's (time
    to the first committed canvas, time between committed canvases), as vLLM reports DiffusionGemma.
    `stats()` is the engine's EngineStats now, None while it is not there (its gauges then write nothing)."""

    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str, engine: str, max_model_len: int):
        v = "vllm:"
        m = (("model_name", model_name), ("engine", engine))

        def read(field: str) -> Callable[[], float | None]:
            return lambda: None if (now := stats()) is None else getattr(now, field)

        def cache_info() -> float | None:  # vLLM's info gauge: 1, its labels say what
            now = stats()
            if now is None:
                return None
            labels = {"block_size": now.block_size, "cache_dtype": "auto", "enable_prefix_caching": now.prefix_caching,
                      "num_gpu_blocks": now.kv_cache_blocks, "prefix_caching_hash_algo": "sha256"}
            info.const = (*m, *((k, str(v)) for k, v in labels.items()))
            return 1

        self.success = Counter(v + "request_success_total", "Requests that ended, by finish reason.", "finished_reason",
                               OUTCOMES, const=m)
        self.prompt_tokens = Counter(v + "prompt_tokens_total", "Prompt tokens of ended requests.", const=m)
        self.generation_tokens = Counter(v + "generation_tokens_total", "Tokens generated by ended requests.", const=m)
        self.denoising_steps = Counter(v + "diffusion_num_denoising_steps_total",
                                       "Denoising steps (decoder passes over one canvas).", const=m)
        self.positions = Counter(v + "diffusion_num_canvas_positions_total", "Canvas positions run through the decoder.",
                                 const=m)
        self.committed = Counter(v + "diffusion_num_committed_tokens_total",
                                 "Tokens committed to the outputs of ended requests (after EOS and stop trimming).", const=m)
        info = Gauge(v + "cache_config_info", "Information of the KV cache (its labels; the value is 1).", cache_info)
        self.gauges = [
            Gauge(v + "num_requests_running", "Requests holding a slot and KV cache.", read("num_running"), const=m),
            Gauge(v + "num_requests_waiting", "Requests waiting for a slot or KV cache.", read("num_waiting"), const=m),
            Gauge(v + "kv_cache_usage_perc", "Fraction of full-attention KV cache blocks reserved (1 = full).",
                  read("kv_cache_usage"), const=m),
            Gauge(v + "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache (first admissions).",
                  read("prefix_cache_queries"), kind="counter", const=m),
            Gauge(v + "prefix_cache_hits_total", "Prompt tokens found in the prefix cache (first admissions).",
                  read("prefix_cache_hits"), kind="counter", const=m),
            Gauge(v + "num_preemptions_total", "Requests preempted (fairness or KV cache exhausted).",
                  read("num_preemptions"), kind="counter", const=m),
            info,
        ]
        tokens = _token_buckets(max_model_len)
        self.ttft = Histogram(v + "time_to_first_token_seconds", "Arrival to the first committed canvas.", _TTFT_BUCKETS, m)
        self.itl = Histogram(v + "inter_token_latency_seconds", "Time between consecutive committed canvases.",
                             _CANVAS_BUCKETS, m)
        self.tpot_old = Histogram(v + "time_per_output_token_seconds",
                                  "The same observations as vllm:inter_token_latency_seconds (vLLM's older name).",
                                  _CANVAS_BUCKETS, m)
        self.tpot = Histogram(v + "request_time_per_output_token_seconds",
                              "Per request: (end-to-end - time to first canvas) / (generated tokens - 1).", _CANVAS_BUCKETS, m)
        self.e2e = Histogram(v + "e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS, m)
        self.queue = Histogram(v + "request_queue_time_seconds", "Arrival to first admission.", _E2E_BUCKETS, m)
        self.inference = Histogram(v + "request_inference_time_seconds", "First admission to finish.", _E2E_BUCKETS, m)
        self.prefill = Histogram(v + "request_prefill_time_seconds", "First admission to the first committed canvas.",
                                 _E2E_BUCKETS, m)
        self.decode = Histogram(v + "request_decode_time_seconds", "First committed canvas to finish.", _E2E_BUCKETS, m)
        self.prompt_len = Histogram(v + "request_prompt_tokens", "Prompt tokens per ended request.", tokens, m)
        self.generation_len = Histogram(v + "request_generation_tokens", "Generated tokens per ended request.", tokens, m)

    def finished(self, finish_reason: str, prompt_tokens: int, generated_tokens: int, m: dict) -> None:
        self.success.inc(label=finish_reason)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        self.denoising_steps.inc(m["denoising_steps"])
        self.positions.inc(m["canvas_positions_evaluated"])
        self.committed.inc(m["committed_tokens"])
        self.prompt_len.observe(prompt_tokens)
        self.generation_len.observe(generated_tokens)
        for gap in m["canvas_gaps"]:
            self.itl.observe(gap)
            self.tpot_old.observe(gap)
        first, total, queued = m["time_to_first_canvas"], m["total_time"], m["queue_time"]
        if total is not None:
            self.e2e.observe(total)
        if queued is not None:
            self.queue.observe(queued)
            if total is not None:
                self.inference.observe(total - queued)
        if first is not None:
            self.ttft.observe(first)
            if queued is not None:
                self.prefill.observe(first - queued)
            if total is not None:
                self.decode.observe(total - first)
                if generated_tokens > 1:
                    self.tpot.observe((total - first) / (generated_tokens - 1))

    def families(self) -> list:
        return [self.success, self.prompt_tokens, self.generation_tokens, self.denoising_steps, self.positions,
                self.committed, *self.gauges, self.ttft, self.itl, self.tpot_old, self.tpot, self.e2e, self.queue,
                self.inference, self.prefill, self.decode, self.prompt_len, self.generation_len]


class ServingMetrics:
    """What /metrics reports, of the engines behind an EngineClient: blockdiff's families with the
    engines added up, and vLLM's labelled per engine. Counters and histograms are fed on the event
    loop by the client's on_step and on_finish; gauges are read from `client.engine_stats()` at each
    scrape."""

    def __init__(self, client: EngineClient, model_name: str):
        self.client, self.model_name = client, model_name
        self._now: dict[str, EngineStats] = {}  # the engines' stats at this scrape
        self.vllm: dict[str, VllmMetrics] = {}
        for engine in client.engine_stats():
            self._engine(engine)

        def total(field: str) -> Callable[[], float]:
            return lambda: getattr(EngineStats.total(list(self._now.values())), field) if self._now else 0

        p = "blockdiff_"
        self.requests = Counter(p + "requests_total", "Engine requests that ended, by outcome (stop, length, abort, error).",
                                "outcome", OUTCOMES)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of ended requests.")
        self.generation_tokens = Counter(p + "generation_tokens_total", "Tokens generated by ended requests.")
        self.denoising_steps = Counter(p + "denoising_steps_total", "Denoising steps (decoder passes over one canvas).")
        self.canvases = Counter(p + "canvases_total", "Canvases committed.")
        self.positions = Counter(p + "canvas_positions_evaluated_total", "Canvas positions run through the decoder.")
        self.http = Counter(p + "http_responses_total", "HTTP responses, by status code.", "status")
        self.refusals = Counter(p + "http_refusals_total", "Requests refused while their connection or body was "
                                "admitted (each also counted by status), by reason.", "reason")
        self.closed = Counter(p + "connections_closed_total", "Connections the server closed with no request to "
                              "answer, by reason (header_timeout, room: the longest idle one, past --max-connections).",
                              "reason")
        self.step_time = Histogram(p + "step_duration_seconds", "Duration of one engine step (one forward).",
                                   _LATENCY_BUCKETS)
        self.first_canvas = Histogram(p + "time_to_first_canvas_seconds", "Arrival to first committed canvas.",
                                      _REQUEST_BUCKETS)
        self.request_time = Histogram(p + "request_duration_seconds", "Arrival to finish of finished requests.",
                                      _REQUEST_BUCKETS)
        self.gauges = [
            Gauge(p + "requests_running", "Requests holding a slot and KV cache.", total("num_running")),
            Gauge(p + "requests_waiting", "Requests waiting for a slot or KV cache.", total("num_waiting")),
            Gauge(p + "kv_cache_usage_ratio", "Fraction of full-attention KV cache blocks reserved.",
                  total("kv_cache_usage")),
            Gauge(p + "kv_cache_blocks", "Full-attention KV cache blocks in all.", total("kv_cache_blocks")),
        ]
        # Counted by the engines; read at each scrape, as counters.
        self.engine_counters = [
            Gauge(p + "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache (first admissions).",
                  total("prefix_cache_queries"), kind="counter"),
            Gauge(p + "prefix_cache_hits_total", "Prompt tokens found in the prefix cache (first admissions).",
                  total("prefix_cache_hits"), kind="counter"),
            Gauge(p + "num_preemptions_total", "Requests preempted (fairness or KV cache exhausted).",
                  total("num_preemptions"), kind="counter"),
        ]

    def _engine(self, engine: str) -> VllmMetrics:
        if engine not in self.vllm:
            self.vllm[engine] = VllmMetrics(lambda: self._now.get(engine), self.model_name, engine,
                                            self.client.limits.max_model_len)
        return self.vllm[engine]

    def step(self, seconds: float, engine: str = "0") -> None:
        self.step_time.observe(seconds)

    def finished(self, finish_reason: str, prompt_tokens: int, generated_tokens: int, m: dict, engine: str = "0") -> None:
        """A request of `engine` ended: finish_reason is stop, length or abort; m its RequestOutput.metrics."""
        self.requests.inc(label=finish_reason)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        self.denoising_steps.inc(m["denoising_steps"])
        self.canvases.inc(m["canvases"])
        self.positions.inc(m["canvas_positions_evaluated"])
        if m["time_to_first_canvas"] is not None:
            self.first_canvas.observe(m["time_to_first_canvas"])
        if m["total_time"] is not None:
            self.request_time.observe(m["total_time"])
        self._engine(engine).finished(finish_reason, prompt_tokens, generated_tokens, m)

    def response(self, status: int) -> None:
        self.http.inc(label=str(status))

    def refused(self, reason: str) -> None:
        self.refusals.inc(label=reason)

    def connection_closed(self, reason: str) -> None:
        self.closed.inc(label=reason)

    def render(self) -> str:
        self._now = self.client.engine_stats()
        for engine in self._now:
            self._engine(engine)
        families = [self.requests, self.prompt_tokens, self.generation_tokens, self.denoising_steps, self.canvases,
                    self.positions, *self.gauges, *self.engine_counters, self.step_time, self.first_canvas, self.request_time, self.http,
                    self.refusals, self.closed]
        lines = [line for family in families for line in family.render()]
        # vLLM's families: each once, with the samples of every engine.
        engines = [self.vllm[e] for e in sorted(self.vllm, key=_engine_order)]
        for same in zip(*(e.families() for e in engines)):
            lines += same[0].header()
            for family in same:
                lines += family.samples()
        return "\n".join(lines) + "\n"


def _engine_order(name: str) -> tuple:
    return (0, int(name), "") if name.isdigit() else (1, 0, name)
