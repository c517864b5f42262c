"""Every shell and Python block of README.md and docs/*.md runs as written, in document order.

Blocks: fenced ```bash / ```sh / ```python, and indented (4-space) blocks, which are shell. Other
fenced blocks (no language, json, text) are samples, not commands. A comment on the line before a
block says more about it:

    <!-- doc-test: skip REASON -->       not run (machine-specific or long); the reason is reported
    <!-- doc-test: text -->              not a command (a formula, a synopsis)
    <!-- doc-test: background -->        a server: started, waited for (/health), stopped at the end
    <!-- doc-test: expect A | B | ... -->  run, and its output must contain A, B, ...

How a command is adapted, and only this: a leading `bash scripts/setup.sh && ` is dropped (the setup
made the interpreter this test runs in, whose bin/ stands in for `.venv/bin/` and leads PATH); the
documented ports become a free one (`--port` is added to a `serve` or `bench serve` line that
names no port);
`/tmp/` paths move into this test's temporary directory.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_process import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL, PYTHON = "shell", "python"
DOC_PORTS = ("8000", "8123")
SETUP = "bash scripts/setup.sh && "
_MARKER = re.compile(r"^<!-- doc-test: (skip|text|background|expect)\b:?\s*(.*?)\s*-->$")
# Documents whose blocks run a benchmark or an evaluation (a minute or more), or start replicas.
SLOW_DOCS = {"README.md", "demo.md", "quickstart.md", "scaling.md", "serving_without_a_gpu.md", "tp.md", "images.md",
             "video.md", "structured_outputs.md", "server.md"}


@dataclasses.dataclass
class Block:
    doc: str
    line: int
    kind: str  # SHELL, PYTHON or "sample"
    code: str
    mode: str = "run"  # run, skip, text, background, expect
    arg: str = ""


def parse(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i, in_list = [], 0, False
    while i < len(lines):
        line = lines[i]
        marker = _marker(lines, i)
        if line.startswith("```"):
            lang = line[3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            kind = {"bash": SHELL, "sh": SHELL, "shell": SHELL, "python": PYTHON}.get(lang, "sample")
            blocks.append(Block(path.name, i + 1, kind, "\n".join(lines[i + 1:end]), *marker))
            i = end + 1
            continue
        if line.startswith("    ") and not in_list and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            code = "\n".join(ln[4:] for ln in lines[i:end]).strip("\n")
            blocks.append(Block(path.name, i + 1, SHELL, code, *marker))
            i = end
            continue
        # Indented lines inside a list item continue the item; they are not code.
        if re.match(r"^([-*]|\d+\.) ", line):
            in_list = True
        elif line.strip() and not line.startswith(" "):
            in_list = False
        i += 1
    return blocks


def _marker(lines: list[str], i: int) -> tuple[str, str]:
    """The marker on the line before the block, or the one before that when a blank line separates
    them (an indented block needs one before it)."""
    before = [ln.strip() for ln in lines[max(0, i - 2):i]][::-1]
    if before and not before[0] and len(before) > 1:
        before = before[1:]
    m = _MARKER.match(before[0]) if before else None
    return (m.group(1), m.group(2)) if m else ("run", "")


class DocSession:
    """Runs one document's blocks: one working directory, one port, one background server at most."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.port = free_port()
        self.server: subprocess.Popen | None = None
        self.log = tmp / "server.log"
        bindir = os.path.dirname(sys.executable)
        self.env = {**os.environ, "PATH": bindir + os.pathsep + os.environ["PATH"], "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.env.pop("BLOCKDIFF_API_KEY", None)
        self.bindir = bindir

    def adapt(self, code: str) -> str:
        code = code.replace(SETUP, "")
        # The documents' /tmp/ paths first: the interpreter's own bin/ may itself lie under /tmp/.
        code = re.sub(r"(?<![\w.])/tmp/", str(self.tmp) + "/", code)
        code = code.replace(".venv/bin/", self.bindir + "/")
        for port in DOC_PORTS:
            code = code.replace(f"127.0.0.1:{port}", f"127.0.0.1:{self.port}").replace(f"--port {port}", f"--port {self.port}")
        # `serve` and `bench serve` lines that leave the port at its default (8000) get the free one.
        code = "\n".join(ln + f" --port {self.port}" if re.search(r"blockdiff (bench )?serve\b", ln)
                         and not re.search(r"--port|--base-url|\\$", ln) else ln for ln in code.splitlines())
        return code

    def run(self, block: Block) -> str:
        code = self.adapt(block.code)
        if block.mode == "background":
            return self.start_server(code)
        cmd = [sys.executable, "-c", code] if block.kind == PYTHON else ["bash", "-e", "-o", "pipefail", "-c", code]
        done = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=900)
        where = f"{block.doc}:{block.line}"
        assert done.returncode == 0, f"{where} failed ({done.returncode}):\n{code}\n{done.stdout}\n{done.stderr}"
        return done.stdout + done.stderr

    def start_server(self, code: str) -> str:
        assert self.server is None, "one background server per document"
        self.server = subprocess.Popen(["bash", "-c", "exec " + code], cwd=ROOT, env=self.env, start_new_session=True,
                                       stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.server.poll() is None, f"server exited:\n{self.log.read_text()}"
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return self.log.read_text()
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"server not ready:\n{self.log.read_text()}")

    def close(self) -> None:
        if self.server is not None:
            try:
                os.killpg(self.server.pid, signal.SIGTERM)
            except ProcessLookupError:  # the server and all it started are gone already
                pass
            self.server.wait(60)


def _doc_param(path: Path):
    marks = [pytest.mark.slow] if path.name in SLOW_DOCS else []
    return pytest.param(path, id=path.name, marks=marks)


@pytest.mark.parametrize("path", [_doc_param(p) for p in DOCS])
def test_doc_blocks_run_as_written(path, tmp_path):
    blocks = parse(path)
    skipped = []
    session = DocSession(tmp_path)
    try:
        for block in blocks:
            if block.kind == "sample" or block.mode == "text":
                continue
            if block.mode == "skip":
                assert block.arg, f"{block.doc}:{block.line}: a skipped block must say why"
                skipped.append(f"{block.doc}:{block.line} ({block.arg})")
                continue
            output = session.run(block)
            if block.mode == "expect":
                for wanted in (w.strip() for w in block.arg.split("|")):
                    assert wanted in output, f"{block.doc}:{block.line}: {wanted!r} not in its output:\n{output}"
    finally:
        session.close()
    if skipped:
        print(f"skipped in {path.name}: " + "; ".join(skipped))


def test_parser_finds_every_kind_of_block(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("Text\n\n    echo one\n\n- item\n\n    continued item\n\n<!-- doc-test: expect a | b -->\n```python\n"
                   "print('a b')\n```\n\n```json\n{}\n```\n\n<!-- doc-test: skip needs a GPU -->\n```bash\nnvidia-smi\n```\n")
    got = [(b.kind, b.code, b.mode, b.arg) for b in parse(doc)]
    assert got == [(SHELL, "echo one", "run", ""), (PYTHON, "print('a b')", "expect", "a | b"),
                   ("sample", "{}", "run", ""), (SHELL, "nvidia-smi", "skip", "needs a GPU")]
