"""Serving metrics for /metrics, with prometheus_client, in a registry of the server's own (several
servers or test apps in one process do not collide in the global one).

Every event is counted once. What vLLM has a name for is reported under vLLM's name, labels
(`model_name`, `engine`: one per data-parallel replica) and buckets, so that dashboards and tools
written for a vLLM server read a blockdiff one (docs/server.md, "Metrics"); what it has none for is
`blockdiff:`. Counters and histograms are fed on the event loop by the client's on_step and
on_finish; what the engines keep (gauges, their own totals) is read from them at each scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from blockdiff.engine.client import EngineClient

OUTCOMES = ("stop", "length", "abort", "error")

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# vLLM's buckets for its families of the same names.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_CANVAS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
_ENGINE = ("model_name", "engine")


def _token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's)."""
    out, scale = [], 1
    while scale <= max_model_len:
        out += [b for b in (scale, 2 * scale, 5 * scale) if b <= max_model_len]
        scale *= 10
    return tuple(out)


def _engine_order(name: str) -> tuple:
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


# vLLM's families that the engines keep: (EngineStats field, name, help, kind).
_ENGINE_STATE = [
    ("num_running", "vllm:num_requests_running", "Requests holding a slot and KV cache.", GaugeMetricFamily),
    ("num_waiting", "vllm:num_requests_waiting", "Requests waiting for a slot or KV cache.", GaugeMetricFamily),
    ("kv_cache_usage", "vllm:kv_cache_usage_perc", "Fraction of full-attention KV cache blocks reserved (1 = full).",
     GaugeMetricFamily),
    # Totals the engine counts: counters, though read here, not incremented.
    ("prefix_cache_queries", "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (first "
     "admissions).", CounterMetricFamily),
    ("prefix_cache_hits", "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (first admissions).",
     CounterMetricFamily),
    ("num_preemptions", "vllm:num_preemptions", "Requests preempted (fairness or KV cache exhausted).",
     CounterMetricFamily),
]
_CACHE_INFO = (*_ENGINE, "block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks", "prefix_caching_hash_algo")


class EngineState(Collector):
    """The engines' gauges and totals, read from `client.engine_stats()` at each scrape. An engine
    that is not there now (a replica restarting) has no sample."""

    def __init__(self, client: EngineClient, model_name: str):
        self.client, self.model_name = client, model_name

    def collect(self):
        families = [(field, kind(name, help, labels=_ENGINE)) for field, name, help, kind in _ENGINE_STATE]
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache (its labels; the value is 1).",
                                 labels=_CACHE_INFO)
        stats = self.client.engine_stats()
        for engine in sorted(stats, key=_engine_order):
            now, labels = stats[engine], [self.model_name, engine]
            for field, family in families:
                family.add_metric(labels, getattr(now, field))
            info.add_metric([*labels, str(now.block_size), "auto", str(now.prefix_caching), str(now.kv_cache_blocks),
                             "sha256"], 1)
        return [family for _, family in families] + [info]


