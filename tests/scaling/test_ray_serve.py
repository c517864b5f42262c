"""The Ray Serve application (entrypoints/ray_serve.py) on a local Ray instance: two
replicas of the demo model behind Ray's HTTP proxy, served to the official openai client."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray[serve]')")
from ray import serve  # noqa: E402

from blockdiff.config import EngineConfig  # noqa: E402
from blockdiff.entrypoints.ray_serve import PrefixAffinityRouter, _replica_options, build_openai_app  # noqa: E402
from server_process import free_port, parse_metrics  # noqa: E402

SUCCESS = "vllm:request_success_total"


def test_replicas_are_placed_with_their_gpus_and_scale_on_queue_length(tiny):
    options = _replica_options(EngineConfig(tiny, tensor_parallel_size=2, device="cuda", max_num_seqs=8), {}, {})
    assert options["placement_group_bundles"] == [{"CPU": 1, "GPU": 2}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 2}
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8}
    router = options["request_router_config"]
    assert router.get_request_router_class() is PrefixAffinityRouter
    assert router.request_router_kwargs == {"imbalance": 2}  # a quarter of a replica's batch
    fixed = _replica_options(EngineConfig(tiny, device="cpu"), {"num_replicas": 3}, {"imbalance": 2})
    assert "autoscaling_config" not in fixed and fixed["num_replicas"] == 3
    assert fixed["placement_group_bundles"] == [{"CPU": 1}]
    with pytest.raises(ValueError, match="unknown argument 'engines'"):
        build_openai_app({"engines": {}})
    with pytest.raises(ValueError, match="unknown field 'max_num_seq'"):
        build_openai_app({"engine": {"max_num_seq": 4}})
    with pytest.raises(ValueError, match="data_parallel_size is Ray's to set"):
        build_openai_app({"engine": {"data_parallel_size": 2}})


def _served(url: str) -> dict[str, float]:
    """Requests each replica (by its Ray replica id) has finished, from the ingress's /metrics."""
    out: dict[str, float] = {}
    for name, value in parse_metrics(httpx.get(url + "/metrics", timeout=10).text).items():
        if name.startswith(SUCCESS + "{"):
            engine = name.split('engine="')[1].split('"')[0]
            out[engine] = out.get(engine, 0) + value
    return out


def _grew(url: str, before: dict[str, float]) -> list[str]:
    deadline = time.monotonic() + 10
    while True:
        after = _served(url)
        grew = [e for e in after for _ in range(int(after[e] - before.get(e, 0)))]
        if grew or time.monotonic() > deadline:
            return grew
        time.sleep(0.05)


@pytest.mark.slow  # a Ray instance, its proxy and three replicas: ~40 s here
def test_the_deployment_serves_chat_through_rays_http_proxy_with_prefix_affinity():
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_openai_app({"engine": {"max_num_seqs": 4}, "deployment": {"num_replicas": 2}})
        serve.run(app, name="blockdiff", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["demo"]
        before = _served(url)
        replies = [client.chat.completions.create(model="demo", messages=[{"role": "user", "content": task}],
                                                  max_tokens=32, seed=1).choices[0].message.content
                   for task in ("reverse: stone", "upper: river", "sort: 3 1 2", "reverse: cloud", "upper: lake")]
        assert replies == ["enots", "RIVER", "1 2 3", "duolc", "LAKE"]
        stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "upper: stream"}],
                                                max_tokens=16, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "STREAM"
        served = _grew(url, before)
        assert len(served) == 6 and len(set(served)) == 2, served  # both replicas took requests

        # A long prefix: its repeats go where its blocks are cached, which the router learns from
        # the replicas' KV events (a random pick of two replicas would hit all five by chance 1/16).
        document = "copy: " + "the quick brown fox jumps over the lazy dog. " * 4
        before = _served(url)
        first = client.completions.create(model="demo", prompt=document, max_tokens=8, seed=5)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        [home] = _grew(url, before)
        time.sleep(1.5)  # the router subscribes to a replica's events once Ray has collected its routing stats
        for i in range(5):
            before = _served(url)
            again = client.completions.create(model="demo", prompt=document + f" ({i})", max_tokens=8, seed=5)
            assert again.usage.prompt_tokens_details.cached_tokens >= len(document) // 16 * 16 - 16
            assert _grew(url, before) == [home]
    finally:
        serve.shutdown()
        ray.shutdown()
