"""The bundled demo model: it answers held-out problems, and keeps answering them the same way
through transformers' generate and under tensor parallelism."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest
import torch
from helpers import load_hf
from server_process import ServerProcess

from blockdiff import LLM, SamplingParams
from blockdiff.demo import demo_checkpoint
from blockdiff.demo.evaluate import EvalResult, evaluate
from blockdiff.demo.tasks import heldout_problems, is_correct
from blockdiff.demo.train import chat_prompt, demo_tokenizer
from blockdiff.entrypoints.cli import main

NUM = 100
# Few denoising steps keep the test fast; the canvas is 8 tokens.
PARAMS = SamplingParams(max_tokens=16, max_denoising_steps=8)
ENGINE = dict(max_num_seqs=NUM, max_model_len=128)


@pytest.fixture(scope="module")
def problems():
    return heldout_problems(NUM)


@pytest.fixture(scope="module")
def tp1(problems) -> EvalResult:
    with LLM(demo_checkpoint(), **ENGINE) as llm:
        return evaluate(llm, problems, PARAMS)


def test_accuracy_on_held_out_problems(tp1):
    assert sum(tp1.total.values()) == NUM
    assert tp1.accuracy >= 0.9, tp1.lines()
    assert all(tp1.correct[task] / tp1.total[task] >= 0.8 for task in tp1.total), tp1.lines()
    assert tp1.tokens_per_step > 1.0  # diffusion commits several tokens per step


def test_transformers_generate_agrees(problems, tp1):
    """transformers' generate, one prompt at a time with the same sampler settings, answers as well
    as we do (its random draws differ from ours, so accuracies are compared, not tokens)."""
    hf = load_hf(demo_checkpoint())
    tokenizer = demo_tokenizer()
    eos = set(hf.generation_config.eos_token_id)
    right = 0
    for i, problem in enumerate(problems):
        prompt = chat_prompt(tokenizer, problem.question)
        torch.manual_seed(i)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=PARAMS.max_tokens, max_denoising_steps=PARAMS.max_denoising_steps)
        tokens = out.sequences[0, len(prompt) :].tolist()
        cut = next((j for j, t in enumerate(tokens) if t in eos), len(tokens))
        right += is_correct(problem, tokenizer.decode(tokens[:cut]))
    assert abs(right / NUM - tp1.accuracy) <= 0.05, (right, tp1.lines())


@pytest.mark.usefixtures("single_threaded_workers")
def test_tensor_parallel_accuracy(problems, tp1):
    """Two ranks (vocabulary-sharded sampling and self-conditioning) answer as well as one."""
    with LLM(demo_checkpoint(), tensor_parallel_size=2, **ENGINE) as llm:
        tp2 = evaluate(llm, problems, PARAMS)
    assert abs(tp2.accuracy - tp1.accuracy) <= 0.02, (tp2.lines(), tp1.lines())


def test_default_model_is_the_demo(capsys):
    """`blockdiff generate` with no model answers a task with the bundled checkpoint."""
    assert main(["generate", "--chat", "sort: 3 1 2", "--seed-per-request", "0"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "1 2 3"
    with LLM() as llm:
        assert llm.engine.cfg.model == demo_checkpoint()


def test_readme_first_command_answers_a_task(tmp_path):
    """The README's first command serves the demo with no model given, and its curl example gets
    the task's answer back."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    first = next(line.strip() for line in readme.splitlines() if line.startswith("    bash scripts/setup.sh"))
    assert first.endswith("blockdiff serve")
    curl = next(line.strip() for line in readme.splitlines() if line.startswith("    curl "))
    route = re.search(r"http://127\.0\.0\.1:8000(/\S+)", curl).group(1)
    body = json.loads(re.search(r"-d '(.*)'$", curl).group(1))
    question = body["messages"][-1]["content"]
    assert question.startswith("sort: ")
    expected = " ".join(sorted(question.removeprefix("sort: ").split()))
    server = ServerProcess(None, log_path=str(tmp_path / "server.log"))
    try:
        r = httpx.post(server.url + route, json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected
        assert f"`{expected}`" in readme  # the README says what comes back
    finally:
        server.close()


def test_eval_command(capsys):
    assert main(["eval", "--task", "demo", "--num", "6", "--max-denoising-steps", "4", "--entropy-bound", "0.3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == ["sort", "reverse", "upper"]
    assert lines[3].startswith("tokens per denoising step: ")
    assert lines[-1].startswith("accuracy: ") and len(lines[-1]) == len("accuracy: 0.000")
    assert main(["eval", "--task", "demo", "--num", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_the_held_out_split_is_a_tenth_and_the_same_in_every_process():
    """Training and evaluation run in different processes: the split must not depend on anything
    per-process (such as Python's salted str hash), and must hold back about a tenth."""
    import random
    import subprocess
    import sys

    from blockdiff.demo.tasks import TASKS, held_out, make_problem

    rng = random.Random(5)
    drawn = [make_problem(TASKS[i % len(TASKS)], rng) for i in range(3000)]
    flags = [held_out(p) for p in drawn]
    assert 0.07 < sum(flags) / len(flags) < 0.13
    code = ("import sys; from blockdiff.demo.tasks import Problem, held_out; "
            "print(''.join('1' if held_out(Problem('', q, '')) else '0' for q in sys.stdin.read().splitlines()))")
    other = subprocess.run([sys.executable, "-c", code], input="\n".join(p.question for p in drawn), text=True,
                           capture_output=True, env={**os.environ, "PYTHONHASHSEED": "123"}, check=True)
    assert other.stdout.strip() == "".join("1" if f else "0" for f in flags)

    first = heldout_problems(30)
    assert [p.task for p in first[:3]] == list(TASKS) and len({p.question for p in first}) == 30
    assert {p.question for p in heldout_problems(30, seed=1)} != {p.question for p in first}
    assert is_correct(first[0], f" {first[0].answer}\n") and not is_correct(first[0], first[0].answer + "0")
