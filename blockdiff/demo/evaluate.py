"""Task accuracy of a model on held-out demo problems, and the tokens it commits per denoising step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from blockdiff.demo.tasks import TASKS, Problem, is_correct
from blockdiff.llm import LLM
from blockdiff.outputs import RequestOutput
from blockdiff.sampling_params import SamplingParams


@dataclass
class EvalResult:
    correct: dict[str, int] = field(default_factory=dict)  # task -> problems answered right
    total: dict[str, int] = field(default_factory=dict)
    tokens: int = 0  # tokens committed, EOS included, nothing after it
    denoising_steps: int = 0

    def add(self, problem: Problem, right: bool, tokens: int, steps: int) -> None:
        self.correct[problem.task] = self.correct.get(problem.task, 0) + int(right)
        self.total[problem.task] = self.total.get(problem.task, 0) + 1
        self.tokens += tokens
        self.denoising_steps += steps

    @property
    def accuracy(self) -> float:
        return sum(self.correct.values()) / max(1, sum(self.total.values()))

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(1, self.denoising_steps)

    def lines(self) -> list[str]:
        """The report `blockdiff eval` prints; the last line is `accuracy: X.XXX`."""
        out = [
            f"{task}: {self.correct[task] / self.total[task]:.3f} ({self.correct[task]}/{self.total[task]})"
            for task in TASKS
            if task in self.total
        ]
        out.append(f"tokens per denoising step: {self.tokens_per_step:.3f} ({self.tokens} tokens, {self.denoising_steps} steps)")
        out.append(f"accuracy: {self.accuracy:.3f}")
        return out


def per_problem_params(params: SamplingParams, n: int, seed: int) -> list[SamplingParams]:
    """Problem i samples with seed `seed + i`, so a run is reproducible and independent of batching."""
    return [replace(params, seed=seed + i) for i in range(n)]


def score(problems: Sequence[Problem], outputs: Sequence[RequestOutput]) -> EvalResult:
    result = EvalResult()
    for problem, out in zip(problems, outputs, strict=True):
        result.add(problem, is_correct(problem, out.text), len(out.token_ids), out.metrics["denoising_steps"])
    return result


def evaluate(llm: LLM, problems: Sequence[Problem], params: SamplingParams, seed: int = 0) -> EvalResult:
    """Every problem as a one-message chat, all of them in one batched generate call."""
    conversations = [[{"role": "user", "content": p.question}] for p in problems]
    outputs = llm.chat(conversations, per_problem_params(params, len(problems), seed))
    return score(problems, outputs)
