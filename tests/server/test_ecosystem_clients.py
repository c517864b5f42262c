"""The ecosystem's own tools against a real server on the demo model: guidellm's streaming
benchmark, and lm-evaluation-harness' log-likelihood (multiple-choice) path through
`local-completions` and its chat model (langchain's structured output is in
test_server_structured.py). Each is installed by the test extra (scripts/setup.sh; torch-dependent
ones under a torch==2.13.0 constraint).

The server runs as a vLLM user would start it for these tools: the checkpoint
named by its directory, which becomes the served model's id (guidellm loads its tokenizer from the
id /v1/models reports), and --enable-tokenizer-info-endpoint (lm-eval's local-completions then
tokenizes through the server). The tools get only the flags their docs give for a vLLM server;
the commands are docs/server.md's."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import httpx
import pytest
from server_process import serve

from blockdiff.hub import DEMO_CHECKPOINT
from blockdiff.tokenizer import Tokenizer

BIN = os.path.dirname(sys.executable)
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING"}


server = serve(DEMO_CHECKPOINT, "--max-model-len", "512", "--max-num-seqs", "8", "--enable-tokenizer-info-endpoint")


def sort_choice_docs(n: int, seed: int = 0) -> list[dict]:
    """The demo's sort task as multiple choice: its chat prompt, the sorted digits against a shuffle
    of them, in a random order."""
    rng, template, docs = random.Random(seed), Tokenizer.from_pretrained(DEMO_CHECKPOINT), []
    while len(docs) < n:
        digits = [rng.randint(0, 9) for _ in range(rng.randint(3, 7))]
        right, wrong = sorted(digits), list(digits)
        while wrong == right:
            rng.shuffle(wrong)
        choices = [" ".join(map(str, right)), " ".join(map(str, wrong))]
        label = rng.randint(0, 1)
        if label:
            choices.reverse()
        prompt = template.apply_chat_template([{"role": "user", "content": "sort: " + " ".join(map(str, digits))}])
        docs.append({"context": prompt, "choices": choices, "label": label})
    return docs


def test_tokenizer_info_is_vllms_and_names_no_server_path(server):
    info = httpx.get(server.url + "/tokenizer_info").json()
    tokenizer = Tokenizer.from_pretrained(DEMO_CHECKPOINT)
    # tokenizer_config.json's fields, special tokens as their text, and the template the server renders
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("<bos>", "<eos>", "<pad>")
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == 131072
    assert DEMO_CHECKPOINT not in json.dumps(info)


# lm-eval's local-completions as its API guide gives it for vLLM: model and base_url, nothing else. It
# finds /tokenizer_info and /tokenize and tokenizes through the server: no transformers needed.
_LOCAL_COMPLETIONS = """
import sys
sys.modules["transformers"] = None  # lm-eval's base install has no transformers: any import of it fails
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI
lm = LocalCompletionsAPI(model=sys.argv[1], base_url=sys.argv[2] + "/v1/completions", max_retries=1)
requests = [Instance("loglikelihood", {}, (sys.argv[3], choice), 0) for choice in sys.argv[4:]]
print(lm.tokenizer_backend, *(score for score, _ in lm.loglikelihood(requests, disable_tqdm=True)))
"""


def test_lm_eval_local_completions_tokenizes_through_the_server_without_transformers(server):
    pytest.importorskip("lm_eval")
    [doc] = sort_choice_docs(1)
    right, wrong = doc["choices"][doc["label"]], doc["choices"][1 - doc["label"]]
    run = subprocess.run([sys.executable, "-c", _LOCAL_COMPLETIONS, DEMO_CHECKPOINT, server.url, doc["context"], right,
                          wrong], capture_output=True, text=True, timeout=120, env=OFFLINE)
    assert run.returncode == 0, run.stderr[-3000:]
    backend, right_score, wrong_score = run.stdout.split()[-3:]
    assert backend == "remote"
    assert float(right_score) > float(wrong_score)  # the sorted digits are the likelier continuation


def _lm_eval(server, tmp_path, model: str, endpoint: str, task: str, *flags: str) -> dict:
    """lm-eval's `model` against the server's /v1/`endpoint` on `task` (its yaml in tmp_path), as its
    docs give it for a vLLM server: the task's metrics."""
    out = tmp_path / "results"
    run = subprocess.run(
        [os.path.join(BIN, "lm_eval"), "--model", model, "--tasks", task, "--include_path", str(tmp_path),
         "--output_path", str(out), *flags,
         "--model_args", f"model={DEMO_CHECKPOINT},base_url={server.url}/v1/{endpoint},num_concurrent=8,max_retries=1"],
        capture_output=True, text=True, timeout=600, env=OFFLINE)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [result] = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    return result["results"][task]


