"""What a vLLM user brings: the seed's serve command with vLLM's diffusion flags, the
offline API in vLLM's shape, and the request fields vLLM accepts, on the real engine and server."""

from __future__ import annotations

import logging
import shlex
from dataclasses import replace

import httpx
import openai
import pytest
from server_process import ServerProcess, serve

from blockdiff import LLM, SamplingParams
from blockdiff.arg_utils import engine_config, sampling_overrides
from blockdiff.entrypoints.cli import build_parser, main
from blockdiff.hub import DEMO_CHECKPOINT

SORT = [{"role": "user", "content": "sort: 3 1 2"}]
# The seed's serve command, with the model and the lengths adapted to a tiny local checkpoint.
SEED_SERVE = ("--max-num-seqs 4 --max-model-len 512 --trust-remote-code "
              "--diffusion-config '{\"canvas_length\":32,\"max_denoising_steps\":16}' "
              "--hf-overrides '{\"diffusion_sampler\":\"entropy_bound\",\"diffusion_entropy_bound\":0.1,"
              "\"diffusion_confidence_threshold\":0.0}'")


def test_the_seed_serve_command_runs_as_written(tiny, tmp_path):
    proc = ServerProcess(tiny, *shlex.split(SEED_SERVE), log_path=str(tmp_path / "server.log"))
    try:
        card = httpx.get(proc.url + "/v1/models").json()["data"][0]
        assert card["canvas_length"] == 32  # the checkpoint's is 8: --diffusion-config's canvas_length
        defaults = card["sampling_defaults"]
        assert (defaults["max_denoising_steps"], defaults["entropy_bound"], defaults["confidence_threshold"]) == (16, 0.1, 0.0)
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused")
        r = client.completions.create(model=tiny, prompt="The quick brown fox", max_tokens=64, seed=0,
                                      extra_body={"ignore_eos": True})
        diffusion = r.usage.model_extra["diffusion"]
        # confidence_threshold 0 never stops a canvas early: two canvases of 32, 16 steps each
        assert r.usage.completion_tokens == 64 and diffusion["canvases"] == 2 and diffusion["denoising_steps"] == 32
        assert "--trust-remote-code is ignored" in proc.log()
    finally:
        proc.close()


@pytest.mark.parametrize("flags,message", [
    (["--diffusion-config", '{"canvas_len": 8}'], "'canvas_len' is not one of vLLM's (canvas_length, max_denoising_steps)"),
    (["--diffusion-config", '{"entropy_bound": 0.2}'], "use --entropy-bound"),
    (["--hf-overrides", '{"max_position_embeddings": 64}'], "use --max-model-len"),
    (["--hf-overrides", '{"rope_theta": 5}'], "no blockdiff flag changes it"),
    (["--hf-overrides", '{"diffusion_bound": 0.2}'], "'diffusion_bound' is not a diffusion setting"),
    (["--hf-overrides", '{"diffusion_sampler": "greedy"}'], "diffusion_sampler must be one of entropy_bound"),
    (["--hf-overrides", '{"diffusion_entropy_bound": "x"}'], "diffusion_entropy_bound must be a number"),
    (["--diffusion-config", "[1]"], "--diffusion-config must be a JSON object"),
    (["--entropy-bound", "0.3", "--hf-overrides", '{"diffusion_entropy_bound": 0.1}'], "--entropy-bound 0.3 disagrees"),
    (["--canvas-length", "8", "--diffusion-config", '{"canvas_length": 16}'], "--canvas-length 8 disagrees"),
])
def test_other_vllm_diffusion_keys_are_refused_naming_the_flag(tiny, capsys, flags, message):
    assert main(["generate", "--model", tiny, *flags, "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_the_vllm_flags_map_onto_blockdiffs_settings():
    args = build_parser().parse_args(["serve", "demo", *shlex.split(SEED_SERVE)])
    cfg = engine_config(args)
    assert cfg.model == DEMO_CHECKPOINT and cfg.canvas_length == 32 and cfg.diffusion_sampler == "entropy_bound"
    assert sampling_overrides(args) == {"max_denoising_steps": 16, "entropy_bound": 0.1, "confidence_threshold": 0.0}


def test_confidence_threshold_zero_runs_every_step_and_the_default_stops_early():
    with LLM("demo") as llm:
        never = llm.chat(SORT, SamplingParams(max_denoising_steps=16, confidence_threshold=0.0, seed=0), use_tqdm=False)[0]
        default = llm.chat(SORT, SamplingParams(max_denoising_steps=16, seed=0), use_tqdm=False)[0]
    assert never.metrics["denoising_steps"] == 16 * never.metrics["canvases"]
    assert default.metrics["denoising_steps"] < 16 * default.metrics["canvases"]
    assert never.outputs[0].text == default.outputs[0].text == "1 2 3"


# ---- the offline API in vLLM's shape ----------------------------------------------------------------
@pytest.fixture(scope="module")
def demo():
    with LLM(model="demo") as llm:
        yield llm


def test_outputs_are_in_vllms_shape_and_chat_sets_the_prompt(demo):
    out = demo.chat(SORT, SamplingParams(max_denoising_steps=16, seed=0, logprobs=2), use_tqdm=False,
                    add_generation_prompt=True)[0]
    completion = out.outputs[0]
    assert completion.index == 0 and completion.text == "1 2 3" and completion.finish_reason == "stop"
    assert completion.token_ids == out.token_ids and completion.stop_reason is None  # EOS: no stop_reason
    assert out.prompt == demo.get_tokenizer().apply_chat_template(SORT) and out.prompt.endswith("<start_of_turn>model\n")
    assert out.prompt_token_ids == demo.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    entries = completion.logprobs
    assert len(entries) == len(completion.token_ids) and all(t in e for t, e in zip(completion.token_ids, entries))
    assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(completion.token_ids, entries)))
    assert demo.llm_engine is demo.engine and demo.llm_engine.scheduler is not None
    bare = demo.chat(SORT, SamplingParams(max_tokens=8, seed=0), use_tqdm=False, add_generation_prompt=False)[0]
    assert len(bare.prompt_token_ids) < len(out.prompt_token_ids)


