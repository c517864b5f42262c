"""Every CLI error a user meets is one `error: ...` line with the right exit code and no traceback.
Each case runs `python -m blockdiff ...` as a real subprocess."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from blockdiff.model.tiny import TinySpec, make_tiny_model
from server_process import free_port

# What may precede the error line on stderr: log records (the startup summary) and progress bars.
_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING) ")


def _run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "blockdiff", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def _check_one_line_error(stderr: str, expected: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.replace("\r", "\n").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1, stderr
    others = [ln for ln in lines if ln not in errors and not _LOG_LINE.match(ln) and not ln.startswith("Generating")]
    assert not others, f"stray stderr lines: {others}"
    assert expected in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """Checkpoints that fail in the ways a user meets: no tokenizer, malformed config.json."""
    root = tmp_path_factory.mktemp("broken")
    no_tok = make_tiny_model(str(root / "no-tokenizer"), TinySpec(num_layers=1, vocab_size=64, tokenizer=False))
    bad_json = make_tiny_model(str(root / "bad-json"), TinySpec(num_layers=1, vocab_size=64))
    with open(os.path.join(bad_json, "config.json"), "w") as f:
        f.write('{"architectures": [')
    return {"no_tok": no_tok, "bad_json": bad_json, "hf_cache": str(root / "empty-hf-cache")}


# (id, argv (with {placeholders}), exit code, text the error line must hold)
CASES = [
    ("port-out-of-range", ["serve", "--port", "99999"], 2, "argument --port: must be in 0..65535, got 99999"),
    ("device-tpu", ["generate", "--device", "tpu", "hi"], 2, "device 'tpu' is not supported"),
    ("draft-not-ids", ["generate", "--draft", "1,x", "hi"], 2, "argument --draft: '1,x' is not a comma-separated list"),
    ("refused-vllm-flag", ["serve", "--quantization", "awq"], 2, "argument --quantization/-q: not supported"),
    ("bad-sampler-flag", ["generate", "--entropy-bound", "-1", "hi"], 2, "entropy_bound"),
    ("missing-directory", ["generate", "--model", "/nonexistent/model", "hi"], 2, "is not a checkpoint directory"),
    ("hub-id-not-cached", ["generate", "--model", "google/diffusiongemma-26B-A4B-it", "--download-dir", "{hf_cache}", "hi"],
     2, "hf download google/diffusiongemma-26B-A4B-it --cache-dir"),
    ("malformed-config", ["generate", "--model", "{bad_json}", "hi"], 2, "config.json is not valid JSON"),
    ("no-tokenizer", ["generate", "--model", "{no_tok}", "hi"], 2, "pass --tokenizer"),
    ("bench-without-server", ["bench", "serve", "--port", "{free_port}", "--num-prompts", "2"], 1,
     "cannot reach http://127.0.0.1:{free_port}: is blockdiff serve running?"),
    ("port-taken", ["serve", "--port", "{taken_port}"], 1, "cannot listen on 127.0.0.1:{taken_port}: Address already in use"),
    # The tokenizer, not the model, is what is missing.
    ("missing-tokenizer", ["serve", "--tokenizer", "/nonexistent", "--port", "0"], 2,
     "tokenizer '/nonexistent' is not a checkpoint directory"),
    ("tokenizer-without-tokenizer-json", ["serve", "--tokenizer", "{no_tok}", "--port", "0"], 2, "has no tokenizer.json"),
    ("chat-without-server", ["chat", "--url", "http://127.0.0.1:{free_port}/v1"], 1,
     "cannot connect to http://127.0.0.1:{free_port}/v1: "),
    ("make-tiny-model-over-a-checkpoint", ["make-tiny-model", "{no_tok}"], 2, "holds a checkpoint; pass --overwrite"),
    ("forwarded-allow-ips-not-an-address", ["serve", "--forwarded-allow-ips", "127.0.0.1,proxy.local"], 2,
     "argument --forwarded-allow-ips: 'proxy.local' is not an IP address or a CIDR network"),
    ("metrics-key-without-api-key", ["serve", "--metrics-require-api-key", "--port", "{free_port}"], 2,
     "--metrics-require-api-key needs --api-key"),
    ("abbreviated-flag", ["serve", "--max-num-seq", "4"], 2, "unrecognized arguments: --max-num-seq (see `blockdiff serve --help`)"),
    ("unknown-flag-of-a-nested-command", ["bench", "serve", "--no-such-flag"], 2,
     "unrecognized arguments: --no-such-flag (see `blockdiff bench serve --help`)"),
    ("bench-backend-against-its-endpoint", ["bench", "serve", "--backend", "openai", "--endpoint", "/v1/chat/completions"],
     2, "use --backend openai-chat"),
]
if not torch.cuda.is_available():
    CASES.append(("device-cuda-on-cpu-build", ["generate", "--device", "cuda", "hi"], 2, "use the cpu device (--device cpu)"))


# Cases that load a checkpoint, a tokenizer or a server's startup before failing: 7-14 s each on 2
# cores, so the default suite keeps one of each kind and the slow one runs them all.
SLOW_CASES = {"missing-directory", "hub-id-not-cached", "no-tokenizer", "missing-tokenizer",
              "tokenizer-without-tokenizer-json", "make-tiny-model-over-a-checkpoint",
              "forwarded-allow-ips-not-an-address", "metrics-key-without-api-key"}


@pytest.mark.parametrize("argv, code, expected", [
    pytest.param(*c[1:], id=c[0], marks=[pytest.mark.slow] if c[0] in SLOW_CASES else []) for c in CASES])
def test_cli_error_is_one_line_with_the_right_exit_code(argv, code, expected, broken):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        values = {**broken, "free_port": free_port(), "taken_port": taken.getsockname()[1]}
        done = _run(*[a.format(**values) for a in argv])
    assert done.returncode == code, done.stderr
    _check_one_line_error(done.stderr, expected.format(**values))
    assert "serving " not in done.stderr  # never announced before the port is held


def test_debug_log_level_shows_the_traceback():
    done = _run("generate", "--model", "/nonexistent/model", "--log-level", "debug", "hi")
    assert done.returncode == 2
    assert "Traceback" in done.stderr and done.stderr.rstrip().endswith("(org/name)")


def test_ctrl_c_during_generate_is_one_line():
    # Enough work that generation is still running when the signal arrives.
    prompts = [f"sort: {i} 3 1 2" for i in range(64)]
    proc = subprocess.Popen([sys.executable, "-m", "blockdiff", "generate", "--chat", "--max-tokens", "512",
                             "--ignore-eos", "--max-num-seqs", "64", *prompts],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            # As a command typed in a terminal: a pytest started in the background
                            # ignores SIGINT, and its children would inherit that.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = ""
    while "Generating" not in seen:  # the progress bar: the model is loaded and requests run
        chunk = proc.stderr.read(1)
        assert chunk, f"exited before generating: {seen}"
        seen += chunk
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130
    _check_one_line_error(seen + rest, "error: interrupted")


def test_python_api_refuses_the_same_devices_with_value_error():
    from blockdiff import LLM

    with pytest.raises(ValueError, match="device 'tpu' is not supported: use auto, cpu, cuda or cuda:N"):
        LLM(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"use the cpu device \(--device cpu\)"):
            LLM(device="cuda")