@pytest.mark.slow  # ~25 s, most of it lm-eval's start; the test above scores through the same model in the default run
def test_lm_eval_multiple_choice_ranks_the_sorted_digits_first(server, tmp_path):
    pytest.importorskip("lm_eval")
    data = tmp_path / "sort_choice.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in sort_choice_docs(24)))
    (tmp_path / "sort_choice.yaml").write_text(f"""task: demo_sort_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")
    accuracy = _lm_eval(server, tmp_path, "local-completions", "completions", "demo_sort_choice")["acc,none"]
    print(f"lm-eval local-completions, demo_sort_choice (24 questions, 2 choices): acc {accuracy:.3f}")
    assert accuracy >= 0.9  # chance is 0.5


@pytest.mark.slow  # ~40 s under load: lm-eval's start and 8 generations
def test_lm_eval_local_chat_completions_sorts_the_digits(server, tmp_path):
    """lm-eval's chat model as its docs give it for vLLM: model, base_url and --apply_chat_template;
    the server renders the chat template, so no tokenizer on either side of the client."""
    pytest.importorskip("lm_eval")
    rng = random.Random(1)
    rows = [[rng.randint(0, 9) for _ in range(rng.randint(3, 6))] for _ in range(8)]
    data = tmp_path / "sort_gen.jsonl"
    data.write_text("".join(json.dumps({"question": "sort: " + " ".join(map(str, r)),
                                        "answer": " ".join(map(str, sorted(r)))}) + "\n" for r in rows))
    (tmp_path / "sort_gen.yaml").write_text(f"""task: demo_sort_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: []
  max_gen_toks: 24
metric_list:
  - metric: exact_match
""")
    accuracy = _lm_eval(server, tmp_path, "local-chat-completions", "chat/completions", "demo_sort_gen",
                        "--apply_chat_template")["exact_match,none"]
    print(f"lm-eval local-chat-completions, demo_sort_gen (8 questions): exact match {accuracy:.3f}")
    assert accuracy >= 0.75


# What failed first in `guidellm run` against a server named "demo": its own steps that pick the model
# (the first id of /v1/models) and load that id's tokenizer, which its synthetic data is built with.
_GUIDELLM_TOKENIZER = """
import asyncio, sys
from guidellm.benchmark.entrypoints import resolve_backend
from guidellm.data.tokenizers import TokenizerRegistry
from guidellm.schemas.backends.openai_http import OpenAIHTTPBackendArgs
from guidellm.schemas.data.tokenizers import HuggingFaceTokenizerArgs
_, model = asyncio.run(resolve_backend(OpenAIHTTPBackendArgs(target=sys.argv[1])))
tokenizer = TokenizerRegistry.create(HuggingFaceTokenizerArgs(model=model))()
print(*tokenizer(sys.argv[2], add_special_tokens=False)["input_ids"])
"""


def test_guidellm_finds_the_model_and_its_tokenizer_from_the_server(server):
    pytest.importorskip("guidellm")
    run = subprocess.run([sys.executable, "-c", _GUIDELLM_TOKENIZER, server.url, "sort: 3 1 2"],
                         capture_output=True, text=True, timeout=120, env=OFFLINE)
    assert run.returncode == 0, run.stderr[-3000:]
    served = httpx.post(server.url + "/tokenize", json={"prompt": "sort: 3 1 2", "add_special_tokens": False})
    assert list(map(int, run.stdout.split())) == served.json()["tokens"]


@pytest.mark.slow  # ~35 s under load, most of it guidellm's start; the test above runs its model and tokenizer steps
def test_guidellm_streaming_reports_time_to_first_token_and_inter_token_latency(server, tmp_path):
    pytest.importorskip("guidellm")
    report = tmp_path / "guidellm.json"
    run = subprocess.run(
        # No model and no tokenizer: guidellm takes the model's id from /v1/models, the checkpoint
        # directory, and loads the tokenizer from it (a hub id would load from the hub or its cache).
        [os.path.join(BIN, "guidellm"), "run", "--backend", f"kind=openai_http,target={server.url}",
         "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=6",
         "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=24", "--output", f"kind=json,path={report}",
         "--disable-console-interactive"],
        capture_output=True, text=True, timeout=600, env=OFFLINE, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [bench] = json.loads(report.read_text())["benchmarks"]
    metrics = bench["metrics"]
    # guidellm streams with stream_options.continuous_usage_stats: every request must succeed
    assert metrics["request_totals"] == {"successful": 6, "errored": 0, "incomplete": 0, "total": 6}
    ttft = metrics["time_to_first_token_ms"]["successful"]["mean"]
    itl = metrics["inter_token_latency_ms"]["successful"]["mean"]
    tokens = metrics["output_token_count"]["successful"]["mean"]
    print(f"guidellm synchronous, 6 requests: TTFT {ttft:.1f} ms, ITL {itl:.2f} ms, {tokens:.0f} output tokens")
    assert ttft > 0 and itl > 0 and tokens > 0