def test_stop_reason_names_the_stop_string_or_token(demo):
    tok = demo.get_tokenizer()
    two = tok.encode("2", add_special_tokens=False)[0]
    by_string = demo.chat(SORT, SamplingParams(max_denoising_steps=16, seed=0, stop=" 2"), use_tqdm=False)[0].outputs[0]
    assert (by_string.text, by_string.finish_reason, by_string.stop_reason) == ("1", "stop", " 2")
    by_token = demo.chat(SORT, SamplingParams(max_denoising_steps=16, seed=0, stop_token_ids=[two]), use_tqdm=False)[0]
    assert by_token.outputs[0].stop_reason == two and by_token.outputs[0].token_ids[-1] == two


def test_min_tokens_suppresses_the_end_of_the_output(demo):
    """The demo answers "1 2 3" and ends: 6 tokens then EOS. With min_tokens 12 the canvases that
    commit EOS earlier take their most likely other token there instead, so the output goes on."""
    plain = demo.chat(SORT, SamplingParams(max_denoising_steps=16, seed=0), use_tqdm=False)[0]
    eos = set(demo.engine.inputs.eos_token_ids)
    assert len(plain.token_ids) < 12 and plain.token_ids[-1] in eos
    long = demo.chat(SORT, SamplingParams(max_denoising_steps=16, seed=0, min_tokens=12, max_tokens=40, logprobs=0),
                     use_tqdm=False)[0]
    assert len(long.token_ids) >= 12 and not eos & set(long.token_ids[:12])
    assert long.token_ids[:5] == plain.token_ids[:5]  # what came before the EOS is kept
    assert all(lp.logprob <= 0 for lp in long.outputs[0].token_logprobs)
    # a stop string that ends within the first min_tokens tokens ("1 2") does not end the output either
    def text(min_tokens: int) -> str:
        return demo.chat(SORT, SamplingParams(max_denoising_steps=16, seed=0, stop="2", min_tokens=min_tokens),
                         use_tqdm=False)[0].outputs[0].text

    assert (text(0), text(2), text(3)) == ("1 ", "1 ", "1 2 3")


def test_n_gives_n_completions_offline_as_the_server_does(demo):
    """SamplingParams(n=2): one RequestOutput per prompt with two completions, choice i drawing from
    seed + i, as the server's choices do: each equals a request of n=1 seeded seed + i."""
    prompts = ["sort: 9 4 7 1", "reverse: block"]
    params = SamplingParams(max_tokens=16, seed=3, temperature=1.5, logprobs=1)
    outs = demo.generate(prompts, SamplingParams(n=2, max_tokens=16, seed=3, temperature=1.5, logprobs=1), use_tqdm=False)
    assert len(outs) == 2 and [len(o.outputs) for o in outs] == [2, 2]
    for prompt, out in zip(prompts, outs):
        assert [c.index for c in out.outputs] == [0, 1]
        for i, c in enumerate(out.outputs):
            alone = demo.generate(prompt, replace(params, seed=3 + i), use_tqdm=False)[0].outputs[0]
            assert (c.token_ids, c.text) == (alone.token_ids, alone.text)
    assert outs[0].outputs[0].token_ids != outs[0].outputs[1].token_ids  # temperature 1.5: two draws differ
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n=2"):  # the engine itself takes one completion per request
        demo.engine.add_request("sort: 1", SamplingParams(n=2))