class ServingMetrics:
    """What /metrics reports, of the engines behind an EngineClient. vLLM's families are per engine
    (summed over `engine` for the server's total, as with vLLM's data-parallel replicas); blockdiff's
    add the engines up. A diffusion model outputs a canvas at a time: a "token" latency here is a
    canvas's (time to the first committed canvas, time between committed canvases), as vLLM reports
    DiffusionGemma."""

    def __init__(self, client: EngineClient, model_name: str):
        self.client, self.model_name = client, model_name
        self.registry = r = CollectorRegistry()
        r.register(EngineState(client, model_name))
        v, b = "vllm:", "blockdiff:"

        def hist(name: str, help: str, buckets) -> Histogram:
            return Histogram(v + name, help, _ENGINE, buckets=buckets, registry=r)

        self.success = Counter(v + "request_success", "Requests that ended, by finish reason.",
                               (*_ENGINE, "finished_reason"), registry=r)
        self.prompt_tokens = Counter(v + "prompt_tokens", "Prompt tokens of ended requests.", _ENGINE, registry=r)
        self.generation_tokens = Counter(v + "generation_tokens", "Tokens generated by ended requests.", _ENGINE,
                                         registry=r)
        self.denoising_steps = Counter(v + "diffusion_num_denoising_steps", "Denoising steps (decoder passes over "
                                       "one canvas).", _ENGINE, registry=r)
        self.positions = Counter(v + "diffusion_num_canvas_positions", "Canvas positions run through the decoder.",
                                 _ENGINE, registry=r)
        self.committed = Counter(v + "diffusion_num_committed_tokens", "Tokens committed to the outputs of ended "
                                 "requests (after EOS and stop trimming).", _ENGINE, registry=r)
        self.ttft = hist("time_to_first_token_seconds", "Arrival to the first committed canvas.", _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive committed canvases.", _CANVAS_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Per request: (end-to-end - time to first canvas) / (generated tokens - 1).", _CANVAS_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first admission.", _E2E_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "First admission to finish.", _E2E_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "First admission to the first committed canvas.",
                            _E2E_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First committed canvas to finish.", _E2E_BUCKETS)
        tokens = _token_buckets(client.limits.max_model_len)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per ended request.", tokens)
        self.generation_len = hist("request_generation_tokens", "Generated tokens per ended request.", tokens)
        self.per_engine = [self.prompt_tokens, self.generation_tokens, self.denoising_steps, self.positions,
                           self.committed, self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.inference,
                           self.prefill, self.decode, self.prompt_len, self.generation_len]
        # blockdiff's own: no vLLM family counts these.
        self.canvases = Counter(b + "canvases", "Canvases committed.", registry=r)
        self.step_time = Histogram(b + "step_duration_seconds", "Duration of one engine step (one forward).",
                                   buckets=_STEP_BUCKETS, registry=r)
        self.http = Counter(b + "http_responses", "HTTP responses, by status code.", ("status",), registry=r)
        self.refusals = Counter(b + "http_refusals", "Requests refused while their connection or body was admitted "
                                "(each also counted by status), by reason.", ("reason",), registry=r)
        self.closed = Counter(b + "connections_closed", "Connections the server closed with no request to answer, by "
                              "reason (header_timeout, room: the longest idle one, past --max-connections).",
                              ("reason",), registry=r)
        self._engines: set[str] = set()
        self._add_engines(client.engine_stats())

    def _add_engines(self, engines) -> None:
        """Zero samples for engines not seen yet: a scrape before an engine's first request has its series."""
        for engine in sorted(set(engines) - self._engines, key=_engine_order):
            self._engines.add(engine)
            for family in self.per_engine:
                family.labels(self.model_name, engine)
            for outcome in OUTCOMES:
                self.success.labels(self.model_name, engine, outcome)

    def step(self, seconds: float, engine: str = "0") -> None:
        self.step_time.observe(seconds)

    def finished(self, finish_reason: str, prompt_tokens: int, generated_tokens: int, m: dict, engine: str = "0") -> None:
        """A request of `engine` ended: finish_reason is stop, length or abort; m its RequestOutput.metrics."""
        self._add_engines((engine,))
        labels = (self.model_name, engine)
        self.success.labels(*labels, finish_reason).inc()
        self.prompt_tokens.labels(*labels).inc(prompt_tokens)
        self.generation_tokens.labels(*labels).inc(generated_tokens)
        self.denoising_steps.labels(*labels).inc(m["denoising_steps"])
        self.positions.labels(*labels).inc(m["canvas_positions_evaluated"])
        self.committed.labels(*labels).inc(m["committed_tokens"])
        self.canvases.inc(m["canvases"])
        self.prompt_len.labels(*labels).observe(prompt_tokens)
        self.generation_len.labels(*labels).observe(generated_tokens)
        for gap in m["canvas_gaps"]:
            self.itl.labels(*labels).observe(gap)
        first, total, queued = m["time_to_first_canvas"], m["total_time"], m["queue_time"]
        if total is not None:
            self.e2e.labels(*labels).observe(total)
        if queued is not None:
            self.queue.labels(*labels).observe(queued)
            if total is not None:
                self.inference.labels(*labels).observe(total - queued)
        if first is not None:
            self.ttft.labels(*labels).observe(first)
            if queued is not None:
                self.prefill.labels(*labels).observe(first - queued)
            if total is not None:
                self.decode.labels(*labels).observe(total - first)
                if generated_tokens > 1:
                    self.tpot.labels(*labels).observe((total - first) / (generated_tokens - 1))

    def response(self, status: int) -> None:
        self.http.labels(str(status)).inc()

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason).inc()

    def connection_closed(self, reason: str) -> None:
        self.closed.labels(reason).inc()

    def render(self) -> bytes:
        """The exposition, in CONTENT_TYPE_LATEST."""
        self._add_engines(self.client.engine_stats())
        return generate_latest(self.registry)
