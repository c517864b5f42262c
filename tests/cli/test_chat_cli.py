"""`blockdiff chat` driven over stdin: the demo model loaded by the command, and a real server."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
from server_process import ServerProcess


def _chat(stdin: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "blockdiff", "chat", "--log-level", "warning", *args], input=stdin,
                          capture_output=True, text=True, timeout=300, env=env)


def test_the_demo_model_answers_until_exit():
    done = _chat("sort: 3 1 2\n\n/exit\nreverse: block\n")
    assert (done.returncode, done.stdout, done.stderr) == (0, "1 2 3\n", "")


def test_a_failed_turn_prints_one_error_line_and_is_left_out_of_the_conversation():
    # Kept in the conversation, the long turn would make every later prompt too long as well.
    done = _chat("x" * 60 + "\nupper: diffusion\n", "--max-model-len", "48")
    assert done.returncode == 0 and done.stdout == "DIFFUSION\n"
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: prompt of ") and "max_model_len=48" in lines[0], done.stderr


def test_chat_against_a_server_streams_and_keeps_the_conversation(tmp_path):
    server = ServerProcess(None, "--max-model-len", "128", log_path=str(tmp_path / "server.log"))
    try:
        before = server.metrics().total("vllm:prompt_tokens_total")
        done = _chat("sort: 3 1 2\nreverse: block\n", "--url", server.url + "/v1", "--max-tokens", "16")
        assert done.returncode == 0 and done.stderr == "", done.stderr
        first, second = done.stdout.splitlines()
        assert first == "1 2 3"
        # The second turn sent the whole conversation: the server prefilled both prompts in full.
        one = [{"role": "user", "content": "sort: 3 1 2"}]
        two = [*one, {"role": "assistant", "content": first}, {"role": "user", "content": "reverse: block"}]
        counts = [httpx.post(server.url + "/tokenize", json={"messages": m}, timeout=30).json()["count"] for m in (one, two)]
        assert server.wait_idle().total("vllm:prompt_tokens_total") - before == sum(counts)
    finally:
        server.close()


def test_llm_stream_yields_what_each_committed_canvas_adds():
    from blockdiff import LLM, SamplingParams

    with LLM() as llm:  # the demo: canvases of 8 tokens
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": "upper: diffusion"}])
        outs = list(llm.stream(ids, SamplingParams(seed=0)))
        whole, = llm.generate([ids], SamplingParams(seed=0))
    assert len(outs) == whole.metrics["canvases"] >= 2
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert "".join(o.text for o in outs) == whole.text == "DIFFUSION"
    assert sum((o.token_ids for o in outs), []) == whole.token_ids