def test_llm_takes_vllms_keywords_with_the_clis_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="blockdiff"):
        llm = LLM("demo", trust_remote_code=True, gpu_memory_utilization=0.9, swap_space=4, tokenizer_mode="auto",
                  disable_log_stats=True, max_num_batched_tokens=64, enforce_eager=True,
                  diffusion_config={"canvas_length": 16, "max_denoising_steps": 8},
                  hf_overrides={"diffusion_entropy_bound": 0.2})
    try:
        assert llm.engine.cfg.max_prefill_tokens == 64 and llm.engine.canvas_length == 16
        assert llm.engine.inputs.defaults["entropy_bound"] == 0.2 and llm.engine.inputs.defaults["max_denoising_steps"] == 8
        for name in ("trust-remote-code", "gpu-memory-utilization", "swap-space", "tokenizer-mode", "disable-log-stats"):
            assert f"--{name} is ignored" in caplog.text
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="quantization is not supported"):
        LLM("demo", quantization="fp8")


# ---- the server's vLLM fields -------------------------------------------------------------------
server = serve("demo", "--max-model-len", "256")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def test_continuous_usage_stats_sends_usage_in_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model="demo", messages=SORT, stream=True, max_tokens=32, seed=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chunks and all(c.usage is not None for c in chunks)
    completions = [c.usage.completion_tokens for c in chunks]
    assert completions == sorted(completions) and completions[0] == 0 and completions[-1] > 0
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "1 2 3"


def test_vllms_fields_are_accepted_with_their_meaning(client):
    r = client.chat.completions.create(model="demo", messages=SORT, max_tokens=32, seed=0, metadata={"job": "x"},
                                       extra_body={"min_tokens": 10})
    assert r.usage.completion_tokens >= 10
    special = client.completions.create(model="demo", prompt="<start_of_turn>user\nsort: 3 1 2<end_of_turn>\n"
                                        "<start_of_turn>model\n", max_tokens=16, seed=0,
                                        extra_body={"skip_special_tokens": False, "ignore_eos": True})
    plain = client.completions.create(model="demo", prompt="<start_of_turn>user\nsort: 3 1 2<end_of_turn>\n"
                                      "<start_of_turn>model\n", max_tokens=16, seed=0, extra_body={"ignore_eos": True})
    assert "<" in special.choices[0].text and "<" not in plain.choices[0].text
    echoed = client.chat.completions.create(
        model="demo", messages=[*SORT, {"role": "assistant", "content": "Sorted:"}], max_tokens=16, seed=0,
        extra_body={"echo": True})
    assert echoed.choices[0].message.content.startswith("Sorted:")


def test_reasoning_effort_turns_thinking_on_and_off(client):
    thinking = client.chat.completions.create(model="demo", messages=SORT, max_tokens=64, seed=0, reasoning_effort="high")
    assert thinking.choices[0].message.model_extra.get("reasoning_content") and thinking.choices[0].message.content == "1 2 3"
    plain = client.chat.completions.create(model="demo", messages=SORT, max_tokens=64, seed=0, reasoning_effort="none")
    assert not plain.choices[0].message.model_extra.get("reasoning_content")
    assert plain.choices[0].message.content == "1 2 3"
    with pytest.raises(openai.BadRequestError, match="turns thinking on") as e:
        client.chat.completions.create(model="demo", messages=SORT, max_tokens=8, reasoning_effort="low",
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert e.value.body["param"] == "reasoning_effort"


def test_vllms_generation_config_and_default_template_kwargs(tmp_path):
    """The recipe's `--generation-config vllm` (the sampler's reference defaults instead of the
    checkpoint's generation_config.json; EOS stays the checkpoint's) and
    `--default-chat-template-kwargs '{"enable_thinking": true}'` (thinking unless a request says)."""
    proc = ServerProcess("demo", "--max-model-len", "256", "--generation-config", "vllm",
                         "--default-chat-template-kwargs", '{"enable_thinking": true}', log_path=str(tmp_path / "s.log"))
    try:
        defaults = httpx.get(proc.url + "/v1/models").json()["data"][0]["sampling_defaults"]
        assert defaults["max_denoising_steps"] == 48  # the reference's; the demo's generation_config.json says 16
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused")
        thinking = client.chat.completions.create(model="demo", messages=SORT, max_tokens=64, seed=0)
        assert thinking.choices[0].message.model_extra.get("reasoning_content")
        assert thinking.choices[0].message.content == "1 2 3" and thinking.choices[0].finish_reason == "stop"
        plain = client.chat.completions.create(model="demo", messages=SORT, max_tokens=64, seed=0, reasoning_effort="none")
        assert not plain.choices[0].message.model_extra.get("reasoning_content")
    finally:
        proc.close()
    bad = main(["serve", "--generation-config", "/nonexistent"])
    assert bad == 2
