"""The ecosystem's own tools against a real server on the demo model (issue 26, finding 5):
guidellm's streaming benchmark, lm-evaluation-harness' log-likelihood (multiple-choice) path through
`local-completions`, and langchain's structured output. Each is installed by the test extra
(scripts/setup.sh; torch-dependent ones under a torch==2.13.0 constraint)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from server_process import ServerProcess

from blockdiff.hub import DEMO_CHECKPOINT
from blockdiff.tokenizer import Tokenizer

BIN = os.path.dirname(sys.executable)
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(None, "--max-model-len", "512", "--max-num-seqs", "8",
                         log_path=str(tmp_path_factory.mktemp("clients") / "server.log"))
    yield proc
    proc.close()


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


@pytest.mark.slow  # ~25 s, most of it lm-eval's start; tests/test_scoring.py sends its requests in the default run
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
    out = tmp_path / "results"
    run = subprocess.run(
        [os.path.join(BIN, "lm_eval"), "--model", "local-completions", "--tasks", "demo_sort_choice",
         "--include_path", str(tmp_path), "--output_path", str(out),
         "--model_args", f"model=demo,base_url={server.url}/v1/completions,tokenizer={DEMO_CHECKPOINT},"
                         "tokenizer_backend=huggingface,num_concurrent=8,max_retries=1"],
        capture_output=True, text=True, timeout=600, env=OFFLINE)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [result] = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    accuracy = result["results"]["demo_sort_choice"]["acc,none"]
    print(f"lm-eval local-completions, demo_sort_choice (24 questions, 2 choices): acc {accuracy:.3f}")
    assert accuracy >= 0.9  # chance is 0.5


def test_guidellm_streaming_reports_time_to_first_token_and_inter_token_latency(server, tmp_path):
    pytest.importorskip("guidellm")
    report = tmp_path / "guidellm.json"
    run = subprocess.run(
        [os.path.join(BIN, "guidellm"), "run", "--backend", f"kind=openai_http,target={server.url},model=demo",
         "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=6",
         "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=24",
         "--tokenizer", f"kind=huggingface_auto,model={DEMO_CHECKPOINT}", "--output", f"kind=json,path={report}",
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


def test_langchain_with_structured_output_on_the_demo(server):
    """langchain's with_structured_output sends response_format with the model's JSON schema; the
    constrained commit makes the demo's reply parse into it (docs/structured_outputs.md)."""
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Sorted(BaseModel):
        digits: list[int]

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="demo", max_tokens=32, max_retries=0)
    assert llm.invoke("sort: 3 1 2").content  # the client works...
    answer = llm.with_structured_output(Sorted).invoke("sort: 3 1 2")  # ...and its structured output parses
    assert isinstance(answer, Sorted) and all(isinstance(d, int) for d in answer.digits)
